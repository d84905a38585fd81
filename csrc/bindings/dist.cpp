// Bindings of the process group and the collectives: NumPy arrays in, C++ views
// out, GIL released around every call into the core. No algorithm here.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/collective_docs.h"
#include "distributed/default_group.h"
#include "cuda/blas.h"
#include "cuda/driver.h"
#include "cuda/module.h"
#include "distributed/backend/nccl/nccl_api.h"
#include "distributed/backend/nccl/nccl_backend.h"

namespace cx::bindings {

using namespace cx::distributed;

namespace {

// A checked view of an array handed to a collective: a NumPy array with the
// CPU backend, an array with __cuda_array_interface__ (CuPy) with NCCL.
struct View {
  py::object obj;  // keeps the array alive
  void* ptr = nullptr;
  size_t count = 0;  // elements (of dt)
  DataType dt = DataType::kBytes;
  size_t size = 0;    // elements of the array's own dtype
  size_t nbytes = 0;
  py::object dtype;  // the NumPy dtype (also for GPU arrays); its name only for messages
  std::string dtype_name() const { return py::str(dtype.attr("name")); }
  std::vector<int64_t> shape;
  uintptr_t stream = 0;  // GPU arrays: the stream to order the collective after (0: legacy default)
};

// The reducible dtype of an array, from its descriptor's kind and size (cheap:
// this runs on every call); ml_dtypes' bfloat16 (kind 'V') is recognised by
// name. nullopt: not reducible (moved as bytes).
std::optional<DataType> reducible_dtype(const py::dtype& d) {
  const char kind = d.kind();
  const auto size = d.itemsize();
  switch (kind) {
    case 'f':
      if (size == 4) return DataType::kFloat32;
      if (size == 8) return DataType::kFloat64;
      if (size == 2) return DataType::kFloat16;
      break;
    case 'i':
      if (size == 4) return DataType::kInt32;
      if (size == 8) return DataType::kInt64;
      break;
    case 'u':
      if (size == 1) return DataType::kUInt8;
      break;
    case 'V':
      if (size == 2 && std::string(py::str(d.attr("name"))) == "bfloat16") return DataType::kBFloat16;
      break;
    default: break;
  }
  return std::nullopt;
}

bool is_gpu_array(const py::handle& obj) { return py::hasattr(obj, "__cuda_array_interface__"); }
// What NumPy can view without a copy: an ndarray, anything with the buffer protocol
// (memoryview, array.array, bytearray, ...) or the array interface. Objects that only
// have __array__ (a torch.Tensor, say) may hand NumPy a copy, and a collective that
// writes its result into a copy loses it: those are refused (not_an_array).
bool is_host_array(const py::handle& obj) {
  return py::isinstance<py::array>(obj) || PyObject_CheckBuffer(obj.ptr()) ||
         py::hasattr(obj, "__array_interface__");
}
// The ndarray viewing a host array's memory (see is_host_array). Buffers go through a
// memoryview: np.asarray(b"ab") would make a new 0-d string array, not a view.
py::array host_array(const py::handle& obj) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  auto asarray = py::module_::import("numpy").attr("asarray");
  if (PyObject_CheckBuffer(obj.ptr())) return asarray(py::memoryview(py::reinterpret_borrow<py::object>(obj)));
  return asarray(obj);
}
bool is_array(const py::handle& obj, bool gpu) { return gpu ? is_gpu_array(obj) : is_host_array(obj); }
std::string type_name(const py::handle& obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }
std::string module_name(const py::handle& obj) {
  return py::str(py::type::handle_of(obj).attr("__module__"));
}

[[noreturn]] void not_an_array(const char* what, const py::handle& obj, bool gpu) {
  std::string tname = type_name(obj);
  if (gpu && py::isinstance<py::array>(obj)) {
    CX_THROW(TypeMismatch, what, " is a NumPy array, but the process group uses BackendType.NCCL, which works on "
             "GPU arrays: pass cupy.asarray(a) (and use that array afterwards), or use BackendType.CPU "
             "(DISTRIBUTED_BACKEND=cpu) for NumPy arrays");
  }
  if (gpu) {
    CX_THROW(TypeMismatch, what, " must be a GPU array (a CuPy array, or any object with __cuda_array_interface__) "
             "with BackendType.NCCL, got ", tname);
  }
  if (is_gpu_array(obj)) {
    CX_THROW(TypeMismatch, what, " is a GPU array (", tname, "), but the process group uses BackendType.CPU, which "
             "works on NumPy arrays: initialize with BackendType.NCCL (DISTRIBUTED_BACKEND=nccl) for GPU arrays, "
             "or copy it to the host with cupy.asnumpy(a)");
  }
  if (module_name(obj).rfind("torch", 0) == 0 && tname == "Tensor") {
    CX_THROW(TypeMismatch, what, " is a torch.Tensor: pass t.numpy(), which shares the tensor's memory, so the "
             "result lands in the tensor (t.detach().numpy() if it requires grad)");
  }
  CX_THROW(TypeMismatch, what, " must be a NumPy array (or an object NumPy can view without a copy: a "
           "memoryview, array.array, bytearray, anything with the buffer protocol), got ", tname);
}

// Refuses what cannot travel between processes as its bytes: Python objects
// (pointers, meaningless in another process; the receiver would crash reading
// them) and non-native byte order (reduced as if native, it gives wrong numbers
// without an error; moved, a peer with the native type would misread it).
void check_transferable(const py::dtype& d, const char* what) {
  constexpr uint64_t kHasObject = 0x01;  // NPY_ITEM_HASOBJECT: the dtype holds PyObject pointers
  if (d.flags() & kHasObject) {
    CX_THROW(TypeMismatch, what, " has dtype ", std::string(py::str(d)), ", which holds pointers to Python "
             "objects; they mean nothing in another process. Send bytes instead: pickle on your side, "
             "e.g. np.frombuffer(pickle.dumps(obj), np.uint8) (send its length first)");
  }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  constexpr char kForeign = '>';
#else
  constexpr char kForeign = '<';
#endif
  bool native = d.byteorder() != kForeign;
  if (native && d.has_fields()) native = d.attr("isnative").cast<bool>();  // byteorder is '|' for records
  if (!native) {
    CX_THROW(TypeMismatch, what, " has dtype ", std::string(py::str(d)), ", whose byte order is not this machine's: "
             "pass arr.astype(arr.dtype.newbyteorder('=')) (and use that array afterwards)");
  }
}

// Fills dt/count from the dtype name (or the bfloat16 override).
void set_dtype(View& v, size_t itemsize, const char* what, bool reduce,
               const std::optional<std::string>& dtype_override) {
  std::optional<DataType> dt;
  if (dtype_override) {
    if (*dtype_override != "bfloat16") {
      CX_THROW(InvalidArgument, "dtype='", *dtype_override, "' is not supported: the only override is 'bfloat16' "
                                "(for bfloat16 values stored in a uint16 array)");
    }
    if (itemsize != 2) {
      CX_THROW(TypeMismatch, "dtype='bfloat16' needs a 2-byte array (uint16 storage), got itemsize ", itemsize);
    }
    dt = DataType::kBFloat16;
  } else {
    dt = reducible_dtype(py::reinterpret_borrow<py::dtype>(v.dtype));
  }
  if (dt) {
    v.dt = *dt;
    v.count = v.size;
  } else if (reduce) {
    CX_THROW(TypeMismatch, what, " has dtype ", v.dtype_name(), ", which cannot be reduced: use float32, float64, "
             "float16, bfloat16 (ml_dtypes, or uint16 storage with dtype='bfloat16'), int32, int64 or uint8");
  } else {
    v.dt = DataType::kBytes;  // moved, never combined: any dtype works
    v.count = v.nbytes;
  }
}

const char* kContiguous = " must be C-contiguous (collectives work in place on the array's memory): ";

View numpy_view(const py::handle& obj, const char* what, bool writable, bool reduce,
                const std::optional<std::string>& dtype_override) {
  View v;
  py::array arr = host_array(obj);
  v.obj = arr;
  check_transferable(arr.dtype(), what);
  if (!(arr.flags() & py::array::c_style)) {
    CX_THROW(InvalidArgument, what, kContiguous, "pass numpy.ascontiguousarray(a) and use that array afterwards");
  }
  if (writable && !arr.writeable()) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  v.ptr = const_cast<void*>(arr.data());
  v.size = static_cast<size_t>(arr.size());
  v.nbytes = static_cast<size_t>(arr.nbytes());
  v.dtype = arr.dtype();
  for (py::ssize_t i = 0; i < arr.ndim(); ++i) v.shape.push_back(arr.shape(i));
  set_dtype(v, static_cast<size_t>(arr.itemsize()), what, reduce, dtype_override);
  return v;
}

// __cuda_array_interface__ (versions 0..3): shape, typestr, data=(ptr, readonly),
// strides (None: C-contiguous), mask (must be None), stream (v3; None: no sync).
View gpu_view(const py::handle& obj, const char* what, bool writable, bool reduce,
              const std::optional<std::string>& dtype_override) {
  View v;
  v.obj = py::reinterpret_borrow<py::object>(obj);
  py::dict cai = obj.attr("__cuda_array_interface__");
  auto bad = [&](const std::string& why) {
    CX_THROW(TypeMismatch, what, " has an invalid __cuda_array_interface__ (", why, ")");
  };
  if (!cai.contains("shape") || !cai.contains("typestr") || !cai.contains("data")) bad("shape, typestr and data are required");
  if (cai.contains("mask") && !cai["mask"].is_none()) {
    CX_THROW(TypeMismatch, what, " is a masked GPU array; collectives need plain arrays");
  }
  for (auto d : py::reinterpret_borrow<py::tuple>(cai["shape"])) v.shape.push_back(d.cast<int64_t>());
  std::string typestr = py::str(cai["typestr"]);
  py::object np_dtype = py::module_::import("numpy").attr("dtype")(typestr);
  size_t itemsize = np_dtype.attr("itemsize").cast<size_t>();
  if (typestr.size() < 3 || (typestr[0] == '>' && itemsize > 1)) {
    CX_THROW(TypeMismatch, what, " has typestr '", typestr, "': only little-endian GPU arrays are supported");
  }
  v.dtype = np_dtype;
  py::tuple data = cai["data"];
  if (data.size() != 2) bad("data must be (pointer, read_only)");
  v.ptr = reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  if (writable && data[1].cast<bool>()) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  v.size = 1;
  for (int64_t d : v.shape) v.size *= static_cast<size_t>(d);
  v.nbytes = v.size * itemsize;
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    py::tuple strides = cai["strides"];
    if (strides.size() != v.shape.size()) bad("strides and shape differ in length");
    int64_t expect = static_cast<int64_t>(itemsize);
    for (size_t i = v.shape.size(); i-- > 0;) {
      if (v.shape[i] > 1 && strides[i].cast<int64_t>() != expect) {
        CX_THROW(InvalidArgument, what, kContiguous, "pass cupy.ascontiguousarray(a) and use that array afterwards");
      }
      expect *= v.shape[i];
    }
  }
  if (cai.contains("stream") && !cai["stream"].is_none()) v.stream = cai["stream"].cast<uintptr_t>();
  set_dtype(v, itemsize, what, reduce, dtype_override);
  return v;
}

// `gpu`: the group's backend is NCCL. `reduce`: the collective combines
// elements, so the dtype must be one we can reduce. `writable`: the collective
// writes into it.
View view_of(const py::handle& obj, const char* what, bool writable, bool reduce, bool gpu,
             const std::optional<std::string>& dtype_override = std::nullopt) {
  if (!is_array(obj, gpu)) not_an_array(what, obj, gpu);
  return gpu ? gpu_view(obj, what, writable, reduce, dtype_override)
             : numpy_view(obj, what, writable, reduce, dtype_override);
}

void same_layout(const View& ref, const View& v, const std::string& what) {
  if (v.dt != ref.dt || v.count != ref.count || !v.dtype.equal(ref.dtype)) {
    CX_THROW(InvalidArgument, what, " has ", v.size, " elements of ", v.dtype_name(), " but ", ref.size,
             " elements of ", ref.dtype_name(), " are expected (every block must match the input array)");
  }
}

// A list of p arrays, or one array holding p blocks of `per` elements.
std::vector<View> blocks_of(const py::handle& obj, const char* what, const View& ref, int p, bool writable, bool gpu) {
  std::vector<View> out;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    if (static_cast<int>(seq.size()) != p) {
      CX_THROW(InvalidArgument, what, " has ", seq.size(), " entries, but the world size is ", p,
               ": pass one array per rank");
    }
    for (size_t i = 0; i < seq.size(); ++i) {
      std::string item = std::string(what) + "[" + std::to_string(i) + "]";
      View v = view_of(seq[i], item.c_str(), writable, false, gpu);
      if (ref.dt != DataType::kBytes && v.dt == DataType::kBytes) same_layout(ref, v, item);
      v.dt = ref.dt;
      if (ref.dt != DataType::kBytes) v.count = v.size;
      same_layout(ref, v, item);
      out.push_back(std::move(v));
    }
    return out;
  }
  View whole = view_of(obj, what, writable, false, gpu);
  if (!whole.dtype.equal(ref.dtype) || whole.nbytes != p * ref.nbytes) {
    CX_THROW(InvalidArgument, what, " must hold world_size x ", ref.size, " elements of ", ref.dtype_name(), " (", p,
             " x ", ref.nbytes, " bytes); got ", whole.size, " elements of ", whole.dtype_name());
  }
  size_t block = ref.nbytes;
  for (int i = 0; i < p; ++i) {
    View v;
    v.obj = whole.obj;
    v.ptr = static_cast<char*>(whole.ptr) + block * static_cast<size_t>(i);
    v.count = ref.count;
    v.dt = ref.dt;
    out.push_back(std::move(v));
  }
  return out;
}

// What an async collective returns. Holds the arrays it works on, so they
// outlive the operation; dropping an unfinished handle waits for it.
struct PyWork {
  std::shared_ptr<Work> work;
  py::list keep;
  ~PyWork() {
    if (work && !work->is_completed()) {
      py::gil_scoped_release nogil;
      try {
        work->wait();
      } catch (...) {
      }
    }
  }
};

template <typename... Keep>
py::object finish(ProcessGroup::WorkPtr w, bool async, const Keep&... keep) {
  if (!async) return py::none();
  auto pw = std::make_unique<PyWork>();
  pw->work = std::move(w);
  (pw->keep.append(keep), ...);
  return py::cast(std::move(pw));
}

bool on_gpu(const ProcessGroup& pg) { return pg.config().backend == BackendType::kNccl; }

template <typename F>
ProcessGroup::WorkPtr call(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

}  // namespace

void bind_dist(py::module_& m) {
  py::enum_<ReduceOp>(m, "ReduceOp", "How all_reduce, reduce and reduce_scatter combine values.")
      .value("SUM", ReduceOp::kSum)
      .value("AVG", ReduceOp::kAvg)
      .value("PRODUCT", ReduceOp::kProduct)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax);

  py::enum_<BackendType>(m, "BackendType", "Transport of the process group.")
      .value("CPU", BackendType::kCpu)
      .value("NCCL", BackendType::kNccl);

  py::class_<Config>(m, "DistributedConfig",
                     "Where this process sits in the job. from_environment() reads RANK, WORLD_SIZE, LOCAL_RANK, "
                     "MASTER_ADDR, MASTER_PORT, DISTRIBUTED_BACKEND, DISTRIBUTED_TIMEOUT_MS (timeout_ms: how long "
                     "init() waits for every rank) and DISTRIBUTED_OPERATION_TIMEOUT_MS (operation_timeout_ms: how "
                     "long one collective waits for its peers).")
      .def(py::init<>())
      .def_readwrite("rank", &Config::rank)
      .def_readwrite("world_size", &Config::world_size)
      .def_readwrite("local_rank", &Config::local_rank)
      .def_readwrite("master_addr", &Config::master_addr)
      .def_readwrite("master_port", &Config::master_port)
      .def_readwrite("backend", &Config::backend)
      .def_readwrite("timeout_ms", &Config::timeout_ms,
                     "Milliseconds init() waits for every rank to arrive (default 600000, 10 min)")
      .def_readwrite("operation_timeout_ms", &Config::operation_timeout_ms,
                     "Milliseconds one collective waits for its peers (default 1800000, 30 min)")
      .def_readwrite("chunk_bytes", &Config::chunk_bytes)
      .def_readwrite("small_allreduce_bytes", &Config::small_allreduce_bytes)
      .def_readwrite("spin_us", &Config::spin_us)
      .def_static("from_environment", &Config::from_environment)
      .def("validate", &Config::validate)
      .def("__repr__", [](const Config& c) {
        return "DistributedConfig(rank=" + std::to_string(c.rank) + ", world_size=" + std::to_string(c.world_size) +
               ", local_rank=" + std::to_string(c.local_rank) + ", master_addr='" + c.master_addr +
               "', master_port=" + std::to_string(c.master_port) +
               ", backend=" + (c.backend == BackendType::kCpu ? "CPU" : "NCCL") +
               ", timeout_ms=" + std::to_string(c.timeout_ms) +
               ", operation_timeout_ms=" + std::to_string(c.operation_timeout_ms) + ")";
      });

  py::class_<PyWork>(m, "Work", "Handle of an async collective (async_op=True).")
      .def(
          "wait",
          [](PyWork& w, std::optional<double> timeout) {
            int64_t ms = timeout ? static_cast<int64_t>(*timeout * 1000.0) : -1;
            bool ok;
            {
              py::gil_scoped_release nogil;
              ok = w.work->wait(ms);
            }
            if (!ok) {
              CX_THROW(TimeoutError, "the collective did not complete within ", *timeout,
                       " s (it is still running; wait again, or check the other ranks)");
            }
            return true;
          },
          py::arg("timeout") = py::none(),
          "Block until the collective is done (timeout in seconds; None: its own deadline). Raises its error.")
      .def("is_completed", [](PyWork& w) { return w.work->is_completed(); })
      .def("__repr__", [](PyWork& w) {
        return std::string("<cx.distributed.Work ") + (w.work->is_completed() ? "completed>" : "pending>");
      });

  m.def(
      "init",
      [](const Config& cfg) {
        py::gil_scoped_release nogil;
        init_default_group(cfg);
      },
      py::arg("config"));
  m.def("finalize", [] {
    py::gil_scoped_release nogil;
    finalize_default_group();
  });
  m.def("is_initialized", [] { return default_group() != nullptr; });
  m.def("get_rank", [] { return require_default_group("get_rank()")->rank(); });
  m.def("get_world_size", [] { return require_default_group("get_world_size()")->size(); });
  m.def("get_local_rank", [] { return require_default_group("get_local_rank()")->config().local_rank; });
  m.def("get_config", [] { return require_default_group("get_config()")->config(); });

  m.def(
      "all_reduce",
      [](py::object arr, ReduceOp op, bool async_op, std::optional<std::string> dtype) {
        auto pg = require_default_group("all_reduce()");
        const bool gpu = on_gpu(*pg);
        View v = view_of(arr, "the array", true, true, gpu, dtype);
        auto w = call([&] { return pg->all_reduce(v.ptr, v.count, v.dt, op, async_op, v.stream); });
        return finish(w, async_op, v.obj);
      },
      py::arg("arr"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false, py::arg("dtype") = py::none(),
      docs::kAllReduce);

  m.def(
      "broadcast",
      [](py::object arr, int src, bool async_op) {
        auto pg = require_default_group("broadcast()");
        const bool gpu = on_gpu(*pg);
        View v = view_of(arr, "the array", true, false, gpu);
        auto w = call([&] { return pg->broadcast(v.ptr, v.count, v.dt, src, async_op, v.stream); });
        return finish(w, async_op, v.obj);
      },
      py::arg("arr"), py::arg("src") = 0, py::arg("async_op") = false, docs::kBroadcast);

  m.def(
      "all_gather",
      [](py::object out, py::object arr, bool async_op) {
        auto pg = require_default_group("all_gather()");
        const bool gpu = on_gpu(*pg);
        View in = view_of(arr, "the input array", false, false, gpu);
        auto blocks = blocks_of(out, "the output", in, pg->size(), true, gpu);
        std::vector<void*> outs;
        for (auto& b : blocks) outs.push_back(b.ptr);
        auto w = call([&] { return pg->all_gather(in.ptr, outs, in.count, in.dt, async_op, in.stream); });
        return finish(w, async_op, out, in.obj);
      },
      py::arg("out"), py::arg("arr"), py::arg("async_op") = false, docs::kAllGather);

  m.def(
      "reduce_scatter",
      [](py::object out, py::object inputs, ReduceOp op, bool async_op, std::optional<std::string> dtype) {
        auto pg = require_default_group("reduce_scatter()");
        const bool gpu = on_gpu(*pg);
        View o = view_of(out, "the output array", true, true, gpu, dtype);
        auto blocks = blocks_of(inputs, "the input", o, pg->size(), false, gpu);
        std::vector<const void*> ins;
        for (auto& b : blocks) ins.push_back(b.ptr);
        auto w = call([&] { return pg->reduce_scatter(ins, o.ptr, o.count, o.dt, op, async_op, o.stream); });
        return finish(w, async_op, out, inputs);
      },
      py::arg("out"), py::arg("inputs"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
      py::arg("dtype") = py::none(), docs::kReduceScatter);

  m.def(
      "reduce",
      [](py::object arr, int dst, ReduceOp op, bool async_op, std::optional<std::string> dtype) {
        auto pg = require_default_group("reduce()");
        const bool gpu = on_gpu(*pg);
        View v = view_of(arr, "the array", true, true, gpu, dtype);
        auto w = call([&] { return pg->reduce(v.ptr, v.count, v.dt, op, dst, async_op, v.stream); });
        return finish(w, async_op, v.obj);
      },
      py::arg("arr"), py::arg("dst") = 0, py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
      py::arg("dtype") = py::none(), docs::kReduce);

  m.def(
      "scatter",
      [](py::object arr, py::object scatter_list, int src, bool async_op) {
        auto pg = require_default_group("scatter()");
        const bool gpu = on_gpu(*pg);
        View o = view_of(arr, "the output array", true, false, gpu);
        std::vector<const void*> ins;
        if (pg->rank() == src) {
          if (scatter_list.is_none()) {
            CX_THROW(InvalidArgument, "scatter(): the source rank ", src, " must pass scatter_list (one array per rank)");
          }
          for (auto& b : blocks_of(scatter_list, "scatter_list", o, pg->size(), false, gpu)) ins.push_back(b.ptr);
        }
        auto w = call([&] { return pg->scatter(ins, o.ptr, o.count, o.dt, src, async_op, o.stream); });
        return finish(w, async_op, o.obj, scatter_list);
      },
      py::arg("arr"), py::arg("scatter_list") = py::none(), py::arg("src") = 0, py::arg("async_op") = false,
      docs::kScatter);

  m.def(
      "gather",
      [](py::object arr, py::object gather_list, int dst, bool async_op) {
        auto pg = require_default_group("gather()");
        const bool gpu = on_gpu(*pg);
        View in = view_of(arr, "the input array", false, false, gpu);
        std::vector<void*> outs;
        if (pg->rank() == dst) {
          if (gather_list.is_none()) {
            CX_THROW(InvalidArgument, "gather(): the destination rank ", dst, " must pass gather_list (one array per rank)");
          }
          for (auto& b : blocks_of(gather_list, "gather_list", in, pg->size(), true, gpu)) outs.push_back(b.ptr);
        }
        auto w = call([&] { return pg->gather(in.ptr, outs, in.count, in.dt, dst, async_op, in.stream); });
        return finish(w, async_op, in.obj, gather_list);
      },
      py::arg("arr"), py::arg("gather_list") = py::none(), py::arg("dst") = 0, py::arg("async_op") = false,
      docs::kGather);

  m.def(
      "all_to_all",
      [](py::object out, py::object inputs, bool async_op) {
        auto pg = require_default_group("all_to_all()");
        const bool gpu = on_gpu(*pg);
        if (!(py::isinstance<py::list>(inputs) || py::isinstance<py::tuple>(inputs)) && !is_array(inputs, gpu)) {
          not_an_array("the input", inputs, gpu);
        }
        // The reference block: the first input block.
        py::object first;
        if (is_array(inputs, gpu)) {
          View a = view_of(inputs, "the input", false, false, gpu);
          if (a.shape.empty() || a.shape[0] != pg->size()) {
            CX_THROW(InvalidArgument, "all_to_all(): an input array must have world_size (", pg->size(),
                     ") rows, one block per destination rank");
          }
          first = inputs[py::int_(0)];
        } else {
          auto seq = py::reinterpret_borrow<py::sequence>(inputs);
          if (seq.size() == 0) CX_THROW(InvalidArgument, "all_to_all(): the input list is empty");
          first = seq[0];
        }
        View ref = view_of(first, "the input[0]", false, false, gpu);
        auto ib = blocks_of(inputs, "the input", ref, pg->size(), false, gpu);
        auto ob = blocks_of(out, "the output", ref, pg->size(), true, gpu);
        std::vector<const void*> ins;
        std::vector<void*> outs;
        for (auto& b : ib) ins.push_back(b.ptr);
        for (auto& b : ob) outs.push_back(b.ptr);
        auto w = call([&] { return pg->all_to_all(ins, outs, ref.count, ref.dt, async_op, ref.stream); });
        return finish(w, async_op, out, inputs);
      },
      py::arg("out"), py::arg("inputs"), py::arg("async_op") = false, docs::kAllToAll);

  m.def(
      "barrier",
      [](bool async_op) {
        auto pg = require_default_group("barrier()");
        auto w = call([&] { return pg->barrier(async_op); });
        return finish(w, async_op);
      },
      py::arg("async_op") = false, docs::kBarrier);

  m.def(
      "send",
      [](py::object arr, int dst, bool async_op) {
        auto pg = require_default_group("send()");
        const bool gpu = on_gpu(*pg);
        View v = view_of(arr, "the array", false, false, gpu);
        auto w = call([&] { return pg->send(v.ptr, v.count, v.dt, dst, async_op, v.stream); });
        return finish(w, async_op, v.obj);
      },
      py::arg("arr"), py::arg("dst"), py::arg("async_op") = false, docs::kSend);

  m.def(
      "recv",
      [](py::object arr, int src, bool async_op) {
        auto pg = require_default_group("recv()");
        const bool gpu = on_gpu(*pg);
        View v = view_of(arr, "the array", true, false, gpu);
        auto w = call([&] { return pg->recv(v.ptr, v.count, v.dt, src, async_op, v.stream); });
        return finish(w, async_op, v.obj);
      },
      py::arg("arr"), py::arg("src"), py::arg("async_op") = false, docs::kRecv);

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
