#include "train/trainer.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/error.h"
#include "train/cpu_engine.h"
#include "train/gpu_engine.h"

namespace cx::train {

namespace {
// dst row i = X row idx[i], rows of `row` floats, on `threads` threads.
void copy_rows(float* dst, const float* X, const int64_t* idx, size_t n, size_t row, unsigned threads) {
  auto part = [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      std::memcpy(dst + i * row, X + static_cast<size_t>(idx[i]) * row, row * sizeof(float));
    }
  };
  if (threads <= 1) return part(0, n);
  std::vector<std::thread> pool;
  const size_t per = (n + threads - 1) / threads;
  for (unsigned t = 1; t < threads && t * per < n; ++t) pool.emplace_back(part, t * per, std::min(n, (t + 1) * per));
  part(0, std::min(n, per));
  for (auto& th : pool) th.join();
}
}  // namespace

TrainerCore::TrainerCore(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                         std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                         DDPConfig cfg)
    : model_(std::move(model)), loss_(std::move(loss)), opt_(std::move(opt)), group_(std::move(group)) {
  CX_CHECK(model_ != nullptr, InvalidArgument, "DistributedTrainer: model is None");
  CX_CHECK(loss_ != nullptr, InvalidArgument, "DistributedTrainer: loss_fn is None");
  CX_CHECK(opt_ != nullptr, InvalidArgument, "DistributedTrainer: optimizer is None");
  CX_CHECK(model_->num_parameters() > 0, InvalidArgument,
           "DistributedTrainer: the model has no parameters; add() layers before creating the trainer");
  if (group_->config().backend == distributed::BackendType::kNccl) {
    // Note [The model on the GPU] (gpu_engine.h): the host DDP keeps its
    // bookkeeping (rank, per-rank dropout streams) but moves no data; the GPU
    // engine broadcasts rank 0's parameters on the device.
    // The GPU engine has the fp16/bf16 hooks (Note [The GPU trainer's clipping and 16-bit buckets] in
    // gpu_engine.cpp), not PowerSGD. Refused before a GPU is touched, on every rank alike.
    const CommHookKind hook = parse_comm_hook(cfg.comm_hook, "DistributedTrainer: DDPConfig.comm_hook");
    CX_CHECK(hook != CommHookKind::kPowerSgd, InvalidArgument, "DistributedTrainer (rank ", group_->rank(),
             "): DDPConfig.comm_hook = '", comm_hook_name(hook), "' is not supported on the GPU (cuda:",
             group_->config().local_rank, ", BackendType.NCCL): the GPU engine all-reduces float32 gradients "
             "with NCCL, or 16-bit ones with 'fp16' or 'bf16'. Use one of those with the NCCL backend, or train "
             "on the CPU backend to use PowerSGD");
    DDPConfig host_cfg = cfg;
    host_cfg.broadcast_parameters = false;
    // host_cfg.nonfinite stays: the host DDP moves no gradients, but its mode, counters and messages are the
    // GPU engine's (Note [Non-finite gradients on the GPU] in gpu_engine.cpp).
    ddp_ = std::make_shared<DistributedDataParallel>(model_, host_cfg, group_);
    ddp_->refuse_comm_hooks(detail::concat("is not supported on the GPU (cuda:", group_->config().local_rank,
                                           ", BackendType.NCCL): the trainer's GPU engine reduces the gradients "
                                           "as the DDPConfig it was built with says, not this host object; pass "
                                           "comm_hook = 'fp16' or 'bf16' in that DDPConfig, or use the CPU backend"));
    engine_ = std::make_unique<GpuEngine>(model_, loss_, opt_, group_, cfg, ddp_);
    ddp_->set_host_gather([e = engine_.get()](const void* in, void* out, size_t n) { e->all_gather_host(in, out, n); });
  } else {
    ddp_ = std::make_shared<DistributedDataParallel>(model_, cfg, group_);
    auto cpu = std::make_unique<CpuEngine>(model_, loss_, opt_, group_, ddp_);
    cpu_engine_ = cpu.get();
    engine_ = std::move(cpu);
  }
}

void TrainerCore::set_nonfinite(const std::string& mode) {
  ddp_->set_nonfinite(mode);  // the GPU engine reads it too
}

void TrainerCore::set_matmul_precision(const std::string& name) {
  const cuda::GemmPrecision p = cuda::gemm_precision_from_name(name);
  if (cpu_engine_) {
    CX_CHECK(p == cuda::GemmPrecision::kFloat32, InvalidArgument, "DistributedTrainer (rank ", group_->rank(),
             "): matmul_precision='", name, "' rounds the inputs of the GPU's matrix products (cuBLAS, "
             "BackendType.NCCL); the CPU trainer's are float32 only. Set DistributedTrainingConfig.matmul_precision "
             "= 'float32', or train on the GPU");
    return;
  }
  static_cast<GpuEngine&>(*engine_).set_matmul_precision(p);
}

bool TrainerCore::shard_optimizer_state() const {
  return cpu_engine_ ? zero_ != nullptr : static_cast<const GpuEngine&>(*engine_).zero();
}

void TrainerCore::set_shard_optimizer_state(bool on) {
  if (!cpu_engine_) return static_cast<GpuEngine&>(*engine_).set_zero(on);  // Note [ZeRO-1 on the GPU]
  if (on == (zero_ != nullptr)) return;
  if (on) {
    zero_ = std::make_shared<ZeroRedundancyOptimizer>(ddp_, opt_);
    cpu_engine_->set_zero(zero_);
  } else {
    nn::StateDict whole = zero_->state_dict();
    cpu_engine_->set_zero(nullptr);
    zero_.reset();
    opt_->load_state_dict(whole);
  }
}

void TrainerCore::set_grad_clip(const GradClip& clip) {
  check_grad_clip(clip);
  if (cpu_engine_)
    cpu_engine_->set_grad_clip(clip);
  else
    static_cast<GpuEngine&>(*engine_).set_grad_clip(clip);
}

void TrainerCore::add_ema(float* shadow, size_t n, double decay) {
  CX_CHECK(n == model_->num_parameters(), InvalidArgument, "EMA: the average holds ", n,
           " weights but the model has ", model_->num_parameters(), " parameters");
  CX_CHECK(decay > 0.0 && decay < 1.0, InvalidArgument, "EMA: decay must be in (0, 1), got ", decay);
  if (cpu_engine_)
    cpu_engine_->averages().add(shadow, n, decay);
  else
    static_cast<GpuEngine&>(*engine_).add_ema(shadow, n, decay);  // Note [EMA on the GPU] in gpu_engine.cpp
}

void TrainerCore::settle_ema() {
  if (cpu_engine_)
    cpu_engine_->averages().settle(model_->flat_params());
  else
    static_cast<GpuEngine&>(*engine_).settle_ema();
}

void TrainerCore::clear_ema() {
  if (cpu_engine_)
    cpu_engine_->averages().clear();
  else
    static_cast<GpuEngine&>(*engine_).clear_ema();
}

nn::StateDict TrainerCore::optimizer_state_dict(std::map<std::string, nn::Optimizer::Destination>& into) {
  engine_->to_host();
  if (!shard_optimizer_state()) return opt_->state_dict(into);
  into.clear();
  return zero_ ? zero_->state_dict() : static_cast<GpuEngine&>(*engine_).zero_state_dict();
}

void TrainerCore::load_optimizer_state_dict(const nn::StateDict& sd) {
  if (zero_)
    zero_->load_state_dict(sd);
  else if (shard_optimizer_state())
    static_cast<GpuEngine&>(*engine_).zero_load_state_dict(sd);
  else
    opt_->load_state_dict(sd);
}

TrainerCore::~TrainerCore() {
  if (ddp_) ddp_->set_host_gather(nullptr);  // Python may keep trainer.ddp; the engine goes now
}

void TrainerCore::sync_buffers() {
  if (ddp_->config().broadcast_buffers) engine_->broadcast_buffers();
}

void TrainerCore::gather(const float* X, const nn::Shape& x_shape, const Targets& y, const int64_t* idx, size_t n) {
  size_t row = nn::numel(x_shape) / (x_shape[0] ? x_shape[0] : 1);
  size_t rows = std::min(x_shape[0], y.rows);
  xb_shape_ = x_shape;
  xb_shape_[0] = n;
  for (size_t i = 0; i < n; ++i) {
    CX_CHECK(idx[i] >= 0 && static_cast<size_t>(idx[i]) < rows, InvalidArgument, "DistributedTrainer: sample index ",
             idx[i], " is out of range for ", rows, " rows; was the sampler built for another data set?");
  }
  float* dst = engine_->input_buffer(n * row);
  // The GPU engine's host is idle while the device computes, so a large batch is
  // gathered by several threads; ranks training on the CPU keep their cores.
  const unsigned threads = dst && n * row * sizeof(float) >= (4u << 20)
                               ? std::min(8u, std::max(1u, std::thread::hardware_concurrency()))
                               : 1u;
  if (!dst) {
    x_.resize(n * row);
    dst = x_.data();
  }
  xb_ = dst;
  copy_rows(dst, X, idx, n, row, threads);
  gather_targets(y, idx, n);
}

// idx null: rows 0..n-1, read in place where the loss can take them as they are.
void TrainerCore::gather_targets(const Targets& y, const int64_t* idx, size_t n) {
  auto at = [idx](size_t i) { return idx ? static_cast<size_t>(idx[i]) : i; };
  y_kind_ = y.kind;
  if (y.kind == Targets::Kind::kFloat32) {
    yb_shape_ = {n};
    yb_shape_.insert(yb_shape_.end(), y.row_shape.begin(), y.row_shape.end());
    if (!idx) {
      yd_ = static_cast<const float*>(y.data);
      return;
    }
    size_t yr = nn::numel(y.row_shape);
    y_dense_.resize(n * yr);
    for (size_t i = 0; i < n; ++i)
      std::memcpy(y_dense_.data() + i * yr, static_cast<const float*>(y.data) + at(i) * yr, yr * sizeof(float));
    yd_ = y_dense_.data();
  } else if (y.kind == Targets::Kind::kInt64 && !idx) {
    yl_ = static_cast<const int64_t*>(y.data);
  } else {
    y_labels_.resize(n);
    for (size_t i = 0; i < n; ++i)
      y_labels_[i] = y.kind == Targets::Kind::kInt64 ? static_cast<const int64_t*>(y.data)[at(i)]
                                                     : static_cast<const int32_t*>(y.data)[at(i)];
    yl_ = y_labels_.data();
  }
}

void TrainerCore::slice(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin, size_t n) {
  std::vector<int64_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = static_cast<int64_t>(begin + i);
  gather(X, x_shape, y, idx.data(), n);
}

nn::BatchTargets TrainerCore::batch_targets(size_t n) const {
  nn::BatchTargets t;
  if (y_kind_ == Targets::Kind::kFloat32) {
    t.dense = yd_;
    t.shape = yb_shape_;
  } else {
    t.labels = yl_;
    t.shape = {n};
  }
  return t;
}

BatchStats TrainerCore::train_batch(const float* X, const nn::Shape& x_shape, const Targets& y,
                                    DistributedBatchIterator& it) {
  auto [idx, n] = it.next_view();
  BatchStats s;
  if (n == 0) return s;
  gather(X, x_shape, y, idx, n);
  return engine_->train_batch(xb_, xb_shape_, batch_targets(n));
}

BatchStats TrainerCore::train_rows(const float* X, const nn::Shape& x_shape, const Targets& y) {
  const size_t n = x_shape.empty() ? 0 : x_shape[0];
  CX_CHECK(y.rows == n, InvalidArgument, "DistributedTrainer: a batch of ", n, " input rows has ", y.rows,
           " targets; they must match");
  if (n == 0) return BatchStats();
  const size_t row = nn::numel(x_shape) / n;
  float* dst = engine_->input_buffer(n * row);
  if (dst) {
    std::memcpy(dst, X, n * row * sizeof(float));
    xb_ = dst;
  } else {
    xb_ = X;  // the CPU engine reads the caller's rows in place
  }
  xb_shape_ = x_shape;
  gather_targets(y, nullptr, n);
  return engine_->train_batch(xb_, xb_shape_, batch_targets(n));
}

BatchStats TrainerCore::evaluate(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin,
                                 size_t end, size_t batch) {
  BatchStats s;
  bool was_training = model_->training();
  model_->eval();
  try {
    for (size_t b = begin; b < end; b += batch) {
      size_t n = std::min(batch, end - b);
      slice(X, x_shape, y, b, n);
      BatchStats e = engine_->eval_batch(xb_, xb_shape_, batch_targets(n));
      s.loss_sum += e.loss_sum, s.correct += e.correct, s.count += e.count;
    }
  } catch (...) {
    model_->train(was_training);
    throw;
  }
  model_->train(was_training);
  return s;
}

BatchStats TrainerCore::evaluate_all(const float* X, const nn::Shape& x_shape, const Targets& y, size_t batch) {
  CX_CHECK(batch >= 1, InvalidArgument, "DistributedTrainer.evaluate: batch_size must be >= 1");
  const size_t n = x_shape[0];
  const size_t p = static_cast<size_t>(group_->size()), r = static_cast<size_t>(group_->rank());
  return reduce_stats(evaluate(X, x_shape, y, n * r / p, n * (r + 1) / p, batch));
}

}  // namespace cx::train
