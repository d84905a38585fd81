#include "nn/layers/conv2d.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common/error.h"
#include "nn/blas.h"
#include "nn/kernels.h"
#include "nn/layers/conv2d_direct.h"
#include "nn/parallel.h"
#include "nn/registry.h"
#include "nn/rng.h"
#include "nn/serialize.h"

namespace cx::nn {

namespace {

constexpr int64_t kMaxSize = 1 << 20;  // any one size; what a file may claim too

// n floats, eight at a time: one vector move each where the caller is compiled
// for AVX2 (a call to memcpy per image row would cost more than the copy for
// rows of 8 floats).
inline void copy_floats(float* __restrict d, const float* __restrict s, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (size_t l = 0; l < 8; ++l) d[i + l] = s[i + l];
  for (; i < n; ++i) d[i] = s[i];
}

size_t conv_arg(const char* what, int64_t v, int64_t lo) {
  CX_CHECK(v >= lo, InvalidArgument, "Conv2dModule: ", what, " must be >= ", lo, ", got ", v);
  CX_CHECK(v <= kMaxSize, InvalidArgument, "Conv2dModule: ", what, " must be at most ", kMaxSize, ", got ", v);
  return static_cast<size_t>(v);
}

// Weight floats (out x in/groups x k x k) that fit in 2^30, without overflowing on the way.
bool weight_fits(uint64_t in, uint64_t out, uint64_t k, uint64_t groups) {
  const uint64_t kg = in / groups * k * k;  // <= 2^60
  return kg <= (1ull << 30) / out;
}

// The image extent a kernel covers: dilation*(k-1)+1.
size_t extent(const Conv2dGeometry& g) { return g.dilation * (g.k - 1) + 1; }

}  // namespace

Conv2dModule::Conv2dModule(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride,
                           int64_t padding, bool bias, int64_t dilation, int64_t groups, uint64_t seed)
    : bias_(bias) {
  g_.in = conv_arg("in_channels", in_channels, 1);
  g_.out = conv_arg("out_channels", out_channels, 1);
  g_.k = conv_arg("kernel_size", kernel_size, 1);
  g_.stride = conv_arg("stride", stride, 1);
  g_.padding = conv_arg("padding", padding, 0);
  g_.dilation = conv_arg("dilation", dilation, 1);
  g_.groups = conv_arg("groups", groups, 1);
  CX_CHECK(g_.in % g_.groups == 0 && g_.out % g_.groups == 0, InvalidArgument,
           "Conv2dModule: in_channels (", g_.in, ") and out_channels (", g_.out, ") must both be divisible by groups (",
           g_.groups, ")");
  CX_CHECK(weight_fits(g_.in, g_.out, g_.k, g_.groups), InvalidArgument, "Conv2dModule: the weight (", g_.out, ", ",
           g_.in / g_.groups, ", ", g_.k, ", ", g_.k, ") is too large (more than 2^30 floats)");
  std::vector<ParamSpec> specs{{"weight", {g_.out, g_.in / g_.groups, g_.k, g_.k}}};
  if (bias) specs.push_back({"bias", {g_.out}});
  declare_params(std::move(specs));
  reset_parameters(seed);
}

void Conv2dModule::reset_parameters(uint64_t seed) {
  const size_t fan_in = g_.in / g_.groups * g_.k * g_.k;
  const double bound = std::sqrt(6.0 / fan_in);
  Rng rng(seed);
  float* w = param(0);
  for (size_t i = 0, n = g_.out * fan_in; i < n; ++i) w[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
  if (bias_) std::fill(param(1), param(1) + g_.out, 0.0f);
}

std::string Conv2dModule::repr() const {
  std::string s = "Conv2d(" + std::to_string(g_.in) + ", " + std::to_string(g_.out) +
                  ", kernel_size=" + std::to_string(g_.k);
  if (g_.stride != 1) s += ", stride=" + std::to_string(g_.stride);
  if (g_.padding != 0) s += ", padding=" + std::to_string(g_.padding);
  if (g_.dilation != 1) s += ", dilation=" + std::to_string(g_.dilation);
  if (g_.groups != 1) s += ", groups=" + std::to_string(g_.groups);
  if (!bias_) s += ", bias=False";
  return s + ")";
}

Shape Conv2dModule::output_shape(const Shape& in) const {
  CX_CHECK(in.size() == 4, InvalidArgument, repr(), " expects input of shape (batch, ", g_.in,
           ", height, width), got ", shape_str(in));
  CX_CHECK(in[1] == g_.in, InvalidArgument, repr(), " expects ", g_.in, " input channels (input of shape (batch, ",
           g_.in, ", height, width)), got ", shape_str(in));
  const size_t hp = in[2] + 2 * g_.padding, wp = in[3] + 2 * g_.padding, e = extent(g_);
  CX_CHECK(hp >= e && wp >= e, InvalidArgument, repr(), ": the kernel (", e, " x ", e, g_.dilation > 1 ? " dilated" : "",
           ") is larger than the input padded to ", hp, " x ", wp, " (input ", shape_str(in), ")");
  const size_t oh = (hp - e) / g_.stride + 1, ow = (wp - e) / g_.stride + 1;
  CX_CHECK(oh * ow * (g_.in * g_.k * g_.k) <= (1u << 30) && hp * wp <= (1u << 30), InvalidArgument, repr(),
           ": input ", shape_str(in), " is too large for one sample's unfolding");
  return {in[0], g_.out, oh, ow};
}

// ---------------------------------------------------------------- unfolding (im2col) and folding (col2im)

namespace {
std::atomic<size_t> unfold_floats{0};  // 0: kUnfoldFloats
}  // namespace

size_t Conv2dModule::set_unfold_floats(size_t n) { return unfold_floats.exchange(n); }

size_t Conv2dModule::chunk_rows(size_t OH, size_t OW) const {
  const size_t limit = unfold_floats.load() ? unfold_floats.load() : kUnfoldFloats;
  const size_t rows = std::max<size_t>(1, limit / (g_.in * g_.k * g_.k * OW));
  const size_t chunks = (OH + rows - 1) / rows;
  return (OH + chunks - 1) / chunks;  // as even as they come: no thin last chunk
}

// Note [Direct convolution] in conv2d_direct.cpp: stride 1 or 2, one group, a kernel larger than 1x1, outputs of
// whole vectors, on an AVX-512 core.
bool Conv2dModule::runs_direct(size_t OH, size_t OW) const {
  return g_.stride <= 2 && g_.dilation == 1 && g_.groups == 1 && g_.k > 1 && direct_conv::fits(g_.k, OH, OW) &&
         direct_conv::available();
}

// Note [Direct convolution]: 8-wide outputs of 16-64 channels compute with the channels in the vector.
bool Conv2dModule::by_channel_ok(size_t channels, size_t OH, size_t OW) {
  return OW == 8 && OH * OW <= direct_conv::kMaxPixels && direct_conv::fits_channels(channels);
}

// Note [Direct convolution]: the batch in contiguous parts of kPartSamples samples at least, on the model math's
// threads (Note [One pool for the model math] in nn/parallel.h), the first on the calling thread.
size_t Conv2dModule::in_parts(size_t N, const std::function<void(size_t, size_t, size_t, PartScratch&)>& part) {
  const size_t most = static_cast<size_t>(num_threads());
  if (part_sums_.size() < most) part_sums_.resize(most);
  // Never more parts than part_sums_ has, should another thread change the thread count meanwhile.
  return parallel_for(N, kPartSamples, [&](size_t k, size_t b, size_t e) { part(b, e, k, thread_scratch()); },
                      part_sums_.size());
}

Conv2dModule::PartScratch& Conv2dModule::thread_scratch() {
  thread_local PartScratch s;
  return s;
}

void Conv2dModule::image(const float* x, size_t H, size_t W, float* out) const {
  (g_.stride == 1 ? direct_conv::pad_image : direct_conv::split_columns)(x, g_.in, H, W, g_.padding, out);
}

const float* Conv2dModule::pad(const float* x, size_t H, size_t W, PartScratch& s) const {
  const size_t p = g_.padding, C = g_.in, Hp = H + 2 * p, Wp = W + 2 * p;
  if (!p) return x;
  const std::array<size_t, 4> geometry{C, H, W, p};
  if (s.padded_for != geometry) {  // zeroed once per geometry: the borders stay zero (Note [Scratch per thread])
    s.padded.resize({C, Hp, Wp});
    std::memset(s.padded.data(), 0, C * Hp * Wp * sizeof(float));
    s.padded_for = geometry;
  }
  float* dst = s.padded.data();
  for (size_t c = 0; c < C; ++c)
    for (size_t h = 0; h < H; ++h) copy_floats(dst + (c * Hp + h + p) * Wp + p, x + (c * H + h) * W, W);
  return dst;
}

namespace {

// col row (c, i, j), column (oh - oh0) * OW + ow = src[c][oh*s + i*d][ow*s + j*d]. W and S are OW and
// the stride when known at compile time (0: at run time): the rows of the usual image widths (8, 16, 32)
// then copy as one to four vector moves (or shuffles, for stride 2) each, with no loop around them.
template <size_t W, size_t S>
__attribute__((always_inline)) inline void unfold_impl(const float* __restrict src, float* __restrict col,
                                                       const Conv2dGeometry& g, size_t Hp, size_t Wp, size_t oh0,
                                                       size_t oh1, size_t OW) {
  const size_t C = g.in, k = g.k, s = S ? S : g.stride, d = g.dilation, cols = (oh1 - oh0) * OW;
  const size_t n = W ? W : OW;
  for (size_t c = 0; c < C; ++c)
    for (size_t i = 0; i < k; ++i)
      for (size_t j = 0; j < k; ++j) {
        float* r = col + ((c * k + i) * k + j) * cols;
        const float* b = src + (c * Hp + i * d + oh0 * s) * Wp + j * d;
        for (size_t oh = oh0; oh < oh1; ++oh, r += n, b += s * Wp) {
          if (W && S) {
            for (size_t l = 0; l < W; ++l) r[l] = b[l * S];
          } else if (s == 1) {
            copy_floats(r, b, n);
          } else if (s == 2) {
            for (size_t ow = 0; ow < n; ++ow) r[ow] = b[2 * ow];
          } else {
            for (size_t ow = 0; ow < n; ++ow) r[ow] = b[ow * s];
          }
        }
      }
}

// The transpose: every column of dcol adds into the padded pixel it was copied from.
template <size_t W, size_t S>
__attribute__((always_inline)) inline void fold_impl(const float* __restrict dcol, float* __restrict dst,
                                                     const Conv2dGeometry& g, size_t Hp, size_t Wp, size_t oh0,
                                                     size_t oh1, size_t OW) {
  const size_t C = g.in, k = g.k, s = S ? S : g.stride, d = g.dilation, cols = (oh1 - oh0) * OW;
  const size_t n = W ? W : OW;
  for (size_t c = 0; c < C; ++c)
    for (size_t i = 0; i < k; ++i)
      for (size_t j = 0; j < k; ++j) {
        const float* r = dcol + ((c * k + i) * k + j) * cols;
        float* b = dst + (c * Hp + i * d + oh0 * s) * Wp + j * d;
        for (size_t oh = oh0; oh < oh1; ++oh, r += n, b += s * Wp) {
          if (W && S) {
            for (size_t l = 0; l < W; ++l) b[l * S] += r[l];
          } else if (s == 1) {
            for (size_t ow = 0; ow < n; ++ow) b[ow] += r[ow];
          } else {
            for (size_t ow = 0; ow < n; ++ow) b[ow * s] += r[ow];
          }
        }
      }
}

// Cloned for AVX2: the copies are 256-bit moves there, and the strided gathers and scatters shuffles.
__attribute__((target_clones("avx2", "default"))) void unfold_rows(const float* __restrict src,
                                                                   float* __restrict col, const Conv2dGeometry& g,
                                                                   size_t Hp, size_t Wp, size_t oh0, size_t oh1,
                                                                   size_t OW) {
  switch (g.stride <= 2 ? g.stride * 1000 + OW : 0) {
    case 1008: return unfold_impl<8, 1>(src, col, g, Hp, Wp, oh0, oh1, OW);
    case 1016: return unfold_impl<16, 1>(src, col, g, Hp, Wp, oh0, oh1, OW);
    case 1032: return unfold_impl<32, 1>(src, col, g, Hp, Wp, oh0, oh1, OW);
    case 2008: return unfold_impl<8, 2>(src, col, g, Hp, Wp, oh0, oh1, OW);
    case 2016: return unfold_impl<16, 2>(src, col, g, Hp, Wp, oh0, oh1, OW);
    default: return unfold_impl<0, 0>(src, col, g, Hp, Wp, oh0, oh1, OW);
  }
}

__attribute__((target_clones("avx2", "default"))) void fold_rows(const float* __restrict dcol, float* __restrict dst,
                                                                 const Conv2dGeometry& g, size_t Hp, size_t Wp,
                                                                 size_t oh0, size_t oh1, size_t OW) {
  switch (g.stride <= 2 ? g.stride * 1000 + OW : 0) {
    case 1008: return fold_impl<8, 1>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
    case 1016: return fold_impl<16, 1>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
    case 1032: return fold_impl<32, 1>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
    case 2008: return fold_impl<8, 2>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
    case 2016: return fold_impl<16, 2>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
    default: return fold_impl<0, 0>(dcol, dst, g, Hp, Wp, oh0, oh1, OW);
  }
}

}  // namespace

const float* Conv2dModule::unfold(const float* src, size_t Hp, size_t Wp, size_t oh0, size_t oh1, size_t OW,
                                  PartScratch& s) const {
  s.col.resize({g_.in * g_.k * g_.k, (oh1 - oh0) * OW});
  unfold_rows(src, s.col.data(), g_, Hp, Wp, oh0, oh1, OW);
  return s.col.data();
}

void Conv2dModule::each_unfolded(const float* x, size_t H, size_t W, size_t OH, size_t OW, PartScratch& s,
                                 const std::function<void(const float*, int, size_t)>& f) const {
  const size_t Hp = H + 2 * g_.padding, Wp = W + 2 * g_.padding, R = chunk_rows(OH, OW);
  const float* src = pad(x, H, W, s);
  for (size_t oh0 = 0; oh0 < OH; oh0 += R) {
    const size_t oh1 = std::min(OH, oh0 + R);
    f(unfold(src, Hp, Wp, oh0, oh1, OW, s), static_cast<int>((oh1 - oh0) * OW), oh0);
  }
}

void Conv2dModule::fold(const float* dcol, float* dst, size_t Hp, size_t Wp, size_t oh0, size_t oh1, size_t OW) const {
  fold_rows(dcol, dst, g_, Hp, Wp, oh0, oh1, OW);
}

// ---------------------------------------------------------------- forward, backward

void Conv2dModule::forward(const float* x, const Shape& in, float* y, bool) {
  const size_t N = in[0], C = g_.in, H = in[2], W = in[3];
  const Shape out = output_shape(in);
  const size_t OH = out[2], OW = out[3], P = OH * OW, G = g_.groups;
  const size_t Og = g_.out / G, Kg = C / G * g_.k * g_.k, Hp = H + 2 * g_.padding, Wp = W + 2 * g_.padding;
  const int iOg = static_cast<int>(Og), iKg = static_cast<int>(Kg), iP = static_cast<int>(P);
  const float* w = param(0);
  const float beta = bias_ ? 1.0f : 0.0f;
  auto fill_bias = [&](float* yn) {
    if (bias_)
      for (size_t o = 0; o < g_.out; ++o) std::fill(yn + o * P, yn + (o + 1) * P, param(1)[o]);
  };
  if (runs_direct(OH, OW)) {  // Note [Direct convolution]
    const bool by_channel = by_channel_ok(g_.out, OH, OW);
    packed_.resize({direct_conv::packed_floats(g_.out, C, g_.k)});
    if (by_channel)
      direct_conv::pack_by_channel(w, g_.out, C, g_.k, false, packed_.data());
    else
      direct_conv::pack(w, g_.out, C, g_.k, false, packed_.data());
    in_parts(N, [&](size_t b, size_t e, size_t, PartScratch& s) {
      s.images.resize({C, Hp, Wp});
      if (by_channel) s.dys.resize({P, g_.out});
      for (size_t n = b; n < e; ++n) {
        float* yn = y + n * g_.out * P;
        fill_bias(yn);
        image(x + n * C * H * W, H, W, s.images.data());
        if (by_channel)
          direct_conv::forward_by_channel(s.images.data(), C, Hp, Wp, g_.stride, packed_.data(), g_.out, g_.k, yn,
                                          OH, OW, bias_, s.dys.data());
        else
          direct_conv::forward(s.images.data(), C, Hp, Wp, g_.stride, packed_.data(), g_.out, g_.k, yn, OH, OW,
                               bias_);
      }
    });
    return;
  }
  in_parts(N, [&](size_t b, size_t e, size_t, PartScratch& s) {  // each sample's GEMMs in one part
    for (size_t n = b; n < e; ++n) {
      const float* xn = x + n * C * H * W;
      float* yn = y + n * g_.out * P;
      fill_bias(yn);
      if (direct()) {  // the sample is its own unfolding
        for (size_t g = 0; g < G; ++g)
          gemm(false, false, iOg, iP, iKg, 1.0f, w + g * Og * Kg, iKg, xn + g * Kg * P, iP, beta, yn + g * Og * P,
               iP);
        continue;
      }
      each_unfolded(xn, H, W, OH, OW, s, [&](const float* col, int cols, size_t oh0) {
        for (size_t g = 0; g < G; ++g)
          gemm(false, false, iOg, cols, iKg, 1.0f, w + g * Og * Kg, iKg, col + g * Kg * cols, cols, beta,
               yn + g * Og * P + oh0 * OW, iP);
      });
    }
  });
}

void Conv2dModule::backward(const float* x, const float*, const Shape& in, const float* gy, float* gx,
                            const ParamDone& done) {
  const size_t N = in[0], C = g_.in, H = in[2], W = in[3];
  const Shape out = output_shape(in);
  const size_t OH = out[2], OW = out[3], P = OH * OW, G = g_.groups;
  const size_t Og = g_.out / G, Kg = C / G * g_.k * g_.k, Hp = H + 2 * g_.padding, Wp = W + 2 * g_.padding;
  const size_t R = chunk_rows(OH, OW);
  const int iOg = static_cast<int>(Og), iKg = static_cast<int>(Kg), iP = static_cast<int>(P);
  // Note [Convolution as GEMM]: bias, then the weight, each final before dx starts.
  if (bias_) {
    float* db = grad(1);
    parallel_items(g_.out, N * P, [&](size_t, size_t o0, size_t o1) {
      for (size_t o = o0; o < o1; ++o) {
        double s = 0;
        for (size_t n = 0; n < N; ++n) s += kernels::sum(gy + (n * g_.out + o) * P, P);
        db[o] += static_cast<float>(s);
      }
    });
    done(1);
  }
  float* dw = grad(0);
  // Note [Direct convolution]: outputs of whole vectors as 16 partial sums per weight; 8-wide ones with output
  // channels in the vector. Over samples a chunk of about kChunkPixels output pixels at a time; each thread's sums
  // added up after the batch.
  const bool direct_ok = runs_direct(OH, OW);
  const bool fast = OW % 16 == 0 && direct_ok;
  const bool by_channel = !fast && direct_ok && direct_conv::fits_channels(g_.out);
  if (fast || by_channel) {
    const size_t O = g_.out, chunk = std::min(N, std::max<size_t>(1, kChunkPixels / P));
    const size_t sums = by_channel ? Kg * O : Kg * O * 16;
    const size_t parts = in_parts(N, [&](size_t b, size_t e, size_t part, PartScratch& s) {
      Tensor& lanes = part_sums_[part];
      lanes.resize({sums});
      std::memset(lanes.data(), 0, sums * sizeof(float));
      s.images.resize({chunk, C, Hp, Wp});
      s.dys.resize({chunk, O, P});
      for (size_t n0 = b; n0 < e; n0 += chunk) {
        const size_t n = std::min(chunk, e - n0);
        for (size_t m = 0; m < n; ++m) {
          image(x + (n0 + m) * C * H * W, H, W, s.images.data() + m * C * Hp * Wp);
          const float* g = gy + (n0 + m) * O * P;
          if (by_channel) {  // pixel-major
            float* t = s.dys.data() + m * P * O;
            for (size_t o = 0; o < O; ++o)
              for (size_t q = 0; q < P; ++q) t[q * O + o] = g[o * P + q];
          } else {  // channel-major
            for (size_t o = 0; o < O; ++o) copy_floats(s.dys.data() + (o * n + m) * P, g + o * P, P);
          }
        }
        if (by_channel)
          direct_conv::weight_grad_by_channel(s.images.data(), n, C, Hp, Wp, g_.stride, s.dys.data(), O, g_.k, OH,
                                              OW, lanes.data());
        else
          direct_conv::weight_grad(s.images.data(), n, C, Hp, Wp, g_.stride, s.dys.data(), O, g_.k, OH, OW,
                                   lanes.data());
      }
    });
    float* sum = part_sums_[0].data();
    for (size_t t = 1; t < parts; ++t) kernels::add(sum, part_sums_[t].data(), sums, sum);
    if (by_channel) {
      for (size_t o = 0; o < O; ++o)
        for (size_t q = 0; q < Kg; ++q) dw[o * Kg + q] += sum[q * O + o];
    } else {
      direct_conv::add_lanes(sum, O * Kg, dw);
    }
  }
  if (!fast && !by_channel) {
    // One part adds each sample's product into dw itself, as on one thread; several add into dw of their own,
    // added to dw in part order afterwards (Note [One pool for the model math]).
    const size_t parts = in_parts(N, [&](size_t b, size_t e, size_t part, PartScratch& s) {
      float* into = dw;
      if (b != 0 || e != N) {
        Tensor& mine = part_sums_[part];
        mine.resize({g_.out * Kg});
        std::memset(mine.data(), 0, g_.out * Kg * sizeof(float));
        into = mine.data();
      }
      for (size_t n = b; n < e; ++n) {
        const float* xn = x + n * C * H * W;
        const float* gyn = gy + n * g_.out * P;
        if (direct()) {
          for (size_t g = 0; g < G; ++g)
            gemm(false, true, iOg, iKg, iP, 1.0f, gyn + g * Og * P, iP, xn + g * Kg * P, iP, 1.0f, into + g * Og * Kg,
                 iKg);
          continue;
        }
        each_unfolded(xn, H, W, OH, OW, s, [&](const float* col, int cols, size_t oh0) {
          for (size_t g = 0; g < G; ++g)
            gemm(false, true, iOg, iKg, cols, 1.0f, gyn + g * Og * P + oh0 * OW, iP, col + g * Kg * cols, cols, 1.0f,
                 into + g * Og * Kg, iKg);
        });
      }
    });
    for (size_t t = 0; parts > 1 && t < parts; ++t) kernels::add(dw, part_sums_[t].data(), g_.out * Kg, dw);
  }
  done(0);
  if (!gx) return;
  const float* w = param(0);
  const size_t p = g_.padding;
  // Note [Direct convolution]: dx is dy's convolution, turned and swapped.
  if (g_.stride == 1 && p <= g_.k - 1 && runs_direct(H, W)) {
    const size_t q = g_.k - 1 - p, Hq = OH + 2 * q, Wq = OW + 2 * q, O = g_.out;
    const bool by_channel = by_channel_ok(C, H, W);
    packed_.resize({direct_conv::packed_floats(C, O, g_.k)});
    if (by_channel)
      direct_conv::pack_by_channel(w, C, O, g_.k, true, packed_.data());
    else
      direct_conv::pack(w, C, O, g_.k, true, packed_.data());
    in_parts(N, [&](size_t b, size_t e, size_t, PartScratch& s) {
      if (by_channel) s.dys.resize({H * W, C});
      const std::array<size_t, 4> geometry{O, OH, OW, q};
      if (q && s.dypadded_for != geometry) {  // new geometry: zero it all once; the borders stay zero
        s.dypadded.resize({O, Hq, Wq});
        std::memset(s.dypadded.data(), 0, O * Hq * Wq * sizeof(float));
        s.dypadded_for = geometry;
      }
      for (size_t n = b; n < e; ++n) {
        const float* src = gy + n * O * P;
        if (q) {
          float* dst = s.dypadded.data();
          for (size_t o = 0; o < O; ++o)
            for (size_t h = 0; h < OH; ++h) copy_floats(dst + (o * Hq + h + q) * Wq + q, src + (o * OH + h) * OW, OW);
          src = dst;
        }
        if (by_channel)
          direct_conv::forward_by_channel(src, O, Hq, Wq, 1, packed_.data(), C, g_.k, gx + n * C * H * W, H, W, false,
                                          s.dys.data());
        else
          direct_conv::forward(src, O, Hq, Wq, 1, packed_.data(), C, g_.k, gx + n * C * H * W, H, W, false);
      }
    });
    return;
  }
  in_parts(N, [&](size_t b, size_t e, size_t, PartScratch& s) {  // each sample's dx in one part
    if (p) s.dpadded.resize({C, Hp, Wp});
    for (size_t n = b; n < e; ++n) {
      const float* gyn = gy + n * g_.out * P;
      float* gxn = gx + n * C * H * W;
      if (direct()) {  // dx = W^T dy, straight into dx
        for (size_t g = 0; g < G; ++g)
          gemm(true, false, iKg, iP, iOg, 1.0f, w + g * Og * Kg, iKg, gyn + g * Og * P, iP, 0.0f, gxn + g * Kg * P,
               iP);
        continue;
      }
      float* dst = p ? s.dpadded.data() : gxn;
      std::memset(dst, 0, C * Hp * Wp * sizeof(float));
      for (size_t oh0 = 0; oh0 < OH; oh0 += R) {
        const size_t oh1 = std::min(OH, oh0 + R);
        const int cols = static_cast<int>((oh1 - oh0) * OW);
        s.col.resize({C * g_.k * g_.k, static_cast<size_t>(cols)});
        float* dcol = s.col.data();
        for (size_t g = 0; g < G; ++g)
          gemm(true, false, iKg, cols, iOg, 1.0f, w + g * Og * Kg, iKg, gyn + g * Og * P + oh0 * OW, iP, 0.0f,
               dcol + g * Kg * cols, cols);
        fold(dcol, dst, Hp, Wp, oh0, oh1, OW);
      }
      if (p)
        for (size_t c = 0; c < C; ++c)
          for (size_t h = 0; h < H; ++h) copy_floats(gxn + (c * H + h) * W, dst + (c * Hp + h + p) * Wp + p, W);
    }
  });
}

void Conv2dModule::write_config(ByteWriter& w) const {
  for (size_t v : {g_.in, g_.out, g_.k, g_.stride, g_.padding, g_.dilation, g_.groups}) w.u64(v);
  w.u8(bias_ ? 1 : 0);
}

namespace {

std::shared_ptr<Module> read_conv2d(ByteReader& r) {
  uint64_t v[7];
  for (auto& x : v) x = r.u64();
  const uint8_t bias = r.u8();
  for (int i = 0; i < 7; ++i)
    if (v[i] > static_cast<uint64_t>(kMaxSize)) r.fail("bad Conv2d hyper-parameters");
  if (bias > 1) r.fail("bad Conv2d hyper-parameters");
  // The weights must fit in what is left of the file (the constructor checks the rest).
  if (v[0] && v[1] && v[6] && v[0] % v[6] == 0 &&
      (!weight_fits(v[0], v[1], v[2], v[6]) || v[1] * (v[0] / v[6]) * v[2] * v[2] > r.remaining() / 4))
    r.fail("bad Conv2d sizes");
  return std::make_shared<Conv2dModule>(v[0], v[1], v[2], v[3], v[4], bias != 0, v[5], v[6], 0);
}

// Note [Layer ids] in registry.h.
const LayerRegistration kConv2dRegistration{12, "Conv2d", read_conv2d};

}  // namespace

}  // namespace cx::nn
