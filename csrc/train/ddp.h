// defines: DDPConfig and DistributedDataParallel, which keeps the replicas of a
// SequentialModel identical by averaging gradients across the default process
// group, overlapping that communication with backward.
//
// Usage from C++ (one call each per batch):
//   DistributedDataParallel ddp(model, DDPConfig{});   // broadcasts rank 0's weights
//   ddp.forward(x, shape); ddp.backward(g, shape, false);
//   ddp.update_parameters(opt);                        // waits, averages, steps, zeroes grads
//
// Note [Overlap]
// The model's grad-ready hook (Note [Gradient-ready hook] in nn/sequential.h)
// tells us, during backward, when a parameter's gradient is final. When every
// parameter of bucket b is final, b is ready; ready buckets are launched as
// asynchronous AVG all-reduces on the group's communication thread strictly in
// index order (a bucket ready early waits for its predecessors: BucketScheduler
// in buckets.h, which the GPU trainer uses too), so every rank submits the same
// sequence of collectives and the group's one comm thread pairs them up. Communication of the last layers thus runs while backward is
// still computing the first ones. sync_gradients() launches whatever is left
// and waits for all of it.
//
// Note [Accumulation]
// A bucket is "dirty" when it holds local gradient not yet part of an
// all-reduce. AVG is linear and its result is the same on every rank, so
// averaging some micro-batches early and the rest later gives the same
// average: a bucket may be reduced any number of times before the step, as long
// as it is reduced once after its last local contribution. That makes every
// schedule below correct; they differ only in how much they communicate:
//   - inside no_sync(), backward launches nothing; the next synced backward or
//     sync_gradients() reduces the accumulated sum once;
//   - the guide's pattern (backward k times, then sync_gradients) is learned: a
//     backward launches only if it is the k-th since the last sync, k being the
//     count seen in the previous cycle (1 to start with), so after the first
//     cycle the inner steps do not communicate.
// Before a backward writes into the gradient buffer again, it waits for the
// reductions in flight (they read and write the same memory). With a
// communication hook (DDPConfig.comm_hook, comm_hooks.h) launch() hands the
// bucket to the hook and that wait completes the hook's work; fp16/bf16 are
// linear up to rounding, PowerSGD is not (Note [PowerSGD and accumulation] in
// comm_hooks.cpp).
//
// Note [Unused parameters]
// A bucket is launched when every parameter in it has been reported final by
// the model's grad-ready hook. A parameter whose hook never fires would leave
// its bucket (and, since launches are in index order, every later one)
// waiting, and ranks would disagree about what has been reduced. With
// SequentialModel this cannot happen in a backward that completes:
//   - every module's backward accumulates and finalises every parameter it
//     declares (Linear: bias then weight; BatchNorm: beta then gamma), in
//     train and eval mode alike, even when the gradient is zero (dead ReLUs,
//     dropped units, a zero grad_output);
//   - backward(..., input_grad=false) stops early only at leading modules
//     without parameters;
//   - there is no way to freeze a parameter or skip a layer's backward;
//   - a backward that throws is rethrown before anything of it is reduced.
// The one path that used to silence hooks was wrapping a model twice: the
// newer wrapper's hook replaced the older one's, and destroying the older one
// cleared the newer one's hook. Hooks now carry their owner: destroying an
// older wrapper leaves the newer one's hook alone, and backward through a
// stale wrapper raises InvalidArgument saying to use the newest one.
// So DDPConfig.find_unused_parameters changes nothing for today's modules. It
// is kept (the API names it) as a guarantee for any future module or model
// that leaves a parameter unreported: after backward returns, the unreported
// parameters are listed; with the flag set every bucket is then marked ready
// and reduced as it is (the unused slices hold what they held, zeros after
// zero_grad, so their average is too), in the same index order on every rank;
// without it backward throws InvalidArgument naming the parameter indices and
// the flag, never hangs. The check runs on every backward (it is a scan of one
// byte per parameter tensor).
//
// Note [Dropout across ranks]
// Each rank must draw its own dropout masks, or sample i of every rank's batch
// would get the same mask and an N-rank step would not be a step on a batch of
// N*b independent samples. PyTorch gets this from each process having its own
// generator (and users seeding per rank); here every rank builds the same
// model with the same seeds, so construction forks the streams: every module
// with a generator (Note [RNG state] in nn/module.h) on rank r gets
// nn::fork_stream(state, r). Rank 0's stream is left as it is, so a world of
// one trains exactly like the bare model. Wrapping a model again forks again
// (deterministically). Checkpoints of DistributedTrainer hold every rank's
// states, so a resumed run draws the masks an uninterrupted one would.
//
// Note [Buffers across ranks]
// Module buffers (BatchNormModule's running_mean/running_var) are not
// parameters: no gradient averages them, and each rank's training forward
// updates them from its own batch, so left alone they drift apart (0.14 in
// running_mean after a short fit on 2 ranks), evaluation shards then use
// different statistics, and a checkpoint keeps only rank 0's. As PyTorch's DDP
// (broadcast_buffers=True), forward() in training mode first copies rank 0's
// buffers to every rank: one float32 broadcast of every buffer packed together
// (train/buffer_sync.h), none for a model without buffers. Each rank's forward
// then adds its own batch's update on top, so between steps they differ by one
// update; DistributedTrainer broadcasts once more at the end of every epoch,
// so evaluation, checkpoints and the model after fit hold the same statistics
// on every rank. Eval-mode forwards change no buffer and send nothing.
// DDPConfig.broadcast_buffers = False turns this off (the construction-time
// copy of broadcast_parameters stays). SyncBatchNormModule keeps its running
// statistics equal on every rank by itself (its statistics are global: Note
// [SyncBatchNorm statistics] in nn/modules.h); the broadcast does no harm there.
// Construction also hands every module the group's SUM all-reduce (Note
// [Modules that communicate] in nn/module.h) when there is more than one rank,
// and takes it back in the destructor.
//
// Note [Join]
// Uneven inputs (torch.distributed.algorithms.Join): inside ddp.join() a rank
// that runs out of batches calls join_end() and, until every rank has, answers
// its peers' collectives with zeros. A joined rank cannot know what its peers
// will send next, so under join every point where DDP communicates starts with
// a join signal: one SUM all-reduce of world+1 float64s, slot r = 1 if rank r
// is still active, the last slot the kind of what follows (1: a training
// forward's buffer broadcast, 2: the gradient all-reduce). From it every rank
// learns the active ranks (the same set everywhere, since every rank takes
// part in every signal) and what to shadow; kinds that differ between active
// ranks (one in no_sync, one stepping) throw on every rank instead of pairing
// wrong collectives. What changes while joining:
//   - backward launches nothing (no overlap): sync_gradients() sends the signal,
//     then one SUM all-reduce of the whole gradient buffer, divided by the
//     number of active ranks, joined ranks contributing zeros; where every
//     active rank checks for non-finite values (a slot of the signal counts
//     them) that all-reduce is probed on every rank, joined ones too, and all
//     take part in the check's agreement (Note [Non-finite gradients] in nonfinite.h);
//   - a training forward with buffers to broadcast sends the signal, then the
//     buffers of the lowest active rank (rank 0 while it is active, so with
//     even inputs nothing differs from plain DDP): a joined rank's are stale;
//   - SyncBatchNorm's replica sums cannot be shadowed: join() refuses models
//     that have one, as it refuses a ZeroRedundancyOptimizer's step.
// When the signal reports no active rank every rank leaves together; ranks
// that joined early have not stepped since, so the lowest rank of the last
// non-empty active set broadcasts its parameters and buffers (every rank of
// that set applied the same averaged updates). As in PyTorch, the optimizer
// state of an early joiner stays as it was when it joined.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "nn/optimizer.h"
#include "nn/sequential.h"
#include "train/buckets.h"
#include "train/comm_hooks.h"
#include "train/nonfinite.h"

namespace cx::train {

struct DDPConfig {
  bool broadcast_parameters = true;  // copy rank 0's parameters (and buffers) to every rank at construction
  bool broadcast_buffers = true;     // and rank 0's buffers before every training forward (Note [Buffers across ranks])
  double bucket_size_mb = 25.0;      // cap per gradient bucket, MiB
  bool find_unused_parameters = false;
  double first_bucket_mb = 1.0;      // cap of bucket 0 (Note [Bucket order])
  std::string comm_hook = "none";    // "none", "fp16", "bf16", "powersgd" (comm_hooks.h)
  PowerSGDConfig powersgd;           // options of the "powersgd" hook
  // What a step whose averaged gradient holds NaN/inf does (Note [Non-finite gradients] in nonfinite.h):
  // "raise" (NonFiniteError on every rank), "skip" (no optimizer step, on every rank), "warn" or "off".
  std::string nonfinite = "raise";
};

// One parameter tensor that differs between ranks.
struct ParamMismatch {
  size_t param_index;
  std::vector<int> ranks;  // ranks whose copy differs from rank 0's
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<nn::SequentialModel> model, DDPConfig cfg,
                          std::shared_ptr<distributed::ProcessGroup> group);
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // The model's forward; in training mode rank 0's buffers are broadcast
  // first if config().broadcast_buffers (Note [Buffers across ranks]).
  const nn::Tensor& forward(const float* x, const nn::Shape& shape);
  // Runs model.backward with the overlapped bucket all-reduce (Note [Overlap]).
  const nn::Tensor* backward(const float* grad_output, const nn::Shape& shape, bool input_grad);
  // Launches every dirty bucket, waits for all reductions: flat_grads() then
  // holds the average over ranks of what backward accumulated.
  void sync_gradients();
  // sync_gradients() if needed, optimizer.step(model), model.zero_grad().
  void update_parameters(nn::Optimizer& opt);

  // Note [Join]: enter uneven-input mode; join_end() when this rank has no
  // more batches (shadows its peers until all have finished, then syncs the
  // final parameters); join_abort() leaves without communicating (an error).
  void join_begin();
  void join_end();
  void join_abort() { joining_ = false; }
  bool joining() const { return joining_; }

  // Note [ZeRO-1] in zero.h: with sharding on, backward launches nothing and a
  // ZeroRedundancyOptimizer reduce-scatters the gradients at its step.
  void set_shard_gradients(bool on);
  bool shard_gradients() const { return shard_; }
  // Waits for reductions in flight; returns whether backward accumulated
  // gradient that no reduction has covered since, and marks it covered: the
  // caller (ZeroRedundancyOptimizer::step) reduces it itself.
  bool take_unsynced();

  // Replaces how buckets are reduced from the next step on (comm_hooks.h):
  // "none" (float32 AVG all-reduce), "fp16", "bf16", "powersgd" with `psgd`.
  // Every rank must register the same hook at the same point, between steps;
  // InvalidArgument while a step's gradients wait to be reduced, for a name or
  // option out of range, or where the trainer refuses hooks (the GPU engine).
  void register_comm_hook(const std::string& name, const PowerSGDConfig& psgd = PowerSGDConfig());
  // The hook's state for checkpoints (PowerSGD: iteration, Q, this rank's
  // residuals; empty for the others) and its restore (same model and options).
  CommHookState comm_hook_state();
  void set_comm_hook_state(const CommHookState& s);
  // Makes register_comm_hook refuse any hook but "none", saying `why`.
  void refuse_comm_hooks(std::string why) { hooks_refused_ = std::move(why); }

  // DDPConfig.nonfinite from the next sync on (every rank alike; InvalidArgument naming the choices).
  void set_nonfinite(const std::string& mode);
  const char* nonfinite() const { return nonfinite_name(nonfinite_); }
  NonFiniteMode nonfinite_mode() const { return nonfinite_; }
  // One step of the GPU engine, which scans the device gradients itself (Note [Non-finite gradients on the
  // GPU] in gpu_engine.cpp): its verdict is counted, raised, skipped or warned of as this object's own check
  // would (every rank calls it with the same verdict). false: the optimizer step is not taken.
  bool conclude_device_step(const NonFiniteVerdict& v);
  // Steps whose averaged gradient was not finite, and of those the ones not taken ("skip").
  uint64_t nonfinite_steps() const { return nonfinite_steps_; }
  uint64_t skipped_steps() const { return skipped_steps_; }
  // "skip" decided that the gradients synced last must not be stepped on: update_parameters
  // (and ZeRO's step) then zero them instead, and clear this.
  bool step_skipped() const { return skip_pending_; }
  void clear_skip() { skip_pending_ = false; }
  // The "warn" text of the last sync (then empty): the binding issues it as a RuntimeWarning.
  std::string take_warning() { return std::move(warning_); }
  // ZeRO-1 (zero.cpp): this rank's own gradients are about to be reduce-scattered: the probe its
  // reduce-scatter (and tail all_reduce) fill, indices of the flat buffer (the fused check: Note
  // [Non-finite gradients]); null where the check is off or reads the gradients itself (done here)...
  distributed::ReduceProbe* begin_sharded();
  // ...and after it, with this rank's shard of the average in place, every rank agrees (collective);
  // false when the step must not be taken ("skip"); NonFiniteError with "raise".
  bool conclude_sharded(size_t shard_offset, size_t shard_count);
  // How the check runs (Note [Non-finite gradients]), for benchmarks and tests: `fused`, inside the
  // reductions (the default) or by reading each bucket before it; `by_message`, ranks agree by a small
  // all-reduce behind the last bucket (the default) or each reads the average. They decide what the
  // gradient collectives carry, so every rank must choose alike: collective, between steps; a
  // MismatchError naming the ranks on every rank where they differ.
  void set_check_path(bool fused, bool by_message);
  bool fused_switch() const { return fused_; }
  bool by_message_switch() const { return by_message_; }

  void set_require_sync(bool on) { require_sync_ = on; }
  bool require_sync() const { return require_sync_; }

  // Copies rank 0's parameters (and module buffers) to every rank.
  void broadcast_parameters();
  // Copies rank 0's module buffers to every rank, as one message.
  void broadcast_buffers();
  // Hashes every parameter tensor, gathers the hashes and compares them with
  // rank 0's; same answer on every rank. Collective: every rank must call it.
  std::vector<ParamMismatch> check_parameters();
  // Whether every rank holds the same parameters, bit for bit: one 8-byte hash
  // of them from each rank, gathered. Collective; the same answer on every
  // rank. Cheap enough to run every few hundred steps
  // (DistributedTrainingConfig.check_every_n_steps).
  bool parameters_agree();
  // "" when parameters_agree(); otherwise which parameter tensors differ from
  // rank 0's on which ranks (check_parameters), with the likely causes. Collective.
  std::string parameter_report();
  // The same, and with raise_on_mismatch a MismatchError naming every parameter that differs (index, layer,
  // tensor), the ranks it differs on and the likely causes, instead of returning a non-empty list.
  std::vector<ParamMismatch> check_parameters(bool raise_on_mismatch);

  // How the replica checks above gather host bytes from every rank: through
  // the group by default; the GPU trainer passes its engine's, which stages
  // them through the device (NCCL moves device memory only).
  using HostGather = std::function<void(const void* in, void* out, size_t bytes)>;
  void set_host_gather(HostGather g);

  const std::vector<Bucket>& buckets() const { return sched_.buckets(); }
  size_t bucket_of(size_t param) const { return sched_.bucket_of(param); }
  // Collectives launched so far (tests use it to see that no_sync communicates less).
  uint64_t allreduce_count() const { return launched_total_; }
  const DDPConfig& config() const { return cfg_; }
  const std::shared_ptr<nn::SequentialModel>& model() const { return model_; }
  const std::shared_ptr<distributed::ProcessGroup>& group() const { return group_; }
  int rank() const { return group_->rank(); }
  int world_size() const { return group_->size(); }
  bool is_master() const { return group_->rank() == 0; }

 private:
  void fork_rng_streams();
  std::string describe(const std::vector<ParamMismatch>& bad) const;
  void gather_host(const void* in, void* out, size_t bytes);
  void give_replica_sums();
  void on_grad_ready(size_t param);
  void launch(size_t b);
  void wait_in_flight();
  // Note [Join]: the signal; returns (active ranks, kind), records the set.
  // `probe`: this rank asks for the fused non-finite check of the gradient all-reduce (kJoinSync); sets join_probed_.
  std::pair<int, int> join_signal(bool active, int kind, bool probe = false);
  NonFiniteVerdict decide_joined();
  void broadcast_buffers_from(int root);
  void sync_gradients_joined();
  bool checking() const { return nonfinite_ != NonFiniteMode::kOff; }
  // The buckets' own reductions (or the fp16/bf16 hooks' casts) test for non-finite values (Note [Fused
  // non-finite check] in distributed/reduce_probe.h); otherwise (PowerSGD, one rank, join(), the benchmark's
  // variants) launch() reads them.
  bool fused_check() const {
    return checking() && fused_ && by_message_ && (!hook_ || hook_->probes()) && !joining_ && group_->size() > 1;
  }
  // Acts on a verdict (Note [Non-finite gradients]); false when the step is skipped.
  bool act_on(const NonFiniteVerdict& v);

  std::shared_ptr<nn::SequentialModel> model_;
  DDPConfig cfg_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  size_t num_params_ = 0;             // parameter tensors at construction (checked against re-layouts)
  size_t num_elems_ = 0;
  BucketScheduler sched_;             // touched on the thread running backward only
  std::vector<char> dirty_;           // Note [Accumulation]
  bool in_backward_ = false;
  std::vector<distributed::ProcessGroup::WorkPtr> in_flight_;
  bool require_sync_ = true;
  size_t backwards_since_sync_ = 0;
  size_t period_ = 1;                 // backwards per sync seen in the last cycle
  bool any_unsynced_ = false;         // something to reduce since the last sync
  uint64_t launched_total_ = 0;
  HostGather host_gather_;
  std::vector<float> buffer_pack_;    // broadcast_buffers' message
  bool shard_ = false;                // Note [ZeRO-1] in zero.h
  bool joining_ = false;              // Note [Join]
  int join_authority_ = 0;            // lowest rank of the last non-empty active set
  bool join_signalled_ = false;       // a signal reported active ranks since join_begin
  int join_active_ = 0;               // the active ranks of the last gradient signal (their average)
  bool join_probed_ = false;          // the last signal: every active rank asked for the fused check
  std::vector<double> join_buf_;

  NonFiniteMode nonfinite_ = NonFiniteMode::kRaise;
  std::unique_ptr<NonFiniteCheck> check_;
  uint64_t steps_ = 0;                // syncs that reduced something (the step a NonFiniteError names)
  uint64_t nonfinite_steps_ = 0, skipped_steps_ = 0;
  bool skip_pending_ = false;
  bool by_message_ = true;
  bool fused_ = true;
  std::vector<double> fused_msg_;     // the fused path's agreement message
  bool sharded_fused_ = false;        // begin_sharded handed out the probe (ZeRO-1's reduce-scatter fills it)
  std::string warning_;

  std::unique_ptr<CommHook> hook_;    // null: the float32 AVG all-reduce of launch()
  std::string hooks_refused_;
};

}  // namespace cx::train
