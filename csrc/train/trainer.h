// defines: TrainerCore, the C++ side of DistributedTrainer: gathers a batch's
// rows and hands them to its Engine (engine.h: forward, loss, backward with the
// overlapped bucket all-reduce, optimizer step, on the host or on the GPU).
// One call per batch from Python; the epoch loop, printing and checkpoint files
// live in python/pycyxwiz/distributed/_train.py.
//
// Reported metrics are sums (loss * rows, correct rows, rows) so that a
// sample-weighted global mean is one SUM all-reduce away (reduce_stats).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "nn/loss.h"
#include "nn/optimizer.h"
#include "nn/sequential.h"
#include "train/ddp.h"
#include "train/cpu_engine.h"
#include "train/engine.h"
#include "train/grad_clip.h"
#include "train/sampler.h"
#include "train/zero.h"

namespace cx::train {

// A view of the targets of a whole data set: class labels or dense float rows.
struct Targets {
  enum class Kind { kInt64, kInt32, kFloat32 } kind = Kind::kInt64;
  const void* data = nullptr;
  size_t rows = 0;  // rows of y; a sample index must be below both these and X's rows
  nn::Shape row_shape;  // per-row shape of dense targets ({} for labels)
};

class TrainerCore {
 public:
  TrainerCore(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
              std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group, DDPConfig cfg);
  ~TrainerCore();

  // Trains on the iterator's next batch of rows of (X, y): one optimizer step.
  BatchStats train_batch(const float* X, const nn::Shape& x_shape, const Targets& y, DistributedBatchIterator& it);
  // Trains on all of (X, y), a batch a cx.data.Dataset made: one optimizer step. The rows
  // are read where they are (the CPU engine) or copied once into the engine's buffer.
  BatchStats train_rows(const float* X, const nn::Shape& x_shape, const Targets& y);
  // Loss/correct sums of rows [begin, end) in eval mode, in chunks of batch rows.
  BatchStats evaluate(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin, size_t end,
                      size_t batch);
  // SUM over ranks, in float64.
  BatchStats reduce_stats(const BatchStats& s) { return engine_->reduce_stats(s); }
  // Collective: the global sums over all rows of (X, y). Rank r of p evaluates the contiguous shard
  // [n*r/p, n*(r+1)/p), no padding, so every sample is counted exactly once; then reduce_stats.
  BatchStats evaluate_all(const float* X, const nn::Shape& x_shape, const Targets& y, size_t batch);

  // The model's device when the group's backend is NCCL ("" on the CPU).
  std::string device() const { return engine_->describe(); }
  // GPU training keeps parameters and optimizer state on the device: these copy
  // them to the host objects and back (no-ops on the CPU).
  void sync_to_host() { engine_->to_host(); }
  void sync_from_host() { engine_->from_host(); }
  // Collective: rank 0's module buffers to every rank if the DDPConfig's
  // broadcast_buffers (fit calls it at the end of every epoch: Note [Buffers
  // across ranks] in ddp.h); nothing otherwise.
  void sync_buffers();
  // Collectives over host bytes for the trainer's bookkeeping (RNG states,
  // checkpoints), which work on either backend.
  void all_gather_host(const void* in, void* out, size_t bytes) { engine_->all_gather_host(in, out, bytes); }
  void broadcast_host(void* buf, size_t bytes, int root) { engine_->broadcast_host(buf, bytes, root); }

  // Collective: "" when every rank holds the same parameters, else which ones
  // differ on which ranks (DistributedDataParallel::parameter_report), read from
  // the host objects (brought up to date first).
  std::string parameter_report() {
    engine_->to_host();
    return ddp_->parameter_report();
  }

  // Collective: ZeRO-1 on or off (DistributedTrainingConfig.shard_optimizer_state;
  // Note [ZeRO-1] in zero.h). Turning it on cuts the optimizer's state to this
  // rank's shard, off gathers it whole again. On the GPU: Note [ZeRO-1 on the GPU] in gpu_engine.cpp.
  void set_shard_optimizer_state(bool on);
  bool shard_optimizer_state() const;
  // DistributedTrainingConfig.grad_clip_norm / grad_clip_value (0: off; grad_clip.h), for
  // every step from now on, on either engine.
  void set_grad_clip(const GradClip& clip);
  // cx.callbacks.EMA: `shadow` (one float per parameter, kept alive by the caller until
  // clear_ema) follows decay * shadow + (1 - decay) * params after every step, its
  // update settled lazily (Note [EMA off the critical path] in ema.h): settle_ema()
  // before reading a shadow or writing the parameters between steps. On the GPU:
  // Note [EMA on the GPU] in gpu_engine.cpp.
  void add_ema(float* shadow, size_t n, double decay);
  void settle_ema();
  void clear_ema();
  // DistributedTrainingConfig.nonfinite: the DDP's DDPConfig.nonfinite from now on (the GPU engine checks
  // its device gradients by the same mode: Note [Non-finite gradients on the GPU] in gpu_engine.cpp).
  void set_nonfinite(const std::string& mode);
  // DistributedTrainingConfig.matmul_precision ("float32", "tf32", "bf16": Note [GEMM precision] in
  // cuda/blas.cpp), for every GEMM of the model on the GPU from now on, evaluation too. The CPU trainer's GEMMs
  // are float32 only: it refuses the others by name.
  void set_matmul_precision(const std::string& name);
  // The whole optimizer state (collective while sharded): Optimizer::state_dict(into), whose `into` comes
  // back empty while sharded (the gathered state is in fresh arrays); and loading a whole one (each rank
  // keeps its shard while sharded).
  nn::StateDict optimizer_state_dict(std::map<std::string, nn::Optimizer::Destination>& into);
  void load_optimizer_state_dict(const nn::StateDict& sd);
  const std::shared_ptr<ZeroRedundancyOptimizer>& zero() const { return zero_; }

  DistributedDataParallel& ddp() { return *ddp_; }
  const std::shared_ptr<DistributedDataParallel>& ddp_ptr() const { return ddp_; }
  distributed::ProcessGroup& group() { return *group_; }

 private:
  // The gathered batch's targets (n rows), as the loss takes them.
  nn::BatchTargets batch_targets(size_t n) const;
  void gather(const float* X, const nn::Shape& x_shape, const Targets& y, const int64_t* idx, size_t n);
  void gather_targets(const Targets& y, const int64_t* idx, size_t n);
  void slice(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin, size_t n);

  std::shared_ptr<nn::SequentialModel> model_;
  std::shared_ptr<nn::Loss> loss_;
  std::shared_ptr<nn::Optimizer> opt_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::shared_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<Engine> engine_;  // CpuEngine, or GpuEngine with the NCCL backend
  CpuEngine* cpu_engine_ = nullptr;  // engine_ when it is a CpuEngine
  std::shared_ptr<ZeroRedundancyOptimizer> zero_;
  std::vector<float> x_;          // gathered input rows, where the engine has no buffer for them
  const float* xb_ = nullptr;     // the gathered rows: x_ or the engine's input_buffer
  std::vector<int64_t> y_labels_;  // gathered labels (int32 labels widened)
  std::vector<float> y_dense_;    // gathered dense targets
  const int64_t* yl_ = nullptr;   // the batch's labels: y_labels_ or the caller's (train_rows)
  const float* yd_ = nullptr;     // the batch's dense targets: y_dense_ or the caller's
  nn::Shape xb_shape_, yb_shape_;
  Targets::Kind y_kind_ = Targets::Kind::kInt64;
};

}  // namespace cx::train
