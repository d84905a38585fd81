#include "train/grad_clip.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "nn/kernels.h"

namespace cx::train {

void check_grad_clip(const GradClip& c) {
  CX_CHECK(std::isfinite(c.max_norm) && c.max_norm >= 0, InvalidArgument,
           "DistributedTrainingConfig.grad_clip_norm must be a finite number > 0 (None: no clipping), got ",
           c.max_norm);
  CX_CHECK(std::isfinite(c.max_value) && c.max_value >= 0, InvalidArgument,
           "DistributedTrainingConfig.grad_clip_value must be a finite number > 0 (None: no clipping), got ",
           c.max_value);
}

std::string clip_nan_message(int rank) {
  return detail::concat("DistributedTrainer (rank ", rank, "): the gradient holds NaN, so grad_clip_value cannot "
                        "clip it (check the inputs and targets for NaN/inf, or lower the learning rate)");
}

std::string clip_norm_message(double norm, int rank) {
  return detail::concat("DistributedTrainer (rank ", rank, "): the gradient's norm is ", norm,
                        ", so grad_clip_norm cannot clip it: the loss or the gradients hold NaN or inf "
                        "(check the inputs and targets for NaN/inf, or lower the learning rate)");
}

double clip_gradients(float* g, size_t n, const GradClip& c, distributed::ProcessGroup* shards, int rank) {
  if (c.max_value > 0) {
    const float v = static_cast<float>(c.max_value);
    bool nan = false;
    for (size_t i = 0; i < n; ++i) {
      nan |= g[i] != g[i];  // a NaN passes any clamp
      g[i] = std::min(std::max(g[i], -v), v);
    }
    CX_CHECK(!nan, InvalidArgument, clip_nan_message(rank));
  }
  if (!(c.max_norm > 0)) return 0;
  double sq = nn::kernels::sum_squares(g, n);
  if (shards && shards->size() > 1)  // Note [Clipping the global gradient]
    shards->all_reduce(&sq, 1, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  const double norm = std::sqrt(sq);
  CX_CHECK(std::isfinite(norm), InvalidArgument, clip_norm_message(norm, rank));
  const double coef = c.max_norm / (norm + 1e-6);
  if (coef < 1.0) nn::kernels::scale(g, n, static_cast<float>(coef));
  return norm;
}

}  // namespace cx::train
