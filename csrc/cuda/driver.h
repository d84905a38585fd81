// defines: CudaDriver, the CUDA driver-API calls pycyxwiz makes (the NCCL
// backend, the model on the GPU), loaded at run time; cuda_driver() to get it,
// check_cu() for errors.
//
// Note [How CUDA is found and loaded]
// _core links nothing of CUDA. Everything on a GPU talks to the driver API of
// libcuda.so.1 through dlopen: that library ships with the NVIDIA driver, so it
// is present exactly where a GPU is usable, and it does not depend on which
// CUDA toolkit (12 or 13) or which wheels are installed. No CUDA runtime
// (libcudart) is needed: CuPy's streams are driver streams (cudaStream_t and
// CUstream are the same handle), the NCCL library carries its own runtime, and
// our few kernels (csrc/cuda/*.cu) are compiled by nvcc at build time into a
// fatbin embedded in _core and launched with cuModuleLoadData/cuLaunchKernel.
// So `import pycyxwiz` never touches CUDA; only init() with BackendType.NCCL
// does. CX_CUDA_DRIVER_LIBRARY names another driver library (for tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cx::cuda {

// Our own declarations of the driver API types we use (cuda.h is not needed to build).
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUdeviceptr = unsigned long long;

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorInvalidValue = 1;
constexpr CUresult kErrorNotReady = 600;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kStreamNonBlocking = 0x1;
constexpr int kPointerAttributeMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeHost = 1, kMemoryTypeDevice = 2, kMemoryTypeUnified = 4;

// The __cuda_array_interface__ stream numbers 1 and 2 are the legacy and
// per-thread default streams; the driver API spells them the same way.
inline CUstream stream_of(uintptr_t s) { return s == 1 ? nullptr : reinterpret_cast<CUstream>(s); }

struct CudaDriver {
  std::string path;  // the library that was loaded
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);  // kSuccess when all its work is done, else kErrorNotReady
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  // Several attributes in one call; memory CUDA does not know reads as type 0 (no error).
  CUresult (*cuPointerGetAttributes)(unsigned, int*, void**, CUdeviceptr);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);

  // "CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"
  std::string error_text(CUresult r) const;
};

// Loads libcuda.so.1 and calls cuInit once per process. Throws Error with the
// "no NVIDIA GPU visible ... use BackendType.CPU" message if either fails.
const CudaDriver& cuda_driver();

// Number of visible GPUs (0 where there is no driver: never throws).
int device_count_or_zero();

// Throws InvalidArgument when `local_rank` names no visible GPU.
void check_local_rank(int local_rank, int device_count);

// Throws Error "<what> failed: <error text>" if r is not CUDA_SUCCESS.
void check_cu(CUresult r, const char* what);

}  // namespace cx::cuda
