// defines: CpuEngine, the trainer's per-batch work on the host: forward (with
// rank 0's buffers broadcast first), the loss, backward with the overlapped
// bucket all-reduce (DistributedDataParallel), clipping the averaged gradient
// where asked (grad_clip.h), the optimizer's step, and the EMAs of the
// parameters (ema.h).
#pragma once

#include <memory>

#include "distributed/process_group.h"
#include "nn/loss.h"
#include "nn/optimizer.h"
#include "nn/sequential.h"
#include "train/ddp.h"
#include "train/ema.h"
#include "train/engine.h"
#include "train/grad_clip.h"
#include "train/zero.h"

namespace cx::train {

class CpuEngine : public Engine {
 public:
  CpuEngine(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
            std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
            std::shared_ptr<DistributedDataParallel> ddp);

  BatchStats train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) override;
  BatchStats eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) override;
  BatchStats reduce_stats(const BatchStats& s) override;
  void all_gather_host(const void* in, void* out, size_t bytes) override;
  void broadcast_host(void* buf, size_t bytes, int root) override;
  void broadcast_buffers() override;
  // ZeRO-1 (Note [ZeRO-1] in zero.h): steps go through it while set; null: the plain optimizer.
  void set_zero(std::shared_ptr<ZeroRedundancyOptimizer> zero) { zero_ = std::move(zero); }
  // Clipping of the averaged gradient before every step (grad_clip.h); off by default.
  void set_grad_clip(const GradClip& clip) { clip_ = clip; }
  // The EMAs of the parameters updated after every step (Note [EMA off the critical path] in ema.h).
  ParameterAverages& averages() { return averages_; }

 private:
  BatchStats loss_of(const nn::Tensor& out, const nn::BatchTargets& y);

  std::shared_ptr<nn::SequentialModel> model_;
  std::shared_ptr<nn::Loss> loss_;
  std::shared_ptr<nn::Optimizer> opt_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::shared_ptr<DistributedDataParallel> ddp_;
  std::shared_ptr<ZeroRedundancyOptimizer> zero_;
  GradClip clip_;
  ParameterAverages averages_;
};

}  // namespace cx::train
