#include "train/cpu_engine.h"

namespace cx::train {

CpuEngine::CpuEngine(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
                     std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
                     std::shared_ptr<DistributedDataParallel> ddp)
    : model_(std::move(model)),
      loss_(std::move(loss)),
      opt_(std::move(opt)),
      group_(std::move(group)),
      ddp_(std::move(ddp)) {}

BatchStats CpuEngine::loss_of(const nn::Tensor& out, const nn::BatchTargets& y) {
  const nn::BatchSums sums = loss_->forward_batch(out.data(), out.shape(), y);
  return BatchStats{sums.loss_sum, sums.correct, static_cast<double>(y.rows())};
}

BatchStats CpuEngine::train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  model_->train(true);
  const nn::Tensor& out = ddp_->forward(x, x_shape);  // broadcasts rank 0's buffers first (broadcast_buffers)
  BatchStats s = loss_of(out, y);
  const nn::Tensor& g = loss_->backward();
  ddp_->backward(g.data(), g.shape(), /*input_grad=*/false);
  averages_.settle(model_->flat_params());  // the last step's EMA update, while the buckets are reduced
  if (zero_) {
    zero_->step(clip_);  // clips its shard between the reduce-scatter and the step
  } else {
    if (clip_.on()) {
      ddp_->sync_gradients();  // the average over ranks, then update_parameters has nothing left to sync
      if (!ddp_->step_skipped())  // a skipped step's gradient is not finite: nothing to clip
        clip_gradients(model_->flat_grads(), model_->num_parameters(), clip_, nullptr, group_->rank());
    }
    ddp_->update_parameters(*opt_);
  }
  averages_.owe();
  return s;
}

BatchStats CpuEngine::eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) {
  return loss_of(model_->forward(x, x_shape), y);
}

BatchStats CpuEngine::reduce_stats(const BatchStats& s) {
  double v[3] = {s.loss_sum, s.correct, s.count};
  group_->all_reduce(v, 3, distributed::DataType::kFloat64, distributed::ReduceOp::kSum, false);
  return BatchStats{v[0], v[1], v[2]};
}

void CpuEngine::all_gather_host(const void* in, void* out, size_t bytes) {
  std::vector<void*> outs;
  for (int r = 0; r < group_->size(); ++r) outs.push_back(static_cast<char*>(out) + bytes * r);
  group_->all_gather(in, outs, bytes, distributed::DataType::kUInt8, false);
}

void CpuEngine::broadcast_buffers() { ddp_->broadcast_buffers(); }

void CpuEngine::broadcast_host(void* buf, size_t bytes, int root) {
  group_->broadcast(buf, bytes, distributed::DataType::kUInt8, root, false);
}

}  // namespace cx::train
