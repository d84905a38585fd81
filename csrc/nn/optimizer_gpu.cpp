// The optimizers on a GPU (Note [Optimizers on the GPU] in optimizer.h): the
// device twin of the state arrays, and each optimizer's update as one kernel
// of cuda/nn.cu over the flat parameter buffer. The CPU side is optimizer.cpp.
#include "common/error.h"
#include "nn/optimizer.h"

namespace cx::nn {

namespace {
using u64 = unsigned long long;
}  // namespace

Optimizer::DeviceArrays Optimizer::to_device(cuda::Device& dev, size_t n) {
  DeviceArrays s;
  s.n = n;
  for (auto& [name, arr] : state_arrays()) {
    cuda::Buffer b;
    if (!arr->empty()) {
      CX_CHECK(arr->size() == n, InvalidArgument, type_name(), "Optimizer: its state was built for ", arr->size(),
               " parameters, this model has ", n, "; use one optimizer per model");
      b.reserve(n * sizeof(float));
      dev.upload(b.get(), arr->data(), n * sizeof(float));
    } else if (needs_array(name)) {
      b.reserve(n * sizeof(float));
      dev.zero(b.get(), n * sizeof(float));
    }
    s.arrays.push_back(std::move(b));
  }
  dev.sync();
  return s;
}

void Optimizer::step(cuda::Device& dev, DeviceArrays& s, float* params, const float* grads,
                     const unsigned int* skip) {
  std::vector<float*> state;
  for (auto& b : s.arrays) state.push_back(b.f());  // null for an empty Buffer
  ++t_;
  update(dev, params, grads, s.n, state, skip);
}

void Optimizer::to_host(cuda::Device& dev, const DeviceArrays& s) {
  if (t_ == 0) return;  // no step on the device: the host's state is current
  auto arrays = state_arrays();
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (!s.arrays[i].get()) continue;
    arrays[i].second->resize(s.n);
    dev.download(arrays[i].second->data(), s.arrays[i].get(), s.n * sizeof(float));
  }
  n_ = s.n;
}

void SGDOptimizer::update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
                          const unsigned int* skip) {
  float* buf = momentum_ != 0.0 ? state[0] : nullptr;  // momentum_buffer
  dev.launch(dev.fn("cx_nn_sgd"), cuda::Device::grid_for(n), 256, p, g, buf, u64(n), static_cast<float>(lr_),
             static_cast<float>(momentum_), nesterov_ ? 1 : 0, static_cast<float>(weight_decay_), skip);
}

void AdamOptimizer::update(cuda::Device& dev, float* p, const float* g, size_t n, const std::vector<float*>& state,
                           const unsigned int* skip) {
  const StepFactors f = step_factors(t_);  // as the CPU's update
  dev.launch(dev.fn("cx_nn_adam"), cuda::Device::grid_for(n), 256, p, g, state[0], state[1], u64(n), f.beta1,
             f.beta2, f.eps, f.step_size, f.inv_bc2_sqrt, f.l2, f.decay, skip);  // exp_avg, exp_avg_sq
}

void RMSpropOptimizer::update(cuda::Device& dev, float* p, const float* g, size_t n,
                              const std::vector<float*>& state, const unsigned int* skip) {
  float* buf = momentum_ != 0.0 ? state[1] : nullptr;  // square_avg, momentum_buffer
  dev.launch(dev.fn("cx_nn_rmsprop"), cuda::Device::grid_for(n), 256, p, g, state[0], buf, u64(n),
             static_cast<float>(lr_), static_cast<float>(alpha_), static_cast<float>(eps_),
             static_cast<float>(momentum_), static_cast<float>(weight_decay_), skip);
}

}  // namespace cx::nn
