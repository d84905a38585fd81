// defines: Loss, CrossEntropyLoss, MSELoss, BCEWithLogitsLoss; BatchTargets,
// BatchSums.
//
// Each: forward(output, target) returns the mean loss over the batch and keeps
// dL/d(output) for backward(). All reductions are means (PyTorch's default), so
// grads scale as 1/batch (1/numel for MSE and BCE).
//
// The trainer sees every loss through one interface, on either device:
// forward_batch() takes a batch's targets as it holds them (labels or dense
// rows) and returns what the batch adds to the reported metrics; the GPU form
// queues the same on a cuda::Device (its code is loss_gpu.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "nn/tensor.h"

namespace cx::cuda {
class Device;
}

namespace cx::nn {

// A batch's targets: class labels (batch,), or dense float rows of `shape`.
struct BatchTargets {
  const int64_t* labels = nullptr;
  const float* dense = nullptr;
  Shape shape;  // (batch,) for labels; the dense targets' shape
  size_t rows() const { return shape.empty() ? 0 : shape[0]; }
};

// What one batch adds to the trainer's metrics.
struct BatchSums {
  double loss_sum = 0;  // the batch's mean loss times its rows
  double correct = 0;   // rows the model got right (NaN where that means nothing: MSELoss)
};

class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string repr() const = 0;
  // dL/d(output) of the last forward. Throws if forward was never called.
  const Tensor& backward() const;
  // The same times `scale`, written into out (the output's numel floats): the
  // gradient of scale * loss. Gradient accumulation over k micro-batches passes
  // 1/k, so that the accumulated gradient is the big batch's.
  void backward_into(float* out, float scale) const;

  // Forward on a batch's output against its targets, keeping dL/d(output) for
  // backward(); throws naming the loss when the targets do not fit it.
  virtual BatchSums forward_batch(const float* out, const Shape& os, const BatchTargets& t) = 0;
  // The same on a GPU, queued on dev's stream: `t` is the targets on the host
  // (checked there), `on_device` their device copies; dL/d(output) goes into
  // gout, and the kernels add their sums into stats[0..1] (device doubles,
  // zeroed by the caller). batch_sums() reads them once the stream is done.
  virtual void forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                             const BatchTargets& on_device, float* gout, double* stats) const = 0;
  virtual BatchSums batch_sums(const double* stats, const Shape& os) const = 0;

 protected:
  Tensor grad_;
  bool have_ = false;
};

// Throws TypeMismatch naming `loss` unless `t` holds dense (float) targets.
void check_dense_targets(const Loss& loss, const BatchTargets& t);

// logits (batch, classes) in; targets are class indices (int32 or int64, in
// [0, classes)) or dense (batch, classes) float rows (one-hot or probabilities).
// Uses a max-shifted log-sum-exp, so large logits never overflow.
class CrossEntropyLoss : public Loss {
 public:
  std::string repr() const override { return "CrossEntropyLoss()"; }
  BatchSums forward_batch(const float* out, const Shape& os, const BatchTargets& t) override;
  void forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                     const BatchTargets& on_device, float* gout, double* stats) const override;
  BatchSums batch_sums(const double* stats, const Shape& os) const override;
  float forward(const float* logits, const Shape& shape, const int64_t* labels, size_t n_labels);
  float forward(const float* logits, const Shape& shape, const int32_t* labels, size_t n_labels);
  float forward(const float* logits, const Shape& shape, const float* target, const Shape& target_shape);
  // Fraction of rows of the last forward whose argmax matches the label (for
  // dense targets: the target's argmax).
  double accuracy() const { return last_batch_ ? static_cast<double>(correct_) / last_batch_ : 0.0; }
  size_t correct() const { return correct_; }

 private:
  template <typename L>
  float forward_labels(const float* logits, const Shape& shape, const L* labels, size_t n_labels);
  size_t correct_ = 0, last_batch_ = 0;
};

class MSELoss : public Loss {
 public:
  std::string repr() const override { return "MSELoss()"; }
  BatchSums forward_batch(const float* out, const Shape& os, const BatchTargets& t) override;
  void forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                     const BatchTargets& on_device, float* gout, double* stats) const override;
  BatchSums batch_sums(const double* stats, const Shape& os) const override;
  float forward(const float* output, const Shape& shape, const float* target, const Shape& target_shape);
};

// Sigmoid + binary cross-entropy in one stable expression:
// max(x, 0) - x*t + log(1 + exp(-|x|)); targets in [0, 1], same shape as x.
class BCEWithLogitsLoss : public Loss {
 public:
  std::string repr() const override { return "BCEWithLogitsLoss()"; }
  BatchSums forward_batch(const float* out, const Shape& os, const BatchTargets& t) override;
  void forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                     const BatchTargets& on_device, float* gout, double* stats) const override;
  BatchSums batch_sums(const double* stats, const Shape& os) const override;
  float forward(const float* logits, const Shape& shape, const float* target, const Shape& target_shape);
};

}  // namespace cx::nn
