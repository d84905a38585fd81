// defines: BatchNorm2dModule, batch normalisation of NCHW images (as
// torch.nn.BatchNorm2d), on the CPU and the GPU (BatchNormModule's device code
// takes images: modules_gpu.cpp).
//
// BatchNormModule over (batch, C, H, W): the statistics of channel c are those
// of its batch*H*W values, gamma (weight, starts at 1) and beta (bias, starts
// at 0) are per channel, and so are the running statistics, which train/
// broadcasts from rank 0 like BatchNormModule's (Note [Buffers across ranks]
// in train/ddp.h). convert_sync_batchnorm() turns it into a SyncBatchNormModule,
// which takes images too: its statistics are then every rank's batch*H*W values
// per channel (Note [SyncBatchNorm statistics] in nn/modules.h). The arithmetic
// is BatchNormModule::forward_nchw / backward_nchw (batchnorm2d.cpp), which the
// two share.
#pragma once

#include "nn/modules.h"

namespace cx::nn {

class BatchNorm2dModule : public BatchNormModule {
 public:
  explicit BatchNorm2dModule(size_t features, float eps = 1e-5f, float momentum = 0.1f)
      : BatchNormModule("BatchNorm2dModule", features, eps, momentum) {}
  std::string type_name() const override { return "BatchNorm2d"; }
  Shape output_shape(const Shape& in) const override;
};

}  // namespace cx::nn
