// defines: direct_conv, the AVX-512 kernels that compute a stride-1 convolution of one sample straight from its
// zero-padded image, without unfolding it (Note [Direct convolution] in conv2d_direct.cpp).
#pragma once

#include <cstddef>

namespace cx::nn::direct_conv {

// Whether this CPU runs the kernels (AVX-512F), and CX_NN_SCALAR is not 1 (which keeps the GEMMs).
bool available();

// The output widths the kernels take: a multiple of 16 (a vector of output pixels).
inline bool fits_width(size_t out_width) { return out_width > 0 && out_width % 16 == 0; }

// Floats of the packed weights of O output and C input channels, k x k.
size_t packed_floats(size_t O, size_t C, size_t k);

// Packs weights w (O, C, k, k) for forward() into `out` (packed_floats(O, C, k) floats). `transposed`: the
// weights of the transposed convolution instead, which computes dx from dy: O and C swapped and the kernel
// turned half a turn (w given as (C, O, k, k), packed as O output channels of that).
void pack(const float* w, size_t O, size_t C, size_t k, bool transposed, float* out);

// One sample, stride 1: y[o][oh][ow] (+)= sum over c < C, i < k, j < k of w[o][c][i][j] * xp[c][oh+i][ow+j], for
// o < O, oh < OH, ow < OW; xp is (C, Hp, Wp) with Hp >= OH + k - 1 and Wp >= OW + k - 1; OW a multiple of 16;
// `add` adds to what y holds (a bias), else y is overwritten. `packed` comes from pack().
void forward(const float* xp, size_t C, size_t Hp, size_t Wp, const float* packed, size_t O, size_t k, float* y,
             size_t OH, size_t OW, bool add);

// One sample's part of the weight gradient, stride 1: for every weight (o, c, i, j) of O x C x k x k, 16 partial
// sums (a vector's lanes) at lanes[((o*C + c)*k*k + i*k + j) * 16], to which it adds dy[o][oh][ow] *
// xp[c][oh+i][ow+j] over the sample's output pixels (each lane its own); dy is (O, OH, OW), OW a multiple of 16.
// Zero them before the first sample; add_lanes then adds each weight's 16 sums into dw.
void weight_grad(const float* xp, size_t C, size_t Hp, size_t Wp, const float* dy, size_t O, size_t k, size_t OH,
                 size_t OW, float* lanes);
void add_lanes(const float* lanes, size_t n, float* dw);

}  // namespace cx::nn::direct_conv
