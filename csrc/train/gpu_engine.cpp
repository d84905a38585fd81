#include "train/gpu_engine.h"

#include "common/error.h"
#include "train/buffer_sync.h"

namespace cx::train {

namespace {
uintptr_t stream_id(const cuda::Device& dev) { return reinterpret_cast<uintptr_t>(dev.stream()); }

// Every layer must have GPU code (a SyncBatchNormModule has none yet): asked
// before a GPU is touched, so every rank refuses at trainer construction.
std::unique_ptr<cuda::Device> open_device(const nn::SequentialModel& model, const distributed::ProcessGroup& group) {
  nn::check_runs_on_gpu(model);
  return std::make_unique<cuda::Device>(group.config().local_rank);
}
}  // namespace

GpuEngine::GpuEngine(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                       std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                       const DDPConfig& cfg, const DistributedDataParallel& host_ddp)
    : dev_(open_device(*model, *group)),
      model_(std::move(model)),
      loss_(std::move(loss)),
      opt_(std::move(opt)),
      group_(std::move(group)),
      sched_(host_ddp.buckets(), model_->param_slices().size(), [this](size_t b) { launch_bucket(b); }),
      broadcast_buffers_(cfg.broadcast_buffers) {
  dm_ = std::make_unique<nn::DeviceModel>(model_, *dev_);
  opt_state_ = opt_->to_device(*dev_, dm_->size());
  stats_.reserve(4 * sizeof(double));
  if (cfg.broadcast_parameters) {  // a no-op at world size 1, run anyway: one code path
    // Rank 0's parameters and BatchNorm statistics, on the device, then into the host model.
    group_->broadcast(dm_->params(), dm_->size(), distributed::DataType::kFloat32, 0, false, stream_id(*dev_));
    broadcast_buffers();
    dm_->to_host();
  }
}

GpuEngine::~GpuEngine() {
  try {
    dev_->make_current();
    for (auto& w : in_flight_) w->wait();
  } catch (...) {
    // The group is poisoned; its next user sees why.
  }
}

std::string GpuEngine::describe() const {
  return detail::concat("cuda:", dev_->ordinal(), " (", dev_->name(), "), GEMM: ", dev_->gemm_backend());
}

void GpuEngine::wait_in_flight() {
  std::vector<distributed::ProcessGroup::WorkPtr> works;
  works.swap(in_flight_);
  for (auto& w : works) w->wait();  // each returns once NCCL's result is in the buffer
}

// ---- host sync ---------------------------------------------------------------------

void GpuEngine::to_host() {
  dev_->make_current();
  wait_in_flight();
  dm_->to_host();
  opt_->to_host(*dev_, opt_state_);
}

void GpuEngine::from_host() {
  dev_->make_current();
  wait_in_flight();
  dm_->to_device();
  opt_state_ = opt_->to_device(*dev_, dm_->size());
}

// ---- one step ----------------------------------------------------------------------

float* GpuEngine::input_buffer(size_t floats) {
  // The last step's copy from here has completed: each step ends waiting for its loss.
  dev_->make_current();
  host_x_.reserve(floats * sizeof(float));
  return host_x_.f();
}

nn::BatchTargets GpuEngine::upload_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  const size_t nx = nn::numel(x_shape);
  x_.reserve(nx * sizeof(float));
  dev_->upload(x_.get(), x, nx * sizeof(float));
  nn::BatchTargets on_dev;
  on_dev.shape = y.shape;
  if (y.labels) {
    labels_.reserve(y.rows() * sizeof(int64_t));
    dev_->upload(labels_.get(), y.labels, y.rows() * sizeof(int64_t));
    on_dev.labels = static_cast<const int64_t*>(labels_.get());
  } else {
    const size_t ny = nn::numel(y.shape);
    dense_.reserve(ny * sizeof(float));
    dev_->upload(dense_.get(), y.dense, ny * sizeof(float));
    on_dev.dense = dense_.f();
  }
  return on_dev;
}

void GpuEngine::launch_loss(const float* out, const nn::Shape& os, const nn::BatchTargets& y,
                             const nn::BatchTargets& on_dev) {
  gout_.reserve(nn::numel(os) * sizeof(float));
  dev_->zero(stats_.get(), 4 * sizeof(double));
  loss_->forward_batch(*dev_, out, os, y, on_dev, gout_.f(), static_cast<double*>(stats_.get()));
}

BatchStats GpuEngine::read_loss(const nn::Shape& os) {
  double st[4] = {0, 0, 0, 0};
  dev_->download(st, stats_.get(), sizeof(st));  // waits for the step
  const nn::BatchSums sums = loss_->batch_sums(st, os);
  return BatchStats{sums.loss_sum, sums.correct, static_cast<double>(os[0])};
}

void GpuEngine::launch_bucket(size_t b) {
  const Bucket& bk = sched_.buckets()[b];
  if (bk.count)  // world size 1 too, as DistributedDataParallel: one code path
    in_flight_.push_back(group_->all_reduce(dm_->grads() + bk.offset, bk.count, distributed::DataType::kFloat32,
                                            distributed::ReduceOp::kAvg, true, stream_id(*dev_)));
}

BatchStats GpuEngine::train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  dev_->make_current();
  const nn::BatchTargets on_dev = upload_batch(x, x_shape, y);
  if (broadcast_buffers_) broadcast_buffers();  // as DistributedDataParallel::forward in training
  const float* out = dm_->forward(x_.f(), x_shape, true);
  const nn::Shape os = dm_->output_shape();
  launch_loss(out, os, y, on_dev);
  // Note [First step of a shape]: the first backward of a batch shape makes the
  // driver load kernels (ours lazily, cuBLAS's for these sizes), which may wait
  // for the whole context; with an NCCL kernel already waiting on peers that
  // could stall. So for a new shape the buckets go out after backward has run.
  const bool overlap = shapes_seen_.count(x_shape[0]) > 0;
  sched_.start(overlap);
  dm_->backward(gout_.f(), [this](size_t p) { sched_.param_ready(p); });
  if (!overlap) {
    dev_->sync();
    shapes_seen_.insert(x_shape[0]);
  }
  sched_.launch_rest();
  wait_in_flight();
  opt_->step(*dev_, opt_state_, dm_->params(), dm_->grads());
  dm_->zero_grad();
  return read_loss(os);
}

BatchStats GpuEngine::eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  dev_->make_current();
  const nn::BatchTargets on_dev = upload_batch(x, x_shape, y);
  const float* out = dm_->forward(x_.f(), x_shape, false);
  const nn::Shape os = dm_->output_shape();
  launch_loss(out, os, y, on_dev);
  return read_loss(os);
}

BatchStats GpuEngine::reduce_stats(const BatchStats& s) {
  double v[3] = {s.loss_sum, s.correct, s.count};
  dev_->make_current();
  staging_.reserve(sizeof(v));
  dev_->upload(staging_.get(), v, sizeof(v));
  group_->all_reduce(staging_.get(), 3, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false,
                     stream_id(*dev_));
  dev_->download(v, staging_.get(), sizeof(v));
  return BatchStats{v[0], v[1], v[2]};
}

void GpuEngine::all_gather_host(const void* in, void* out, size_t bytes) {
  const int world = group_->size();
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes * (world + 1));
  char* base = static_cast<char*>(staging_.get());
  dev_->upload(base, in, bytes);
  std::vector<void*> outs;
  for (int r = 0; r < world; ++r) outs.push_back(base + bytes * (r + 1));
  group_->all_gather(base, outs, bytes, distributed::DataType::kUInt8, false, stream_id(*dev_));
  dev_->download(out, base + bytes, bytes * world);
}

void GpuEngine::broadcast_buffers() {
  dev_->make_current();
  const std::vector<FloatSpan> spans = dm_->buffers();
  if (total_floats(spans) == 0) return;  // no buffers: no collective, and no device allocation either
  buffer_pack_.reserve(total_floats(spans) * sizeof(float));
  train::broadcast_buffers(*group_, spans, buffer_pack_.f(), [this](float* dst, const float* src, size_t n) {
    dev_->copy(dst, src, n * sizeof(float));
  }, stream_id(*dev_));
}

void GpuEngine::broadcast_host(void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes);
  dev_->upload(staging_.get(), buf, bytes);
  group_->broadcast(staging_.get(), bytes, distributed::DataType::kUInt8, root, false, stream_id(*dev_));
  dev_->download(buf, staging_.get(), bytes);
}

}  // namespace cx::train
