#include "train/ema.h"

#include "nn/parallel.h"

namespace cx::train {

namespace {

__attribute__((target_clones("avx2", "default"))) void ema_range(float* __restrict shadow,
                                                                  const float* __restrict params, size_t n, float d,
                                                                  float c) {
  for (size_t i = 0; i < n; ++i) shadow[i] = d * shadow[i] + c * params[i];
}

}  // namespace

// On the model math's threads where a process has several (nn/parallel.h), in parts of whole 16-float blocks:
// every element is the same product and sum whatever the parts.
void ema_update(float* shadow, const float* params, size_t n, double decay) {
  const float d = static_cast<float>(decay);
  const float c = static_cast<float>(1.0 - decay);
  nn::parallel_floats(n, [&](size_t b, size_t e) { ema_range(shadow + b, params + b, e - b, d, c); });
}

}  // namespace cx::train
