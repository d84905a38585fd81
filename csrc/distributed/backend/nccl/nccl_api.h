// defines: our own declarations of the part of NCCL's C API the backend uses
// (nccl.h is not needed to build), NcclApi (the functions, loaded at run time)
// and nccl_api() to load it.
//
// Where libnccl.so.2 comes from, first hit wins:
//   1. CX_NCCL_LIBRARY, a full path (then nothing else is tried);
//   2. <dir>/libnccl.so.2 for each dir of set_nccl_search_dirs(): the Python
//      side passes site-packages/nvidia/nccl/lib (the nvidia-nccl-cu12 /
//      nvidia-nccl-cu13 wheels that `pip install pycyxwiz[cuda12]` brings);
//   3. the system's (dlopen("libnccl.so.2"): LD_LIBRARY_PATH, ldconfig).
// Nothing is loaded until a process group with BackendType.NCCL is created.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "distributed/types.h"

namespace cx::distributed::nccl {

// ---- NCCL's ABI (stable since NCCL 2.0; ncclAvg and bfloat16 since 2.10) ----
using ncclResult_t = int;
constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclUnhandledCudaError = 1;
constexpr ncclResult_t ncclSystemError = 2;
constexpr ncclResult_t ncclInternalError = 3;
constexpr ncclResult_t ncclInvalidArgument = 4;
constexpr ncclResult_t ncclInvalidUsage = 5;
constexpr ncclResult_t ncclRemoteError = 6;
constexpr ncclResult_t ncclInProgress = 7;

using ncclDataType_t = int;
constexpr ncclDataType_t ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
                         ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9;

using ncclRedOp_t = int;
constexpr ncclRedOp_t ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4;

constexpr size_t kUniqueIdBytes = 128;
struct ncclUniqueId {
  char internal[kUniqueIdBytes];
};
using ncclComm_t = struct ncclComm*;
using cudaStream_t = void*;  // a CUstream: the runtime and driver share stream handles

struct NcclApi {
  std::string path;  // the library that was loaded
  int version = 0;   // ncclGetVersion: 22703 for 2.27.3
  ncclResult_t (*ncclGetVersion)(int*);
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId*);
  ncclResult_t (*ncclCommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*ncclCommDestroy)(ncclComm_t);
  ncclResult_t (*ncclCommAbort)(ncclComm_t);
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*ncclGetErrorString)(ncclResult_t);
  const char* (*ncclGetLastError)(ncclComm_t);  // NCCL >= 2.13; may be null
  ncclResult_t (*ncclAllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclBroadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclAllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                    cudaStream_t);
  ncclResult_t (*ncclSend)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclRecv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*ncclGroupStart)();
  ncclResult_t (*ncclGroupEnd)();

  bool has_avg() const { return version >= 21000; }
  // "ncclSystemError (unhandled system error ...): <last error>"
  std::string error_text(ncclResult_t r, ncclComm_t comm = nullptr) const;
};

// Directories searched before the system's (replaces the previous list).
void set_nccl_search_dirs(std::vector<std::string> dirs);

// Loads NCCL once per process. Throws Error naming what was tried and what to
// install if no usable libnccl.so.2 is found.
const NcclApi& nccl_api();

ncclDataType_t to_nccl(DataType t);
// NCCL's op for ours. AVG maps to ncclAvg (api.has_avg() must be true).
ncclRedOp_t to_nccl(ReduceOp op);

}  // namespace cx::distributed::nccl
