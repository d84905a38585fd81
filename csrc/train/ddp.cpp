#include "train/ddp.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <cfloat>

#include "common/error.h"
#include "nn/kernels.h"
#include "nn/rng.h"
#include "train/buffer_sync.h"

namespace cx::train {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

size_t mb_to_bytes(double mb, const char* field) {
  CX_CHECK(mb > 0.0, InvalidArgument, "DistributedDataParallel: DDPConfig.", field, " must be > 0, got ", mb);
  return static_cast<size_t>(mb * kMiB);
}

// Whether module m is, or holds (in a container's models), a SyncBatchNorm.
bool has_sync_batchnorm(nn::Module& m) {
  if (m.type_name() == "SyncBatchNorm") return true;
  for (nn::SequentialModel* inner : m.submodels())
    for (size_t i = 0; i < inner->size(); ++i)
      if (has_sync_batchnorm(*inner->module(i))) return true;
  return false;
}

// FNV-1a over the bytes: equal tensors hash equal; a differing bit differs.
uint64_t fnv1a(const float* p, size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n * sizeof(float); ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// The buckets of a model (Note [Bucket order]): a pure function of its layout and the caps.
std::vector<Bucket> buckets_of(const nn::SequentialModel* model, const DDPConfig& cfg) {
  CX_CHECK(model != nullptr, InvalidArgument, "DistributedDataParallel: model is None");
  const size_t cap = mb_to_bytes(cfg.bucket_size_mb, "bucket_size_mb");
  const size_t first = std::min(cap, mb_to_bytes(cfg.first_bucket_mb, "first_bucket_mb"));
  std::vector<size_t> counts;
  for (auto [off, n] : model->param_slices()) counts.push_back(n);
  return assign_buckets(counts, sizeof(float), first, cap);
}

// What follows a join signal (Note [Join]).
constexpr int kJoinForward = 1;  // a training forward's buffer broadcast
constexpr int kJoinSync = 2;     // the gradient all-reduce

bool has_buffers(nn::SequentialModel& m) {
  for (size_t i = 0; i < m.size(); ++i)
    for (auto* buf : m.module(i)->buffers())
      if (!buf->empty()) return true;
  return false;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::SequentialModel> model, DDPConfig cfg,
                                                 std::shared_ptr<distributed::ProcessGroup> group)
    : model_(std::move(model)),
      cfg_(cfg),
      group_(std::move(group)),
      num_params_(model_ ? model_->param_slices().size() : 0),
      num_elems_(model_ ? model_->num_parameters() : 0),
      sched_(buckets_of(model_.get(), cfg_), num_params_, [this](size_t b) { launch(b); }) {
  CX_CHECK(group_ != nullptr, InvalidArgument,
           "DistributedDataParallel: no process group; call cx.distributed.init() first");
  dirty_.assign(sched_.buckets().size(), 0);
  const std::string who = "DistributedDataParallel (rank " + std::to_string(group_->rank()) + "): DDPConfig.comm_hook";
  const CommHookKind hook = parse_comm_hook(cfg_.comm_hook, who);
  if (hook == CommHookKind::kPowerSgd) check_powersgd_config(cfg_.powersgd, who);
  cfg_.comm_hook = comm_hook_name(hook);
  nonfinite_ = parse_nonfinite(cfg_.nonfinite, "DistributedDataParallel (rank " + std::to_string(group_->rank()) +
                                                   "): DDPConfig.nonfinite");
  cfg_.nonfinite = nonfinite_name(nonfinite_);
  check_ = std::make_unique<NonFiniteCheck>(model_, sched_.buckets(), group_->size(), group_->rank());

  if (cfg_.broadcast_parameters) broadcast_parameters();
  fork_rng_streams();
  give_replica_sums();
  // The hook holds a raw pointer: the destructor clears it before we go away
  // (unless a newer wrapper has replaced it: Note [Unused parameters]).
  model_->set_grad_ready_hook([this](size_t i) { on_grad_ready(i); }, this);
  if (hook != CommHookKind::kNone) hook_ = make_comm_hook(hook, cfg_.powersgd, model_, sched_.buckets(), *group_);
}

void DistributedDataParallel::register_comm_hook(const std::string& name, const PowerSGDConfig& psgd) {
  const std::string who = "DistributedDataParallel.register_comm_hook (rank " + std::to_string(group_->rank()) + ")";
  const CommHookKind kind = parse_comm_hook(name, who);
  if (kind == CommHookKind::kPowerSgd) check_powersgd_config(psgd, who);
  CX_CHECK(kind == CommHookKind::kNone || hooks_refused_.empty(), InvalidArgument, who, ": hook '", name, "' ",
           hooks_refused_);
  CX_CHECK(kind == CommHookKind::kNone || (!shard_ && !joining_), InvalidArgument, who, ": hook '", name,
           "' compresses all-reduces, but ", shard_ ? "this DDP's gradients are sharded by a ZeroRedundancyOptimizer "
           "(ZeRO-1), which reduce-scatters them" : "inside join() a finished rank answers plain all-reduces",
           "; use one or the other");
  CX_CHECK(!any_unsynced_, InvalidArgument, who, ": the gradients of ", backwards_since_sync_,
           " backward(s) are waiting to be reduced; register the hook between steps (before the first backward, or "
           "after update_parameters / sync_gradients), on every rank");
  wait_in_flight();
  hook_ = kind == CommHookKind::kNone ? nullptr : make_comm_hook(kind, psgd, model_, sched_.buckets(), *group_);
  cfg_.comm_hook = comm_hook_name(kind);
  cfg_.powersgd = psgd;
}

CommHookState DistributedDataParallel::comm_hook_state() {
  wait_in_flight();
  return hook_ ? hook_->state() : CommHookState{};
}

void DistributedDataParallel::set_comm_hook_state(const CommHookState& s) {
  wait_in_flight();
  if (hook_) {
    hook_->set_state(s);
  } else {
    CX_CHECK(s.q.empty() && s.error.empty(), InvalidArgument, "DistributedDataParallel (rank ", group_->rank(),
             "): PowerSGD state given but the comm hook is '", cfg_.comm_hook,
             "'; set DDPConfig.comm_hook = 'powersgd' (or register_comm_hook) first");
  }
}

// Note [Dropout across ranks].
void DistributedDataParallel::fork_rng_streams() {
  auto states = model_->rng_states();
  for (auto& s : states) s = nn::fork_stream(s, static_cast<uint64_t>(group_->rank()));
  model_->set_rng_states(states);
}

// Note [Modules that communicate] in nn/module.h. The sum holds a raw pointer
// to the group: the destructor takes it back before we (and our group_) go.
void DistributedDataParallel::give_replica_sums() {
  if (group_->size() < 2) return;  // a world of one: the modules compute as they would alone
  distributed::ProcessGroup* g = group_.get();
  nn::ReplicaSum sum = [g](double* buf, size_t n) {
    g->all_reduce(buf, n, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  };
  for (size_t i = 0; i < model_->size(); ++i) model_->module(i)->set_replica_sum(sum, this);
}

DistributedDataParallel::~DistributedDataParallel() {
  model_->clear_grad_ready_hook(this);
  for (size_t i = 0; i < model_->size(); ++i) model_->module(i)->clear_replica_sum(this);
  try {
    wait_in_flight();
  } catch (...) {
    // The group is poisoned; its next user sees the error.
  }
}

void DistributedDataParallel::broadcast_parameters() {
  CX_CHECK(model_->num_parameters() == num_elems_, InvalidArgument,
           "DistributedDataParallel: the model changed after it was wrapped (", num_elems_, " parameters then, ",
           model_->num_parameters(), " now); wrap it after the last add()");
  wait_in_flight();
  if (num_elems_) group_->broadcast(model_->flat_params(), num_elems_, distributed::DataType::kFloat32, 0, false);
  broadcast_buffers();
}

void DistributedDataParallel::broadcast_buffers() { broadcast_buffers_from(0); }

void DistributedDataParallel::broadcast_buffers_from(int root) {
  std::vector<FloatSpan> spans;
  for (size_t i = 0; i < model_->size(); ++i)
    for (auto* buf : model_->module(i)->buffers()) spans.emplace_back(buf->data(), buf->size());
  buffer_pack_.resize(total_floats(spans));
  train::broadcast_buffers(
      *group_, spans, buffer_pack_.data(),
      [](float* dst, const float* src, size_t n) { std::memcpy(dst, src, n * sizeof(float)); }, 0, root);
}

// ---------------------------------------------------------------- join (Note [Join])

void DistributedDataParallel::join_begin() {
  CX_CHECK(!joining_, InvalidArgument, "DistributedDataParallel.join (rank ", group_->rank(),
           "): already inside join(); contexts do not nest");
  CX_CHECK(!hook_, InvalidArgument, "DistributedDataParallel.join (rank ", group_->rank(), "): this DDP has the '",
           cfg_.comm_hook, "' communication hook, whose compressed all-reduces a finished rank cannot shadow; use "
           "join() without a hook, or give every rank the same number of batches");
  CX_CHECK(!shard_, InvalidArgument, "DistributedDataParallel.join (rank ", group_->rank(),
           "): this DDP's gradients are sharded by a ZeroRedundancyOptimizer (ZeRO-1), whose reduce-scatter and "
           "all-gather a finished rank cannot shadow; use join() with a plain optimizer, or give every rank the "
           "same number of batches (DistributedSampler pads to that)");
  if (group_->size() > 1)
    for (size_t i = 0; i < model_->size(); ++i)
      CX_CHECK(!has_sync_batchnorm(*model_->module(i)), InvalidArgument, "DistributedDataParallel.join (rank ",
               group_->rank(), "): layer ", i, model_->module(i)->type_name() == "SyncBatchNorm" ? " is" : " holds",
               " a SyncBatchNorm, whose forward sums statistics over every rank and cannot be answered by a "
               "rank that has finished; use BatchNorm under join(), or give every rank the same number of batches");
  wait_in_flight();
  joining_ = true;
  join_signalled_ = false;
  join_authority_ = 0;
}

std::pair<int, int> DistributedDataParallel::join_signal(bool active, int kind, bool probe) {
  const int world = group_->size(), rank = group_->rank();
  join_buf_.assign(static_cast<size_t>(world) + 2, 0.0);
  if (active) {
    join_buf_[static_cast<size_t>(rank)] = 1.0;
    join_buf_[static_cast<size_t>(world)] = kind;
    join_buf_[static_cast<size_t>(world) + 1] = probe ? 1.0 : 0.0;
  }
  group_->all_reduce(join_buf_.data(), join_buf_.size(), distributed::DataType::kFloat64,
                     distributed::ReduceOp::kSum, false);
  int count = 0, lowest = -1;
  for (int r = 0; r < world; ++r)
    if (join_buf_[static_cast<size_t>(r)] > 0.5) {
      ++count;
      if (lowest < 0) lowest = r;
    }
  const double kinds = join_buf_[static_cast<size_t>(world)];
  // Every active rank asks for the fused check, or none gets it (the same decision on every rank).
  join_probed_ = count > 0 && static_cast<int>(join_buf_[static_cast<size_t>(world) + 1] + 0.5) == count;
  if (count == 0) return {0, 0};
  const int seen = static_cast<int>(kinds / count + 0.5);
  const bool agree = (seen == kJoinForward || seen == kJoinSync) && seen * count == static_cast<int>(kinds + 0.5);
  if (!agree || (active && seen != kind)) {
    joining_ = false;
    CX_THROW(MismatchError, "DistributedDataParallel.join (rank ", rank, "): the ", count,
             " ranks still active reached different collectives (some a training forward that broadcasts "
             "buffers, some the gradient all-reduce of sync_gradients/update_parameters). Every active rank must "
             "run the same sequence per step: the same no_sync() pattern and the same forward/backward/update "
             "calls");
  }
  join_authority_ = lowest;
  join_signalled_ = true;
  return {count, seen};
}

void DistributedDataParallel::sync_gradients_joined() {
  // Note [Non-finite gradients] in nonfinite.h: fused where every active rank asks for it (the signal says).
  const int active = join_signal(true, kJoinSync, checking() && fused_ && by_message_ && group_->size() > 1).first;
  join_active_ = active;  // the ranks this step's average is over (its non-finite message says so)
  float* g = model_->flat_grads();
  if (checking() && !join_probed_) check_->scan_all(g);
  if (num_elems_) {
    if (join_probed_)
      group_->all_reduce_probed(g, num_elems_, distributed::ReduceOp::kSum, check_->shard_probe(), false);
    else
      group_->all_reduce(g, num_elems_, distributed::DataType::kFloat32, distributed::ReduceOp::kSum, false);
    nn::kernels::scale(g, num_elems_, 1.0f / static_cast<float>(active));
  }
  ++launched_total_;
  ++steps_;
  skip_pending_ = false;
}

void DistributedDataParallel::join_end() {
  CX_CHECK(joining_, InvalidArgument, "DistributedDataParallel.join_end (rank ", group_->rank(),
           "): not inside join()");
  wait_in_flight();
  // Shadow the peers still active: their signals say what comes next.
  for (uint64_t shadowed = 0;;) {
    auto [active, kind] = join_signal(false, 0);
    if (active == 0) break;
    if (kind == kJoinForward) {
      broadcast_buffers_from(join_authority_);
    } else {
      ++shadowed;
      model_->zero_grad();  // this rank's contribution: zeros
      float* g = model_->flat_grads();
      if (num_elems_ && join_probed_)
        group_->all_reduce_probed(g, num_elems_, distributed::ReduceOp::kSum, check_->shard_probe(), false);
      else if (num_elems_)
        group_->all_reduce(g, num_elems_, distributed::DataType::kFloat32, distributed::ReduceOp::kSum, false);
      if (!join_probed_) continue;
      // The active ranks' agreement, answered. Where they raise NonFiniteError, this rank raises it too, at
      // once: it would otherwise wait in the next signal for ranks that have left.
      NonFiniteVerdict v = decide_joined();
      v.averaged_over = active;
      if (v.bad && nonfinite_ == NonFiniteMode::kRaise) {
        joining_ = false;
        ++nonfinite_steps_;
        CX_THROW(NonFiniteError, check_->describe(v, "DistributedDataParallel (rank " +
                                                         std::to_string(group_->rank()) + ")",
                                                  steps_ + shadowed, false,
                                                  "This rank had finished its batches inside join(); the ranks "
                                                  "still active did not take the step and raise this error too."));
      }
    }
  }
  joining_ = false;
  model_->zero_grad();
  std::fill(dirty_.begin(), dirty_.end(), 0);
  backwards_since_sync_ = 0;
  any_unsynced_ = false;
  // Ranks that finished early are behind: everyone takes the last active ranks' state.
  if (join_signalled_ && group_->size() > 1) {
    if (num_elems_)
      group_->broadcast(model_->flat_params(), num_elems_, distributed::DataType::kFloat32, join_authority_, false);
    broadcast_buffers_from(join_authority_);
  }
}

// ---------------------------------------------------------------- ZeRO-1 (Note [ZeRO-1] in zero.h)

void DistributedDataParallel::set_shard_gradients(bool on) {
  if (on == shard_) return;
  CX_CHECK(!joining_, InvalidArgument, "DistributedDataParallel (rank ", group_->rank(),
           "): cannot change gradient sharding (ZeRO-1) inside join()");
  CX_CHECK(!on || !hook_, InvalidArgument, "ZeroRedundancyOptimizer (rank ", group_->rank(), "): this DDP has the '",
           cfg_.comm_hook, "' communication hook, which compresses all-reduces, but ZeRO-1 reduce-scatters the "
           "gradients; use one or the other (DDPConfig.comm_hook = None)");
  wait_in_flight();
  shard_ = on;
}

bool DistributedDataParallel::take_unsynced() {
  wait_in_flight();
  const bool had = any_unsynced_;
  std::fill(dirty_.begin(), dirty_.end(), 0);
  if (backwards_since_sync_ > 0) period_ = backwards_since_sync_;
  backwards_since_sync_ = 0;
  any_unsynced_ = false;
  return had;
}

const nn::Tensor& DistributedDataParallel::forward(const float* x, const nn::Shape& shape) {
  if (cfg_.broadcast_buffers && model_->training()) {
    if (!joining_) {
      broadcast_buffers();
    } else if (has_buffers(*model_)) {  // Note [Join]
      join_signal(true, kJoinForward);
      broadcast_buffers_from(join_authority_);
    }
  }
  return model_->forward(x, shape);
}

void DistributedDataParallel::wait_in_flight() {
  // Wait for all, then rethrow the first error (the group is poisoned anyway).
  std::vector<distributed::ProcessGroup::WorkPtr> works;
  works.swap(in_flight_);
  for (auto& w : works) w->wait();
  if (hook_) hook_->finish();
}

void DistributedDataParallel::launch(size_t b) {
  const Bucket& bk = sched_.buckets()[b];
  // Note [Non-finite gradients]: the reduction tests the bucket as it reduces it (fused), or it is read here.
  const bool fused = fused_check();
  if (checking() && !fused) check_->scan(b, model_->flat_grads());
  if (hook_)
    hook_->launch(b, fused ? &check_->probe(b) : nullptr);  // comm_hooks.h
  else if (bk.count && fused)
    in_flight_.push_back(group_->all_reduce_probed(model_->flat_grads() + bk.offset, bk.count,
                                                   distributed::ReduceOp::kAvg, check_->probe(b), true));
  else if (bk.count)
    in_flight_.push_back(group_->all_reduce(model_->flat_grads() + bk.offset, bk.count, distributed::DataType::kFloat32,
                                            distributed::ReduceOp::kAvg, true));
  ++launched_total_;
  dirty_[b] = 0;
}

// Runs on the thread running backward, without the GIL (Note [Overlap]).
void DistributedDataParallel::on_grad_ready(size_t param) {
  if (!in_backward_) return;  // model.backward called directly: sync reduces it
  sched_.param_ready(param);
}

const nn::Tensor* DistributedDataParallel::backward(const float* grad_output, const nn::Shape& shape,
                                                    bool input_grad) {
  CX_CHECK(model_->param_slices().size() == num_params_ && model_->num_parameters() == num_elems_,
           InvalidArgument, "DistributedDataParallel.backward: the model changed after it was wrapped; wrap it "
           "after the last add()");
  CX_CHECK(model_->hook_owner() == this, InvalidArgument, "DistributedDataParallel.backward (rank ", group_->rank(),
           "): this model has been wrapped by another DistributedDataParallel (or DistributedTrainer) since this "
           "one was made, and only the newest wrapper sees its gradients; use the newest one");
  wait_in_flight();  // in-flight reductions read and write the buffer backward adds into
  if (checking()) check_->before_accumulating(model_->flat_grads());  // Note [A bucket reduced twice]
  const size_t k = backwards_since_sync_;
  // Note [Accumulation]; sharded (ZeRO-1) or joining: reduced at the step, not during backward.
  const bool launching = require_sync_ && k + 1 >= period_ && !shard_ && !joining_;
  sched_.start(launching);
  std::fill(dirty_.begin(), dirty_.end(), 1);
  in_backward_ = true;
  ++backwards_since_sync_;
  any_unsynced_ = true;
  const nn::Tensor* gx = nullptr;
  try {
    gx = model_->backward(grad_output, shape, input_grad);
  } catch (...) {
    in_backward_ = false;
    // Nothing of this backward may be reduced now: other ranks may not have got here.
    throw;
  }
  in_backward_ = false;

  const std::vector<size_t> unused = sched_.unseen();
  if (!unused.empty()) {
    if (!cfg_.find_unused_parameters) {
      std::ostringstream os;
      for (size_t i = 0; i < unused.size() && i < 20; ++i) os << (i ? ", " : "") << unused[i];
      if (unused.size() > 20) os << ", ...";
      CX_THROW(InvalidArgument, "DistributedDataParallel (rank ", group_->rank(), "): parameters [", os.str(),
               "] received no gradient in this backward, so their buckets can never be reduced. Likely causes: "
               "part of the model is not used to compute the output, or backward failed part-way. Set "
               "DDPConfig.find_unused_parameters = True to reduce them anyway (as they are, zeros after "
               "zero_grad).");
    }
    // Note [Accumulation]: an unused parameter contributes nothing; its bucket is ready as it is.
    sched_.mark_all_ready();
  }
  if (launching) sched_.launch_ready();
  return gx;
}

void DistributedDataParallel::sync_gradients() {
  if (!any_unsynced_ && in_flight_.empty() && !(hook_ && hook_->busy())) return;  // nothing new since the last sync
  if (joining_) {
    wait_in_flight();
    sync_gradients_joined();
    std::fill(dirty_.begin(), dirty_.end(), 0);
    backwards_since_sync_ = 0;
    any_unsynced_ = false;
    // Fused: the agreement, in which joined ranks take part; else the active ranks hold the same average and
    // each reads it (no message).
    if (join_probed_) act_on(decide_joined());
    else if (checking()) act_on(check_->decide_local(model_->flat_grads()));
    return;
  }
  for (size_t b = 0; b < dirty_.size(); ++b)
    if (dirty_[b]) launch(b);
  // Note [Non-finite gradients]: with by_message_, the agreement travels right behind the last bucket (fused:
  // after them, only where their algorithms left the flags local).
  const bool check = checking(), fused = fused_check();
  if (check && by_message_ && !fused) {
    std::vector<double>& msg = check_->pack();
    if (group_->size() > 1)
      in_flight_.push_back(group_->all_reduce(msg.data(), msg.size(), distributed::DataType::kFloat64,
                                              distributed::ReduceOp::kSum, true));
  }
  wait_in_flight();
  if (fused) {
    fused_msg_.resize(check_->fused_size());
    if (check_->pack_fused(fused_msg_.data()))  // the same on every rank
      group_->all_reduce(fused_msg_.data(), fused_msg_.size(), distributed::DataType::kFloat64,
                         distributed::ReduceOp::kSum, false);
  }
  if (hook_) hook_->end_step();
  if (backwards_since_sync_ > 0) period_ = backwards_since_sync_;
  backwards_since_sync_ = 0;
  any_unsynced_ = false;
  ++steps_;
  skip_pending_ = false;
  if (fused) {
    act_on(check_->decide_fused(fused_msg_.data(), model_->flat_grads(), *group_));
  } else if (check && by_message_) {
    const double limit = hook_ && hook_->kind() == CommHookKind::kFp16 ? 65504.0 * group_->size() : FLT_MAX / 2;
    act_on(check_->decide(model_->flat_grads(), limit));
  } else if (check) {
    // The average is the same bytes on every rank: each reads it and every rank finds the same. Only a bad
    // step communicates, to learn whose own gradient was bad (every rank gets here alike).
    NonFiniteVerdict v = check_->decide_local(model_->flat_grads());
    if (v.bad) check_->name_ranks(v, *group_);
    act_on(v);
  }
}

void DistributedDataParallel::set_nonfinite(const std::string& mode) {
  const NonFiniteMode m = parse_nonfinite(mode, "DistributedDataParallel.nonfinite (rank " +
                                                    std::to_string(group_->rank()) + ")");
  CX_CHECK(!any_unsynced_ || m == nonfinite_, InvalidArgument, "DistributedDataParallel.nonfinite (rank ",
           group_->rank(), "): cannot change while a step's gradients wait to be reduced; set it between steps");
  nonfinite_ = m;
  cfg_.nonfinite = nonfinite_name(m);
}

// Inside join() every rank (joined ones too) holds the whole sum, with the same non-finite elements: rank 0
// counts them, and the message of decide_sharded names every rank's own values, tested by whoever added them.
NonFiniteVerdict DistributedDataParallel::decide_joined() {
  return check_->decide_sharded(model_->flat_grads(), 0, group_->rank() == 0 ? num_elems_ : 0, *group_);
}

bool DistributedDataParallel::act_on(const NonFiniteVerdict& verdict) {
  if (!verdict.bad) return true;
  NonFiniteVerdict v = verdict;  // rare: a bad step
  if (joining_ && join_active_ > 0) v.averaged_over = join_active_;  // inside join(): over the active ranks
  ++nonfinite_steps_;
  if (hook_) hook_->reset_nonfinite();  // Note [PowerSGD and non-finite values] in comm_hooks.cpp
  const std::string who = "DistributedDataParallel (rank " + std::to_string(group_->rank()) + ")";
  const bool fp16 = hook_ && hook_->kind() == CommHookKind::kFp16;
  switch (nonfinite_) {
    case NonFiniteMode::kRaise:
      CX_THROW(NonFiniteError, check_->describe(v, who, steps_, fp16,
                                                "The optimizer step was not taken. Look for a NaN or inf in this "
                                                "step's input rows, or lower the learning rate; DDPConfig.nonfinite "
                                                "= 'skip' skips such steps (what a loss scaler needs)."));
    case NonFiniteMode::kSkip:
      ++skipped_steps_;
      skip_pending_ = true;
      return false;
    case NonFiniteMode::kWarn:
      warning_ = check_->describe(v, who, steps_, fp16, "The step is taken (DDPConfig.nonfinite = 'warn').");
      return true;
    case NonFiniteMode::kOff: break;
  }
  return true;
}

bool DistributedDataParallel::conclude_device_step(const NonFiniteVerdict& v) {
  ++steps_;
  skip_pending_ = false;
  return act_on(v);
}

distributed::ReduceProbe* DistributedDataParallel::begin_sharded() {
  sharded_fused_ = checking() && fused_ && by_message_ && group_->size() > 1;
  if (sharded_fused_) return &check_->shard_probe();
  if (checking()) check_->scan_all(model_->flat_grads());
  return nullptr;
}

void DistributedDataParallel::set_check_path(bool fused, bool by_message) {
  const int world = group_->size(), rank = group_->rank();
  CX_CHECK(!any_unsynced_, InvalidArgument, "DistributedDataParallel (rank ", rank,
           "): the non-finite check's path cannot change while a step's gradients wait to be reduced; set it "
           "between steps, on every rank");
  CX_CHECK(!joining_, InvalidArgument, "DistributedDataParallel (rank ", rank,
           "): the non-finite check's path cannot change inside join() (a rank that has finished could not take "
           "part); set it before join(), on every rank");
  wait_in_flight();
  // Slot r: rank r's fused switch; slot world + r: its by_message switch (Note [Non-finite gradients]).
  std::vector<double> seen(2 * static_cast<size_t>(world), 0.0);
  seen[static_cast<size_t>(rank)] = fused ? 1.0 : 0.0;
  seen[static_cast<size_t>(world + rank)] = by_message ? 1.0 : 0.0;
  if (world > 1)
    group_->all_reduce(seen.data(), seen.size(), distributed::DataType::kFloat64, distributed::ReduceOp::kSum,
                       false);
  const char* names[2] = {"_fused_check", "_agree_by_message"};
  for (int k = 0; k < 2; ++k) {
    std::ostringstream on, off;
    int n_on = 0;
    for (int r = 0; r < world; ++r) {
      const bool v = seen[static_cast<size_t>(k * world + r)] > 0.5;
      (v ? on : off) << ((v ? n_on : r - n_on) ? ", " : "") << r;
      n_on += v;
    }
    CX_CHECK(n_on == 0 || n_on == world, MismatchError, "DistributedDataParallel.", names[k], " (rank ", rank,
             "): the ranks disagree: True on ranks [", on.str(), "], False on ranks [", off.str(),
             "]. It decides what the gradient collectives carry (the fused check's flag words and agreement "
             "message), so every rank must set it alike");
  }
  fused_ = fused;
  by_message_ = by_message;
}

bool DistributedDataParallel::conclude_sharded(size_t shard_offset, size_t shard_count) {
  ++steps_;
  skip_pending_ = false;
  if (!checking()) return true;
  if (sharded_fused_) {
    sharded_fused_ = false;
    return act_on(check_->decide_sharded(model_->flat_grads(), shard_offset, shard_count, *group_));
  }
  std::vector<double>& msg = check_->pack(model_->flat_grads(), shard_offset, shard_count, true);
  if (group_->size() > 1)
    group_->all_reduce(msg.data(), msg.size(), distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  return act_on(check_->decide(model_->flat_grads(), 0.0, true));
}

void DistributedDataParallel::update_parameters(nn::Optimizer& opt) {
  CX_CHECK(!shard_, InvalidArgument, "DistributedDataParallel.update_parameters (rank ", group_->rank(),
           "): this DDP's optimizer state is sharded by a ZeroRedundancyOptimizer; pass that wrapper "
           "(ddp.update_parameters(zero) or zero.step()), not the ", opt.type_name(), " optimizer inside it");
  sync_gradients();
  if (skip_pending_) {  // DDPConfig.nonfinite = "skip": not taken, on every rank alike
    skip_pending_ = false;
  } else {
    opt.step(*model_);
  }
  model_->zero_grad();
}

void DistributedDataParallel::set_host_gather(HostGather g) { host_gather_ = std::move(g); }

void DistributedDataParallel::gather_host(const void* in, void* out, size_t bytes) {
  if (host_gather_) return host_gather_(in, out, bytes);
  std::vector<void*> outs;
  for (int r = 0; r < group_->size(); ++r) outs.push_back(static_cast<char*>(out) + bytes * r);
  group_->all_gather(in, outs, bytes, distributed::DataType::kUInt8, false);
}

bool DistributedDataParallel::parameters_agree() {
  wait_in_flight();
  const uint64_t h = fnv1a(model_->flat_params(), model_->num_parameters());
  std::vector<uint64_t> all(static_cast<size_t>(group_->size()));
  gather_host(&h, all.data(), sizeof(h));
  return std::all_of(all.begin(), all.end(), [&](uint64_t x) { return x == all[0]; });
}

std::vector<ParamMismatch> DistributedDataParallel::check_parameters() {
  wait_in_flight();
  auto slices = model_->param_slices();
  const size_t n = slices.size();
  const int world = group_->size();
  // The count goes first so that models of different shapes are reported, not mis-compared.
  const uint64_t count = n;
  std::vector<uint64_t> counts(static_cast<size_t>(world));
  gather_host(&count, counts.data(), sizeof(count));
  for (int r = 0; r < world; ++r)
    CX_CHECK(counts[r] == count, MismatchError, "check_parameters (rank ", group_->rank(), "): rank ", r,
             " has a model with ", counts[r], " parameter tensors, this rank has ", n,
             "; every rank must build the same architecture");
  std::vector<uint64_t> mine(n), all(n * static_cast<size_t>(world));
  for (size_t i = 0; i < n; ++i) mine[i] = fnv1a(model_->flat_params() + slices[i].first, slices[i].second);
  if (n) gather_host(mine.data(), all.data(), n * sizeof(uint64_t));
  std::vector<ParamMismatch> out;
  for (size_t i = 0; i < n; ++i) {
    ParamMismatch m{i, {}};
    for (int r = 1; r < world; ++r)
      if (all[r * n + i] != all[i]) m.ranks.push_back(r);
    if (!m.ranks.empty()) out.push_back(std::move(m));
  }
  return out;
}

std::string DistributedDataParallel::describe(const std::vector<ParamMismatch>& bad) const {
  std::ostringstream os;
  os << "parameters differ across ranks:";
  for (auto& b : bad) {
    os << "\n  parameter " << param_name(*model_, b.param_index) << " differs from rank 0's on ranks [";
    for (size_t i = 0; i < b.ranks.size(); ++i) os << (i ? ", " : "") << b.ranks[i];
    os << "]";
  }
  os << "\nLikely causes: DDPConfig.broadcast_parameters = False with different initial weights, "
        "different random seeds, or parameters changed on one rank outside the optimizer step.";
  return os.str();
}

std::vector<ParamMismatch> DistributedDataParallel::check_parameters(bool raise_on_mismatch) {
  std::vector<ParamMismatch> bad = check_parameters();
  if (bad.empty() || !raise_on_mismatch) return bad;
  CX_THROW(MismatchError, "check_parameters (rank ", rank(), "): ", describe(bad));
}

std::string DistributedDataParallel::parameter_report() {
  if (parameters_agree()) return std::string();
  return describe(check_parameters());
}

}  // namespace cx::train
