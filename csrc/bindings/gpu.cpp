// Bindings of the GPU backend's library discovery and probes, and hooks for tests that run without a GPU.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "distributed/default_group.h"
#include "cuda/blas.h"
#include "cuda/driver.h"
#include "cuda/module.h"
#include "distributed/backend/nccl/nccl_api.h"
#include "distributed/backend/nccl/nccl_backend.h"
#include "nn/device_model.h"
#include "nn/sequential.h"

namespace cx::bindings {

using namespace cx::distributed;

void bind_gpu(py::module_& m) {
  // ---- GPU backend: library discovery, probes, and hooks for tests that run without a GPU ----
  m.def("_set_cublas_search_dirs", &cuda::set_cublas_search_dirs, py::arg("dirs"),
        "Directories searched for libcublas.so.13/.12 first (the nvidia wheels' lib folders).");
  m.def("_set_nccl_search_dirs", &nccl::set_nccl_search_dirs, py::arg("dirs"),
        "Directories searched for libnccl.so.2 before the system's (the Python side passes the nvidia wheels').");
  m.def(
      "_nccl_library",
      [] {
        py::gil_scoped_release nogil;
        const auto& api = nccl::nccl_api();
        return std::make_pair(api.path, api.version);
      },
      "Loads NCCL (raises if it cannot be found) and returns (path, version code).");
  m.def("_cuda_device_count", [] {
    py::gil_scoped_release nogil;
    return cuda::device_count_or_zero();
  });
  m.def("_cuda_kernels_built", &cuda::kernels_built, "True if nvcc compiled the CUDA kernels into this build.");
  m.def("_check_gpu_local_rank", &cuda::check_local_rank, py::arg("local_rank"), py::arg("device_count"));
  m.def("_check_model_runs_on_gpu", &nn::check_runs_on_gpu, py::arg("model"),
        "For tests: what the GPU trainer checks of a model before it opens a GPU (raises ValueError naming the "
        "first layer without GPU code).");
  m.def(
      "_array_view",
      [](py::object arr, BackendType backend, bool writable, bool reduce, std::optional<std::string> dtype) {
        View v = view_of(arr, "the array", writable, reduce, backend == BackendType::kNccl, dtype);
        py::dict d;
        d["ptr"] = reinterpret_cast<uintptr_t>(v.ptr);
        d["count"] = v.count;
        d["dtype"] = dtype_name(v.dt);
        d["nbytes"] = v.nbytes;
        d["stream"] = v.stream;
        return d;
      },
      py::arg("arr"), py::arg("backend"), py::arg("writable") = true, py::arg("reduce") = true,
      py::arg("dtype") = py::none(),
      "For tests: the checked view a collective would see of `arr` under `backend` (raises what it would raise).");
  m.def(
      "_nccl_id_exchange_selftest",
      [](const Config& cfg, int fail_rank, int first_byte) {
        std::string id;
        {
          py::gil_scoped_release nogil;
          id = nccl_id_exchange_selftest(cfg, fail_rank, first_byte);
        }
        return py::bytes(id);
      },
      py::arg("config"), py::arg("fail_rank") = -1, py::arg("first_byte") = -1,
      "For tests: the NCCL unique-id exchange through a real store, with a random id instead of NCCL's\n"
      "(its first byte set to first_byte when that is 0..255).");
}

}  // namespace cx::bindings
