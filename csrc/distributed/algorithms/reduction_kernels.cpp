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

// SUM of float16 / bfloat16, the hot case of the 16-bit communication hooks:
// the same widen-add-round as reduce_16, eight lanes at a time (F16C's
// conversions round to nearest even, as float_to_half) or written branch-free
// so the compiler vectorises it (bfloat16, NaN kept quiet as float_to_bf16).
#if CX_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void sum_half_f16c(uint16_t* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_add_ps(a, b), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) d[i] = float_to_half(half_to_float(d[i]) + half_to_float(s[i]));
}

bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

void sum_bf16(uint16_t* __restrict d, const uint16_t* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = static_cast<uint32_t>(d[i]) << 16, b = static_cast<uint32_t>(s[i]) << 16;
    float fa, fb;
    std::memcpy(&fa, &a, 4);
    std::memcpy(&fb, &b, 4);
    const float f = fa + fb;
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? ((x >> 16) | 0x40u) : rounded);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t count, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: reduce_typed(static_cast<float*>(dst), static_cast<const float*>(src), count, op); break;
    case DataType::kFloat64: reduce_typed(static_cast<double*>(dst), static_cast<const double*>(src), count, op); break;
    case DataType::kInt32: reduce_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count, op); break;
    case DataType::kInt64: reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, op); break;
    case DataType::kUInt8: reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op); break;
    case DataType::kFloat16:
#if CX_HAVE_F16C_PATH
      if ((op == ReduceOp::kSum || op == ReduceOp::kAvg) && have_f16c()) {
        sum_half_f16c(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
        break;
      }
#endif
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
