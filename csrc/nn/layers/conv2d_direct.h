// defines: direct_conv, the AVX-512 kernels that compute a convolution of stride 1 or 2 straight from the
// samples' zero-padded images, without unfolding them (Note [Direct convolution] in conv2d_direct.cpp).
#pragma once

#include <cstddef>

namespace cx::nn::direct_conv {

// Whether this CPU runs the kernels (AVX-512F), CX_NN_SCALAR is not 1 (which keeps the GEMMs), and they are
// switched on.
bool available();
// For tests and benchmarks (A/B in one process): switches the kernels on or off; returns the previous setting.
bool switch_on(bool on);

constexpr size_t kMaxKernel = 16;

// Whether the kernels take k x k kernels with outputs OH x OW: OW a multiple of 16 (a vector of output pixels),
// or 8 with OH even (a vector is two output rows).
bool fits(size_t k, size_t OH, size_t OW);

// The image the kernels read, C x Hp x Wp floats written to `out`: the sample x (C, H, W) zero-padded by p; for
// stride 2 (split_columns) each padded row (Wp = W + 2p) as its even columns, then its odd ones.
void pad_image(const float* x, size_t C, size_t H, size_t W, size_t p, float* out);
void split_columns(const float* x, size_t C, size_t H, size_t W, size_t p, float* out);

// Floats of the packed weights of O output and C input channels, k x k.
size_t packed_floats(size_t O, size_t C, size_t k);

// Packs weights w (O, C, k, k) for forward() into `out` (packed_floats(O, C, k) floats). `transposed`: the
// weights of the transposed convolution instead, which computes dx from dy: O and C swapped and the kernel
// turned half a turn (w given as (C, O, k, k), packed as O output channels of that).
void pack(const float* w, size_t O, size_t C, size_t k, bool transposed, float* out);

// One sample, stride s (1 or 2): y[o][oh][ow] (+)= sum over c < C, i < k, j < k of w[o][c][i][j] *
// xp[c][s*oh+i][s*ow+j], for o < O, oh < OH, ow < OW (fits(k, OH, OW)); xp is the zero-padded image (C, Hp, Wp),
// split by split_columns for stride 2; `add` adds to what y holds (a bias), else y is overwritten. `packed` comes
// from pack().
void forward(const float* xp, size_t C, size_t Hp, size_t Wp, size_t stride, const float* packed, size_t O,
             size_t k, float* y, size_t OH, size_t OW, bool add);

// n samples' part of the weight gradient, stride s (1 or 2): for every weight (o, c, i, j) of O x C x k x k, 16
// partial sums (a vector's lanes) at lanes[((o*C + c)*k*k + i*k + j) * 16], to which it adds dy[o][oh][ow] *
// xp[c][s*oh+i][s*ow+j] over the samples' output pixels (each lane its own); dy is (O, n, OH, OW), channel-major,
// OW a multiple of 16; xp holds the n samples' images one after the other, each as for forward. Zero the lanes
// before the first sample; add_lanes then adds each weight's 16 sums into dw.
void weight_grad(const float* xp, size_t n, size_t C, size_t Hp, size_t Wp, size_t stride, const float* dy,
                 size_t O, size_t k, size_t OH, size_t OW, float* lanes);
void add_lanes(const float* lanes, size_t n, float* dw);

// The "by channel" kernels, with output channels in the vector, for O a multiple of 16 up to 64.
bool fits_channels(size_t O);

// Forward with output channels in the vector, for fits_channels(O) and outputs of at most kMaxPixels pixels (the
// 8-wide outputs, where forward()'s vectors of two half rows cost a shuffle each): y as forward() computes it,
// through yT (OH*OW x O floats of scratch). wt: the weights as pack_by_channel lays them out (K = C*k*k rows of O;
// `transposed` as for pack).
constexpr size_t kMaxPixels = 256;
void pack_by_channel(const float* w, size_t O, size_t C, size_t k, bool transposed, float* out);
void forward_by_channel(const float* xp, size_t C, size_t Hp, size_t Wp, size_t stride, const float* wt, size_t O,
                        size_t k, float* y, size_t OH, size_t OW, bool add, float* yT);

// The weight gradient with output channels in the vector, for fits_channels(O) and any output width: acc[q][o] (K
// = C*k*k rows q = (c*k + i)*k + j, O columns) += the n samples' dy[o][oh][ow] * xp[c][s*oh+i][s*ow+j]; dyT is
// their dy pixel-major (n*OH*OW rows of O), xp as for weight_grad.
void weight_grad_by_channel(const float* xp, size_t n, size_t C, size_t Hp, size_t Wp, size_t stride,
                            const float* dyT, size_t O, size_t k, size_t OH, size_t OW, float* acc);

}  // namespace cx::nn::direct_conv
