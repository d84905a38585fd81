/* The core's single-precision FMA peak: benchmarks/cnn.py divides convolution GFLOP/s by it.

     cc -O2 -o fma_peak fma_peak.c && ./fma_peak      # prints GFLOP/s, one thread

   Twelve independent chains of fused multiply-adds as wide as the core has them: 16 floats (AVX-512F, 32
   flops each) where it has them, which pycyxwiz's direct convolutions use (Note [Direct convolution]), else 8
   (AVX2+FMA, 16 flops each); enough to keep both FMA pipes of a modern x86 core busy through the instruction's
   latency. The best of 30 runs of ~0.05 s (short, so that one of them runs alone on a busy machine). Prints 0
   on a CPU without AVX2 and FMA. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx2,fma"))) static float chains(long iters) {
  /* distinct starting values, so the compiler cannot merge the chains */
  __m256 a0 = _mm256_set1_ps(1.0f), a1 = _mm256_set1_ps(1.1f), a2 = _mm256_set1_ps(1.2f),
         a3 = _mm256_set1_ps(1.3f), a4 = _mm256_set1_ps(1.4f), a5 = _mm256_set1_ps(1.5f),
         a6 = _mm256_set1_ps(1.6f), a7 = _mm256_set1_ps(1.7f), a8 = _mm256_set1_ps(1.8f),
         a9 = _mm256_set1_ps(1.9f), a10 = _mm256_set1_ps(2.0f), a11 = _mm256_set1_ps(2.1f);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iters; i++) {
    a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c);
    a3 = _mm256_fmadd_ps(a3, m, c); a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
    a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c); a8 = _mm256_fmadd_ps(a8, m, c);
    a9 = _mm256_fmadd_ps(a9, m, c); a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

__attribute__((target("avx512f"))) static float chains512(long iters) {
  __m512 a[12];
  for (int k = 0; k < 12; k++) a[k] = _mm512_set1_ps(1.0f + 0.1f * k);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; k++) a[k] = _mm512_fmadd_ps(a[k], m, c);
  }
  __m512 s = a[0];
  for (int k = 1; k < 12; k++) s = _mm512_add_ps(s, a[k]);
  return _mm512_reduce_add_ps(s);
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    printf("0\n");
    return 0;
  }
  const int wide = __builtin_cpu_supports("avx512f");
  const long iters = wide ? 10000000 : 20000000;
  volatile float sink = wide ? chains512(1000000) : chains(1000000);
  double best = 0;
  for (int r = 0; r < 30; r++) {
    double t = now();
    sink += wide ? chains512(iters) : chains(iters);
    t = now() - t;
    double gflops = iters * 12.0 * (wide ? 32.0 : 16.0) / t / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("%.2f\n", best);
  return 0;
}
