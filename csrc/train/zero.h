// defines: Shard and shard_of (which slice of a flat buffer a rank owns), and
// ZeroRedundancyOptimizer, ZeRO-1 over a DistributedDataParallel: each rank
// keeps and updates the optimizer state of its shard of the parameters only.
//
// Usage from C++ (one call per batch, as DistributedDataParallel):
//   ZeroRedundancyOptimizer zero(ddp, std::make_shared<nn::AdamOptimizer>(1e-3));
//   ddp->forward(x, shape); ddp->backward(g, shape, false);
//   zero.step();   // reduce-scatter, step the shard, all-gather, zero the grads
//
// Note [ZeRO-1]
// Rajbhandari et al. 2020, stage 1 (PyTorch's ZeroRedundancyOptimizer shards
// the state too, but all-reduces the gradients and broadcasts per parameter).
// The flat parameter buffer of n floats is cut into world contiguous shards:
// q = n / world floats each, the last rank also takes the n % world floats
// left over, so shards are contiguous and every rank but the last starts at
// rank * q (shard_of). A step:
//   1. while ZeRO is on, backward launches nothing (DDP's set_shard_gradients);
//      the step reduce-scatters (AVG) the gradient: block i of every rank's
//      buffer is [i*q, (i+1)*q), cut into pieces of at most one DDP bucket, so
//      the only scratch is one bucket; the < world leftover floats are one tiny
//      AVG all-reduce. Each rank then holds the average of its own shard only
//      (the rest of its gradient buffer is stale and zeroed after the step).
//      If sync_gradients() already averaged the whole buffer, nothing is sent.
//   2. the wrapped optimizer steps [offset, offset+count) of the parameters;
//      its state is sized to that range on the first step (Optimizer::step over
//      a sub-buffer), i.e. count floats per state array instead of n;
//   3. an all-gather puts every rank's updated shard in everyone's parameters
//      (in place: block i is written by rank i), the leftover floats go by one
//      broadcast from the last rank.
// The optimizers are element-wise (SGD, Adam, AdamW, RMSprop), so stepping
// shards gives the result of stepping the whole buffer, to the bit.
// state_dict() gathers the whole state (collective) and load_state_dict()
// takes a whole one and keeps this rank's shard, so a checkpoint can be
// resumed with another world size. A model with fewer parameters than ranks is
// refused (a rank would own nothing).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/optimizer.h"
#include "train/ddp.h"
#include "train/grad_clip.h"

namespace cx::train {

struct Shard {
  size_t offset = 0, count = 0;
};
// Rank `rank`'s shard of n floats over `world` ranks (Note [ZeRO-1]).
Shard shard_of(size_t n, int world, int rank);

// The optimizer state of a model of n parameters, both ways between whole and a rank's shard, for both devices'
// ZeRO-1 (ZeroRedundancyOptimizer here, GpuEngine's in gpu_engine.cpp). `who` begins the errors.
// Not collective: `full`'s arrays (n floats each) cut to `shard`.
nn::StateDict shard_state(const nn::StateDict& full, size_t n, Shard shard, const std::string& who);
// Collective: opt's state (each array `shard.count` floats) made whole by gather(mine, out), which puts every
// rank's shard of a state array in out (n floats) on every rank.
nn::StateDict whole_state(const nn::Optimizer& opt, size_t n, Shard shard, const std::string& who,
                          const std::function<void(const float* mine, float* out)>& gather);

class ZeroRedundancyOptimizer {
 public:
  // Takes the optimizer's state over: a state built for the whole model is
  // cut to this rank's shard; none yet is sized at the first step.
  ZeroRedundancyOptimizer(std::shared_ptr<DistributedDataParallel> ddp, std::shared_ptr<nn::Optimizer> opt);
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // Collective: reduce-scatter, clip (Note [Clipping the global gradient] in
  // grad_clip.h) and step this rank's shard, all-gather the parameters, zero
  // the gradients (Note [ZeRO-1]).
  void step(const GradClip& clip = GradClip());
  // Collective: the whole optimizer state, as the wrapped optimizer's
  // state_dict() would be without sharding.
  nn::StateDict state_dict();
  // Not collective: a whole state (state_dict() of any world size, or of an
  // unsharded optimizer); this rank keeps its shard.
  void load_state_dict(const nn::StateDict& full);

  Shard shard() const { return shard_; }
  size_t state_numel() const { return opt_->state_numel(); }
  nn::Optimizer& optimizer() { return *opt_; }
  const std::shared_ptr<nn::Optimizer>& optimizer_ptr() const { return opt_; }
  const std::shared_ptr<DistributedDataParallel>& ddp() const { return ddp_; }
  // Floats of gradient scratch (one piece of the reduce-scatter).
  size_t scratch_floats() const { return scratch_.size(); }

 private:
  // false when the step must not be taken (DDPConfig.nonfinite = "skip").
  bool reduce_scatter_gradients();
  void all_gather_parameters();
  // out (n floats, every rank) gets every rank's `mine` (its shard's floats).
  void all_gather_shards(const float* mine, float* out);

  std::shared_ptr<DistributedDataParallel> ddp_;
  std::shared_ptr<nn::Optimizer> opt_;
  distributed::ProcessGroup* group_;
  size_t n_ = 0;     // parameters of the model
  size_t q_ = 0;     // floats of every shard but the last's
  Shard shard_;
  std::vector<float> scratch_;  // one reduce-scatter piece
};

}  // namespace cx::train
