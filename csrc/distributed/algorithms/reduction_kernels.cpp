#include "distributed/algorithms/reduction_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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

// Round to nearest even, NaN kept quiet; branch-free, so that loops over it vectorise.
uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? ((x >> 16) | 0x40u) : rounded);
}

namespace {

// The elements (at + j) of the lanes j set in `mask` hold `rank`'s non-finite values.
void record_lanes(ReduceProbe& p, int rank, size_t at, unsigned mask) {
  for (unsigned j = 0; j < 8; ++j)
    if (mask >> j & 1u) p.add(rank, at + j, at + j + 1);
}

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
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {  // floats never get here (check_reducible)
        if (op == ReduceOp::kBand) apply(d, s, n, [](T a, T b) { return static_cast<T>(a & b); });
        if (op == ReduceOp::kBor) apply(d, s, n, [](T a, T b) { return static_cast<T>(a | b); });
        if (op == ReduceOp::kBxor) apply(d, s, n, [](T a, T b) { return static_cast<T>(a ^ b); });
      }
      break;
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
      case ReduceOp::kBand:  // integers and bool only (check_reducible)
      case ReduceOp::kBor:
      case ReduceOp::kBxor:
      case ReduceOp::kNone: break;
    }
    d[i] = FromF(r);
  }
}

// ---- 16-bit floats: the SUM of the hooks' all-reduces, and the casts around it ----
//
// One codec per type says how an element narrows and widens: float_to_bf16
// (the top half of a float32, rounded to nearest even, NaN kept quiet) and
// float_to_half, and their inverses. The loops are written once over a codec;
// their AVX2 forms (with F16C for float16) do the same arithmetic eight lanes
// at a time and give the same bits as the scalar definition, so ranks with and
// without AVX2 agree.

struct Bf16 {
  static uint16_t narrow1(float f) { return float_to_bf16(f); }
  static float widen1(uint16_t b) { return bf16_to_float(b); }
};

struct Half {
  static uint16_t narrow1(float f) { return float_to_half(f); }
  static float widen1(uint16_t h) { return half_to_float(h); }
};

// The loops, from element `i` on; the vector forms call them for their tails.
template <class C>
void sum_from(size_t i, uint16_t* __restrict d, const uint16_t* __restrict s, size_t n) {
  for (; i < n; ++i) d[i] = C::narrow1(C::widen1(d[i]) + C::widen1(s[i]));
}

template <class C>
void narrow_from(size_t i, const float* __restrict src, float scale, uint16_t* __restrict dst, size_t n) {
  for (; i < n; ++i) dst[i] = C::narrow1(src[i] * scale);
}

template <class C>
void widen_from(size_t i, const uint16_t* __restrict src, float* __restrict dst, size_t n) {
  for (; i < n; ++i) dst[i] = C::widen1(src[i]);
}

template <class C>
void narrow_sum_from(size_t i, const float* __restrict own, float scale, const uint16_t* __restrict recv,
                     uint16_t* __restrict dst, size_t n) {
  for (; i < n; ++i) dst[i] = C::narrow1(C::widen1(C::narrow1(own[i] * scale)) + C::widen1(recv[i]));
}

// The tested forms (narrow_tested, ...): the loop above, then whether any float32 of [i, n) is inf/NaN.
inline bool any_nonfinite(const float* p, size_t i, size_t n) {
  uint32_t worst = 0;
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, p + i, sizeof b);
    worst = std::max(worst, b & 0x7fffffffu);
  }
  return worst >= 0x7f800000u;
}

template <class C>
bool narrow_tested_from(size_t i, const float* __restrict src, float scale, uint16_t* __restrict dst, size_t n) {
  narrow_from<C>(i, src, scale, dst, n);
  return any_nonfinite(src, i, n);
}

template <class C>
bool widen_tested_from(size_t i, const uint16_t* __restrict src, float* __restrict dst, size_t n) {
  widen_from<C>(i, src, dst, n);
  return any_nonfinite(dst, i, n);
}

template <class C>
bool narrow_sum_tested_from(size_t i, const float* __restrict own, float scale, const uint16_t* __restrict recv,
                            uint16_t* __restrict dst, size_t n) {
  narrow_sum_from<C>(i, own, scale, recv, dst, n);
  return any_nonfinite(own, i, n);
}

#if CX_HAVE_F16C_PATH
#define CX_SIMD __attribute__((target("avx2,f16c")))

// Eight lanes of a codec: load widens, store narrows, round narrows and widens back.
struct Bf16x8 : Bf16 {
  // narrow1 on each 32-bit lane: each ends holding its 16-bit result.
  CX_SIMD static __m256i narrow_lanes(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(x, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                              _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, quiet, is_nan);
  }
  CX_SIMD static __m256 as_float(__m256i lanes) { return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16)); }
  CX_SIMD static __m256 load(const uint16_t* p) {
    return as_float(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // Lanes below 2^16 pack without saturating, within each 128-bit half; then the
  // two halves' low quads are brought together.
  CX_SIMD static void store(uint16_t* p, __m256 v) {
    const __m256i l = narrow_lanes(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(l, l), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  CX_SIMD static __m256 round(__m256 v) { return as_float(narrow_lanes(v)); }
};

struct Halfx8 : Half {
  CX_SIMD static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  CX_SIMD static void store(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  CX_SIMD static __m256 round(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
};

template <class L>
CX_SIMD void sum_x8(uint16_t* d, const uint16_t* s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) L::store(d + i, _mm256_add_ps(L::load(d + i), L::load(s + i)));
  sum_from<L>(i, d, s, n);
}

template <class L>
CX_SIMD void narrow_x8(const float* src, float scale, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) L::store(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), k));
  narrow_from<L>(i, src, scale, dst, n);
}

template <class L>
CX_SIMD void widen_x8(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, L::load(src + i));
  widen_from<L>(i, src, dst, n);
}

template <class L>
CX_SIMD void narrow_sum_x8(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    L::store(dst + i, _mm256_add_ps(L::round(_mm256_mul_ps(_mm256_loadu_ps(own + i), k)), L::load(recv + i)));
  narrow_sum_from<L>(i, own, scale, recv, dst, n);
}

// Lanes of v that are inf or NaN: |v| (the bits, sign cleared) above FLT_MAX's.
CX_SIMD inline __m256i nonfinite_lanes(__m256 v) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)),
                            _mm256_set1_epi32(0x7f7fffff));
}

// The tested casts: each loop of the casts above with the lanes' test OR'ed in.
template <class L>
CX_SIMD bool narrow_tested_x8(const float* src, float scale, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  __m256i bad = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    bad = _mm256_or_si256(bad, nonfinite_lanes(v));
    L::store(dst + i, _mm256_mul_ps(v, k));
  }
  return narrow_tested_from<L>(i, src, scale, dst, n) || !_mm256_testz_si256(bad, bad);
}

template <class L>
CX_SIMD bool widen_tested_x8(const uint16_t* src, float* dst, size_t n) {
  __m256i bad = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = L::load(src + i);
    bad = _mm256_or_si256(bad, nonfinite_lanes(v));
    _mm256_storeu_ps(dst + i, v);
  }
  return widen_tested_from<L>(i, src, dst, n) || !_mm256_testz_si256(bad, bad);
}

template <class L>
CX_SIMD bool narrow_sum_tested_x8(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n) {
  const __m256 k = _mm256_set1_ps(scale);
  __m256i bad = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(own + i);
    bad = _mm256_or_si256(bad, nonfinite_lanes(v));
    L::store(dst + i, _mm256_add_ps(L::round(_mm256_mul_ps(v, k)), L::load(recv + i)));
  }
  return narrow_sum_tested_from<L>(i, own, scale, recv, dst, n) || !_mm256_testz_si256(bad, bad);
}

CX_SIMD void sum_probed_x8(float* __restrict d, const float* __restrict s, size_t n, const SumProbe& k,
                           ReduceProbe& theirs, size_t* i_out, bool* out_bad) {
  const __m256i want_ours = _mm256_set1_epi32(k.ours >= 0 ? -1 : 0);
  const __m256i want_theirs = _mm256_set1_epi32(k.theirs >= 0 ? -1 : 0);
  __m256i out = _mm256_setzero_si256();
  size_t i = 0;
  // A NaN or inf in a or b makes a + b NaN or inf, so only the sums are tested
  // on the common path, sixteen at a time; where one is not finite (rare), the
  // eight lanes around it are looked into.
  auto look_into = [&](size_t at, __m256 a, __m256 b, __m256i bad) CX_SIMD {
    out = _mm256_or_si256(out, bad);
    const __m256i na = _mm256_and_si256(nonfinite_lanes(a), want_ours);
    const __m256i nb = _mm256_and_si256(nonfinite_lanes(b), want_theirs);
    const unsigned ma = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(na)));
    const unsigned mb = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(nb)));
    if (ma) record_lanes(*k.probe, k.ours, k.base + at, ma);
    if (mb) record_lanes(theirs, k.theirs, k.base + at, mb);
  };
  for (; i + 16 <= n; i += 16) {
    const __m256 a0 = _mm256_loadu_ps(d + i), b0 = _mm256_loadu_ps(s + i), r0 = _mm256_add_ps(a0, b0);
    const __m256 a1 = _mm256_loadu_ps(d + i + 8), b1 = _mm256_loadu_ps(s + i + 8), r1 = _mm256_add_ps(a1, b1);
    _mm256_storeu_ps(d + i, r0);
    _mm256_storeu_ps(d + i + 8, r1);
    const __m256i bad0 = nonfinite_lanes(r0), bad1 = nonfinite_lanes(r1);
    const __m256i bad = _mm256_or_si256(bad0, bad1);
    if (__builtin_expect(!_mm256_testz_si256(bad, bad), 0)) {  // rare: name the elements
      look_into(i, a0, b0, bad0);
      look_into(i + 8, a1, b1, bad1);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(d + i), b = _mm256_loadu_ps(s + i), r = _mm256_add_ps(a, b);
    _mm256_storeu_ps(d + i, r);
    const __m256i bad = nonfinite_lanes(r);
    if (__builtin_expect(!_mm256_testz_si256(bad, bad), 0)) look_into(i, a, b, bad);
  }
  *i_out = i;
  *out_bad = !_mm256_testz_si256(out, out);
}

bool have_simd() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}

// Runs f<Vector codec> where the CPU has AVX2 and F16C, f<Scalar codec> otherwise.
#define CX_DISPATCH16(wire, vec, scalar, ...)                                                            \
  ((wire) == DataType::kBFloat16 ? (have_simd() ? vec<Bf16x8>(__VA_ARGS__) : scalar<Bf16>(0, __VA_ARGS__)) \
                                 : (have_simd() ? vec<Halfx8>(__VA_ARGS__) : scalar<Half>(0, __VA_ARGS__)))
#else
#define CX_DISPATCH16(wire, vec, scalar, ...) \
  ((wire) == DataType::kBFloat16 ? scalar<Bf16>(0, __VA_ARGS__) : scalar<Half>(0, __VA_ARGS__))
#endif

}  // namespace

void narrow(const float* src, float scale, uint16_t* dst, size_t n, DataType wire) {
  CX_DISPATCH16(wire, narrow_x8, narrow_from, src, scale, dst, n);
}

void widen(const uint16_t* src, float* dst, size_t n, DataType wire) {
  CX_DISPATCH16(wire, widen_x8, widen_from, src, dst, n);
}

void narrow_sum(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n, DataType wire) {
  CX_DISPATCH16(wire, narrow_sum_x8, narrow_sum_from, own, scale, recv, dst, n);
}

bool narrow_tested(const float* src, float scale, uint16_t* dst, size_t n, DataType wire) {
  return CX_DISPATCH16(wire, narrow_tested_x8, narrow_tested_from, src, scale, dst, n);
}

bool widen_tested(const uint16_t* src, float* dst, size_t n, DataType wire) {
  return CX_DISPATCH16(wire, widen_tested_x8, widen_tested_from, src, dst, n);
}

bool narrow_sum_tested(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n, DataType wire) {
  return CX_DISPATCH16(wire, narrow_sum_tested_x8, narrow_sum_tested_from, own, scale, recv, dst, n);
}

namespace {
void sum_16(uint16_t* d, const uint16_t* s, size_t n, DataType wire) { CX_DISPATCH16(wire, sum_x8, sum_from, d, s, n); }
}  // namespace

namespace {
constexpr uint32_t kNonFiniteBits = 0x7f800000u;
inline bool nonfinite(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x7fffffffu) >= kNonFiniteBits;
}
}  // namespace

void sum_probed(float* dst, const float* src, size_t n, const SumProbe& k) {
  // The other rank's elements are gathered apart and appended at the end, so
  // that ours and theirs, both bad, do not split each other's ranges.
  thread_local ReduceProbe theirs;
  theirs.clear();
  size_t i = 0;
  bool out_bad = false;
#if CX_HAVE_F16C_PATH
  if (have_simd()) sum_probed_x8(dst, src, n, k, theirs, &i, &out_bad);
#endif
  for (; i < n; ++i) {
    const float a = dst[i], b = src[i], r = a + b;
    dst[i] = r;
    out_bad |= nonfinite(r);
    if (k.ours >= 0 && nonfinite(a)) k.probe->add(k.ours, k.base + i, k.base + i + 1);
    if (k.theirs >= 0 && nonfinite(b)) theirs.add(k.theirs, k.base + i, k.base + i + 1);
  }
  for (const BadValues& b : theirs.bad) k.probe->add(b.rank, b.begin, b.end);
  if (out_bad && k.finishes) k.probe->result_bad = true;
}

void probe_whole(ReduceProbe& p, const float* buf, size_t n, size_t base, int rank, bool own) {
  for (size_t i = 0; i < n; ++i) {
    if (!nonfinite(buf[i])) continue;
    if (!own) {
      p.result_bad = true;
      return;
    }
    p.add(rank, base + i, base + i + 1);
  }
}

void reduce_into(void* dst, const void* src, size_t count, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: reduce_typed(static_cast<float*>(dst), static_cast<const float*>(src), count, op); break;
    case DataType::kFloat64: reduce_typed(static_cast<double*>(dst), static_cast<const double*>(src), count, op); break;
    case DataType::kInt32: reduce_typed(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count, op); break;
    case DataType::kInt64: reduce_typed(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count, op); break;
    case DataType::kUInt8: reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, op); break;
    case DataType::kInt8: reduce_typed(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), count, op); break;
    case DataType::kBool: {
      // 0/1 bytes: "or" is MAX, "and" is MIN; "exclusive or" of 0s and 1s stays 0 or 1.
      ReduceOp as = ReduceOp::kMin;  // PRODUCT, MIN, BAND
      if (op == ReduceOp::kSum || op == ReduceOp::kMax || op == ReduceOp::kBor) as = ReduceOp::kMax;
      if (op == ReduceOp::kBxor) as = ReduceOp::kBxor;
      reduce_typed(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), count, as);
      break;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      auto* s = static_cast<const uint16_t*>(src);
      if (op == ReduceOp::kSum || op == ReduceOp::kAvg)
        sum_16(d, s, count, t);
      else if (t == DataType::kFloat16)
        reduce_16<half_to_float, float_to_half>(d, s, count, op);
      else
        reduce_16<bf16_to_float, float_to_bf16>(d, s, count, op);
      break;
    }
    case DataType::kBytes: break;
  }
}

// A world that is a power of two multiplies by its reciprocal, which is exact:
// x * 2^-k and x / 2^k are the same correctly rounded value, bit for bit
// (subnormal results too), and a multiply costs a fraction of a divide (the
// divide was 1.3% of the CPU of a 2-rank MLP step: 100 k floats a step).
void finish_avg(void* buf, size_t count, DataType t, ReduceOp op, int world) {
  if (op != ReduceOp::kAvg || world == 1) return;
  const bool pow2 = (world & (world - 1)) == 0;
  switch (t) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      const float w = static_cast<float>(world), r = 1.0f / w;
      if (pow2) {
        for (size_t i = 0; i < count; ++i) p[i] *= r;
      } else {
        for (size_t i = 0; i < count; ++i) p[i] /= w;
      }
      break;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      const double w = world, r = 1.0 / w;
      if (pow2) {
        for (size_t i = 0; i < count; ++i) p[i] *= r;
      } else {
        for (size_t i = 0; i < count; ++i) p[i] /= w;
      }
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
