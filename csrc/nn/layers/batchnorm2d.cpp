#include "nn/layers/batchnorm2d.h"

#include <cmath>
#include <vector>

#include "common/error.h"
#include "nn/kernels.h"
#include "nn/parallel.h"
#include "nn/registry.h"
#include "nn/serialize.h"

namespace cx::nn {

Shape BatchNorm2dModule::output_shape(const Shape& in) const {
  CX_CHECK(in.size() == 4 && in[1] == features(), InvalidArgument, repr(), " expects input of shape (batch, ",
           features(), ", height, width), got ", shape_str(in));
  return in;
}

// ---------------------------------------------------------------- BatchNorm over images

// The two passes of BatchNormModule::forward (Note [SyncBatchNorm statistics]),
// over each channel's batch*H*W values: rows of H*W floats reduced in float
// lanes, added up per channel in double. x-hat is not stored: backward gets x
// back and recomputes it from mean_ and invstd_, which saves writing (and
// reading) a copy of the activations.
void BatchNormModule::forward_nchw(const float* x, const Shape& in, float* y, bool training) {
  const size_t N = in[0], C = f_, S = in[2] * in[3];
  last_training_ = training;
  last_synced_ = training && sum_;
  invstd_.assign(C, 0.0f);
  mean_.assign(C, 0.0f);
  if (training) {
    const double local = static_cast<double>(N) * S;
    if (!sum_)
      CX_CHECK(local >= 2, InvalidArgument, repr(), " needs more than one value per channel (batch x height x "
               "width) in training mode, got input ", shape_str(in));
    stats_.assign(C + 1, 0.0);  // [values per channel, sum of each channel ...]
    stats_[0] = local;
    // Channels in parts, each summed in sample order as on one thread (Note [One pool for the model math]).
    parallel_items(C, N * S, [&](size_t, size_t c0, size_t c1) {
      for (size_t n = 0; n < N; ++n)
        for (size_t c = c0; c < c1; ++c) stats_[1 + c] += kernels::sum(x + (n * C + c) * S, S);
    });
    if (sum_) sum_(stats_.data(), C + 1);
    const double M = stats_[0];
    // Every rank has the same M, so either all of them throw here or none.
    CX_CHECK(M >= 2, InvalidArgument, repr(), " needs more than one value per channel over all ranks in training "
             "mode, got ", M, " (this rank's input: ", shape_str(in), ")");
    last_count_ = M;
    for (size_t c = 0; c < C; ++c) mean_[c] = static_cast<float>(stats_[1 + c] / M);
    std::vector<double> var(C, 0.0);
    parallel_items(C, N * S, [&](size_t, size_t c0, size_t c1) {
      for (size_t n = 0; n < N; ++n)
        for (size_t c = c0; c < c1; ++c) var[c] += kernels::sum_sq_dev(x + (n * C + c) * S, S, mean_[c]);
    });
    if (sum_) sum_(var.data(), C);
    for (size_t c = 0; c < C; ++c) {
      invstd_[c] = static_cast<float>(1.0 / std::sqrt(var[c] / M + eps_));
      running_mean_[c] = static_cast<float>((1.0 - momentum_) * running_mean_[c] + momentum_ * (stats_[1 + c] / M));
      running_var_[c] = static_cast<float>((1.0 - momentum_) * running_var_[c] + momentum_ * var[c] / (M - 1));
    }
  } else {
    for (size_t c = 0; c < C; ++c) {
      mean_[c] = running_mean_[c];
      invstd_[c] = 1.0f / std::sqrt(running_var_[c] + eps_);
    }
  }
  // y = gamma * invstd * (x - mean) + beta
  const float *gamma = param(0), *beta = param(1);
  parallel_items(N * C, S, [&](size_t, size_t p0, size_t p1) {
    for (size_t pl = p0; pl < p1; ++pl) {
      const size_t c = pl % C;
      kernels::affine(x + pl * S, S, gamma[c] * invstd_[c], mean_[c], beta[c], y + pl * S);
    }
  });
}

void BatchNormModule::backward_nchw(const float* x, const Shape& in, const float* gy, float* gx,
                                    const ParamDone& done) {
  const size_t N = in[0], C = f_, S = in[2] * in[3];
  // Per channel: sum of dy, and sum of dy * x-hat = invstd * sum of dy * (x - mean).
  std::vector<double> sums(2 * C, 0.0);
  parallel_items(C, 2 * N * S, [&](size_t, size_t c0, size_t c1) {
    for (size_t n = 0; n < N; ++n)
      for (size_t c = c0; c < c1; ++c) {
        const size_t off = (n * C + c) * S;
        sums[c] += kernels::sum(gy + off, S);
        sums[C + c] += kernels::dot_dev(gy + off, x + off, S, mean_[c]);
      }
  });
  for (size_t c = 0; c < C; ++c) sums[C + c] *= invstd_[c];
  // The local sums: DDP averages these gradients (Note [SyncBatchNorm statistics]).
  float *dgamma = grad(0), *dbeta = grad(1);
  for (size_t c = 0; c < C; ++c) dbeta[c] += static_cast<float>(sums[c]);
  done(1);
  for (size_t c = 0; c < C; ++c) dgamma[c] += static_cast<float>(sums[C + c]);
  done(0);
  if (!gx) return;
  const float* gamma = param(0);
  if (!last_training_) {
    parallel_items(N * C, S, [&](size_t, size_t p0, size_t p1) {
      for (size_t pl = p0; pl < p1; ++pl) {
        const size_t c = pl % C;
        kernels::affine(gy + pl * S, S, gamma[c] * invstd_[c], 0.0f, 0.0f, gx + pl * S);
      }
    });
    return;
  }
  double inv_m = 1.0 / (static_cast<double>(N) * S);
  if (last_synced_) {  // dL/dx needs both sums over the whole batch
    sum_(sums.data(), 2 * C);
    inv_m = 1.0 / last_count_;
  }
  // dx = gamma * invstd * (dy - mean(dy) - x-hat * mean(dy * x-hat)), x-hat = (x - mean) * invstd:
  // dx = k1 * dy + k2 * (x - mean) + k3.
  std::vector<float> k(3 * C);
  for (size_t c = 0; c < C; ++c) {
    const double gi = static_cast<double>(gamma[c]) * invstd_[c];
    k[3 * c] = static_cast<float>(gi);
    k[3 * c + 1] = static_cast<float>(-gi * invstd_[c] * inv_m * sums[C + c]);
    k[3 * c + 2] = static_cast<float>(-gi * inv_m * sums[c]);
  }
  parallel_items(N * C, S, [&](size_t, size_t p0, size_t p1) {
    for (size_t pl = p0; pl < p1; ++pl) {
      const size_t c = pl % C;
      kernels::affine2(gy + pl * S, x + pl * S, S, k[3 * c], k[3 * c + 1], mean_[c], k[3 * c + 2], gx + pl * S);
    }
  });
}

// ---------------------------------------------------------------- files

namespace {

std::shared_ptr<Module> read_batchnorm2d(ByteReader& r) {
  uint64_t f = r.u64();
  float eps = r.f32(), mom = r.f32();
  if (f == 0 || f > r.remaining() / 4) r.fail("bad BatchNorm2d size " + std::to_string(f));
  return std::make_shared<BatchNorm2dModule>(f, eps, mom);
}

// Note [Layer ids] in registry.h.
const LayerRegistration kBatchNorm2dRegistration{16, "BatchNorm2d", read_batchnorm2d};

}  // namespace

}  // namespace cx::nn
