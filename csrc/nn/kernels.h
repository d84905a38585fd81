// defines: the vectorised loops over flat buffers that optimizers, losses,
// clipping, Sigmoid/Tanh/GELU and the image layers (nn/layers/) use. Each has a plain scalar reference beside an AVX2 path picked at
// run time (the shipped build targets baseline x86-64; see DESIGN.md "Build").
// PYCYXWIZ_NN_SCALAR=1 in the environment forces the scalar paths.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cx::nn::kernels {

// Adam / AdamW on n elements. g_scale multiplies the gradient read (1 normally).
// l2 adds l2*p to the gradient (Adam's weight_decay); decay multiplies p by
// (1 - lr*wd) first (AdamW's decoupled decay; pass 1 for none).
// step_size = lr / (1 - beta1^t); inv_bc2_sqrt = 1 / sqrt(1 - beta2^t).
void adam(float* p, const float* g, float* m, float* v, size_t n, float beta1, float beta2, float eps,
          float step_size, float inv_bc2_sqrt, float l2, float decay);

// RMSprop: v = a*v + (1-a) g^2; if momentum: buf = mu*buf + g/(sqrt(v)+eps), p -= lr*buf;
// else p -= lr*g/(sqrt(v)+eps). g includes l2*p.
void rmsprop(float* p, const float* g, float* v, float* buf, size_t n, float lr, float alpha, float eps,
             float momentum, float l2);

// SGD (PyTorch's formula): d = g + l2*p; if momentum: buf = mu*buf + d; d = nesterov ? d + mu*buf : buf;
// p -= lr*d. buf may be null when momentum == 0.
void sgd(float* p, const float* g, float* buf, size_t n, float lr, float momentum, bool nesterov, float l2);

// Sigmoid and Tanh forward over n floats: the formulas of cuda/act_rules.h (the scalar path, and the GPU's),
// or with AVX2 an 8-wide exp (Note [Vector exp] in kernels.cpp) within a few ulp of them; a NaN stays NaN.
void sigmoid(const float* x, float* y, size_t n);
void tanh(const float* x, float* y, size_t n);
// GELU (exact) forward, and its backward gx = gy * GELU'(x), likewise, its erf to float32's rounding of 1.
void gelu(const float* x, float* y, size_t n);
void gelu_backward(const float* x, const float* gy, float* gx, size_t n);

// sum of squares in double (for global-norm clipping).
double sum_squares(const float* x, size_t n);
void scale(float* x, size_t n, float s);

// The largest |x[i]|'s bit pattern with the sign cleared: >= kNonFiniteBits
// exactly when some x[i] is inf or NaN (Note [Finding non-finite values by
// their bits] in kernels.cpp). 0 for n == 0.
constexpr uint32_t kNonFiniteBits = 0x7f800000u;
uint32_t max_abs_bits(const float* x, size_t n);
// How many of x[0..n) are inf or NaN.
size_t count_nonfinite(const float* x, size_t n);

// Reductions over one row of an image (a channel's plane): n floats summed in
// eight float lanes, which the compiler vectorises, then added up in double.
// The same lanes on every target, so the result does not depend on the CPU.
double sum(const float* x, size_t n);
double sum_sq_dev(const float* x, size_t n, float m);               // sum of (x - m)^2
double dot_dev(const float* g, const float* x, size_t n, float m);  // sum of g * (x - m)
// Element-wise: y = a*(x - m) + b; gx = k1*gy + k2*(x - m) + k3; z = x + y.
void affine(const float* x, size_t n, float a, float m, float b, float* y);
void affine2(const float* gy, const float* x, size_t n, float k1, float k2, float m, float k3, float* gx);
void add(const float* x, const float* y, size_t n, float* z);

}  // namespace cx::nn::kernels
