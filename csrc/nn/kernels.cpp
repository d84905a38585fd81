#include "nn/kernels.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/env.h"
#include "cuda/act_rules.h"
#include "cuda/update_rules.h"
#include "nn/parallel.h"

namespace cx::nn::kernels {

namespace {

// CX_NN_SCALAR=1 forces the scalar reference paths (tests compare the two).
bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !(env::get("CX_NN_SCALAR") && std::string(env::get("CX_NN_SCALAR")) == "1");
  return yes;
}

// Scalar reference: the formulas exactly as published (cuda/update_rules.h, which
// the GPU kernels use too).
void adam_scalar(float* p, const float* g, float* m, float* v, size_t i, size_t n, float b1, float b2,
                 float eps, float step_size, float inv_bc2_sqrt, float l2, float decay) {
  for (; i < n; ++i) rules::adam(p[i], g[i], m[i], v[i], b1, b2, eps, step_size, inv_bc2_sqrt, l2, decay);
}

__attribute__((target("avx2,fma"))) size_t adam_avx2(float* p, const float* g, float* m, float* v, size_t n,
                                                     float b1, float b2, float eps, float step_size,
                                                     float inv_bc2_sqrt, float l2, float decay) {
  const __m256 vb1 = _mm256_set1_ps(b1), vb1c = _mm256_set1_ps(1.0f - b1);
  const __m256 vb2 = _mm256_set1_ps(b2), vb2c = _mm256_set1_ps(1.0f - b2);
  const __m256 veps = _mm256_set1_ps(eps), vstep = _mm256_set1_ps(step_size);
  const __m256 vbc2 = _mm256_set1_ps(inv_bc2_sqrt), vl2 = _mm256_set1_ps(l2), vdecay = _mm256_set1_ps(decay);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pi = _mm256_loadu_ps(p + i);
    __m256 gi = _mm256_fmadd_ps(vl2, pi, _mm256_loadu_ps(g + i));
    __m256 mi = _mm256_fmadd_ps(vb1, _mm256_loadu_ps(m + i), _mm256_mul_ps(vb1c, gi));
    __m256 vi = _mm256_fmadd_ps(vb2, _mm256_loadu_ps(v + i), _mm256_mul_ps(vb2c, _mm256_mul_ps(gi, gi)));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), vbc2, veps);
    __m256 upd = _mm256_div_ps(_mm256_mul_ps(vstep, mi), denom);
    _mm256_storeu_ps(p + i, _mm256_sub_ps(_mm256_mul_ps(pi, vdecay), upd));
  }
  return i;
}

void rmsprop_scalar(float* p, const float* g, float* v, float* buf, size_t i, size_t n, float lr, float a,
                    float eps, float mu, float l2) {
  for (; i < n; ++i) rules::rmsprop(p[i], g[i], v[i], buf ? buf + i : nullptr, lr, a, eps, mu, l2);
}

__attribute__((target("avx2,fma"))) size_t rmsprop_avx2(float* p, const float* g, float* v, float* buf, size_t n,
                                                        float lr, float a, float eps, float mu, float l2) {
  const __m256 va = _mm256_set1_ps(a), vac = _mm256_set1_ps(1.0f - a), veps = _mm256_set1_ps(eps);
  const __m256 vlr = _mm256_set1_ps(lr), vmu = _mm256_set1_ps(mu), vl2 = _mm256_set1_ps(l2);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pi = _mm256_loadu_ps(p + i);
    __m256 gi = _mm256_fmadd_ps(vl2, pi, _mm256_loadu_ps(g + i));
    __m256 vi = _mm256_fmadd_ps(va, _mm256_loadu_ps(v + i), _mm256_mul_ps(vac, _mm256_mul_ps(gi, gi)));
    _mm256_storeu_ps(v + i, vi);
    __m256 d = _mm256_div_ps(gi, _mm256_add_ps(_mm256_sqrt_ps(vi), veps));
    if (buf) {
      d = _mm256_fmadd_ps(vmu, _mm256_loadu_ps(buf + i), d);
      _mm256_storeu_ps(buf + i, d);
    }
    _mm256_storeu_ps(p + i, _mm256_sub_ps(pi, _mm256_mul_ps(vlr, d)));
  }
  return i;
}

}  // namespace

void adam(float* p, const float* g, float* m, float* v, size_t n, float beta1, float beta2, float eps,
          float step_size, float inv_bc2_sqrt, float l2, float decay) {
  parallel_floats(n, [&](size_t b, size_t e) {
    size_t i = have_avx2() ? b + adam_avx2(p + b, g + b, m + b, v + b, e - b, beta1, beta2, eps, step_size,
                                           inv_bc2_sqrt, l2, decay)
                           : b;
    adam_scalar(p, g, m, v, i, e, beta1, beta2, eps, step_size, inv_bc2_sqrt, l2, decay);
  });
}

void rmsprop(float* p, const float* g, float* v, float* buf, size_t n, float lr, float alpha, float eps,
             float momentum, float l2) {
  parallel_floats(n, [&](size_t b, size_t e) {
    float* bb = buf ? buf + b : nullptr;
    size_t i = have_avx2() ? b + rmsprop_avx2(p + b, g + b, v + b, bb, e - b, lr, alpha, eps, momentum, l2) : b;
    rmsprop_scalar(p, g, v, buf, i, e, lr, alpha, eps, momentum, l2);
  });
}

namespace {

// No sqrt here, so the compiler vectorises these for each target by itself.
__attribute__((target_clones("avx2", "default"))) void sgd_range(float* __restrict p, const float* __restrict g,
                                                                 float* __restrict buf, size_t n, float lr,
                                                                 float momentum, bool nesterov, float l2) {
  if (!buf) {
    for (size_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + l2 * p[i]);
    return;
  }
  if (nesterov) {
    for (size_t i = 0; i < n; ++i) {
      float d = g[i] + l2 * p[i];
      float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * (d + momentum * b);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      float d = g[i] + l2 * p[i];
      float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * b;
    }
  }
}

}  // namespace

void sgd(float* p, const float* g, float* buf, size_t n, float lr, float momentum, bool nesterov, float l2) {
  parallel_floats(n, [&](size_t b, size_t e) {
    sgd_range(p + b, g + b, buf ? buf + b : nullptr, e - b, lr, momentum, nesterov, l2);
  });
}

namespace {

// Note [Vector exp]
// Sigmoid, Tanh and GELU spend their time in expf/tanhf/erff, one libm call per
// element: for 4M floats 45, 85 and 57 ms forward (GELU's backward 81), against
// ReLU's 3.7 and PyTorch's 4.5, 16 and 3.8 on one thread. On 8 lanes: 4.4, 5.6
// and 11.7 (GELU's backward 15.7).
// exp8 is Cephes' expf on 8 lanes: x = n ln2 + r with |r| <= ln2/2 (ln2 in two
// parts, so r is exact), e^r by a degree-7 polynomial, 2^n built in the exponent
// bits; relative error under 2e-7 (about 1.5 ulp) where the result is normal.
// Only x <= 0 is asked for here (e^-|x|), so it cannot overflow; below -80 it
// is e^(x+40) e^-40, so that a subnormal result is rounded once, as expf's is.
// Tanh below |x| = 0.625 is Cephes' odd polynomial ((1 - e)/(1 + e) loses digits
// there); above, (1 - e)/(1 + e) with e = e^-2|x|. GELU's erf is erf8 below.
// The scalar path keeps the rules' libm calls, so CX_NN_SCALAR=1 gives the
// reference they are tested on (tests/test_nn_gradients.py).
__attribute__((target("avx2,fma"))) __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-80.0f), _CMP_LT_OQ);
  x = _mm256_add_ps(x, _mm256_and_ps(tiny, _mm256_set1_ps(40.0f)));
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 flush = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);  // e^x under 1e-55: 0 in float
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  p = _mm256_andnot_ps(flush, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
  return _mm256_blendv_ps(p, _mm256_mul_ps(p, _mm256_set1_ps(4.24835426e-18f)), tiny);  // e^-40
}

__attribute__((target("avx2,fma"))) size_t sigmoid_avx2(const float* x, float* y, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp8(_mm256_or_ps(v, sign));  // e^-|x|
    const __m256 d = _mm256_add_ps(one, e);
    __m256 out = _mm256_blendv_ps(_mm256_div_ps(e, d), _mm256_div_ps(one, d), _mm256_cmp_ps(v, zero, _CMP_GE_OQ));
    out = _mm256_blendv_ps(out, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN in, NaN out
    _mm256_storeu_ps(y + i, out);
  }
  return i;
}

__attribute__((target("avx2,fma"))) size_t tanh_avx2(const float* x, float* y, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 a = _mm256_andnot_ps(sign, v);
    const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 z = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), a, a);
    __m256 out = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
    out = _mm256_or_ps(out, _mm256_and_ps(v, sign));  // tanh is odd: -0 stays -0
    out = _mm256_blendv_ps(out, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm256_storeu_ps(y + i, out);
  }
  return i;
}

// erf on 8 lanes, to an absolute error near float32's rounding of 1 (what 1 + erf(z) in GELU can use):
// Cephes' erff, z T(z^2) below |z| = 1; above, 1 - erfc with erfc(a) = e^-a^2 / a P(1/a^2) on [1, 2) and
// R(1/a^2) beyond (the polynomials of Cephes' erfcf as XLA evaluates them).
__attribute__((target("avx2,fma"))) __m256 horner(__m256 x, const float* c, int n) {
  __m256 p = _mm256_set1_ps(c[0]);
  for (int k = 1; k < n; ++k) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c[k]));
  return p;
}

__attribute__((target("avx2,fma"))) __m256 erf8(__m256 z) {
  static const float kT[] = {7.853861353153693e-5f, -8.010193625184903e-4f, 5.188327685732524e-3f,
                             -2.685381193529856e-2f, 1.128358514861418e-1f, -3.761262582423300e-1f,
                             1.128379165726710e+0f};
  static const float kP[] = {2.326819970068386e-2f, -1.387039388740657e-1f, 3.687424674597105e-1f,
                             -5.824733027278666e-1f, 6.210004621745983e-1f, -4.944515323274145e-1f,
                             3.404879937665872e-1f, -2.741127028184656e-1f, 5.638259427386472e-1f};
  static const float kR[] = {-1.047766399936249e+1f, 1.297719955372516e+1f, -7.495518717768503e+0f,
                             2.921019019210786e+0f, -1.015265279202700e+0f, 4.218463358204948e-1f,
                             -2.820767439740514e-1f, 5.641895067754075e-1f};
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 a = _mm256_andnot_ps(sign, z), a2 = _mm256_mul_ps(a, a);
  const __m256 small = _mm256_mul_ps(a, horner(a2, kT, 7));
  const __m256 q = _mm256_div_ps(one, a), y = _mm256_mul_ps(q, q);
  const __m256 pr = _mm256_blendv_ps(horner(y, kR, 8), horner(y, kP, 9), _mm256_cmp_ps(a, _mm256_set1_ps(2.0f),
                                                                                         _CMP_LT_OQ));
  const __m256 erfc = _mm256_mul_ps(_mm256_mul_ps(exp8(_mm256_sub_ps(_mm256_setzero_ps(), a2)), q), pr);
  const __m256 r = _mm256_blendv_ps(_mm256_sub_ps(one, erfc), small, _mm256_cmp_ps(a, one, _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(z, sign));
}

__attribute__((target("avx2,fma"))) size_t gelu_avx2(const float* x, float* y, size_t n) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), r2 = _mm256_set1_ps(0.70710678118654752f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    __m256 out = _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, erf8(_mm256_mul_ps(v, r2))));
    out = _mm256_blendv_ps(out, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm256_storeu_ps(y + i, out);
  }
  return i;
}

__attribute__((target("avx2,fma"))) size_t gelu_backward_avx2(const float* x, const float* gy, float* gx, size_t n) {
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), r2 = _mm256_set1_ps(0.70710678118654752f);
  const __m256 k = _mm256_set1_ps(0.39894228040143268f), mhalf = _mm256_set1_ps(-0.5f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 cdf = _mm256_mul_ps(half, _mm256_add_ps(one, erf8(_mm256_mul_ps(v, r2))));
    const __m256 pdf = _mm256_mul_ps(k, exp8(_mm256_mul_ps(mhalf, _mm256_mul_ps(v, v))));
    _mm256_storeu_ps(gx + i, _mm256_mul_ps(_mm256_loadu_ps(gy + i), _mm256_fmadd_ps(v, pdf, cdf)));
  }
  return i;
}

}  // namespace

void gelu(const float* x, float* y, size_t n) {
  parallel_floats(n, [&](size_t b, size_t e) {
    size_t i = have_avx2() ? b + gelu_avx2(x + b, y + b, e - b) : b;
    for (; i < e; ++i) y[i] = rules::gelu_fwd(x[i]);
  });
}

void gelu_backward(const float* x, const float* gy, float* gx, size_t n) {
  parallel_floats(n, [&](size_t b, size_t e) {
    size_t i = have_avx2() ? b + gelu_backward_avx2(x + b, gy + b, gx + b, e - b) : b;
    for (; i < e; ++i) gx[i] = rules::gelu_bwd(x[i], gy[i]);
  });
}

void sigmoid(const float* x, float* y, size_t n) {
  parallel_floats(n, [&](size_t b, size_t e) {
    size_t i = have_avx2() ? b + sigmoid_avx2(x + b, y + b, e - b) : b;
    for (; i < e; ++i) y[i] = rules::sigmoid_fwd(x[i]);
  });
}

void tanh(const float* x, float* y, size_t n) {
  parallel_floats(n, [&](size_t b, size_t e) {
    size_t i = have_avx2() ? b + tanh_avx2(x + b, y + b, e - b) : b;
    for (; i < e; ++i) y[i] = rules::tanh_fwd(x[i]);
  });
}

double sum_squares(const float* x, size_t n) {
  double acc[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += static_cast<double>(x[i + k]) * x[i + k];
  for (; i < n; ++i) acc[0] += static_cast<double>(x[i]) * x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

namespace {
__attribute__((target_clones("avx2", "default"))) void scale_range(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] *= s;
}
}  // namespace

void scale(float* x, size_t n, float s) {
  parallel_floats(n, [&](size_t b, size_t e) { scale_range(x + b, e - b, s); });
}

// Note [Finding non-finite values by their bits]
// A float is inf or NaN exactly when its exponent bits are all ones, so with
// the sign bit cleared its bit pattern, read as an integer, is >= 0x7f800000;
// and for finite floats that integer orders like |x|. One integer max over
// the bits thus answers both "is any value non-finite?" and "how large is the
// largest one?" in a single pass with no branch and no floating-point
// compare (which NaN would poison); it vectorises to one AND and one MAX per
// eight lanes. DistributedDataParallel runs it over every bucket it reduces
// (Note [Non-finite gradients] in train/nonfinite.h).
__attribute__((target_clones("avx2", "default"))) uint32_t max_abs_bits(const float* __restrict x, size_t n) {
  uint32_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      uint32_t b;
      std::memcpy(&b, x + i + l, sizeof b);
      b &= 0x7fffffffu;
      acc[l] = acc[l] > b ? acc[l] : b;
    }
  uint32_t m = 0;
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b &= 0x7fffffffu;
    m = m > b ? m : b;
  }
  for (uint32_t a : acc) m = m > a ? m : a;
  return m;
}

size_t count_nonfinite(const float* x, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) c += !std::isfinite(x[i]);
  return c;
}

// ---- image rows: eight float lanes, added up in double (the order fixed, whatever the target) ----

__attribute__((target_clones("avx2", "default"))) double sum(const float* __restrict x, size_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += x[i + l];
  double s = 0;
  for (; i < n; ++i) s += x[i];
  for (float a : acc) s += a;
  return s;
}

__attribute__((target_clones("avx2", "default"))) double sum_sq_dev(const float* __restrict x, size_t n, float m) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const float d = x[i + l] - m;
      acc[l] += d * d;
    }
  double s = 0;
  for (; i < n; ++i) s += static_cast<double>(x[i] - m) * (x[i] - m);
  for (float a : acc) s += a;
  return s;
}

__attribute__((target_clones("avx2", "default"))) double dot_dev(const float* __restrict g,
                                                                 const float* __restrict x, size_t n, float m) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += g[i + l] * (x[i + l] - m);
  double s = 0;
  for (; i < n; ++i) s += static_cast<double>(g[i]) * (x[i] - m);
  for (float a : acc) s += a;
  return s;
}

__attribute__((target_clones("avx2", "default"))) void affine(const float* __restrict x, size_t n, float a, float m,
                                                              float b, float* __restrict y) {
  for (size_t i = 0; i < n; ++i) y[i] = a * (x[i] - m) + b;
}

__attribute__((target_clones("avx2", "default"))) void affine2(const float* __restrict gy, const float* __restrict x,
                                                               size_t n, float k1, float k2, float m, float k3,
                                                               float* __restrict gx) {
  for (size_t i = 0; i < n; ++i) gx[i] = k1 * gy[i] + k2 * (x[i] - m) + k3;
}

namespace {
__attribute__((target_clones("avx2", "default"))) void add_range(const float* x, const float* y, size_t n, float* z) {
  for (size_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}
}  // namespace

void add(const float* x, const float* y, size_t n, float* z) {
  parallel_floats(n, [&](size_t b, size_t e) { add_range(x + b, y + b, e - b, z + b); });
}

}  // namespace cx::nn::kernels
