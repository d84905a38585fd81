// defines: Conv2dModule, 2-D convolution over NCHW float32 images (as
// torch.nn.Conv2d, square kernels), on the CPU and the GPU (layers_gpu.cpp).
//
// Shapes: input (batch, in_channels, H, W) -> output (batch, out_channels, OH, OW) with
//   OH = (H + 2*padding - dilation*(kernel_size-1) - 1) / stride + 1   (the same for OW).
// Parameters: weight (out_channels, in_channels/groups, k, k), then bias (out_channels,).
// Init (seeded): Kaiming-uniform U(-sqrt(6/fan_in), sqrt(6/fan_in)) with fan_in =
// in_channels/groups * k * k, as LinearModule's default; bias starts at zero.
//
// Note [Convolution as GEMM]
// (On an AVX-512 core, most 3x3 convolutions of stride 1 and 2 now run without unfolding: Note [Direct
// convolution] in conv2d_direct.cpp. What follows is every other case.)
// Per sample, the input is unfolded into a matrix col (K = in/groups*k*k rows,
// P = OH*OW columns; im2col) so that the convolution of group g is one GEMM
// through our BLAS (nn/blas.h):
//   forward   y[g] (out/groups x P)  = W[g] (out/groups x K) . col[g]
//   backward  dW[g] += dy[g] . col[g]^T          (col unfolded again: it is not kept)
//             dcol[g] = W[g]^T . dy[g], then folded back and summed into dx (col2im)
// A 1x1 kernel with stride 1 and no padding needs no unfolding: col is the
// input itself. The unfolding copies rows of a zero-padded copy of the sample,
// so for stride 1 its inner loop is a plain copy of OW floats with no bounds
// checks. The weight's gradient is final for the whole batch before dx is
// computed (the bias's before that), so DDP sends it while dx is computed
// (Note [Overlap] in train/ddp.h); dx needs no unfolding, so the order costs
// nothing. Per sample rather than a batch at a time: the GEMMs are already
// 64 to 1024 columns wide at ResNet sizes, the output is NCHW as it comes out
// of the GEMM (a batch's would be channel-major and need a transposing copy),
// and the scratch is one sample's. A prototype that unfolded 4 or 16 samples
// into one wider GEMM was not faster on these 2-vCPU machines, within their
// run-to-run noise; what the per-sample GEMMs lose is the weight's packing,
// repeated for every sample (the most at 64 channels of 8x8, where P = 64).
//
// Note [Unfolding in chunks]
// col is K times the size of the sample's output (9x for a 3x3 kernel): at 16
// channels of 32x32 it is 590 KB, more than this core's L2 (512 KB), and the
// GEMM that reads it right after writing it would read it from L3. So a sample
// is unfolded a few output rows at a time, at most kUnfoldFloats (256 KB) per
// piece, in pieces of even size; each piece is one GEMM per group into (or,
// backward, from) its columns of y, dy and dx.
#pragma once

#include <cstdint>
#include <array>
#include <functional>
#include <vector>

#include "nn/module.h"
#include "nn/tensor.h"

namespace cx::nn {

struct Conv2dGeometry {
  size_t in, out, k, stride, padding, dilation, groups;
};

class Conv2dModule : public Module {
 public:
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
  void forward(const DeviceParams& d, DeviceState* state, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* state, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
  std::unique_ptr<DeviceState> make_device_state(cuda::Device& dev) const override;
  void write_config(ByteWriter& w) const override;

  const Conv2dGeometry& geometry() const { return g_; }
  bool has_bias() const { return bias_; }
  // Re-draws the weights from `seed` (bias back to zero).
  void reset_parameters(uint64_t seed);

  // Note [Unfolding in chunks]: the most floats one unfolding may hold (0: the
  // default, kUnfoldFloats); returns the previous setting. For tests, which
  // force many chunks on small images.
  static size_t set_unfold_floats(size_t n);
  static constexpr size_t kUnfoldFloats = 64 * 1024;

 private:
  bool direct() const { return g_.k == 1 && g_.stride == 1 && g_.padding == 0; }
  size_t chunk_rows(size_t OH, size_t OW) const;  // output rows per unfolding
  // Whether the direct kernels compute outputs OH x OW (Note [Direct convolution]).
  bool runs_direct(size_t OH, size_t OW) const;
  // Whether outputs OH x OW of `channels` channels compute with the channels in the vector.
  static bool by_channel_ok(size_t channels, size_t OH, size_t OW);
  // The sample as the direct kernels read it, into `out`: zero-padded, and for stride 2 split into each row's even
  // and odd columns (direct_conv::pad_image, split_columns).
  void image(const float* x, size_t H, size_t W, float* out) const;
  // The weight gradient's direct kernel takes samples of about this many output pixels together: the 8 output
  // channels' dy it reads for each weight stay in L1 (32 KB).
  static constexpr size_t kChunkPixels = 1024;
  // The direct kernels split a batch over threads in parts of at least this many samples.
  static constexpr size_t kPartSamples = 4;
  Conv2dGeometry g_;
  bool bias_;
  Tensor packed_;  // the direct kernels' weights (Note [Direct convolution])
  // Note [Scratch per thread]
  // The buffers a part works in are its thread's, shared by every convolution of the process (they run one
  // after another on a thread): memory grows with threads x the largest layer, not threads x layers. Only the
  // weight-sized sums of a part's samples (part_sums_) belong to the layer, which adds them up after its parts.
  // A buffer whose borders stay zero between calls remembers the geometry it was zeroed for.
  struct PartScratch {
    Tensor padded;                      // GEMMs: one sample, zero-padded (borders stay zero)
    std::array<size_t, 4> padded_for{};  // ... zeroed for (C, H, W, padding)
    Tensor col;                         // GEMMs: its unfolding, or the gradient of it
    Tensor dpadded;                     // GEMMs, backward: dx of one padded sample
    Tensor images;                      // direct: image()s of a sample or of a chunk of samples
    Tensor dys;                         // direct: the chunk's dy (channel- or pixel-major), or a by-channel
                                        // forward's output turned
    Tensor dypadded;                    // direct, backward: dy of one sample, zero-padded by k-1-padding
    std::array<size_t, 4> dypadded_for{};  // ... zeroed for (O, OH, OW, k-1-padding)
  };
  static PartScratch& thread_scratch();  // the calling thread's
  // Backward, where the batch has several parts: each part's weight gradient (GEMMs) or its 16 partial sums per
  // weight (direct), added up in part order.
  std::vector<Tensor> part_sums_;
  // Runs part(begin, end, index, scratch) over [0, N) in parts on the model math's threads (nn/parallel.h), each
  // with its thread's scratch (Note [Scratch per thread]); returns the number of parts.
  size_t in_parts(size_t N, const std::function<void(size_t, size_t, size_t, PartScratch&)>& part);
  // The sample x (in, H, W) zero-padded into s.padded (x itself without padding).
  const float* pad(const float* x, size_t H, size_t W, PartScratch& s) const;
  // Unfolds output rows [oh0, oh1) of the padded sample src into s.col:
  // K = in*k*k rows, (oh1-oh0)*OW columns.
  const float* unfold(const float* src, size_t Hp, size_t Wp, size_t oh0, size_t oh1, size_t OW,
                      PartScratch& s) const;
  // Pads the sample x and unfolds it chunk by chunk of output rows (chunk_rows): f(col, its columns, first row).
  void each_unfolded(const float* x, size_t H, size_t W, size_t OH, size_t OW, PartScratch& s,
                     const std::function<void(const float*, int, size_t)>& f) const;
  // Its transpose: adds dcol (as s.col) into dst, the padded sample's gradient.
  void fold(const float* dcol, float* dst, size_t Hp, size_t Wp, size_t oh0, size_t oh1, size_t OW) const;
};

}  // namespace cx::nn
