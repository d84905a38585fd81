// defines: the communication hooks of DistributedDataParallel: what a bucket's
// gradient reduction becomes when DDPConfig.comm_hook is not "none" (the plain
// float32 AVG all-reduce stays in ddp.cpp). "fp16"/"bf16": the bucket is cast,
// all-reduced in that type and cast back (Note [Half-precision buckets]);
// "powersgd": each large matrix gradient is replaced by a rank-r approximation
// with error feedback and warm start, after Vogels et al. 2019 "PowerSGD:
// Practical Low-Rank Gradient Compression for Distributed Optimization"
// (Note [PowerSGD]).
//
// A hook is driven by DDP on the thread running backward (or sync_gradients),
// never on the group's communication thread, which only runs its collectives
// (Note [Where hooks compute]):
//   launch(b)  bucket b's gradients are final: start its reduction;
//   finish()   complete every launched bucket (flat grads hold the result);
//   end_step() sync_gradients completed a step (PowerSGD counts iterations).
// Every rank calls them in the same order, so every rank submits the same
// sequence of collectives.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "nn/sequential.h"
#include "train/buckets.h"

namespace cx::train {

// PowerSGD's options; the names and defaults are PyTorch's PowerSGDState's.
struct PowerSGDConfig {
  int matrix_approximation_rank = 1;  // r: P is n x r, Q is m x r
  int64_t start_powerSGD_iter = 1000;  // steps of plain float32 all-reduce first (Note [PowerSGD])
  double min_compression_rate = 2.0;   // compress an n x m matrix only if n*m >= rate * (n+m)*r
  bool use_error_feedback = true;      // keep what the approximation drops, add it to the next step's gradient
  bool warm_start = true;              // start each step's power iteration from the last step's Q
  uint64_t seed = 0;                   // of the random initial Q (the same on every rank)
};

enum class CommHookKind { kNone, kFp16, kBf16, kPowerSgd };

// "none" (or ""), "fp16", "bf16", "powersgd" (case-insensitive); InvalidArgument otherwise,
// naming `who` and the choices.
CommHookKind parse_comm_hook(const std::string& name, const std::string& who);
const char* comm_hook_name(CommHookKind k);
// InvalidArgument naming `who` and the field when an option is out of range.
void check_powersgd_config(const PowerSGDConfig& c, const std::string& who);

// PowerSGD's state that must survive a checkpoint: the iteration count, the
// warm-start Q of every compressed matrix (the same on every rank) and this
// rank's error-feedback residuals (different on every rank).
struct CommHookState {
  int64_t iteration = 0;
  std::vector<float> q;
  std::vector<float> error;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // `probe` (null: no check): where the hook's casts can test bucket's values as
  // they pass (probes(): the fp16/bf16 hooks, Note [Cast on the wire] in
  // distributed/algorithms/allreduce.cpp), it fills it; the others ignore it and
  // DDP reads the bucket itself (Note [Non-finite gradients] in nonfinite.h).
  virtual void launch(size_t bucket, distributed::ReduceProbe* probe) = 0;
  virtual bool probes() const { return false; }
  virtual void finish() = 0;
  virtual bool busy() const = 0;  // launched buckets not finished yet
  virtual void end_step() {}
  // The step's averaged gradient was not finite (Note [Non-finite gradients] in nonfinite.h): drop
  // any state that step fed (PowerSGD: Q and the residuals). Every rank calls it alike.
  virtual void reset_nonfinite() {}
  virtual CommHookKind kind() const = 0;
  // PowerSGD only; the others have no state (iteration 0, empty arrays).
  virtual CommHookState state() const { return {}; }
  virtual void set_state(const CommHookState&) {}
};

// The hook of `kind` (not kNone) over `model`'s flat gradient buffer cut into `buckets`.
std::unique_ptr<CommHook> make_comm_hook(CommHookKind kind, const PowerSGDConfig& psgd,
                                         std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets,
                                         distributed::ProcessGroup& group);

}  // namespace cx::train
