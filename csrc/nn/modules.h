// defines: the layers — LinearModule, the activations (ReLU, LeakyReLU, Sigmoid,
// Tanh, GELU, Softmax), DropoutModule, BatchNormModule, FlattenModule — and
// read_module(), which rebuilds one from a model file.
//
// Shapes: Linear, Softmax and BatchNorm take (batch, features); the element-wise
// layers and Dropout take any (batch, ...) and keep it; Flatten turns
// (batch, d1, d2, ...) into (batch, d1*d2*...).
#pragma once

#include <memory>

#include "nn/module.h"
#include "nn/rng.h"

namespace cx::nn {

class ByteReader;

enum class LinearInit : uint8_t { kKaiming = 0, kXavier = 1 };
// "kaiming" or "xavier" (init= of cx.LinearModule); InvalidArgument naming both for anything else.
LinearInit linear_init_from_name(const std::string& name);

// y = x W^T + b, W is (out, in) as in PyTorch. Init (seeded): Kaiming-uniform
// U(-sqrt(6/in), sqrt(6/in)) for ReLU nets, or Xavier-uniform
// U(-sqrt(6/(in+out)), +); bias starts at zero.
class LinearModule : public Module {
 public:
  LinearModule(size_t in, size_t out, bool bias = true, LinearInit init = LinearInit::kKaiming, uint64_t seed = 0);
  ModuleKind kind() const override { return ModuleKind::kLinear; }
  std::string type_name() const override { return "Linear"; }
  std::string repr() const override;
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
  void write_config(ByteWriter& w) const override;
  size_t in_features() const { return in_; }
  size_t out_features() const { return out_; }
  bool has_bias() const { return bias_; }
  LinearInit init() const { return init_; }
  // Re-draws the weights from `seed` (bias back to zero).
  void reset_parameters(uint64_t seed);

 private:
  size_t in_, out_;
  bool bias_;
  LinearInit init_;
};

// Element-wise layers share one shape rule.
class ElementwiseModule : public Module {
 public:
  Shape output_shape(const Shape& in) const override;
};

// The activations share their GPU code: one kernel each way, told which function
// by a code (nn.cu's cx_nn_act_fwd/bwd).
class ActivationModule : public ElementwiseModule {
 public:
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;

 protected:
  virtual int device_code() const = 0;  // cx_nn_act_fwd's: 0 ReLU, 1 LeakyReLU, 2 Sigmoid, 3 Tanh, 4 GELU
  virtual float device_slope() const { return 0.0f; }
};

class ReLUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  ModuleKind kind() const override { return ModuleKind::kReLU; }
  std::string type_name() const override { return "ReLU"; }
  std::string repr() const override { return "ReLU()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  int device_code() const override { return 0; }
};

class LeakyReLUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  explicit LeakyReLUModule(float negative_slope = 0.01f);
  ModuleKind kind() const override { return ModuleKind::kLeakyReLU; }
  std::string type_name() const override { return "LeakyReLU"; }
  std::string repr() const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void write_config(ByteWriter& w) const override;
  float negative_slope() const { return slope_; }

 protected:
  int device_code() const override { return 1; }
  float device_slope() const override { return slope_; }

 private:
  float slope_;
};

class SigmoidModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  ModuleKind kind() const override { return ModuleKind::kSigmoid; }
  std::string type_name() const override { return "Sigmoid"; }
  std::string repr() const override { return "Sigmoid()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  int device_code() const override { return 2; }
};

class TanhModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  ModuleKind kind() const override { return ModuleKind::kTanh; }
  std::string type_name() const override { return "Tanh"; }
  std::string repr() const override { return "Tanh()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  int device_code() const override { return 3; }
};

// Exact GELU: x * Phi(x), Phi the standard normal CDF (PyTorch's default).
class GELUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  ModuleKind kind() const override { return ModuleKind::kGELU; }
  std::string type_name() const override { return "GELU"; }
  std::string repr() const override { return "GELU()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  int device_code() const override { return 4; }
};

// Softmax over the features of each row of (batch, features).
class SoftmaxModule : public Module {
 public:
  ModuleKind kind() const override { return ModuleKind::kSoftmax; }
  std::string type_name() const override { return "Softmax"; }
  std::string repr() const override { return "Softmax()"; }
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
};

// Inverted dropout: in training each element is zeroed with probability p and the
// rest scaled by 1/(1-p); in eval mode it is the identity. Masks come from a
// seeded generator, so runs repeat exactly.
class DropoutModule : public ElementwiseModule {
 public:
  explicit DropoutModule(float p = 0.5f, uint64_t seed = 0);
  ModuleKind kind() const override { return ModuleKind::kDropout; }
  std::string type_name() const override { return "Dropout"; }
  std::string repr() const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
  std::unique_ptr<DeviceState> make_device_state(cuda::Device& dev) const override;
  void to_device(cuda::Device& dev, DeviceState* state) const override;
  void to_host(cuda::Device& dev, const DeviceState* state) override;
  void write_config(ByteWriter& w) const override;
  float p() const { return p_; }
  uint64_t seed() const { return seed_; }
  bool has_rng_state() const override { return true; }
  uint64_t rng_state() const override { return rng_.state(); }
  void set_rng_state(uint64_t s) override { rng_.set_state(s); }

 private:
  float p_;
  uint64_t seed_;
  Rng rng_;
  Tensor mask_;
  bool last_training_ = false;
};

// Batch normalisation over (batch, features): per-feature gamma (weight, starts
// at 1) and beta (bias, starts at 0). Training mode normalises with the batch's
// statistics and updates running_mean/running_var (momentum, unbiased variance,
// as PyTorch); eval mode uses the running statistics.
class BatchNormModule : public Module {
 public:
  explicit BatchNormModule(size_t features, float eps = 1e-5f, float momentum = 0.1f);
  ModuleKind kind() const override { return ModuleKind::kBatchNorm; }
  std::string type_name() const override { return "BatchNorm"; }
  std::string repr() const override;
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
  std::unique_ptr<DeviceState> make_device_state(cuda::Device& dev) const override;
  void to_device(cuda::Device& dev, DeviceState* state) const override;
  void to_host(cuda::Device& dev, const DeviceState* state) override;
  std::vector<std::pair<float*, size_t>> device_buffers(DeviceState* state) override;
  std::vector<std::vector<float>*> buffers() override { return {&running_mean_, &running_var_}; }
  void write_config(ByteWriter& w) const override;
  size_t features() const { return f_; }
  float eps() const { return eps_; }
  float momentum() const { return momentum_; }
  std::vector<float>& running_mean() { return running_mean_; }
  std::vector<float>& running_var() { return running_var_; }

 private:
  size_t f_;
  float eps_, momentum_;
  std::vector<float> running_mean_, running_var_;
  Tensor xhat_;
  std::vector<float> invstd_;
  bool last_training_ = false;
};

class FlattenModule : public Module {
 public:
  ModuleKind kind() const override { return ModuleKind::kFlatten; }
  std::string type_name() const override { return "Flatten"; }
  std::string repr() const override { return "Flatten()"; }
  Shape output_shape(const Shape& in) const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
};

// Reads one module's kind and hyper-parameters (not its weights). Throws IoError
// through `r` on unknown kinds or bad values.
std::shared_ptr<Module> read_module(ByteReader& r);

}  // namespace cx::nn
