// defines: Engine, the per-batch work of the trainer on one device (CpuEngine:
// the host model and DistributedDataParallel; GpuEngine: the model on GPU
// LOCAL_RANK with NCCL), and BatchStats, what a batch reports.
//
// TrainerCore (trainer.h) gathers a batch's rows and hands them to its engine:
// it picks the engine once, at construction, from the group's backend.
#pragma once

#include <cstddef>
#include <string>

#include "nn/loss.h"
#include "nn/tensor.h"

namespace cx::train {

// Sums, so that a sample-weighted global mean is one SUM all-reduce away.
struct BatchStats {
  double loss_sum = 0;  // sum over rows of the loss (batch mean * rows)
  double correct = 0;   // rows classified correctly (NaN for MSELoss)
  double count = 0;     // rows
};

class Engine {
 public:
  virtual ~Engine() = default;
  // Where the trainer gathers the next batch's input rows (`floats` of them):
  // host memory the engine copies from best (the GPU engine: page-locked), or
  // null for the trainer's own. Valid until the next call.
  virtual float* input_buffer(size_t floats) {
    (void)floats;
    return nullptr;
  }
  // One optimizer step on a batch of host rows x (x_shape) and their targets.
  virtual BatchStats train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) = 0;
  // The batch's loss in eval mode (the model is in eval mode already).
  virtual BatchStats eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) = 0;
  // SUM over ranks, in float64.
  virtual BatchStats reduce_stats(const BatchStats& s) = 0;
  // Collectives over host bytes for the trainer's bookkeeping (RNG states,
  // checkpoints), on whichever memory the backend moves. Blocking.
  virtual void all_gather_host(const void* in, void* out, size_t bytes) = 0;
  virtual void broadcast_host(void* buf, size_t bytes, int root) = 0;
  // Rank 0's module buffers to every rank, where the model lives (Note
  // [Buffers across ranks] in ddp.h). Collective.
  virtual void broadcast_buffers() = 0;
  // Where the model's state lives between steps: copies it to the host objects
  // and back (no-ops where it is the host).
  virtual void to_host() {}
  virtual void from_host() {}
  // The device, for trainer.device ("" on the CPU).
  virtual std::string describe() const { return std::string(); }
};

}  // namespace cx::train
