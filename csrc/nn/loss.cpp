#include "nn/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "cuda/act_rules.h"

namespace cx::nn {

const Tensor& Loss::backward() const {
  CX_CHECK(have_, InvalidArgument, repr(), ".backward() called before forward()");
  return grad_;
}

void Loss::backward_into(float* out, float scale) const {
  const Tensor& g = backward();
  const float* src = g.data();
  for (size_t i = 0; i < g.numel(); ++i) out[i] = src[i] * scale;
}

namespace {
void check_logits(const char* who, const Shape& s) {
  CX_CHECK(s.size() == 2 && s[0] >= 1 && s[1] >= 1, InvalidArgument, who,
           ": expected output of shape (batch, classes), got ", shape_str(s));
}
void check_same(const char* who, const Shape& out, const Shape& t) {
  CX_CHECK(out.size() >= 1 && out[0] >= 1, InvalidArgument, who, ": expected output of shape (batch, ...), got ",
           shape_str(out));
  CX_CHECK(out == t, InvalidArgument, who, ": target must have the output's shape ", shape_str(out), ", got ",
           shape_str(t));
}

// Writes softmax(row) into g and returns log-sum-exp(row).
float softmax_row(const float* x, float* g, size_t C) {
  float mx = *std::max_element(x, x + C);
  float s = 0.0f;
  for (size_t j = 0; j < C; ++j) s += (g[j] = std::exp(x[j] - mx));
  float inv = 1.0f / s;
  for (size_t j = 0; j < C; ++j) g[j] *= inv;
  return mx + std::log(s);
}

size_t argmax(const float* x, size_t C) { return static_cast<size_t>(std::max_element(x, x + C) - x); }
}  // namespace

template <typename L>
float CrossEntropyLoss::forward_labels(const float* logits, const Shape& shape, const L* labels, size_t n_labels) {
  check_logits("CrossEntropyLoss", shape);
  const size_t B = shape[0], C = shape[1];
  CX_CHECK(n_labels == B, InvalidArgument, "CrossEntropyLoss: expected ", B, " labels (one per row of the output ",
           shape_str(shape), "), got ", n_labels);
  for (size_t r = 0; r < B; ++r)
    CX_CHECK(labels[r] >= 0 && static_cast<size_t>(labels[r]) < C, InvalidArgument, "CrossEntropyLoss: label ",
             static_cast<int64_t>(labels[r]), " at row ", r, " is out of range [0, ", C, ")");
  grad_.resize(shape);
  float* g = grad_.data();
  double total = 0.0;
  size_t correct = 0;
  const float invB = 1.0f / static_cast<float>(B);
  for (size_t r = 0; r < B; ++r) {
    const float* x = logits + r * C;
    float* gr = g + r * C;
    size_t y = static_cast<size_t>(labels[r]);
    float lse = softmax_row(x, gr, C);
    total += static_cast<double>(lse) - x[y];
    correct += argmax(x, C) == y;
    gr[y] -= 1.0f;
    for (size_t j = 0; j < C; ++j) gr[j] *= invB;
  }
  correct_ = correct;
  last_batch_ = B;
  have_ = true;
  return static_cast<float>(total / static_cast<double>(B));
}

float CrossEntropyLoss::forward(const float* logits, const Shape& shape, const int64_t* labels, size_t n) {
  return forward_labels(logits, shape, labels, n);
}
float CrossEntropyLoss::forward(const float* logits, const Shape& shape, const int32_t* labels, size_t n) {
  return forward_labels(logits, shape, labels, n);
}

float CrossEntropyLoss::forward(const float* logits, const Shape& shape, const float* t, const Shape& tshape) {
  check_logits("CrossEntropyLoss", shape);
  check_same("CrossEntropyLoss", shape, tshape);
  const size_t B = shape[0], C = shape[1];
  grad_.resize(shape);
  float* g = grad_.data();
  double total = 0.0;
  size_t correct = 0;
  const float invB = 1.0f / static_cast<float>(B);
  for (size_t r = 0; r < B; ++r) {
    const float *x = logits + r * C, *tr = t + r * C;
    float* gr = g + r * C;
    float lse = softmax_row(x, gr, C);
    // loss = sum_j t_j (lse - x_j); dL/dx_j = softmax_j * sum(t) - t_j
    double row = 0.0;
    float tsum = 0.0f;
    for (size_t j = 0; j < C; ++j) {
      row += static_cast<double>(tr[j]) * (static_cast<double>(lse) - x[j]);
      tsum += tr[j];
    }
    total += row;
    correct += argmax(x, C) == argmax(tr, C);
    for (size_t j = 0; j < C; ++j) gr[j] = (gr[j] * tsum - tr[j]) * invB;
  }
  correct_ = correct;
  last_batch_ = B;
  have_ = true;
  return static_cast<float>(total / static_cast<double>(B));
}

float MSELoss::forward(const float* o, const Shape& shape, const float* t, const Shape& tshape) {
  check_same("MSELoss", shape, tshape);
  const size_t n = numel(shape);
  grad_.resize(shape);
  float* g = grad_.data();
  double total = 0.0;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (size_t i = 0; i < n; ++i) total += rules::mse(o[i], t[i], inv_n, g[i]);  // cuda/act_rules.h, as the GPU
  have_ = true;
  return static_cast<float>(total / static_cast<double>(n));
}

float BCEWithLogitsLoss::forward(const float* x, const Shape& shape, const float* t, const Shape& tshape) {
  check_same("BCEWithLogitsLoss", shape, tshape);
  const size_t n = numel(shape);
  grad_.resize(shape);
  float* g = grad_.data();
  double total = 0.0;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (size_t i = 0; i < n; ++i) total += static_cast<double>(rules::bce_with_logits(x[i], t[i], inv_n, g[i]));
  have_ = true;
  return static_cast<float>(total / static_cast<double>(n));
}

// ---- the trainer's view ----------------------------------------------------------------

void check_dense_targets(const Loss& loss, const BatchTargets& t) {
  CX_CHECK(t.dense, TypeMismatch, "DistributedTrainer: ", loss.repr(),
           " needs float32 targets shaped like the model's output, got integer labels");
}

BatchSums CrossEntropyLoss::forward_batch(const float* out, const Shape& os, const BatchTargets& t) {
  const float l = t.dense ? forward(out, os, t.dense, t.shape) : forward(out, os, t.labels, t.rows());
  return {static_cast<double>(l) * t.rows(), static_cast<double>(correct_)};
}

BatchSums MSELoss::forward_batch(const float* out, const Shape& os, const BatchTargets& t) {
  check_dense_targets(*this, t);
  const float l = forward(out, os, t.dense, t.shape);
  return {static_cast<double>(l) * t.rows(), std::numeric_limits<double>::quiet_NaN()};
}

BatchSums BCEWithLogitsLoss::forward_batch(const float* out, const Shape& os, const BatchTargets& t) {
  check_dense_targets(*this, t);
  const float l = forward(out, os, t.dense, t.shape);
  // Per row: the fraction of outputs on the right side of 0.5.
  const size_t n = t.rows(), total = numel(os), per = total / n;
  size_t hit = 0;
  for (size_t i = 0; i < total; ++i) hit += (out[i] > 0.f) == (t.dense[i] > 0.5f);
  return {static_cast<double>(l) * n, static_cast<double>(hit) / static_cast<double>(per ? per : 1)};
}

}  // namespace cx::nn
