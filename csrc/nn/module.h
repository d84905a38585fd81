// defines: Module, the base of every layer; ParamSpec. (A layer's id in
// .cyxmodel files is in its registration: nn/registry.h.)
//
// A module is a pure function of its input and parameters plus whatever it must
// remember for backward (a dropout mask, batch-norm statistics). The model owns
// the activations: forward writes into a buffer the model provides, and backward
// gets the same input and output pointers back, so a module never copies or keeps
// its input.
//
// Parameters: a module declares its parameter tensors (ParamSpec, e.g. Linear's
// weight (out, in) then bias (out,)). Until it is added to a SequentialModel it
// owns a small storage of its own; add() moves the values into the model's flat
// buffers and re-points the module there (attach). Within a module the tensors
// are contiguous and in declaration order, so the model's layout is "layer order,
// weight then bias".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/tensor.h"

namespace cx::cuda {
class Device;
}

namespace cx::nn {

class ByteWriter;
class SequentialModel;

struct ParamSpec {
  std::string name;  // "weight", "bias"
  Shape shape;
};

// Called by backward with a module-local parameter index once that parameter's
// gradient is final for this backward call.
using ParamDone = std::function<void(size_t local_index)>;

// Note [Modules on the GPU]
// Every module runs on a GPU too: the same layer over device memory, its work
// queued on a cuda::Device's stream (nn.cu's kernels, the Device's GEMM). The
// model's parameters and gradients are two flat device buffers laid out as the
// host's (Note [Flat buffers] in sequential.h), so parameter i of a module is at
// param_offset(i) in both. What a module must keep on the device between
// forward and backward, or across steps (a dropout mask and generator state,
// batch-norm statistics), lives in a DeviceState the module makes and the
// DeviceModel running it owns (device_model.h): device memory is freed with
// its device. The module's GPU code is in modules_gpu.cpp, beside its CPU code.
// A blocking SUM all-reduce of n float64 over the replicas (Note [Modules that communicate] below): of host
// memory as set_replica_sum gives it, of device memory, after what the stream holds, as DeviceParams carries it.
using ReplicaSum = std::function<void(double* buf, size_t n)>;

struct DeviceParams {
  cuda::Device& dev;
  float* params;  // the model's flat device parameters
  float* grads;   // and gradients
  const ReplicaSum* replica_sum = nullptr;  // SyncBatchNormModule's statistics (Note [SyncBatchNorm on the GPU])
  int replicas = 1;                         // the ranks replica_sum sums over
};

class DeviceState {
 public:
  virtual ~DeviceState() = default;
};

// Note [Modules that communicate]
// nn/ knows nothing of distribution (README "Design"), yet a module may need a
// sum over the replicas of a data-parallel model: SyncBatchNormModule's batch
// statistics are those of every rank's batch together. Such a module is given
// the sum from outside: train/ (DistributedDataParallel, which the trainer uses
// too) hands every module a ReplicaSum, a blocking SUM all-reduce of a float64
// buffer over its process group, when it wraps the model and takes it back when
// it goes away (owner: the wrapper; as the grad-ready hook, only the newest
// wrapper's stays). Every rank calls it at the same point of the same forward
// or backward, so the collectives pair up; it is only given in a world of more
// than one. A module without one computes on its local batch alone.

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // "Linear": the name the layer is registered under (nn/registry.h).
  virtual std::string type_name() const = 0;
  virtual std::string repr() const = 0;       // "Linear(784, 256, bias=True)"

  // Shape of the output for an input shape (batch first). Throws InvalidArgument
  // saying which input shape it expects.
  virtual Shape output_shape(const Shape& in) const = 0;
  // y has room for output_shape(in).
  virtual void forward(const float* x, const Shape& in, float* y, bool training) = 0;
  // x, y: the input and output of the last forward; gy: dL/dy. Accumulates (+=)
  // parameter gradients, calls done(i) for each parameter once its gradient is
  // final (in reverse declaration order), and writes dL/dx into gx unless null.
  virtual void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                        const ParamDone& done) = 0;

  // The same on a GPU (Note [Modules on the GPU]): x, y, gy, gx are device
  // pointers; `state` is what make_device_state() made (null if nothing).
  virtual void forward(const DeviceParams& d, DeviceState* state, const float* x, const Shape& in, float* y,
                       bool training) = 0;
  virtual void backward(const DeviceParams& d, DeviceState* state, const float* x, const float* y, const Shape& in,
                        const float* gy, float* gx, const ParamDone& done) = 0;
  // The module's device state, filled from the host module (to_device), and
  // copied back into it (to_host). Modules without any return null.
  virtual std::unique_ptr<DeviceState> make_device_state(cuda::Device& dev) const { return nullptr; }
  virtual void to_device(cuda::Device& dev, DeviceState* state) const {}
  virtual void to_host(cuda::Device& dev, const DeviceState* state) {}
  // buffers() on the device: (pointer, floats), in the same order.
  virtual std::vector<std::pair<float*, size_t>> device_buffers(DeviceState* state) { return {}; }
  // Throws InvalidArgument saying why if this module has no GPU code (yet);
  // the GPU trainer asks every module before it touches a device.
  virtual void check_runs_on_gpu() const {}

  // Note [Modules that communicate]: most modules ignore these.
  virtual void set_replica_sum(ReplicaSum sum, const void* owner) {}
  virtual void clear_replica_sum(const void* owner) {}

  // Containers (ResidualModule): the models they hold, in parameter order.
  // Whatever walks a model's layers (convert_sync_batchnorm, DDP's checks)
  // walks these too; everything else sees a container as one module.
  virtual std::vector<SequentialModel*> submodels() { return {}; }

  // Non-trainable state saved with the model (BatchNorm's running statistics).
  virtual std::vector<std::vector<float>*> buffers() { return {}; }
  // Hyper-parameters, written to model files right after the layer's id; its
  // registered reader reads them back (nn/registry.h).
  virtual void write_config(ByteWriter& w) const {}

  // Note [RNG state]
  // A module that draws random numbers while training (DropoutModule's masks)
  // has a generator whose state is part of the training state, like optimizer
  // moments: a resumed run draws the same masks as an uninterrupted one only if
  // the state is saved and restored. It is not in .cyxmodel files (those hold
  // the seed, so a loaded model starts its stream afresh); the trainer's
  // checkpoints hold it (python/pycyxwiz/distributed/_train.py).
  virtual bool has_rng_state() const { return false; }
  virtual uint64_t rng_state() const { return 0; }
  virtual void set_rng_state(uint64_t) {}

  const std::vector<ParamSpec>& param_specs() const { return specs_; }
  size_t num_params() const { return total_; }  // scalars over all its tensors
  float* param(size_t i) { return p_->data() + offset_ + local_off_[i]; }
  // Parameter i (its gradient) within the model's flat device buffers.
  float* param(const DeviceParams& d, size_t i) const { return d.params + param_offset(i); }
  float* grad(const DeviceParams& d, size_t i) const { return d.grads + param_offset(i); }
  float* grad(size_t i) { return g_->data() + offset_ + local_off_[i]; }
  const float* param(size_t i) const { return p_->data() + offset_ + local_off_[i]; }
  size_t param_offset(size_t i) const { return offset_ + local_off_[i]; }
  const std::shared_ptr<FloatStorage>& param_storage() const { return p_; }
  const std::shared_ptr<FloatStorage>& grad_storage() const { return g_; }

  // SequentialModel only: from now on this module's parameters live in
  // (params, grads) starting at `offset`. Copies the current values over.
  void attach(std::shared_ptr<FloatStorage> params, std::shared_ptr<FloatStorage> grads, size_t offset);
  bool in_model() const { return in_model_; }
  void set_in_model() { in_model_ = true; }
  // SequentialModel only, when it replaces this module: gives it back a
  // storage of its own holding its current values; it belongs to no model.
  void detach();

  // Using a module on its own (tests, experiments): keeps a copy of the input.
  const Tensor& forward_standalone(const float* x, const Shape& in, bool training);
  const Tensor& backward_standalone(const float* gy, const Shape& shape);

 protected:
  // Derived constructors call this once; it allocates the module's own storage.
  void declare_params(std::vector<ParamSpec> specs);
  // After attach() or detach() moved the parameters: a container re-points the
  // models it holds (Note [Models inside a module] in sequential.h).
  virtual void storage_moved() {}

 private:
  std::vector<ParamSpec> specs_;
  std::vector<size_t> local_off_;
  size_t total_ = 0;
  std::shared_ptr<FloatStorage> p_ = std::make_shared<FloatStorage>(0);
  std::shared_ptr<FloatStorage> g_ = std::make_shared<FloatStorage>(0);
  size_t offset_ = 0;
  bool in_model_ = false;
  Tensor sx_, sy_, sgx_;
  bool standalone_ready_ = false;
};

}  // namespace cx::nn
