// defines: SequentialModel — an ordered list of modules whose parameters and
// gradients live in two flat float32 buffers it owns.
//
// Note [Flat buffers]
// Every parameter tensor (and its gradient) is a slice of one contiguous buffer,
// in layer order, weight then bias: param_slices()[i] = (offset, count). The
// distributed layer all-reduces slices of flat_grads() in place (a DDP bucket is
// just a range), and optimizers update flat_params() in one vectorised pass.
// add() re-lays the buffers out (allocates bigger ones and copies every value),
// so pointers from flat_params()/flat_grads() are valid until the next add().
//
// Usage from C++ (one call each per batch):
//   const Tensor& out = model.forward(x, {batch, 784});
//   model.backward(grad_out, out.shape(), /*input_grad=*/false);
//   optimizer.step(model);
//
// forward() does not copy its input: x must stay alive and unchanged until the
// matching backward() has returned (the Python binding keeps the array alive).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"

namespace cx::nn {

class SequentialModel {
 public:
  // Called with a parameter index (into param_slices()) during backward().
  using GradReadyHook = std::function<void(size_t param_index)>;

  SequentialModel() = default;
  SequentialModel(const SequentialModel&) = delete;
  SequentialModel& operator=(const SequentialModel&) = delete;

  // Appends a module; its current parameter values move into the flat buffers.
  // A module belongs to at most one model (InvalidArgument otherwise).
  void add(std::shared_ptr<Module> m);
  size_t size() const { return modules_.size(); }
  const std::shared_ptr<Module>& module(size_t i) const { return modules_.at(i); }
  // Puts m in place of module i. m must declare the same parameter tensors
  // (names and shapes), so the flat layout, parameter indices and buckets stay
  // as they are; m's current values move into the slot (as add()), and the
  // module it replaces leaves with a copy of its own (Module::detach).
  // InvalidArgument otherwise, or if m already belongs to a model.
  void replace(size_t i, std::shared_ptr<Module> m);

  // x: row-major, shape (batch, ...) with batch >= 1. Returns the model's output
  // (owned by the model, valid until the next forward). Throws InvalidArgument
  // naming the layer and the shape it expects.
  const Tensor& forward(const float* x, const Shape& shape);
  // The shapes forward() goes through for an input of `shape`: [input, output of
  // layer 0, ..., output of the last layer]. Throws InvalidArgument as forward()
  // does (the device model checks shapes with it too).
  std::vector<Shape> shapes_for(const Shape& shape) const;

  // grad_output: dL/d(output) with the output's shape. Accumulates (+=) into
  // flat_grads(). Returns dL/dx (owned by the model) when input_grad, else null;
  // skipping it saves the first layer's largest GEMM.
  //
  // Note [Gradient-ready hook]
  // If a hook is set, backward calls hook(i) as soon as parameter i's gradient
  // is final for this call, i.e. all of this backward's contributions have been
  // added into flat_grads()[param_slices()[i]]. Layers run last to first, and
  // within a layer bias before weight, so indices arrive in strictly decreasing
  // order, each exactly once per backward. The hook runs synchronously on the
  // thread calling backward (which does not hold the GIL); it must not call back
  // into this model and should be quick (e.g. enqueue an async all-reduce of a
  // bucket whose last parameter just became ready). The slice it names is not
  // written again by this backward.
  const Tensor* backward(const float* grad_output, const Shape& shape, bool input_grad = true);

  // `owner` identifies who set the hook (DDP passes itself): a model wrapped
  // twice has one hook, the newest wrapper's, and an older wrapper can tell
  // (hook_owner() != this) and must not clear it (clear_grad_ready_hook(owner)
  // is a no-op unless owner set the current hook).
  void set_grad_ready_hook(GradReadyHook hook, const void* owner = nullptr) {
    hook_ = std::move(hook);
    hook_owner_ = owner;
  }
  void clear_grad_ready_hook() {
    hook_ = nullptr;
    hook_owner_ = nullptr;
  }
  void clear_grad_ready_hook(const void* owner) {
    if (hook_owner_ == owner) clear_grad_ready_hook();
  }
  const void* hook_owner() const { return hook_ ? hook_owner_ : nullptr; }

  // The generator states of every module with one (Note [RNG state] in
  // module.h), in layer order. set_rng_states takes as many as rng_states()
  // returns (InvalidArgument otherwise).
  std::vector<uint64_t> rng_states() const;
  void set_rng_states(const std::vector<uint64_t>& states);

  void zero_grad();
  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }
  // Anomaly mode (as torch.autograd.detect_anomaly): forward and backward check
  // every layer's output and gradients and raise NonFiniteError naming the
  // first layer (index and type) that turned finite values into inf/NaN.
  // Off by default: it reads every activation and gradient once more.
  void set_detect_anomaly(bool on) { detect_anomaly_ = on; }
  bool detect_anomaly() const { return detect_anomaly_; }

  float* flat_params() { return params_->data() + base_; }
  float* flat_grads() { return grads_->data() + base_; }
  const float* flat_params() const { return params_->data() + base_; }
  const float* flat_grads() const { return grads_->data() + base_; }
  size_t num_parameters() const { return total_; }
  // (offset, count) of every parameter tensor, layer order, weight then bias;
  // offsets from flat_params().
  std::vector<std::pair<size_t, size_t>> param_slices() const;
  // For each parameter tensor: (module index, index within the module).
  const std::vector<std::pair<size_t, size_t>>& param_owners() const { return owners_; }
  const std::shared_ptr<FloatStorage>& param_storage() const { return params_; }
  const std::shared_ptr<FloatStorage>& grad_storage() const { return grads_; }
  // Where flat_params() starts in param_storage(): 0 but for a container's model.
  size_t base_offset() const { return base_; }

  // Note [Models inside a module]
  // A container (ResidualModule) holds whole models, whose parameters must be
  // a slice of the container's own (and so, once the container is in a model,
  // of that model's flat buffers: Note [Flat buffers]). hold() marks this model
  // as held by `holder`, which checks holder() is null first; from then on add()
  // refuses, since it would re-lay the buffers out under the container.
  // adopt_storage() re-points every module to (params, grads) from `offset` on,
  // in the same order; the container calls it whenever its own storage moves
  // (Module::storage_moved).
  void hold(const void* holder) { holder_ = holder; }
  const void* holder() const { return holder_; }
  void adopt_storage(std::shared_ptr<FloatStorage> params, std::shared_ptr<FloatStorage> grads, size_t offset);
  // The output shapes of every layer as shapes_for(), with errors naming the
  // layer ("layer 2: ...") but not the model: a container prefixes its own.
  std::vector<Shape> layer_shapes(const Shape& shape) const;

  std::string repr() const;
  std::string summary() const;  // a table: layer, output features, parameters

  // .cyxmodel files (Note [.cyxmodel format, version 1] in serialize.h).
  std::string serialize() const;
  void save(const std::string& path) const;
  static std::shared_ptr<SequentialModel> deserialize(const std::string& bytes, const std::string& what);
  static std::shared_ptr<SequentialModel> load(const std::string& path);

 private:
  std::vector<std::shared_ptr<Module>> modules_;
  std::vector<std::pair<size_t, size_t>> owners_;
  std::vector<size_t> first_param_;  // per module: global index of its first parameter tensor
  std::shared_ptr<FloatStorage> params_ = std::make_shared<FloatStorage>(0);
  std::shared_ptr<FloatStorage> grads_ = std::make_shared<FloatStorage>(0);
  size_t total_ = 0;
  size_t base_ = 0;                 // Note [Models inside a module]
  const void* holder_ = nullptr;
  bool training_ = true;
  bool detect_anomaly_ = false;
  void check_backward(size_t k, const float* gx) const;  // anomaly mode, after layer k's backward
  GradReadyHook hook_;
  const void* hook_owner_ = nullptr;

  // State of the last forward, for backward.
  const float* input_ = nullptr;
  Shape in_shape_;
  std::vector<Shape> shapes_;  // shapes_[i]: input shape of module i; shapes_[n]: output
  std::vector<Tensor> acts_;   // acts_[i]: output of module i
  Tensor gbuf_[2];
  bool have_forward_ = false;
};

}  // namespace cx::nn
