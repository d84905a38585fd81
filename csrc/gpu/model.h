// defines: GpuModel, a SequentialModel's device twin: the same layers run by
// csrc/cuda/nn.cu on one Device, with parameters and gradients in two flat
// device buffers laid out exactly as the host model's (Note [Flat buffers] in
// nn/sequential.h), so a DDP bucket is a device slice NCCL reduces in place.
//
// The host model stays the reference copy for everything that is not a
// training step (saving, predict, checkpoints): upload() copies parameters,
// BatchNorm running statistics and dropout generator states to the device,
// download() copies them back. Shapes are checked by the host modules'
// output_shape(), so errors read exactly as on the CPU. Dropout masks are the
// ones the CPU draws from the same generator state (csrc/cuda/nn.cu).
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "gpu/runtime.h"
#include "nn/sequential.h"

namespace cx::gpu {

class GpuModel {
 public:
  GpuModel(std::shared_ptr<nn::SequentialModel> model, Device& dev);
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  void upload();
  void download();
  // Only the parameters, device to host (after the device broadcast at start).
  void download_params();

  // x: (batch, ...) float32 on the device. Returns the device output, valid
  // until the next forward; output_shape() is its shape.
  const float* forward(const float* x, const nn::Shape& shape, bool training);
  const nn::Shape& output_shape() const { return shapes_.back(); }
  // gy: dL/d(output) on the device. Accumulates into grads() and calls
  // hook(i) once parameter i's gradient kernels are queued (indices strictly
  // decreasing, as SequentialModel's Note [Gradient-ready hook]). Computes no
  // gradient for the model's input.
  void backward(const float* gy, const std::function<void(size_t)>& hook);
  void zero_grad();

  float* params() { return params_.f(); }
  float* grads() { return grads_.f(); }
  size_t size() const { return n_; }
  const std::vector<std::pair<size_t, size_t>>& slices() const { return slices_; }
  // Device buffers that are state but not parameters (BatchNorm running
  // statistics): (pointer, floats).
  std::vector<std::pair<float*, size_t>> buffers();

 private:
  struct Layer {
    nn::Module* m = nullptr;
    nn::ModuleKind kind{};
    size_t first = 0;  // global index of its first parameter tensor
    uint64_t rng = 0;  // dropout generator state
    bool last_training = false;
    Buffer mask, xhat, invstd, rmean, rvar;
  };
  float* param(const Layer& l, size_t i) { return params_.f() + slices_[l.first + i].first; }
  float* grad(const Layer& l, size_t i) { return grads_.f() + slices_[l.first + i].first; }

  std::shared_ptr<nn::SequentialModel> model_;
  Device& dev_;
  size_t n_ = 0;
  std::vector<std::pair<size_t, size_t>> slices_;
  Buffer params_, grads_;
  std::vector<Layer> layers_;
  std::vector<nn::Shape> shapes_;  // shapes_[i]: input of layer i; shapes_.back(): output
  std::vector<Buffer> acts_;       // acts_[i]: output of layer i
  const float* input_ = nullptr;
  Buffer gbuf_[2];
  bool have_forward_ = false;
};

}  // namespace cx::gpu
