// defines: ResidualModule, y = block(x) + shortcut(x), a container of two
// SequentialModels (the shortcut the identity when absent), on the CPU and the GPU
// (layers_gpu.cpp: the two models' layers run on the device as DeviceModel runs a model's).
//
// The container is one module of its model: its parameters are the block's
// then the shortcut's, in their own layer order ("block.0.weight", ...,
// "shortcut.1.bias"), and they are a slice of the model's flat buffers like
// any module's (Note [Models inside a module] in nn/sequential.h), so DDP
// buckets, ZeRO-1 shards, optimizers and checkpoints see them in that fixed
// order. Containers nest: a block may hold ResidualModules.
//
// Forward runs the block and the shortcut on the same input. Backward runs
// the shortcut first, then the block, so that parameter gradients still become
// final in strictly decreasing order (Note [Gradient-ready hook]); dL/dx is the
// sum of the two models' dL/dx (dL/dy itself for the identity).
//
// The file format writes the two models' layers (ids and hyper-parameters)
// after the container's id; the parameters and buffers follow as for any
// module. A layer with a random-number generator (Dropout) is refused inside a
// block: its state would be missing from the trainer's checkpoints (Note [RNG
// state] in nn/module.h); put it outside the residual.
#pragma once

#include <memory>

#include "nn/sequential.h"

namespace cx::nn {

class ResidualModule : public Module {
 public:
  // shortcut may be null (the identity). Throws InvalidArgument if block is
  // null, either model is empty, already held by another ResidualModule or
  // holds a layer with a generator (Dropout).
  ResidualModule(std::shared_ptr<SequentialModel> block, std::shared_ptr<SequentialModel> shortcut);
  // Lets the models go: they keep their layers and values and may grow again.
  ~ResidualModule() override;
  std::string type_name() const override { return "Residual"; }
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
  void to_device(cuda::Device& dev, DeviceState* state) const override;
  void to_host(cuda::Device& dev, const DeviceState* state) override;
  std::vector<std::pair<float*, size_t>> device_buffers(DeviceState* state) override;
  void check_runs_on_gpu() const override;
  void write_config(ByteWriter& w) const override;
  std::vector<std::vector<float>*> buffers() override;
  std::vector<SequentialModel*> submodels() override;
  void set_replica_sum(ReplicaSum sum, const void* owner) override;
  void clear_replica_sum(const void* owner) override;

  const std::shared_ptr<SequentialModel>& block() const { return block_; }
  const std::shared_ptr<SequentialModel>& shortcut() const { return shortcut_; }  // null: the identity

 protected:
  void storage_moved() override;

 private:
  std::shared_ptr<SequentialModel> block_, shortcut_;
  size_t block_tensors_ = 0;  // the block's parameter tensors: the shortcut's are numbered after them
  Shape out_;                 // the last forward's output shape
};

}  // namespace cx::nn
