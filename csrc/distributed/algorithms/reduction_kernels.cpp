#include "distributed/algorithms/reduction_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CX_HAVE_F16C_PATH 1
#endif

namespace cx::distributed {

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {  // result is subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = absx >> 23;
    uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) ... bring to 10-bit subnormal
    uint32_t half_m = m >> (shift);
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t e = (absx >> 23) - 127 + 15;
  uint32_t m = absx & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;  // may carry into exponent: correct
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return static_cast<uint16_t>(x >> 16);
}

namespace {

template <typename T, typename F>
void apply(T* __restrict d, const T* __restrict s, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}

template <typename T>
void reduce_typed(T* d, const T* s, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: apply(d, s, n, [](T a, T b) { return static_cast<T>(a + b); }); break;
    case ReduceOp::kProduct: apply(d, s, n, [](T a, T b) { return static_cast<T>(a * b); }); break;
    case ReduceOp::kMin: apply(d, s, n, [](T a, T b) { return b < a ? b : a; }); break;
    case ReduceOp::kMax: apply(d, s, n, [](T a, T b) { return b > a ? b : a; }); break;
    case ReduceOp::kNone: break;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce_16(uint16_t* d, const uint16_t* s, size_t n, ReduceOp op) {
  for (size_t i = 0; i < n; ++i) {
    float a = ToF(d[i]), b = ToF(s[i]), r = a;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: r = a + b; break;
      case ReduceOp::kProduct: r = a * b; break;
      case ReduceOp::kMin: r = b < a ? b : a; break;
      case ReduceOp::kMax: r = b > a ? b : a; break;
      case ReduceOp::kNone: break;
    }
    d[i] = FromF(r);
  }
}

// ---- 16-bit floats: the SUM of the hooks' all-reduces, and the casts around it ----
//
// bfloat16 is the top half of a float32, rounded to nearest even (NaN kept
// quiet), as float_to_bf16; the scalar forms below are written branch-free so
// that the compiler vectorises them, and the AVX2 forms do the same integer
// arithmetic eight lanes at a time. float16 uses F16C's conversions, which
// round to nearest even as float_to_half. Every form gives the same bits as
// the scalar definition, so ranks with and without AVX2 agree.

inline uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

inline float float_of(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline uint16_t bf16_round(uint32_t x) {
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? ((x >> 16) | 0x40u) : rounded);
}

inline float bf16_widen(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

void sum_bf16_scalar(uint16_t* __restrict d, const uint16_t* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = bf16_round(bits_of(bf16_widen(d[i]) + bf16_widen(s[i])));
}

void narrow_bf16_scalar(const float* __restrict src, float scale, uint16_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_round(bits_of(src[i] * scale));
}

void widen_bf16_scalar(const uint16_t* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_widen(src[i]);
}

void narrow_sum_bf16_scalar(const float* __restrict own, float scale, const uint16_t* __restrict recv,
                            uint16_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i)
    dst[i] = bf16_round(bits_of(bf16_widen(bf16_round(bits_of(own[i] * scale))) + bf16_widen(recv[i])));
}

void narrow_half_scalar(const float* src, float scale, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i] * scale);
}

void widen_half_scalar(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void narrow_sum_half_scalar(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i)
    dst[i] = float_to_half(half_to_float(float_to_half(own[i] * scale)) + half_to_float(recv[i]));
}

#if CX_HAVE_F16C_PATH
#define CX_F16C __attribute__((target("avx,f16c")))
#define CX_AVX2 __attribute__((target("avx2")))

CX_F16C inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

CX_F16C inline void store_half8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

CX_F16C void sum_half_f16c(uint16_t* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_half8(d + i, _mm256_add_ps(load_half8(d + i), load_half8(s + i)));
  for (; i < n; ++i) d[i] = float_to_half(half_to_float(d[i]) + half_to_float(s[i]));
}

CX_F16C void narrow_half_f16c(const float* src, float scale, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_half8(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), k));
  narrow_half_scalar(src + i, scale, dst + i, n - i);
}

CX_F16C void widen_half_f16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_half8(src + i));
  widen_half_scalar(src + i, dst + i, n - i);
}

CX_F16C void narrow_sum_half_f16c(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(own + i), k),
                                                     _MM_FROUND_TO_NEAREST_INT));
    store_half8(dst + i, _mm256_add_ps(a, load_half8(recv + i)));
  }
  narrow_sum_half_scalar(own + i, scale, recv + i, dst + i, n - i);
}

// bf16_round on eight lanes: each 32-bit lane ends holding its 16-bit result.
CX_AVX2 inline __m256i bf16_round8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(x, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

// Eight lanes below 2^16 into eight uint16: pack within each 128-bit half (no
// saturation can happen), then bring the two halves' low quads together.
CX_AVX2 inline void store_bf16x8(uint16_t* p, __m256i lanes) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), _MM_SHUFFLE(3, 1, 2, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

CX_AVX2 inline __m256 as_float8(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }

CX_AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  return as_float8(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

CX_AVX2 void sum_bf16_avx2(uint16_t* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16x8(d + i, bf16_round8(_mm256_add_ps(load_bf16x8(d + i), load_bf16x8(s + i))));
  sum_bf16_scalar(d + i, s + i, n - i);
}

CX_AVX2 void narrow_bf16_avx2(const float* src, float scale, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16x8(dst + i, bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(src + i), k)));
  narrow_bf16_scalar(src + i, scale, dst + i, n - i);
}

CX_AVX2 void widen_bf16_avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
  widen_bf16_scalar(src + i, dst + i, n - i);
}

CX_AVX2 void narrow_sum_bf16_avx2(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = as_float8(bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(own + i), k)));
    store_bf16x8(dst + i, bf16_round8(_mm256_add_ps(a, load_bf16x8(recv + i))));
  }
  narrow_sum_bf16_scalar(own + i, scale, recv + i, dst + i, n - i);
}

bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}

bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

void sum_half(uint16_t* d, const uint16_t* s, size_t n) {
#if CX_HAVE_F16C_PATH
  if (have_f16c()) return sum_half_f16c(d, s, n);
#endif
  for (size_t i = 0; i < n; ++i) d[i] = float_to_half(half_to_float(d[i]) + half_to_float(s[i]));
}

void sum_bf16(uint16_t* d, const uint16_t* s, size_t n) {
#if CX_HAVE_F16C_PATH
  if (have_avx2()) return sum_bf16_avx2(d, s, n);
#endif
  sum_bf16_scalar(d, s, n);
}

}  // namespace

void narrow(const float* src, float scale, uint16_t* dst, size_t n, DataType wire) {
  if (wire == DataType::kBFloat16) {
#if CX_HAVE_F16C_PATH
    if (have_avx2()) return narrow_bf16_avx2(src, scale, dst, n);
#endif
    return narrow_bf16_scalar(src, scale, dst, n);
  }
#if CX_HAVE_F16C_PATH
  if (have_f16c()) return narrow_half_f16c(src, scale, dst, n);
#endif
  narrow_half_scalar(src, scale, dst, n);
}

void widen(const uint16_t* src, float* dst, size_t n, DataType wire) {
  if (wire == DataType::kBFloat16) {
#if CX_HAVE_F16C_PATH
    if (have_avx2()) return widen_bf16_avx2(src, dst, n);
#endif
    return widen_bf16_scalar(src, dst, n);
  }
#if CX_HAVE_F16C_PATH
  if (have_f16c()) return widen_half_f16c(src, dst, n);
#endif
  widen_half_scalar(src, dst, n);
}

void narrow_sum(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n, DataType wire) {
  if (wire == DataType::kBFloat16) {
#if CX_HAVE_F16C_PATH
    if (have_avx2()) return narrow_sum_bf16_avx2(own, scale, recv, dst, n);
#endif
    return narrow_sum_bf16_scalar(own, scale, recv, dst, n);
  }
#if CX_HAVE_F16C_PATH
  if (have_f16c()) return narrow_sum_half_f16c(own, scale, recv, dst, n);
#endif
  narrow_sum_half_scalar(own, scale, recv, dst, n);
}

void reduce_into(void* dst, const void* src, size_t count, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: reduce_typed(static_cast<float*>(dst), static_cast<const float*>(src), count, op); break;
    case DataType::kFloat64: reduce_typed(static_cast<double*>(dst), static_cast<const double*>(src), count, op); break;
    case DataType::kInt32: reduce_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count, op); break;
    case DataType::kInt64: reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, op); break;
    case DataType::kUInt8: reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op); break;
    case DataType::kFloat16:
      if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
        sum_half(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
        break;
      }
      reduce_16<half_to_float, float_to_half>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, op);
      break;
    case DataType::kBFloat16:
      if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
        sum_bf16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
        break;
      }
      reduce_16<bf16_to_float, float_to_bf16>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count, op);
      break;
    case DataType::kBytes: break;
  }
}

void finish_avg(void* buf, size_t count, DataType t, ReduceOp op, int world) {
  if (op != ReduceOp::kAvg || world == 1) return;
  switch (t) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      const float w = static_cast<float>(world);
      for (size_t i = 0; i < count; ++i) p[i] /= w;
      break;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] /= world;
      break;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] = float_to_half(half_to_float(p[i]) / world);
      break;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < count; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / world);
      break;
    }
    default: break;  // integers rejected by check_reducible
  }
}

}  // namespace cx::distributed
