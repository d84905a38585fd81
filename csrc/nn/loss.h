// defines: CrossEntropyLoss, MSELoss, BCEWithLogitsLoss.
//
// Each: forward(output, target) returns the mean loss over the batch and keeps
// dL/d(output) for backward(). All reductions are means (PyTorch's default), so
// grads scale as 1/batch (1/numel for MSE and BCE).
#pragma once

#include <cstdint>
#include <string>

#include "nn/tensor.h"

namespace cx::nn {

class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string repr() const = 0;
  // dL/d(output) of the last forward. Throws if forward was never called.
  const Tensor& backward() const;

 protected:
  Tensor grad_;
  bool have_ = false;
};

// logits (batch, classes) in; targets are class indices (int32 or int64, in
// [0, classes)) or dense (batch, classes) float rows (one-hot or probabilities).
// Uses a max-shifted log-sum-exp, so large logits never overflow.
class CrossEntropyLoss : public Loss {
 public:
  std::string repr() const override { return "CrossEntropyLoss()"; }
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
  float forward(const float* output, const Shape& shape, const float* target, const Shape& target_shape);
};

// Sigmoid + binary cross-entropy in one stable expression:
// max(x, 0) - x*t + log(1 + exp(-|x|)); targets in [0, 1], same shape as x.
class BCEWithLogitsLoss : public Loss {
 public:
  std::string repr() const override { return "BCEWithLogitsLoss()"; }
  float forward(const float* logits, const Shape& shape, const float* target, const Shape& target_shape);
};

}  // namespace cx::nn
