// defines: LRScheduler and StepLR, CosineAnnealingLR, LinearWarmupLR.
//
// A scheduler owns nothing but a step counter: step() advances it and writes
// lr_at(counter) into the optimizer. lr_at is a closed form of the counter, so
// a resumed run (load_state_dict) continues on exactly the same curve.
//
// interval() says how often a trainer steps it: once per epoch (StepLR,
// CosineAnnealingLR, as PyTorch's are used) or once per optimizer step
// (LinearWarmupLR, whose length is in steps); set_interval changes it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "nn/optimizer.h"

namespace cx::nn {

class LRScheduler {
 public:
  // Captures the optimizer's current lr as base_lr and sets lr_at(0).
  explicit LRScheduler(std::shared_ptr<Optimizer> opt);
  virtual ~LRScheduler() = default;
  virtual std::string repr() const = 0;
  virtual double lr_at(int64_t epoch) const = 0;
  void step();
  enum class Interval { kEpoch, kStep };
  Interval interval() const { return interval_; }
  void set_interval(Interval i) { interval_ = i; }
  double get_last_lr() const { return opt_->lr(); }
  int64_t last_epoch() const { return epoch_; }
  double base_lr() const { return base_lr_; }
  void load(int64_t last_epoch, double base_lr);  // resume
  const std::shared_ptr<Optimizer>& optimizer() const { return opt_; }

 protected:
  void start() { opt_->set_lr(lr_at(0)); }  // derived constructors call this
  std::shared_ptr<Optimizer> opt_;
  double base_lr_;
  int64_t epoch_ = 0;
  Interval interval_ = Interval::kEpoch;
};

// lr = base * gamma^(epoch / step_size)
class StepLR : public LRScheduler {
 public:
  StepLR(std::shared_ptr<Optimizer> opt, int64_t step_size, double gamma = 0.1);
  std::string repr() const override;
  double lr_at(int64_t epoch) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = eta_min + (base - eta_min) * (1 + cos(pi * min(epoch, T_max) / T_max)) / 2;
// it stays at eta_min after T_max.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(std::shared_ptr<Optimizer> opt, int64_t t_max, double eta_min = 0.0);
  std::string repr() const override;
  double lr_at(int64_t epoch) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// lr = base * (start + (1 - start) * min(epoch, warmup) / warmup): a linear ramp
// from start_factor*base to base over warmup_steps steps, then constant.
class LinearWarmupLR : public LRScheduler {
 public:
  LinearWarmupLR(std::shared_ptr<Optimizer> opt, int64_t warmup_steps, double start_factor = 0.1);
  std::string repr() const override;
  double lr_at(int64_t epoch) const override;

 private:
  int64_t warmup_;
  double start_;
};

}  // namespace cx::nn
