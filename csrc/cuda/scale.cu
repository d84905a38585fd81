// The device kernels of the NCCL backend. Compiled by nvcc into a fatbin that
// is embedded in _core and launched through the driver API (see Note [How CUDA
// is found and loaded] in cuda/driver.h), so every kernel
// is extern "C" (its name is looked up as written) and takes plain pointers.
//
// cx_scale_*: x[i] *= f in place. ReduceOp.AVG is a SUM followed by this on
// NCCL older than 2.10, which has no ncclAvg.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T>
__device__ void scale(T* x, unsigned long long n, float f) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    x[i] = static_cast<T>(static_cast<float>(x[i]) * f);
  }
}

extern "C" __global__ void cx_scale_f32(float* x, unsigned long long n, float f) { scale(x, n, f); }
extern "C" __global__ void cx_scale_f16(__half* x, unsigned long long n, float f) { scale(x, n, f); }
extern "C" __global__ void cx_scale_bf16(__nv_bfloat16* x, unsigned long long n, float f) { scale(x, n, f); }
extern "C" __global__ void cx_scale_f64(double* x, unsigned long long n, double f) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    x[i] *= f;
  }
}
