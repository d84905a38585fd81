// defines: Cublas (cuBLAS's float32 GEMM on one stream, loaded at run time),
// GemmPrecision and set_cublas_search_dirs().
//
// cuBLAS is dlopen'ed (Note [How CUDA is found and loaded] in driver.h): from
// CX_CUBLAS_LIBRARY if set, else the nvidia-cublas(-cu12) wheels' folders
// (python/pycyxwiz/distributed/_gpu.py passes them), else the system loader's
// path. Only cublasCreate/SetStream/Sgemm/GemmEx/Destroy and the strided batched GEMMs are
// declared, by us.
#pragma once

#include <string>
#include <vector>

#include "cuda/driver.h"

namespace cx::cuda {

// What a float32 GEMM's inputs are rounded to on the tensor cores (Note [GEMM
// precision] in blas.cpp); the products are summed and stored in float32
// whatever the choice. DistributedTrainingConfig.matmul_precision names them.
enum class GemmPrecision { kFloat32, kTf32, kBf16 };
// "float32", "tf32", "bf16"; and back (InvalidArgument naming the three).
const char* gemm_precision_name(GemmPrecision p);
GemmPrecision gemm_precision_from_name(const std::string& name);

// Directories searched for libcublas.so.13/.12 before the system loader's path.
void set_cublas_search_dirs(std::vector<std::string> dirs);

class Cublas {
 public:
  // The first library that opens and starts on this GPU, bound to `stream` (a
  // libcublas.so.13 opens on a CUDA 12 driver but cublasCreate fails there: the
  // next is tried). None: ok() is false and why_not() says what was tried.
  explicit Cublas(CUstream stream);
  ~Cublas();
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;

  bool ok() const { return handle_ != nullptr; }
  const std::string& path() const;
  const std::string& why_not() const { return why_not_; }

  // Row-major C = alpha op(A) op(B) + beta C (op(A) M x K, op(B) K x N), queued on the stream; float32
  // matrices, their products rounded as `p` says.
  void sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
             float beta, float* C, int ldc, GemmPrecision p = GemmPrecision::kFloat32);
  // Whether this library has cublasGemmEx, which the precisions other than float32 need.
  bool has_gemm_ex() const;
  // C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch, where X_i = X + i * sX (row-major, as sgemm); only
  // where has_strided_batched(p).
  void sgemm_strided_batched(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, long long sa,
                             const float* B, int ldb, long long sb, float beta, float* C, int ldc, long long sc,
                             int batch, GemmPrecision p);
  bool has_strided_batched(GemmPrecision p) const;

 private:
  const void* lib_ = nullptr;  // the library's entry points (blas.cpp's Library)
  void* handle_ = nullptr;     // cublasHandle_t
  std::string why_not_;
};

}  // namespace cx::cuda
