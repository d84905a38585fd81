#include "cuda/blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "common/env.h"
#include "common/error.h"

namespace cx::cuda {

namespace {

// ---- cuBLAS, declared by us (cublas_api.h is not needed to build) ----------------
using cublasStatus_t = int;
using cublasHandle_t = void*;
constexpr int kCublasOpN = 0, kCublasOpT = 1;

struct Library {
  std::string path;
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, CUstream) = nullptr;
  cublasStatus_t (*sgemm)(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, const float*, int,
                          const float*, float*, int) = nullptr;
  // cublasGemmEx(handle, opA, opB, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute,
  // algo); optional (null: float32 only).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, const void*,
                            int, int, const void*, void*, int, int, int, int) = nullptr;
  // cublasSgemmStridedBatched(handle, opA, opB, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc,
  // strideC, batch) and cublasGemmStridedBatchedEx (GemmEx's arguments with a stride after each ld, the batch
  // before compute); optional (null: Device::gemm_batched loops over gemm).
  cublasStatus_t (*sgemm_sb)(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, long long,
                             const float*, int, long long, const float*, float*, int, long long, int) = nullptr;
  cublasStatus_t (*gemm_sb_ex)(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, long long,
                               const void*, int, int, long long, const void*, void*, int, int, long long, int, int,
                               int) = nullptr;
};

// cudaDataType_t, cublasComputeType_t and cublasGemmAlgo_t values (library_types.h, cublas_api.h).
constexpr int kCudaR32F = 0;
constexpr int kComputeFast16BF = 75, kComputeFastTf32 = 77;
constexpr int kGemmDefault = -1;

std::mutex g_mu;
std::vector<std::string> g_dirs;
std::vector<const Library*> g_loaded;  // every library opened so far; never closed, like the driver

// Returns the library at `path` (opened once per process), or null with *why.
const Library* open_library(const std::string& path, std::string* why) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (const Library* c : g_loaded)
    if (c->path == path) return c;
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    *why = e ? e : path + ": cannot be loaded";
    return nullptr;
  }
  auto* c = new Library();
  c->path = path;
  c->create = reinterpret_cast<decltype(c->create)>(::dlsym(lib, "cublasCreate_v2"));
  c->destroy = reinterpret_cast<decltype(c->destroy)>(::dlsym(lib, "cublasDestroy_v2"));
  c->set_stream = reinterpret_cast<decltype(c->set_stream)>(::dlsym(lib, "cublasSetStream_v2"));
  c->sgemm = reinterpret_cast<decltype(c->sgemm)>(::dlsym(lib, "cublasSgemm_v2"));
  c->gemm_ex = reinterpret_cast<decltype(c->gemm_ex)>(::dlsym(lib, "cublasGemmEx"));
  c->sgemm_sb = reinterpret_cast<decltype(c->sgemm_sb)>(::dlsym(lib, "cublasSgemmStridedBatched"));
  c->gemm_sb_ex = reinterpret_cast<decltype(c->gemm_sb_ex)>(::dlsym(lib, "cublasGemmStridedBatchedEx"));
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
std::vector<std::string> candidates() {
  if (const char* over = env::get("CX_CUBLAS_LIBRARY")) return {over};
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lk(g_mu);
  for (const auto& d : g_dirs)
    for (const char* n : {"libcublas.so.13", "libcublas.so.12"}) out.push_back(d + "/" + n);
  for (const char* n : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) out.emplace_back(n);
  return out;
}

const Library& library(const void* p) { return *static_cast<const Library*>(p); }

}  // namespace

const char* gemm_precision_name(GemmPrecision p) {
  switch (p) {
    case GemmPrecision::kTf32: return "tf32";
    case GemmPrecision::kBf16: return "bf16";
    default: return "float32";
  }
}

GemmPrecision gemm_precision_from_name(const std::string& name) {
  for (GemmPrecision p : {GemmPrecision::kFloat32, GemmPrecision::kTf32, GemmPrecision::kBf16})
    if (name == gemm_precision_name(p)) return p;
  CX_THROW(InvalidArgument, "matmul_precision must be 'float32', 'tf32' or 'bf16', got '", name, "'");
}

void set_cublas_search_dirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_dirs = std::move(dirs);
}

Cublas::Cublas(CUstream stream) {
  std::vector<std::string> tried;
  for (const std::string& path : candidates()) {
    std::string why;
    const Library* c = open_library(path, &why);
    if (!c) {
      tried.push_back(why);
      continue;
    }
    cublasHandle_t h = nullptr;
    cublasStatus_t r = c->create(&h);
    if (r == 0 && c->set_stream(h, stream) == 0) {
      handle_ = h;
      lib_ = c;
      return;
    }
    if (r == 0) c->destroy(h);
    tried.push_back(detail::concat(path, ": cublasCreate/cublasSetStream failed (status ", r, ")"));
  }
  // Short: trainer.device prints it. CX_CUBLAS_LIBRARY=<path> shows one library's own error.
  why_not_ = "no usable cuBLAS: pip install nvidia-cublas-cu12, or nvidia-cublas for CUDA 13";
  if (!tried.empty()) why_not_ += "; " + tried.front();
}

Cublas::~Cublas() {
  if (handle_) library(lib_).destroy(handle_);
}

const std::string& Cublas::path() const {
  static const std::string none;
  return lib_ ? library(lib_).path : none;
}

bool Cublas::has_gemm_ex() const { return lib_ && library(lib_).gemm_ex; }

bool Cublas::has_strided_batched(GemmPrecision p) const {
  if (!lib_) return false;
  return p == GemmPrecision::kFloat32 ? library(lib_).sgemm_sb != nullptr : library(lib_).gemm_sb_ex != nullptr;
}

// Note [GEMM precision]
// DistributedTrainingConfig.matmul_precision = "bf16" or "tf32" is PyTorch's
// mixed precision for the part that costs: the matrix products. Each stays a
// float32 GEMM to us (float32 matrices in, float32 result out), and cuBLAS is
// allowed to round its inputs to bfloat16 (8 bits of mantissa) or TF32 (10)
// on the tensor cores, summing the products in float32 (cublasGemmEx with
// CUBLAS_COMPUTE_32F_FAST_16BF / _FAST_TF32). Weights, gradients, optimizer
// state and every other layer stay float32, so nothing else changes: no cast
// kernels of ours, no loss scaling (bfloat16 has float32's range). torch's
// autocast rounds the same GEMM inputs and also stores their outputs in
// bfloat16; ours keeps them in float32, at no cost to the GEMM's speed.
void Cublas::sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                   int ldb, float beta, float* C, int ldc, GemmPrecision p) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
  // row-major matrix read column-major is its transpose: swap the operands.
  const Library& lib = library(lib_);
  const int opb = tb ? kCublasOpT : kCublasOpN, opa = ta ? kCublasOpT : kCublasOpN;
  cublasStatus_t r;
  if (p == GemmPrecision::kFloat32) {
    r = lib.sgemm(handle_, opb, opa, N, M, K, &alpha, B, ldb, A, lda, &beta, C, ldc);
  } else {
    const int compute = p == GemmPrecision::kBf16 ? kComputeFast16BF : kComputeFastTf32;
    r = lib.gemm_ex(handle_, opb, opa, N, M, K, &alpha, B, kCudaR32F, ldb, A, kCudaR32F, lda, &beta, C, kCudaR32F,
                    ldc, compute, kGemmDefault);
  }
  if (r != 0) {
    CX_THROW(Error, p == GemmPrecision::kFloat32 ? "cublasSgemm" : "cublasGemmEx", " failed with status ", r, " (",
             M, "x", N, "x", K, ", ", gemm_precision_name(p), ")");
  }
}

void Cublas::sgemm_strided_batched(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                                   long long sa, const float* B, int ldb, long long sb, float beta, float* C, int ldc,
                                   long long sc, int batch, GemmPrecision p) {
  const Library& lib = library(lib_);  // operands swapped as in sgemm
  const int opb = tb ? kCublasOpT : kCublasOpN, opa = ta ? kCublasOpT : kCublasOpN;
  cublasStatus_t r;
  if (p == GemmPrecision::kFloat32) {
    r = lib.sgemm_sb(handle_, opb, opa, N, M, K, &alpha, B, ldb, sb, A, lda, sa, &beta, C, ldc, sc, batch);
  } else {
    const int compute = p == GemmPrecision::kBf16 ? kComputeFast16BF : kComputeFastTf32;
    r = lib.gemm_sb_ex(handle_, opb, opa, N, M, K, &alpha, B, kCudaR32F, ldb, sb, A, kCudaR32F, lda, sa, &beta, C,
                       kCudaR32F, ldc, sc, batch, compute, kGemmDefault);
  }
  if (r != 0) {
    CX_THROW(Error, p == GemmPrecision::kFloat32 ? "cublasSgemmStridedBatched" : "cublasGemmStridedBatchedEx",
             " failed with status ", r, " (", batch, " x ", M, "x", N, "x", K, ", ", gemm_precision_name(p), ")");
  }
}

}  // namespace cx::cuda
