// defines: the 2-D pooling layers over NCHW float32 images — MaxPool2dModule,
// AvgPool2dModule (torch.nn.MaxPool2d / AvgPool2d with square windows and no
// padding) and GlobalAvgPool2dModule ((batch, C, H, W) -> (batch, C), the mean
// of each channel), on the CPU and the GPU (layers_gpu.cpp). No parameters.
//
// Shapes: a window of kernel_size moved by stride (kernel_size when not given):
//   OH = (H - kernel_size) / stride + 1   (the same for OW; windows that would
// run past the edge are dropped, as PyTorch's floor mode). Overlapping windows
// (stride < kernel_size) are allowed; in backward their gradients add up.
#pragma once

#include <cstdint>
#include <vector>

#include "nn/module.h"

namespace cx::nn {

// What the two windowed poolings share: the window, the shape rule, the file format.
class Pool2dModule : public Module {
 public:
  // Throws InvalidArgument, naming `layer` ("MaxPool2dModule"), for kernel_size or stride < 1.
  Pool2dModule(const char* layer, int64_t kernel_size, int64_t stride);
  std::string repr() const override;
  Shape output_shape(const Shape& in) const override;
  void write_config(ByteWriter& w) const override;
  size_t kernel_size() const { return k_; }
  size_t stride() const { return s_; }

 protected:
  size_t k_, s_;
};

// The maximum of each window (NaN if the window holds one, as PyTorch). Its
// gradient goes to the window's first maximum.
class MaxPool2dModule : public Pool2dModule {
 public:
  MaxPool2dModule(int64_t kernel_size, int64_t stride) : Pool2dModule("MaxPool2dModule", kernel_size, stride) {}
  std::string type_name() const override { return "MaxPool2d"; }
  std::unique_ptr<DeviceState> make_device_state(cuda::Device& dev) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* state, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* state, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;

 private:
  std::vector<uint32_t> argmax_;  // per output element: the index of its maximum within its channel's plane
};

// The mean of each window (kernel_size^2 values).
class AvgPool2dModule : public Pool2dModule {
 public:
  AvgPool2dModule(int64_t kernel_size, int64_t stride) : Pool2dModule("AvgPool2dModule", kernel_size, stride) {}
  std::string type_name() const override { return "AvgPool2d"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* state, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* state, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
};

class GlobalAvgPool2dModule : public Module {
 public:
  std::string type_name() const override { return "GlobalAvgPool2d"; }
  std::string repr() const override { return "GlobalAvgPool2d()"; }
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* state, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* state, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
};

}  // namespace cx::nn
