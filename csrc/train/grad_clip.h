// defines: GradClip (DistributedTrainingConfig.grad_clip_norm / grad_clip_value)
// and clip_gradients, which applies it to the averaged gradient before the
// optimizer's step: the CPU engine on the whole buffer after DDP's all-reduce,
// ZeroRedundancyOptimizer on this rank's shard after its reduce-scatter.
//
// Note [Clipping the global gradient]
// What is clipped is the gradient the optimizer steps with: the average over
// ranks, i.e. the gradient of the whole global batch, not a rank's own. After
// DDP's all-reduce every rank holds that average bit for bit, so each computes
// the same norm and scales alike. Under ZeRO-1 a rank holds the average of its
// shard only; the norm of the whole is sqrt of the SUM over ranks of the
// shards' squared norms: one all-reduce of one float64 per step (a rank
// clipping its shard by the shard's own norm would give the step a norm of up
// to sqrt(world) times the bound). Value clipping is element-wise and needs
// nothing. Both: values first, then the norm of what they left (so both bounds
// hold after the step's clip). The formula is torch.nn.utils.clip_grad_norm_'s
// (coef = max_norm / (norm + 1e-6), applied when below 1), which
// nn::clip_grad_norm uses too. A norm that is NaN or infinite cannot be clipped
// and would turn every parameter into NaN: every rank (they all compute the
// same norm) raises instead; so does value clipping on a NaN element.
#pragma once

#include <cstddef>
#include <string>

#include "distributed/process_group.h"

namespace cx::train {

struct GradClip {
  double max_norm = 0;   // > 0: clip the global L2 norm to it; 0: off
  double max_value = 0;  // > 0: clamp every element to [-max_value, max_value]; 0: off
  bool on() const { return max_norm > 0 || max_value > 0; }
};

// Checks a GradClip's numbers (finite, >= 0), naming the config fields.
void check_grad_clip(const GradClip& c);

// Clips n floats of averaged gradient in place as `c` says. With `shards` (ZeRO-1),
// g is this rank's shard and the norm is summed over the group's ranks (a
// collective every rank makes); null: g is the whole gradient. `rank` is for the
// message when the norm is not finite. Returns the norm before clipping (0 when
// only values are clipped).
double clip_gradients(float* g, size_t n, const GradClip& c, distributed::ProcessGroup* shards, int rank);

// What clip_gradients raises (InvalidArgument) when it cannot clip: a NaN element under grad_clip_value, a norm
// that is not finite under grad_clip_norm. The GPU engine raises the same words (Note [The GPU trainer's clipping
// and 16-bit buckets] in gpu_engine.cpp).
std::string clip_nan_message(int rank);
std::string clip_norm_message(double norm, int rank);

}  // namespace cx::train
