#include "train/comm_hooks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <exception>

#include "common/error.h"
#include "nn/blas.h"
#include "nn/kernels.h"
#include "nn/rng.h"

namespace cx::train {

using distributed::DataType;
using distributed::ProcessGroup;
using distributed::ReduceOp;

CommHookKind parse_comm_hook(const std::string& name, const std::string& who) {
  std::string s;
  for (char c : name) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (s.empty() || s == "none") return CommHookKind::kNone;
  if (s == "fp16") return CommHookKind::kFp16;
  if (s == "bf16") return CommHookKind::kBf16;
  if (s == "powersgd") return CommHookKind::kPowerSgd;
  CX_THROW(InvalidArgument, who, ": unknown communication hook '", name,
           "'; choose one of 'none' (float32 all-reduce), 'fp16', 'bf16' or 'powersgd'");
}

const char* comm_hook_name(CommHookKind k) {
  switch (k) {
    case CommHookKind::kFp16: return "fp16";
    case CommHookKind::kBf16: return "bf16";
    case CommHookKind::kPowerSgd: return "powersgd";
    case CommHookKind::kNone: break;
  }
  return "none";
}

void check_powersgd_config(const PowerSGDConfig& c, const std::string& who) {
  CX_CHECK(c.matrix_approximation_rank >= 1, InvalidArgument, who,
           ": PowerSGD matrix_approximation_rank must be >= 1 (the rank of each gradient's approximation), got ",
           c.matrix_approximation_rank);
  CX_CHECK(c.start_powerSGD_iter >= 0, InvalidArgument, who,
           ": PowerSGD start_powerSGD_iter must be >= 0 (steps of uncompressed all-reduce first), got ",
           c.start_powerSGD_iter);
  CX_CHECK(c.min_compression_rate >= 0.0 && std::isfinite(c.min_compression_rate), InvalidArgument, who,
           ": PowerSGD min_compression_rate must be a finite number >= 0, got ", c.min_compression_rate);
}

namespace {

// Waits for every work, then rethrows the first failure (the group is poisoned
// by then, so the others fail too; none is left running on our buffers).
class FirstError {
 public:
  // Waits for w; false (and remembers why) if it failed or an earlier one did.
  bool wait(const ProcessGroup::WorkPtr& w) {
    if (!w) return !err_;
    try {
      w->wait();
    } catch (...) {
      if (!err_) err_ = std::current_exception();
    }
    return !err_;
  }
  bool failed() const { return static_cast<bool>(err_); }
  void rethrow() {
    if (err_) std::rethrow_exception(err_);
  }

 private:
  std::exception_ptr err_;
};

// ---- fp16 / bf16 -----------------------------------------------------------------------------

// Note [Half-precision buckets]
// launch(b) queues a SUM all-reduce of the bucket's float32 gradients, each
// multiplied by 1/world and rounded to the 16-bit type, which travels in a
// 16-bit scratch half the bucket's size and is widened back into the gradient
// slice; finish() waits for the buckets. The 1/world is applied before the
// all-reduce, in the same step as the cast, for
// two reasons: float16 tops out at 65504, and a SUM of N gradients near that
// would overflow to inf while their average would not (a SUM of values each at
// most max/N cannot overflow; this is also what PyTorch's fp16 hook does); and
// the cast back then is a pure widening, exact and one pass, with no divide.
// The price is range at the small end: float16 keeps 10 bits down to 6e-5 and
// flushes below 6e-8, so a gradient that small divided by N loses bits. bfloat16
// has float32's range, so neither overflow nor underflow changes; it takes the
// same path for one code path and the exact cast back. The element-wise sums in
// the ring round to the 16-bit type after every addition (reduction_kernels.h),
// so the result is the float32 average within about (N+1) units of the type's
// rounding of the mean of |g| (tests/test_comm_hooks.py checks that bound).
// Bytes on the wire are half of float32's. The casts are not passes of their
// own: they ride in the ring, chunk by chunk, where the ring touches the data
// anyway (ProcessGroup::all_reduce_cast, Note [Cast on the wire] in
// distributed/algorithms/allreduce.cpp), on the communication thread, so the
// backward pass that launched the bucket does not wait for them either. DDP's
// non-finite check rides in them too (launch's probe: Note [Non-finite gradients]
// in nonfinite.h): a compare per eight lanes of what they narrow and widen.

class HalfHook : public CommHook {
 public:
  HalfHook(CommHookKind kind, std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets,
           ProcessGroup& group)
      : kind_(kind), model_(std::move(model)), buckets_(std::move(buckets)), group_(group) {
    scratch_.resize(model_->num_parameters());
  }

  void launch(size_t b, distributed::ReduceProbe* probe) override {
    const Bucket& bk = buckets_[b];
    if (!bk.count) return;
    const float scale = 1.0f / static_cast<float>(group_.size());
    const DataType dt = kind_ == CommHookKind::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
    pending_.push_back(group_.all_reduce_cast(model_->flat_grads() + bk.offset, scratch_.data() + bk.offset,
                                              bk.count, dt, scale, true, probe));
  }
  bool probes() const override { return true; }

  void finish() override {
    std::vector<ProcessGroup::WorkPtr> todo;
    todo.swap(pending_);
    FirstError err;
    for (auto& w : todo) err.wait(w);
    err.rethrow();
  }

  bool busy() const override { return !pending_.empty(); }
  CommHookKind kind() const override { return kind_; }

 private:
  CommHookKind kind_;
  std::shared_ptr<nn::SequentialModel> model_;
  std::vector<Bucket> buckets_;
  ProcessGroup& group_;
  std::vector<uint16_t> scratch_;  // one 16-bit slot per gradient element; bucket b uses its own range
  std::vector<ProcessGroup::WorkPtr> pending_;
};

// ---- PowerSGD --------------------------------------------------------------------------------

// Note [PowerSGD]
// For every matrix gradient M (n x m, a Linear weight: rows are outputs) that
// is worth compressing (n*m >= min_compression_rate * (n+m)*r), one step of
// the power iteration of Vogels et al. (Algorithm 2), with error feedback
// (their Algorithm 1):
//   D  = M + e                     e: this rank's residual from the last step
//   P  = D Q;  P <- mean over ranks (all-reduce);  P^ = orthonormalise(P)
//   Ql = D^T P^                    this rank's Q
//   e  = D - P^ Ql^T               what this rank's own approximation drops
//   Q  = mean over ranks of Ql (all-reduce);   M <- P^ Q^T = P^ P^^T mean(D)
// Q is kept for the next step (warm start; with warm_start off a fresh random
// Q every step), seeded identically on every rank, so P^ is the same
// everywhere. The residual is the paper's (what the local decompression of
// this rank's D loses), and the mean of the residuals is exactly what the
// applied update misses of mean(D), so over steps nothing is lost, only
// delayed. At full rank (r = min(n, m)) and P of full rank, P^ P^^T mean(D) =
// mean(D): the result is the plain average within float32 rounding (the
// orthonormalisation is done in float64, twice over, so it adds none to speak
// of). Vectors (biases), matrices below the compression rate and every tensor
// of the first start_powerSGD_iter steps (PyTorch's default, 1000: compression
// works best once the gradients' directions have settled) are all-reduced
// uncompressed, as float32 AVG, with no residual. A bucket's uncompressed
// tensors travel packed together with its P's in one all-reduce, and its Q's
// in a second.
//
// Note [Where hooks compute]
// The hooks compute on the thread running DDP (backward's or sync_gradients'),
// never on the group's one communication thread: that thread runs the
// collectives of every bucket in order, and a GEMM there would hold back the
// later buckets' all-reduces (and the half-precision casts are cheaper than the
// bytes they save). PowerSGD's step is split at its first all-reduce: launch(b),
// called in backward as soon as the bucket's gradients are final, adds the
// residual, computes P = D Q (a GEMM r/batch the size of the layer's own
// weight-gradient GEMM) and queues the first all-reduce; backward goes on while
// it travels. finish() (in sync_gradients, or before the next backward writes
// the buffer) orthonormalises P, computes Q and the residual, and queues the Q
// all-reduce of every launched bucket before it waits for the first of them,
// so those travel while it decompresses. Which buckets are launched and finished
// when is the same on every rank (Note [Overlap] in ddp.h), and so is the order
// of collectives.
//
// Note [PowerSGD and accumulation]
// AVG is linear, so plain DDP may reduce a bucket several times in one step
// (Note [Accumulation] in ddp.h). PowerSGD is not: a bucket reduced twice in a
// step is compressed twice, the second time with the first result inside it.
// Nothing is lost (each compression's residual is fed into the next), but the
// step is no longer the one a single reduction would make. Under no_sync()
// every bucket is reduced once per step; the guide's pattern (backward k times,
// then sync_gradients) reduces more than once in its first cycle only, after
// which DDP has learned k. The iteration count (for start_powerSGD_iter)
// advances once per sync_gradients that reduced something.

// Note [PowerSGD and non-finite values]
// One NaN or inf in a rank's gradient would otherwise live on in PowerSGD's
// state: in that rank's residual (added to every later gradient) and, through
// the average, in Q (warm start: the next step's power iteration starts from
// it, on every rank). So a step never hands such values on:
//   - the loop that adds the residual to the gradient also takes the largest
//     |D| as bits (Note [Finding non-finite values by their bits] in
//     nn/kernels.cpp): no extra pass. If this rank's D held inf/NaN, the
//     residual it leaves for the matrix is zero. (P^ is always finite:
//     orthonormalise zeroes a column it cannot normalise; so with a finite D,
//     Ql and the residual are finite.)
//   - after the Q all-reduce each bucket's Q (m*r floats per matrix, small) is
//     checked; the average is the same on every rank, so every rank finds the
//     same and re-draws that bucket's Q from the seed, as at the start.
// And when DDP's check (DDPConfig.nonfinite other than "off") finds the step's
// averaged gradient not finite, reset_nonfinite() zeroes every residual and
// re-draws every Q on every rank. tests/test_comm_hooks.py injects a NaN and
// checks the state after the step.

// Orthonormalises the r columns of the n x r row-major matrix p in place:
// modified Gram-Schmidt in float64, run twice (one pass leaves an error of
// cond(P) times the rounding; the second removes it). A column that is
// numerically zero after projection becomes zero: it spans nothing.
void orthonormalise(float* p, int n, int r, std::vector<double>& tmp) {
  tmp.resize(static_cast<size_t>(n) * r);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < r; ++j) tmp[static_cast<size_t>(j) * n + i] = p[static_cast<size_t>(i) * r + j];
  std::vector<double> first_norm(r, 0.0);
  for (int pass = 0; pass < 2; ++pass) {
    for (int j = 0; j < r; ++j) {
      double* cj = tmp.data() + static_cast<size_t>(j) * n;
      for (int k = 0; k < j; ++k) {
        const double* ck = tmp.data() + static_cast<size_t>(k) * n;
        double d = 0;
        for (int i = 0; i < n; ++i) d += ck[i] * cj[i];
        for (int i = 0; i < n; ++i) cj[i] -= d * ck[i];
      }
      double s = 0;
      for (int i = 0; i < n; ++i) s += cj[i] * cj[i];
      const double norm = std::sqrt(s);
      if (pass == 0) first_norm[j] = norm;
      if (!(norm > 0.0) || !std::isfinite(norm)) {
        std::fill(cj, cj + n, 0.0);
        continue;
      }
      for (int i = 0; i < n; ++i) cj[i] /= norm;
    }
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < r; ++j) p[static_cast<size_t>(i) * r + j] = static_cast<float>(tmp[static_cast<size_t>(j) * n + i]);
}

constexpr double kTwoPi = 6.283185307179586;

class PowerSgdHook : public CommHook {
 public:
  PowerSgdHook(const PowerSGDConfig& cfg, std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets,
               ProcessGroup& group)
      : cfg_(cfg), model_(std::move(model)), buckets_(std::move(buckets)), group_(group) {
    plan();
  }

  void launch(size_t b, distributed::ReduceProbe*) override {  // DDP reads the bucket itself
    const Bucket& bk = buckets_[b];
    if (!bk.count) return;
    float* g = model_->flat_grads();
    if (iteration_ < cfg_.start_powerSGD_iter) {
      pending_.push_back({b, false, group_.all_reduce(g + bk.offset, bk.count, DataType::kFloat32, ReduceOp::kAvg,
                                                      true), nullptr});
      return;
    }
    Plan& pl = plans_[b];
    if (!cfg_.warm_start) {
      init_q(pl);
    } else if (!q_ready_) {
      for (auto& each : plans_) init_q(each);
      q_ready_ = true;
    }
    float* buf = pl.buf.data();
    size_t at = 0;
    for (auto [off, n] : pl.plain) {
      std::memcpy(buf + at, g + off, n * sizeof(float));
      at += n;
    }
    for (const Matrix& mx : pl.mats) {
      float* d = g + mx.offset;
      const size_t nm = static_cast<size_t>(mx.n) * mx.m;
      if (cfg_.use_error_feedback) {  // Note [PowerSGD and non-finite values]: the check rides in the add
        const float* e = error_.data() + mx.err_off;
        uint32_t bits = 0;
        for (size_t i = 0; i < nm; ++i) {
          d[i] += e[i];
          uint32_t bi;
          std::memcpy(&bi, d + i, sizeof bi);
          bi &= 0x7fffffffu;
          bits = bits > bi ? bits : bi;
        }
        bad_d_[&mx - pl.mats.data() + pl.mat_begin] = bits >= nn::kernels::kNonFiniteBits;
      }
      nn::gemm(false, false, mx.n, mx.r, mx.m, 1.0f, d, mx.m, q_.data() + mx.q_off, mx.r, 0.0f,
               buf + pl.plain_count + mx.p_off, mx.r);
    }
    pending_.push_back({b, true,
                        group_.all_reduce(buf, pl.buf.size(), DataType::kFloat32, ReduceOp::kAvg, true), nullptr});
  }

  void finish() override {
    std::vector<Pending> todo;
    todo.swap(pending_);
    FirstError err;
    float* g = model_->flat_grads();
    // Stage 1: P arrived; Q and the residual, and the Q all-reduces queued.
    for (auto& p : todo) {
      if (!err.wait(p.first) || !p.compressed) continue;
      Plan& pl = plans_[p.bucket];
      const float* buf = pl.buf.data();
      size_t at = 0;
      for (auto [off, n] : pl.plain) {
        std::memcpy(g + off, buf + at, n * sizeof(float));
        at += n;
      }
      for (const Matrix& mx : pl.mats) {
        float* ph = pl.buf.data() + pl.plain_count + mx.p_off;
        orthonormalise(ph, mx.n, mx.r, tmp_);
        const float* d = g + mx.offset;
        float* ql = q_.data() + mx.q_off;
        nn::gemm(true, false, mx.m, mx.r, mx.n, 1.0f, d, mx.m, ph, mx.r, 0.0f, ql, mx.r);
        if (cfg_.use_error_feedback) {
          float* e = error_.data() + mx.err_off;
          if (bad_d_[&mx - pl.mats.data() + pl.mat_begin]) {  // Note [PowerSGD and non-finite values]
            std::fill(e, e + static_cast<size_t>(mx.n) * mx.m, 0.0f);
          } else {
            std::memcpy(e, d, static_cast<size_t>(mx.n) * mx.m * sizeof(float));
            nn::gemm(false, true, mx.n, mx.m, mx.r, -1.0f, ph, mx.r, ql, mx.r, 1.0f, e, mx.m);
          }
        }
      }
      if (pl.q_count)
        p.second = group_.all_reduce(q_.data() + pl.q_begin, pl.q_count, DataType::kFloat32, ReduceOp::kAvg, true);
    }
    // Stage 2: Q arrived; M = P^ Q^T.
    for (auto& p : todo) {
      if (!p.compressed || !err.wait(p.second)) continue;
      Plan& pl = plans_[p.bucket];
      for (const Matrix& mx : pl.mats)
        nn::gemm(false, true, mx.n, mx.m, mx.r, 1.0f, pl.buf.data() + pl.plain_count + mx.p_off, mx.r,
                 q_.data() + mx.q_off, mx.r, 0.0f, g + mx.offset, mx.m);
      // Note [PowerSGD and non-finite values]: the same Q on every rank, so the same decision.
      if (pl.q_count && nn::kernels::max_abs_bits(q_.data() + pl.q_begin, pl.q_count) >= nn::kernels::kNonFiniteBits)
        init_q(pl);
    }
    err.rethrow();
  }

  bool busy() const override { return !pending_.empty(); }

  void end_step() override { ++iteration_; }

  void reset_nonfinite() override {  // Note [PowerSGD and non-finite values]
    std::fill(error_.begin(), error_.end(), 0.0f);
    q_ready_ = false;
  }

  CommHookKind kind() const override { return CommHookKind::kPowerSgd; }

  CommHookState state() const override {
    CommHookState s;
    s.iteration = iteration_;
    if (q_ready_) s.q = q_;
    s.error = error_;
    return s;
  }

  void set_state(const CommHookState& s) override {
    CX_CHECK(s.iteration >= 0, InvalidArgument, "PowerSGD state: iteration must be >= 0, got ", s.iteration);
    CX_CHECK(s.q.empty() || s.q.size() == q_.size(), InvalidArgument, "PowerSGD state: ", s.q.size(),
             " values of Q, but this model and matrix_approximation_rank need ", q_.size(),
             "; restore it into the same architecture with the same PowerSGD options");
    CX_CHECK(s.error.empty() || s.error.size() == error_.size(), InvalidArgument, "PowerSGD state: ",
             s.error.size(), " error-feedback values, but this model and its PowerSGD options need ", error_.size(),
             "; restore it into the same architecture with the same PowerSGD options");
    iteration_ = s.iteration;
    if (s.q.empty()) {
      q_ready_ = false;
    } else {
      q_ = s.q;
      q_ready_ = true;
    }
    if (s.error.empty())
      std::fill(error_.begin(), error_.end(), 0.0f);
    else
      error_ = s.error;
  }

 private:
  struct Matrix {
    size_t offset;  // in the flat gradient buffer
    int n, m, r;
    size_t p_off;    // in the bucket's buffer, after its uncompressed values
    size_t q_off;    // in q_
    size_t err_off;  // in error_
  };
  struct Plan {
    std::vector<std::pair<size_t, size_t>> plain;  // (offset, count) runs all-reduced as they are
    size_t plain_count = 0;
    std::vector<Matrix> mats;
    std::vector<float> buf;  // uncompressed values, then every matrix's P
    size_t q_begin = 0, q_count = 0;  // the bucket's Q's, contiguous in q_
    size_t mat_begin = 0;             // index of mats[0] in bad_d_
  };
  struct Pending {
    size_t bucket;
    bool compressed;
    ProcessGroup::WorkPtr first, second;
  };

  void plan() {
    const auto slices = model_->param_slices();
    const auto& owners = model_->param_owners();
    size_t q_total = 0, err_total = 0;
    plans_.resize(buckets_.size());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Bucket& bk = buckets_[b];
      Plan& pl = plans_[b];
      pl.q_begin = q_total;
      size_t p_total = 0;
      for (size_t i = bk.first_param; i <= bk.last_param && i < slices.size(); ++i) {
        auto [off, cnt] = slices[i];
        if (!cnt) continue;
        auto [mi, pi] = owners[i];
        const nn::Shape& shape = model_->module(mi)->param_specs()[pi].shape;
        bool compress = false;
        Matrix mx{};
        if (shape.size() >= 2 && shape[0] > 0) {
          const size_t n = shape[0], m = cnt / n;
          const size_t r = std::min<size_t>({static_cast<size_t>(cfg_.matrix_approximation_rank), n, m});
          compress = static_cast<double>(n) * m >= cfg_.min_compression_rate * static_cast<double>(n + m) * r;
          mx = Matrix{off, static_cast<int>(n), static_cast<int>(m), static_cast<int>(r), 0, 0, 0};
        }
        if (!compress) {
          if (!pl.plain.empty() && pl.plain.back().first + pl.plain.back().second == off)
            pl.plain.back().second += cnt;
          else
            pl.plain.emplace_back(off, cnt);
          pl.plain_count += cnt;
          continue;
        }
        mx.p_off = p_total;
        mx.q_off = q_total;
        mx.err_off = err_total;
        p_total += static_cast<size_t>(mx.n) * mx.r;
        q_total += static_cast<size_t>(mx.m) * mx.r;
        err_total += cnt;
        pl.mats.push_back(mx);
      }
      // P's follow the uncompressed values; p_off were counted from 0.
      pl.buf.resize(pl.plain_count + p_total);
      pl.q_count = q_total - pl.q_begin;
    }
    q_.assign(q_total, 0.0f);
    error_.assign(cfg_.use_error_feedback ? err_total : 0, 0.0f);
    size_t mats = 0;
    for (Plan& pl : plans_) {
      pl.mat_begin = mats;
      mats += pl.mats.size();
    }
    bad_d_.assign(mats, 0);
  }

  // A standard normal Q for every matrix of a bucket, the same on every rank:
  // seeded by the seed, the matrix and (without warm start) the iteration.
  void init_q(const Plan& pl) {
    for (const Matrix& mx : pl.mats) {
        uint64_t seed = cfg_.seed * 0x9E3779B97F4A7C15ull + mx.q_off;
        if (!cfg_.warm_start) seed ^= static_cast<uint64_t>(iteration_) * 0xD1B54A32D192ED03ull;
        nn::Rng rng(seed);
        float* q = q_.data() + mx.q_off;
        const size_t k = static_cast<size_t>(mx.m) * mx.r;
        for (size_t i = 0; i < k; i += 2) {  // Box-Muller: two normals per two uniforms
          const double u1 = (static_cast<double>(rng.next() >> 11) + 1.0) * (1.0 / 9007199254740993.0);
          const double u2 = static_cast<double>(rng.next() >> 11) * (1.0 / 9007199254740992.0);
          const double rad = std::sqrt(-2.0 * std::log(u1));
          q[i] = static_cast<float>(rad * std::cos(kTwoPi * u2));
          if (i + 1 < k) q[i + 1] = static_cast<float>(rad * std::sin(kTwoPi * u2));
        }
    }
  }

  PowerSGDConfig cfg_;
  std::shared_ptr<nn::SequentialModel> model_;
  std::vector<Bucket> buckets_;
  ProcessGroup& group_;
  std::vector<Plan> plans_;
  std::vector<float> q_;      // every compressed matrix's Q (m x r), bucket by bucket
  std::vector<float> error_;  // every compressed matrix's residual (n x m), this rank's
  bool q_ready_ = false;     // Q initialised (with warm start: once, for every bucket)
  int64_t iteration_ = 0;     // completed steps (sync_gradients that reduced something)
  std::vector<Pending> pending_;
  std::vector<double> tmp_;
  std::vector<char> bad_d_;   // per matrix: this rank's D held inf/NaN this step
};

}  // namespace

std::unique_ptr<CommHook> make_comm_hook(CommHookKind kind, const PowerSGDConfig& psgd,
                                         std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets,
                                         distributed::ProcessGroup& group) {
  switch (kind) {
    case CommHookKind::kFp16:
    case CommHookKind::kBf16: return std::make_unique<HalfHook>(kind, std::move(model), std::move(buckets), group);
    case CommHookKind::kPowerSgd:
      check_powersgd_config(psgd, "DistributedDataParallel");
      return std::make_unique<PowerSgdHook>(psgd, std::move(model), std::move(buckets), group);
    case CommHookKind::kNone: break;
  }
  return nullptr;
}

}  // namespace cx::train
