#include "train/zero.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"

namespace cx::train {

Shard shard_of(size_t n, int world, int rank) {
  const size_t w = static_cast<size_t>(world), r = static_cast<size_t>(rank);
  const size_t q = n / w;
  return Shard{r * q, r + 1 == w ? n - r * q : q};
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::shared_ptr<DistributedDataParallel> ddp,
                                                 std::shared_ptr<nn::Optimizer> opt)
    : ddp_(std::move(ddp)), opt_(std::move(opt)) {
  CX_CHECK(ddp_ != nullptr, InvalidArgument,
           "ZeroRedundancyOptimizer: ddp is None; wrap the model first: ddp = "
           "cx.distributed.DistributedDataParallel(model)");
  CX_CHECK(opt_ != nullptr, InvalidArgument, "ZeroRedundancyOptimizer: optimizer is None");
  group_ = ddp_->group().get();
  const int world = group_->size(), rank = group_->rank();
  n_ = ddp_->model()->num_parameters();
  CX_CHECK(!ddp_->shard_gradients(), InvalidArgument, "ZeroRedundancyOptimizer (rank ", rank,
           "): this DistributedDataParallel is already sharded by another ZeroRedundancyOptimizer; use that one");
  CX_CHECK(!ddp_->joining(), InvalidArgument, "ZeroRedundancyOptimizer (rank ", rank,
           "): cannot be made inside ddp.join(); a finished rank cannot shadow its collectives");
  q_ = n_ / static_cast<size_t>(world);
  shard_ = shard_of(n_, world, rank);
  const double bucket_bytes = ddp_->config().bucket_size_mb * static_cast<double>(size_t{1} << 20);
  const size_t piece = std::max<size_t>(1, static_cast<size_t>(bucket_bytes) / sizeof(float));
  scratch_.resize(std::min(piece, q_));
  // Take the optimizer's state over: whole (an unsharded run, a checkpoint), or none yet.
  const size_t built = opt_->state_params();
  if (built == n_ && world > 1) {
    load_state_dict(opt_->state_dict());
  } else {
    CX_CHECK(built == 0 || built == shard_.count, InvalidArgument, "ZeroRedundancyOptimizer (rank ", rank,
             "): the optimizer's state was built for ", built, " parameters, but the model has ", n_,
             " (this rank's shard: ", shard_.count, "); use one optimizer per model");
  }
  ddp_->set_shard_gradients(true);
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  try {
    ddp_->set_shard_gradients(false);
  } catch (...) {
    // A poisoned group (waiting for in-flight work); its next user sees the error.
  }
}

bool ZeroRedundancyOptimizer::reduce_scatter_gradients() {
  // nothing new, or sync_gradients() already averaged it all (and checked it: Note [Non-finite gradients])
  if (!ddp_->take_unsynced()) return !ddp_->step_skipped();
  const int world = group_->size();
  float* g = ddp_->model()->flat_grads();
  // Note [Non-finite gradients] in nonfinite.h: the reductions test what they add into `probe` (null: off, or
  // DDP has read the gradients itself).
  distributed::ReduceProbe* probe = ddp_->begin_sharded();
  if (world > 1) {
    float* own = g + shard_.offset;
    std::vector<const float*> ins(static_cast<size_t>(world));
    for (size_t off = 0; off < q_; off += scratch_.size()) {
      const size_t c = std::min(scratch_.size(), q_ - off);
      for (int i = 0; i < world; ++i) ins[static_cast<size_t>(i)] = g + static_cast<size_t>(i) * q_ + off;
      if (probe)  // block i's element j is g[i * q_ + off + j]
        group_->reduce_scatter_probed(ins, scratch_.data(), c, distributed::ReduceOp::kAvg, *probe, off, q_, false);
      else
        group_->reduce_scatter(std::vector<const void*>(ins.begin(), ins.end()), scratch_.data(), c,
                               distributed::DataType::kFloat32, distributed::ReduceOp::kAvg, false);
      std::memcpy(own + off, scratch_.data(), c * sizeof(float));
    }
    const size_t tail = n_ - q_ * static_cast<size_t>(world);  // fewer than world elements
    if (tail && probe) {
      distributed::ReduceProbe t;
      t.blame = probe->blame;
      group_->all_reduce_probed(g + n_ - tail, tail, distributed::ReduceOp::kAvg, t, false);
      for (const auto& b : t.bad) probe->add(b.rank, n_ - tail + b.begin, n_ - tail + b.end);
      probe->result_bad |= t.result_bad;
    } else if (tail) {
      group_->all_reduce(g + n_ - tail, tail, distributed::DataType::kFloat32, distributed::ReduceOp::kAvg, false);
    }
  }
  return ddp_->conclude_sharded(shard_.offset, shard_.count);  // collective: the same answer on every rank
}

void ZeroRedundancyOptimizer::all_gather_shards(const float* mine, float* out) {
  const int world = group_->size();
  std::vector<void*> outs(static_cast<size_t>(world));
  for (int i = 0; i < world; ++i) outs[static_cast<size_t>(i)] = out + static_cast<size_t>(i) * q_;
  if (world > 1 && q_) group_->all_gather(mine, outs, q_, distributed::DataType::kFloat32, false);
  else if (mine != out) std::memcpy(out + shard_.offset, mine, shard_.count * sizeof(float));
  const size_t tail = n_ - q_ * static_cast<size_t>(world);
  if (world > 1 && tail) {
    if (group_->rank() == world - 1) std::memmove(out + n_ - tail, mine + q_, tail * sizeof(float));
    group_->broadcast(out + n_ - tail, tail, distributed::DataType::kFloat32, world - 1, false);
  }
}

void ZeroRedundancyOptimizer::all_gather_parameters() {
  float* p = ddp_->model()->flat_params();
  all_gather_shards(p + shard_.offset, p);  // block i is rank i's shard, in place
}

void ZeroRedundancyOptimizer::step(const GradClip& clip) {
  const int rank = group_->rank();
  CX_CHECK(ddp_->shard_gradients(), InvalidArgument, "ZeroRedundancyOptimizer.step (rank ", rank,
           "): its DistributedDataParallel is no longer sharded");
  CX_CHECK(ddp_->model()->num_parameters() == n_, InvalidArgument, "ZeroRedundancyOptimizer.step (rank ", rank,
           "): the model changed after the optimizer was wrapped (", n_, " parameters then, ",
           ddp_->model()->num_parameters(), " now)");
  if (!reduce_scatter_gradients()) {  // DDPConfig.nonfinite = "skip": not taken, on every rank alike
    ddp_->clear_skip();
    ddp_->model()->zero_grad();
    return;
  }
  float* p = ddp_->model()->flat_params();
  float* g = ddp_->model()->flat_grads();
  if (clip.on()) clip_gradients(g + shard_.offset, shard_.count, clip, group_, rank);
  opt_->step(p + shard_.offset, g + shard_.offset, shard_.count);
  all_gather_parameters();
  ddp_->model()->zero_grad();
}

nn::StateDict whole_state(const nn::Optimizer& opt, size_t n, Shard shard, const std::string& who,
                          const std::function<void(const float*, float*)>& gather) {
  nn::StateDict sd = opt.state_dict();
  // The same arrays on every rank (the same steps and hyper-parameters), by name: a rank whose shard
  // is empty (fewer parameters than ranks) holds them empty, and state_dict() leaves empty ones out.
  if (opt.steps() > 0) {
    for (const std::string& name : opt.state_array_names()) sd.arrays.try_emplace(name);
  }
  for (auto& [name, arr] : sd.arrays) {
    CX_CHECK(arr.size() == shard.count, InvalidArgument, who, ": state '", name, "' holds ", arr.size(),
             " floats, not this rank's shard of ", shard.count, "; was the optimizer stepped outside the wrapper?");
    std::vector<float> full(n);
    gather(arr.data(), full.data());
    arr.swap(full);
  }
  return sd;
}

nn::StateDict shard_state(const nn::StateDict& full, size_t n, Shard shard, const std::string& who) {
  nn::StateDict mine = full;
  for (auto& [name, arr] : mine.arrays) {
    CX_CHECK(arr.size() == n, InvalidArgument, who, ": state '", name, "' holds ", arr.size(),
             " floats but the model has ", n, " parameters; load a whole state (state_dict() of a "
             "ZeroRedundancyOptimizer or of an unsharded optimizer of the same model)");
    arr = std::vector<float>(arr.begin() + static_cast<std::ptrdiff_t>(shard.offset),
                             arr.begin() + static_cast<std::ptrdiff_t>(shard.offset + shard.count));
  }
  return mine;
}

nn::StateDict ZeroRedundancyOptimizer::state_dict() {
  return whole_state(*opt_, n_, shard_,
                     detail::concat("ZeroRedundancyOptimizer.state_dict (rank ", group_->rank(), ")"),
                     [this](const float* mine, float* out) { all_gather_shards(mine, out); });
}

void ZeroRedundancyOptimizer::load_state_dict(const nn::StateDict& full) {
  opt_->load_state_dict(
      shard_state(full, n_, shard_, detail::concat("ZeroRedundancyOptimizer.load_state_dict (rank ", group_->rank(),
                                                   ")")));
}

}  // namespace cx::train
