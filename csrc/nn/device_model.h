// defines: DeviceModel, a SequentialModel on a GPU: its modules run by their own
// device code (Note [Modules on the GPU] in module.h) on one cuda::Device, with
// parameters and gradients in two flat device buffers laid out exactly as the
// host model's (Note [Flat buffers] in sequential.h), so a DDP bucket is a
// device slice NCCL reduces in place.
//
// The host model stays the reference copy for everything that is not a
// training step (saving, predict, checkpoints): to_device() copies parameters
// and each module's device state (BatchNorm statistics, dropout generators) to
// the device, to_host() copies them back. Shapes are checked by the host
// modules' output_shape(), so errors read exactly as on the CPU.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/device.h"
#include "nn/sequential.h"

namespace cx::nn {

// Throws InvalidArgument naming the first layer of `model` that has no GPU
// code (Module::check_runs_on_gpu). Needs no GPU: the trainer calls it before
// it opens one, and DeviceModel's constructor calls it too.
void check_runs_on_gpu(const SequentialModel& model);

class DeviceModel {
 public:
  DeviceModel(std::shared_ptr<SequentialModel> model, cuda::Device& dev);
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  void to_device();
  void to_host();
  // Only the parameters, device to host (after the device broadcast at start).
  void params_to_host();

  // x: (batch, ...) float32 on the device. Returns the device output, valid
  // until the next forward; output_shape() is its shape.
  const float* forward(const float* x, const Shape& shape, bool training);
  const Shape& output_shape() const { return shapes_.back(); }
  // gy: dL/d(output) on the device. Accumulates into grads() and calls
  // hook(i) once parameter i's gradient kernels are queued (indices strictly
  // decreasing, as SequentialModel's Note [Gradient-ready hook]). Computes no
  // gradient for the model's input.
  void backward(const float* gy, const std::function<void(size_t)>& hook);
  void zero_grad();
  // The device sum that modules which communicate use (SyncBatchNormModule: Note [SyncBatchNorm on the GPU] in
  // modules_gpu.cpp) and how many replicas it sums over; given by the GPU trainer, at every world size.
  void set_replica_sum(ReplicaSum sum, int replicas) {
    sum_ = std::move(sum);
    replicas_ = replicas;
  }

  float* params() { return params_.f(); }
  float* grads() { return grads_.f(); }
  size_t size() const { return n_; }
  const std::vector<std::pair<size_t, size_t>>& slices() const { return slices_; }
  // Device buffers that are state but not parameters (BatchNorm running
  // statistics): (pointer, floats).
  std::vector<std::pair<float*, size_t>> buffers();

 private:
  struct Layer {
    Module* m = nullptr;
    size_t first = 0;  // global index of its first parameter tensor
    std::unique_ptr<DeviceState> state;
  };
  DeviceParams device_params() {
    return DeviceParams{dev_, params_.f(), grads_.f(), sum_ ? &sum_ : nullptr, replicas_};
  }

  std::shared_ptr<SequentialModel> model_;
  cuda::Device& dev_;
  size_t n_ = 0;
  std::vector<std::pair<size_t, size_t>> slices_;
  cuda::Buffer params_, grads_;
  std::vector<Layer> layers_;
  std::vector<Shape> shapes_;      // shapes_[i]: input of layer i; shapes_.back(): output
  std::vector<cuda::Buffer> acts_;  // acts_[i]: output of layer i
  const float* input_ = nullptr;
  cuda::Buffer gbuf_[2];
  bool have_forward_ = false;
  ReplicaSum sum_;
  int replicas_ = 1;
};

}  // namespace cx::nn
