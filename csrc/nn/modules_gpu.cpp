// The layers on a GPU (Note [Modules on the GPU] in module.h): each module's
// device forward and backward, the kernels of cuda/nn.cu queued on the Device's
// stream. The CPU side of the same classes is modules.cpp; the two compute the
// same function (tests/test_gpu.py compares them on a GPU).
#include <algorithm>

#include "common/error.h"
#include "cuda/device.h"
#include "nn/modules.h"

namespace cx::nn {

namespace {

using u64 = unsigned long long;
using cuda::Buffer;
using cuda::Device;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // nn::Rng's increment per draw

// Blocks of 256 threads, one warp per row.
unsigned warp_grid(size_t rows) { return static_cast<unsigned>((rows + 7) / 8); }

}  // namespace

// ---- Linear ------------------------------------------------------------------------

void LinearModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y, bool) {
  const int B = static_cast<int>(in[0]), I = static_cast<int>(in_), O = static_cast<int>(out_);
  d.dev.gemm(false, true, B, O, I, 1.0f, x, I, param(d, 0), I, 0.0f, y, O);
  if (bias_)
    d.dev.launch(d.dev.fn("cx_nn_bias_add"), Device::grid_for(u64(B) * O), 256, y,
                 static_cast<const float*>(param(d, 1)), u64(B), u64(O));
}

void LinearModule::backward(const DeviceParams& d, DeviceState*, const float* x, const float*, const Shape& in,
                            const float* gy, float* gx, const ParamDone& done) {
  const int B = static_cast<int>(in[0]), I = static_cast<int>(in_), O = static_cast<int>(out_);
  if (bias_) {
    d.dev.launch2(d.dev.fn("cx_nn_col_sum_add"), static_cast<unsigned>((O + 31) / 32),
                  static_cast<unsigned>(std::min(64, (B + 63) / 64)), 32, 8, grad(d, 1), gy, u64(B), u64(O));
    if (done) done(1);
  }
  d.dev.gemm(true, false, O, I, B, 1.0f, gy, O, x, I, 1.0f, grad(d, 0), I);  // dW += gy^T x
  if (done) done(0);
  if (gx) d.dev.gemm(false, false, B, I, O, 1.0f, gy, O, param(d, 0), I, 0.0f, gx, I);  // dx = gy W
}

// ---- activations ---------------------------------------------------------------------

// Each activation's pair of kernels; every one takes (x, y, n, slope) forward and (x, y, gy, gx, n, slope)
// backward, whatever of those its formula reads.
const char* ReLUModule::device_kernel(bool bwd) const { return bwd ? "cx_nn_relu_bwd" : "cx_nn_relu_fwd"; }
const char* LeakyReLUModule::device_kernel(bool bwd) const {
  return bwd ? "cx_nn_leaky_relu_bwd" : "cx_nn_leaky_relu_fwd";
}
const char* SigmoidModule::device_kernel(bool bwd) const { return bwd ? "cx_nn_sigmoid_bwd" : "cx_nn_sigmoid_fwd"; }
const char* TanhModule::device_kernel(bool bwd) const { return bwd ? "cx_nn_tanh_bwd" : "cx_nn_tanh_fwd"; }
const char* GELUModule::device_kernel(bool bwd) const { return bwd ? "cx_nn_gelu_bwd" : "cx_nn_gelu_fwd"; }

void ActivationModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y, bool) {
  const u64 n = numel(in);
  d.dev.launch(d.dev.fn(device_kernel(false)), Device::grid_for(n), 256, x, y, n, device_slope());
}

void ActivationModule::backward(const DeviceParams& d, DeviceState*, const float* x, const float* y, const Shape& in,
                                const float* gy, float* gx, const ParamDone&) {
  if (!gx) return;
  const u64 n = numel(in);
  d.dev.launch(d.dev.fn(device_kernel(true)), Device::grid_for(n), 256, x, y, gy, gx, n, device_slope());
}

// ---- Softmax -----------------------------------------------------------------------

void SoftmaxModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y, bool) {
  d.dev.launch(d.dev.fn("cx_nn_softmax_fwd"), warp_grid(in[0]), 256, x, y, u64(in[0]), u64(in[1]));
}

void SoftmaxModule::backward(const DeviceParams& d, DeviceState*, const float*, const float* y, const Shape& in,
                             const float* gy, float* gx, const ParamDone&) {
  if (gx) d.dev.launch(d.dev.fn("cx_nn_softmax_bwd"), warp_grid(in[0]), 256, y, gy, gx, u64(in[0]), u64(in[1]));
}

// ---- Dropout -----------------------------------------------------------------------

namespace {
// The generator state advances on the device exactly as the host's would: the
// masks are the ones the CPU draws from the same state (cuda/nn.cu).
struct DropoutState : DeviceState {
  Buffer mask;
  uint64_t rng = 0;
  bool last_training = false;
};
}  // namespace

std::unique_ptr<DeviceState> DropoutModule::make_device_state(cuda::Device&) const {
  return std::make_unique<DropoutState>();
}
void DropoutModule::to_device(cuda::Device&, DeviceState* s) const { static_cast<DropoutState*>(s)->rng = rng_.state(); }
void DropoutModule::to_host(cuda::Device&, const DeviceState* s) {
  rng_.set_state(static_cast<const DropoutState*>(s)->rng);
}

void DropoutModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
                            bool training) {
  auto& st = *static_cast<DropoutState*>(s);
  const u64 n = numel(in);
  st.last_training = training && p_ > 0.0f;
  if (!st.last_training) {
    d.dev.copy(y, x, n * sizeof(float));
    return;
  }
  st.mask.reserve(n * sizeof(float));
  d.dev.launch(d.dev.fn("cx_nn_dropout_fwd"), Device::grid_for(n), 256, x, y, st.mask.f(), n, p_, u64(st.rng));
  st.rng += n * kGolden;  // the state after n draws (Rng::next adds kGolden per draw)
}

void DropoutModule::backward(const DeviceParams& d, DeviceState* s, const float*, const float*, const Shape& in,
                             const float* gy, float* gx, const ParamDone&) {
  if (!gx) return;
  const auto& st = *static_cast<const DropoutState*>(s);
  const u64 n = numel(in);
  if (st.last_training)
    d.dev.launch(d.dev.fn("cx_nn_mul"), Device::grid_for(n), 256, gy, static_cast<const float*>(st.mask.f()), gx, n);
  else
    d.dev.copy(gx, gy, n * sizeof(float));
}

// ---- BatchNorm ---------------------------------------------------------------------

namespace {
struct BatchNormState : DeviceState {
  Buffer xhat, invstd, rmean, rvar;
  Buffer mean;  // images (N, C, H, W): backward recomputes x-hat from x, mean and invstd
  mutable Buffer part;  // images: each run's two sums (the kernels' part), 2 x runs x C doubles
  bool last_training = false;
  // SyncBatchNormModule: the statistics summed over the ranks (cx_nn_sbn_fold's layout, 4C + 1 doubles), and
  // whether the last forward normalised with them.
  Buffer sync;
  bool synced = false;
};
}  // namespace

std::unique_ptr<DeviceState> BatchNormModule::make_device_state(cuda::Device&) const {
  auto s = std::make_unique<BatchNormState>();
  s->rmean.reserve(f_ * sizeof(float));
  s->rvar.reserve(f_ * sizeof(float));
  s->invstd.reserve(f_ * sizeof(float));
  s->mean.reserve(f_ * sizeof(float));
  return s;
}

void BatchNormModule::to_device(cuda::Device& dev, DeviceState* s) const {
  auto& st = *static_cast<BatchNormState*>(s);
  dev.upload(st.rmean.get(), running_mean_.data(), f_ * sizeof(float));
  dev.upload(st.rvar.get(), running_var_.data(), f_ * sizeof(float));
}

void BatchNormModule::to_host(cuda::Device& dev, const DeviceState* s) {
  const auto& st = *static_cast<const BatchNormState*>(s);
  dev.download(running_mean_.data(), st.rmean.get(), f_ * sizeof(float));
  dev.download(running_var_.data(), st.rvar.get(), f_ * sizeof(float));
}

std::vector<std::pair<float*, size_t>> BatchNormModule::device_buffers(DeviceState* s) {
  auto& st = *static_cast<BatchNormState*>(s);
  return {{st.rmean.f(), f_}, {st.rvar.f(), f_}};
}

void BatchNormModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
                              bool training) {
  auto& st = *static_cast<BatchNormState*>(s);
  if (in.size() == 4) {  // BatchNorm2dModule: BatchNormModule::forward_nchw's arithmetic (the kernels' note)
    CX_CHECK(in[0] * in[2] * in[3] < (size_t(1) << 32), InvalidArgument, repr(), ": input ", shape_str(in),
             " has too many values per channel for the GPU's kernels (2^32)");
    if (training)
      CX_CHECK(in[0] * in[2] * in[3] >= 2, InvalidArgument, repr(), " needs more than one value per channel (batch "
               "x height x width) in training mode, got input ", shape_str(in));
    st.last_training = training;
    const unsigned runs = cuda::Device::channel_runs(in[0] * in[2] * in[3]), C = static_cast<unsigned>(f_);
    const u64 N = in[0], S = in[2] * in[3];
    st.part.reserve(2 * runs * f_ * sizeof(double));
    auto* part = static_cast<double*>(st.part.get());
    if (training) {
      d.dev.launch2(d.dev.fn("cx_nn_channel_sums"), C, runs, 256, 1, x, part, N, u64(f_), S);
      d.dev.launch2(d.dev.fn("cx_nn_bn2d_var"), C, runs, 256, 1, x, part, N, u64(f_), S);
    }
    d.dev.launch2(d.dev.fn("cx_nn_bn2d_fwd"), C, runs, 256, 1, x, y, static_cast<const double*>(part), st.mean.f(),
                  st.invstd.f(), static_cast<const float*>(param(d, 0)), static_cast<const float*>(param(d, 1)),
                  st.rmean.f(), st.rvar.f(), N, u64(f_), S, eps_, momentum_, training ? 1 : 0);
    return;
  }
  if (training)  // as the CPU forward says it
    CX_CHECK(in[0] >= 2, InvalidArgument, repr(), " needs a batch of at least 2 in training mode, got ",
             shape_str(in));
  st.last_training = training;
  st.xhat.reserve(numel(in) * sizeof(float));
  d.dev.launch(d.dev.fn("cx_nn_bn_fwd"), Device::grid_for(in[1]), 256, x, y, st.xhat.f(), st.invstd.f(),
               static_cast<const float*>(param(d, 0)), static_cast<const float*>(param(d, 1)), st.rmean.f(),
               st.rvar.f(), u64(in[0]), u64(in[1]), eps_, momentum_, training ? 1 : 0);
}

void BatchNormModule::backward(const DeviceParams& d, DeviceState* s, const float* x, const float*, const Shape& in,
                               const float* gy, float* gx, const ParamDone& done) {
  const auto& st = *static_cast<const BatchNormState*>(s);
  if (in.size() == 4) {
    const unsigned runs = cuda::Device::channel_runs(in[0] * in[2] * in[3]), C = static_cast<unsigned>(f_);
    const u64 N = in[0], S = in[2] * in[3];
    st.part.reserve(2 * runs * f_ * sizeof(double));  // forward's size unless the eval forward came first
    auto* part = static_cast<double*>(st.part.get());
    const auto* mean = static_cast<const float*>(st.mean.f());
    d.dev.launch2(d.dev.fn("cx_nn_bn2d_bsum"), C, runs, 256, 1, gy, x, mean, part, N, u64(f_), S);
    d.dev.launch2(d.dev.fn("cx_nn_bn2d_bwd"), C, runs, 256, 1, gy, x, mean, static_cast<const float*>(st.invstd.f()),
                  static_cast<const float*>(param(d, 0)), grad(d, 0), grad(d, 1), gx, static_cast<const double*>(part),
                  N, u64(f_), S, st.last_training ? 1 : 0);
    if (done) {
      done(1);
      done(0);
    }
    return;
  }
  d.dev.launch(d.dev.fn("cx_nn_bn_bwd"), Device::grid_for(in[1]), 256, gy, static_cast<const float*>(st.xhat.f()),
               static_cast<const float*>(st.invstd.f()), static_cast<const float*>(param(d, 0)), grad(d, 0),
               grad(d, 1), gx, u64(in[0]), u64(in[1]), st.last_training ? 1 : 0);
  if (done) {
    done(1);
    done(0);
  }
}

// ---- SyncBatchNorm -----------------------------------------------------------------

// Note [SyncBatchNorm on the GPU]
// Note [SyncBatchNorm statistics] (modules.h) on the device: BatchNorm2d's kernels (Note [Channel sums in runs]
// in cuda/nn.cu) with the sums taken out between the passes and summed over the ranks by the device ReplicaSum the
// GPU trainer puts in DeviceParams (a blocking NCCL all-reduce of float64 on the stream):
//   forward:  channel sums -> fold [M, sums] -> all-reduce -> centred squares about the global mean -> fold ->
//             all-reduce -> normalise with the global statistics, running statistics from them (cx_nn_sbn_*);
//   backward: BatchNorm2d's two sums -> fold, adding the local sums to dbeta and dgamma (DDP averages those, as
//             on the CPU) -> all-reduce [2C] -> dL/dx with the global sums and count.
// (batch, features) input runs as images of 1x1 (N, C, 1, 1), so one path serves both. The trainer gives the
// sum at every world size, so a single GPU runs this path too (its all-reduces copy nothing; tests/test_gpu.py
// compares it with the CPU's BatchNorm). Without a sum (no trainer) and in eval mode it is BatchNormModule.
// Each all-reduce waits on the host: 3 per layer and training step.
void SyncBatchNormModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
                                  bool training) {
  auto& st = *static_cast<BatchNormState*>(s);
  const Shape im = in.size() == 4 ? in : Shape{in[0], in[1], 1, 1};
  st.synced = training && d.replica_sum;
  if (!st.synced) return BatchNormModule::forward(d, s, x, im, y, training);
  const size_t F = features(), per = im[0] * im[2] * im[3];
  CX_CHECK(per < (size_t(1) << 32), InvalidArgument, repr(), ": input ", shape_str(in),
           " has too many values per channel for the GPU's kernels (2^32)");
  CX_CHECK(per * static_cast<size_t>(d.replicas) >= 2, InvalidArgument, repr(), " needs a batch of at least 2 rows ",
           "over all ranks in training mode, got ", per, " (this rank's input: ", shape_str(in), ")");
  st.last_training = true;
  const unsigned runs = cuda::Device::channel_runs(per), C = static_cast<unsigned>(F);
  const u64 N = im[0], S = im[2] * im[3];
  st.part.reserve(2 * runs * F * sizeof(double));
  st.sync.reserve((4 * F + 1) * sizeof(double));
  auto* part = static_cast<double*>(st.part.get());
  auto* sync = static_cast<double*>(st.sync.get());
  d.dev.launch2(d.dev.fn("cx_nn_channel_sums"), C, runs, 256, 1, x, part, N, u64(F), S);
  d.dev.launch(d.dev.fn("cx_nn_sbn_fold"), Device::grid_for(F), 256, static_cast<const double*>(part), sync, u64(F),
               runs, u64(1), static_cast<double>(per));
  (*d.replica_sum)(sync, F + 1);
  d.dev.launch2(d.dev.fn("cx_nn_sbn_var"), C, runs, 256, 1, x, static_cast<const double*>(sync), part, N, u64(F), S);
  d.dev.launch(d.dev.fn("cx_nn_sbn_fold"), Device::grid_for(F), 256, static_cast<const double*>(part), sync, u64(F),
               runs, u64(1 + F), 0.0);
  (*d.replica_sum)(sync + 1 + F, F);
  d.dev.launch2(d.dev.fn("cx_nn_sbn_fwd"), C, runs, 256, 1, x, y, static_cast<const double*>(sync), st.mean.f(),
                st.invstd.f(), static_cast<const float*>(param(d, 0)), static_cast<const float*>(param(d, 1)),
                st.rmean.f(), st.rvar.f(), N, u64(F), S, eps(), momentum());
}

void SyncBatchNormModule::backward(const DeviceParams& d, DeviceState* s, const float* x, const float* y,
                                   const Shape& in, const float* gy, float* gx, const ParamDone& done) {
  auto& st = *static_cast<BatchNormState*>(s);
  const Shape im = in.size() == 4 ? in : Shape{in[0], in[1], 1, 1};
  if (!st.synced) return BatchNormModule::backward(d, s, x, y, im, gy, gx, done);
  const size_t F = features();
  const unsigned runs = cuda::Device::channel_runs(im[0] * im[2] * im[3]), C = static_cast<unsigned>(F);
  const u64 N = im[0], S = im[2] * im[3];
  auto* part = static_cast<double*>(st.part.get());
  auto* sync = static_cast<double*>(st.sync.get());
  const auto* mean = static_cast<const float*>(st.mean.f());
  const auto* invstd = static_cast<const float*>(st.invstd.f());
  d.dev.launch2(d.dev.fn("cx_nn_bn2d_bsum"), C, runs, 256, 1, gy, x, mean, part, N, u64(F), S);
  d.dev.launch(d.dev.fn("cx_nn_sbn_bfold"), Device::grid_for(F), 256, static_cast<const double*>(part), sync, invstd,
               grad(d, 0), grad(d, 1), u64(F), runs);
  if (done) {
    done(1);
    done(0);
  }
  if (!gx) return;  // the first layer: no all-reduce, on every rank alike (as on the CPU)
  (*d.replica_sum)(sync + 1 + 2 * F, 2 * F);
  d.dev.launch2(d.dev.fn("cx_nn_sbn_bwd"), C, runs, 256, 1, gy, x, mean, invstd,
                static_cast<const float*>(param(d, 0)), gx, static_cast<const double*>(sync), N, u64(F), S);
}

// ---- Flatten -----------------------------------------------------------------------

void FlattenModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y, bool) {
  d.dev.copy(y, x, numel(in) * sizeof(float));
}

void FlattenModule::backward(const DeviceParams& d, DeviceState*, const float*, const float*, const Shape& in,
                             const float* gy, float* gx, const ParamDone&) {
  if (gx) d.dev.copy(gx, gy, numel(in) * sizeof(float));
}

}  // namespace cx::nn
