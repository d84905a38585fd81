// defines: the optimizers' per-element update rules, shared by the CPU's scalar
// reference paths (nn/kernels.cpp) and the GPU kernels (cuda/nn.cu), so the two
// compute the same formula by construction. (The CPU's AVX2 paths are checked
// against the scalar ones by tests/test_nn_optimizers.py.) It lives in the floor
// because the kernels do; nn/ includes it from here.
#pragma once

#include <math.h>

#include "cuda/host_device.h"

namespace cx::nn::rules {

// Adam / AdamW (see nn/kernels.h: decay is AdamW's 1 - lr*wd, l2 Adam's weight_decay).
CX_HD void adam(float& p, float g, float& m, float& v, float b1, float b2, float eps, float step_size,
                float inv_bc2_sqrt, float l2, float decay) {
  const float pi = p * decay;
  const float gi = g + l2 * p;
  const float mi = b1 * m + (1.0f - b1) * gi;
  const float vi = b2 * v + (1.0f - b2) * gi * gi;
  m = mi;
  v = vi;
  p = pi - step_size * mi / (sqrtf(vi) * inv_bc2_sqrt + eps);
}

// RMSprop; buf null without momentum.
CX_HD void rmsprop(float& p, float g, float& v, float* buf, float lr, float a, float eps, float mu, float l2) {
  const float gi = g + l2 * p;
  const float vi = a * v + (1.0f - a) * gi * gi;
  v = vi;
  float d = gi / (sqrtf(vi) + eps);
  if (buf) {
    *buf = mu * *buf + d;
    d = *buf;
  }
  p -= lr * d;
}

// SGD (PyTorch's formula); buf null without momentum.
CX_HD void sgd(float& p, float g, float* buf, float lr, float mu, bool nesterov, float l2) {
  float d = g + l2 * p;
  if (buf) {
    const float b = mu * *buf + d;
    *buf = b;
    d = nesterov ? d + mu * b : b;
  }
  p -= lr * d;
}

}  // namespace cx::nn::rules
