// The losses on a GPU: each loss's device forward_batch (cuda/nn.cu's kernels,
// which write dL/d(output) and sum the loss and the correct rows into device
// doubles) and how those sums become the batch's metrics. The CPU side of the
// same classes is loss.cpp; the checks read the same.
#include <limits>

#include "common/error.h"
#include "cuda/device.h"
#include "nn/loss.h"

namespace cx::nn {

namespace {
using u64 = unsigned long long;
}  // namespace

void CrossEntropyLoss::forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                                     const BatchTargets& on_device, float* gout, double* stats) const {
  CX_CHECK(os.size() == 2, InvalidArgument, "CrossEntropyLoss: expected output of shape (batch, classes), got ",
           shape_str(os));
  const size_t rows = os[0];
  const unsigned grid = static_cast<unsigned>((rows + 7) / 8);  // a warp per row
  if (t.labels) {
    for (size_t r = 0; r < rows; ++r)  // as the CPU forward checks them, on the host copy
      CX_CHECK(t.labels[r] >= 0 && static_cast<size_t>(t.labels[r]) < os[1], InvalidArgument,
               "CrossEntropyLoss: label ", t.labels[r], " at row ", r, " is out of range [0, ", os[1], ")");
    dev.launch(dev.fn("cx_nn_ce_labels"), grid, 256, out, on_device.labels, gout, stats, u64(rows), u64(os[1]));
  } else {
    CX_CHECK(t.shape == os, InvalidArgument, "CrossEntropyLoss: target must have the output's shape ", shape_str(os),
             ", got ", shape_str(t.shape));
    dev.launch(dev.fn("cx_nn_ce_dense"), grid, 256, out, on_device.dense, gout, stats, u64(rows), u64(os[1]));
  }
}

BatchSums CrossEntropyLoss::batch_sums(const double* st, const Shape&) const { return {st[0], st[1]}; }

namespace {
// MSE and BCE: one kernel over the elements.
void elementwise_loss(const Loss& loss, const char* kernel, cuda::Device& dev, const float* out, const Shape& os,
                      const BatchTargets& t, const BatchTargets& on_device, float* gout, double* stats) {
  check_dense_targets(loss, t);
  CX_CHECK(t.shape == os, InvalidArgument, loss.repr(), ": target must have the output's shape ", shape_str(os),
           ", got ", shape_str(t.shape));
  const u64 n = numel(os);
  dev.launch(dev.fn(kernel), cuda::Device::grid_for(n), 256, out, on_device.dense, gout, stats, n);
}
// They average over elements: the batch's loss times its rows, as the CPU reports it.
double loss_sum(const double* st, const Shape& os) {
  return st[0] / static_cast<double>(numel(os)) * static_cast<double>(os[0]);
}
}  // namespace

void MSELoss::forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                            const BatchTargets& on_device, float* gout, double* stats) const {
  elementwise_loss(*this, "cx_nn_mse", dev, out, os, t, on_device, gout, stats);
}

BatchSums MSELoss::batch_sums(const double* st, const Shape& os) const {
  return {loss_sum(st, os), std::numeric_limits<double>::quiet_NaN()};
}

void BCEWithLogitsLoss::forward_batch(cuda::Device& dev, const float* out, const Shape& os, const BatchTargets& t,
                                      const BatchTargets& on_device, float* gout, double* stats) const {
  elementwise_loss(*this, "cx_nn_bce", dev, out, os, t, on_device, gout, stats);
}

BatchSums BCEWithLogitsLoss::batch_sums(const double* st, const Shape& os) const {
  const size_t per = numel(os) / os[0];
  return {loss_sum(st, os), st[1] / static_cast<double>(per ? per : 1)};
}

}  // namespace cx::nn
