// Bindings of the process group and the collectives: NumPy arrays in, C++ views
// out, GIL released around every call into the core. No algorithm here.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "dist/default_group.h"

namespace cx::bindings {

using namespace cx::dist;

namespace {

// A checked view of a NumPy array handed to a collective.
struct View {
  py::array arr;
  void* ptr = nullptr;
  size_t count = 0;  // elements (of dt)
  DataType dt = DataType::kBytes;
};

// dtype by name; ml_dtypes' bfloat16 included. nullopt: not reducible (moved as bytes).
std::optional<DataType> reducible_dtype(const py::dtype& d) {
  std::string name = py::str(d.attr("name"));
  if (name == "float32") return DataType::kFloat32;
  if (name == "float64") return DataType::kFloat64;
  if (name == "float16") return DataType::kFloat16;
  if (name == "bfloat16") return DataType::kBFloat16;
  if (name == "int32") return DataType::kInt32;
  if (name == "int64") return DataType::kInt64;
  if (name == "uint8") return DataType::kUInt8;
  return std::nullopt;
}

[[noreturn]] void not_an_array(const char* what, const py::handle& obj) {
  std::string tname = py::str(py::type::handle_of(obj).attr("__name__"));
  if (py::hasattr(obj, "__cuda_array_interface__")) {
    CX_THROW(TypeMismatch, what, " is a GPU array (", tname,
             "): GPU arrays need the NCCL backend, which this build of pycyxwiz does not have yet; "
             "copy it to a NumPy array (e.g. cupy.asnumpy) or use NumPy arrays with the CPU backend");
  }
  CX_THROW(TypeMismatch, what, " must be a NumPy array, got ", tname);
}

// `reduce`: the collective combines elements, so the dtype must be one we can
// reduce. `writable`: the collective writes into it.
View view_of(const py::handle& obj, const char* what, bool writable, bool reduce,
             const std::optional<std::string>& dtype_override = std::nullopt) {
  if (!py::isinstance<py::array>(obj)) not_an_array(what, obj);
  View v;
  v.arr = py::reinterpret_borrow<py::array>(obj);
  if (!(v.arr.flags() & py::array::c_style)) {
    CX_THROW(InvalidArgument, what, " must be C-contiguous (collectives work in place on the array's memory): "
                                    "pass numpy.ascontiguousarray(a) and use that array afterwards");
  }
  if (writable && !v.arr.writeable()) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  v.ptr = const_cast<void*>(v.arr.data());
  std::optional<DataType> dt;
  if (dtype_override) {
    if (*dtype_override != "bfloat16") {
      CX_THROW(InvalidArgument, "dtype='", *dtype_override, "' is not supported: the only override is 'bfloat16' "
                                "(for bfloat16 values stored in a uint16 array)");
    }
    if (v.arr.itemsize() != 2) {
      CX_THROW(TypeMismatch, "dtype='bfloat16' needs a 2-byte array (uint16 storage), got itemsize ", v.arr.itemsize());
    }
    dt = DataType::kBFloat16;
  } else {
    dt = reducible_dtype(v.arr.dtype());
  }
  if (dt) {
    v.dt = *dt;
    v.count = static_cast<size_t>(v.arr.size());
  } else if (reduce) {
    std::string name = py::str(v.arr.dtype().attr("name"));
    CX_THROW(TypeMismatch, what, " has dtype ", name, ", which cannot be reduced: use float32, float64, float16, "
             "bfloat16 (ml_dtypes, or uint16 storage with dtype='bfloat16'), int32, int64 or uint8");
  } else {
    v.dt = DataType::kBytes;  // moved, never combined: any dtype works
    v.count = static_cast<size_t>(v.arr.nbytes());
  }
  return v;
}

void same_layout(const View& ref, const View& v, const std::string& what) {
  if (v.dt != ref.dt || v.count != ref.count || !v.arr.dtype().is(ref.arr.dtype())) {
    std::string a = py::str(v.arr.dtype().attr("name")), b = py::str(ref.arr.dtype().attr("name"));
    CX_THROW(InvalidArgument, what, " has ", v.arr.size(), " elements of ", a, " but ", ref.arr.size(),
             " elements of ", b, " are expected (every block must match the input array)");
  }
}

// A list of p arrays, or one array holding p blocks of `per` elements.
std::vector<View> blocks_of(const py::handle& obj, const char* what, const View& ref, int p, bool writable) {
  std::vector<View> out;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    if (static_cast<int>(seq.size()) != p) {
      CX_THROW(InvalidArgument, what, " has ", seq.size(), " entries, but the world size is ", p,
               ": pass one array per rank");
    }
    for (size_t i = 0; i < seq.size(); ++i) {
      std::string item = std::string(what) + "[" + std::to_string(i) + "]";
      View v = view_of(seq[i], item.c_str(), writable, false);
      if (ref.dt != DataType::kBytes && v.dt == DataType::kBytes) same_layout(ref, v, item);
      v.dt = ref.dt;
      if (ref.dt != DataType::kBytes) v.count = static_cast<size_t>(v.arr.size());
      same_layout(ref, v, item);
      out.push_back(std::move(v));
    }
    return out;
  }
  View whole = view_of(obj, what, writable, false);
  if (!whole.arr.dtype().is(ref.arr.dtype()) || static_cast<size_t>(whole.arr.nbytes()) != p * static_cast<size_t>(ref.arr.nbytes())) {
    std::string a = py::str(whole.arr.dtype().attr("name")), b = py::str(ref.arr.dtype().attr("name"));
    CX_THROW(InvalidArgument, what, " must hold world_size x ", ref.arr.size(), " elements of ", b, " (", p, " x ",
             ref.arr.nbytes(), " bytes); got ", whole.arr.size(), " elements of ", a);
  }
  size_t block = static_cast<size_t>(ref.arr.nbytes());
  for (int i = 0; i < p; ++i) {
    View v;
    v.arr = whole.arr;
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

py::object finish(ProcessGroup::WorkPtr w, bool async, py::list keep) {
  if (!async) return py::none();
  auto pw = std::make_unique<PyWork>();
  pw->work = std::move(w);
  pw->keep = std::move(keep);
  return py::cast(std::move(pw));
}

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

  py::enum_<Backend>(m, "BackendType", "Transport of the process group.")
      .value("CPU", Backend::kCpu)
      .value("NCCL", Backend::kNccl);

  py::class_<Config>(m, "DistributedConfig",
                     "Where this process sits in the job. Defaults as seed 004; from_environment() reads RANK, "
                     "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, DISTRIBUTED_BACKEND, DISTRIBUTED_TIMEOUT_MS.")
      .def(py::init<>())
      .def_readwrite("rank", &Config::rank)
      .def_readwrite("world_size", &Config::world_size)
      .def_readwrite("local_rank", &Config::local_rank)
      .def_readwrite("master_addr", &Config::master_addr)
      .def_readwrite("master_port", &Config::master_port)
      .def_readwrite("backend", &Config::backend)
      .def_readwrite("timeout_ms", &Config::timeout_ms)
      .def_readwrite("chunk_bytes", &Config::chunk_bytes)
      .def_readwrite("small_allreduce_bytes", &Config::small_allreduce_bytes)
      .def_readwrite("spin_us", &Config::spin_us)
      .def_static("from_environment", &Config::from_environment)
      .def("validate", &Config::validate)
      .def("__repr__", [](const Config& c) {
        return "DistributedConfig(rank=" + std::to_string(c.rank) + ", world_size=" + std::to_string(c.world_size) +
               ", local_rank=" + std::to_string(c.local_rank) + ", master_addr='" + c.master_addr +
               "', master_port=" + std::to_string(c.master_port) +
               ", backend=" + (c.backend == Backend::kCpu ? "CPU" : "NCCL") +
               ", timeout_ms=" + std::to_string(c.timeout_ms) + ")";
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
        View v = view_of(arr, "the array", true, true, dtype);
        auto w = call([&] { return pg->all_reduce(v.ptr, v.count, v.dt, op, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr)));
      },
      py::arg("arr"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false, py::arg("dtype") = py::none());

  m.def(
      "broadcast",
      [](py::object arr, int src, bool async_op) {
        auto pg = require_default_group("broadcast()");
        View v = view_of(arr, "the array", true, false);
        auto w = call([&] { return pg->broadcast(v.ptr, v.count, v.dt, src, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr)));
      },
      py::arg("arr"), py::arg("src") = 0, py::arg("async_op") = false);

  m.def(
      "all_gather",
      [](py::object out, py::object arr, bool async_op) {
        auto pg = require_default_group("all_gather()");
        View in = view_of(arr, "the input array", false, false);
        auto blocks = blocks_of(out, "the output", in, pg->size(), true);
        std::vector<void*> outs;
        for (auto& b : blocks) outs.push_back(b.ptr);
        auto w = call([&] { return pg->all_gather(in.ptr, outs, in.count, in.dt, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(out, arr)));
      },
      py::arg("out"), py::arg("arr"), py::arg("async_op") = false);

  m.def(
      "reduce_scatter",
      [](py::object out, py::object inputs, ReduceOp op, bool async_op, std::optional<std::string> dtype) {
        auto pg = require_default_group("reduce_scatter()");
        View o = view_of(out, "the output array", true, true, dtype);
        auto blocks = blocks_of(inputs, "the input", o, pg->size(), false);
        std::vector<const void*> ins;
        for (auto& b : blocks) ins.push_back(b.ptr);
        auto w = call([&] { return pg->reduce_scatter(ins, o.ptr, o.count, o.dt, op, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(out, inputs)));
      },
      py::arg("out"), py::arg("inputs"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
      py::arg("dtype") = py::none());

  m.def(
      "reduce",
      [](py::object arr, int dst, ReduceOp op, bool async_op, std::optional<std::string> dtype) {
        auto pg = require_default_group("reduce()");
        View v = view_of(arr, "the array", true, true, dtype);
        auto w = call([&] { return pg->reduce(v.ptr, v.count, v.dt, op, dst, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr)));
      },
      py::arg("arr"), py::arg("dst") = 0, py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
      py::arg("dtype") = py::none());

  m.def(
      "scatter",
      [](py::object arr, py::object scatter_list, int src, bool async_op) {
        auto pg = require_default_group("scatter()");
        View o = view_of(arr, "the output array", true, false);
        std::vector<const void*> ins;
        if (pg->rank() == src) {
          if (scatter_list.is_none()) {
            CX_THROW(InvalidArgument, "scatter(): the source rank ", src, " must pass scatter_list (one array per rank)");
          }
          for (auto& b : blocks_of(scatter_list, "scatter_list", o, pg->size(), false)) ins.push_back(b.ptr);
        }
        auto w = call([&] { return pg->scatter(ins, o.ptr, o.count, o.dt, src, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr, scatter_list)));
      },
      py::arg("arr"), py::arg("scatter_list") = py::none(), py::arg("src") = 0, py::arg("async_op") = false);

  m.def(
      "gather",
      [](py::object arr, py::object gather_list, int dst, bool async_op) {
        auto pg = require_default_group("gather()");
        View in = view_of(arr, "the input array", false, false);
        std::vector<void*> outs;
        if (pg->rank() == dst) {
          if (gather_list.is_none()) {
            CX_THROW(InvalidArgument, "gather(): the destination rank ", dst, " must pass gather_list (one array per rank)");
          }
          for (auto& b : blocks_of(gather_list, "gather_list", in, pg->size(), true)) outs.push_back(b.ptr);
        }
        auto w = call([&] { return pg->gather(in.ptr, outs, in.count, in.dt, dst, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr, gather_list)));
      },
      py::arg("arr"), py::arg("gather_list") = py::none(), py::arg("dst") = 0, py::arg("async_op") = false);

  m.def(
      "all_to_all",
      [](py::object out, py::object inputs, bool async_op) {
        auto pg = require_default_group("all_to_all()");
        if (!(py::isinstance<py::list>(inputs) || py::isinstance<py::tuple>(inputs)) &&
            !py::isinstance<py::array>(inputs)) {
          not_an_array("the input", inputs);
        }
        // The reference block: the first input block.
        py::object first;
        if (py::isinstance<py::array>(inputs)) {
          py::array a = py::reinterpret_borrow<py::array>(inputs);
          if (a.ndim() == 0 || a.shape(0) != pg->size()) {
            CX_THROW(InvalidArgument, "all_to_all(): an input array must have world_size (", pg->size(),
                     ") rows, one block per destination rank");
          }
          first = inputs[py::int_(0)];
        } else {
          auto seq = py::reinterpret_borrow<py::sequence>(inputs);
          if (seq.size() == 0) CX_THROW(InvalidArgument, "all_to_all(): the input list is empty");
          first = seq[0];
        }
        View ref = view_of(first, "the input[0]", false, false);
        auto ib = blocks_of(inputs, "the input", ref, pg->size(), false);
        auto ob = blocks_of(out, "the output", ref, pg->size(), true);
        std::vector<const void*> ins;
        std::vector<void*> outs;
        for (auto& b : ib) ins.push_back(b.ptr);
        for (auto& b : ob) outs.push_back(b.ptr);
        auto w = call([&] { return pg->all_to_all(ins, outs, ref.count, ref.dt, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(out, inputs)));
      },
      py::arg("out"), py::arg("inputs"), py::arg("async_op") = false);

  m.def(
      "barrier",
      [](bool async_op) {
        auto pg = require_default_group("barrier()");
        auto w = call([&] { return pg->barrier(async_op); });
        return finish(w, async_op, py::list());
      },
      py::arg("async_op") = false);

  m.def(
      "send",
      [](py::object arr, int dst, bool async_op) {
        auto pg = require_default_group("send()");
        View v = view_of(arr, "the array", false, false);
        auto w = call([&] { return pg->send(v.ptr, v.count, v.dt, dst, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr)));
      },
      py::arg("arr"), py::arg("dst"), py::arg("async_op") = false);

  m.def(
      "recv",
      [](py::object arr, int src, bool async_op) {
        auto pg = require_default_group("recv()");
        View v = view_of(arr, "the array", true, false);
        auto w = call([&] { return pg->recv(v.ptr, v.count, v.dt, src, async_op); });
        return finish(w, async_op, py::list(py::make_tuple(arr)));
      },
      py::arg("arr"), py::arg("src"), py::arg("async_op") = false);
}

}  // namespace cx::bindings
