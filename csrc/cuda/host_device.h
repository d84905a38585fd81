// defines: CX_HD, the mark of a function compiled for both the CPU and the GPU
// (inline on the host, __host__ __device__ __forceinline__ under nvcc): what the
// per-element rules (update_rules.h, act_rules.h) are written with.
#pragma once

#ifdef __CUDACC__
#define CX_HD __host__ __device__ __forceinline__
#else
#define CX_HD inline
#endif
