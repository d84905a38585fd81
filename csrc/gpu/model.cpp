#include "gpu/model.h"

#include <algorithm>

#include "common/error.h"
#include "nn/modules.h"

namespace cx::gpu {

namespace {

using u64 = unsigned long long;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // nn::Rng's increment per draw

// Activation codes of cx_nn_act_fwd/bwd.
int act_code(nn::ModuleKind k) {
  switch (k) {
    case nn::ModuleKind::kReLU: return 0;
    case nn::ModuleKind::kLeakyReLU: return 1;
    case nn::ModuleKind::kSigmoid: return 2;
    case nn::ModuleKind::kTanh: return 3;
    case nn::ModuleKind::kGELU: return 4;
    default: return -1;
  }
}

float slope_of(nn::Module* m) {
  auto* l = dynamic_cast<nn::LeakyReLUModule*>(m);
  return l ? l->negative_slope() : 0.0f;
}

// Blocks of 256 threads, one warp per row.
unsigned warp_grid(size_t rows) { return static_cast<unsigned>((rows + 7) / 8); }

}  // namespace

GpuModel::GpuModel(std::shared_ptr<nn::SequentialModel> model, Device& dev) : model_(std::move(model)), dev_(dev) {
  CX_CHECK(model_ && model_->size() > 0, InvalidArgument, "the model has no modules; add() some first");
  n_ = model_->num_parameters();
  slices_ = model_->param_slices();
  size_t first = 0;
  for (size_t i = 0; i < model_->size(); ++i) {
    Layer l;
    l.m = model_->module(i).get();
    l.kind = l.m->kind();
    l.first = first;
    first += l.m->param_specs().size();
    if (auto* bn = dynamic_cast<nn::BatchNormModule*>(l.m)) {
      l.rmean.reserve(bn->features() * sizeof(float));
      l.rvar.reserve(bn->features() * sizeof(float));
      l.invstd.reserve(bn->features() * sizeof(float));
    }
    layers_.push_back(std::move(l));
  }
  params_.reserve(n_ * sizeof(float));
  grads_.reserve(n_ * sizeof(float));
  upload();
}

void GpuModel::upload() {
  CX_CHECK(model_->num_parameters() == n_ && model_->param_slices() == slices_, InvalidArgument,
           "the model's layers changed after the trainer was made; make a new trainer");
  dev_.make_current();
  dev_.upload(params_.get(), model_->flat_params(), n_ * sizeof(float));
  dev_.zero(grads_.get(), n_ * sizeof(float));
  for (auto& l : layers_) {
    if (auto* bn = dynamic_cast<nn::BatchNormModule*>(l.m)) {
      dev_.upload(l.rmean.get(), bn->running_mean().data(), bn->features() * sizeof(float));
      dev_.upload(l.rvar.get(), bn->running_var().data(), bn->features() * sizeof(float));
    }
    if (l.m->has_rng_state()) l.rng = l.m->rng_state();
  }
  dev_.sync();
  have_forward_ = false;
}

void GpuModel::download_params() {
  dev_.make_current();
  dev_.download(model_->flat_params(), params_.get(), n_ * sizeof(float));
}

void GpuModel::download() {
  download_params();
  for (auto& l : layers_) {
    if (auto* bn = dynamic_cast<nn::BatchNormModule*>(l.m)) {
      dev_.download(bn->running_mean().data(), l.rmean.get(), bn->features() * sizeof(float));
      dev_.download(bn->running_var().data(), l.rvar.get(), bn->features() * sizeof(float));
    }
    if (l.m->has_rng_state()) l.m->set_rng_state(l.rng);
  }
}

std::vector<std::pair<float*, size_t>> GpuModel::buffers() {
  std::vector<std::pair<float*, size_t>> out;
  for (auto& l : layers_)
    if (auto* bn = dynamic_cast<nn::BatchNormModule*>(l.m)) {
      out.emplace_back(l.rmean.f(), bn->features());
      out.emplace_back(l.rvar.f(), bn->features());
    }
  return out;
}

void GpuModel::zero_grad() { dev_.zero(grads_.get(), n_ * sizeof(float)); }

const float* GpuModel::forward(const float* x, const nn::Shape& shape, bool training) {
  CX_CHECK(shape.size() >= 2 && shape[0] >= 1, InvalidArgument,
           "SequentialModel.forward: expected input of shape (batch, features) with batch >= 1, got ",
           nn::shape_str(shape));
  have_forward_ = false;
  const size_t n = layers_.size();
  shapes_.resize(n + 1);
  acts_.resize(n);
  shapes_[0] = shape;
  for (size_t i = 0; i < n; ++i) {
    try {
      shapes_[i + 1] = layers_[i].m->output_shape(shapes_[i]);
    } catch (const InvalidArgument& e) {
      CX_THROW(InvalidArgument, "SequentialModel.forward: layer ", i, ": ", e.what());
    }
    acts_[i].reserve(nn::numel(shapes_[i + 1]) * sizeof(float));
  }
  input_ = x;
  const float* cur = x;
  for (size_t i = 0; i < n; ++i) {
    Layer& l = layers_[i];
    const nn::Shape& in = shapes_[i];
    float* y = acts_[i].f();
    const u64 numel = nn::numel(in);
    switch (l.kind) {
      case nn::ModuleKind::kLinear: {
        auto* lin = static_cast<nn::LinearModule*>(l.m);
        const int B = static_cast<int>(in[0]), I = static_cast<int>(lin->in_features()),
                  O = static_cast<int>(lin->out_features());
        dev_.gemm(false, true, B, O, I, 1.0f, cur, I, param(l, 0), I, 0.0f, y, O);
        if (lin->has_bias())
          dev_.launch(dev_.fn("cx_nn_bias_add"), Device::grid_for(u64(B) * O), 256, y,
                      static_cast<const float*>(param(l, 1)), u64(B), u64(O));
        break;
      }
      case nn::ModuleKind::kReLU:
      case nn::ModuleKind::kLeakyReLU:
      case nn::ModuleKind::kSigmoid:
      case nn::ModuleKind::kTanh:
      case nn::ModuleKind::kGELU:
        dev_.launch(dev_.fn("cx_nn_act_fwd"), Device::grid_for(numel), 256, act_code(l.kind), cur, y, numel,
                    slope_of(l.m));
        break;
      case nn::ModuleKind::kSoftmax:
        dev_.launch(dev_.fn("cx_nn_softmax_fwd"), warp_grid(in[0]), 256, cur, y, u64(in[0]), u64(in[1]));
        break;
      case nn::ModuleKind::kDropout: {
        auto* d = static_cast<nn::DropoutModule*>(l.m);
        l.last_training = training && d->p() > 0.0f;
        if (!l.last_training) {
          dev_.copy(y, cur, numel * sizeof(float));
          break;
        }
        l.mask.reserve(numel * sizeof(float));
        dev_.launch(dev_.fn("cx_nn_dropout_fwd"), Device::grid_for(numel), 256, cur, y, l.mask.f(), numel, d->p(),
                    u64(l.rng));
        l.rng += numel * kGolden;  // the state after numel draws (nn::Rng::next adds kGolden per draw)
        break;
      }
      case nn::ModuleKind::kBatchNorm: {
        auto* bn = static_cast<nn::BatchNormModule*>(l.m);
        if (training)  // as BatchNormModule::forward says it
          CX_CHECK(in[0] >= 2, InvalidArgument, bn->repr(), " needs a batch of at least 2 in training mode, got ",
                   nn::shape_str(in));
        l.last_training = training;
        l.xhat.reserve(numel * sizeof(float));
        dev_.launch(dev_.fn("cx_nn_bn_fwd"), Device::grid_for(in[1]), 256, cur, y, l.xhat.f(), l.invstd.f(),
                    static_cast<const float*>(param(l, 0)), static_cast<const float*>(param(l, 1)), l.rmean.f(),
                    l.rvar.f(), u64(in[0]), u64(in[1]), bn->eps(), bn->momentum(), training ? 1 : 0);
        break;
      }
      case nn::ModuleKind::kFlatten:
        dev_.copy(y, cur, numel * sizeof(float));
        break;
      default:
        CX_THROW(InvalidArgument, "layer ", i, " (", l.m->repr(), ") cannot run on the GPU");
    }
    cur = y;
  }
  have_forward_ = true;
  return cur;
}

void GpuModel::backward(const float* gy, const std::function<void(size_t)>& hook) {
  CX_CHECK(have_forward_, InvalidArgument, "SequentialModel.backward: call forward() first");
  const size_t n = layers_.size();
  size_t biggest = 0;
  for (size_t i = 1; i < n; ++i) biggest = std::max(biggest, nn::numel(shapes_[i]));
  for (auto& b : gbuf_) b.reserve(biggest * sizeof(float));
  const float* g = gy;
  for (size_t k = n; k-- > 0;) {
    Layer& l = layers_[k];
    const nn::Shape& in = shapes_[k];
    const float* x = k ? acts_[k - 1].f() : input_;
    const float* y = acts_[k].f();
    float* gx = k ? gbuf_[k % 2].f() : nullptr;  // never the buffer g is in (k+1's)
    const u64 numel = nn::numel(in);
    switch (l.kind) {
      case nn::ModuleKind::kLinear: {
        auto* lin = static_cast<nn::LinearModule*>(l.m);
        const int B = static_cast<int>(in[0]), I = static_cast<int>(lin->in_features()),
                  O = static_cast<int>(lin->out_features());
        if (lin->has_bias()) {
          dev_.launch2(dev_.fn("cx_nn_col_sum_add"), static_cast<unsigned>((O + 31) / 32),
                       static_cast<unsigned>(std::min(64, (B + 63) / 64)), 32, 8, grad(l, 1), g, u64(B), u64(O));
          if (hook) hook(l.first + 1);
        }
        dev_.gemm(true, false, O, I, B, 1.0f, g, O, x, I, 1.0f, grad(l, 0), I);  // dW += gy^T x
        if (hook) hook(l.first);
        if (gx) dev_.gemm(false, false, B, I, O, 1.0f, g, O, param(l, 0), I, 0.0f, gx, I);  // dx = gy W
        break;
      }
      case nn::ModuleKind::kReLU:
      case nn::ModuleKind::kLeakyReLU:
      case nn::ModuleKind::kSigmoid:
      case nn::ModuleKind::kTanh:
      case nn::ModuleKind::kGELU:
        if (gx)
          dev_.launch(dev_.fn("cx_nn_act_bwd"), Device::grid_for(numel), 256, act_code(l.kind), x, y, g, gx, numel,
                      slope_of(l.m));
        break;
      case nn::ModuleKind::kSoftmax:
        if (gx) dev_.launch(dev_.fn("cx_nn_softmax_bwd"), warp_grid(in[0]), 256, y, g, gx, u64(in[0]), u64(in[1]));
        break;
      case nn::ModuleKind::kDropout:
        if (!gx) break;
        if (l.last_training)
          dev_.launch(dev_.fn("cx_nn_mul"), Device::grid_for(numel), 256, g, static_cast<const float*>(l.mask.f()), gx,
                      numel);
        else
          dev_.copy(gx, g, numel * sizeof(float));
        break;
      case nn::ModuleKind::kBatchNorm:
        dev_.launch(dev_.fn("cx_nn_bn_bwd"), Device::grid_for(in[1]), 256, g, static_cast<const float*>(l.xhat.f()),
                    static_cast<const float*>(l.invstd.f()), static_cast<const float*>(param(l, 0)), grad(l, 0),
                    grad(l, 1), gx, u64(in[0]), u64(in[1]), l.last_training ? 1 : 0);
        if (hook) {
          hook(l.first + 1);
          hook(l.first);
        }
        break;
      case nn::ModuleKind::kFlatten:
        if (gx) dev_.copy(gx, g, numel * sizeof(float));
        break;
      default:
        CX_THROW(InvalidArgument, "layer ", k, " (", l.m->repr(), ") cannot run on the GPU");
    }
    g = gx;
  }
}

}  // namespace cx::gpu
