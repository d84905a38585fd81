// defines: Conv2dModule, 2-D convolution over NCHW float32 images (as
// torch.nn.Conv2d, square kernels), CPU only for now (nn/cpu_only.h).
//
// Shapes: input (batch, in_channels, H, W) -> output (batch, out_channels, OH, OW) with
//   OH = (H + 2*padding - dilation*(kernel_size-1) - 1) / stride + 1   (the same for OW).
// Parameters: weight (out_channels, in_channels/groups, k, k), then bias (out_channels,).
// Init (seeded): Kaiming-uniform U(-sqrt(6/fan_in), sqrt(6/fan_in)) with fan_in =
// in_channels/groups * k * k, as LinearModule's default; bias starts at zero.
//
// Note [Convolution as GEMM]
// Per sample, the input is unfolded into a matrix col (K = in/groups*k*k rows,
// P = OH*OW columns; im2col) so that the convolution of group g is one GEMM
// through our BLAS (nn/blas.h):
//   forward   y[g] (out/groups x P)  = W[g] (out/groups x K) . col[g]
//   backward  dW[g] += dy[g] . col[g]^T          (col unfolded again: it is not kept)
//             dcol[g] = W[g]^T . dy[g], then folded back and summed into dx (col2im)
// A 1x1 kernel with stride 1 and no padding needs no unfolding: col is the
// input itself. The unfolding copies rows from a zero-padded copy of the
// sample, so its inner loop is a plain copy of OW floats (stride 1) with no
// bounds checks. Measured on the 2-vCPU EPYC these run on (benchmarks/cnn.py),
// against unfolding a chunk of samples into one wider GEMM: per sample was as
// fast or faster (the GEMMs are already >= 64 columns wide and stay in cache),
// and needs K*P floats of scratch instead of a chunk's. The weight gradient is
// finished for every sample before dx is computed, so DDP can start sending it
// while dx is still being computed (Note [Overlap] in train/ddp.h); the bias's
// even earlier.
#pragma once

#include <cstdint>

#include "nn/cpu_only.h"
#include "nn/tensor.h"

namespace cx::nn {

struct Conv2dGeometry {
  size_t in, out, k, stride, padding, dilation, groups;
};

class Conv2dModule : public CpuOnly<Module> {
 public:
  using CpuOnly::backward;  // the GPU ones (refusals)
  using CpuOnly::forward;
  // Throws InvalidArgument naming the argument for sizes < 1 (padding < 0), or
  // channels not divisible by groups.
  Conv2dModule(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1,
               int64_t padding = 0, bool bias = true, int64_t dilation = 1, int64_t groups = 1, uint64_t seed = 0);
  std::string type_name() const override { return "Conv2d"; }
  std::string repr() const override;
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void write_config(ByteWriter& w) const override;

  const Conv2dGeometry& geometry() const { return g_; }
  bool has_bias() const { return bias_; }
  // Re-draws the weights from `seed` (bias back to zero).
  void reset_parameters(uint64_t seed);

 private:
  // Unfolds sample x (in, H, W) into col_ (K x P); returns col (the input itself
  // for a 1x1 kernel with stride 1 and no padding).
  const float* unfold(const float* x, size_t H, size_t W, size_t OH, size_t OW);
  bool direct() const { return g_.k == 1 && g_.stride == 1 && g_.padding == 0; }

  Conv2dGeometry g_;
  bool bias_;
  Tensor padded_, col_;  // scratch: one sample, zero-padded (borders stay zero); its unfolding
  Tensor dpadded_;       // backward: dx of one padded sample
};

}  // namespace cx::nn
