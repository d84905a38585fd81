#include "nn/layers/conv2d_direct.h"

#include <immintrin.h>

#include <algorithm>
#include <string>

#include "common/env.h"

namespace cx::nn::direct_conv {

// Note [Direct convolution]
// The GEMMs of Note [Convolution as GEMM] ran these networks' 3x3 convolutions at 50-115 GFLOP/s on an AVX-512
// core whose peak is about 250, where PyTorch's oneDNN reaches 100-175 (benchmarks/README.md, "Convolutional
// networks"): at 16-64 output channels the GEMM is 16-64 rows high, so the unfolded sample that it packs
// (K x P floats, written by the unfolding just before) is used 16-64 times per float read, and unfolding and
// packing cost as much as the multiplications. With stride 1, row (c, i, j) of the unfolding over output row
// oh is the padded image's row c, oh + i from column j on: plain loads from the image. So these kernels read
// the image itself: a block of 8 output channels times 1-3 vectors of 16 output pixels (24 accumulators at
// most, in registers), and for every input channel c, kernel row i and column j, one load of each vector's
// 16 pixels and 8 broadcasts of the weights, 8 FMAs per vector. The weights are packed per call (8 output
// channels' (c, i, j) in a row of 8 floats, zero beyond the last channel), a few KB. The input gradient is the
// same kernel: the convolution of dy, zero-padded by k-1-padding, with the kernel turned half a turn and in and
// out channels swapped (pack's `transposed`). A vector of pixels lies in one output row, so the output width
// must be a multiple of 16; other shapes, strides, dilations and groups keep the GEMMs.

bool available() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          !(env::get("CX_NN_SCALAR") && std::string(env::get("CX_NN_SCALAR")) == "1");
  return yes;
}

namespace {

constexpr size_t kRows = 8;  // output channels per block: one broadcast weight each

size_t blocks_of(size_t O) { return (O + kRows - 1) / kRows; }

// kRows output channels (the first `rows` of them stored) x NV vectors of 16 output pixels: vector v reads the
// image at x + xoff[v] and writes y + yoff[v] (+ r * P for output channel r). wb: this block's packed weights.
template <int NV>
__attribute__((target("avx512f"))) void conv_block(const float* __restrict x, const size_t* xoff,
                                                   float* __restrict y, const size_t* yoff, size_t P, size_t rows,
                                                   const float* __restrict wb, size_t C, size_t plane, size_t Wp,
                                                   size_t k, bool add) {
  __m512 acc[kRows][NV];
#pragma GCC unroll 8
  for (size_t r = 0; r < kRows; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v)
      acc[r][v] = add && r < rows ? _mm512_loadu_ps(y + r * P + yoff[v]) : _mm512_setzero_ps();
  for (size_t c = 0; c < C; ++c) {
    for (size_t i = 0; i < k; ++i) {
      const float* row = x + c * plane + i * Wp;
      for (size_t j = 0; j < k; ++j, wb += kRows) {
        __m512 xv[NV];
#pragma GCC unroll 3
        for (int v = 0; v < NV; ++v) xv[v] = _mm512_loadu_ps(row + j + xoff[v]);
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
// c, kernel row i and columns [j0, j0 + NJ), one vector of 16 pixel lanes each, at acc (stride `per_o` floats from
// one output channel to the next): each lane adds up dy[o][oh][ow] * xp[c][oh+i][ow+j] over its pixels ow of
// every output row oh. dy: output channel o's first pixel; x: image row c, i, shifted by j0.
template <int NJ>
__attribute__((target("avx512f"))) void grad_block(const float* __restrict dy, size_t P, size_t rows,
                                                   const float* __restrict x, size_t Wp, size_t OH, size_t OW,
                                                   float* __restrict acc, size_t per_o) {
  __m512 a[kRows][NJ];
  const float* d[kRows];
#pragma GCC unroll 8
  for (size_t r = 0; r < kRows; ++r) {
    d[r] = dy + (r < rows ? r : 0) * P;
#pragma GCC unroll 3
    for (int j = 0; j < NJ; ++j) a[r][j] = _mm512_loadu_ps(acc + (r < rows ? r : 0) * per_o + j * 16);
  }
  for (size_t oh = 0; oh < OH; ++oh) {
    const float* xr = x + oh * Wp;
    const size_t yr = oh * OW;
    for (size_t ow = 0; ow < OW; ow += 16) {
      __m512 xv[NJ];
#pragma GCC unroll 3
      for (int j = 0; j < NJ; ++j) xv[j] = _mm512_loadu_ps(xr + ow + j);
#pragma GCC unroll 8
      for (size_t r = 0; r < kRows; ++r) {
        __m512 g = _mm512_loadu_ps(d[r] + yr + ow);
        asm("" : "+v"(g));  // one load, in a register: GCC would fold it into each FMA, loading it NJ times
#pragma GCC unroll 3
        for (int j = 0; j < NJ; ++j) a[r][j] = _mm512_fmadd_ps(g, xv[j], a[r][j]);
      }
    }
  }
  for (size_t r = 0; r < rows; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(acc + r * per_o + j * 16, a[r][j]);
}

}  // namespace

void weight_grad(const float* xp, size_t C, size_t Hp, size_t Wp, const float* dy, size_t O, size_t k, size_t OH,
                 size_t OW, float* lanes) {
  const size_t P = OH * OW, kk = k * k, per_o = C * kk * 16;
  for (size_t b = 0; b < blocks_of(O); ++b) {
    const size_t rows = std::min(kRows, O - b * kRows);
    for (size_t c = 0; c < C; ++c)
      for (size_t i = 0; i < k; ++i)
        for (size_t j0 = 0; j0 < k; j0 += 3) {
          const float* x = xp + (c * Hp + i) * Wp + j0;
          float* acc = lanes + b * kRows * per_o + ((c * k + i) * k + j0) * 16;
          const float* d = dy + b * kRows * P;
          if (k - j0 >= 3)
            grad_block<3>(d, P, rows, x, Wp, OH, OW, acc, per_o);
          else if (k - j0 == 2)
            grad_block<2>(d, P, rows, x, Wp, OH, OW, acc, per_o);
          else
            grad_block<1>(d, P, rows, x, Wp, OH, OW, acc, per_o);
        }
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

void forward(const float* xp, size_t C, size_t Hp, size_t Wp, const float* packed, size_t O, size_t k, float* y,
             size_t OH, size_t OW, bool add) {
  const size_t per_row = OW / 16, segments = OH * per_row, P = OH * OW, plane = Hp * Wp, wfloats = C * k * k * kRows;
  for (size_t b = 0; b < blocks_of(O); ++b) {
    const size_t rows = std::min(kRows, O - b * kRows);
    const float* wb = packed + b * wfloats;
    float* yb = y + b * kRows * P;
    for (size_t s = 0; s < segments; s += 3) {
      size_t xoff[3], yoff[3];
      const size_t nv = std::min<size_t>(3, segments - s);
      for (size_t v = 0; v < nv; ++v) {
        const size_t oh = (s + v) / per_row, ow = (s + v) % per_row * 16;
        xoff[v] = oh * Wp + ow;
        yoff[v] = oh * OW + ow;
      }
      if (nv == 3)
        conv_block<3>(xp, xoff, yb, yoff, P, rows, wb, C, plane, Wp, k, add);
      else if (nv == 2)
        conv_block<2>(xp, xoff, yb, yoff, P, rows, wb, C, plane, Wp, k, add);
      else
        conv_block<1>(xp, xoff, yb, yoff, P, rows, wb, C, plane, Wp, k, add);
    }
  }
}

}  // namespace cx::nn::direct_conv
