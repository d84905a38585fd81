// defines: the first layers — LinearModule, the activations (ReLU, LeakyReLU,
// Sigmoid, Tanh, GELU, Softmax), DropoutModule, BatchNormModule,
// SyncBatchNormModule, FlattenModule — and convert_sync_batchnorm(). Each is
// registered (file id, name, reader) in modules.cpp; layers added since live in
// a file pair of their own under nn/layers/ (README "Design": adding a layer).
//
// Shapes: Linear, Softmax and BatchNorm take (batch, features); the element-wise
// layers and Dropout take any (batch, ...) and keep it; Flatten turns
// (batch, d1, d2, ...) into (batch, d1*d2*...).
#pragma once

#include <memory>

#include "nn/module.h"
#include "nn/rng.h"

namespace cx::nn {

class SequentialModel;

enum class LinearInit : uint8_t { kKaiming = 0, kXavier = 1 };
// "kaiming" or "xavier" (init= of cx.LinearModule); InvalidArgument naming both for anything else.
LinearInit linear_init_from_name(const std::string& name);

// y = x W^T + b, W is (out, in) as in PyTorch. Init (seeded): Kaiming-uniform
// U(-sqrt(6/in), sqrt(6/in)) for ReLU nets, or Xavier-uniform
// U(-sqrt(6/(in+out)), +); bias starts at zero.
class LinearModule : public Module {
 public:
  LinearModule(size_t in, size_t out, bool bias = true, LinearInit init = LinearInit::kKaiming, uint64_t seed = 0);
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

// The activations' formulas are cuda/act_rules.h's, for both devices. On the GPU
// each has a kernel each way (cuda/nn.cu's cx_nn_<name>_fwd/_bwd), all of one
// signature, so that one launch serves them all.
class ActivationModule : public ElementwiseModule {
 public:
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;

 protected:
  virtual const char* device_kernel(bool backward) const = 0;
  virtual float device_slope() const { return 0.0f; }  // the kernels' last argument: LeakyReLU's slope
};

class ReLUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  std::string type_name() const override { return "ReLU"; }
  std::string repr() const override { return "ReLU()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  const char* device_kernel(bool backward) const override;
};

class LeakyReLUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  explicit LeakyReLUModule(float negative_slope = 0.01f);
  std::string type_name() const override { return "LeakyReLU"; }
  std::string repr() const override;
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;
  void write_config(ByteWriter& w) const override;
  float negative_slope() const { return slope_; }

 protected:
  const char* device_kernel(bool backward) const override;
  float device_slope() const override { return slope_; }

 private:
  float slope_;
};

class SigmoidModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  std::string type_name() const override { return "Sigmoid"; }
  std::string repr() const override { return "Sigmoid()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  const char* device_kernel(bool backward) const override;
};

class TanhModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  std::string type_name() const override { return "Tanh"; }
  std::string repr() const override { return "Tanh()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  const char* device_kernel(bool backward) const override;
};

// Exact GELU: x * Phi(x), Phi the standard normal CDF (PyTorch's default).
class GELUModule : public ActivationModule {
 public:
  using ActivationModule::backward;  // the GPU ones
  using ActivationModule::forward;
  std::string type_name() const override { return "GELU"; }
  std::string repr() const override { return "GELU()"; }
  void forward(const float* x, const Shape& in, float* y, bool training) override;
  void backward(const float* x, const float* y, const Shape& in, const float* gy, float* gx,
                const ParamDone& done) override;

 protected:
  const char* device_kernel(bool backward) const override;
};

// Softmax over the features of each row of (batch, features).
class SoftmaxModule : public Module {
 public:
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
  explicit BatchNormModule(size_t features, float eps = 1e-5f, float momentum = 0.1f)
      : BatchNormModule("BatchNormModule", features, eps, momentum) {}
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

 protected:
  // `layer` names the class in the constructor's errors.
  BatchNormModule(const char* layer, size_t features, float eps, float momentum);
  // The same statistics over images (batch, C, H, W): per channel over batch, H
  // and W (nn/layers/batchnorm2d.cpp). forward() and backward() hand 4-D inputs
  // to these; BatchNormModule's own output_shape() admits none.
  void forward_nchw(const float* x, const Shape& in, float* y, bool training);
  void backward_nchw(const float* x, const Shape& in, const float* gy, float* gx, const ParamDone& done);

  // The sum over replicas (Note [Modules that communicate]): always null here;
  // SyncBatchNormModule's when train/ has given it one. The CPU forward and
  // backward below are the two modules' one implementation: with a null sum it
  // is batch normalisation of the local batch, with one of the union of every
  // rank's batch (Note [SyncBatchNorm statistics]).
  ReplicaSum sum_;
  const void* sum_owner_ = nullptr;

 private:
  size_t f_;
  float eps_, momentum_;
  std::vector<float> running_mean_, running_var_;
  Tensor xhat_;               // (batch, features) only: images recompute it from x and mean_
  std::vector<float> invstd_;
  std::vector<float> mean_;   // images: the mean the last forward normalised with
  std::vector<double> stats_;  // what is summed over replicas
  double last_count_ = 0;      // rows behind the last training forward's statistics (every rank's)
  bool last_training_ = false;
  bool last_synced_ = false;   // the last forward's statistics were summed over replicas
};

// Note [SyncBatchNorm statistics]
// As torch.nn.SyncBatchNorm: in training the batch mean and variance are those
// of the union of every rank's batch, so N ranks with b rows each normalise as
// one process with the N*b rows would, and the running statistics are updated
// from those global statistics (unbiased variance over the global count). The
// statistics are two SUM all-reduces of float64, the same two passes
// BatchNormModule makes over its own batch:
//   1. [rows, sum of x_j for each feature j]   -> global count M and mean m_j
//   2. [sum of (x_j - m_j)^2 for each j]         -> variance (biased /M, unbiased /(M-1))
// rather than one all-reduce of [rows, sum x, sum x^2] with var = E[x^2] - m^2.
// The one-pass form subtracts two numbers of size m^2 to get one of size var,
// losing about log10(m^2/var) digits (features far from zero mean: a layer's
// inputs before the network has learned to centre them); the centred pass
// loses nothing, and in a world of one it is bit for bit BatchNormModule's own
// computation. The price is one more all-reduce per forward, of F doubles: a
// latency, not a bandwidth, cost.
// Backward needs, for dL/dx, two per-feature sums over the whole batch: sum of
// dy and sum of dy*xhat; they are one SUM all-reduce ([2F] float64). The
// gradients of gamma and beta stay the local sums: DistributedDataParallel
// averages them like every other parameter's, which is the gradient of the
// global batch (each rank's loss is its batch's mean). The backward all-reduce
// is skipped when no dL/dx is wanted (the first layer of a model run with
// input_grad=False, the same on every rank).
// Without a sum (outside DistributedDataParallel, or a world of one) the module
// is BatchNormModule on its local batch. Eval mode uses the running statistics
// and communicates nothing. On the GPU: Note [SyncBatchNorm on the GPU] in
// modules_gpu.cpp.
class SyncBatchNormModule : public BatchNormModule {
 public:
  using BatchNormModule::BatchNormModule;
  using BatchNormModule::backward;
  using BatchNormModule::forward;
  // A SyncBatchNormModule with bn's hyper-parameters, parameters (and their
  // gradients) and running statistics.
  static std::shared_ptr<SyncBatchNormModule> from(BatchNormModule& bn);
  std::string type_name() const override { return "SyncBatchNorm"; }
  // (batch, features) as BatchNormModule, or images (batch, features, H, W) as
  // BatchNorm2dModule: convert_sync_batchnorm() replaces both.
  Shape output_shape(const Shape& in) const override;
  void set_replica_sum(ReplicaSum sum, const void* owner) override;
  void clear_replica_sum(const void* owner) override;

  // On the GPU: BatchNormModule's device state, the statistics summed by DeviceParams::replica_sum (Note
  // [SyncBatchNorm on the GPU] in modules_gpu.cpp).
  void forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
               bool training) override;
  void backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y, const Shape& in,
                const float* gy, float* gx, const ParamDone& done) override;
};

// Replaces every BatchNormModule and BatchNorm2dModule of `model`, and of the
// models its containers hold (ResidualModule's block and shortcut), by a
// SyncBatchNormModule with the same parameters, buffers and hyper-parameters,
// in place (as PyTorch's convert_sync_batchnorm does to a container's
// children); returns how many.
// The replaced modules leave the model with a copy of their values. Convert
// before wrapping the model in DistributedDataParallel: the wrapper gives the
// modules it finds then their sum over ranks.
size_t convert_sync_batchnorm(SequentialModel& model);

class FlattenModule : public Module {
 public:
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

}  // namespace cx::nn
