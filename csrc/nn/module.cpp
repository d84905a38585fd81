#include "nn/module.h"

#include <cstring>

#include "common/error.h"

namespace cx::nn {

void Module::declare_params(std::vector<ParamSpec> specs) {
  specs_ = std::move(specs);
  local_off_.clear();
  total_ = 0;
  for (const auto& s : specs_) {
    local_off_.push_back(total_);
    total_ += numel(s.shape);
  }
  p_ = std::make_shared<FloatStorage>(total_);
  g_ = std::make_shared<FloatStorage>(total_);
  offset_ = 0;
}

void Module::attach(std::shared_ptr<FloatStorage> params, std::shared_ptr<FloatStorage> grads, size_t offset) {
  if (total_) {
    std::memcpy(params->data() + offset, p_->data() + offset_, total_ * sizeof(float));
    std::memcpy(grads->data() + offset, g_->data() + offset_, total_ * sizeof(float));
  }
  p_ = std::move(params);
  g_ = std::move(grads);
  offset_ = offset;
  storage_moved();
}

void Module::detach() {
  auto p = std::make_shared<FloatStorage>(total_);
  auto g = std::make_shared<FloatStorage>(total_);
  if (total_) {
    std::memcpy(p->data(), p_->data() + offset_, total_ * sizeof(float));
    std::memcpy(g->data(), g_->data() + offset_, total_ * sizeof(float));
  }
  p_ = std::move(p);
  g_ = std::move(g);
  offset_ = 0;
  in_model_ = false;
  storage_moved();
}

const Tensor& Module::forward_standalone(const float* x, const Shape& in, bool training) {
  Shape out = output_shape(in);
  sx_.resize(in);
  std::memcpy(sx_.data(), x, numel(in) * sizeof(float));
  sy_.resize(out);
  forward(sx_.data(), in, sy_.data(), training);
  standalone_ready_ = true;
  return sy_;
}

const Tensor& Module::backward_standalone(const float* gy, const Shape& shape) {
  CX_CHECK(standalone_ready_, InvalidArgument, type_name(), ".backward() called before forward()");
  CX_CHECK(shape == sy_.shape(), InvalidArgument, type_name(), ".backward: grad_output must have the output's shape ",
           shape_str(sy_.shape()), ", got ", shape_str(shape));
  sgx_.resize(sx_.shape());
  backward(sx_.data(), sy_.data(), sx_.shape(), gy, sgx_.data(), [](size_t) {});
  return sgx_;
}

}  // namespace cx::nn
