#include "nn/layers/conv2d_direct.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/env.h"

namespace cx::nn::direct_conv {

// Note [Direct convolution]
// The GEMMs of Note [Convolution as GEMM] ran the ResNet benchmark's 3x3 convolutions at 50-115 GFLOP/s on a core
// whose AVX-512 FMA peak is 240, where PyTorch's oneDNN reaches 110-190: at 16-64 output channels the GEMM is
// 16-64 rows high, so each float of the unfolded sample, which the unfolding has just written and the GEMM then
// packs, is used only 16-64 times, and unfolding and packing cost as much as the multiplications. Yet with stride 1
// row (c, i, j) of the unfolding over output row oh is the padded image's row c, oh + i from column j on: plain
// loads from the image. So these kernels read the image itself.
// - Forward: a block of 8 output channels times 1-3 vectors of 16 output pixels (24 accumulators at most, in
//   registers); for every input channel c, kernel row i and column j, one load of each vector's 16 pixels and 8
//   broadcasts of the weights, 8 FMAs per vector. The weights are packed per call (8 output channels' (c, i, j)
//   in a row of 8 floats, zero beyond the last channel), a few KB.
// - A vector is 16 pixels of one output row, or two rows of 8 (an 8-wide output, ResNets' last stage: its
//   16 floats lie together in y, and its image pixels are two loads of 8, joined by a shuffle).
// - 8-wide outputs of 16, 32, 48 or 64 channels put the output channels in the vector instead (the "by channel"
//   kernels): forward and dx as 6-24 pixels x 1-4 vectors of channels, one weight vector load per vector and one
//   broadcast per pixel for each weight (c, i, j), into a pixel-major copy of the output that is then turned
//   around; the weight gradient as 6-24 weights x 1-4 vectors of channels over the chunk's pixels, from dy turned
//   pixel-major. No half-row shuffles, and no per-sample blocks of 4 vectors.
// - Stride 2 reads every other column: the image is split first (split_columns: each padded row's even
//   columns, then its odd ones, by two AVX-512 permutes per 32 floats), and column j of the kernel is then
//   a plain load from the even or the odd half; rows are every other row, an offset.
// - The input gradient (stride 1) is the same kernel: the convolution of dy, zero-padded by k-1-padding, with
//   the kernel turned half a turn and in and out channels swapped (pack's `transposed`).
// - The weight gradient: 8 output channels x 1-3 kernel columns of one (c, i), 16 lanes each, adding dy's
//   pixels times the image's over the pixels of a chunk of samples (about 1024 output pixels: the 8 channels'
//   dy, copied channel-major, stay in L1), each lane its own partial sum; the 16 lanes of a weight are added
//   up once per batch (add_lanes, in double).
// Threads: Conv2dModule splits the batch into contiguous parts of 4 samples at least on the model math's pool
// (Note [One pool for the model math] in nn/parallel.h; one thread per rank where several share a host, Note
// [Default BLAS threads]; every core for a process alone), each part with scratch of its own; the weight
// gradient's lanes of the parts are added together in part order before add_lanes, so the weight gradient's
// roundings depend on the thread count. A convolution alone (16 channels of 32x32, batch 128) runs 1.9x as fast
// on 2 threads as on one here. When each part started a thread of its own and the rest of the step (ReLU,
// BatchNorm, the GEMMs left in it) ran on OpenBLAS's threads or on one, the ResNet-8 step of one process ran
// 0.8-1.15x as fast on 2 threads as on one; on the pool, with the rest of the step on it too, 1.7-1.8x.
// Measured (benchmarks/README.md, "Direct convolution"), one thread, batch 128, each layer's forward and backward
// with the kernels switched on and off in turn (_conv2d_direct): 3x3 stride 1 at 16 channels of 32x32 1.83x as
// fast, 32 of 16x16 1.65x, 64 of 8x8 1.35x; 3x3 stride 2 from 16 to 32 channels 1.40x, from 32 to 64 (to 8x8)
// 1.28x; the ResNet-8 training step 1.34x at batch 32 and 1.30x at 128. Left to the GEMMs: 1x1 convolutions
// (0.55-0.78x this way: the split image costs more than their small GEMMs), dx of stride 2 (each of its four
// phases a convolution whose width, 17 for 32 columns, is no whole vector), the weight gradient of 8-wide outputs
// whose channels are no multiple of 16 (the lanes kernel measured no faster than the GEMM there: 45-50 against
// 44-48 us a sample at 64 channels of 8x8, whose chunks are 4 vectors of pixels a sample); not written:
// dilations, groups, outputs of other widths.

namespace {
std::atomic<bool> switched_on{true};
}  // namespace

bool available() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          !(env::get("CX_NN_SCALAR") && std::string(env::get("CX_NN_SCALAR")) == "1");
  return yes && switched_on.load(std::memory_order_relaxed);
}

bool switch_on(bool on) { return switched_on.exchange(on); }

namespace {

constexpr size_t kRows = 8;  // output channels per block: one broadcast weight each

size_t blocks_of(size_t O) { return (O + kRows - 1) / kRows; }

// Where the image's column j of a kernel row starts, relative to the first output pixel's: j with stride 1; in the
// split layout of stride 2 (split_columns), the even columns' half or the odd columns' half.
void column_offsets(size_t k, size_t stride, size_t Wp, size_t* coff) {
  for (size_t j = 0; j < k; ++j) coff[j] = stride == 1 ? j : j % 2 * ((Wp + 1) / 2) + j / 2;
}

// 16 image pixels: 16 in one row from p, or (kHalves: outputs 8 wide) 8 from p and 8 from p + next, the next
// output row's.
template <bool kHalves>
__attribute__((target("avx512f"), always_inline)) inline __m512 pixels(const float* p, size_t next) {
  if (!kHalves) return _mm512_loadu_ps(p);
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(p + next)), 1));  // AVX-512F
}

// kRows output channels (the first `rows` of them stored) x NV vectors of 16 output pixels: vector v reads the
// image at x + xoff[v] (and, kHalves, x + xoff[v] + next) and writes y + yoff[v] (+ r * P for output channel r).
// wb: this block's packed weights; coff: column_offsets.
template <int NV, bool kHalves, size_t K>
__attribute__((target("avx512f"))) void conv_block(const float* __restrict x, const size_t* xoff, size_t next,
                                                   float* __restrict y, const size_t* yoff, size_t P, size_t rows,
                                                   const float* __restrict wb, size_t C, size_t plane, size_t Wp,
                                                   size_t k, const size_t* coff, bool add) {
  __m512 acc[kRows][NV];
#pragma GCC unroll 8
  for (size_t r = 0; r < kRows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v)
      acc[r][v] = add && r < rows ? _mm512_loadu_ps(y + r * P + yoff[v]) : _mm512_setzero_ps();
  const size_t kk = K ? K : k;  // K: the kernel's size where known at compile time, its loops unrolled
  for (size_t c = 0; c < C; ++c) {
#pragma GCC unroll 3
    for (size_t i = 0; i < kk; ++i) {
      const float* row = x + c * plane + i * Wp;
#pragma GCC unroll 3
      for (size_t j = 0; j < kk; ++j, wb += kRows) {
        __m512 xv[NV];
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) xv[v] = pixels<kHalves>(row + coff[j] + xoff[v], next);
#pragma GCC unroll 8
        for (size_t r = 0; r < kRows; ++r) {
          const __m512 w = _mm512_set1_ps(wb[r]);
#pragma GCC unroll 3
          for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(w, xv[v], acc[r][v]);
        }
      }
    }
  }
  for (size_t r = 0; r < rows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + r * P + yoff[v], acc[r][v]);
}

// The weight gradient's partial sums of output channels [o, o + 8) (the first `rows` of them real), input channel
// c, kernel row i and NJ kernel columns, one vector of 16 pixel lanes each, at acc (stride `per_o` floats from
// one output channel to the next): each lane adds up dy[o][oh][ow] * image[c][s*oh + i][s*ow + j] over its
// pixels. dy: output channel o's pixels of the chunk's samples, 16 a vector (`row` floats from one channel to the
// next); vector t's image pixels are at x + xoff[t] for the NJ columns' column_offsets coff. One loop over the T
// vectors of the chunk (rows of one vector each at 16 x 16 outputs).
template <int NJ>
__attribute__((target("avx512f"))) void grad_block(const float* __restrict dy, size_t row, size_t rows,
                                                   const float* __restrict x, const size_t* xoff, size_t T,
                                                   const size_t* coff, float* __restrict acc, size_t per_o) {
  __m512 a[kRows][NJ];
  const float* d[kRows];
#pragma GCC unroll 8
  for (size_t r = 0; r < kRows; ++r) {
    d[r] = dy + (r < rows ? r : 0) * row;
#pragma GCC unroll 3
    for (int j = 0; j < NJ; ++j) a[r][j] = _mm512_loadu_ps(acc + (r < rows ? r : 0) * per_o + j * 16);
  }
  for (size_t t = 0; t < T; ++t) {
    const float* xt = x + xoff[t];
    __m512 xv[NJ];
#pragma GCC unroll 3
    for (int j = 0; j < NJ; ++j) xv[j] = _mm512_loadu_ps(xt + coff[j]);
#pragma GCC unroll 8
    for (size_t r = 0; r < kRows; ++r) {
      __m512 g = _mm512_loadu_ps(d[r] + 16 * t);
      asm("" : "+v"(g));  // one load, in a register: GCC would fold it into each FMA, loading it NJ times
#pragma GCC unroll 3
      for (int j = 0; j < NJ; ++j) a[r][j] = _mm512_fmadd_ps(g, xv[j], a[r][j]);
    }
  }
  for (size_t r = 0; r < rows; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(acc + r * per_o + j * 16, a[r][j]);
}

template <bool kHalves>
void conv_blocks(const float* xp, size_t C, size_t Hp, size_t Wp, size_t stride, const float* packed, size_t O,
                 size_t k, float* y, size_t OH, size_t OW, bool add) {
  // A segment is 16 output pixels: a 16th of a row, or (kHalves) two rows of 8.
  const size_t per_row = kHalves ? 1 : OW / 16, segments = kHalves ? OH / 2 : OH * per_row;
  const size_t P = OH * OW, plane = Hp * Wp, wfloats = C * k * k * kRows, rstep = stride * Wp;
  size_t coff[kMaxKernel];
  column_offsets(k, stride, Wp, coff);
  for (size_t b = 0; b < blocks_of(O); ++b) {
    const size_t rows = std::min(kRows, O - b * kRows);
    const float* wb = packed + b * wfloats;
    float* yb = y + b * kRows * P;
    for (size_t s = 0, nv = 0; s < segments; s += nv) {
      size_t xoff[3], yoff[3];
      nv = segments - s == 4 ? 2 : std::min<size_t>(3, segments - s);  // 3, ..., 3, 2, 2 rather than 3, 1
      for (size_t v = 0; v < nv; ++v) {
        const size_t oh = kHalves ? 2 * (s + v) : (s + v) / per_row, ow = kHalves ? 0 : (s + v) % per_row * 16;
        xoff[v] = oh * rstep + ow;
        yoff[v] = oh * OW + ow;
      }
      if (nv == 3 && k == 3)
        conv_block<3, kHalves, 3>(xp, xoff, rstep, yb, yoff, P, rows, wb, C, plane, Wp, k, coff, add);
      else if (nv == 3)
        conv_block<3, kHalves, 0>(xp, xoff, rstep, yb, yoff, P, rows, wb, C, plane, Wp, k, coff, add);
      else if (nv == 2)
        conv_block<2, kHalves, 0>(xp, xoff, rstep, yb, yoff, P, rows, wb, C, plane, Wp, k, coff, add);
      else
        conv_block<1, kHalves, 0>(xp, xoff, rstep, yb, yoff, P, rows, wb, C, plane, Wp, k, coff, add);
    }
  }
}

}  // namespace

bool fits(size_t k, size_t OH, size_t OW) {
  return k <= kMaxKernel && OH > 0 && ((OW > 0 && OW % 16 == 0) || (OW == 8 && OH % 2 == 0));
}

void pad_image(const float* x, size_t C, size_t H, size_t W, size_t p, float* out) {
  const size_t Hp = H + 2 * p, Wp = W + 2 * p;
  for (size_t c = 0; c < C; ++c)
    for (size_t r = 0; r < Hp; ++r, out += Wp) {
      if (r < p || r - p >= H) {
        std::fill(out, out + Wp, 0.0f);
        continue;
      }
      std::fill(out, out + p, 0.0f);
      std::copy(x + (c * H + r - p) * W, x + (c * H + r - p + 1) * W, out + p);
      std::fill(out + p + W, out + Wp, 0.0f);
    }
}

__attribute__((target("avx512f"))) void split_columns(const float* x, size_t C, size_t H, size_t W, size_t p,
                                                      float* out) {
  const size_t Hp = H + 2 * p, Wp = W + 2 * p, We = (Wp + 1) / 2, Wo = Wp / 2;
  // Lanes 0-15: the even floats of two vectors, 16-31 the odd ones.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (size_t c = 0; c < C; ++c)
    for (size_t r = 0; r < Hp; ++r, out += Wp) {
      if (r < p || r - p >= H) {
        std::fill(out, out + Wp, 0.0f);
        continue;
      }
      const uintptr_t src = reinterpret_cast<uintptr_t>(x + (c * H + r - p) * W);
      // Padded columns 2m .. 2m + 31, the sample's 2m - p .. 2m - p + 31: the lanes outside the row are masked
      // off (read as zeros, never touched: the padding).
      for (size_t m = 0; m < We; m += 16) {
        const size_t lo = std::min<size_t>(32, 2 * m < p ? p - 2 * m : 0);
        const size_t hi = W + p > 2 * m ? std::min<size_t>(32, W + p - 2 * m) : 0;
        const uint64_t lanes = ((1ull << hi) - 1) & ~((1ull << lo) - 1);
        const void* at = reinterpret_cast<const void*>(src + (2 * m - p) * sizeof(float));  // wraps where 2m < p
        const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes), at);
        const __m512 b = _mm512_maskz_loadu_ps(static_cast<__mmask16>(lanes >> 16),
                                               reinterpret_cast<const float*>(at) + 16);
        const auto keep = [](size_t n) { return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1); };
        _mm512_mask_storeu_ps(out + m, keep(We - m), _mm512_permutex2var_ps(a, even, b));
        if (m < Wo) _mm512_mask_storeu_ps(out + We + m, keep(Wo - m), _mm512_permutex2var_ps(a, odd, b));
      }
    }
}

void weight_grad(const float* xp, size_t n, size_t C, size_t Hp, size_t Wp, size_t stride, const float* dy,
                 size_t O, size_t k, size_t OH, size_t OW, float* lanes) {
  // dy is channel-major: one output channel's n samples after each other, so the 8 rows a block reads lie
  // together (samples O * P floats apart, a multiple of 4 KB, would meet in the same sets of L1), and its
  // vectors follow each other.
  const size_t P = OH * OW, kk = k * k, per_o = C * kk * 16, image_floats = C * Hp * Wp, row = n * P;
  const size_t rstep = stride * Wp, T = row / 16;
  size_t coff[kMaxKernel];
  column_offsets(k, stride, Wp, coff);
  std::vector<size_t> xoff;
  xoff.reserve(T);
  for (size_t m = 0; m < n; ++m)
    for (size_t oh = 0; oh < OH; ++oh)
      for (size_t ow = 0; ow < OW; ow += 16) xoff.push_back(m * image_floats + oh * rstep + ow);
  for (size_t b = 0; b < blocks_of(O); ++b) {
    const size_t rows = std::min(kRows, O - b * kRows);
    for (size_t c = 0; c < C; ++c)
      for (size_t i = 0; i < k; ++i)
        for (size_t j0 = 0; j0 < k; j0 += 3) {
          const float* x = xp + (c * Hp + i) * Wp;
          float* acc = lanes + b * kRows * per_o + ((c * k + i) * k + j0) * 16;
          const float* d = dy + b * kRows * row;
          if (k - j0 >= 3)
            grad_block<3>(d, row, rows, x, xoff.data(), T, coff + j0, acc, per_o);
          else if (k - j0 == 2)
            grad_block<2>(d, row, rows, x, xoff.data(), T, coff + j0, acc, per_o);
          else
            grad_block<1>(d, row, rows, x, xoff.data(), T, coff + j0, acc, per_o);
        }
  }
}

namespace {

// The weight gradient with output channels in the vector: MV vectors of 16 output channels x NQ weights (c, i, j)
// of the kernel, over the T pixels of a chunk: acc[q][o] += dyT[t][o] * image pixel (t, q), one broadcast per
// pixel and weight. dyT is pixel-major (T x O); pixel t of weight q is at x + xoff[t] + qoff[q].
template <int MV, int NQ>
__attribute__((target("avx512f"))) void tgrad_block(const float* __restrict dyT, size_t O, const float* __restrict x,
                                                    const size_t* xoff, size_t T, const size_t* qoff, size_t nq,
                                                    float* __restrict acc) {
  __m512 a[NQ][MV];
#pragma GCC unroll 24
  for (int q = 0; q < NQ; ++q)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) a[q][v] = q < static_cast<int>(nq) ? _mm512_loadu_ps(acc + q * O + 16 * v)
                                                                    : _mm512_setzero_ps();
  for (size_t t = 0; t < T; ++t) {
    __m512 g[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) g[v] = _mm512_loadu_ps(dyT + t * O + 16 * v);
    const float* xt = x + xoff[t];
#pragma GCC unroll 24
    for (int q = 0; q < NQ; ++q) {
      const __m512 b = _mm512_set1_ps(xt[qoff[q]]);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) a[q][v] = _mm512_fmadd_ps(b, g[v], a[q][v]);
    }
  }
  for (int q = 0; q < static_cast<int>(nq); ++q)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(acc + q * O + 16 * v, a[q][v]);
}

template <int MV, int NQ>
void tgrad_blocks(const float* dyT, size_t O, const float* x, const size_t* xoff, size_t T, const size_t* qoff,
                  size_t K, float* acc) {
  for (size_t q0 = 0; q0 < K; q0 += NQ) {
    const size_t nq = std::min<size_t>(NQ, K - q0);
    // A short last block reads weights past K: point them at weight 0 (its sums are not stored).
    size_t offs[NQ];
    for (size_t q = 0; q < NQ; ++q) offs[q] = qoff[q < nq ? q0 + q : 0];
    tgrad_block<MV, NQ>(dyT, O, x, xoff, T, offs, nq, acc + q0 * O);
  }
}

// Forward with output channels in the vector: NP pixels x MV vectors of 16 output channels, over the K weights
// (c, i, j): yT[p][o] = sum over q of wt[q][o] * image pixel (p, q). wt is K x O; pixel p of weight q is at
// x + xoff[p] + qoff[q]; yT rows of O (the first np pixels stored).
template <int MV, int NP>
__attribute__((target("avx512f"))) void tconv_block(const float* __restrict wt, size_t O, size_t K,
                                                    const float* __restrict x, const size_t* xoff,
                                                    const size_t* qoff, size_t np, float* __restrict yT) {
  __m512 a[NP][MV];
#pragma GCC unroll 24
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) a[p][v] = _mm512_setzero_ps();
  const float* xp[NP];
#pragma GCC unroll 24
  for (int p = 0; p < NP; ++p) xp[p] = x + xoff[p < static_cast<int>(np) ? p : 0];
  for (size_t q = 0; q < K; ++q) {
    __m512 w[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) w[v] = _mm512_loadu_ps(wt + q * O + 16 * v);
    const size_t off = qoff[q];
#pragma GCC unroll 24
    for (int p = 0; p < NP; ++p) {
      const __m512 b = _mm512_set1_ps(xp[p][off]);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) a[p][v] = _mm512_fmadd_ps(b, w[v], a[p][v]);
    }
  }
  for (int p = 0; p < static_cast<int>(np); ++p)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(yT + p * O + 16 * v, a[p][v]);
}

template <int MV, int NP>
void tconv_blocks(const float* wt, size_t O, size_t K, const float* x, const size_t* xoff, size_t P,
                  const size_t* qoff, float* yT) {
  for (size_t p0 = 0; p0 < P; p0 += NP)
    tconv_block<MV, NP>(wt, O, K, x, xoff + p0, qoff, std::min<size_t>(NP, P - p0), yT + p0 * O);
}

}  // namespace

void pack_by_channel(const float* w, size_t O, size_t C, size_t k, bool transposed, float* out) {
  const size_t kk = k * k;
  for (size_t c = 0; c < C; ++c)
    for (size_t i = 0; i < k; ++i)
      for (size_t j = 0; j < k; ++j, out += O)
        for (size_t o = 0; o < O; ++o)
          out[o] = transposed ? w[(c * O + o) * kk + (k - 1 - i) * k + (k - 1 - j)] : w[(o * C + c) * kk + i * k + j];
}

void forward_by_channel(const float* xp, size_t C, size_t Hp, size_t Wp, size_t stride, const float* wt, size_t O,
                        size_t k, float* y, size_t OH, size_t OW, bool add, float* yT) {
  const size_t K = C * k * k, P = OH * OW;
  size_t coff[kMaxKernel], xoff[kMaxPixels];
  column_offsets(k, stride, Wp, coff);
  std::vector<size_t> qoff(K);
  for (size_t c = 0; c < C; ++c)
    for (size_t i = 0; i < k; ++i)
      for (size_t j = 0; j < k; ++j) qoff[(c * k + i) * k + j] = c * Hp * Wp + i * Wp + coff[j];
  for (size_t oh = 0, t = 0; oh < OH; ++oh)
    for (size_t ow = 0; ow < OW; ++ow, ++t) xoff[t] = oh * stride * Wp + ow;
  switch (O / 16) {
    case 1: tconv_blocks<1, 24>(wt, O, K, xp, xoff, P, qoff.data(), yT); break;
    case 2: tconv_blocks<2, 12>(wt, O, K, xp, xoff, P, qoff.data(), yT); break;
    case 3: tconv_blocks<3, 8>(wt, O, K, xp, xoff, P, qoff.data(), yT); break;
    default: tconv_blocks<4, 6>(wt, O, K, xp, xoff, P, qoff.data(), yT); break;
  }
  for (size_t o = 0; o < O; ++o)
    for (size_t p = 0; p < P; ++p) y[o * P + p] = (add ? y[o * P + p] : 0.0f) + yT[p * O + o];
}

bool fits_channels(size_t O) { return O % 16 == 0 && O <= 64; }

void weight_grad_by_channel(const float* xp, size_t n, size_t C, size_t Hp, size_t Wp, size_t stride,
                            const float* dyT, size_t O, size_t k, size_t OH, size_t OW, float* acc) {
  const size_t K = C * k * k, image_floats = C * Hp * Wp, T = n * OH * OW;
  size_t coff[kMaxKernel];
  column_offsets(k, stride, Wp, coff);
  std::vector<size_t> qoff(K), xoff(T);
  for (size_t c = 0; c < C; ++c)
    for (size_t i = 0; i < k; ++i)
      for (size_t j = 0; j < k; ++j) qoff[(c * k + i) * k + j] = c * Hp * Wp + i * Wp + coff[j];
  for (size_t m = 0, t = 0; m < n; ++m)
    for (size_t oh = 0; oh < OH; ++oh)
      for (size_t ow = 0; ow < OW; ++ow, ++t) xoff[t] = m * image_floats + oh * stride * Wp + ow;
  switch (O / 16) {
    case 1: return tgrad_blocks<1, 24>(dyT, O, xp, xoff.data(), T, qoff.data(), K, acc);
    case 2: return tgrad_blocks<2, 12>(dyT, O, xp, xoff.data(), T, qoff.data(), K, acc);
    case 3: return tgrad_blocks<3, 8>(dyT, O, xp, xoff.data(), T, qoff.data(), K, acc);
    default: return tgrad_blocks<4, 6>(dyT, O, xp, xoff.data(), T, qoff.data(), K, acc);
  }
}

void add_lanes(const float* lanes, size_t n, float* dw) {
  for (size_t i = 0; i < n; ++i, lanes += 16) {
    double s = 0;  // 16 partial sums of one weight's gradient, added up once per batch
    for (size_t l = 0; l < 16; ++l) s += lanes[l];
    dw[i] += static_cast<float>(s);
  }
}

size_t packed_floats(size_t O, size_t C, size_t k) { return blocks_of(O) * C * k * k * kRows; }

void pack(const float* w, size_t O, size_t C, size_t k, bool transposed, float* out) {
  const size_t kk = k * k;
  for (size_t b = 0; b < blocks_of(O); ++b)
    for (size_t c = 0; c < C; ++c)
      for (size_t i = 0; i < k; ++i)
        for (size_t j = 0; j < k; ++j, out += kRows)
          for (size_t r = 0; r < kRows; ++r) {
            const size_t o = b * kRows + r;
            out[r] = o >= O         ? 0.0f
                     : transposed ? w[(c * O + o) * kk + (k - 1 - i) * k + (k - 1 - j)]
                                  : w[(o * C + c) * kk + i * k + j];
          }
}

void forward(const float* xp, size_t C, size_t Hp, size_t Wp, size_t stride, const float* packed, size_t O,
             size_t k, float* y, size_t OH, size_t OW, bool add) {
  if (OW == 8)
    conv_blocks<true>(xp, C, Hp, Wp, stride, packed, O, k, y, OH, OW, add);
  else
    conv_blocks<false>(xp, C, Hp, Wp, stride, packed, O, k, y, OH, OW, add);
}

}  // namespace cx::nn::direct_conv
