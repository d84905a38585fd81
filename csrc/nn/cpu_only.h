// defines: CpuOnly<Base>, the GPU side of a layer whose GPU code has not run on
// a GPU yet: none. Such a layer derives from CpuOnly<Module> (or
// CpuOnly<SomeModule>) and writes only its CPU code.
//
// GPU code is verified or refused (DESIGN.md): check_runs_on_gpu() throws,
// naming the layer, and the GPU trainer asks every module before it opens a
// device (nn::check_runs_on_gpu in device_model.h), so a model holding such a
// layer is refused at trainer construction on every rank, in these words:
//   the model cannot train on the GPU: layer 2: Conv2d(16, 32, kernel_size=3):
//   Conv2dModule has no GPU code yet; train it with BackendType.CPU ...
// The device forward/backward refuse the same way should anything get past it.
// When the layer's GPU code exists and has run on a GPU, it derives from its
// base directly and overrides these (Note [Modules on the GPU] in module.h).
#pragma once

#include <memory>

#include "common/error.h"
#include "nn/module.h"

namespace cx::nn {

template <typename Base>
class CpuOnly : public Base {
 public:
  using Base::Base;
  using Base::backward;  // the CPU ones
  using Base::forward;

  void check_runs_on_gpu() const override {
    CX_THROW(InvalidArgument, this->repr(), ": ", this->type_name(), "Module has no GPU code yet; train it with "
             "BackendType.CPU (DISTRIBUTED_BACKEND=cpu)");
  }
  void forward(const DeviceParams&, DeviceState*, const float*, const Shape&, float*, bool) override {
    check_runs_on_gpu();
  }
  void backward(const DeviceParams&, DeviceState*, const float*, const float*, const Shape&, const float*, float*,
                const ParamDone&) override {
    check_runs_on_gpu();
  }
  std::unique_ptr<DeviceState> make_device_state(cuda::Device&) const override {
    check_runs_on_gpu();
    return nullptr;
  }
};

}  // namespace cx::nn
