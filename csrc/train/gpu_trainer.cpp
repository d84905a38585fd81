#include "train/gpu_trainer.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "train/trainer.h"

namespace cx::train {

namespace {

using u64 = unsigned long long;

double scalar(const nn::StateDict& sd, const char* k) {
  auto it = sd.scalars.find(k);
  CX_CHECK(it != sd.scalars.end(), InvalidArgument, "optimizer state lacks '", k, "'");
  return it->second;
}

}  // namespace

GpuTrainer::GpuTrainer(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                       std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                       const DDPConfig& cfg, const DistributedDataParallel& host_ddp)
    : model_(std::move(model)), loss_(std::move(loss)), opt_(std::move(opt)), group_(std::move(group)) {
  const nn::Loss* l = loss_.get();
  CX_CHECK(dynamic_cast<const nn::CrossEntropyLoss*>(l) || dynamic_cast<const nn::MSELoss*>(l) ||
               dynamic_cast<const nn::BCEWithLogitsLoss*>(l),
           TypeMismatch, "DistributedTrainer: unsupported loss ", l->repr());
  dev_ = std::make_unique<gpu::Device>(group_->config().local_rank);
  gm_ = std::make_unique<gpu::GpuModel>(model_, *dev_);
  read_optimizer();
  stats_.reserve(4 * sizeof(double));

  // The host DDP's buckets (made from the same config and layout), so both
  // backends cut the gradients the same way.
  buckets_ = host_ddp.buckets();
  bucket_of_.resize(gm_->slices().size());
  for (size_t p = 0; p < bucket_of_.size(); ++p) bucket_of_[p] = host_ddp.bucket_of(p);
  pending_.assign(buckets_.size(), 0);
  ready_.assign(buckets_.size(), 0);

  if (cfg.broadcast_parameters) {  // a no-op at world size 1, run anyway: one code path
    // Rank 0's parameters and BatchNorm statistics, on the device, then into the host model.
    auto s = reinterpret_cast<uintptr_t>(dev_->stream());
    group_->broadcast(gm_->params(), gm_->size(), distributed::DataType::kFloat32, 0, false, s);
    for (auto [p, n] : gm_->buffers()) group_->broadcast(p, n, distributed::DataType::kFloat32, 0, false, s);
    gm_->download();
  }
}

GpuTrainer::~GpuTrainer() {
  try {
    dev_->make_current();
    for (auto& w : in_flight_) w->wait();
  } catch (...) {
    // The group is poisoned; its next user sees why.
  }
}

std::string GpuTrainer::describe() const {
  return detail::concat("cuda:", dev_->ordinal(), " (", dev_->name(), "), GEMM: ", dev_->gemm_backend());
}

// ---- optimizer ---------------------------------------------------------------------

void GpuTrainer::read_optimizer() {
  nn::StateDict sd = opt_->state_dict();
  const size_t n = gm_->size();
  auto load = [&](gpu::Buffer& b, const char* name, bool needed) {
    auto it = sd.arrays.find(name);
    if (it != sd.arrays.end()) {
      CX_CHECK(it->second.size() == n, InvalidArgument, opt_->type_name(), "Optimizer: its state was built for ",
               it->second.size(), " parameters, this model has ", n, "; use one optimizer per model");
      b.reserve(n * sizeof(float));
      dev_->upload(b.get(), it->second.data(), n * sizeof(float));
      return true;
    }
    if (!needed) return false;
    b.reserve(n * sizeof(float));
    dev_->zero(b.get(), n * sizeof(float));
    return true;
  };
  t_ = static_cast<int64_t>(scalar(sd, "step"));
  if (sd.type == "SGD") {
    kind_ = Opt::kSgd;
    momentum_ = scalar(sd, "momentum");
    nesterov_ = scalar(sd, "nesterov") != 0.0;
    weight_decay_ = scalar(sd, "weight_decay");
    has_s1_ = load(s1_, "momentum_buffer", momentum_ != 0.0);
  } else if (sd.type == "Adam" || sd.type == "AdamW") {
    kind_ = sd.type == "Adam" ? Opt::kAdam : Opt::kAdamW;
    // Hyper-parameters: AdamOptimizer::step_factors reads them at each step.
    CX_CHECK(dynamic_cast<const nn::AdamOptimizer*>(opt_.get()), TypeMismatch, "DistributedTrainer: ", opt_->repr(),
             " says it is ", sd.type, " but is not an AdamOptimizer");
    has_s1_ = load(s1_, "exp_avg", true);
    has_s2_ = load(s2_, "exp_avg_sq", true);
  } else if (sd.type == "RMSprop") {
    kind_ = Opt::kRmsprop;
    alpha_ = scalar(sd, "alpha");
    eps_ = scalar(sd, "eps");
    weight_decay_ = scalar(sd, "weight_decay");
    momentum_ = scalar(sd, "momentum");
    has_s1_ = load(s1_, "square_avg", true);
    has_s2_ = load(s2_, "momentum_buffer", momentum_ != 0.0);
  } else {
    CX_THROW(TypeMismatch, "DistributedTrainer: the ", sd.type, " optimizer has no GPU update");
  }
  dev_->sync();
}

void GpuTrainer::optimizer_step() {
  ++t_;
  const double lr = opt_->lr();  // read every step: a scheduler may have changed it
  const u64 n = gm_->size();
  float* p = gm_->params();
  const float* g = gm_->grads();
  const unsigned grid = gpu::Device::grid_for(n);
  switch (kind_) {
    case Opt::kSgd: {
      float* buf = momentum_ != 0.0 ? s1_.f() : nullptr;
      dev_->launch(dev_->fn("cx_nn_sgd"), grid, 256, p, g, buf, n, static_cast<float>(lr), static_cast<float>(momentum_),
                   nesterov_ ? 1 : 0, static_cast<float>(weight_decay_));
      break;
    }
    case Opt::kAdam:
    case Opt::kAdamW: {
      const auto f = dynamic_cast<const nn::AdamOptimizer&>(*opt_).step_factors(t_);  // as AdamOptimizer::update
      dev_->launch(dev_->fn("cx_nn_adam"), grid, 256, p, g, s1_.f(), s2_.f(), n, f.beta1, f.beta2, f.eps, f.step_size,
                   f.inv_bc2_sqrt, f.l2, f.decay);
      break;
    }
    case Opt::kRmsprop: {
      float* buf = momentum_ != 0.0 ? s2_.f() : nullptr;
      dev_->launch(dev_->fn("cx_nn_rmsprop"), grid, 256, p, g, s1_.f(), buf, n, static_cast<float>(lr),
                   static_cast<float>(alpha_), static_cast<float>(eps_), static_cast<float>(momentum_),
                   static_cast<float>(weight_decay_));
      break;
    }
  }
}

// ---- host sync ---------------------------------------------------------------------

void GpuTrainer::to_host() {
  dev_->make_current();
  for (auto& w : in_flight_) w->wait();
  in_flight_.clear();
  gm_->download();
  nn::StateDict sd = opt_->state_dict();  // hyper-parameters and lr as the host has them
  sd.scalars["step"] = static_cast<double>(t_);
  sd.arrays.clear();
  const size_t n = gm_->size();
  auto get = [&](gpu::Buffer& b, const char* name) {
    std::vector<float> v(n);
    dev_->download(v.data(), b.get(), n * sizeof(float));
    sd.arrays[name] = std::move(v);
  };
  if (t_ > 0) {
    switch (kind_) {
      case Opt::kSgd:
        if (has_s1_) get(s1_, "momentum_buffer");
        break;
      case Opt::kAdam:
      case Opt::kAdamW:
        get(s1_, "exp_avg");
        get(s2_, "exp_avg_sq");
        break;
      case Opt::kRmsprop:
        get(s1_, "square_avg");
        if (has_s2_) get(s2_, "momentum_buffer");
        break;
    }
  }
  opt_->load_state_dict(sd);
}

void GpuTrainer::from_host() {
  dev_->make_current();
  for (auto& w : in_flight_) w->wait();
  in_flight_.clear();
  gm_->upload();
  read_optimizer();
}

// ---- one step ----------------------------------------------------------------------

void GpuTrainer::upload_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels, const float* dense,
                              const nn::Shape& y_shape) {
  const size_t nx = nn::numel(x_shape);
  x_.reserve(nx * sizeof(float));
  dev_->upload(x_.get(), x, nx * sizeof(float));
  if (labels) {
    labels_.reserve(x_shape[0] * sizeof(int64_t));
    dev_->upload(labels_.get(), labels, x_shape[0] * sizeof(int64_t));
  } else {
    const size_t ny = nn::numel(y_shape);
    dense_.reserve(ny * sizeof(float));
    dev_->upload(dense_.get(), dense, ny * sizeof(float));
  }
}

void GpuTrainer::launch_loss(const nn::Shape& os, const int64_t* labels, const nn::Shape& y_shape) {
  const size_t rows = os[0], numel = nn::numel(os);
  gout_.reserve(numel * sizeof(float));
  dev_->zero(stats_.get(), 4 * sizeof(double));
  const float* o = last_out_;  // the forward's output
  auto* stats = static_cast<double*>(stats_.get());
  if (dynamic_cast<nn::CrossEntropyLoss*>(loss_.get())) {
    CX_CHECK(os.size() == 2, InvalidArgument, "CrossEntropyLoss: expected output of shape (batch, classes), got ",
             nn::shape_str(os));
    const unsigned grid = static_cast<unsigned>((rows + 7) / 8);  // a warp per row
    if (labels) {
      for (size_t r = 0; r < rows; ++r)  // as CrossEntropyLoss::forward checks them, on the host copy
        CX_CHECK(labels[r] >= 0 && static_cast<size_t>(labels[r]) < os[1], InvalidArgument, "CrossEntropyLoss: label ",
                 labels[r], " at row ", r, " is out of range [0, ", os[1], ")");
      dev_->launch(dev_->fn("cx_nn_ce_labels"), grid, 256, o, static_cast<const int64_t*>(labels_.get()), gout_.f(),
                   stats, u64(rows), u64(os[1]));
    } else {
      CX_CHECK(y_shape == os, InvalidArgument, "CrossEntropyLoss: target must have the output's shape ",
               nn::shape_str(os), ", got ", nn::shape_str(y_shape));
      dev_->launch(dev_->fn("cx_nn_ce_dense"), grid, 256, o, static_cast<const float*>(dense_.f()), gout_.f(), stats,
                   u64(rows), u64(os[1]));
    }
    return;
  }
  CX_CHECK(!labels, TypeMismatch, "DistributedTrainer: ", loss_->repr(),
           " needs float32 targets shaped like the model's output, got integer labels");
  CX_CHECK(y_shape == os, InvalidArgument, loss_->repr(), ": target must have the output's shape ", nn::shape_str(os),
           ", got ", nn::shape_str(y_shape));
  const bool mse = dynamic_cast<nn::MSELoss*>(loss_.get()) != nullptr;
  dev_->launch(dev_->fn(mse ? "cx_nn_mse" : "cx_nn_bce"), gpu::Device::grid_for(numel), 256, o,
               static_cast<const float*>(dense_.f()), gout_.f(), stats, u64(numel));
}

BatchStats GpuTrainer::read_loss(const nn::Shape& os) {
  double st[4] = {0, 0, 0, 0};
  dev_->download(st, stats_.get(), sizeof(st));  // waits for the step
  const size_t rows = os[0], numel = nn::numel(os);
  BatchStats s;
  s.count = static_cast<double>(rows);
  if (dynamic_cast<nn::CrossEntropyLoss*>(loss_.get())) {
    s.loss_sum = st[0];
    s.correct = st[1];
  } else {
    // MSE and BCE average over elements: the batch's loss times its rows, as TrainerCore sums it.
    s.loss_sum = st[0] / static_cast<double>(numel) * static_cast<double>(rows);
    s.correct = dynamic_cast<nn::MSELoss*>(loss_.get()) ? std::numeric_limits<double>::quiet_NaN()
                                                         : st[1] / static_cast<double>(numel / rows ? numel / rows : 1);
  }
  return s;
}

void GpuTrainer::launch_bucket(size_t b) {
  const Bucket& bk = buckets_[b];
  if (bk.count)  // world size 1 too, as DistributedDataParallel: one code path
    in_flight_.push_back(group_->all_reduce(gm_->grads() + bk.offset, bk.count, distributed::DataType::kFloat32,
                                            distributed::ReduceOp::kAvg, true, reinterpret_cast<uintptr_t>(dev_->stream())));
}

BatchStats GpuTrainer::train_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels,
                                   const float* dense, const nn::Shape& y_shape) {
  dev_->make_current();
  upload_batch(x, x_shape, labels, dense, y_shape);
  last_out_ = gm_->forward(x_.f(), x_shape, true);
  const nn::Shape os = gm_->output_shape();
  launch_loss(os, labels, y_shape);
  // Note [First step of a shape]: the first backward of a batch shape makes the
  // driver load kernels (ours lazily, cuBLAS's for these sizes), which may wait
  // for the whole context; with an NCCL kernel already waiting on peers that
  // could stall. So for a new shape the buckets go out after backward has run.
  const bool overlap = shapes_seen_.count(x_shape[0]) > 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = buckets_[b].last_param - buckets_[b].first_param + 1;
    ready_[b] = 0;
  }
  next_bucket_ = 0;
  gm_->backward(gout_.f(), [this, overlap](size_t p) {
    size_t b = bucket_of_[p];
    if (--pending_[b] == 0) ready_[b] = 1;
    while (overlap && next_bucket_ < buckets_.size() && ready_[next_bucket_]) launch_bucket(next_bucket_++);
  });
  if (!overlap) {
    dev_->sync();
    shapes_seen_.insert(x_shape[0]);
  }
  while (next_bucket_ < buckets_.size()) launch_bucket(next_bucket_++);
  std::vector<distributed::ProcessGroup::WorkPtr> works;
  works.swap(in_flight_);
  for (auto& w : works) w->wait();  // each returns once NCCL's result is in the buffer
  optimizer_step();
  gm_->zero_grad();
  return read_loss(os);
}

BatchStats GpuTrainer::eval_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels, const float* dense,
                                  const nn::Shape& y_shape) {
  dev_->make_current();
  upload_batch(x, x_shape, labels, dense, y_shape);
  last_out_ = gm_->forward(x_.f(), x_shape, false);
  const nn::Shape os = gm_->output_shape();
  launch_loss(os, labels, y_shape);
  return read_loss(os);
}

BatchStats GpuTrainer::reduce_stats(const BatchStats& s) {
  double v[3] = {s.loss_sum, s.correct, s.count};
  {
    dev_->make_current();
    staging_.reserve(sizeof(v));
    dev_->upload(staging_.get(), v, sizeof(v));
    group_->all_reduce(staging_.get(), 3, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false,
                       reinterpret_cast<uintptr_t>(dev_->stream()));
    dev_->download(v, staging_.get(), sizeof(v));
  }
  return BatchStats{v[0], v[1], v[2]};
}

void GpuTrainer::all_gather_host(const void* in, void* out, size_t bytes) {
  const int world = group_->size();
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes * (world + 1));
  char* base = static_cast<char*>(staging_.get());
  dev_->upload(base, in, bytes);
  std::vector<void*> outs;
  for (int r = 0; r < world; ++r) outs.push_back(base + bytes * (r + 1));
  group_->all_gather(base, outs, bytes, distributed::DataType::kUInt8, false, reinterpret_cast<uintptr_t>(dev_->stream()));
  dev_->download(out, base + bytes, bytes * world);
}

void GpuTrainer::broadcast_host(void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes);
  dev_->upload(staging_.get(), buf, bytes);
  group_->broadcast(staging_.get(), bytes, distributed::DataType::kUInt8, root, false,
                    reinterpret_cast<uintptr_t>(dev_->stream()));
  dev_->download(buf, staging_.get(), bytes);
}

}  // namespace cx::train
