#include "nn/layers/pooling.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "nn/kernels.h"
#include "nn/parallel.h"
#include "nn/registry.h"
#include "nn/serialize.h"

namespace cx::nn {

namespace {

constexpr int64_t kMaxWindow = 1 << 16;

size_t window_arg(const char* layer, const char* what, int64_t v) {
  CX_CHECK(v >= 1 && v <= kMaxWindow, InvalidArgument, layer, ": ", what, " must be in [1, ", kMaxWindow, "], got ", v);
  return static_cast<size_t>(v);
}

void check_nchw(const Module& m, const Shape& in) {
  CX_CHECK(in.size() == 4, InvalidArgument, m.repr(), " expects input of shape (batch, channels, height, width), got ",
           shape_str(in));
}

}  // namespace

// ---------------------------------------------------------------- Pool2d

Pool2dModule::Pool2dModule(const char* layer, int64_t kernel_size, int64_t stride)
    : k_(window_arg(layer, "kernel_size", kernel_size)), s_(window_arg(layer, "stride", stride)) {}

std::string Pool2dModule::repr() const {
  std::string s = type_name() + "(kernel_size=" + std::to_string(k_);
  if (s_ != k_) s += ", stride=" + std::to_string(s_);
  return s + ")";
}

Shape Pool2dModule::output_shape(const Shape& in) const {
  check_nchw(*this, in);
  CX_CHECK(in[2] >= k_ && in[3] >= k_, InvalidArgument, repr(), ": the window (", k_, " x ", k_,
           ") is larger than the input image (", in[2], " x ", in[3], ", input ", shape_str(in), ")");
  return {in[0], in[1], (in[2] - k_) / s_ + 1, (in[3] - k_) / s_ + 1};
}

void Pool2dModule::write_config(ByteWriter& w) const {
  w.u64(k_);
  w.u64(s_);
}

// ---------------------------------------------------------------- MaxPool2d

void MaxPool2dModule::forward(const float* x, const Shape& in, float* y, bool) {
  const Shape out = output_shape(in);
  const size_t planes = in[0] * in[1], H = in[2], W = in[3], OH = out[2], OW = out[3];
  argmax_.resize(planes * OH * OW);
  parallel_items(planes, H * W, [&](size_t, size_t pl0, size_t pl1) {
    for (size_t pl = pl0; pl < pl1; ++pl) {
      const float* xp = x + pl * H * W;
      float* yp = y + pl * OH * OW;
      uint32_t* ap = argmax_.data() + pl * OH * OW;
      for (size_t oh = 0; oh < OH; ++oh)
        for (size_t ow = 0; ow < OW; ++ow) {
          size_t best = oh * s_ * W + ow * s_;
          float bv = xp[best];
          for (size_t i = 0; i < k_; ++i) {
            const size_t row = (oh * s_ + i) * W + ow * s_;
            for (size_t j = 0; j < k_; ++j) {
              const float v = xp[row + j];
              if (v > bv || (std::isnan(v) && !std::isnan(bv))) bv = v, best = row + j;
            }
          }
          yp[oh * OW + ow] = bv;
          ap[oh * OW + ow] = static_cast<uint32_t>(best);
        }
    }
  });
}

void MaxPool2dModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                               const ParamDone&) {
  if (!gx) return;
  const Shape out = output_shape(in);
  const size_t planes = in[0] * in[1], HW = in[2] * in[3], P = out[2] * out[3];
  parallel_items(planes, HW, [&](size_t, size_t pl0, size_t pl1) {
    std::memset(gx + pl0 * HW, 0, (pl1 - pl0) * HW * sizeof(float));
    for (size_t pl = pl0; pl < pl1; ++pl) {
      const uint32_t* ap = argmax_.data() + pl * P;
      const float* gp = gy + pl * P;
      float* xp = gx + pl * HW;
      for (size_t o = 0; o < P; ++o) xp[ap[o]] += gp[o];
    }
  });
}

// ---------------------------------------------------------------- AvgPool2d

void AvgPool2dModule::forward(const float* x, const Shape& in, float* y, bool) {
  const Shape out = output_shape(in);
  const size_t planes = in[0] * in[1], H = in[2], W = in[3], OH = out[2], OW = out[3];
  const float inv = 1.0f / static_cast<float>(k_ * k_);
  parallel_items(planes, H * W, [&](size_t, size_t pl0, size_t pl1) {
    for (size_t pl = pl0; pl < pl1; ++pl) {
      const float* xp = x + pl * H * W;
      float* yp = y + pl * OH * OW;
      for (size_t oh = 0; oh < OH; ++oh) {
        float* yr = yp + oh * OW;
        std::fill(yr, yr + OW, 0.0f);
        for (size_t i = 0; i < k_; ++i) {
          const float* xr = xp + (oh * s_ + i) * W;
          for (size_t j = 0; j < k_; ++j)
            for (size_t ow = 0; ow < OW; ++ow) yr[ow] += xr[ow * s_ + j];
        }
        for (size_t ow = 0; ow < OW; ++ow) yr[ow] *= inv;
      }
    }
  });
}

void AvgPool2dModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                               const ParamDone&) {
  if (!gx) return;
  const Shape out = output_shape(in);
  const size_t planes = in[0] * in[1], H = in[2], W = in[3], OH = out[2], OW = out[3];
  const float inv = 1.0f / static_cast<float>(k_ * k_);
  parallel_items(planes, H * W, [&](size_t, size_t pl0, size_t pl1) {
    std::memset(gx + pl0 * H * W, 0, (pl1 - pl0) * H * W * sizeof(float));
    for (size_t pl = pl0; pl < pl1; ++pl) {
      float* xp = gx + pl * H * W;
      const float* gp = gy + pl * OH * OW;
      for (size_t oh = 0; oh < OH; ++oh) {
        const float* gr = gp + oh * OW;
        for (size_t i = 0; i < k_; ++i) {
          float* xr = xp + (oh * s_ + i) * W;
          for (size_t j = 0; j < k_; ++j)
            for (size_t ow = 0; ow < OW; ++ow) xr[ow * s_ + j] += gr[ow] * inv;
        }
      }
    }
  });
}

// ---------------------------------------------------------------- GlobalAvgPool2d

Shape GlobalAvgPool2dModule::output_shape(const Shape& in) const {
  check_nchw(*this, in);
  CX_CHECK(in[2] * in[3] >= 1, InvalidArgument, repr(), " expects images of at least 1 x 1, got ", shape_str(in));
  return {in[0], in[1]};
}

void GlobalAvgPool2dModule::forward(const float* x, const Shape& in, float* y, bool) {
  const size_t planes = in[0] * in[1], HW = in[2] * in[3];
  parallel_items(planes, HW, [&](size_t, size_t pl0, size_t pl1) {
    for (size_t pl = pl0; pl < pl1; ++pl) y[pl] = static_cast<float>(kernels::sum(x + pl * HW, HW) / HW);
  });
}

void GlobalAvgPool2dModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                                     const ParamDone&) {
  if (!gx) return;
  const size_t planes = in[0] * in[1], HW = in[2] * in[3];
  const float inv = 1.0f / static_cast<float>(HW);
  parallel_items(planes, HW, [&](size_t, size_t pl0, size_t pl1) {
    for (size_t pl = pl0; pl < pl1; ++pl) std::fill(gx + pl * HW, gx + (pl + 1) * HW, gy[pl] * inv);
  });
}

// ---------------------------------------------------------------- files

namespace {

template <typename Pool>
std::shared_ptr<Module> read_pool(ByteReader& r) {
  const uint64_t k = r.u64(), s = r.u64();
  if (k > static_cast<uint64_t>(kMaxWindow) || s > static_cast<uint64_t>(kMaxWindow))
    r.fail("bad pooling window " + std::to_string(k) + ", stride " + std::to_string(s));
  return std::make_shared<Pool>(static_cast<int64_t>(k), static_cast<int64_t>(s));
}

// Note [Layer ids] in registry.h.
const LayerRegistration kMaxPool2d{13, "MaxPool2d", read_pool<MaxPool2dModule>};
const LayerRegistration kAvgPool2d{14, "AvgPool2d", read_pool<AvgPool2dModule>};
const LayerRegistration kGlobalAvgPool2d{15, "GlobalAvgPool2d",
                                         [](ByteReader&) -> std::shared_ptr<Module> {
                                           return std::make_shared<GlobalAvgPool2dModule>();
                                         }};

}  // namespace

}  // namespace cx::nn
