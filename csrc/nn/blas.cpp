#include "nn/blas.h"

#include <cblas.h>

#include <cstdlib>
#include <string>

#include "common/env.h"
#include "common/error.h"

namespace cx::nn {

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void set_num_threads(int n) {
  CX_CHECK(n >= 1, InvalidArgument, "set_num_threads: need n >= 1, got ", n);
  scipy_openblas_set_num_threads(n);
}

int get_num_threads() { return scipy_openblas_get_num_threads(); }

namespace {
long env_long(const char* name, long fallback) {
  const char* v = env::get(name);
  if (!v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0') ? x : fallback;
}
}  // namespace

void apply_default_num_threads() {
  if (env::get("OPENBLAS_NUM_THREADS") || env::get("OMP_NUM_THREADS")) return;
  long local = env_long("LOCAL_WORLD_SIZE", -1);
  bool shared_host = local > 1 || (local < 0 && env_long("WORLD_SIZE", 1) > 1);
  if (shared_host) scipy_openblas_set_num_threads(1);
}

}  // namespace cx::nn
