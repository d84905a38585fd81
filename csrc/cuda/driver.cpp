#include "cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "common/env.h"
#include "common/error.h"

namespace cx::cuda {

namespace {

constexpr const char* kUseCpu = "use BackendType.CPU (DISTRIBUTED_BACKEND=cpu) on this machine";

// Not named `bind`: an unqualified bind(lib, fn, "name", std::string) finds std::bind by argument-dependent
// lookup wherever <functional> is visible (the layers' precompiled headers make it so), which then wins the
// overload, builds a binder nobody calls, and leaves every pointer null: the first call into the driver was a
// jump to address 0 (tests/test_gpu.py::test_the_driver_loader_binds_every_entry_point).
template <typename F>
void bind_symbol(void* lib, F& fn, const char* name, const std::string& path) {
  void* p = ::dlsym(lib, name);
  if (!p) {
    CX_THROW(Error, "BackendType.NCCL needs an NVIDIA GPU: ", path, " was loaded but has no ", name,
             ", so it is not a usable NVIDIA driver (it is older than CUDA 12 or not libcuda at all); update the "
             "driver, or ", kUseCpu);
  }
  fn = reinterpret_cast<F>(p);
}

struct Loaded {
  CudaDriver drv;
  std::string error;  // non-empty: loading or cuInit failed
};

Loaded load() {
  Loaded out;
  CudaDriver& d = out.drv;
  const char* over = env::get("CX_CUDA_DRIVER_LIBRARY");
  d.path = over ? over : "libcuda.so.1";
  void* lib = ::dlopen(d.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    out.error = detail::concat("no NVIDIA GPU visible: the NVIDIA driver library ", d.path, " could not be loaded (",
                               why ? why : "not found", "). BackendType.NCCL needs an NVIDIA GPU and its driver; ",
                               kUseCpu);
    return out;
  }
  try {
    bind_symbol(lib, d.cuInit, "cuInit", d.path);
    bind_symbol(lib, d.cuDriverGetVersion, "cuDriverGetVersion", d.path);
    bind_symbol(lib, d.cuDeviceGetCount, "cuDeviceGetCount", d.path);
    bind_symbol(lib, d.cuDeviceGet, "cuDeviceGet", d.path);
    bind_symbol(lib, d.cuDeviceGetName, "cuDeviceGetName", d.path);
    bind_symbol(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", d.path);
    bind_symbol(lib, d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", d.path);
    bind_symbol(lib, d.cuCtxSetCurrent, "cuCtxSetCurrent", d.path);
    bind_symbol(lib, d.cuCtxSynchronize, "cuCtxSynchronize", d.path);
    bind_symbol(lib, d.cuStreamCreate, "cuStreamCreate", d.path);
    bind_symbol(lib, d.cuStreamDestroy, "cuStreamDestroy_v2", d.path);
    bind_symbol(lib, d.cuStreamSynchronize, "cuStreamSynchronize", d.path);
    bind_symbol(lib, d.cuStreamQuery, "cuStreamQuery", d.path);
    bind_symbol(lib, d.cuStreamWaitEvent, "cuStreamWaitEvent", d.path);
    bind_symbol(lib, d.cuEventCreate, "cuEventCreate", d.path);
    bind_symbol(lib, d.cuEventDestroy, "cuEventDestroy_v2", d.path);
    bind_symbol(lib, d.cuEventRecord, "cuEventRecord", d.path);
    bind_symbol(lib, d.cuEventQuery, "cuEventQuery", d.path);
    bind_symbol(lib, d.cuMemAlloc, "cuMemAlloc_v2", d.path);
    bind_symbol(lib, d.cuMemFree, "cuMemFree_v2", d.path);
    bind_symbol(lib, d.cuMemHostAlloc, "cuMemHostAlloc", d.path);
    bind_symbol(lib, d.cuMemFreeHost, "cuMemFreeHost", d.path);
    bind_symbol(lib, d.cuPointerGetAttribute, "cuPointerGetAttribute", d.path);
    bind_symbol(lib, d.cuPointerGetAttributes, "cuPointerGetAttributes", d.path);
    bind_symbol(lib, d.cuModuleLoadData, "cuModuleLoadData", d.path);
    bind_symbol(lib, d.cuModuleUnload, "cuModuleUnload", d.path);
    bind_symbol(lib, d.cuModuleGetFunction, "cuModuleGetFunction", d.path);
    bind_symbol(lib, d.cuLaunchKernel, "cuLaunchKernel", d.path);
    bind_symbol(lib, d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", d.path);
    bind_symbol(lib, d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", d.path);
    bind_symbol(lib, d.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", d.path);
    bind_symbol(lib, d.cuMemsetD8Async, "cuMemsetD8Async", d.path);
    bind_symbol(lib, d.cuGetErrorName, "cuGetErrorName", d.path);
    bind_symbol(lib, d.cuGetErrorString, "cuGetErrorString", d.path);
  } catch (const Error& e) {
    out.error = e.what();
    return out;  // the library stays loaded: unloading a driver is never safe
  }
  CUresult r = d.cuInit(0);
  if (r != kSuccess) {
    out.error = detail::concat("no NVIDIA GPU visible: the NVIDIA driver (", d.path, ") is installed but cuInit failed with ",
                               d.error_text(r), ". BackendType.NCCL needs a working NVIDIA GPU; check nvidia-smi and "
                               "CUDA_VISIBLE_DEVICES, or ", kUseCpu);
  }
  return out;
}

const Loaded& loaded() {
  static std::once_flag once;
  static Loaded* l = nullptr;  // never destroyed: the driver outlives every static destructor
  std::call_once(once, [] { l = new Loaded(load()); });
  return *l;
}

}  // namespace

std::string CudaDriver::error_text(CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName) cuGetErrorName(r, &name);
  if (cuGetErrorString) cuGetErrorString(r, &text);
  return detail::concat(name ? name : "CUDA error", " (", text ? text : "code " + std::to_string(r), ")");
}

const CudaDriver& cuda_driver() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw Error(l.error);
  return l.drv;
}

int device_count_or_zero() {
  const Loaded& l = loaded();
  if (!l.error.empty()) return 0;
  int n = 0;
  if (l.drv.cuDeviceGetCount(&n) != kSuccess) return 0;
  return n;
}

void check_local_rank(int local_rank, int device_count) {
  if (device_count <= 0) {
    CX_THROW(Error, "no NVIDIA GPU visible: the driver reports no device (CUDA_VISIBLE_DEVICES='",
             env::get("CUDA_VISIBLE_DEVICES") ? env::get("CUDA_VISIBLE_DEVICES") : "<unset>", "'); ", kUseCpu);
  }
  if (local_rank >= device_count) {
    const char* vis = env::get("CUDA_VISIBLE_DEVICES");
    CX_THROW(InvalidArgument, "LOCAL_RANK=", local_rank, " has no GPU: this machine shows ", device_count,
             device_count == 1 ? " GPU" : " GPUs", " (cuda:0 .. cuda:", device_count - 1,
             vis ? std::string(", CUDA_VISIBLE_DEVICES='") + vis + "'" : std::string(),
             "). With BackendType.NCCL each rank on a machine needs its own GPU (NCCL refuses two ranks on one GPU): "
             "start at most ", device_count, " ranks per machine, or use BackendType.CPU");
  }
}

void check_cu(CUresult r, const char* what) {
  if (r != kSuccess) CX_THROW(Error, what, " failed: ", cuda_driver().error_text(r));
}

}  // namespace cx::cuda
