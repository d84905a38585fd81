#include "nn/modules.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "common/error.h"
#include "cuda/act_rules.h"
#include "nn/blas.h"
#include "nn/kernels.h"
#include "nn/parallel.h"
#include "nn/registry.h"
#include "nn/sequential.h"
#include "nn/serialize.h"

namespace cx::nn {

namespace {
std::string fmt_float(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// (batch, features) with features == want (0: any).
void check_2d(const Module& m, const Shape& in, size_t want, const char* what) {
  bool ok = in.size() == 2 && (want == 0 || in[1] == want);
  if (!ok) {
    std::string expect = want ? "(batch, " + std::to_string(want) + ")" : std::string("(batch, ") + what + ")";
    CX_THROW(InvalidArgument, m.repr(), " expects input of shape ", expect, ", got ", shape_str(in));
  }
}
}  // namespace

// ---------------------------------------------------------------- Linear

LinearInit linear_init_from_name(const std::string& name) {
  if (name == "kaiming") return LinearInit::kKaiming;
  if (name == "xavier") return LinearInit::kXavier;
  CX_THROW(InvalidArgument, "LinearModule: init must be 'kaiming' or 'xavier', got '", name, "'");
}

LinearModule::LinearModule(size_t in, size_t out, bool bias, LinearInit init, uint64_t seed)
    : in_(in), out_(out), bias_(bias), init_(init) {
  CX_CHECK(in >= 1 && out >= 1, InvalidArgument, "LinearModule: in_features and out_features must be >= 1, got (",
           in, ", ", out, ")");
  std::vector<ParamSpec> specs{{"weight", {out, in}}};
  if (bias) specs.push_back({"bias", {out}});
  declare_params(std::move(specs));
  reset_parameters(seed);
}

void LinearModule::reset_parameters(uint64_t seed) {
  double bound = init_ == LinearInit::kKaiming ? std::sqrt(6.0 / in_) : std::sqrt(6.0 / (in_ + out_));
  Rng rng(seed);
  float* w = param(0);
  for (size_t i = 0; i < in_ * out_; ++i) w[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
  if (bias_) std::fill(param(1), param(1) + out_, 0.0f);
}

std::string LinearModule::repr() const {
  std::string s = "Linear(" + std::to_string(in_) + ", " + std::to_string(out_);
  if (!bias_) s += ", bias=False";
  return s + ")";
}

Shape LinearModule::output_shape(const Shape& in) const {
  check_2d(*this, in, in_, "");
  return {in[0], out_};
}

void LinearModule::forward(const float* x, const Shape& in, float* y, bool) {
  const int B = static_cast<int>(in[0]), I = static_cast<int>(in_), O = static_cast<int>(out_);
  if (bias_) {
    const float* b = param(1);
    for (int r = 0; r < B; ++r) std::memcpy(y + static_cast<size_t>(r) * O, b, O * sizeof(float));
  }
  gemm(false, true, B, O, I, 1.0f, x, I, param(0), I, bias_ ? 1.0f : 0.0f, y, O);
}

void LinearModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                            const ParamDone& done) {
  const int B = static_cast<int>(in[0]), I = static_cast<int>(in_), O = static_cast<int>(out_);
  // Parameter gradients first, so the hook can start communicating them while
  // dL/dx (the rest of this backward) is still being computed.
  if (bias_) {
    float* db = grad(1);
    for (int r = 0; r < B; ++r) {
      const float* row = gy + static_cast<size_t>(r) * O;
      for (int j = 0; j < O; ++j) db[j] += row[j];
    }
    done(1);
  }
  gemm(true, false, O, I, B, 1.0f, gy, O, x, I, 1.0f, grad(0), I);  // dW += gy^T x
  done(0);
  if (gx) gemm(false, false, B, I, O, 1.0f, gy, O, param(0), I, 0.0f, gx, I);  // dx = gy W
}

void LinearModule::write_config(ByteWriter& w) const {
  w.u64(in_);
  w.u64(out_);
  w.u8(bias_ ? 1 : 0);
  w.u8(static_cast<uint8_t>(init_));
}

// ---------------------------------------------------------------- element-wise

Shape ElementwiseModule::output_shape(const Shape& in) const {
  if (in.size() < 2) CX_THROW(InvalidArgument, repr(), " expects input of shape (batch, features...), got ", shape_str(in));
  return in;
}

// The formulas are cuda/act_rules.h's, which the GPU kernels use too.

void ReLUModule::forward(const float* x, const Shape& in, float* y, bool) {
  parallel_floats(numel(in), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) y[i] = rules::relu_fwd(x[i]);
  });
}
void ReLUModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                          const ParamDone&) {
  if (!gx) return;
  parallel_floats(numel(in), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) gx[i] = rules::relu_bwd(x[i], gy[i]);  // a vector select (act_rules.h)
  });
}

LeakyReLUModule::LeakyReLUModule(float s) : slope_(s) {
  CX_CHECK(std::isfinite(s), InvalidArgument, "LeakyReLUModule: negative_slope must be finite, got ", s);
}
std::string LeakyReLUModule::repr() const { return "LeakyReLU(negative_slope=" + fmt_float(slope_) + ")"; }
// slope_ copied out first: y might alias it, so the loop would load it again for every element.
void LeakyReLUModule::forward(const float* x, const Shape& in, float* y, bool) {
  size_t n = numel(in);
  const float slope = slope_;
  for (size_t i = 0; i < n; ++i) y[i] = rules::leaky_relu_fwd(x[i], slope);
}
void LeakyReLUModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                               const ParamDone&) {
  if (!gx) return;
  size_t n = numel(in);
  const float slope = slope_;
  for (size_t i = 0; i < n; ++i) gx[i] = rules::leaky_relu_bwd(x[i], gy[i], slope);
}
void LeakyReLUModule::write_config(ByteWriter& w) const { w.f32(slope_); }

void SigmoidModule::forward(const float* x, const Shape& in, float* y, bool) {
  kernels::sigmoid(x, y, numel(in));  // the rule, or 8 lanes within a few ulp of it (Note [Vector exp])
}
void SigmoidModule::backward(const float*, const float* y, const Shape& in, const float* gy, float* gx,
                             const ParamDone&) {
  if (!gx) return;
  size_t n = numel(in);
  for (size_t i = 0; i < n; ++i) gx[i] = rules::sigmoid_bwd(y[i], gy[i]);
}

void TanhModule::forward(const float* x, const Shape& in, float* y, bool) {
  kernels::tanh(x, y, numel(in));  // the rule, or 8 lanes within a few ulp of it (Note [Vector exp])
}
void TanhModule::backward(const float*, const float* y, const Shape& in, const float* gy, float* gx,
                          const ParamDone&) {
  if (!gx) return;
  size_t n = numel(in);
  for (size_t i = 0; i < n; ++i) gx[i] = rules::tanh_bwd(y[i], gy[i]);
}

void GELUModule::forward(const float* x, const Shape& in, float* y, bool) {
  kernels::gelu(x, y, numel(in));  // the rule, or 8 lanes (Note [Vector exp])
}
void GELUModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                          const ParamDone&) {
  if (gx) kernels::gelu_backward(x, gy, gx, numel(in));
}

// ---------------------------------------------------------------- Softmax

Shape SoftmaxModule::output_shape(const Shape& in) const {
  check_2d(*this, in, 0, "features");
  return in;
}
void SoftmaxModule::forward(const float* x, const Shape& in, float* y, bool) {
  size_t B = in[0], F = in[1];
  for (size_t r = 0; r < B; ++r) {
    const float* xr = x + r * F;
    float* yr = y + r * F;
    float mx = *std::max_element(xr, xr + F);
    float s = 0.0f;
    for (size_t j = 0; j < F; ++j) s += (yr[j] = std::exp(xr[j] - mx));
    float inv = 1.0f / s;
    for (size_t j = 0; j < F; ++j) yr[j] *= inv;
  }
}
void SoftmaxModule::backward(const float*, const float* y, const Shape& in, const float* gy, float* gx,
                             const ParamDone&) {
  if (!gx) return;
  size_t B = in[0], F = in[1];
  for (size_t r = 0; r < B; ++r) {
    const float *yr = y + r * F, *gr = gy + r * F;
    float dot = 0.0f;
    for (size_t j = 0; j < F; ++j) dot += gr[j] * yr[j];
    for (size_t j = 0; j < F; ++j) gx[r * F + j] = yr[j] * (gr[j] - dot);
  }
}

// ---------------------------------------------------------------- Dropout

DropoutModule::DropoutModule(float p, uint64_t seed) : p_(p), seed_(seed), rng_(seed) {
  CX_CHECK(p >= 0.0f && p < 1.0f, InvalidArgument, "DropoutModule: p must be in [0, 1), got ", p);
}
std::string DropoutModule::repr() const { return "Dropout(p=" + fmt_float(p_) + ")"; }
void DropoutModule::forward(const float* x, const Shape& in, float* y, bool training) {
  size_t n = numel(in);
  last_training_ = training && p_ > 0.0f;
  if (!last_training_) {
    std::memcpy(y, x, n * sizeof(float));
    return;
  }
  mask_.resize(in);
  float* m = mask_.data();
  const float keep_scale = 1.0f / (1.0f - p_);
  for (size_t i = 0; i < n; ++i) m[i] = rng_.uniform() >= p_ ? keep_scale : 0.0f;
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * m[i];
}
void DropoutModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                             const ParamDone&) {
  if (!gx) return;
  size_t n = numel(in);
  if (!last_training_) {
    std::memcpy(gx, gy, n * sizeof(float));
    return;
  }
  const float* m = mask_.data();
  for (size_t i = 0; i < n; ++i) gx[i] = gy[i] * m[i];
}
void DropoutModule::write_config(ByteWriter& w) const {
  w.f32(p_);
  w.u64(seed_);
}

// ---------------------------------------------------------------- BatchNorm

BatchNormModule::BatchNormModule(const char* layer, size_t features, float eps, float momentum)
    : f_(features), eps_(eps), momentum_(momentum), running_mean_(features, 0.0f), running_var_(features, 1.0f) {
  CX_CHECK(features >= 1, InvalidArgument, layer, ": features must be >= 1, got ", features);
  CX_CHECK(eps > 0.0f, InvalidArgument, layer, ": eps must be > 0, got ", eps);
  CX_CHECK(momentum >= 0.0f && momentum <= 1.0f, InvalidArgument, layer, ": momentum must be in [0, 1], got ",
           momentum);
  declare_params({{"weight", {features}}, {"bias", {features}}});
  std::fill(param(0), param(0) + features, 1.0f);
}
std::string BatchNormModule::repr() const {
  return type_name() + "(" + std::to_string(f_) + ", eps=" + fmt_float(eps_) + ", momentum=" + fmt_float(momentum_) +
         ")";
}
Shape BatchNormModule::output_shape(const Shape& in) const {
  check_2d(*this, in, f_, "");
  return in;
}
// The statistics are two passes in float64; with sum_ each pass's sums are
// every rank's (Note [SyncBatchNorm statistics]).
void BatchNormModule::forward(const float* x, const Shape& in, float* y, bool training) {
  if (in.size() == 4) return forward_nchw(x, in, y, training);
  const size_t B = in[0], F = f_;
  last_training_ = training;
  last_synced_ = training && sum_;
  xhat_.resize(in);
  invstd_.assign(F, 0.0f);
  float* xh = xhat_.data();
  const float *gamma = param(0), *beta = param(1);
  if (training) {
    if (!sum_)
      CX_CHECK(B >= 2, InvalidArgument, repr(), " needs a batch of at least 2 in training mode, got ", shape_str(in));
    stats_.assign(F + 1, 0.0);  // [rows, sum of x_j ...]
    stats_[0] = static_cast<double>(B);
    double* sum = stats_.data() + 1;
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) sum[j] += x[r * F + j];
    if (sum_) sum_(stats_.data(), F + 1);
    const double M = stats_[0];
    // Every rank has the same M, so either all of them throw here or none.
    CX_CHECK(M >= 2, InvalidArgument, repr(), " needs a batch of at least 2 rows over all ranks in training mode, ",
             "got ", M, " (this rank's input: ", shape_str(in), ")");
    last_count_ = M;
    std::vector<double> mean(F), var(F, 0.0);
    for (size_t j = 0; j < F; ++j) mean[j] = sum[j] / M;
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) {
        double d = x[r * F + j] - mean[j];
        var[j] += d * d;
      }
    if (sum_) sum_(var.data(), F);
    for (size_t j = 0; j < F; ++j) {
      double biased = var[j] / M;
      invstd_[j] = static_cast<float>(1.0 / std::sqrt(biased + eps_));
      double unbiased = var[j] / (M - 1);
      running_mean_[j] = static_cast<float>((1.0 - momentum_) * running_mean_[j] + momentum_ * mean[j]);
      running_var_[j] = static_cast<float>((1.0 - momentum_) * running_var_[j] + momentum_ * unbiased);
    }
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) {
        float h = static_cast<float>(x[r * F + j] - mean[j]) * invstd_[j];
        xh[r * F + j] = h;
        y[r * F + j] = gamma[j] * h + beta[j];
      }
  } else {
    for (size_t j = 0; j < F; ++j) invstd_[j] = 1.0f / std::sqrt(running_var_[j] + eps_);
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) {
        float h = (x[r * F + j] - running_mean_[j]) * invstd_[j];
        xh[r * F + j] = h;
        y[r * F + j] = gamma[j] * h + beta[j];
      }
  }
}
void BatchNormModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                               const ParamDone& done) {
  if (in.size() == 4) return backward_nchw(x, in, gy, gx, done);
  const size_t B = in[0], F = f_;
  const float* xh = xhat_.data();
  std::vector<float> sum_gy(F, 0.0f), sum_gy_xh(F, 0.0f);
  for (size_t r = 0; r < B; ++r)
    for (size_t j = 0; j < F; ++j) {
      sum_gy[j] += gy[r * F + j];
      sum_gy_xh[j] += gy[r * F + j] * xh[r * F + j];
    }
  // The local sums: DDP averages these gradients (Note [SyncBatchNorm statistics]).
  float *dgamma = grad(0), *dbeta = grad(1);
  for (size_t j = 0; j < F; ++j) dbeta[j] += sum_gy[j];
  done(1);
  for (size_t j = 0; j < F; ++j) dgamma[j] += sum_gy_xh[j];
  done(0);
  if (!gx) return;
  const float* gamma = param(0);
  if (last_training_) {
    float invB = 1.0f / static_cast<float>(B);
    if (last_synced_) {  // dL/dx needs both sums over the whole batch
      stats_.resize(2 * F);
      for (size_t j = 0; j < F; ++j) stats_[j] = sum_gy[j], stats_[F + j] = sum_gy_xh[j];
      sum_(stats_.data(), 2 * F);
      for (size_t j = 0; j < F; ++j)
        sum_gy[j] = static_cast<float>(stats_[j]), sum_gy_xh[j] = static_cast<float>(stats_[F + j]);
      invB = static_cast<float>(1.0 / last_count_);
    }
    // dx = gamma * invstd / B * (B*gy - sum(gy) - xhat * sum(gy*xhat))
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) {
        size_t k = r * F + j;
        gx[k] = gamma[j] * invstd_[j] * (gy[k] - invB * sum_gy[j] - xh[k] * invB * sum_gy_xh[j]);
      }
  } else {
    for (size_t r = 0; r < B; ++r)
      for (size_t j = 0; j < F; ++j) gx[r * F + j] = gy[r * F + j] * gamma[j] * invstd_[j];
  }
}
void BatchNormModule::write_config(ByteWriter& w) const {
  w.u64(f_);
  w.f32(eps_);
  w.f32(momentum_);
}

// ---------------------------------------------------------------- SyncBatchNorm

std::shared_ptr<SyncBatchNormModule> SyncBatchNormModule::from(BatchNormModule& bn) {
  auto s = std::make_shared<SyncBatchNormModule>(bn.features(), bn.eps(), bn.momentum());
  for (size_t i = 0; i < bn.param_specs().size(); ++i) {
    const size_t n = numel(bn.param_specs()[i].shape);
    std::memcpy(s->param(i), bn.param(i), n * sizeof(float));
    std::memcpy(s->grad(i), bn.grad(i), n * sizeof(float));
  }
  s->running_mean() = bn.running_mean();
  s->running_var() = bn.running_var();
  return s;
}

Shape SyncBatchNormModule::output_shape(const Shape& in) const {
  CX_CHECK((in.size() == 2 || in.size() == 4) && in[1] == features(), InvalidArgument, repr(),
           " expects input of shape (batch, ", features(), ") or (batch, ", features(), ", height, width), got ",
           shape_str(in));
  return in;
}

void SyncBatchNormModule::set_replica_sum(ReplicaSum sum, const void* owner) {
  sum_ = std::move(sum);
  sum_owner_ = sum_ ? owner : nullptr;
}

void SyncBatchNormModule::clear_replica_sum(const void* owner) {
  if (sum_owner_ != owner) return;  // a newer wrapper's (Note [Modules that communicate])
  sum_ = nullptr;
  sum_owner_ = nullptr;
}

size_t convert_sync_batchnorm(SequentialModel& model) {
  size_t n = 0;
  for (size_t i = 0; i < model.size(); ++i) {
    const auto& m = model.module(i);
    for (SequentialModel* inner : m->submodels()) n += convert_sync_batchnorm(*inner);
    auto* bn = dynamic_cast<BatchNormModule*>(m.get());  // BatchNorm, BatchNorm2d
    if (!bn || dynamic_cast<SyncBatchNormModule*>(bn)) continue;
    model.replace(i, SyncBatchNormModule::from(*bn));
    ++n;
  }
  return n;
}

// ---------------------------------------------------------------- Flatten

Shape FlattenModule::output_shape(const Shape& in) const {
  if (in.size() < 2) CX_THROW(InvalidArgument, "Flatten() expects input of shape (batch, d1, ...), got ", shape_str(in));
  return {in[0], numel(Shape(in.begin() + 1, in.end()))};
}
void FlattenModule::forward(const float* x, const Shape& in, float* y, bool) {
  std::memcpy(y, x, numel(in) * sizeof(float));
}
void FlattenModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                             const ParamDone&) {
  if (gx) std::memcpy(gx, gy, numel(in) * sizeof(float));
}

// ---------------------------------------------------------------- files

// Note [Layer ids] in registry.h: these ids are in files; never renumber them.
namespace {

std::shared_ptr<Module> read_linear(ByteReader& r) {
  uint64_t in = r.u64(), out = r.u64();
  uint8_t bias = r.u8(), init = r.u8();
  if (init > 1 || bias > 1) r.fail("bad Linear hyper-parameters");
  if (in == 0 || out == 0 || in > (1ull << 31) || out > (1ull << 31) || in * out > r.remaining() / 4)
    r.fail("bad Linear sizes (" + std::to_string(in) + ", " + std::to_string(out) + ")");
  return std::make_shared<LinearModule>(in, out, bias != 0, static_cast<LinearInit>(init), 0);
}

std::shared_ptr<Module> read_dropout(ByteReader& r) {
  float p = r.f32();
  uint64_t seed = r.u64();
  return std::make_shared<DropoutModule>(p, seed);
}

// BatchNorm and SyncBatchNorm write the same hyper-parameters.
template <typename BN>
std::shared_ptr<Module> read_batchnorm(ByteReader& r, const char* name) {
  uint64_t f = r.u64();
  float eps = r.f32(), mom = r.f32();
  if (f == 0 || f > r.remaining() / 4) r.fail(std::string("bad ") + name + " size " + std::to_string(f));
  return std::make_shared<BN>(f, eps, mom);
}

template <typename M>
std::shared_ptr<Module> read_plain(ByteReader&) {
  return std::make_shared<M>();
}

const LayerRegistration kLinear{1, "Linear", read_linear};
const LayerRegistration kReLU{2, "ReLU", read_plain<ReLUModule>};
const LayerRegistration kLeakyReLU{3, "LeakyReLU", [](ByteReader& r) -> std::shared_ptr<Module> {
                                     return std::make_shared<LeakyReLUModule>(r.f32());
                                   }};
const LayerRegistration kSigmoid{4, "Sigmoid", read_plain<SigmoidModule>};
const LayerRegistration kTanh{5, "Tanh", read_plain<TanhModule>};
const LayerRegistration kGELU{6, "GELU", read_plain<GELUModule>};
const LayerRegistration kSoftmax{7, "Softmax", read_plain<SoftmaxModule>};
const LayerRegistration kDropout{8, "Dropout", read_dropout};
const LayerRegistration kBatchNorm{9, "BatchNorm", [](ByteReader& r) {
                                     return read_batchnorm<BatchNormModule>(r, "BatchNorm");
                                   }};
const LayerRegistration kFlatten{10, "Flatten", read_plain<FlattenModule>};
const LayerRegistration kSyncBatchNorm{11, "SyncBatchNorm", [](ByteReader& r) {
                                         return read_batchnorm<SyncBatchNormModule>(r, "SyncBatchNorm");
                                       }};

}  // namespace

}  // namespace cx::nn
