#include "nn/kernels.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/env.h"
#include "cuda/update_rules.h"

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
  size_t i = have_avx2() ? adam_avx2(p, g, m, v, n, beta1, beta2, eps, step_size, inv_bc2_sqrt, l2, decay) : 0;
  adam_scalar(p, g, m, v, i, n, beta1, beta2, eps, step_size, inv_bc2_sqrt, l2, decay);
}

void rmsprop(float* p, const float* g, float* v, float* buf, size_t n, float lr, float alpha, float eps,
             float momentum, float l2) {
  size_t i = have_avx2() ? rmsprop_avx2(p, g, v, buf, n, lr, alpha, eps, momentum, l2) : 0;
  rmsprop_scalar(p, g, v, buf, i, n, lr, alpha, eps, momentum, l2);
}

// No sqrt here, so the compiler vectorises these for each target by itself.
__attribute__((target_clones("avx2", "default"))) void sgd(float* __restrict p, const float* __restrict g,
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

double sum_squares(const float* x, size_t n) {
  double acc[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += static_cast<double>(x[i + k]) * x[i + k];
  for (; i < n; ++i) acc[0] += static_cast<double>(x[i]) * x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

__attribute__((target_clones("avx2", "default"))) void scale(float* x, size_t n, float s) {
  for (size_t i = 0; i < n; ++i) x[i] *= s;
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

__attribute__((target_clones("avx2", "default"))) void add(const float* x, const float* y, size_t n, float* z) {
  for (size_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}

}  // namespace cx::nn::kernels
