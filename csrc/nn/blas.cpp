#include "nn/blas.h"

#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

#include "common/env.h"
#include "common/error.h"
#include "nn/parallel.h"

namespace cx::nn {

namespace {

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
           int ldb, float beta, float* C, int ldc) {
  scipy_cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Note [GEMM on the pool]
// OpenBLAS runs on one thread (Note [One pool for the model math] in parallel.h), so a product worth splitting is
// cut here into blocks of C, each one OpenBLAS call on a part of the pool: the columns when C is at least as wide
// as it is tall, else the rows, in whole blocks of kBlock so each part keeps full vector widths. Only the operand
// along the split is divided; the other (in a layer, the batch-sized one: the split falls on the weights' side)
// is read, and packed, by every part. Each element of C is still one dot product over all of K.
constexpr int kBlock = 16;
constexpr double kPartFlops = 4e6;  // the least work a part is handed (about 30 us at 130 GFLOP/s)

}  // namespace

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  const double flops = 2.0 * M * N * K;
  if (num_threads() == 1 || flops < 2 * kPartFlops) {
    sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const bool by_columns = N >= M;
  const int span = by_columns ? N : M;
  const size_t blocks = static_cast<size_t>((span + kBlock - 1) / kBlock);
  const size_t grain = static_cast<size_t>(std::max(1.0, kPartFlops / (flops / static_cast<double>(blocks))));
  parallel_for(blocks, grain, [&](size_t, size_t b, size_t e) {
    const int lo = static_cast<int>(b) * kBlock, hi = std::min(span, static_cast<int>(e) * kBlock);
    if (by_columns)  // C[:, lo:hi] = op(A) op(B)[:, lo:hi]
      sgemm(trans_a, trans_b, M, hi - lo, K, alpha, A, lda, trans_b ? B + static_cast<size_t>(lo) * ldb : B + lo,
            ldb, beta, C + lo, ldc);
    else  // C[lo:hi, :] = op(A)[lo:hi, :] op(B)
      sgemm(trans_a, trans_b, hi - lo, N, K, alpha, trans_a ? A + lo : A + static_cast<size_t>(lo) * lda, lda, B,
            ldb, beta, C + static_cast<size_t>(lo) * ldc, ldc);
  });
}

void set_num_threads(int n) {
  CX_CHECK(n >= 1, InvalidArgument, "set_num_threads: need n >= 1, got ", n);
  CX_CHECK(n <= kMaxThreads, InvalidArgument, "set_num_threads: at most ", kMaxThreads, " threads, got ", n);
  set_pool_threads(n);
}

int get_num_threads() { return num_threads(); }

namespace {
long env_long(const char* name, long fallback) {
  const char* v = env::get(name);
  if (!v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0') ? x : fallback;
}

// A thread count from OMP_NUM_THREADS or OPENBLAS_NUM_THREADS: a positive number, or the first of an OpenMP
// list ("4,2": 4 at the outer level); -1 for anything else, which is ignored as OpenBLAS ignores it.
long thread_count(const char* name) {
  const char* v = env::get(name);
  if (!v) return -1;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return end != v && (*end == '\0' || *end == ',') && x >= 1 ? x : -1;
}

// The CPUs this process may run on (its affinity mask: a container's or taskset's share, not the machine's).
int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

void apply_default_num_threads() {
  scipy_openblas_set_num_threads(1);  // Note [GEMM on the pool]
  for (const char* name : {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const long n = thread_count(name);
    if (n >= 1) {
      set_pool_threads(static_cast<int>(std::min<long>(n, kMaxThreads)));
      return;
    }
  }
  long local = env_long("LOCAL_WORLD_SIZE", -1);
  bool shared_host = local > 1 || (local < 0 && env_long("WORLD_SIZE", 1) > 1);
  set_pool_threads(shared_host ? 1 : std::min(usable_cpus(), kMaxThreads));
}

}  // namespace cx::nn
