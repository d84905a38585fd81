// The image layers on a GPU (Note [Modules on the GPU] in nn/module.h): Conv2d, the poolings and Residual,
// each the device twin of its CPU code in this folder, the kernels of cuda/nn.cu queued on the Device's
// stream. BatchNorm2d is BatchNormModule's device code (nn/modules_gpu.cpp), which takes images.
// tests/test_gpu.py trains image models on both devices and compares them.
#include <algorithm>

#include "common/error.h"
#include "cuda/device.h"
#include "nn/layers/conv2d.h"
#include "nn/layers/pooling.h"
#include "nn/layers/residual.h"

namespace cx::nn {

namespace {

using ull = unsigned long long;

// Note [Convolution on the GPU]
// The CPU convolves one sample at a time (Note [Convolution as GEMM] in conv2d.h); a GPU wants a few large
// GEMMs instead. So a chunk of nb samples is unfolded at once into col (K = in*k*k rows, nb*P columns, sample
// after sample), and each group's product is one GEMM:
//   forward   y_n (out x P) = W (out x K) . col_n for each sample n of the chunk, col_n being col's columns
//             n*P..(n+1)*P: one strided batched GEMM writes y (nb, out, P) in place (+ bias, a kernel of its own)
//   backward  gyT (out x nb*P) = gy (nb, out, P) swapped;  dW += gyT . col^T;  dcol = W^T . gyT, folded into dx
// The chunk is the whole batch unless col would pass kColFloats; the bias's gradient is one reduction per
// channel over the batch (Note [Channel sums in runs] in cuda/nn.cu). The GEMMs are the Device's (cuBLAS, at
// the trainer's matmul_precision).
//
// col is the layer's own, so the training forward's last chunk is still unfolded there when backward starts:
// backward takes the chunks for dW last to first and unfolds all but that one again (ConvState::holds).
constexpr size_t kColFloats = size_t(32) << 20;  // 128 MB of unfolding at most

struct ConvState : DeviceState {
  cuda::Buffer col, t;  // the chunk's unfolding (or dcol); gyT
  cuda::Buffer part;    // the bias gradient's sums per run of each channel (cx_nn_channel_sums)
  // What col holds: the unfolding of samples n0.. of the input at x of this shape, or nothing (x null).
  const float* x = nullptr;
  Shape in;
  size_t n0 = 0;
  bool holds(const float* px, const Shape& pin, size_t pn0) const { return x && x == px && in == pin && n0 == pn0; }
};

struct ConvPlan {
  size_t N, C, H, W, O, OH, OW, P, G, Og, Kg, nb;
};

ConvPlan conv_plan(const Conv2dModule& m, const Shape& in) {
  const Conv2dGeometry& g = m.geometry();
  const Shape out = m.output_shape(in);
  ConvPlan c{};
  c.N = in[0], c.C = g.in, c.H = in[2], c.W = in[3], c.O = g.out, c.OH = out[2], c.OW = out[3];
  c.P = c.OH * c.OW, c.G = g.groups, c.Og = g.out / g.groups, c.Kg = g.in / g.groups * g.k * g.k;
  const size_t per_sample = std::max(c.Kg * c.G, c.O) * c.P;
  // The kernels index a sample's pixels, and a chunk's columns, in 32 bits.
  CX_CHECK(per_sample < (size_t(1) << 31) && c.C * c.H * c.W < (size_t(1) << 32), InvalidArgument, m.repr(),
           ": input ", shape_str(in), " is too large for one sample's unfolding on the GPU");
  c.nb = std::max<size_t>(1, std::min(c.N, kColFloats / std::max<size_t>(per_sample, 1)));
  return c;
}

// Blocks of 256 threads over n items in x (grid-stride beyond 2^16 blocks), `rows` in y (at most 2^16 - 1).
unsigned grid_x(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 65535)); }
unsigned grid_y(size_t rows) { return static_cast<unsigned>(std::min<size_t>(std::max<size_t>(rows, 1), 65535)); }

void unfold_chunk(const DeviceParams& d, const Conv2dGeometry& g, const ConvPlan& c, const float* x, float* col,
                  size_t nb) {
  d.dev.launch2(d.dev.fn("cx_nn_im2col"), grid_x(nb * c.P), grid_y(c.C), 256, 1, x, col, ull(nb), ull(c.C),
                ull(c.H), ull(c.W), ull(g.k), ull(g.stride), ull(g.padding), ull(g.dilation), ull(c.OH), ull(c.OW));
}

// dst (B, A, P) = src (A, B, P).
void swap01(const DeviceParams& d, const float* src, float* dst, size_t A, size_t B, size_t P) {
  d.dev.launch2(d.dev.fn("cx_nn_swap01"), grid_x(A * P), grid_y(B), 256, 1, src, dst, ull(A), ull(B), ull(P));
}

}  // namespace

std::unique_ptr<DeviceState> Conv2dModule::make_device_state(cuda::Device&) const {
  return std::make_unique<ConvState>();
}

void Conv2dModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y, bool) {
  auto& st = *static_cast<ConvState*>(s);
  const ConvPlan c = conv_plan(*this, in);
  st.col.reserve(c.Kg * c.G * c.nb * c.P * sizeof(float));
  st.x = nullptr;
  const float* w = param(d, 0);
  const int P = static_cast<int>(c.P), Og = static_cast<int>(c.Og), Kg = static_cast<int>(c.Kg);
  for (size_t n0 = 0; n0 < c.N; n0 += c.nb) {
    const size_t nb = std::min(c.nb, c.N - n0);
    const int cols = static_cast<int>(nb * c.P);
    unfold_chunk(d, g_, c, x + n0 * c.C * c.H * c.W, st.col.f(), nb);
    st.x = x, st.in = in, st.n0 = n0;
    float* yc = y + n0 * c.O * c.P;
    for (size_t g = 0; g < c.G; ++g)
      d.dev.gemm_batched(false, false, Og, P, Kg, 1.0f, w + g * c.Og * c.Kg, Kg, 0, st.col.f() + g * c.Kg * cols, cols,
                         c.P, 0.0f, yc + g * c.Og * c.P, P, c.O * c.P, static_cast<int>(nb));
    if (bias_)
      d.dev.launch2(d.dev.fn("cx_nn_bias01"), grid_x(c.O * c.P), grid_y(nb), 256, 1, yc,
                    static_cast<const float*>(param(d, 1)), ull(c.O), ull(nb), ull(c.P));
  }
}

void Conv2dModule::backward(const DeviceParams& d, DeviceState* s, const float* x, const float*, const Shape& in,
                            const float* gy, float* gx, const ParamDone& done) {
  auto& st = *static_cast<ConvState*>(s);
  const ConvPlan c = conv_plan(*this, in);
  st.col.reserve(c.Kg * c.G * c.nb * c.P * sizeof(float));
  st.t.reserve(c.O * c.nb * c.P * sizeof(float));
  // Note [Convolution as GEMM]: the bias, then the weight, each final before dx starts.
  if (bias_) {
    CX_CHECK(c.N * c.P < (size_t(1) << 32), InvalidArgument, repr(), ": output of ", c.N * c.P,
             " values per channel is too many for the GPU's bias gradient (2^32)");
    const unsigned runs = cuda::Device::channel_runs(c.N * c.P);
    st.part.reserve(runs * c.O * sizeof(double));
    auto* part = static_cast<double*>(st.part.get());
    d.dev.launch2(d.dev.fn("cx_nn_channel_sums"), static_cast<unsigned>(c.O), runs, 256, 1, gy, part, ull(c.N),
                  ull(c.O), ull(c.P));
    d.dev.launch(d.dev.fn("cx_nn_channel_sum_add"), cuda::Device::grid_for(c.O), 256, grad(d, 1),
                 static_cast<const double*>(part), ull(c.O), runs);
    if (done) done(1);
  }
  const float* w = param(d, 0);
  float* dw = grad(d, 0);
  const int Og = static_cast<int>(c.Og), Kg = static_cast<int>(c.Kg);
  const size_t chunks = (c.N + c.nb - 1) / c.nb;
  for (size_t i = chunks; i-- > 0;) {  // last to first: the forward's last chunk may still be in col
    const size_t n0 = i * c.nb, nb = std::min(c.nb, c.N - n0);
    const int cols = static_cast<int>(nb * c.P);
    if (!st.holds(x, in, n0)) unfold_chunk(d, g_, c, x + n0 * c.C * c.H * c.W, st.col.f(), nb);
    st.x = nullptr;  // col is dcol from here on
    swap01(d, gy + n0 * c.O * c.P, st.t.f(), nb, c.O, c.P);  // gyT (out, nb*P)
    for (size_t g = 0; g < c.G; ++g)
      d.dev.gemm(false, true, Og, Kg, cols, 1.0f, st.t.f() + g * c.Og * cols, cols, st.col.f() + g * c.Kg * cols,
                 cols, 1.0f, dw + g * c.Og * c.Kg, Kg);
  }
  if (done) done(0);
  if (!gx) return;
  const bool one_chunk = c.nb >= c.N;  // gyT of the whole batch is still in st.t
  for (size_t n0 = 0; n0 < c.N; n0 += c.nb) {
    const size_t nb = std::min(c.nb, c.N - n0);
    const int cols = static_cast<int>(nb * c.P);
    if (!one_chunk) swap01(d, gy + n0 * c.O * c.P, st.t.f(), nb, c.O, c.P);
    for (size_t g = 0; g < c.G; ++g)
      d.dev.gemm(true, false, Kg, cols, Og, 1.0f, w + g * c.Og * c.Kg, Kg, st.t.f() + g * c.Og * cols, cols, 0.0f,
                 st.col.f() + g * c.Kg * cols, cols);
    d.dev.launch2(d.dev.fn("cx_nn_col2im"), grid_x(c.C * c.H * c.W), grid_y(nb), 256, 1,
                  static_cast<const float*>(st.col.f()), gx + n0 * c.C * c.H * c.W, ull(nb), ull(c.C), ull(c.H),
                  ull(c.W), ull(g_.k), ull(g_.stride), ull(g_.padding), ull(g_.dilation), ull(c.OH), ull(c.OW));
  }
}

// ---- pooling -----------------------------------------------------------------------

namespace {
struct MaxPoolState : DeviceState {
  cuda::Buffer arg;  // per output: the index of its maximum in its plane (as MaxPool2dModule::argmax_)
};
}  // namespace

std::unique_ptr<DeviceState> MaxPool2dModule::make_device_state(cuda::Device&) const {
  return std::make_unique<MaxPoolState>();
}

void MaxPool2dModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
                              bool) {
  auto& st = *static_cast<MaxPoolState*>(s);
  const Shape out = output_shape(in);
  const ull planes = ull(in[0]) * in[1], n = planes * out[2] * out[3];
  st.arg.reserve(n * sizeof(unsigned));
  d.dev.launch(d.dev.fn("cx_nn_maxpool_fwd"), cuda::Device::grid_for(n), 256, x, y,
               static_cast<unsigned*>(st.arg.get()), planes, ull(in[2]), ull(in[3]), ull(out[2]), ull(out[3]),
               ull(k_), ull(s_));
}

void MaxPool2dModule::backward(const DeviceParams& d, DeviceState* s, const float*, const float*, const Shape& in,
                               const float* gy, float* gx, const ParamDone&) {
  if (!gx) return;
  const auto& st = *static_cast<const MaxPoolState*>(s);
  const Shape out = output_shape(in);
  const ull planes = ull(in[0]) * in[1], n = planes * in[2] * in[3];
  d.dev.launch(d.dev.fn("cx_nn_maxpool_bwd"), cuda::Device::grid_for(n), 256, gy,
               static_cast<const unsigned*>(st.arg.get()), gx, planes, ull(in[2]), ull(in[3]), ull(out[2]),
               ull(out[3]), ull(k_), ull(s_));
}

void AvgPool2dModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y, bool) {
  const Shape out = output_shape(in);
  const ull planes = ull(in[0]) * in[1], n = planes * out[2] * out[3];
  const float inv = 1.0f / static_cast<float>(k_ * k_);
  d.dev.launch(d.dev.fn("cx_nn_avgpool_fwd"), cuda::Device::grid_for(n), 256, x, y, planes, ull(in[2]), ull(in[3]),
               ull(out[2]), ull(out[3]), ull(k_), ull(s_), inv);
}

void AvgPool2dModule::backward(const DeviceParams& d, DeviceState*, const float*, const float*, const Shape& in,
                               const float* gy, float* gx, const ParamDone&) {
  if (!gx) return;
  const Shape out = output_shape(in);
  const ull planes = ull(in[0]) * in[1], n = planes * in[2] * in[3];
  const float inv = 1.0f / static_cast<float>(k_ * k_);
  d.dev.launch(d.dev.fn("cx_nn_avgpool_bwd"), cuda::Device::grid_for(n), 256, gy, gx, planes, ull(in[2]),
               ull(in[3]), ull(out[2]), ull(out[3]), ull(k_), ull(s_), inv);
}

void GlobalAvgPool2dModule::forward(const DeviceParams& d, DeviceState*, const float* x, const Shape& in, float* y,
                                    bool) {
  output_shape(in);  // the CPU's checks
  const ull planes = ull(in[0]) * in[1];
  d.dev.launch(d.dev.fn("cx_nn_gap_fwd"), static_cast<unsigned>((planes + 7) / 8), 256, x, y, planes,
               ull(in[2]) * in[3]);
}

void GlobalAvgPool2dModule::backward(const DeviceParams& d, DeviceState*, const float*, const float*, const Shape& in,
                                     const float* gy, float* gx, const ParamDone&) {
  if (!gx) return;
  const ull planes = ull(in[0]) * in[1], S = ull(in[2]) * in[3];
  d.dev.launch(d.dev.fn("cx_nn_gap_bwd"), cuda::Device::grid_for(planes * S), 256, gy, gx, planes, S,
               1.0f / static_cast<float>(S));
}

// ---- Residual ----------------------------------------------------------------------

namespace {

// One of the container's models on the device: its layers run as DeviceModel runs a model's (device_model.cpp),
// on the outer model's flat parameters (the layers' offsets are into those: Note [Models inside a module]).
struct SubmodelRun {
  SequentialModel* model = nullptr;
  size_t tensor_base = 0;  // the container's index of this model's first parameter tensor
  std::vector<size_t> first;  // per layer: its first parameter tensor within the model
  std::vector<std::unique_ptr<DeviceState>> states;
  std::vector<Shape> shapes;        // input of each layer, then the output
  std::vector<cuda::Buffer> acts;   // each layer's output
  cuda::Buffer grads[2];
  const float* input = nullptr;

  void make(SequentialModel* m, size_t base, cuda::Device& dev) {
    model = m, tensor_base = base;
    size_t f = 0;
    for (size_t i = 0; i < m->size(); ++i) {
      first.push_back(f);
      states.push_back(m->module(i)->make_device_state(dev));
      f += m->module(i)->param_specs().size();
    }
  }

  const float* forward(const DeviceParams& d, const float* x, const Shape& in, bool training) {
    shapes = model->shapes_for(in);
    acts.resize(model->size());
    input = x;
    const float* cur = x;
    for (size_t i = 0; i < model->size(); ++i) {
      acts[i].reserve(numel(shapes[i + 1]) * sizeof(float));
      model->module(i)->forward(d, states[i].get(), cur, shapes[i], acts[i].f(), training);
      cur = acts[i].f();
    }
    return cur;
  }

  // Returns dL/d(input) (null unless want_gx), valid until this model's next backward.
  const float* backward(const DeviceParams& d, const float* gy, bool want_gx, const ParamDone& done) {
    size_t biggest = 0;
    for (size_t i = want_gx ? 0 : 1; i < model->size(); ++i) biggest = std::max(biggest, numel(shapes[i]));
    for (auto& b : grads) b.reserve(biggest * sizeof(float));
    const float* g = gy;
    for (size_t k = model->size(); k-- > 0;) {
      const float* x = k ? acts[k - 1].f() : input;
      float* gx = k || want_gx ? grads[k % 2].f() : nullptr;  // never the buffer g is in (k+1's)
      ParamDone inner;
      if (done) inner = [&done, at = tensor_base + first[k]](size_t i) { done(at + i); };
      model->module(k)->backward(d, states[k].get(), x, acts[k].f(), shapes[k], g, gx, inner);
      g = gx;
    }
    return want_gx ? g : nullptr;
  }
};

struct ResidualState : DeviceState {
  SubmodelRun block, shortcut;  // shortcut.model null: the identity
};

}  // namespace

void ResidualModule::check_runs_on_gpu() const {
  for (const auto* m : {block_.get(), shortcut_.get()}) {
    if (!m) continue;
    for (size_t i = 0; i < m->size(); ++i) {
      try {
        m->module(i)->check_runs_on_gpu();
      } catch (const InvalidArgument& e) {
        CX_THROW(InvalidArgument, repr(), ": layer ", i, " of the ", m == block_.get() ? "block" : "shortcut", ": ",
                 e.what());
      }
    }
  }
}

std::unique_ptr<DeviceState> ResidualModule::make_device_state(cuda::Device& dev) const {
  auto st = std::make_unique<ResidualState>();
  st->block.make(block_.get(), 0, dev);
  if (shortcut_) st->shortcut.make(shortcut_.get(), block_tensors_, dev);
  return st;
}

void ResidualModule::to_device(cuda::Device& dev, DeviceState* s) const {
  auto& st = *static_cast<ResidualState*>(s);
  for (SubmodelRun* r : {&st.block, &st.shortcut})
    for (size_t i = 0; r->model && i < r->model->size(); ++i)
      if (r->states[i]) r->model->module(i)->to_device(dev, r->states[i].get());
}

void ResidualModule::to_host(cuda::Device& dev, const DeviceState* s) {
  const auto& st = *static_cast<const ResidualState*>(s);
  for (const SubmodelRun* r : {&st.block, &st.shortcut})
    for (size_t i = 0; r->model && i < r->model->size(); ++i)
      if (r->states[i]) r->model->module(i)->to_host(dev, r->states[i].get());
}

std::vector<std::pair<float*, size_t>> ResidualModule::device_buffers(DeviceState* s) {
  auto& st = *static_cast<ResidualState*>(s);
  std::vector<std::pair<float*, size_t>> out;  // in buffers()'s order
  for (SubmodelRun* r : {&st.block, &st.shortcut})
    for (size_t i = 0; r->model && i < r->model->size(); ++i)
      if (r->states[i])
        for (auto b : r->model->module(i)->device_buffers(r->states[i].get())) out.push_back(b);
  return out;
}

void ResidualModule::forward(const DeviceParams& d, DeviceState* s, const float* x, const Shape& in, float* y,
                             bool training) {
  auto& st = *static_cast<ResidualState*>(s);
  const float* yb = st.block.forward(d, x, in, training);
  out_ = st.block.shapes.back();
  const float* side = shortcut_ ? st.shortcut.forward(d, x, in, training) : x;
  const ull n = numel(out_);
  d.dev.launch(d.dev.fn("cx_nn_add"), cuda::Device::grid_for(n), 256, yb, side, y, n);
}

void ResidualModule::backward(const DeviceParams& d, DeviceState* s, const float*, const float*, const Shape& in,
                              const float* gy, float* gx, const ParamDone& done) {
  auto& st = *static_cast<ResidualState*>(s);
  const bool want_gx = gx != nullptr;
  const float* side = gy;  // the identity's dL/dx
  if (shortcut_) side = st.shortcut.backward(d, gy, want_gx, done);  // first: its parameters come after the block's
  const float* gb = st.block.backward(d, gy, want_gx, done);
  if (!gx) return;
  const ull n = numel(in);
  d.dev.launch(d.dev.fn("cx_nn_add"), cuda::Device::grid_for(n), 256, gb, side, gx, n);
}

}  // namespace cx::nn
