#include "cuda/device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/env.h"
#include "common/error.h"

namespace cx::cuda {

// ---- Buffer, HostBuffer --------------------------------------------------------------

namespace {
// Frees after the queued work that may still read or write the memory (kernels
// and copies on our stream, NCCL on its own): growing a buffer between steps
// must not pull it from under the last step's backward.
void free_after_work(CUdeviceptr p) {
  const auto& d = cuda_driver();
  d.cuCtxSynchronize();
  d.cuMemFree(p);
}
}  // namespace

Buffer::~Buffer() {
  if (p_) free_after_work(p_);
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (p_) free_after_work(p_);
    p_ = o.p_, bytes_ = o.bytes_;
    o.p_ = 0, o.bytes_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (p_) {
    cuda_driver().cuCtxSynchronize();
    cuda_driver().cuMemFreeHost(p_);
  }
}

void HostBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_ && p_) return;
  const auto& d = cuda_driver();
  if (p_) {
    d.cuCtxSynchronize();
    d.cuMemFreeHost(p_);
  }
  p_ = nullptr;
  bytes_ = 0;
  size_t want = std::max<size_t>(bytes, 4096);
  CUresult r = d.cuMemHostAlloc(&p_, want, 0);
  if (r != kSuccess) {
    p_ = nullptr;
    CX_THROW(Error, "cuMemHostAlloc of ", want, " bytes of page-locked host memory failed: ", d.error_text(r),
             " (lower batch_size)");
  }
  bytes_ = want;
}

void Buffer::reserve(size_t bytes) {
  if (bytes <= bytes_ && p_) return;
  const auto& d = cuda_driver();
  if (p_) free_after_work(p_);
  p_ = 0;
  bytes_ = 0;
  size_t want = std::max<size_t>(bytes, 256);
  CUresult r = d.cuMemAlloc(&p_, want);
  if (r != kSuccess) {
    CX_THROW(Error, "cuMemAlloc of ", want, " bytes on the GPU failed: ", d.error_text(r),
             " (the model's parameters, activations or batch do not fit: lower batch_size)");
  }
  bytes_ = want;
}

// ---- Event -------------------------------------------------------------------------

Event::Event() { check_cu(cuda_driver().cuEventCreate(&ev_, kEventDisableTiming), "cuEventCreate"); }
Event::~Event() {
  if (ev_) cuda_driver().cuEventDestroy(ev_);
}

// ---- Device ------------------------------------------------------------------------

// Every kernel of nn.cu, resolved at construction: with lazy module loading
// (the default since CUDA 12.2) resolving one loads it, and loading while an
// NCCL kernel waits on peers is what Note [First step of a shape] (in
// train/gpu_engine.cpp) avoids.
const char* const kNnKernels[] = {
    "cx_nn_bias_add", "cx_nn_col_sum_add",
    "cx_nn_relu_fwd", "cx_nn_relu_bwd", "cx_nn_leaky_relu_fwd", "cx_nn_leaky_relu_bwd", "cx_nn_sigmoid_fwd",
    "cx_nn_sigmoid_bwd", "cx_nn_tanh_fwd", "cx_nn_tanh_bwd", "cx_nn_gelu_fwd", "cx_nn_gelu_bwd",
    "cx_nn_softmax_fwd", "cx_nn_softmax_bwd", "cx_nn_dropout_fwd", "cx_nn_mul", "cx_nn_bn_fwd", "cx_nn_bn_bwd",
    "cx_nn_ce_labels", "cx_nn_ce_dense", "cx_nn_mse", "cx_nn_bce",
    "cx_nn_adam", "cx_nn_sgd", "cx_nn_rmsprop", "cx_nn_sgemm", "cx_nn_count_nonfinite",
    "cx_nn_im2col", "cx_nn_col2im", "cx_nn_swap01", "cx_nn_bias01", "cx_nn_channel_sum_add", "cx_nn_maxpool_fwd",
    "cx_nn_maxpool_bwd", "cx_nn_avgpool_fwd", "cx_nn_avgpool_bwd", "cx_nn_gap_fwd", "cx_nn_gap_bwd",
    "cx_nn_channel_sums", "cx_nn_bn2d_var", "cx_nn_bn2d_fwd", "cx_nn_bn2d_bsum", "cx_nn_bn2d_bwd", "cx_nn_add",
    "cx_nn_clip_value", "cx_nn_sum_squares", "cx_nn_clip_norm_coef", "cx_nn_scale_by", "cx_nn_narrow16",
    "cx_nn_widen16", "cx_nn_ema", "cx_nn_sbn_fold", "cx_nn_sbn_var", "cx_nn_sbn_fwd", "cx_nn_sbn_bfold",
    "cx_nn_sbn_bwd"};

Device::Device(int ordinal) : ordinal_(ordinal) {
  const auto& d = cuda_driver();  // throws "no NVIDIA GPU visible ..." where there is none
  check_local_rank(ordinal, device_count_or_zero());
  if (!kernels_built()) {  // before touching the GPU: the same error everywhere
    CX_THROW(Error, "this build of pycyxwiz has no CUDA kernels (nvcc was not on PATH when it was built), so the "
                    "model cannot run on the GPU: reinstall pycyxwiz where nvcc is found (pip install . with CUDA's "
                    "bin folder on PATH), or train with BackendType.CPU");
  }
  CUdevice dev = 0;
  check_cu(d.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  check_cu(d.cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
  try {
    make_current();
    check_cu(d.cuStreamCreate(&stream_, kStreamNonBlocking), "cuStreamCreate");
    nn_ = std::make_unique<Module>("nn", "the model cannot run on the GPU: reinstall pycyxwiz where nvcc is found, "
                                         "or train with BackendType.CPU");
    for (const char* k : kNnKernels) fn(k);
    sgemm_ = fn("cx_nn_sgemm");
    const char* force = env::get("CX_GPU_GEMM");
    if (force && std::strcmp(force, "tiled") == 0) {
      gemm_desc_ = "pycyxwiz tiled kernel (CX_GPU_GEMM=tiled)";
    } else {
      cublas_ = std::make_unique<Cublas>(stream_);
      if (cublas_->ok()) {
        gemm_desc_ = "cuBLAS (" + cublas_->path() + ")";
      } else {
        gemm_desc_ = "pycyxwiz tiled kernel (" + cublas_->why_not() + ")";
        cublas_.reset();
      }
    }
  } catch (...) {
    release();  // the destructor does not run for a half-made Device
    throw;
  }
}

Device::~Device() { release(); }

void Device::release() {
  const auto& d = cuda_driver();
  d.cuCtxSetCurrent(ctx_);
  if (stream_) d.cuStreamSynchronize(stream_);
  cublas_.reset();
  nn_.reset();
  if (stream_) d.cuStreamDestroy(stream_);
  stream_ = nullptr;
  CUdevice dev = 0;
  if (ctx_ && d.cuDeviceGet(&dev, ordinal_) == kSuccess) d.cuDevicePrimaryCtxRelease(dev);
  ctx_ = nullptr;
}

void Device::make_current() const { check_cu(cuda_driver().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

std::string Device::name() const {
  char buf[256] = {0};
  CUdevice dev = 0;
  const auto& d = cuda_driver();
  if (d.cuDeviceGet(&dev, ordinal_) == kSuccess) d.cuDeviceGetName(buf, sizeof(buf) - 1, dev);
  return buf;
}

void Device::upload(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  check_cu(cuda_driver().cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, stream_),
           "copying to the GPU (cuMemcpyHtoDAsync)");
}

void Device::download(void* dst, const void* src, size_t bytes) {
  if (bytes) {
    check_cu(cuda_driver().cuMemcpyDtoHAsync(dst, reinterpret_cast<CUdeviceptr>(src), bytes, stream_),
             "copying from the GPU (cuMemcpyDtoHAsync)");
  }
  sync();
}

void Device::copy(void* dst, const void* src, size_t bytes) {
  if (!bytes || dst == src) return;
  check_cu(cuda_driver().cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src),
                                           bytes, stream_),
           "cuMemcpyDtoDAsync");
}

void Device::zero(void* dst, size_t bytes) {
  if (!bytes) return;
  check_cu(cuda_driver().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), 0, bytes, stream_), "cuMemsetD8Async");
}

void Device::sync() { check_cu(cuda_driver().cuStreamSynchronize(stream_), "running the model on the GPU"); }

void Device::launch_raw(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, void** args) {
  check_cu(cuda_driver().cuLaunchKernel(f, gx, gy, 1, bx, by, 1, 0, stream_, args, nullptr), "launching a kernel");
}

void Device::set_gemm_precision(GemmPrecision p) {
  if (p != GemmPrecision::kFloat32) {
    CX_CHECK(cublas_ && cublas_->has_gemm_ex(), InvalidArgument, "matmul_precision='", gemm_precision_name(p),
             "' needs cuBLAS with cublasGemmEx, but this GPU's GEMM is the ", gemm_desc_,
             ": install nvidia-cublas (pip install pycyxwiz[cuda13]), or keep matmul_precision='float32'");
  }
  precision_ = p;
}

unsigned Device::grid_for(size_t n, unsigned block) {
  size_t g = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<size_t>(g, 1, 8192));
}

void Device::gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                  int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  if (cublas_) {
    cublas_->sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, precision_);
    return;
  }
  int ita = ta, itb = tb;
  void* args[] = {&ita, &itb, &M, &N, &K, &alpha, &A, &lda, &B, &ldb, &beta, &C, &ldc};
  launch_raw(sgemm_, static_cast<unsigned>((N + 31) / 32), static_cast<unsigned>((M + 31) / 32), 32, 8, args);
}

void Device::gemm_batched(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, size_t sa,
                          const float* B, int ldb, size_t sb, float beta, float* C, int ldc, size_t sc, int batch) {
  if (M == 0 || N == 0 || batch <= 0) return;
  if (cublas_ && cublas_->has_strided_batched(precision_)) {
    cublas_->sgemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, static_cast<long long>(sa), B, ldb,
                                   static_cast<long long>(sb), beta, C, ldc, static_cast<long long>(sc), batch,
                                   precision_);
    return;
  }
  for (int i = 0; i < batch; ++i) gemm(ta, tb, M, N, K, alpha, A + i * sa, lda, B + i * sb, ldb, beta, C + i * sc, ldc);
}

}  // namespace cx::cuda
