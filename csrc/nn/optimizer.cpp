#include "nn/optimizer.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/error.h"
#include "nn/kernels.h"

namespace cx::nn {

namespace {
void check_lr(double lr) {
  CX_CHECK(std::isfinite(lr) && lr >= 0.0, InvalidArgument, "learning rate must be finite and >= 0, got ", lr);
}
void check_range(const char* what, double v, double lo, double hi) {
  CX_CHECK(std::isfinite(v) && v >= lo && v <= hi, InvalidArgument, what, " must be in [", lo, ", ", hi, "], got ", v);
}
double get(const std::map<std::string, double>& s, const char* k) {
  auto it = s.find(k);
  CX_CHECK(it != s.end(), InvalidArgument, "load_state_dict: state_dict lacks '", k, "'");
  return it->second;
}
}  // namespace

Optimizer::Optimizer(double lr) : lr_(lr) { check_lr(lr); }

void Optimizer::set_lr(double lr) {
  check_lr(lr);
  lr_ = lr;
}

void Optimizer::step(float* params, const float* grads, size_t n) {
  if (n_ == 0) {
    for (auto& [name, arr] : state_arrays())
      if (needs_array(name)) arr->assign(n, 0.0f);
    n_ = n;
  }
  CX_CHECK(n == n_, InvalidArgument, type_name(), "Optimizer.step: its state was built for ", n_,
           " parameters, this model has ", n, "; use one optimizer per model");
  ++t_;
  update(params, grads, n);
}

size_t Optimizer::state_numel() const {
  size_t n = 0;
  for (auto& [name, arr] : const_cast<Optimizer*>(this)->state_arrays()) n += arr->size();
  return n;
}

std::vector<std::string> Optimizer::state_array_names() const {
  std::vector<std::string> names;
  for (auto& [name, arr] : const_cast<Optimizer*>(this)->state_arrays())
    if (needs_array(name)) names.push_back(name);
  return names;
}

StateDict Optimizer::state_dict() const {
  std::map<std::string, Destination> none;
  return state_dict(none);
}

StateDict Optimizer::state_dict(std::map<std::string, Destination>& into) const {
  StateDict sd;
  sd.type = type_name();
  sd.scalars["lr"] = lr_;
  sd.scalars["step"] = static_cast<double>(t_);
  get_hparams(sd.scalars);
  std::map<std::string, Destination> filled;
  for (auto& [name, arr] : const_cast<Optimizer*>(this)->state_arrays()) {
    if (arr->empty()) continue;
    auto it = into.find(name);
    if (it != into.end() && it->second.size == arr->size()) {
      std::copy(arr->begin(), arr->end(), it->second.data);
      filled.insert(*it);
    } else {
      sd.arrays[name] = *arr;
    }
  }
  into.swap(filled);
  return sd;
}

void Optimizer::load_state_dict(const StateDict& sd) {
  CX_CHECK(sd.type == type_name(), InvalidArgument, "load_state_dict: state_dict is for a ", sd.type,
           " optimizer, this is ", type_name());
  double lr = get(sd.scalars, "lr"), step = get(sd.scalars, "step");
  check_lr(lr);
  CX_CHECK(step >= 0 && step == std::floor(step), InvalidArgument, "load_state_dict: bad step ", step);
  size_t n = 0;
  bool any = false;
  for (auto& [name, arr] : const_cast<Optimizer*>(this)->state_arrays()) {
    auto it = sd.arrays.find(name);
    if (it == sd.arrays.end()) continue;
    if (any)
      CX_CHECK(it->second.size() == n, InvalidArgument, "load_state_dict: state arrays have different sizes");
    n = it->second.size();
    any = true;
  }
  for (const auto& [name, arr] : sd.arrays) {
    bool known = false;
    for (auto& [own, _] : const_cast<Optimizer*>(this)->state_arrays()) known |= own == name;
    CX_CHECK(known, InvalidArgument, "load_state_dict: unknown state '", name, "' for ", type_name());
  }
  // All checks done; now assign (hyper-parameters validate themselves first).
  set_hparams(sd.scalars);
  for (auto& [name, arr] : state_arrays()) {
    auto it = sd.arrays.find(name);
    if (it != sd.arrays.end()) *arr = it->second;
    else if (any && needs_array(name)) arr->assign(n, 0.0f);
    else arr->clear();
  }
  lr_ = lr;
  t_ = static_cast<int64_t>(step);
  n_ = any ? n : 0;
}

// ---------------------------------------------------------------- SGD

SGDOptimizer::SGDOptimizer(double lr, double momentum, bool nesterov, double weight_decay)
    : Optimizer(lr) {
  // One place validates hyper-parameters, whether from here or a state dict.
  SGDOptimizer::set_hparams({{"momentum", momentum}, {"nesterov", nesterov ? 1.0 : 0.0}, {"weight_decay", weight_decay}});
  CX_CHECK(!nesterov || momentum > 0.0, InvalidArgument, "SGD: nesterov=True needs momentum > 0");
}
std::string SGDOptimizer::repr() const {
  std::ostringstream os;
  os << "SGDOptimizer(lr=" << lr_ << ", momentum=" << momentum_ << ", nesterov=" << (nesterov_ ? "True" : "False")
     << ", weight_decay=" << weight_decay_ << ")";
  return os.str();
}
void SGDOptimizer::update(float* p, const float* g, size_t n) {
  kernels::sgd(p, g, momentum_ != 0.0 ? buf_.data() : nullptr, n, static_cast<float>(lr_),
               static_cast<float>(momentum_), nesterov_, static_cast<float>(weight_decay_));
}
std::vector<std::pair<std::string, std::vector<float>*>> SGDOptimizer::state_arrays() {
  return {{"momentum_buffer", &buf_}};
}
void SGDOptimizer::get_hparams(std::map<std::string, double>& s) const {
  s["momentum"] = momentum_;
  s["nesterov"] = nesterov_ ? 1.0 : 0.0;
  s["weight_decay"] = weight_decay_;
}
void SGDOptimizer::set_hparams(const std::map<std::string, double>& s) {
  double m = get(s, "momentum"), wd = get(s, "weight_decay");
  check_range("SGD momentum", m, 0.0, 1.0);
  check_range("SGD weight_decay", wd, 0.0, 1e9);
  momentum_ = m;
  weight_decay_ = wd;
  nesterov_ = get(s, "nesterov") != 0.0;
}

// ---------------------------------------------------------------- Adam / AdamW

AdamOptimizer::AdamOptimizer(double lr, double beta1, double beta2, double eps, double weight_decay)
    : Optimizer(lr) {
  AdamOptimizer::set_hparams({{"beta1", beta1}, {"beta2", beta2}, {"eps", eps}, {"weight_decay", weight_decay}});
}
AdamWOptimizer::AdamWOptimizer(double lr, double beta1, double beta2, double eps, double weight_decay)
    : AdamOptimizer(lr, beta1, beta2, eps, weight_decay) {
  decoupled_ = true;
}
std::string AdamOptimizer::repr() const {
  std::ostringstream os;
  os << type_name() << "Optimizer(lr=" << lr_ << ", beta1=" << beta1_ << ", beta2=" << beta2_ << ", eps=" << eps_
     << ", weight_decay=" << weight_decay_ << ")";
  return os.str();
}
AdamOptimizer::StepFactors AdamOptimizer::step_factors(int64_t step) const {
  // torch.optim.Adam: step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps.
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(beta1_, t), bc2 = 1.0 - std::pow(beta2_, t);
  StepFactors f;
  f.beta1 = static_cast<float>(beta1_);
  f.beta2 = static_cast<float>(beta2_);
  f.eps = static_cast<float>(eps_);
  f.step_size = static_cast<float>(lr_ / bc1);
  f.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  f.l2 = decoupled_ ? 0.0f : static_cast<float>(weight_decay_);
  f.decay = decoupled_ ? static_cast<float>(1.0 - lr_ * weight_decay_) : 1.0f;
  return f;
}

void AdamOptimizer::update(float* p, const float* g, size_t n) {
  const StepFactors f = step_factors(t_);
  kernels::adam(p, g, m_.data(), v_.data(), n, f.beta1, f.beta2, f.eps, f.step_size, f.inv_bc2_sqrt, f.l2, f.decay);
}
std::vector<std::pair<std::string, std::vector<float>*>> AdamOptimizer::state_arrays() {
  return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
}
void AdamOptimizer::get_hparams(std::map<std::string, double>& s) const {
  s["beta1"] = beta1_;
  s["beta2"] = beta2_;
  s["eps"] = eps_;
  s["weight_decay"] = weight_decay_;
}
void AdamOptimizer::set_hparams(const std::map<std::string, double>& s) {
  double b1 = get(s, "beta1"), b2 = get(s, "beta2"), e = get(s, "eps"), wd = get(s, "weight_decay");
  check_range("Adam beta1", b1, 0.0, 0.999999);
  check_range("Adam beta2", b2, 0.0, 0.999999999);
  check_range("Adam eps", e, 0.0, 1.0);
  check_range("Adam weight_decay", wd, 0.0, 1e9);
  beta1_ = b1;
  beta2_ = b2;
  eps_ = e;
  weight_decay_ = wd;
}

// ---------------------------------------------------------------- RMSprop

RMSpropOptimizer::RMSpropOptimizer(double lr, double alpha, double eps, double weight_decay, double momentum)
    : Optimizer(lr) {
  RMSpropOptimizer::set_hparams({{"alpha", alpha}, {"eps", eps}, {"weight_decay", weight_decay}, {"momentum", momentum}});
}
std::string RMSpropOptimizer::repr() const {
  std::ostringstream os;
  os << "RMSpropOptimizer(lr=" << lr_ << ", alpha=" << alpha_ << ", eps=" << eps_ << ", weight_decay=" << weight_decay_
     << ", momentum=" << momentum_ << ")";
  return os.str();
}
void RMSpropOptimizer::update(float* p, const float* g, size_t n) {
  kernels::rmsprop(p, g, v_.data(), momentum_ != 0.0 ? buf_.data() : nullptr, n, static_cast<float>(lr_),
                   static_cast<float>(alpha_), static_cast<float>(eps_), static_cast<float>(momentum_),
                   static_cast<float>(weight_decay_));
}
std::vector<std::pair<std::string, std::vector<float>*>> RMSpropOptimizer::state_arrays() {
  return {{"square_avg", &v_}, {"momentum_buffer", &buf_}};
}
void RMSpropOptimizer::get_hparams(std::map<std::string, double>& s) const {
  s["alpha"] = alpha_;
  s["eps"] = eps_;
  s["weight_decay"] = weight_decay_;
  s["momentum"] = momentum_;
}
void RMSpropOptimizer::set_hparams(const std::map<std::string, double>& s) {
  double a = get(s, "alpha"), e = get(s, "eps"), wd = get(s, "weight_decay"), m = get(s, "momentum");
  check_range("RMSprop alpha", a, 0.0, 1.0);
  check_range("RMSprop eps", e, 0.0, 1.0);
  check_range("RMSprop weight_decay", wd, 0.0, 1e9);
  check_range("RMSprop momentum", m, 0.0, 1.0);
  alpha_ = a;
  eps_ = e;
  weight_decay_ = wd;
  momentum_ = m;
}

// ---------------------------------------------------------------- clipping

double clip_grad_norm(float* grads, size_t n, double max_norm) {
  CX_CHECK(std::isfinite(max_norm) && max_norm > 0.0, InvalidArgument, "clip_grad_norm: max_norm must be > 0, got ",
           max_norm);
  double norm = std::sqrt(kernels::sum_squares(grads, n));
  // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) kernels::scale(grads, n, static_cast<float>(coef));
  return norm;
}

}  // namespace cx::nn
