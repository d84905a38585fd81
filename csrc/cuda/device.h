// defines: Device (one GPU's primary context, a stream, the model's kernels of
// nn.cu and a GEMM), Buffer (a grow-only device allocation), HostBuffer (its
// page-locked host twin), Event.
//
// All work is queued on the Device's stream in order; the host waits only where
// it reads a result back. The GEMM is cuBLAS (blas.h) or, where none loads, our
// own tiled kernel (cx_nn_sgemm); CX_GPU_GEMM=tiled forces the kernel (tests
// compare the two).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/blas.h"
#include "cuda/driver.h"
#include "cuda/module.h"

namespace cx::cuda {

class Buffer {
 public:
  Buffer() = default;
  ~Buffer();
  Buffer(Buffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = 0, o.bytes_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // At least `bytes` (grow-only; growing drops the old contents).
  void reserve(size_t bytes);
  float* f() const { return reinterpret_cast<float*>(p_); }
  void* get() const { return reinterpret_cast<void*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  CUdeviceptr p_ = 0;
  size_t bytes_ = 0;
};

// Grow-only page-locked host memory: a copy from it to the device is a DMA the
// host does not wait for (from pageable memory the driver first copies it into
// a staging buffer of its own, on the host's time).
class HostBuffer {
 public:
  HostBuffer() = default;
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  // At least `bytes` (growing drops the old contents and waits for the work
  // queued in the context, which may still be reading the old memory).
  void reserve(size_t bytes);
  float* f() const { return static_cast<float*>(p_); }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A CUDA event (no timing) in the current context.
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  CUevent get() const { return ev_; }

 private:
  CUevent ev_ = nullptr;
};

class Device {
 public:
  // Retains GPU `ordinal`'s primary context (the one CuPy and NCCL use), makes
  // it current on this thread, creates a stream and loads nn.cu's kernels.
  // Throws the driver's clear errors (no GPU, LOCAL_RANK beyond the device
  // count) and, in a build without kernels, says to rebuild where nvcc is found.
  explicit Device(int ordinal);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int ordinal() const { return ordinal_; }
  CUstream stream() const { return stream_; }
  void make_current() const;
  std::string name() const;

  // Queued on stream(). upload from pageable host memory returns once the
  // driver has taken the bytes; download waits for the stream.
  void upload(void* dst, const void* src, size_t bytes);
  void download(void* dst, const void* src, size_t bytes);
  void copy(void* dst, const void* src, size_t bytes);
  void zero(void* dst, size_t bytes);
  void sync();

  // Row-major C = alpha op(A) op(B) + beta C (op(A) M x K, op(B) K x N).
  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc);
  // gemm() `batch` times, the i-th on A + i * sa, B + i * sb, C + i * sc: one cuBLAS call where it has
  // the strided batched GEMM, else a gemm() each.
  void gemm_batched(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, size_t sa,
                    const float* B, int ldb, size_t sb, float beta, float* C, int ldc, size_t sc, int batch);
  // "cuBLAS (<path>)" or "pycyxwiz tiled kernel (<why>)".
  const std::string& gemm_backend() const { return gemm_desc_; }
  // What gemm()'s inputs are rounded to (Note [GEMM precision] in blas.cpp);
  // anything but float32 needs cuBLAS with cublasGemmEx (InvalidArgument
  // saying why not otherwise).
  void set_gemm_precision(GemmPrecision p);
  GemmPrecision gemm_precision() const { return precision_; }

  // Kernels of csrc/cuda/nn.cu, by name (cached).
  CUfunction fn(const char* name) { return nn_->fn(name); }
  // Launch with a 1-D grid; each argument is passed by address as the kernel
  // expects, so the types must match the kernel's parameters exactly.
  template <typename... A>
  void launch(CUfunction f, unsigned grid, unsigned block, A... a) {
    void* args[] = {static_cast<void*>(&a)...};
    launch_raw(f, grid, 1, block, 1, args);
  }
  // The same with a 2-D grid and block.
  template <typename... A>
  void launch2(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, A... a) {
    void* args[] = {static_cast<void*>(&a)...};
    launch_raw(f, gx, gy, bx, by, args);
  }
  void launch_raw(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, void** args);
  // A grid for n elements at 256 threads per block (grid-stride kernels).
  static unsigned grid_for(size_t n, unsigned block = 256);
  // The runs a channel's `per_channel` values are split in for cx_nn_channel_sums and BatchNorm2d's kernels
  // (Note [Channel sums in runs] in cuda/nn.cu): at least 4096 values each, at most 64 runs, so C channels
  // take C x runs blocks.
  static unsigned channel_runs(size_t per_channel) {
    return static_cast<unsigned>(per_channel / 4096 >= 64 ? 64 : per_channel / 4096 ? per_channel / 4096 : 1);
  }

 private:
  void release();

  int ordinal_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  std::unique_ptr<Module> nn_;
  std::unique_ptr<Cublas> cublas_;
  std::string gemm_desc_;
  CUfunction sgemm_ = nullptr;
  GemmPrecision precision_ = GemmPrecision::kFloat32;
};

}  // namespace cx::cuda
