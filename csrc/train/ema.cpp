#include "train/ema.h"

namespace cx::train {

__attribute__((target_clones("avx2", "default"))) void ema_update(float* __restrict shadow,
                                                                   const float* __restrict params, size_t n,
                                                                   double decay) {
  const float d = static_cast<float>(decay);
  const float c = static_cast<float>(1.0 - decay);
  for (size_t i = 0; i < n; ++i) shadow[i] = d * shadow[i] + c * params[i];
}

}  // namespace cx::train
