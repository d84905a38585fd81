// defines: gemm() over the scipy-openblas32 wheel's OpenBLAS (symbols are
// prefixed scipy_), split over the model math's threads (Note [GEMM on the pool]
// in blas.cpp), and their count (set_num_threads and its default).
#pragma once

namespace cx::nn {

// Row-major C = alpha * op(A) * op(B) + beta * C, op(A) is M x K, op(B) is K x N.
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);

// The model math's threads (the pool of parallel.h; OpenBLAS itself runs on one).
void set_num_threads(int n);
int get_num_threads();

// Note [Default BLAS threads]
// Several ranks on one machine each running on all cores oversubscribe the CPU
// badly (each one's threads fight the peers' threads and the comm thread). So:
// OPENBLAS_NUM_THREADS / OMP_NUM_THREADS win if the user set them; otherwise 1
// thread when LOCAL_WORLD_SIZE > 1 (or, without LOCAL_WORLD_SIZE, WORLD_SIZE > 1:
// a launch by hand runs every rank on one host); otherwise every CPU this process
// may run on. Applied once, at import.
void apply_default_num_threads();

}  // namespace cx::nn
