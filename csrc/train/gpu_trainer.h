// defines: GpuTrainer, the training step of TrainerCore on GPU LOCAL_RANK when
// the process group's backend is NCCL (Note [The model on the GPU] in
// gpu/runtime.h).
//
// One step: the gathered batch is copied to the device once; forward, the
// loss and backward run there (GpuModel); as each bucket of gradients becomes
// final in backward its AVG all-reduce is queued on NCCL (the same buckets as
// DistributedDataParallel, assign_buckets), so NCCL overlaps the rest of
// backward; then the optimizer's update runs on the device over the flat
// parameter buffer. The host waits for the NCCL results, and once at the end
// of the step to read the loss sums.
//
// The optimizer's state (moments, step count) lives on the device while
// training; to_host() writes it and the model's parameters back into the host
// objects (for checkpoints, saving, predict), from_host() reads them again
// (after a checkpoint is loaded).
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "gpu/model.h"
#include "gpu/runtime.h"
#include "nn/loss.h"
#include "nn/optimizer.h"
#include "train/buckets.h"
#include "train/ddp.h"

namespace cx::train {

struct BatchStats;

class GpuTrainer {
 public:
  GpuTrainer(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
             std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group, const DDPConfig& cfg,
             const DistributedDataParallel& host_ddp);
  ~GpuTrainer();

  // x: host rows (x_shape); labels (n) or dense targets (y_shape), whichever
  // the loss takes. Returns the batch's (loss sum, correct, rows).
  BatchStats train_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels, const float* dense,
                         const nn::Shape& y_shape);
  BatchStats eval_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels, const float* dense,
                        const nn::Shape& y_shape);
  BatchStats reduce_stats(const BatchStats& s);

  void to_host();
  void from_host();

  // Collectives on host bytes, staged through the device (NCCL moves device
  // memory only). Blocking.
  void all_gather_host(const void* in, void* out, size_t bytes);
  void broadcast_host(void* buf, size_t bytes, int root);

  std::string describe() const;  // "cuda:0 (NVIDIA H100 80GB HBM3), GEMM: cuBLAS (...)"

 private:
  // Queues the loss and its gradient (gout_) for the last forward's output;
  // read_loss waits for the stream and returns the batch's sums.
  void launch_loss(const nn::Shape& out_shape, const int64_t* labels, const nn::Shape& y_shape);
  BatchStats read_loss(const nn::Shape& out_shape);
  void upload_batch(const float* x, const nn::Shape& x_shape, const int64_t* labels, const float* dense,
                    const nn::Shape& y_shape);
  void read_optimizer();
  void optimizer_step();
  void launch_bucket(size_t b);

  // Declared first so it is destroyed last: every Buffer below frees into its context.
  std::unique_ptr<gpu::Device> dev_;
  std::shared_ptr<nn::SequentialModel> model_;
  std::shared_ptr<nn::Loss> loss_;
  std::shared_ptr<nn::Optimizer> opt_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::unique_ptr<gpu::GpuModel> gm_;

  // Device batch and loss.
  gpu::Buffer x_, labels_, dense_, gout_, stats_, staging_;
  const float* last_out_ = nullptr;  // the last forward's output (GpuModel's)
  // Optimizer state on the device.
  enum class Opt { kSgd, kAdam, kAdamW, kRmsprop } kind_ = Opt::kSgd;
  double momentum_ = 0, weight_decay_ = 0, eps_ = 0, alpha_ = 0;  // SGD and RMSprop (Adam: step_factors)
  bool nesterov_ = false;
  int64_t t_ = 0;
  gpu::Buffer s1_, s2_;  // SGD/RMSprop momentum buffer; Adam exp_avg, exp_avg_sq; RMSprop square_avg in s1_
  bool has_s1_ = false, has_s2_ = false;

  // Buckets: host_ddp's, copied.
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, pending_;
  size_t next_bucket_ = 0;
  std::vector<char> ready_;
  std::vector<distributed::ProcessGroup::WorkPtr> in_flight_;
  std::set<size_t> shapes_seen_;  // batch sizes that have run a step (Note [First step of a shape])
};

}  // namespace cx::train
