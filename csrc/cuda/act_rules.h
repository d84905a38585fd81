// defines: the activations' per-element formulas (forward and backward of ReLU,
// LeakyReLU, Sigmoid, Tanh, GELU) and the element terms of MSELoss and
// BCEWithLogitsLoss, shared by the CPU loops (nn/modules.cpp, nn/loss.cpp) and
// the GPU kernels (cuda/nn.cu), as update_rules.h is for the optimizers. Only
// functions that exist on both sides (expf, tanhf, erff, log1pf of <math.h>): on
// the host they are what std::exp and the others call for a float.
#pragma once

#include <math.h>

#include "cuda/host_device.h"

namespace cx::nn::rules {

// x <= 0 ? 0 : x keeps a NaN a NaN, as np.maximum(x, 0) and torch.relu do (x > 0 ? x : 0 made it 0,
// hiding a bad input row behind a finite loss).
CX_HD float relu_fwd(float x) { return x <= 0.0f ? 0.0f : x; }
// g comes in read whatever x is, so the CPU's loop is a vector select, not a branch per element (a branch
// mispredicted half the time was ten times slower than the forward pass).
CX_HD float relu_bwd(float x, float g) { return x > 0.0f ? g : 0.0f; }

// x > 0 ? x : slope * x, written as a sum of two selects of a value or 0: GCC if-converts those, while the
// product on one side of a select stays a branch under -ftrapping-math (the default), which left the CPU's loop
// scalar at 7x ReLU's time. The same values, but that a zero result is +0 where the select gave -0.
CX_HD float leaky_relu_fwd(float x, float slope) { return (x <= 0.0f ? 0.0f : x) + slope * (x > 0.0f ? 0.0f : x); }
CX_HD float leaky_relu_bwd(float x, float g, float slope) {
  const bool pos = x > 0.0f;
  return (pos ? g : 0.0f) + slope * (pos ? 0.0f : g);
}

// The sigmoid from e = exp(-|x|), which never overflows: stable on both sides. BCE's log term uses the same e.
CX_HD float sigmoid_stable(float x, float e) { return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e); }
CX_HD float sigmoid_fwd(float x) { return sigmoid_stable(x, expf(-fabsf(x))); }
CX_HD float sigmoid_bwd(float y, float g) { return g * y * (1.0f - y); }

CX_HD float tanh_fwd(float x) { return tanhf(x); }
CX_HD float tanh_bwd(float y, float g) { return g * (1.0f - y * y); }

// Exact GELU, x * Phi(x) with Phi the standard normal CDF (PyTorch's default).
CX_HD float gelu_fwd(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
CX_HD float gelu_bwd(float x, float g) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  const float pdf = 0.39894228040143268f * expf(-0.5f * x * x);  // 1/sqrt(2 pi) exp(-x^2/2)
  return g * (cdf + x * pdf);
}

// MSELoss of output o against target t over n elements (inv_n = 1/n): returns (o - t)^2, in double as the
// loss is summed, and sets g to its gradient 2 (o - t) / n.
CX_HD double mse(float o, float t, float inv_n, float& g) {
  const float d = o - t;
  g = 2.0f * inv_n * d;
  return (double)d * d;
}

// BCEWithLogitsLoss of logit x against target t over n elements (inv_n = 1/n): returns
// max(x, 0) - x t + log(1 + exp(-|x|)), which is log(1 + exp(x)) - x t without overflow, and sets g to its
// gradient (sigmoid(x) - t) / n.
CX_HD float bce_with_logits(float x, float t, float inv_n, float& g) {
  const float e = expf(-fabsf(x));
  g = (sigmoid_stable(x, e) - t) * inv_n;
  const float pos = x < 0.0f ? 0.0f : x;  // max(x, 0), inline on the host too (fmaxf is a call there)
  return pos - x * t + log1pf(e);
}

}  // namespace cx::nn::rules
