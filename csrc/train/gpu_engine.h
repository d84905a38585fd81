// defines: GpuEngine, the trainer's per-batch work on GPU LOCAL_RANK when the
// process group's backend is NCCL.
//
// Note [The model on the GPU]
// With BackendType.NCCL the trainer runs the model on GPU LOCAL_RANK. One step:
// the gathered batch is copied to the device once; rank 0's device buffers are
// broadcast (DDPConfig.broadcast_buffers, as the CPU engine's DDP forward:
// Note [Buffers across ranks] in ddp.h); forward, the loss and
// backward run there (nn::DeviceModel, each module's, loss's and optimizer's
// own device code: Note [Modules on the GPU] in nn/module.h); as each bucket of
// gradients becomes final in backward its AVG all-reduce is queued on NCCL (the
// same buckets and launch order as DistributedDataParallel: BucketScheduler),
// so NCCL overlaps the rest of backward; then the optimizer's update runs on
// the device over the flat parameter buffer. The host waits for the NCCL
// results, and once at the end of the step to read the loss sums. Everything
// goes through the CUDA driver API (cuda/): kernels are cuda/nn.cu, the GEMM is
// cuBLAS where one loads (cuda/blas.h).
//
// The optimizer's state lives on the device while training; to_host() writes
// it and the model's parameters back into the host objects (for checkpoints,
// saving, predict), from_host() reads them again (after a checkpoint is loaded).
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "distributed/process_group.h"
#include "nn/device_model.h"
#include "nn/loss.h"
#include "nn/optimizer.h"
#include "train/buckets.h"
#include "train/comm_hooks.h"
#include "train/ddp.h"
#include "train/engine.h"
#include "train/grad_clip.h"
#include "train/zero.h"

namespace cx::train {

class GpuEngine : public Engine {
 public:
  GpuEngine(std::shared_ptr<nn::SequentialModel> model, std::shared_ptr<nn::Loss> loss,
             std::shared_ptr<nn::Optimizer> opt, std::shared_ptr<distributed::ProcessGroup> group,
             const DDPConfig& cfg, std::shared_ptr<DistributedDataParallel> host_ddp);
  ~GpuEngine() override;

  float* input_buffer(size_t floats) override;  // page-locked: the batch's copy is a DMA
  BatchStats train_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) override;
  BatchStats eval_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y) override;
  BatchStats reduce_stats(const BatchStats& s) override;

  void to_host() override;
  void from_host() override;

  // Collectives on host bytes, staged through the device (NCCL moves device
  // memory only).
  void all_gather_host(const void* in, void* out, size_t bytes) override;
  void broadcast_host(void* buf, size_t bytes, int root) override;
  // The device buffers (DeviceModel::buffers()), on the device's stream: the
  // GPU twin of DistributedDataParallel::broadcast_buffers.
  void broadcast_buffers() override;

  std::string describe() const override;  // "cuda:0 (NVIDIA H100 80GB HBM3), GEMM: cuBLAS (...)"
  // TrainerCore::set_matmul_precision's, on the device's GEMMs.
  void set_matmul_precision(cuda::GemmPrecision p) { dev_->set_gemm_precision(p); }
  // TrainerCore::set_grad_clip's (checked there): from the next step on (Note [The GPU trainer's clipping and
  // 16-bit buckets] in gpu_engine.cpp).
  void set_grad_clip(const GradClip& c) { clip_ = c; }
  // TrainerCore's EMA (Note [EMA on the GPU] in gpu_engine.cpp): `host` (n floats, the parameters' count) is
  // copied to the device now, updated there after every step, and written back by settle_ema.
  void add_ema(float* host, size_t n, double decay);
  void settle_ema();
  void clear_ema() { emas_.clear(); }
  // ZeRO-1 on the GPU (Note [ZeRO-1 on the GPU] in gpu_engine.cpp), TrainerCore::set_shard_optimizer_state's:
  // collective; the host optimizer's state is made this rank's shard (on) or whole again (off).
  void set_zero(bool on);
  bool zero() const { return zero_; }
  // Collective under ZeRO-1: the whole optimizer state, from the host's shard (after to_host()).
  nn::StateDict zero_state_dict();
  // Not collective: a whole state, of which the host optimizer keeps this rank's shard (from_host() uploads it).
  void zero_load_state_dict(const nn::StateDict& sd);

 private:
  // Copies the batch to the device; returns its targets' device copies.
  nn::BatchTargets upload_batch(const float* x, const nn::Shape& x_shape, const nn::BatchTargets& y);
  // Queues the loss and its gradient (gout_) for the output `out`; read_loss
  // waits for the stream and returns the batch's sums.
  void launch_loss(const float* out, const nn::Shape& os, const nn::BatchTargets& y, const nn::BatchTargets& on_dev);
  BatchStats read_loss(const nn::Shape& os);
  void launch_bucket(size_t b);
  void wait_in_flight();
  // Note [Non-finite gradients on the GPU] (gpu_engine.cpp): counts the inf/NaN values of each parameter
  // among grads[lo, hi) into counters() + slot * parameters (and the last counter, the total);
  // conclude_nonfinite decides the step from nf_host_ (read with the loss).
  void count_nonfinite(size_t lo, size_t hi, size_t first_param, size_t slot);
  bool conclude_nonfinite();
  size_t stats_bytes() const;       // stats_: 4 doubles of loss sums, the clip's 16 bytes, then the counters
  unsigned int* counters() const;
  // The clip's part of stats_: the norm (a double), then two counters: NaN values under grad_clip_value, and
  // "cannot clip" (those NaN, or a norm that is not finite), which the optimizer's kernel reads as its skip.
  double* clip_norm() const;
  unsigned int* clip_counters() const;
  void clip_on_device();
  void update_emas();  // queues every EMA's update after the step (Note [EMA on the GPU])
  size_t state_floats() const { return zero_ ? shard_.count : dm_->size(); }  // parameters the state is for
  void all_gather_parameters();                  // ZeRO-1: every rank's shard of the device parameters
  void gather_shards_host(const float* mine, float* out);  // ZeRO-1: a host state array made whole
  std::string zero_who(const char* what) const;

  // Declared first so it is destroyed last: every Buffer below frees into its context.
  std::unique_ptr<cuda::Device> dev_;
  std::shared_ptr<nn::SequentialModel> model_;
  std::shared_ptr<nn::Loss> loss_;
  std::shared_ptr<nn::Optimizer> opt_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::unique_ptr<nn::DeviceModel> dm_;
  nn::Optimizer::DeviceArrays opt_state_;

  // Device batch and loss.
  cuda::Buffer x_, labels_, dense_, gout_, stats_, staging_;
  cuda::Buffer buffer_pack_;  // broadcast_buffers' message
  cuda::HostBuffer host_x_;   // the trainer gathers each batch's rows here (input_buffer)

  // The non-finite check: parameter bounds in the flat buffer (parameters + 1); the host copy of the counters
  // (per parameter this rank's own gradient's, then the average's, then the average's total).
  cuda::Buffer nf_bounds_;
  std::vector<uint32_t> nf_host_;
  std::vector<unsigned char> host_stats_;  // read_loss's copy of stats_
  bool checking_ = false;  // this step's: DDPConfig.nonfinite is not "off"

  GradClip clip_;                              // DistributedTrainingConfig.grad_clip_norm / grad_clip_value
  cuda::Buffer clip_part_;                     // cx_nn_sum_squares' per-block sums, then the coefficient
  CommHookKind hook_ = CommHookKind::kNone;    // DDPConfig.comm_hook: none, fp16 or bf16
  struct Ema {
    float* host;
    size_t n;
    float d, c;  // decay and 1 - decay, as train::ema_update rounds them
    cuda::Buffer dev;
  };
  std::vector<Ema> emas_;
  cuda::Buffer wire_;                          // fp16/bf16: the buckets in 16 bits, as NCCL reduces them
  bool zero_ = false;                          // DistributedTrainingConfig.shard_optimizer_state (ZeRO-1)
  Shard shard_;                                // this rank's parameters then (zero.h's shard_of)
  size_t q_ = 0;                               // floats of every shard but the last's

  std::shared_ptr<DistributedDataParallel> host_ddp_;  // its mode, counters and messages for the check
  BucketScheduler sched_;  // the host DDP's buckets, so both devices cut the gradients the same way
  std::vector<distributed::ProcessGroup::WorkPtr> in_flight_;
  std::set<size_t> shapes_seen_;  // batch sizes that have run a step (Note [First step of a shape])
  bool broadcast_buffers_ = true;  // DDPConfig.broadcast_buffers: before every training forward
};

}  // namespace cx::train
