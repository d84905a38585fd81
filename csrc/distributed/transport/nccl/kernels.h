// defines: Kernels, our CUDA kernels (csrc/cuda/*.cu) loaded into one context.
// Built only where nvcc was found at build time (CX_WITH_CUDA); elsewhere
// Kernels::available() is false and the NCCL backend does without them.
#pragma once

#include <cstddef>

#include "distributed/transport/nccl/cuda_driver.h"
#include "distributed/types.h"

namespace cx::distributed::cuda {

class Kernels {
 public:
  static bool available();  // this build embeds the kernels

  // Loads the module into the current context (lazily, on first use).
  Kernels() = default;
  ~Kernels();
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

  // x[i] *= f for n elements of a floating-point dtype, queued on `s`.
  void scale(void* x, size_t n, DataType dt, double f, CUstream s);

 private:
  void load();
  CUmodule mod_ = nullptr;
  CUfunction f32_ = nullptr, f64_ = nullptr, f16_ = nullptr, bf16_ = nullptr;
};

}  // namespace cx::distributed::cuda
