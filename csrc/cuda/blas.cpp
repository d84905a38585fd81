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
};

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

void Cublas::sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                   int ldb, float beta, float* C, int ldc) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a
  // row-major matrix read column-major is its transpose: swap the operands.
  cublasStatus_t r = library(lib_).sgemm(handle_, tb ? kCublasOpT : kCublasOpN, ta ? kCublasOpT : kCublasOpN, N, M,
                                         K, &alpha, B, ldb, A, lda, &beta, C, ldc);
  if (r != 0) CX_THROW(Error, "cublasSgemm failed with status ", r, " (", M, "x", N, "x", K, ")");
}

}  // namespace cx::cuda
