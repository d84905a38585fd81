#include "train/nonfinite.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <sstream>

#include "common/error.h"
#include "nn/kernels.h"

namespace cx::train {

using nn::kernels::kNonFiniteBits;

NonFiniteMode parse_nonfinite(const std::string& name, const std::string& who) {
  std::string s;
  for (char c : name) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (s == "raise") return NonFiniteMode::kRaise;
  if (s == "skip") return NonFiniteMode::kSkip;
  if (s == "warn") return NonFiniteMode::kWarn;
  if (s == "off") return NonFiniteMode::kOff;
  CX_THROW(InvalidArgument, who, ": unknown value '", name,
           "'; choose 'raise' (NonFiniteError on every rank, the default), 'skip' (the optimizer step is not taken, "
           "on every rank alike), 'warn' (a RuntimeWarning, the step is taken) or 'off' (no check)");
}

const char* nonfinite_name(NonFiniteMode m) {
  switch (m) {
    case NonFiniteMode::kSkip: return "skip";
    case NonFiniteMode::kWarn: return "warn";
    case NonFiniteMode::kOff: return "off";
    case NonFiniteMode::kRaise: break;
  }
  return "raise";
}

std::string param_name(const nn::SequentialModel& m, size_t i) {
  auto [mi, pi] = m.param_owners().at(i);
  std::ostringstream os;
  os << i << " (layer " << mi << " " << m.module(mi)->type_name() << "." << m.module(mi)->param_specs()[pi].name
     << ")";
  return os.str();
}

NonFiniteCheck::NonFiniteCheck(std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets, int world,
                               int rank)
    : model_(std::move(model)), buckets_(std::move(buckets)), world_(world), rank_(rank) {
  own_bits_.assign(buckets_.size(), 0);
  probes_.resize(buckets_.size());
  reduced_.assign(buckets_.size(), 0);
  checked_bad_.assign(buckets_.size(), 0);
}

// Note [A bucket reduced twice]
// In the first cycle of gradient accumulation DDP does not yet know how many
// backwards make a step, so it reduces after each (Note [Accumulation] in
// ddp.h) and the next backward adds into the average. If that average was
// already not finite, every rank's buffer holds its NaN, and reading it as
// "own contribution" would blame every rank. So before a backward adds into
// buckets reduced since the last backward, each rank reads them (the same
// bytes on every rank, hence the same finding, with no message): a bucket whose
// average was bad does not blame anyone at its later reductions (the earlier
// reduction named whoever sent the NaN; its result is still tested). This read
// happens only when a bucket is reduced twice in a step, i.e. in the first
// accumulation cycle, never in the steady state.
void NonFiniteCheck::before_accumulating(const float* g) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!reduced_[b]) continue;
    reduced_[b] = 0;
    if (!checked_bad_[b] && nn::kernels::max_abs_bits(g + buckets_[b].offset, buckets_[b].count) >= kNonFiniteBits)
      checked_bad_[b] = 1;
  }
}

distributed::ReduceProbe& NonFiniteCheck::probe(size_t b) {
  reduced_[b] = 1;
  probes_[b].blame = !checked_bad_[b];
  return probes_[b];
}

std::vector<std::pair<size_t, size_t>> NonFiniteCheck::count_params(const float* g, size_t first, size_t last,
                                                                    size_t lo, size_t hi) const {
  std::vector<std::pair<size_t, size_t>> out;
  const auto slices = model_->param_slices();
  for (size_t i = first; i <= last && i < slices.size(); ++i) {
    const size_t a = std::max(slices[i].first, lo), b = std::min(slices[i].first + slices[i].second, hi);
    if (a >= b) continue;
    const size_t c = nn::kernels::count_nonfinite(g + a, b - a);
    if (c) out.emplace_back(i, c);
  }
  return out;
}

void NonFiniteCheck::scan(size_t b, const float* g) {
  reduced_[b] = 1;
  if (checked_bad_[b]) return;  // Note [A bucket reduced twice]: decide() reads it
  const Bucket& bk = buckets_[b];
  const uint32_t bits = nn::kernels::max_abs_bits(g + bk.offset, bk.count);
  if (bits >= kNonFiniteBits) {  // rare: which parameters (a bucket reduced twice in a step is counted once)
    for (auto& pc : count_params(g, bk.first_param, bk.last_param, 0, static_cast<size_t>(-1))) {
      auto it = std::find_if(own_.begin(), own_.end(), [&](auto& o) { return o.first == pc.first; });
      if (it == own_.end()) own_.push_back(pc);
    }
  }
  own_bits_[b] = std::max(own_bits_[b], bits);
}

void NonFiniteCheck::scan_all(const float* g) {
  for (size_t b = 0; b < buckets_.size(); ++b) scan(b, g);
}

std::vector<double>& NonFiniteCheck::pack(const float* g, size_t shard_offset, size_t shard_count, bool shard) {
  const size_t w = static_cast<size_t>(world_), nb = buckets_.size();
  msg_.assign(w + 2 * nb + (shard ? model_->param_slices().size() : 0), 0.0);
  size_t bad = 0;
  for (size_t b = 0; b < nb; ++b) {
    const uint32_t bits = own_bits_[b];
    if (bits >= kNonFiniteBits) {
      ++bad;
      msg_[w + b] = 1.0;
    } else {
      float m;
      std::memcpy(&m, &bits, sizeof m);
      msg_[w + nb + b] = m;
    }
  }
  msg_[static_cast<size_t>(rank_)] = static_cast<double>(bad);
  if (shard && shard_count) {
    const uint32_t bits = nn::kernels::max_abs_bits(g + shard_offset, shard_count);
    if (bits >= kNonFiniteBits)
      for (auto [i, c] : count_params(g, 0, model_->param_slices().size() - 1, shard_offset,
                                      shard_offset + shard_count))
        msg_[w + 2 * nb + i] = static_cast<double>(c);
  }
  return msg_;
}

void NonFiniteCheck::reset() {
  std::fill(own_bits_.begin(), own_bits_.end(), 0u);
  own_.clear();
  for (auto& p : probes_) p.clear();
  std::fill(reduced_.begin(), reduced_.end(), 0);
  std::fill(checked_bad_.begin(), checked_bad_.end(), 0);
}

bool NonFiniteCheck::pack_fused(double* msg) {
  const size_t w = static_cast<size_t>(world_);
  std::fill(msg, msg + fused_size(), 0.0);
  std::vector<char> seen(w, 0);
  summed_ = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (const auto& bad : probes_[b].bad) seen[static_cast<size_t>(bad.rank)] = 1;
    if (probes_[b].result_bad) msg[w + b] = 1.0;
    if (probes_[b].local_only) summed_ = true;  // the same on every rank: the algorithms are
  }
  for (size_t r = 0; r < w; ++r) msg[r] = seen[r];
  return summed_;
}

NonFiniteVerdict NonFiniteCheck::decide_fused(const double* msg, const float* g, distributed::ProcessGroup& group) {
  NonFiniteVerdict v;
  const size_t w = static_cast<size_t>(world_), nb = buckets_.size();
  // Without the message (summed_ false), the result flags are every rank's already
  // and whom to blame comes from the counts below, as it does with it.
  bool blamed = false;
  for (int r = 0; summed_ && r < world_; ++r) blamed |= msg[static_cast<size_t>(r)] > 0.5;
  for (size_t b = 0; b < nb; ++b) {
    if (!(msg[w + b] > 0.5) && !checked_bad_[b]) continue;  // every part of it finished finite
    const Bucket& bk = buckets_[b];
    for (auto& pc : count_params(g, bk.first_param, bk.last_param, 0, static_cast<size_t>(-1)))
      v.params.push_back(pc);
  }
  std::sort(v.params.begin(), v.params.end());
  v.bad = !v.params.empty();
  if (v.bad || blamed) {
    // Rare: each rank's own non-finite values per parameter, from the ranges
    // the probes recorded (each element by exactly one rank).
    const auto slices = model_->param_slices();
    const size_t np = slices.size();
    std::vector<double> counts(w * np, 0.0);
    for (size_t b = 0; b < nb; ++b) {
      const Bucket& bk = buckets_[b];
      for (const auto& bad : probes_[b].bad) {
        const size_t lo = bk.offset + bad.begin, hi = bk.offset + bad.end;
        for (size_t i = bk.first_param; i <= bk.last_param && i < np; ++i) {
          const size_t a = std::max(slices[i].first, lo), e = std::min(slices[i].first + slices[i].second, hi);
          if (a < e) counts[static_cast<size_t>(bad.rank) * np + i] += static_cast<double>(e - a);
        }
      }
    }
    agree_on_counts(counts, np, group, v);
  }
  reset();
  return v;
}

void NonFiniteCheck::count_ranges(const std::vector<distributed::BadValues>& bad, size_t offset,
                                  std::vector<double>& counts) const {
  const auto slices = model_->param_slices();
  const size_t np = slices.size();
  for (const auto& b : bad) {
    const size_t lo = offset + b.begin, hi = offset + b.end;
    // The first parameter ending after lo (slices are in order), then on while they start before hi.
    size_t i = static_cast<size_t>(std::upper_bound(slices.begin(), slices.end(), lo,
                                                    [](size_t x, const auto& s) { return x < s.first + s.second; }) -
                                   slices.begin());
    for (; i < np && slices[i].first < hi; ++i) {
      const size_t a = std::max(slices[i].first, lo), e = std::min(slices[i].first + slices[i].second, hi);
      if (a < e) counts[static_cast<size_t>(b.rank) * np + i] += static_cast<double>(e - a);
    }
  }
}

distributed::ReduceProbe& NonFiniteCheck::shard_probe() {
  shard_probe_.clear();
  shard_probe_.blame = true;  // under ZeRO-1 backward reduces nothing: the buffer is this rank's own
  return shard_probe_;
}

// Sums `counts` over the ranks (row r, np counts per parameter: rank r's own values found not finite; further
// rows are the caller's) and reads into `v` this rank's own bad parameters and the ranks with any.
void NonFiniteCheck::agree_on_counts(std::vector<double>& counts, size_t np, distributed::ProcessGroup& group,
                                     NonFiniteVerdict& v) const {
  if (world_ > 1 && !counts.empty())
    group.all_reduce(counts.data(), counts.size(), distributed::DataType::kFloat64, distributed::ReduceOp::kSum,
                     false);
  for (size_t i = 0; i < np; ++i) {
    const double c = counts[static_cast<size_t>(rank_) * np + i];
    if (c > 0.5) v.own.emplace_back(i, static_cast<size_t>(c + 0.5));
  }
  for (int r = 0; r < world_; ++r)
    if (std::any_of(counts.begin() + static_cast<std::ptrdiff_t>(r * np),
                    counts.begin() + static_cast<std::ptrdiff_t>((r + 1) * np), [](double c) { return c > 0.5; }))
      v.ranks.push_back(r);
}

// Note [Fused non-finite check] under ZeRO-1: each rank finishes only its shard,
// so, unlike the all_reduce's ring, no rank knows the whole verdict: the small
// message always travels (world + 1 float64s in place of the scan path's
// world + 2 * buckets + parameters).
NonFiniteVerdict NonFiniteCheck::decide_sharded(const float* g, size_t shard_offset, size_t shard_count,
                                                distributed::ProcessGroup& group) {
  NonFiniteVerdict v;
  const size_t w = static_cast<size_t>(world_);
  std::vector<double> msg(w + 1, 0.0);
  for (const auto& b : shard_probe_.bad) msg[static_cast<size_t>(b.rank)] = 1.0;
  msg[w] = shard_probe_.result_bad ? 1.0 : 0.0;
  if (world_ > 1)
    group.all_reduce(msg.data(), msg.size(), distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  const bool bad = msg[w] > 0.5;
  const bool blamed = std::any_of(msg.begin(), msg.begin() + static_cast<std::ptrdiff_t>(w),
                                  [](double c) { return c > 0.5; });
  if (bad || blamed) {  // rare: rows 0..world-1, what each rank sent; row world, the average (by shards)
    const size_t np = model_->param_slices().size();
    std::vector<double> counts((w + 1) * np, 0.0);
    count_ranges(shard_probe_.bad, 0, counts);
    if (shard_count && np)
      for (auto [i, c] : count_params(g, 0, np - 1, shard_offset, shard_offset + shard_count))
        counts[w * np + i] = static_cast<double>(c);
    agree_on_counts(counts, np, group, v);
    for (size_t i = 0; i < np; ++i)
      if (counts[w * np + i] > 0.5) v.params.emplace_back(i, static_cast<size_t>(counts[w * np + i] + 0.5));
  }
  v.bad = !v.params.empty();
  shard_probe_.clear();
  reset();
  return v;
}

NonFiniteVerdict NonFiniteCheck::decide(const float* g, double limit, bool shard) {
  NonFiniteVerdict v;
  const size_t w = static_cast<size_t>(world_), nb = buckets_.size();
  for (int r = 0; r < world_; ++r)
    if (msg_[static_cast<size_t>(r)] > 0.5) v.ranks.push_back(r);
  if (shard) {
    for (size_t i = 0; w + 2 * nb + i < msg_.size(); ++i)
      if (msg_[w + 2 * nb + i] > 0.5) v.params.emplace_back(i, static_cast<size_t>(msg_[w + 2 * nb + i] + 0.5));
  } else {
    for (size_t b = 0; b < nb; ++b) {
      if (!(msg_[w + b] > 0.5 || msg_[w + nb + b] >= limit || checked_bad_[b]))
        continue;  // provably finite after the average
      const Bucket& bk = buckets_[b];
      if (nn::kernels::max_abs_bits(g + bk.offset, bk.count) < kNonFiniteBits) continue;
      for (auto& pc : count_params(g, bk.first_param, bk.last_param, 0, static_cast<size_t>(-1)))
        v.params.push_back(pc);
    }
    std::sort(v.params.begin(), v.params.end());
  }
  v.bad = !v.params.empty();
  v.own = own_;
  std::sort(v.own.begin(), v.own.end());
  reset();
  return v;
}

NonFiniteVerdict NonFiniteCheck::decide_local(const float* g) {
  NonFiniteVerdict v;
  v.ranks_known = false;
  const size_t n = model_->num_parameters();
  if (nn::kernels::max_abs_bits(g, n) >= kNonFiniteBits)
    v.params = count_params(g, 0, model_->param_slices().size() - 1, 0, n);
  v.bad = !v.params.empty();
  v.own = own_;
  std::sort(v.own.begin(), v.own.end());
  reset();
  return v;
}

void NonFiniteCheck::name_ranks(NonFiniteVerdict& v, distributed::ProcessGroup& group) {
  std::vector<double> bad(static_cast<size_t>(world_), 0.0);
  bad[static_cast<size_t>(rank_)] = static_cast<double>(v.own.size());
  if (world_ > 1)
    group.all_reduce(bad.data(), bad.size(), distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  v.ranks.clear();
  for (int r = 0; r < world_; ++r)
    if (bad[static_cast<size_t>(r)] > 0.5) v.ranks.push_back(r);
  v.ranks_known = true;
}

namespace {
std::string list_params(const nn::SequentialModel& m, const std::vector<std::pair<size_t, size_t>>& ps) {
  std::ostringstream os;
  for (size_t k = 0; k < ps.size() && k < 10; ++k)
    os << (k ? ", " : "") << param_name(m, ps[k].first) << ": " << ps[k].second << " of "
       << m.param_slices()[ps[k].first].second << " values";
  if (ps.size() > 10) os << ", ... (" << ps.size() << " tensors)";
  return os.str();
}
}  // namespace

std::string NonFiniteCheck::describe(const NonFiniteVerdict& v, const std::string& who, uint64_t step, bool fp16,
                                     const std::string& outcome) const {
  std::ostringstream os;
  const int over = v.averaged_over > 0 ? v.averaged_over : world_;
  os << who << ": step " << step << ": the gradient averaged over the " << over
     << (over == 1 ? " rank" : " ranks") << " is not finite (NaN or inf) in parameters ["
     << list_params(*model_, v.params) << "]. ";
  if (!v.ranks_known) {
    os << "Inside join() the ranks whose own gradient was bad are not compared; ";
  } else if (v.ranks.empty()) {
    if (fp16)
      os << "Every rank's own gradient was finite: the fp16 communication hook overflowed (the gradients, divided "
            "by the world size, exceed float16's range of 65504). Use comm_hook = 'bf16' (float32's range), or "
            "scale the loss down. ";
    else
      os << "Every rank's own gradient was finite: their sum overflowed float32. ";
  } else {
    os << "The ranks whose own gradient was already not finite: [";
    for (size_t k = 0; k < v.ranks.size(); ++k) os << (k ? ", " : "") << v.ranks[k];
    os << "]. ";
  }
  if (v.own.empty())
    os << "This rank's own gradient was finite. ";
  else
    os << "This rank's own gradient was not finite in [" << list_params(*model_, v.own) << "]. ";
  os << outcome;
  return os.str();
}

}  // namespace cx::train
