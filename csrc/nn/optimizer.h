// defines: Optimizer and SGDOptimizer, AdamOptimizer, AdamWOptimizer,
// RMSpropOptimizer; StateDict; clip_grad_norm.
//
// An optimizer updates one flat parameter buffer from one flat gradient buffer
// (Note [Flat buffers] in sequential.h) in a single vectorised pass; its state
// (momentum, moments) is flat too, sized on the first step. Formulas follow
// PyTorch's documented algorithms, so results match torch.optim to float
// rounding.
//
// Note [Optimizers on the GPU]
// The same optimizer object updates device buffers too: to_device() makes the
// device twin of its state arrays (DeviceArrays, owned by whoever owns the
// device), step() on a cuda::Device runs one update there (nn.cu's kernels,
// which apply the formulas of update_rules.h, as the CPU does), and to_host()
// copies the state back. The step count and the hyper-parameters stay in the
// object, so a scheduler's set_lr() takes effect on the next step either way.
// The GPU code of each optimizer is in optimizer_gpu.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "nn/sequential.h"

namespace cx::nn {

// Everything needed to resume exactly: hyper-parameters and the step count as
// scalars, the per-parameter state as float arrays. Python sees a dict.
struct StateDict {
  std::string type;  // "Adam", "AdamW", "SGD", "RMSprop"
  std::map<std::string, double> scalars;
  std::map<std::string, std::vector<float>> arrays;
};

class Optimizer {
 public:
  explicit Optimizer(double lr);
  virtual ~Optimizer() = default;
  virtual std::string type_name() const = 0;
  virtual std::string repr() const = 0;

  // One update of model.flat_params() from model.flat_grads().
  void step(SequentialModel& model) { step(model.flat_params(), model.flat_grads(), model.num_parameters()); }
  // The same over any flat buffer of n parameters. The optimizer's state is
  // sized by the first call; later calls must pass the same n.
  void step(float* params, const float* grads, size_t n);
  void zero_grad(SequentialModel& model) { model.zero_grad(); }

  double lr() const { return lr_; }
  void set_lr(double lr);
  int64_t steps() const { return t_; }
  // Parameters the state was built for (0 before the first step), and the
  // elements of state held (every state array together): ZeRO-1 checks that
  // a rank holds only its shard's (train/zero.h).
  size_t state_params() const { return n_; }
  size_t state_numel() const;

  StateDict state_dict() const;
  // The same, with some arrays copied into caller memory instead (a checkpoint's arrays of the save before,
  // reused: Note [Checkpoints written in the background] in pycyxwiz/distributed/_train.py): an array whose
  // name is in `into` with its size is copied there and left out of the result's arrays. On return `into`
  // holds just the arrays it filled.
  struct Destination {
    float* data;
    size_t size;
  };
  StateDict state_dict(std::map<std::string, Destination>& into) const;
  // The arrays state_dict() holds once the state is built for n > 0
  // parameters (the same on every rank with these hyper-parameters): ZeRO-1
  // gathers these by name, and a rank with an empty shard holds none.
  std::vector<std::string> state_array_names() const;
  // Restores hyper-parameters, step count and state; checks type and sizes.
  void load_state_dict(const StateDict& sd);

  // The state arrays on a device, in state_arrays() order; an empty Buffer
  // where this optimizer does not use the array (SGD without momentum).
  struct DeviceArrays {
    std::vector<cuda::Buffer> arrays;
    size_t n = 0;
  };
  // Note [Optimizers on the GPU]. to_device: the host's state for n
  // parameters (zeros where it has none yet); throws if it was built for
  // another size. step: one update of n device parameters from their gradients;
  // with `skip`, a device word read by the kernel: nonzero leaves parameters and
  // state as they were (the GPU trainer's "skip", decided on the device:
  // Note [Non-finite gradients on the GPU] in train/gpu_engine.cpp), and the
  // host learns it later: undo_step() takes back the step's count.
  DeviceArrays to_device(cuda::Device& dev, size_t n);
  void step(cuda::Device& dev, DeviceArrays& state, float* params, const float* grads,
            const unsigned int* skip = nullptr);
  void undo_step() { --t_; }
  void to_host(cuda::Device& dev, const DeviceArrays& state);

 protected:
  virtual void update(float* p, const float* g, size_t n) = 0;  // t_ already counts this step
  // The same on the device; state: the DeviceArrays' pointers (null where unused).
  virtual void update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
                      const unsigned int* skip) = 0;
  // Named state arrays, allocated on the first step.
  virtual std::vector<std::pair<std::string, std::vector<float>*>> state_arrays() = 0;
  virtual void get_hparams(std::map<std::string, double>& s) const = 0;
  virtual void set_hparams(const std::map<std::string, double>& s) = 0;
  virtual bool needs_array(const std::string& name) const { return true; }

  double lr_;
  int64_t t_ = 0;
  size_t n_ = 0;  // parameters the state was built for (0: not yet)
};

class SGDOptimizer : public Optimizer {
 public:
  SGDOptimizer(double lr, double momentum = 0.0, bool nesterov = false, double weight_decay = 0.0);
  std::string type_name() const override { return "SGD"; }
  std::string repr() const override;

 protected:
  void update(float* p, const float* g, size_t n) override;
  void update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
              const unsigned int* skip) override;
  std::vector<std::pair<std::string, std::vector<float>*>> state_arrays() override;
  void get_hparams(std::map<std::string, double>& s) const override;
  void set_hparams(const std::map<std::string, double>& s) override;
  bool needs_array(const std::string&) const override { return momentum_ != 0.0; }

 private:
  double momentum_, weight_decay_;
  bool nesterov_;
  std::vector<float> buf_;
};

// Adam (Kingma & Ba); weight_decay is L2 added to the gradient, as torch.optim.Adam.
class AdamOptimizer : public Optimizer {
 public:
  AdamOptimizer(double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
                double weight_decay = 0.0);
  std::string type_name() const override { return decoupled_ ? "AdamW" : "Adam"; }
  std::string repr() const override;

  // The per-step scalars of step t (1-based) at the current lr, as
  // kernels::adam takes them (the GPU's update uses them too).
  struct StepFactors {
    float beta1, beta2, eps, step_size, inv_bc2_sqrt, l2, decay;
  };
  StepFactors step_factors(int64_t t) const;

 protected:
  void update(float* p, const float* g, size_t n) override;
  void update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
              const unsigned int* skip) override;
  std::vector<std::pair<std::string, std::vector<float>*>> state_arrays() override;
  void get_hparams(std::map<std::string, double>& s) const override;
  void set_hparams(const std::map<std::string, double>& s) override;
  bool decoupled_ = false;

 private:
  double beta1_, beta2_, eps_, weight_decay_;
  std::vector<float> m_, v_;
};

// AdamW (Loshchilov & Hutter): decay applied to the weights, p *= 1 - lr*wd.
class AdamWOptimizer : public AdamOptimizer {
 public:
  AdamWOptimizer(double lr = 1e-3, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8,
                 double weight_decay = 1e-2);
};

// RMSprop as torch.optim.RMSprop (centered=False).
class RMSpropOptimizer : public Optimizer {
 public:
  RMSpropOptimizer(double lr = 1e-2, double alpha = 0.99, double eps = 1e-8, double weight_decay = 0.0,
                   double momentum = 0.0);
  std::string type_name() const override { return "RMSprop"; }
  std::string repr() const override;

 protected:
  void update(float* p, const float* g, size_t n) override;
  void update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
              const unsigned int* skip) override;
  std::vector<std::pair<std::string, std::vector<float>*>> state_arrays() override;
  void get_hparams(std::map<std::string, double>& s) const override;
  void set_hparams(const std::map<std::string, double>& s) override;
  bool needs_array(const std::string& name) const override { return name != "momentum_buffer" || momentum_ != 0.0; }

 private:
  double alpha_, eps_, weight_decay_, momentum_;
  std::vector<float> v_, buf_;
};

// Scales all gradients so that their global L2 norm is at most max_norm;
// returns the norm before clipping (computed in double).
double clip_grad_norm(float* grads, size_t n, double max_norm);
inline double clip_grad_norm(SequentialModel& m, double max_norm) {
  return clip_grad_norm(m.flat_grads(), m.num_parameters(), max_norm);
}

}  // namespace cx::nn
