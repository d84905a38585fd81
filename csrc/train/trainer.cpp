#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace cx::train {

TrainerCore::TrainerCore(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                         std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                         DDPConfig cfg)
    : model_(std::move(model)), loss_(std::move(loss)), opt_(std::move(opt)), group_(std::move(group)) {
  CX_CHECK(model_ != nullptr, InvalidArgument, "DistributedTrainer: model is None");
  CX_CHECK(loss_ != nullptr, InvalidArgument, "DistributedTrainer: loss_fn is None");
  CX_CHECK(opt_ != nullptr, InvalidArgument, "DistributedTrainer: optimizer is None");
  CX_CHECK(model_->num_parameters() > 0, InvalidArgument,
           "DistributedTrainer: the model has no parameters; add() layers before creating the trainer");
  if (group_->config().backend == distributed::Backend::kNccl) {
    // Note [The model on the GPU]: the host DDP keeps its bookkeeping (rank,
    // per-rank dropout streams) but moves no data; GpuTrainer broadcasts rank
    // 0's parameters on the device.
    DDPConfig host_cfg = cfg;
    host_cfg.broadcast_parameters = false;
    ddp_ = std::make_shared<DistributedDataParallel>(model_, host_cfg, group_);
    gpu_ = std::make_unique<GpuTrainer>(model_, loss_, opt_, group_, cfg, *ddp_);
  } else {
    ddp_ = std::make_shared<DistributedDataParallel>(model_, cfg, group_);
  }
}

void TrainerCore::all_gather_host(const void* in, void* out, size_t bytes) {
  if (gpu_) return gpu_->all_gather_host(in, out, bytes);
  std::vector<void*> outs;
  for (int r = 0; r < group_->size(); ++r) outs.push_back(static_cast<char*>(out) + bytes * r);
  group_->all_gather(in, outs, bytes, distributed::DataType::kUInt8, false);
}

void TrainerCore::broadcast_host(void* buf, size_t bytes, int root) {
  if (gpu_) return gpu_->broadcast_host(buf, bytes, root);
  group_->broadcast(buf, bytes, distributed::DataType::kUInt8, root, false);
}

void TrainerCore::gather(const float* X, const nn::Shape& x_shape, const Targets& y, const int64_t* idx, size_t n) {
  size_t row = nn::numel(x_shape) / (x_shape[0] ? x_shape[0] : 1);
  size_t rows = std::min(x_shape[0], y.rows);
  xb_shape_ = x_shape;
  xb_shape_[0] = n;
  x_.resize(n * row);
  for (size_t i = 0; i < n; ++i) {
    CX_CHECK(idx[i] >= 0 && static_cast<size_t>(idx[i]) < rows, InvalidArgument, "DistributedTrainer: sample index ",
             idx[i], " is out of range for ", rows, " rows; was the sampler built for another data set?");
    std::memcpy(x_.data() + i * row, X + static_cast<size_t>(idx[i]) * row, row * sizeof(float));
  }
  y_kind_ = y.kind;
  if (y.kind == Targets::Kind::kFloat32) {
    size_t yr = nn::numel(y.row_shape);
    y_dense_.resize(n * yr);
    for (size_t i = 0; i < n; ++i)
      std::memcpy(y_dense_.data() + i * yr, static_cast<const float*>(y.data) + idx[i] * yr, yr * sizeof(float));
    yb_shape_ = {n};
    yb_shape_.insert(yb_shape_.end(), y.row_shape.begin(), y.row_shape.end());
  } else {
    y_labels_.resize(n);
    for (size_t i = 0; i < n; ++i)
      y_labels_[i] = y.kind == Targets::Kind::kInt64 ? static_cast<const int64_t*>(y.data)[idx[i]]
                                                     : static_cast<const int32_t*>(y.data)[idx[i]];
  }
}

void TrainerCore::slice(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin, size_t n) {
  std::vector<int64_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = static_cast<int64_t>(begin + i);
  gather(X, x_shape, y, idx.data(), n);
}

void TrainerCore::loss_forward(const nn::Tensor& out, size_t n, BatchStats& s) {
  const nn::Shape& os = out.shape();
  float l;
  double correct;
  if (auto* ce = dynamic_cast<nn::CrossEntropyLoss*>(loss_.get())) {
    l = y_kind_ == Targets::Kind::kFloat32 ? ce->forward(out.data(), os, y_dense_.data(), yb_shape_)
                                           : ce->forward(out.data(), os, y_labels_.data(), n);
    correct = static_cast<double>(ce->correct());
  } else {
    CX_CHECK(y_kind_ == Targets::Kind::kFloat32, TypeMismatch, "DistributedTrainer: ", loss_->repr(),
             " needs float32 targets shaped like the model's output, got integer labels");
    if (auto* mse = dynamic_cast<nn::MSELoss*>(loss_.get())) {
      l = mse->forward(out.data(), os, y_dense_.data(), yb_shape_);
      correct = std::numeric_limits<double>::quiet_NaN();
    } else if (auto* bce = dynamic_cast<nn::BCEWithLogitsLoss*>(loss_.get())) {
      l = bce->forward(out.data(), os, y_dense_.data(), yb_shape_);
      // Per row: the fraction of outputs on the right side of 0.5.
      size_t per = out.numel() / n, hit = 0;
      for (size_t i = 0; i < out.numel(); ++i) hit += (out.data()[i] > 0.f) == (y_dense_[i] > 0.5f);
      correct = static_cast<double>(hit) / static_cast<double>(per ? per : 1);
    } else {
      CX_THROW(TypeMismatch, "DistributedTrainer: unsupported loss ", loss_->repr());
    }
  }
  s.loss_sum += static_cast<double>(l) * n;
  s.correct += correct;
  s.count += n;
}

BatchStats TrainerCore::train_batch(const float* X, const nn::Shape& x_shape, const Targets& y,
                                    DistributedBatchIterator& it) {
  auto [idx, n] = it.next_view();
  BatchStats s;
  if (n == 0) return s;
  gather(X, x_shape, y, idx, n);
  if (gpu_) {
    bool labels = y_kind_ != Targets::Kind::kFloat32;
    return gpu_->train_batch(x_.data(), xb_shape_, labels ? y_labels_.data() : nullptr,
                             labels ? nullptr : y_dense_.data(), yb_shape_);
  }
  model_->train(true);
  const nn::Tensor& out = model_->forward(x_.data(), xb_shape_);
  loss_forward(out, n, s);
  const nn::Tensor& g = loss_->backward();
  ddp_->backward(g.data(), g.shape(), /*input_grad=*/false);
  ddp_->update_parameters(*opt_);
  return s;
}

BatchStats TrainerCore::evaluate(const float* X, const nn::Shape& x_shape, const Targets& y, size_t begin,
                                 size_t end, size_t batch) {
  BatchStats s;
  bool was_training = model_->training();
  model_->eval();
  try {
    for (size_t b = begin; b < end; b += batch) {
      size_t n = std::min(batch, end - b);
      slice(X, x_shape, y, b, n);
      if (gpu_) {
        bool labels = y_kind_ != Targets::Kind::kFloat32;
        BatchStats e = gpu_->eval_batch(x_.data(), xb_shape_, labels ? y_labels_.data() : nullptr,
                                        labels ? nullptr : y_dense_.data(), yb_shape_);
        s.loss_sum += e.loss_sum, s.correct += e.correct, s.count += e.count;
        continue;
      }
      const nn::Tensor& out = model_->forward(x_.data(), xb_shape_);
      loss_forward(out, n, s);
    }
  } catch (...) {
    model_->train(was_training);
    throw;
  }
  model_->train(was_training);
  return s;
}

BatchStats TrainerCore::evaluate_all(const float* X, const nn::Shape& x_shape, const Targets& y, size_t batch) {
  CX_CHECK(batch >= 1, InvalidArgument, "DistributedTrainer.evaluate: batch_size must be >= 1");
  const size_t n = x_shape[0];
  const size_t p = static_cast<size_t>(group_->size()), r = static_cast<size_t>(group_->rank());
  return reduce_stats(evaluate(X, x_shape, y, n * r / p, n * (r + 1) / p, batch));
}

BatchStats TrainerCore::reduce_stats(const BatchStats& s) {
  if (gpu_) return gpu_->reduce_stats(s);
  double v[3] = {s.loss_sum, s.correct, s.count};
  group_->all_reduce(v, 3, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  return BatchStats{v[0], v[1], v[2]};
}

}  // namespace cx::train
