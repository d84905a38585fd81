// The model stack's CUDA kernels: layers, losses, optimizer updates and a
// fallback GEMM, each the device twin of a loop in csrc/nn/. Per-element
// formulas (activations, the MSE and BCE terms, optimizer updates) are written
// once, in cuda/act_rules.h and cuda/update_rules.h, and called by both; the
// rest repeat the CPU's formula (same float32 rounding where the order of
// operations allows: softmax, cross-entropy, BatchNorm). Launched through
// the driver API (cuda::Device::launch) by each module's, loss's and optimizer's
// GPU code (csrc/nn/*_gpu.cpp), which owns grid sizes and argument order: change
// a signature here and there together.
//
// Sizes are unsigned long long; every elementwise kernel is a grid-stride loop,
// so any grid covers any n.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/act_rules.h"
#include "cuda/update_rules.h"

#define CX_LOOP(i, n) \
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n); \
       i += (unsigned long long)blockDim.x * gridDim.x)

typedef unsigned long long u64;
namespace rules = cx::nn::rules;

// ---------------------------------------------------------------- layers

// y[r, c] += b[c]
extern "C" __global__ void cx_nn_bias_add(float* y, const float* b, u64 rows, u64 cols) {
  CX_LOOP(i, rows * cols) y[i] += b[i % cols];
}

// gb[c] += sum_r g[r, c]. Blocks of 32x8 threads: x picks the column (adjacent
// threads, adjacent columns: coalesced rows), y and blockIdx.y split the rows;
// the 8 partial sums meet in shared memory and each block adds its column sums
// with one atomicAdd, so a wide batch keeps many threads busy.
extern "C" __global__ void cx_nn_col_sum_add(float* gb, const float* g, u64 rows, u64 cols) {
  __shared__ float part[8][33];
  const u64 c = blockIdx.x * 32ull + threadIdx.x;
  float s = 0.0f;
  if (c < cols)
    for (u64 r = blockIdx.y * 8ull + threadIdx.y; r < rows; r += 8ull * gridDim.y) s += g[r * cols + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int k = 1; k < 8; ++k) s += part[k][threadIdx.x];
    atomicAdd(&gb[c], s);
  }
}

// Activations: cuda/act_rules.h's formulas, which the CPU's loops use too. All of
// one signature, (x, y, n, slope) and (x, y, gy, gx, n, slope), so that
// ActivationModule launches each alike; slope is LeakyReLU's, the others ignore
// it, as they do whichever of x and y their backward does not read.
#define CX_ACTIVATION(name, forward, backward)                                                              \
  extern "C" __global__ void cx_nn_##name##_fwd(const float* x, float* y, u64 n, float slope) {             \
    CX_LOOP(i, n) y[i] = forward;                                                                           \
  }                                                                                                         \
  extern "C" __global__ void cx_nn_##name##_bwd(const float* x, const float* y, const float* gy, float* gx, \
                                                u64 n, float slope) {                                       \
    CX_LOOP(i, n) gx[i] = backward;                                                                         \
  }

CX_ACTIVATION(relu, rules::relu_fwd(x[i]), rules::relu_bwd(x[i], gy[i]))
CX_ACTIVATION(leaky_relu, rules::leaky_relu_fwd(x[i], slope), rules::leaky_relu_bwd(x[i], gy[i], slope))
CX_ACTIVATION(sigmoid, rules::sigmoid_fwd(x[i]), rules::sigmoid_bwd(y[i], gy[i]))
CX_ACTIVATION(tanh, rules::tanh_fwd(x[i]), rules::tanh_bwd(y[i], gy[i]))
CX_ACTIVATION(gelu, rules::gelu_fwd(x[i]), rules::gelu_bwd(x[i], gy[i]))

// Softmax over each row of (rows, cols): one warp per row.
extern "C" __global__ void cx_nn_softmax_fwd(const float* x, float* y, u64 rows, u64 cols) {
  u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= rows) return;
  const float* xr = x + warp * cols;
  float* yr = y + warp * cols;
  float mx = -INFINITY;
  for (u64 j = lane; j < cols; j += 32) mx = fmaxf(mx, xr[j]);
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float s = 0.0f;
  for (u64 j = lane; j < cols; j += 32) s += (yr[j] = expf(xr[j] - mx));
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  float inv = 1.0f / s;
  for (u64 j = lane; j < cols; j += 32) yr[j] *= inv;
}

extern "C" __global__ void cx_nn_softmax_bwd(const float* y, const float* gy, float* gx, u64 rows, u64 cols) {
  u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= rows) return;
  const float *yr = y + warp * cols, *gr = gy + warp * cols;
  float dot = 0.0f;
  for (u64 j = lane; j < cols; j += 32) dot += gr[j] * yr[j];
  for (int o = 16; o; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  for (u64 j = lane; j < cols; j += 32) gx[warp * cols + j] = yr[j] * (gr[j] - dot);
}

// Inverted dropout with csrc/nn/rng.h's generator (splitmix64 is a counter:
// draw i of a stream at state s is mix(s + (i+1)*golden)), so the GPU draws the
// very masks the CPU would from the same state.
__device__ __forceinline__ float cx_uniform(u64 state, u64 i) {
  u64 z = state + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void cx_nn_dropout_fwd(const float* x, float* y, float* mask, u64 n, float p, u64 state) {
  const float keep_scale = 1.0f / (1.0f - p);
  CX_LOOP(i, n) {
    float m = cx_uniform(state, i) >= p ? keep_scale : 0.0f;
    mask[i] = m;
    y[i] = x[i] * m;
  }
}

extern "C" __global__ void cx_nn_mul(const float* a, const float* b, float* out, u64 n) {
  CX_LOOP(i, n) out[i] = a[i] * b[i];
}

// BatchNorm over (rows, F), one thread per feature. Training: batch statistics
// in double (as the CPU does), running statistics updated, xhat and invstd kept
// for backward. Eval: running statistics.
extern "C" __global__ void cx_nn_bn_fwd(const float* x, float* y, float* xhat, float* invstd, const float* gamma,
                                        const float* beta, float* rmean, float* rvar, u64 rows, u64 F, float eps,
                                        float momentum, int training) {
  CX_LOOP(j, F) {
    float is;
    float mean_f;
    if (training) {
      double mean = 0.0, var = 0.0;
      for (u64 r = 0; r < rows; ++r) mean += x[r * F + j];
      mean /= (double)rows;
      for (u64 r = 0; r < rows; ++r) {
        double d = x[r * F + j] - mean;
        var += d * d;
      }
      is = (float)(1.0 / sqrt(var / (double)rows + eps));
      double unbiased = var / (double)(rows - 1);
      rmean[j] = (float)((1.0 - momentum) * rmean[j] + momentum * mean);
      rvar[j] = (float)((1.0 - momentum) * rvar[j] + momentum * unbiased);
      for (u64 r = 0; r < rows; ++r) {
        float h = (float)(x[r * F + j] - mean) * is;
        xhat[r * F + j] = h;
        y[r * F + j] = gamma[j] * h + beta[j];
      }
    } else {
      is = 1.0f / sqrtf(rvar[j] + eps);
      mean_f = rmean[j];
      for (u64 r = 0; r < rows; ++r) {
        float h = (x[r * F + j] - mean_f) * is;
        xhat[r * F + j] = h;
        y[r * F + j] = gamma[j] * h + beta[j];
      }
    }
    invstd[j] = is;
  }
}

// dbeta += sum gy, dgamma += sum gy*xhat, and (gx != null) dL/dx.
extern "C" __global__ void cx_nn_bn_bwd(const float* gy, const float* xhat, const float* invstd, const float* gamma,
                                        float* dgamma, float* dbeta, float* gx, u64 rows, u64 F, int training) {
  CX_LOOP(j, F) {
    float sg = 0.0f, sgx = 0.0f;
    for (u64 r = 0; r < rows; ++r) {
      sg += gy[r * F + j];
      sgx += gy[r * F + j] * xhat[r * F + j];
    }
    dbeta[j] += sg;
    dgamma[j] += sgx;
    if (!gx) continue;
    float k = gamma[j] * invstd[j];
    if (training) {
      const float invB = 1.0f / (float)rows;
      for (u64 r = 0; r < rows; ++r) {
        u64 i = r * F + j;
        gx[i] = k * (gy[i] - invB * sg - xhat[i] * invB * sgx);
      }
    } else {
      for (u64 r = 0; r < rows; ++r) gx[r * F + j] = gy[r * F + j] * k;
    }
  }
}

// ---------------------------------------------------------------- image layers (NCHW)
// The device twins of csrc/nn/layers/: convolution as GEMM over a batch's unfolding, pooling, BatchNorm2d,
// the residual sum. Each output element is written by one thread that gathers what it sums (no atomics), in
// the order the CPU's loop adds the same terms where that order is cheap to keep.

// Block reduction of a double over blockDim.x (a power of two, at most 256) threads; every thread gets it.
static __device__ double cx_block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();  // red is reused by the next reduction
  return r;
}

// Unfolding of nb samples x (nb, C, H, W): col row (c, i, j) (c*k*k + i*k + j), column m*P + oh*OW + ow holds
// x[m, c, oh*s - p + i*d, ow*s - p + j*d], 0 in the padding. Note [Convolution as GEMM] in nn/layers/conv2d.h.
// A thread per column (adjacent threads, adjacent columns: coalesced writes), blockIdx.y per channel: the
// column's position is divided out once (32-bit: the chunk's columns are fewer than 2^31, conv_plan), and the
// thread walks its channel's k*k rows with no division at all.
extern "C" __global__ void cx_nn_im2col(const float* x, float* col, u64 nb, u64 C, u64 H, u64 W, u64 k, u64 s,
                                        u64 p, u64 d, u64 OH, u64 OW) {
  const unsigned P = (unsigned)(OH * OW), cols = (unsigned)(nb * P), ow_n = (unsigned)OW;
  const int iH = (int)H, iW = (int)W, ik = (int)k, is = (int)s, ip = (int)p, id = (int)d;
  for (unsigned q = blockIdx.x * blockDim.x + threadIdx.x; q < cols; q += blockDim.x * gridDim.x) {
    const unsigned m = q / P, pp = q - m * P, oh = pp / ow_n, ow = pp - oh * ow_n;
    const int h0 = (int)oh * is - ip, w0 = (int)ow * is - ip;
    for (u64 c = blockIdx.y; c < C; c += gridDim.y) {
      const float* xc = x + (m * C + c) * H * W;
      float* out = col + (c * k * k) * cols + q;
      for (int i = 0; i < ik; ++i) {
        const int h = h0 + i * id;
        const bool hin = h >= 0 && h < iH;
        for (int j = 0; j < ik; ++j, out += cols) {
          const int w = w0 + j * id;
          *out = hin && w >= 0 && w < iW ? xc[(u64)h * W + w] : 0.0f;
        }
      }
    }
  }
}

// Its transpose: dx[m, c, h, w] = the sum of the columns unfolded from that pixel, in (i, j) order as the CPU's
// fold adds them. Overwrites dx. A thread per pixel of a sample (C*H*W < 2^32, conv_plan), blockIdx.y per sample.
extern "C" __global__ void cx_nn_col2im(const float* dcol, float* dx, u64 nb, u64 C, u64 H, u64 W, u64 k, u64 s,
                                        u64 p, u64 d, u64 OH, u64 OW) {
  const unsigned P = (unsigned)(OH * OW), cols = (unsigned)(nb * P), uW = (unsigned)W, uH = (unsigned)H;
  const unsigned n = (unsigned)(C * H * W);
  const int ik = (int)k, is = (int)s, ip = (int)p, id = (int)d, iOH = (int)OH, iOW = (int)OW;
  for (u64 m = blockIdx.y; m < nb; m += gridDim.y) {
    for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += blockDim.x * gridDim.x) {
      const unsigned hw = t / uW, w = t - hw * uW, c = hw / uH, h = hw - c * uH;
      const float* base = dcol + (u64)c * k * k * cols + m * P;
      float acc = 0.0f;
      for (int i = 0; i < ik; ++i) {
        const int hh = (int)h + ip - i * id;
        if (hh < 0 || (is > 1 && hh % is)) continue;
        const int oh = is > 1 ? hh / is : hh;
        if (oh >= iOH) continue;
        for (int j = 0; j < ik; ++j) {
          const int ww = (int)w + ip - j * id;
          if (ww < 0 || (is > 1 && ww % is)) continue;
          const int ow = is > 1 ? ww / is : ww;
          if (ow >= iOW) continue;
          acc += base[(u64)(i * ik + j) * cols + (unsigned)oh * (unsigned)OW + ow];
        }
      }
      dx[m * n + t] = acc;
    }
  }
}

// dst (B, A, P) = src (A, B, P) with its first two axes swapped: NCHW gradients into the convolution's GEMM
// layout (channels, samples x pixels). blockIdx.y per b;
// a thread per (a, pixel) of it (A*P < 2^32, conv_plan).
extern "C" __global__ void cx_nn_swap01(const float* src, float* dst, u64 A, u64 B, u64 P) {
  const unsigned n = (unsigned)(A * P), uP = (unsigned)P;
  for (u64 b = blockIdx.y; b < B; b += gridDim.y) {
    for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += blockDim.x * gridDim.x) {
      const unsigned a = t / uP, q = t - a * uP;
      dst[b * n + t] = src[((u64)a * B + b) * P + q];
    }
  }
}

// y (B, A, P) += bias[a]: the convolution's bias where its GEMMs wrote NCHW (A*P < 2^32, conv_plan).
extern "C" __global__ void cx_nn_bias01(float* y, const float* bias, u64 A, u64 B, u64 P) {
  const unsigned n = (unsigned)(A * P), uP = (unsigned)P;
  for (u64 b = blockIdx.y; b < B; b += gridDim.y)
    for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += blockDim.x * gridDim.x)
      y[b * n + t] += bias[t / uP];
}

// The index in (N, C, S) of value t of channel c's N*S values (fewer than 2^32: one 32-bit division, where a
// 64-bit one costs several times as many instructions).
static __device__ __forceinline__ u64 cx_chan_at(unsigned t, unsigned S, u64 C, u64 c) {
  const unsigned n = t / S;
  return ((u64)n * C + c) * S + (t - n * S);
}

// MaxPool2d over planes of H x W: the window's first maximum (a NaN wins, as on the CPU) and its index in the
// plane.
extern "C" __global__ void cx_nn_maxpool_fwd(const float* x, float* y, unsigned* arg, u64 planes, u64 H, u64 W,
                                             u64 OH, u64 OW, u64 k, u64 s) {
  CX_LOOP(t, planes * OH * OW) {
    const u64 ow = t % OW, oh = (t / OW) % OH, pl = t / (OW * OH);
    const float* xp = x + pl * H * W;
    u64 best = oh * s * W + ow * s;
    float bv = xp[best];
    for (u64 i = 0; i < k; ++i)
      for (u64 j = 0; j < k; ++j) {
        const u64 at = (oh * s + i) * W + ow * s + j;
        const float v = xp[at];
        if (v > bv || (isnan(v) && !isnan(bv))) bv = v, best = at;
      }
    y[t] = bv;
    arg[t] = (unsigned)best;
  }
}

// The windows over input row h (or column): [lo, hi] of the outputs, empty when lo > hi.
static __device__ void cx_windows(u64 h, u64 k, u64 s, u64 O, u64& lo, u64& hi) {
  lo = h + 1 >= k ? (h + 1 - k + s - 1) / s : 0;
  hi = h / s < O ? h / s : O - 1;
}

// dx[pixel] = the sum of gy over the windows whose maximum it was, in output order (as the CPU adds them).
extern "C" __global__ void cx_nn_maxpool_bwd(const float* gy, const unsigned* arg, float* gx, u64 planes, u64 H,
                                             u64 W, u64 OH, u64 OW, u64 k, u64 s) {
  CX_LOOP(t, planes * H * W) {
    const u64 w = t % W, h = (t / W) % H, pl = t / (W * H);
    u64 h0, h1, w0, w1;
    cx_windows(h, k, s, OH, h0, h1);
    cx_windows(w, k, s, OW, w0, w1);
    const unsigned at = (unsigned)(h * W + w);
    float acc = 0.0f;
    for (u64 oh = h0; oh <= h1 && oh < OH; ++oh)
      for (u64 ow = w0; ow <= w1 && ow < OW; ++ow) {
        const u64 o = (pl * OH + oh) * OW + ow;
        if (arg[o] == at) acc += gy[o];
      }
    gx[t] = acc;
  }
}

// AvgPool2d: the window's sum in (i, j) order, times 1/k^2.
extern "C" __global__ void cx_nn_avgpool_fwd(const float* x, float* y, u64 planes, u64 H, u64 W, u64 OH, u64 OW,
                                             u64 k, u64 s, float inv) {
  CX_LOOP(t, planes * OH * OW) {
    const u64 ow = t % OW, oh = (t / OW) % OH, pl = t / (OW * OH);
    const float* xp = x + pl * H * W;
    float acc = 0.0f;
    for (u64 i = 0; i < k; ++i)
      for (u64 j = 0; j < k; ++j) acc += xp[(oh * s + i) * W + ow * s + j];
    y[t] = acc * inv;
  }
}

// dx[pixel] = the sum of gy/k^2 over the windows holding it (oh up, then ow down: the CPU loop's order).
extern "C" __global__ void cx_nn_avgpool_bwd(const float* gy, float* gx, u64 planes, u64 H, u64 W, u64 OH, u64 OW,
                                             u64 k, u64 s, float inv) {
  CX_LOOP(t, planes * H * W) {
    const u64 w = t % W, h = (t / W) % H, pl = t / (W * H);
    u64 h0, h1, w0, w1;
    cx_windows(h, k, s, OH, h0, h1);
    cx_windows(w, k, s, OW, w0, w1);
    float acc = 0.0f;
    for (u64 oh = h0; oh <= h1 && oh < OH; ++oh)
      for (u64 ow = w1 + 1; ow-- > w0;)
        if (ow < OW) acc += gy[(pl * OH + oh) * OW + ow] * inv;
    gx[t] = acc;
  }
}

// GlobalAvgPool2d: y[plane] = the plane's mean (summed in double), one warp per plane.
extern "C" __global__ void cx_nn_gap_fwd(const float* x, float* y, u64 planes, u64 S) {
  const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  if (warp >= planes) return;
  double acc = 0.0;
  for (u64 q = lane; q < S; q += 32) acc += x[warp * S + q];
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[warp] = (float)(acc / (double)S);
}

extern "C" __global__ void cx_nn_gap_bwd(const float* gy, float* gx, u64 planes, u64 S, float inv) {
  CX_LOOP(t, planes * S) gx[t] = gy[t / S] * inv;
}

// Note [Channel sums in runs]
// BatchNorm over (N, C, S = H*W) (BatchNormModule::forward_nchw's arithmetic: batch statistics summed in double,
// the running statistics updated, the mean and 1/std kept for backward, which recomputes x-hat from x; eval: the
// running statistics). Grid C x P: a channel's M = N*S values (M < 2^32, checked on the host) are split in P
// runs, one block each, whose sums go to part[p * C + c] (the centred squares, or backward's second sum, to
// part[(P + p) * C + c]). Each block of a channel then adds the P sums in the same order, so all see the same
// statistics. One block per channel kept most of an H100 idle (32-64 blocks for 132 SMs): 65% of a small ResNet's
// step at batch 512. The convolution's bias gradient takes the first pass (cx_nn_channel_sums) too.
static __device__ __forceinline__ void cx_run(unsigned M, unsigned& lo, unsigned& hi) {
  const u64 L = (M + (u64)gridDim.y - 1) / gridDim.y;
  lo = (unsigned)min((u64)M, blockIdx.y * L);
  hi = (unsigned)min((u64)M, lo + L);
}

static __device__ double cx_runs_sum(const double* part, u64 C, u64 c) {
  double s = 0.0;
  for (unsigned p = 0; p < gridDim.y; ++p) s += part[p * C + c];
  return s;
}

// part[p * C + c] = the sum of run p of channel c's values (Device::channel_runs), in double.
extern "C" __global__ void cx_nn_channel_sums(const float* x, double* part, u64 N, u64 C, u64 S) {
  __shared__ double red[256];
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  double acc = 0.0;
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) acc += x[cx_chan_at(t, uS, C, c)];
  acc = cx_block_sum(acc, red);
  if (threadIdx.x == 0) part[blockIdx.y * C + c] = acc;
}

// gb[c] += the sum of g[n, c, :] over n < N (S values each): its runs' sums (cx_nn_channel_sums), in order.
extern "C" __global__ void cx_nn_channel_sum_add(float* gb, const double* part, u64 C, unsigned runs) {
  CX_LOOP(c, C) {
    double s = 0.0;
    for (unsigned p = 0; p < runs; ++p) s += part[p * C + c];
    gb[c] += (float)s;
  }
}

extern "C" __global__ void cx_nn_bn2d_var(const float* x, double* part, u64 N, u64 C, u64 S) {
  __shared__ double red[256];
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const float mean_f = (float)(cx_runs_sum(part, C, c) / (double)M);
  double v = 0.0;
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const float dv = x[cx_chan_at(t, uS, C, c)] - mean_f;
    v += (double)dv * dv;
  }
  v = cx_block_sum(v, red);
  if (threadIdx.x == 0) part[((u64)gridDim.y + blockIdx.y) * C + c] = v;
}

extern "C" __global__ void cx_nn_bn2d_fwd(const float* x, float* y, const double* part, float* mean_out,
                                          float* invstd, const float* gamma, const float* beta, float* rmean,
                                          float* rvar, u64 N, u64 C, u64 S, float eps, float momentum, int training) {
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const bool first = blockIdx.y == 0 && threadIdx.x == 0;
  float mean_f, is;
  if (training) {
    const double sum = cx_runs_sum(part, C, c), var = cx_runs_sum(part + gridDim.y * C, C, c);
    mean_f = (float)(sum / (double)M);
    is = (float)(1.0 / sqrt(var / (double)M + eps));
    if (first) {
      rmean[c] = (float)((1.0 - momentum) * rmean[c] + momentum * (sum / (double)M));
      rvar[c] = (float)((1.0 - momentum) * rvar[c] + momentum * var / (double)(M - 1));
    }
  } else {
    mean_f = rmean[c];
    is = 1.0f / sqrtf(rvar[c] + eps);
  }
  if (first) {
    mean_out[c] = mean_f;
    invstd[c] = is;
  }
  const float a = gamma[c] * is, b = beta[c];
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const u64 i = cx_chan_at(t, uS, C, c);
    y[i] = a * (x[i] - mean_f) + b;
  }
}

// Backward's sums: gy and gy (x - mean), in double.
extern "C" __global__ void cx_nn_bn2d_bsum(const float* gy, const float* x, const float* mean, double* part, u64 N,
                                           u64 C, u64 S) {
  __shared__ double red[256];
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const float m = mean[c];
  double a1 = 0.0, a2 = 0.0;
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const u64 i = cx_chan_at(t, uS, C, c);
    a1 += gy[i];
    a2 += (double)(gy[i] * (x[i] - m));
  }
  a1 = cx_block_sum(a1, red);
  a2 = cx_block_sum(a2, red);
  if (threadIdx.x == 0) {
    part[blockIdx.y * C + c] = a1;
    part[((u64)gridDim.y + blockIdx.y) * C + c] = a2;
  }
}

// dbeta[c] += sum gy, dgamma[c] += invstd * sum gy (x - mean), and (gx != null) dL/dx = k1 gy + k2 (x - mean) + k3.
extern "C" __global__ void cx_nn_bn2d_bwd(const float* gy, const float* x, const float* mean, const float* invstd,
                                          const float* gamma, float* dgamma, float* dbeta, float* gx,
                                          const double* part, u64 N, u64 C, u64 S, int training) {
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const float m = mean[c];
  const double s1 = cx_runs_sum(part, C, c);
  const double s2 = cx_runs_sum(part + gridDim.y * C, C, c) * invstd[c];
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    dbeta[c] += (float)s1;
    dgamma[c] += (float)s2;
  }
  if (!gx) return;
  const double gi = (double)gamma[c] * invstd[c];
  float k1, k2 = 0.0f, k3 = 0.0f;  // eval: gx = gamma * invstd * gy, as the CPU's affine gives it
  if (training) {
    const double inv_m = 1.0 / (double)M;
    k1 = (float)gi;
    k2 = (float)(-gi * invstd[c] * inv_m * s2);
    k3 = (float)(-gi * inv_m * s1);
  } else {
    k1 = gamma[c] * invstd[c];
  }
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const u64 i = cx_chan_at(t, uS, C, c);
    gx[i] = training ? k1 * gy[i] + k2 * (x[i] - m) + k3 : k1 * gy[i];
  }
}

// SyncBatchNormModule (Note [SyncBatchNorm on the GPU] in nn/modules_gpu.cpp): the kernels above with the sums
// taken out between the passes and summed over the ranks. st holds, in double: [0] the count M (every rank's
// values per channel), [1, C] the sums, [1+C, 2C] the centred squares, [1+2C, 3C] backward's sum of gy and
// [1+3C, 4C] its sum of gy * x-hat.
// st[off + c] = the sum of channel c's runs (part[p * C + c], p < runs), in order; st[0] = count if count > 0.
extern "C" __global__ void cx_nn_sbn_fold(const double* part, double* st, u64 C, unsigned runs, u64 off,
                                          double count) {
  CX_LOOP(c, C) {
    double s = 0.0;
    for (unsigned p = 0; p < runs; ++p) s += part[p * C + c];
    st[off + c] = s;
    if (c == 0 && count > 0.0) st[0] = count;
  }
}

// part[p * C + c] = run p of channel c's centred squares about the mean of every rank's values.
extern "C" __global__ void cx_nn_sbn_var(const float* x, const double* st, double* part, u64 N, u64 C, u64 S) {
  __shared__ double red[256];
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const float mean_f = (float)(st[1 + c] / st[0]);
  double v = 0.0;
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const float dv = x[cx_chan_at(t, uS, C, c)] - mean_f;
    v += (double)dv * dv;
  }
  v = cx_block_sum(v, red);
  if (threadIdx.x == 0) part[blockIdx.y * C + c] = v;
}

// Training forward with every rank's statistics: cx_nn_bn2d_fwd's arithmetic over the count st[0].
extern "C" __global__ void cx_nn_sbn_fwd(const float* x, float* y, const double* st, float* mean_out, float* invstd,
                                         const float* gamma, const float* beta, float* rmean, float* rvar, u64 N,
                                         u64 C, u64 S, float eps, float momentum) {
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const double Mg = st[0], sum = st[1 + c], var = st[1 + C + c];
  const float mean_f = (float)(sum / Mg);
  const float is = (float)(1.0 / sqrt(var / Mg + eps));
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    rmean[c] = (float)((1.0 - momentum) * rmean[c] + momentum * (sum / Mg));
    rvar[c] = (float)((1.0 - momentum) * rvar[c] + momentum * var / (Mg - 1.0));
    mean_out[c] = mean_f;
    invstd[c] = is;
  }
  const float a = gamma[c] * is, b = beta[c];
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const u64 i = cx_chan_at(t, uS, C, c);
    y[i] = a * (x[i] - mean_f) + b;
  }
}

// Backward's local sums (cx_nn_bn2d_bsum's runs, in order): into dbeta and dgamma, which DDP averages, and into
// st for the all-reduce that dL/dx needs.
extern "C" __global__ void cx_nn_sbn_bfold(const double* part, double* st, const float* invstd, float* dgamma,
                                           float* dbeta, u64 C, unsigned runs) {
  CX_LOOP(c, C) {
    double s1 = 0.0, s2 = 0.0;
    for (unsigned p = 0; p < runs; ++p) s1 += part[p * C + c];
    for (unsigned p = 0; p < runs; ++p) s2 += part[((u64)runs + p) * C + c];
    s2 *= invstd[c];
    dbeta[c] += (float)s1;
    dgamma[c] += (float)s2;
    st[1 + 2 * C + c] = s1;
    st[1 + 3 * C + c] = s2;
  }
}

// dL/dx from every rank's sums (cx_nn_bn2d_bwd's formula over the count st[0]).
extern "C" __global__ void cx_nn_sbn_bwd(const float* gy, const float* x, const float* mean, const float* invstd,
                                         const float* gamma, float* gx, const double* st, u64 N, u64 C, u64 S) {
  const u64 c = blockIdx.x;
  const unsigned M = (unsigned)(N * S), uS = (unsigned)S;
  unsigned lo, hi;
  cx_run(M, lo, hi);
  const float m = mean[c];
  const double inv_m = 1.0 / st[0], s1 = st[1 + 2 * C + c], s2 = st[1 + 3 * C + c];
  const double gi = (double)gamma[c] * invstd[c];
  const float k1 = (float)gi, k2 = (float)(-gi * invstd[c] * inv_m * s2), k3 = (float)(-gi * inv_m * s1);
  for (unsigned t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    const u64 i = cx_chan_at(t, uS, C, c);
    gx[i] = k1 * gy[i] + k2 * (x[i] - m) + k3;
  }
}

extern "C" __global__ void cx_nn_add(const float* a, const float* b, float* out, u64 n) {
  CX_LOOP(i, n) out[i] = a[i] + b[i];
}

// ---------------------------------------------------------------- losses
// Each writes dL/d(output) and adds its sums into stats (double): stats[0] the
// loss summed as the CPU sums it (over rows, or over elements), stats[1] the
// rows (or elements) counted correct. Labels are range-checked on the host
// first (GpuEngine::launch_loss, via each loss's forward_batch); the kernel only refuses to read out of bounds.

// Cross-entropy with integer labels, one warp per row.
extern "C" __global__ void cx_nn_ce_labels(const float* x, const int64_t* labels, float* g, double* stats, u64 rows,
                                           u64 C) {
  u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= rows) return;
  const float* xr = x + warp * C;
  float* gr = g + warp * C;
  int64_t y = labels[warp];
  if (y < 0 || (u64)y >= C) return;
  // max and its first index (the CPU's std::max_element picks the first)
  float mx = -INFINITY;
  u64 arg = 0;
  for (u64 j = lane; j < C; j += 32)
    if (xr[j] > mx) mx = xr[j], arg = j;
  for (int o = 16; o; o >>= 1) {
    float om = __shfl_xor_sync(0xffffffffu, mx, o);
    u64 oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > mx || (om == mx && oa < arg)) mx = om, arg = oa;
  }
  float s = 0.0f;
  for (u64 j = lane; j < C; j += 32) s += (gr[j] = expf(xr[j] - mx));
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float inv = 1.0f / s, invB = 1.0f / (float)rows;
  for (u64 j = lane; j < C; j += 32) {
    float p = gr[j] * inv;
    if (j == (u64)y) p -= 1.0f;
    gr[j] = p * invB;
  }
  if (lane == 0) {
    float lse = mx + logf(s);
    atomicAdd(&stats[0], (double)lse - xr[y]);
    if (arg == (u64)y) atomicAdd(&stats[1], 1.0);
  }
}

// Cross-entropy with dense (soft) targets, one warp per row.
extern "C" __global__ void cx_nn_ce_dense(const float* x, const float* t, float* g, double* stats, u64 rows, u64 C) {
  u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= rows) return;
  const float *xr = x + warp * C, *tr = t + warp * C;
  float* gr = g + warp * C;
  float mx = -INFINITY, tmx = -INFINITY;
  u64 arg = 0, targ = 0;
  for (u64 j = lane; j < C; j += 32) {
    if (xr[j] > mx) mx = xr[j], arg = j;
    if (tr[j] > tmx) tmx = tr[j], targ = j;
  }
  for (int o = 16; o; o >>= 1) {
    float om = __shfl_xor_sync(0xffffffffu, mx, o);
    u64 oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > mx || (om == mx && oa < arg)) mx = om, arg = oa;
    float tm = __shfl_xor_sync(0xffffffffu, tmx, o);
    u64 ta = __shfl_xor_sync(0xffffffffu, targ, o);
    if (tm > tmx || (tm == tmx && ta < targ)) tmx = tm, targ = ta;
  }
  float s = 0.0f, tsum = 0.0f;
  for (u64 j = lane; j < C; j += 32) {
    s += (gr[j] = expf(xr[j] - mx));
    tsum += tr[j];
  }
  for (int o = 16; o; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    tsum += __shfl_xor_sync(0xffffffffu, tsum, o);
  }
  const float inv = 1.0f / s, invB = 1.0f / (float)rows, lse = mx + logf(s);
  double row = 0.0;
  for (u64 j = lane; j < C; j += 32) {
    row += (double)tr[j] * ((double)lse - xr[j]);
    gr[j] = (gr[j] * inv * tsum - tr[j]) * invB;
  }
  for (int o = 16; o; o >>= 1) row += __shfl_xor_sync(0xffffffffu, row, o);
  if (lane == 0) {
    atomicAdd(&stats[0], row);
    if (arg == targ) atomicAdd(&stats[1], 1.0);
  }
}

// Block-wide sums of two doubles into stats[0..1].
__device__ void cx_block_add2(double a, double b, double* stats) {
  __shared__ double sa[32], sb[32];
  for (int o = 16; o; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sa[w] = a, sb[w] = b;
  __syncthreads();
  if (w == 0) {
    unsigned nw = (blockDim.x + 31) / 32;
    a = lane < nw ? sa[lane] : 0.0;
    b = lane < nw ? sb[lane] : 0.0;
    for (int o = 16; o; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane == 0) {
      atomicAdd(&stats[0], a);
      if (b != 0.0) atomicAdd(&stats[1], b);
    }
  }
}

// MSE (act_rules.h's mse): stats[0] += sum (o-t)^2; g = 2(o-t)/n.
extern "C" __global__ void cx_nn_mse(const float* o, const float* t, float* g, double* stats, u64 n) {
  const float inv_n = 1.0f / (float)n;
  double acc = 0.0;
  CX_LOOP(i, n) acc += rules::mse(o[i], t[i], inv_n, g[i]);
  cx_block_add2(acc, 0.0, stats);
}

// BCE with logits (act_rules.h's bce_with_logits): stats[0] += sum of the element
// losses, stats[1] += elements on the right side of 0 (the caller divides by the
// row width); g = (sig-t)/n.
extern "C" __global__ void cx_nn_bce(const float* x, const float* t, float* g, double* stats, u64 n) {
  const float inv_n = 1.0f / (float)n;
  double acc = 0.0, hit = 0.0;
  CX_LOOP(i, n) {
    const float v = x[i], ti = t[i];
    acc += (double)rules::bce_with_logits(v, ti, inv_n, g[i]);
    hit += (v > 0.0f) == (ti > 0.5f) ? 1.0 : 0.0;
  }
  cx_block_add2(acc, hit, stats);
}

// ---------------------------------------------------------------- optimizers
// The rules of csrc/cuda/update_rules.h, which the CPU's scalar paths use too.
// skip (may be null): a device word; nonzero leaves everything as it was (the
// GPU trainer's non-finite check, Note [Non-finite gradients on the GPU]).

extern "C" __global__ void cx_nn_adam(float* p, const float* g, float* m, float* v, u64 n, float b1, float b2,
                                      float eps, float step_size, float inv_bc2_sqrt, float l2, float decay,
                                      const unsigned int* skip) {
  if (skip && *skip) return;
  CX_LOOP(i, n) rules::adam(p[i], g[i], m[i], v[i], b1, b2, eps, step_size, inv_bc2_sqrt, l2, decay);
}

extern "C" __global__ void cx_nn_sgd(float* p, const float* g, float* buf, u64 n, float lr, float mu, int nesterov,
                                     float l2, const unsigned int* skip) {
  if (skip && *skip) return;
  CX_LOOP(i, n) rules::sgd(p[i], g[i], buf ? buf + i : nullptr, lr, mu, nesterov != 0, l2);
}

extern "C" __global__ void cx_nn_rmsprop(float* p, const float* g, float* v, float* buf, u64 n, float lr, float a,
                                         float eps, float mu, float l2, const unsigned int* skip) {
  if (skip && *skip) return;
  CX_LOOP(i, n) rules::rmsprop(p[i], g[i], v[i], buf ? buf + i : nullptr, lr, a, eps, mu, l2);
}

// ---------------------------------------------------------------- GEMM fallback
// Row-major C = alpha op(A) op(B) + beta C, op(A) M x K, op(B) K x N; 32x32
// tiles of C per block of 32x8 threads, 4 outputs per thread. Used where no
// cuBLAS library is found.
#define CX_TILE 32
extern "C" __global__ void cx_nn_sgemm(int ta, int tb, int M, int N, int K, float alpha, const float* A, int lda,
                                       const float* B, int ldb, float beta, float* C, int ldc) {
  __shared__ float As[CX_TILE][CX_TILE + 1];
  __shared__ float Bs[CX_TILE][CX_TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x 8
  const int row0 = blockIdx.y * CX_TILE, col0 = blockIdx.x * CX_TILE;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k0 = 0; k0 < K; k0 += CX_TILE) {
    for (int q = 0; q < 4; ++q) {
      int r = ty + 8 * q;
      int i = row0 + r, k = k0 + tx;  // As[r][tx] = op(A)[i][k]
      As[r][tx] = (i < M && k < K) ? (ta ? A[(long)k * lda + i] : A[(long)i * lda + k]) : 0.0f;
      int kk = k0 + r, j = col0 + tx;  // Bs[r][tx] = op(B)[kk][j]
      Bs[r][tx] = (kk < K && j < N) ? (tb ? B[(long)j * ldb + kk] : B[(long)kk * ldb + j]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < CX_TILE; ++k) {
      float b = Bs[k][tx];
      for (int q = 0; q < 4; ++q) acc[q] += As[ty + 8 * q][k] * b;
    }
    __syncthreads();
  }
  for (int q = 0; q < 4; ++q) {
    int i = row0 + ty + 8 * q, j = col0 + tx;
    if (i < M && j < N) {
      float* c = C + (long)i * ldc + j;
      *c = alpha * acc[q] + (beta == 0.0f ? 0.0f : beta * *c);
    }
  }
}

// ---------------------------------------------------------------- checks

// counts[p] (and *total, unless null) += the inf/NaN values of parameter p among g[lo, hi), where
// parameter p holds g[bounds[p], bounds[p+1]) and `first` is a parameter
// whose range holds lo: the GPU trainer's non-finite check (Note [Non-finite
// gradients on the GPU] in train/gpu_engine.cpp). One read of each float; a
// thread walks its parameters forward as its index grows, and an atomic is
// spent only on a parameter where it found a bad value.
static __device__ void add_count(unsigned int* count, unsigned int* total, unsigned int c) {
  atomicAdd(count, c);
  if (total) atomicAdd(total, c);
}

extern "C" __global__ void cx_nn_count_nonfinite(const float* g, u64 lo, u64 hi, const u64* bounds,
                                                 unsigned int first, unsigned int* counts, unsigned int* total) {
  unsigned int p = first, c = 0;
  u64 end = bounds[p + 1];
  for (u64 i = lo + blockIdx.x * (u64)blockDim.x + threadIdx.x; i < hi; i += (u64)blockDim.x * gridDim.x) {
    if (i >= end) {
      if (c) add_count(counts + p, total, c);
      c = 0;
      do end = bounds[++p + 1]; while (i >= end);
    }
    c += (__float_as_uint(g[i]) & 0x7fffffffu) >= 0x7f800000u;  // exponent all ones: inf or NaN
  }
  if (c) add_count(counts + p, total, c);
}

// ---------------------------------------------------------------- the GPU trainer's step extras
// Note [The GPU trainer's clipping and 16-bit buckets] in train/gpu_engine.cpp says who calls these and why.

// grad_clip_value: every element into [-v, v], as train::clip_gradients writes it (a NaN stays NaN and is
// counted into both counters: the value clip's own, and the step's "cannot clip").
extern "C" __global__ void cx_nn_clip_value(float* g, u64 n, float v, unsigned int* nan_count, unsigned int* bad) {
  unsigned int c = 0;
  CX_LOOP(i, n) {
    const float x = g[i];
    c += x != x;
    const float lo = x < -v ? -v : x;
    g[i] = v < lo ? v : lo;
  }
  if (c) add_count(nan_count, bad, c);
}

// grad_clip_norm's sum of squares, in double: each block's share of a grid-stride loop into part[block]
// (a fixed grid, so the blocks' shares and their order in cx_nn_clip_norm_coef are the same on every rank).
extern "C" __global__ void cx_nn_sum_squares(const float* g, u64 n, double* part) {
  __shared__ double red[256];
  double acc = 0.0;
  CX_LOOP(i, n) acc += (double)g[i] * g[i];
  acc = cx_block_sum(acc, red);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// One thread: the norm from the parts in order, and clip_gradients' coefficient max_norm / (norm + 1e-6) where
// it is below 1 (else 1: nothing to scale); a norm that is not finite cannot be clipped (bad += 1, coef 1).
extern "C" __global__ void cx_nn_clip_norm_coef(const double* part, unsigned int parts, double max_norm, double* norm,
                                                float* coef, unsigned int* bad) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double sq = 0.0;
  for (unsigned int p = 0; p < parts; ++p) sq += part[p];
  const double nrm = sqrt(sq);
  *norm = nrm;
  if (!isfinite(nrm)) {
    *bad += 1;
    *coef = 1.0f;
    return;
  }
  const double c = max_norm / (nrm + 1e-6);
  *coef = c < 1.0 ? (float)c : 1.0f;
}

extern "C" __global__ void cx_nn_scale_by(float* g, u64 n, const float* coef) {
  const float c = *coef;
  if (c == 1.0f) return;
  CX_LOOP(i, n) g[i] *= c;
}

// DDPConfig.comm_hook = "fp16" / "bf16" (Note [Half-precision buckets] in train/comm_hooks.cpp): each value
// times `scale` (1/world) rounded to nearest even into the 16-bit type (kind 0: float16, overflowing to inf;
// 1: bfloat16), and the reduced 16-bit sums widened back, exactly.
extern "C" __global__ void cx_nn_narrow16(const float* g, uint16_t* w, u64 n, float scale, int kind) {
  CX_LOOP(i, n) {
    const float x = g[i] * scale;
    w[i] = kind ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
  }
}

extern "C" __global__ void cx_nn_widen16(const uint16_t* w, float* g, u64 n, int kind) {
  CX_LOOP(i, n) g[i] = kind ? __bfloat162float(__ushort_as_bfloat16(w[i])) : __half2float(__ushort_as_half(w[i]));
}

// cx.callbacks.EMA on the GPU trainer: shadow = d * shadow + c * params, each product rounded and then their sum
// (no fused multiply-add), as train::ema_update computes it on the CPU, bit for bit on the same parameters.
extern "C" __global__ void cx_nn_ema(float* shadow, const float* params, u64 n, float d, float c) {
  CX_LOOP(i, n) shadow[i] = __fadd_rn(__fmul_rn(d, shadow[i]), __fmul_rn(c, params[i]));
}
