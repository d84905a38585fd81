#include "gpu/runtime.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.h"

namespace cx::distributed::cuda {
#ifdef CX_WITH_CUDA
extern const unsigned char kFatbin_nn[];  // csrc/cuda/nn.cu, embedded by csrc/cuda/embed.cmake
extern const size_t kFatbinBytes_nn;
#endif
}  // namespace cx::distributed::cuda

namespace cx::gpu {

using distributed::cuda::check_cu;
using distributed::cuda::cuda_driver;

namespace {

// ---- cuBLAS, declared by us (cublas_api.h is not needed to build) ----------------
using cublasStatus_t = int;
using cublasHandle_t = void*;
constexpr int kCublasOpN = 0, kCublasOpT = 1;

struct Cublas {
  std::string path;
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, CUstream) = nullptr;
  cublasStatus_t (*sgemm)(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, const float*, int,
                          const float*, float*, int) = nullptr;
  std::string error;  // why none loaded
};

std::mutex g_mu;
std::vector<std::string> g_dirs;
std::vector<const Cublas*> g_loaded;  // every library opened so far; never closed, like the driver

// Returns the library at `path` (opened once per process), or null with *why.
const Cublas* open_cublas(const std::string& path, std::string* why) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (const Cublas* c : g_loaded)
    if (c->path == path) return c;
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    *why = e ? e : path + ": cannot be loaded";
    return nullptr;
  }
  auto* c = new Cublas();
  c->path = path;
  c->create = reinterpret_cast<decltype(c->create)>(::dlsym(lib, "cublasCreate_v2"));
  c->destroy = reinterpret_cast<decltype(c->destroy)>(::dlsym(lib, "cublasDestroy_v2"));
  c->set_stream = reinterpret_cast<decltype(c->set_stream)>(::dlsym(lib, "cublasSetStream_v2"));
  c->sgemm = reinterpret_cast<decltype(c->sgemm)>(::dlsym(lib, "cublasSgemm_v2"));
  if (!c->create || !c->destroy || !c->set_stream || !c->sgemm) {
    *why = path + " lacks cublasCreate_v2/cublasSetStream_v2/cublasSgemm_v2";
    delete c;
    return nullptr;
  }
  g_loaded.push_back(c);
  return c;
}

// Where to look, in order: CX_CUBLAS_LIBRARY alone if set; else the wheels'
// folders, then the system loader's path.
std::vector<std::string> cublas_candidates() {
  const char* over = std::getenv("CX_CUBLAS_LIBRARY");
  if (over && *over) return {over};
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lk(g_mu);
  for (const auto& d : g_dirs)
    for (const char* n : {"libcublas.so.13", "libcublas.so.12"}) out.push_back(d + "/" + n);
  for (const char* n : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) out.emplace_back(n);
  return out;
}

}  // namespace

void set_cublas_search_dirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_dirs = std::move(dirs);
}

bool kernels_built() {
#ifdef CX_WITH_CUDA
  return distributed::cuda::kFatbinBytes_nn > 0;
#else
  return false;
#endif
}

// ---- Buffer ------------------------------------------------------------------------

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

void Buffer::reserve(size_t bytes) {
  if (bytes <= bytes_ && p_) return;
  const auto& d = cuda_driver();
  if (p_) free_after_work(p_);
  p_ = 0;
  bytes_ = 0;
  size_t want = std::max<size_t>(bytes, 256);
  distributed::cuda::CUresult r = d.cuMemAlloc(&p_, want);
  if (r != distributed::cuda::kSuccess) {
    CX_THROW(Error, "cuMemAlloc of ", want, " bytes on the GPU failed: ", d.error_text(r),
             " (the model's parameters, activations or batch do not fit: lower batch_size)");
  }
  bytes_ = want;
}

// ---- Device ------------------------------------------------------------------------

// Every kernel of nn.cu, resolved at construction: with lazy module loading
// (the default since CUDA 12.2) resolving one loads it, and loading while an
// NCCL kernel waits on peers is what Note [First step of a shape] avoids.
const char* const kKernels[] = {"cx_nn_bias_add", "cx_nn_col_sum_add", "cx_nn_act_fwd",   "cx_nn_act_bwd",
                                "cx_nn_softmax_fwd", "cx_nn_softmax_bwd", "cx_nn_dropout_fwd", "cx_nn_mul",
                                "cx_nn_bn_fwd",     "cx_nn_bn_bwd",      "cx_nn_ce_labels",  "cx_nn_ce_dense",
                                "cx_nn_mse",        "cx_nn_bce",         "cx_nn_adam",       "cx_nn_sgd",
                                "cx_nn_rmsprop",    "cx_nn_sgemm"};

Device::Device(int ordinal) : ordinal_(ordinal) {
  const auto& d = cuda_driver();  // throws "no NVIDIA GPU visible ..." where there is none
  int n = distributed::cuda::device_count_or_zero();
  distributed::cuda::check_local_rank(ordinal, n);
  if (!kernels_built()) {
    CX_THROW(Error, "this build of pycyxwiz has no CUDA kernels (nvcc was not on PATH when it was built), so the "
                    "model cannot run on the GPU: reinstall pycyxwiz where nvcc is found (pip install . with CUDA's "
                    "bin folder on PATH), or train with BackendType.CPU");
  }
  distributed::cuda::CUdevice dev = 0;
  check_cu(d.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  check_cu(d.cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
  try {
    make_current();
    check_cu(d.cuStreamCreate(&stream_, distributed::cuda::kStreamNonBlocking), "cuStreamCreate");
#ifdef CX_WITH_CUDA
    check_cu(d.cuModuleLoadData(&mod_, distributed::cuda::kFatbin_nn),
             "loading pycyxwiz's model kernels (built for sm_80 and sm_90 plus PTX; the GPU may be older, or the "
             "driver older than the nvcc that built them)");
#endif
    for (const char* k : kKernels) fn(k);
    sgemm_ = fn("cx_nn_sgemm");
    load_cublas();
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
  if (cublas_) static_cast<const Cublas*>(cublas_lib_)->destroy(cublas_);
  if (mod_) d.cuModuleUnload(mod_);
  if (stream_) d.cuStreamDestroy(stream_);
  cublas_ = nullptr, mod_ = nullptr, stream_ = nullptr;
  distributed::cuda::CUdevice dev = 0;
  if (ctx_ && d.cuDeviceGet(&dev, ordinal_) == distributed::cuda::kSuccess) d.cuDevicePrimaryCtxRelease(dev);
  ctx_ = nullptr;
}

void Device::load_cublas() {
  const char* force = std::getenv("CX_GPU_GEMM");
  if (force && std::strcmp(force, "tiled") == 0) {
    gemm_desc_ = "pycyxwiz tiled kernel (CX_GPU_GEMM=tiled)";
    return;
  }
  // The first library that opens and also starts on this GPU (a libcublas.so.13
  // opens on a CUDA 12 driver but cublasCreate fails there: try the next).
  std::vector<std::string> tried;
  for (const std::string& path : cublas_candidates()) {
    std::string why;
    const Cublas* c = open_cublas(path, &why);
    if (!c) {
      tried.push_back(why);
      continue;
    }
    cublasHandle_t h = nullptr;
    cublasStatus_t r = c->create(&h);
    if (r == 0 && c->set_stream(h, stream_) == 0) {
      cublas_ = h;
      cublas_lib_ = c;
      gemm_desc_ = "cuBLAS (" + c->path + ")";
      return;
    }
    if (r == 0) c->destroy(h);
    tried.push_back(detail::concat(path, ": cublasCreate/cublasSetStream failed (status ", r, ")"));
  }
  // Short: trainer.device prints it. CX_CUBLAS_LIBRARY=<path> shows one library's own error.
  gemm_desc_ = "pycyxwiz tiled kernel (no usable cuBLAS: pip install nvidia-cublas-cu12, or nvidia-cublas for CUDA 13";
  if (!tried.empty()) gemm_desc_ += "; " + tried.front();
  gemm_desc_ += ")";
}

void Device::make_current() const { check_cu(cuda_driver().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

std::string Device::name() const {
  char buf[256] = {0};
  distributed::cuda::CUdevice dev = 0;
  const auto& d = cuda_driver();
  if (d.cuDeviceGet(&dev, ordinal_) == distributed::cuda::kSuccess) d.cuDeviceGetName(buf, sizeof(buf) - 1, dev);
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

CUfunction Device::fn(const char* name) {
  for (auto& [n, f] : fns_)
    if (n == name) return f;
  CUfunction f = nullptr;
  check_cu(cuda_driver().cuModuleGetFunction(&f, mod_, name), name);
  fns_.emplace_back(name, f);
  return f;
}

void Device::launch_raw(CUfunction f, unsigned gx, unsigned gy, unsigned bx, unsigned by, void** args) {
  check_cu(cuda_driver().cuLaunchKernel(f, gx, gy, 1, bx, by, 1, 0, stream_, args, nullptr), "launching a kernel");
}

unsigned Device::grid_for(size_t n, unsigned block) {
  size_t g = (n + block - 1) / block;
  return static_cast<unsigned>(std::clamp<size_t>(g, 1, 8192));
}

void Device::gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                  int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  if (cublas_) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
    // row-major matrix read column-major is its transpose: swap the operands.
    cublasStatus_t r = static_cast<const Cublas*>(cublas_lib_)->sgemm(cublas_, tb ? kCublasOpT : kCublasOpN, ta ? kCublasOpT : kCublasOpN, N, M, K,
                                      &alpha, B, ldb, A, lda, &beta, C, ldc);
    if (r != 0) CX_THROW(Error, "cublasSgemm failed with status ", r, " (", M, "x", N, "x", K, ")");
    return;
  }
  void* args[] = {&ta, &tb, &M, &N, &K, &alpha, &A, &lda, &B, &ldb, &beta, &C, &ldc};
  int ita = ta, itb = tb;
  args[0] = &ita;
  args[1] = &itb;
  launch_raw(sgemm_, static_cast<unsigned>((N + 31) / 32), static_cast<unsigned>((M + 31) / 32), 32, 8, args);
}

}  // namespace cx::gpu
