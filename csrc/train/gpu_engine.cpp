#include "train/gpu_engine.h"

#include <cstring>

#include "common/error.h"
#include "train/buffer_sync.h"

namespace cx::train {

namespace {
// stats_: the loss sums (4 doubles), the clip's norm and two counters, then the non-finite counters.
constexpr size_t kClipAt = 4 * sizeof(double);
constexpr size_t kCountersAt = kClipAt + sizeof(double) + 2 * sizeof(uint32_t);

uintptr_t stream_id(const cuda::Device& dev) { return reinterpret_cast<uintptr_t>(dev.stream()); }

// Every layer must have GPU code (a layer of cpu_only.h has none): asked
// before a GPU is touched, so every rank refuses at trainer construction.
std::unique_ptr<cuda::Device> open_device(const nn::SequentialModel& model, const distributed::ProcessGroup& group) {
  nn::check_runs_on_gpu(model);
  return std::make_unique<cuda::Device>(group.config().local_rank);
}
}  // namespace

GpuEngine::GpuEngine(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                       std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                       const DDPConfig& cfg, std::shared_ptr<DistributedDataParallel> host_ddp)
    : dev_(open_device(*model, *group)),
      model_(std::move(model)),
      loss_(std::move(loss)),
      opt_(std::move(opt)),
      group_(std::move(group)),
      host_ddp_(std::move(host_ddp)),
      sched_(host_ddp_->buckets(), model_->param_slices().size(), [this](size_t b) { launch_bucket(b); }),
      broadcast_buffers_(cfg.broadcast_buffers) {
  hook_ = parse_comm_hook(cfg.comm_hook, "DistributedTrainer: DDPConfig.comm_hook");  // none/fp16/bf16 (TrainerCore)
  dm_ = std::make_unique<nn::DeviceModel>(model_, *dev_);
  // SyncBatchNormModule's sums (Note [SyncBatchNorm on the GPU] in nn/modules_gpu.cpp), at world size 1 too.
  dm_->set_replica_sum([g = group_.get(), s = stream_id(*dev_)](double* buf, size_t n) {
    g->all_reduce(buf, n, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false, s);
  }, group_->size());
  opt_state_ = opt_->to_device(*dev_, dm_->size());
  const auto slices = model_->param_slices();
  std::vector<uint64_t> bounds{0};
  for (const auto& sl : slices) bounds.push_back(sl.first + sl.second);
  nf_bounds_.reserve(bounds.size() * sizeof(uint64_t));
  dev_->upload(nf_bounds_.get(), bounds.data(), bounds.size() * sizeof(uint64_t));
  nf_host_.resize(2 * slices.size() + 1);
  stats_.reserve(stats_bytes());
  if (hook_ != CommHookKind::kNone) wire_.reserve(dm_->size() * sizeof(uint16_t));
  if (cfg.broadcast_parameters) {  // a no-op at world size 1, run anyway: one code path
    // Rank 0's parameters and BatchNorm statistics, on the device, then into the host model.
    group_->broadcast(dm_->params(), dm_->size(), distributed::DataType::kFloat32, 0, false, stream_id(*dev_));
    broadcast_buffers();
    dm_->to_host();
  }
}

GpuEngine::~GpuEngine() {
  try {
    dev_->make_current();
    for (auto& w : in_flight_) w->wait();
  } catch (...) {
    // The group is poisoned; its next user sees why.
  }
}

std::string GpuEngine::describe() const {
  return detail::concat("cuda:", dev_->ordinal(), " (", dev_->name(), "), GEMM: ", dev_->gemm_backend());
}

void GpuEngine::wait_in_flight() {
  std::vector<distributed::ProcessGroup::WorkPtr> works;
  works.swap(in_flight_);
  for (auto& w : works) w->wait();  // each returns once NCCL's result is in the buffer
}

// ---- host sync ---------------------------------------------------------------------

void GpuEngine::to_host() {
  dev_->make_current();
  wait_in_flight();
  dm_->to_host();
  opt_->to_host(*dev_, opt_state_);
}

void GpuEngine::from_host() {
  dev_->make_current();
  wait_in_flight();
  dm_->to_device();
  opt_state_ = opt_->to_device(*dev_, state_floats());
}

// Note [ZeRO-1 on the GPU]
// Note [ZeRO-1] (zero.h) on the device, with the CPU's shards (shard_of) and state layout, so checkpoints are the
// same files: each rank keeps the optimizer state of its shard only, on the device (opt_state_ of shard_.count
// floats per array; the host optimizer holds the same shard between fits). A step all-reduces the buckets as
// without ZeRO (PyTorch's ZeroRedundancyOptimizer does too, rather than stage 1's reduce-scatter), so the
// non-finite check and clipping see the whole averaged gradient and the norm is the global one; the optimizer
// updates [offset, offset + count) of the parameters, then an in-place NCCL all-gather of the q-float blocks and a
// broadcast of the last rank's < world extra floats give every rank every shard. The all-gather runs at world
// size 1 too (one code path; it moves nothing there). set_zero cuts the host's whole state to the shard, or
// gathers it whole again (through the device: all_gather_host); zero_state_dict gathers for checkpoints, and
// zero_load_state_dict keeps this rank's shard of a whole one. Each waits for the stream.
std::string GpuEngine::zero_who(const char* what) const {
  return detail::concat("DistributedTrainer ", what, " (rank ", group_->rank(), ", shard_optimizer_state on the GPU)");
}

void GpuEngine::set_zero(bool on) {
  if (on == zero_) return;
  const size_t n = dm_->size();
  const int world = group_->size(), rank = group_->rank();
  // Between fits the host objects are the state (fit ends with to_host, a loaded checkpoint goes to the host
  // first), so the host's state is cut or gathered here, and from_host uploads it in its new layout.
  if (on) {
    CX_CHECK(n >= static_cast<size_t>(world), InvalidArgument, "DistributedTrainer (rank ", rank,
             "): shard_optimizer_state needs at least one parameter per rank; the model has ", n, " for ", world,
             " ranks");
    const Shard shard = shard_of(n, world, rank);
    const size_t built = opt_->state_params();
    if (built == n) {
      opt_->load_state_dict(shard_state(opt_->state_dict(), n, shard, zero_who("shard_optimizer_state")));
    } else {
      CX_CHECK(built == 0 || built == shard.count, InvalidArgument, zero_who("shard_optimizer_state"),
               ": the optimizer's state was built for ", built, " parameters, but the model has ", n,
               " (this rank's shard: ", shard.count, "); use one optimizer per model");
    }
    shard_ = shard;
    q_ = n / static_cast<size_t>(world);
    zero_ = true;
  } else {
    nn::StateDict whole = zero_state_dict();
    zero_ = false;
    opt_->load_state_dict(whole);
  }
  from_host();
}

nn::StateDict GpuEngine::zero_state_dict() {
  return whole_state(*opt_, dm_->size(), shard_, zero_who("optimizer state"),
                     [this](const float* mine, float* out) { gather_shards_host(mine, out); });
}

void GpuEngine::zero_load_state_dict(const nn::StateDict& sd) {
  opt_->load_state_dict(shard_state(sd, dm_->size(), shard_, zero_who("load_checkpoint")));
}

void GpuEngine::gather_shards_host(const float* mine, float* out) {
  const size_t n = dm_->size();
  const int world = group_->size();
  const size_t tail = n - q_ * static_cast<size_t>(world);
  if (q_) all_gather_host(mine, out, q_ * sizeof(float));  // block r: rank r's first q floats
  if (tail) {
    if (group_->rank() == world - 1) std::memcpy(out + n - tail, mine + q_, tail * sizeof(float));
    broadcast_host(out + n - tail, tail * sizeof(float), world - 1);
  }
}

void GpuEngine::all_gather_parameters() {
  float* p = dm_->params();
  const size_t n = dm_->size();
  const int world = group_->size();
  if (q_) {  // in place: rank r's block is its shard's first q floats
    std::vector<void*> outs(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) outs[static_cast<size_t>(r)] = p + static_cast<size_t>(r) * q_;
    group_->all_gather(p + shard_.offset, outs, q_, distributed::DataType::kFloat32, false, stream_id(*dev_));
  }
  const size_t tail = n - q_ * static_cast<size_t>(world);
  if (tail)  // the last rank's shard ends with them, in place
    group_->broadcast(p + n - tail, tail, distributed::DataType::kFloat32, world - 1, false, stream_id(*dev_));
}

// ---- one step ----------------------------------------------------------------------

float* GpuEngine::input_buffer(size_t floats) {
  // The last step's copy from here has completed: each step ends waiting for its loss.
  dev_->make_current();
  host_x_.reserve(floats * sizeof(float));
  return host_x_.f();
}

nn::BatchTargets GpuEngine::upload_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  const size_t nx = nn::numel(x_shape);
  x_.reserve(nx * sizeof(float));
  dev_->upload(x_.get(), x, nx * sizeof(float));
  nn::BatchTargets on_dev;
  on_dev.shape = y.shape;
  if (y.labels) {
    labels_.reserve(y.rows() * sizeof(int64_t));
    dev_->upload(labels_.get(), y.labels, y.rows() * sizeof(int64_t));
    on_dev.labels = static_cast<const int64_t*>(labels_.get());
  } else {
    const size_t ny = nn::numel(y.shape);
    dense_.reserve(ny * sizeof(float));
    dev_->upload(dense_.get(), y.dense, ny * sizeof(float));
    on_dev.dense = dense_.f();
  }
  return on_dev;
}

void GpuEngine::launch_loss(const float* out, const nn::Shape& os, const nn::BatchTargets& y,
                             const nn::BatchTargets& on_dev) {
  gout_.reserve(nn::numel(os) * sizeof(float));
  dev_->zero(stats_.get(), stats_bytes());  // the loss sums and the non-finite counters
  loss_->forward_batch(*dev_, out, os, y, on_dev, gout_.f(), static_cast<double*>(stats_.get()));
}

BatchStats GpuEngine::read_loss(const nn::Shape& os) {
  // One copy, which waits for the step: the loss sums, and the non-finite counters behind them when checking.
  host_stats_.resize(stats_bytes());
  dev_->download(host_stats_.data(), stats_.get(),
                 checking_ ? stats_bytes() : clip_.on() ? kCountersAt : 4 * sizeof(double));
  double st[4];
  std::memcpy(st, host_stats_.data(), sizeof(st));
  if (checking_) std::memcpy(nf_host_.data(), host_stats_.data() + kCountersAt, nf_host_.size() * sizeof(uint32_t));
  const nn::BatchSums sums = loss_->batch_sums(st, os);
  return BatchStats{sums.loss_sum, sums.correct, static_cast<double>(os[0])};
}

void GpuEngine::launch_bucket(size_t b) {
  const Bucket& bk = sched_.buckets()[b];
  // This rank's own contribution, read on the stream before NCCL overwrites it with the average.
  if (checking_ && bk.count) count_nonfinite(bk.offset, bk.offset + bk.count, bk.first_param, 0);
  if (!bk.count) return;  // world size 1 too, as DistributedDataParallel: one code path
  if (hook_ == CommHookKind::kNone) {
    in_flight_.push_back(group_->all_reduce(dm_->grads() + bk.offset, bk.count, distributed::DataType::kFloat32,
                                            distributed::ReduceOp::kAvg, true, stream_id(*dev_)));
    return;
  }
  // Note [The GPU trainer's clipping and 16-bit buckets]: narrowed on the stream, then NCCL sums the 16 bits.
  const int bf16 = hook_ == CommHookKind::kBf16 ? 1 : 0;
  auto* wire = static_cast<uint16_t*>(wire_.get()) + bk.offset;
  dev_->launch(dev_->fn("cx_nn_narrow16"), cuda::Device::grid_for(bk.count), 256,
               static_cast<const float*>(dm_->grads() + bk.offset), wire, static_cast<unsigned long long>(bk.count),
               1.0f / static_cast<float>(group_->size()), bf16);
  in_flight_.push_back(group_->all_reduce(wire, bk.count, bf16 ? distributed::DataType::kBFloat16
                                                               : distributed::DataType::kFloat16,
                                          distributed::ReduceOp::kSum, true, stream_id(*dev_)));
}

BatchStats GpuEngine::train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  dev_->make_current();
  const NonFiniteMode mode = host_ddp_->nonfinite_mode();
  checking_ = mode != NonFiniteMode::kOff;
  const nn::BatchTargets on_dev = upload_batch(x, x_shape, y);
  if (broadcast_buffers_) broadcast_buffers();  // as DistributedDataParallel::forward in training
  const float* out = dm_->forward(x_.f(), x_shape, true);
  const nn::Shape os = dm_->output_shape();
  launch_loss(out, os, y, on_dev);
  // Note [First step of a shape]: the first backward of a batch shape makes the
  // driver load kernels (ours lazily, cuBLAS's for these sizes), which may wait
  // for the whole context; with an NCCL kernel already waiting on peers that
  // could stall. So for a new shape the buckets go out after backward has run.
  const bool overlap = shapes_seen_.count(x_shape[0]) > 0;
  sched_.start(overlap);
  dm_->backward(gout_.f(), [this](size_t p) { sched_.param_ready(p); });
  if (!overlap) {
    dev_->sync();
    shapes_seen_.insert(x_shape[0]);
  }
  sched_.launch_rest();
  wait_in_flight();
  if (hook_ != CommHookKind::kNone) {  // the 16-bit averages widened back into the gradient, exactly
    const int bf16 = hook_ == CommHookKind::kBf16 ? 1 : 0;
    for (const Bucket& bk : sched_.buckets())
      if (bk.count)
        dev_->launch(dev_->fn("cx_nn_widen16"), cuda::Device::grid_for(bk.count), 256,
                     static_cast<const uint16_t*>(wire_.get()) + bk.offset, dm_->grads() + bk.offset,
                     static_cast<unsigned long long>(bk.count), bf16);
  }
  // Note [Non-finite gradients on the GPU]: the update reads the average's count and leaves everything as it
  // was where it is not 0, unless the mode is "warn" (the step is taken).
  const unsigned int* skip = nullptr;
  if (checking_) {
    count_nonfinite(0, dm_->size(), 0, 1);  // before clipping, which would clamp an inf away
    if (mode != NonFiniteMode::kWarn) skip = counters() + nf_host_.size() - 1;
  }
  bool skip_on_clip = false;  // the step's skip is the clip's "cannot clip" (no non-finite check skips it)
  if (clip_.on()) {
    clip_on_device();
    if (!skip) skip = clip_counters() + 1, skip_on_clip = true;
  }
  if (zero_) {  // Note [ZeRO-1 on the GPU]
    opt_->step(*dev_, opt_state_, dm_->params() + shard_.offset, dm_->grads() + shard_.offset, skip);
    all_gather_parameters();
  } else {
    opt_->step(*dev_, opt_state_, dm_->params(), dm_->grads(), skip);
  }
  dm_->zero_grad();
  const BatchStats st = read_loss(os);
  unsigned int clip_host[2] = {0, 0};
  double norm = 0;
  if (skip_on_clip) {
    std::memcpy(&norm, host_stats_.data() + kClipAt, sizeof(norm));
    std::memcpy(clip_host, host_stats_.data() + kClipAt + sizeof(double), sizeof(clip_host));
  }
  if (checking_) {
    checking_ = false;
    if (skip && !skip_on_clip && nf_host_.back()) opt_->undo_step();  // kernel left parameters and state: the count too
    conclude_nonfinite();  // raises ("raise"), counts ("skip") or warns ("warn") through the host DDP
  }
  if (clip_host[1]) {  // as clip_gradients: nothing stepped, and the same words
    opt_->undo_step();
    const int rank = group_->rank();
    CX_THROW(InvalidArgument, clip_host[0] ? clip_nan_message(rank) : clip_norm_message(norm, rank));
  }
  update_emas();  // after the step's verdict, as the CPU engine owes its update only once the step is through
  return st;
}

// Note [EMA on the GPU]
// cx.callbacks.EMA's shadow lives on the device while fit runs: add_ema uploads the host array (the parameters
// at the start of fit, or a checkpoint's average), every train_batch that gets through its verdict (taken or
// skipped, as CpuEngine owes an update after update_parameters) queues cx_nn_ema over the flat parameters on the
// stream, and settle_ema downloads the shadow into the host array (the callback's accessors, checkpoints, the
// end of fit). The kernel rounds as train::ema_update does, so on the same parameters the two agree bit for bit.
void GpuEngine::add_ema(float* host, size_t n, double decay) {
  dev_->make_current();
  Ema e{host, n, static_cast<float>(decay), static_cast<float>(1.0 - decay), cuda::Buffer()};
  e.dev.reserve(n * sizeof(float));
  dev_->upload(e.dev.get(), host, n * sizeof(float));
  emas_.push_back(std::move(e));
}

void GpuEngine::update_emas() {
  for (Ema& e : emas_)
    dev_->launch(dev_->fn("cx_nn_ema"), cuda::Device::grid_for(e.n), 256, e.dev.f(),
                 static_cast<const float*>(dm_->params()), static_cast<unsigned long long>(e.n), e.d, e.c);
}

void GpuEngine::settle_ema() {
  if (emas_.empty()) return;
  dev_->make_current();
  for (Ema& e : emas_) dev_->download(e.host, e.dev.get(), e.n * sizeof(float));
}

// Note [The GPU trainer's clipping and 16-bit buckets]
// The CPU engine's gradient clipping (grad_clip.h) and DDP's fp16/bf16 hooks (Note [Half-precision buckets] in
// comm_hooks.cpp), on the device and without a host wait:
//   - fp16/bf16: as each bucket is launched, its gradient times 1/world is rounded to the 16-bit type
//     (cx_nn_narrow16, on the stream before NCCL reads it), NCCL SUMs the 16-bit copy in place in wire_, and
//     once NCCL is done each bucket is widened back into the gradient (cx_nn_widen16, exact). The CPU's hook
//     narrows the same way (to nearest even; float16 overflows to inf, which the non-finite check finds in the
//     average); its ring rounds after every addition, as NCCL's 16-bit sums do.
//   - clipping runs on the average, after the non-finite check has read it, as on the CPU: values clamped
//     (cx_nn_clip_value), then the norm: per-block sums of squares in double over a fixed grid, added in order by
//     one thread (every rank holds the same average, so every rank computes the same norm and coefficient),
//     and the gradient scaled by the coefficient from device memory. The norm and two counters ride in stats_,
//     read with the loss. A gradient that cannot be clipped (a NaN, a norm that is not finite) skips the
//     optimizer's kernel through its skip counter when no non-finite check already decides the step, and fit
//     raises clip_gradients' own message after the step, with the step's count taken back.
void GpuEngine::clip_on_device() {
  float* g = dm_->grads();
  const auto n = static_cast<unsigned long long>(dm_->size());
  unsigned int* c = clip_counters();
  if (clip_.max_value > 0)
    dev_->launch(dev_->fn("cx_nn_clip_value"), cuda::Device::grid_for(n), 256, g, n,
                 static_cast<float>(clip_.max_value), c, c + 1);
  if (!(clip_.max_norm > 0)) return;
  constexpr unsigned kParts = 256;
  clip_part_.reserve(kParts * sizeof(double) + sizeof(float));
  auto* part = static_cast<double*>(clip_part_.get());
  auto* coef = reinterpret_cast<float*>(part + kParts);
  dev_->launch(dev_->fn("cx_nn_sum_squares"), kParts, 256, static_cast<const float*>(g), n, part);
  dev_->launch(dev_->fn("cx_nn_clip_norm_coef"), 1, 32, static_cast<const double*>(part), kParts, clip_.max_norm,
               clip_norm(), coef, c + 1);
  dev_->launch(dev_->fn("cx_nn_scale_by"), cuda::Device::grid_for(n), 256, g, n, static_cast<const float*>(coef));
}

// Note [Non-finite gradients on the GPU]
// The GPU twin of Note [Non-finite gradients] (nonfinite.h), with the same
// modes, counters and messages (the host DistributedDataParallel's: its
// nonfinite mode, skipped_steps, NonFiniteError and warning text). One kernel,
// cx_nn_count_nonfinite (nn.cu), reads a range of the flat gradient once and
// counts its inf/NaN values per parameter tensor:
//   - over each bucket as it is handed to NCCL, queued on the same stream just
//     before the all-reduce, so it reads this rank's own gradient before the
//     average overwrites it in place;
//   - over the whole buffer once NCCL is done: the average, which is the same
//     bytes on every rank (NCCL's all-gather phase copies it), so every rank
//     finds the same parameters and takes the same decision with no message.
// The counters sit behind the loss sums in one device block, zeroed with them
// and read with them by the one wait for the loss each step already has: the
// check adds no host wait. So the decision "this step is not taken" is made on
// the device: the optimizer's kernel reads the average's total count and
// returns at once where it is not 0 ("raise" and "skip"; "warn" takes the
// step), and once the host has read the counters it takes back the step's
// count (Optimizer::undo_step, Adam's bias correction) and raises, counts or
// warns through the host DDP. Only a bad step communicates: a one-byte
// all-gather of "was my own gradient bad" names the ranks, as decide_local +
// name_ranks do on the CPU.
size_t GpuEngine::stats_bytes() const { return kCountersAt + nf_host_.size() * sizeof(uint32_t); }

unsigned int* GpuEngine::counters() const {
  return reinterpret_cast<unsigned int*>(static_cast<char*>(stats_.get()) + kCountersAt);
}

double* GpuEngine::clip_norm() const { return reinterpret_cast<double*>(static_cast<char*>(stats_.get()) + kClipAt); }

unsigned int* GpuEngine::clip_counters() const {
  return reinterpret_cast<unsigned int*>(static_cast<char*>(stats_.get()) + kClipAt + sizeof(double));
}

void GpuEngine::count_nonfinite(size_t lo, size_t hi, size_t first_param, size_t slot) {
  if (hi <= lo) return;
  const size_t params = nf_host_.size() / 2;
  unsigned int* c = counters();
  dev_->launch(dev_->fn("cx_nn_count_nonfinite"), cuda::Device::grid_for(hi - lo), 256,
               static_cast<const float*>(dm_->grads()), static_cast<unsigned long long>(lo),
               static_cast<unsigned long long>(hi), static_cast<const unsigned long long*>(nf_bounds_.get()),
               static_cast<unsigned int>(first_param), c + slot * params, slot == 1 ? c + 2 * params : nullptr);
}

bool GpuEngine::conclude_nonfinite() {
  const size_t params = nf_host_.size() / 2;
  NonFiniteVerdict v;
  for (size_t p = 0; p < params; ++p) {
    if (nf_host_[p]) v.own.emplace_back(p, nf_host_[p]);
    if (nf_host_[params + p]) v.params.emplace_back(p, nf_host_[params + p]);
  }
  v.bad = !v.params.empty();
  if (v.bad) {  // every rank alike: the same average everywhere
    const uint8_t mine = v.own.empty() ? 0 : 1;
    std::vector<uint8_t> all(static_cast<size_t>(group_->size()));
    all_gather_host(&mine, all.data(), 1);
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r]) v.ranks.push_back(static_cast<int>(r));
  }
  return host_ddp_->conclude_device_step(v);
}

BatchStats GpuEngine::eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  dev_->make_current();
  const nn::BatchTargets on_dev = upload_batch(x, x_shape, y);
  const float* out = dm_->forward(x_.f(), x_shape, false);
  const nn::Shape os = dm_->output_shape();
  launch_loss(out, os, y, on_dev);
  return read_loss(os);
}

BatchStats GpuEngine::reduce_stats(const BatchStats& s) {
  double v[3] = {s.loss_sum, s.correct, s.count};
  dev_->make_current();
  staging_.reserve(sizeof(v));
  dev_->upload(staging_.get(), v, sizeof(v));
  group_->all_reduce(staging_.get(), 3, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false,
                     stream_id(*dev_));
  dev_->download(v, staging_.get(), sizeof(v));
  return BatchStats{v[0], v[1], v[2]};
}

void GpuEngine::all_gather_host(const void* in, void* out, size_t bytes) {
  const int world = group_->size();
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes * (world + 1));
  char* base = static_cast<char*>(staging_.get());
  dev_->upload(base, in, bytes);
  std::vector<void*> outs;
  for (int r = 0; r < world; ++r) outs.push_back(base + bytes * (r + 1));
  group_->all_gather(base, outs, bytes, distributed::DataType::kUInt8, false, stream_id(*dev_));
  dev_->download(out, base + bytes, bytes * world);
}

void GpuEngine::broadcast_buffers() {
  dev_->make_current();
  const std::vector<FloatSpan> spans = dm_->buffers();
  if (total_floats(spans) == 0) return;  // no buffers: no collective, and no device allocation either
  buffer_pack_.reserve(total_floats(spans) * sizeof(float));
  train::broadcast_buffers(*group_, spans, buffer_pack_.f(), [this](float* dst, const float* src, size_t n) {
    dev_->copy(dst, src, n * sizeof(float));
  }, stream_id(*dev_));
}

void GpuEngine::broadcast_host(void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  dev_->make_current();
  staging_.reserve(bytes);
  dev_->upload(staging_.get(), buf, bytes);
  group_->broadcast(staging_.get(), bytes, distributed::DataType::kUInt8, root, false, stream_id(*dev_));
  dev_->download(buf, staging_.get(), bytes);
}

}  // namespace cx::train
