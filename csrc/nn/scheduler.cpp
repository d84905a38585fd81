#include "nn/scheduler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/error.h"

namespace cx::nn {

LRScheduler::LRScheduler(std::shared_ptr<Optimizer> opt) : opt_(std::move(opt)) {
  CX_CHECK(opt_ != nullptr, InvalidArgument, "scheduler: optimizer is None");
  base_lr_ = opt_->lr();
}

void LRScheduler::step() {
  ++epoch_;
  opt_->set_lr(lr_at(epoch_));
}

void LRScheduler::load(int64_t last_epoch, double base_lr) {
  CX_CHECK(last_epoch >= 0, InvalidArgument, "scheduler: last_epoch must be >= 0, got ", last_epoch);
  CX_CHECK(std::isfinite(base_lr) && base_lr >= 0, InvalidArgument, "scheduler: bad base_lr ", base_lr);
  epoch_ = last_epoch;
  base_lr_ = base_lr;
  opt_->set_lr(lr_at(epoch_));
}

StepLR::StepLR(std::shared_ptr<Optimizer> opt, int64_t step_size, double gamma)
    : LRScheduler(std::move(opt)), step_size_(step_size), gamma_(gamma) {
  CX_CHECK(step_size >= 1, InvalidArgument, "StepLR: step_size must be >= 1, got ", step_size);
  CX_CHECK(std::isfinite(gamma) && gamma > 0, InvalidArgument, "StepLR: gamma must be > 0, got ", gamma);
  start();
}
std::string StepLR::repr() const {
  std::ostringstream os;
  os << "StepLR(step_size=" << step_size_ << ", gamma=" << gamma_ << ", last_epoch=" << epoch_ << ")";
  return os.str();
}
double StepLR::lr_at(int64_t e) const { return base_lr_ * std::pow(gamma_, static_cast<double>(e / step_size_)); }

CosineAnnealingLR::CosineAnnealingLR(std::shared_ptr<Optimizer> opt, int64_t t_max, double eta_min)
    : LRScheduler(std::move(opt)), t_max_(t_max), eta_min_(eta_min) {
  CX_CHECK(t_max >= 1, InvalidArgument, "CosineAnnealingLR: T_max must be >= 1, got ", t_max);
  CX_CHECK(std::isfinite(eta_min) && eta_min >= 0, InvalidArgument, "CosineAnnealingLR: eta_min must be >= 0, got ",
           eta_min);
  start();
}
std::string CosineAnnealingLR::repr() const {
  std::ostringstream os;
  os << "CosineAnnealingLR(T_max=" << t_max_ << ", eta_min=" << eta_min_ << ", last_epoch=" << epoch_ << ")";
  return os.str();
}
double CosineAnnealingLR::lr_at(int64_t e) const {
  double x = static_cast<double>(std::min(e, t_max_)) / static_cast<double>(t_max_);
  return eta_min_ + (base_lr_ - eta_min_) * 0.5 * (1.0 + std::cos(M_PI * x));
}

LinearWarmupLR::LinearWarmupLR(std::shared_ptr<Optimizer> opt, int64_t warmup_steps, double start_factor)
    : LRScheduler(std::move(opt)), warmup_(warmup_steps), start_(start_factor) {
  interval_ = Interval::kStep;  // its length is in optimizer steps
  CX_CHECK(warmup_steps >= 1, InvalidArgument, "LinearWarmupLR: warmup_steps must be >= 1, got ", warmup_steps);
  CX_CHECK(start_factor >= 0 && start_factor <= 1, InvalidArgument,
           "LinearWarmupLR: start_factor must be in [0, 1], got ", start_factor);
  start();
}
std::string LinearWarmupLR::repr() const {
  std::ostringstream os;
  os << "LinearWarmupLR(warmup_steps=" << warmup_ << ", start_factor=" << start_ << ", last_epoch=" << epoch_ << ")";
  return os.str();
}
double LinearWarmupLR::lr_at(int64_t e) const {
  double f = static_cast<double>(std::min(e, warmup_)) / static_cast<double>(warmup_);
  return base_lr_ * (start_ + (1.0 - start_) * f);
}

}  // namespace cx::nn
