#include "nn/device_model.h"

#include <algorithm>

#include "common/error.h"

namespace cx::nn {

void check_runs_on_gpu(const SequentialModel& model) {
  for (size_t i = 0; i < model.size(); ++i) {
    try {
      model.module(i)->check_runs_on_gpu();
    } catch (const InvalidArgument& e) {
      CX_THROW(InvalidArgument, "the model cannot train on the GPU: layer ", i, ": ", e.what());
    }
  }
}

DeviceModel::DeviceModel(std::shared_ptr<SequentialModel> model, cuda::Device& dev)
    : model_(std::move(model)), dev_(dev) {
  CX_CHECK(model_ && model_->size() > 0, InvalidArgument, "the model has no modules; add() some first");
  check_runs_on_gpu(*model_);
  n_ = model_->num_parameters();
  slices_ = model_->param_slices();
  size_t first = 0;
  for (size_t i = 0; i < model_->size(); ++i) {
    Layer l;
    l.m = model_->module(i).get();
    l.first = first;
    l.state = l.m->make_device_state(dev_);
    first += l.m->param_specs().size();
    layers_.push_back(std::move(l));
  }
  params_.reserve(n_ * sizeof(float));
  grads_.reserve(n_ * sizeof(float));
  to_device();
}

void DeviceModel::to_device() {
  CX_CHECK(model_->num_parameters() == n_ && model_->param_slices() == slices_, InvalidArgument,
           "the model's layers changed after the trainer was made; make a new trainer");
  dev_.make_current();
  dev_.upload(params_.get(), model_->flat_params(), n_ * sizeof(float));
  dev_.zero(grads_.get(), n_ * sizeof(float));
  for (auto& l : layers_)
    if (l.state) l.m->to_device(dev_, l.state.get());
  dev_.sync();
  have_forward_ = false;
}

void DeviceModel::params_to_host() {
  dev_.make_current();
  dev_.download(model_->flat_params(), params_.get(), n_ * sizeof(float));
}

void DeviceModel::to_host() {
  params_to_host();
  for (auto& l : layers_)
    if (l.state) l.m->to_host(dev_, l.state.get());
}

std::vector<std::pair<float*, size_t>> DeviceModel::buffers() {
  std::vector<std::pair<float*, size_t>> out;
  for (auto& l : layers_)
    if (l.state)
      for (auto b : l.m->device_buffers(l.state.get())) out.push_back(b);
  return out;
}

void DeviceModel::zero_grad() { dev_.zero(grads_.get(), n_ * sizeof(float)); }

const float* DeviceModel::forward(const float* x, const Shape& shape, bool training) {
  have_forward_ = false;
  shapes_ = model_->shapes_for(shape);
  const size_t n = layers_.size();
  acts_.resize(n);
  for (size_t i = 0; i < n; ++i) acts_[i].reserve(numel(shapes_[i + 1]) * sizeof(float));
  input_ = x;
  const DeviceParams d = device_params();
  const float* cur = x;
  for (size_t i = 0; i < n; ++i) {
    float* y = acts_[i].f();
    layers_[i].m->forward(d, layers_[i].state.get(), cur, shapes_[i], y, training);
    cur = y;
  }
  have_forward_ = true;
  return cur;
}

void DeviceModel::backward(const float* gy, const std::function<void(size_t)>& hook) {
  CX_CHECK(have_forward_, InvalidArgument, "SequentialModel.backward: call forward() first");
  const size_t n = layers_.size();
  size_t biggest = 0;
  for (size_t i = 1; i < n; ++i) biggest = std::max(biggest, numel(shapes_[i]));
  for (auto& b : gbuf_) b.reserve(biggest * sizeof(float));
  const DeviceParams d = device_params();
  const float* g = gy;
  for (size_t k = n; k-- > 0;) {
    Layer& l = layers_[k];
    const float* x = k ? acts_[k - 1].f() : input_;
    float* gx = k ? gbuf_[k % 2].f() : nullptr;  // never the buffer g is in (k+1's)
    ParamDone done;
    if (hook) done = [&hook, first = l.first](size_t i) { hook(first + i); };
    l.m->backward(d, l.state.get(), x, acts_[k].f(), shapes_[k], g, gx, done);
    g = gx;
  }
}

}  // namespace cx::nn
