#include "distributed/backend/nccl/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "common/env.h"
#include "common/error.h"

namespace cx::distributed::nccl {

namespace {

std::mutex g_api_mu;
std::vector<std::string> g_dirs;
const NcclApi* g_api = nullptr;  // never destroyed: NCCL outlives every static destructor

template <typename F>
bool bind_symbol(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  return fn != nullptr;
}

// Returns an error message, or "" with *api filled.
std::string try_load(const std::string& path, NcclApi* api) {
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    return e ? e : (path + ": cannot be loaded");
  }
  api->path = path;
  const char* missing = nullptr;
#define CX_BIND(name) \
  if (!missing && !bind_symbol(lib, api->name, #name)) missing = #name
  CX_BIND(ncclGetVersion);
  CX_BIND(ncclGetUniqueId);
  CX_BIND(ncclCommInitRank);
  CX_BIND(ncclCommDestroy);
  CX_BIND(ncclCommAbort);
  CX_BIND(ncclCommGetAsyncError);
  CX_BIND(ncclGetErrorString);
  CX_BIND(ncclAllReduce);
  CX_BIND(ncclBroadcast);
  CX_BIND(ncclReduce);
  CX_BIND(ncclAllGather);
  CX_BIND(ncclReduceScatter);
  CX_BIND(ncclSend);
  CX_BIND(ncclRecv);
  CX_BIND(ncclGroupStart);
  CX_BIND(ncclGroupEnd);
#undef CX_BIND
  if (missing) return path + " has no " + missing + " (NCCL older than 2.7?)";
  bind_symbol(lib, api->ncclGetLastError, "ncclGetLastError");
  if (api->ncclGetVersion(&api->version) != ncclSuccess) return path + ": ncclGetVersion failed";
  return "";
}

}  // namespace

std::string NcclApi::error_text(ncclResult_t r, ncclComm_t comm) const {
  std::string s = detail::concat("NCCL error ", r, " (", ncclGetErrorString ? ncclGetErrorString(r) : "?", ")");
  if (ncclGetLastError) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) s += std::string(": ") + last;
  }
  return s;
}

void set_nccl_search_dirs(std::vector<std::string> dirs) {
  std::lock_guard<std::mutex> lk(g_api_mu);
  g_dirs = std::move(dirs);
}

const NcclApi& nccl_api() {
  std::lock_guard<std::mutex> lk(g_api_mu);
  if (g_api) return *g_api;
  auto api = std::make_unique<NcclApi>();
  std::vector<std::string> tried;
  const char* over = env::get("CX_NCCL_LIBRARY");
  std::vector<std::string> paths;
  if (over) {
    paths.push_back(over);
  } else {
    for (const auto& d : g_dirs) paths.push_back(d + "/libnccl.so.2");
    paths.push_back("libnccl.so.2");
  }
  for (const auto& p : paths) {
    std::string err = try_load(p, api.get());
    if (err.empty()) {
      g_api = api.release();
      return *g_api;
    }
    tried.push_back(err);
  }
  std::string list;
  for (const auto& t : tried) list += "\n  " + t;
  if (over && *over) {
    CX_THROW(Error, "the NCCL library CX_NCCL_LIBRARY='", over, "' could not be used:", list,
             "\nunset CX_NCCL_LIBRARY to use the installed nvidia-nccl wheel or the system's libnccl.so.2");
  }
  CX_THROW(Error, "BackendType.NCCL needs the NCCL library (libnccl.so.2), which was not found. Install it with "
                  "`pip install pycyxwiz[cuda12]` (or `pip install nvidia-nccl-cu12`; cuda13 / nvidia-nccl-cu13 for "
                  "CUDA 13), or put a system libnccl.so.2 on LD_LIBRARY_PATH. Tried:",
           list);
}

ncclDataType_t to_nccl(DataType t) {
  switch (t) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kUInt8: return ncclUint8;
    case DataType::kBytes: return ncclUint8;
    case DataType::kInt8: return ncclInt8;  // moved only: ProcessGroup refuses int8 reductions on NCCL
    case DataType::kBool: return ncclUint8;  // moved only: ProcessGroup refuses bool reductions on NCCL
  }
  return ncclUint8;
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kBand:  // NCCL has no bitwise reductions (ProcessGroup::check_reduction refuses them first)
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
    case ReduceOp::kNone: break;
  }
  CX_THROW(InvalidArgument, "no NCCL reduction for ", op_name(op));
}

}  // namespace cx::distributed::nccl
