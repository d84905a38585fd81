// Bindings of the collectives and their Work handle. Each collective converts its arrays (arrays.h), releases the
// GIL around the call into the process group and, with async_op=True, returns a Work that keeps the arrays alive.
// The docstrings are in collective_docs.h.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "bindings/collective_docs.h"
#include "bindings/keywords.h"
#include "common/error.h"
#include "distributed/default_group.h"
#include "distributed/store/store_interface.h"

namespace cx::bindings {

using namespace cx::distributed;

namespace {

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

using GroupPtr = std::shared_ptr<ProcessGroup>;

bool on_gpu(const ProcessGroup& pg) { return pg.config().backend == BackendType::kNccl; }

template <typename F>
ProcessGroup::WorkPtr call(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

void bind_work(py::module_& m) {
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
}

// ---- the collectives, in the order the module defines them

py::object all_reduce(const GroupPtr& pg, py::object arr, ReduceOp op, bool async_op,
                      std::optional<std::string> dtype) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", true, true, gpu, dtype);
  auto w = call([&] { return pg->all_reduce(v.ptr, v.count, v.dt, op, async_op, v.stream); });
  return finish(w, async_op, v.obj);
}

py::object broadcast(const GroupPtr& pg, py::object arr, int src, bool async_op) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", pg->rank() != src, false, gpu);  // the root only reads its array
  auto w = call([&] { return pg->broadcast(v.ptr, v.count, v.dt, src, async_op, v.stream); });
  return finish(w, async_op, v.obj);
}

py::object all_gather(const GroupPtr& pg, py::object out, py::object arr, bool async_op) {
  const bool gpu = on_gpu(*pg);
  View in = view_of(arr, "the input array", false, false, gpu);
  auto blocks = blocks_of(out, "the output", in, pg->size(), true, gpu);
  std::vector<void*> outs;
  for (auto& b : blocks) outs.push_back(b.ptr);
  auto w = call([&] { return pg->all_gather(in.ptr, outs, in.count, in.dt, async_op, in.stream); });
  return finish(w, async_op, out, in.obj);
}

py::object reduce_scatter(const GroupPtr& pg, py::object out, py::object inputs, ReduceOp op, bool async_op,
                          std::optional<std::string> dtype) {
  const bool gpu = on_gpu(*pg);
  View o = view_of(out, "the output array", true, true, gpu, dtype);
  auto blocks = blocks_of(inputs, "the input", o, pg->size(), false, gpu);
  std::vector<const void*> ins;
  for (auto& b : blocks) ins.push_back(b.ptr);
  auto w = call([&] { return pg->reduce_scatter(ins, o.ptr, o.count, o.dt, op, async_op, o.stream); });
  return finish(w, async_op, out, inputs);
}

py::object reduce(const GroupPtr& pg, py::object arr, int dst, ReduceOp op, bool async_op,
                  std::optional<std::string> dtype) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", true, true, gpu, dtype);
  auto w = call([&] { return pg->reduce(v.ptr, v.count, v.dt, op, dst, async_op, v.stream); });
  return finish(w, async_op, v.obj);
}

py::object scatter(const GroupPtr& pg, py::object arr, py::object scatter_list, int src, bool async_op) {
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
}

py::object gather(const GroupPtr& pg, py::object arr, py::object gather_list, int dst, bool async_op) {
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
}

py::object all_to_all(const GroupPtr& pg, py::object out, py::object inputs, bool async_op) {
  const bool gpu = on_gpu(*pg);
  // The reference block: one row of an input array (a 1-D array of world_size elements has
  // one-element blocks), or the first array of an input list. Anything else view_of refuses by name
  // (asking is_array first cost a microsecond a call: a NumPy array's missing __cuda_array_interface__).
  View first, ref;
  if (!(py::isinstance<py::list>(inputs) || py::isinstance<py::tuple>(inputs))) {
    first = view_of(inputs, "the input", false, false, gpu);
    if (first.shape.empty() || first.shape[0] != pg->size()) {
      CX_THROW(InvalidArgument, "all_to_all(): an input array must have world_size (", pg->size(),
               ") rows, one block per destination rank");
    }
    ref = one_block(first, pg->size());
  } else {
    auto seq = py::reinterpret_borrow<py::sequence>(inputs);
    if (seq.size() == 0) CX_THROW(InvalidArgument, "all_to_all(): the input list is empty");
    first = ref = view_of(seq[0], "the input[0]", false, false, gpu);
  }
  auto ib = blocks_of(inputs, "the input", ref, pg->size(), false, gpu, &first);
  auto ob = blocks_of(out, "the output", ref, pg->size(), true, gpu);
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (auto& b : ib) ins.push_back(b.ptr);
  for (auto& b : ob) outs.push_back(b.ptr);
  auto w = call([&] { return pg->all_to_all(ins, outs, ref.count, ref.dt, async_op, ref.stream); });
  return finish(w, async_op, out, inputs);
}

py::object barrier(const GroupPtr& pg, bool async_op) {
  auto w = call([&] { return pg->barrier(async_op); });
  return finish(w, async_op);
}

py::object send(const GroupPtr& pg, py::object arr, int dst, bool async_op, uint32_t tag = 0) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", false, false, gpu);
  auto w = call([&] { return pg->send(v.ptr, v.count, v.dt, dst, async_op, v.stream, tag); });
  return finish(w, async_op, v.obj);
}

py::object recv(const GroupPtr& pg, py::object arr, int src, bool async_op, uint32_t tag = 0) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", true, false, gpu);
  auto w = call([&] { return pg->recv(v.ptr, v.count, v.dt, src, async_op, v.stream, tag); });
  return finish(w, async_op, v.obj);
}

// (work or None, source): `source()` is the sender's rank once the receive is done (-1 before).
py::object recv_any(const GroupPtr& pg, py::object arr, bool async_op, uint32_t tag) {
  const bool gpu = on_gpu(*pg);
  View v = view_of(arr, "the array", true, false, gpu);
  auto source = std::make_shared<int>(-1);
  auto w = call([&] { return pg->recv_any(v.ptr, v.count, v.dt, async_op, tag, source); });
  py::object src = py::cpp_function([source] { return *source; });
  return py::make_tuple(finish(w, async_op, v.obj), src);
}

// A process group of its own (not the default one), made over a Python store: pycyxwiz.torch makes one per torch
// process group. Dropping it closes its connections, without the GIL (its store may need it).
struct Group {
  std::shared_ptr<ProcessGroup> pg;
  ~Group() {
    if (!pg) return;
    py::gil_scoped_release nogil;
    pg.reset();
  }
};

// A collective of the default group's form as a method of Group.
template <typename... A>
auto on(py::object (*f)(const GroupPtr&, A...)) {
  return [f](Group& g, A... a) { return f(g.pg, std::move(a)...); };
}

void bind_group(py::module_& m) {
  py::class_<Group>(m, "Group",
                    "A process group of its own, meeting its peers through a torch.distributed Store (set, check, "
                    "get) instead of MASTER_PORT: pycyxwiz.torch makes one per torch process group. Its methods are "
                    "the collectives of cx.distributed, on this group.")
      .def(py::init([](const Config& cfg, py::object store, const std::string& ip, const std::string& secret) {
             auto st = external_store(std::move(store), ip, cfg.rank);
             auto g = std::make_unique<Group>();
             py::gil_scoped_release nogil;
             g->pg = std::make_shared<ProcessGroup>(cfg, std::move(st), secret);
             return g;
           }),
           py::arg("config"), py::arg("store"), py::arg("ip"), py::arg("secret"),
           "Meets config.world_size ranks through `store` (blocks until all have, or config.timeout_ms). `ip`: "
           "this host's address for its peers; `secret`: proves the group's connections (the same on every rank).")
      .def("rank", [](Group& g) { return g.pg->rank(); })
      .def("size", [](Group& g) { return g.pg->size(); })
      .def_property_readonly("config", [](Group& g) { return g.pg->config(); })
      .def("poisoned", [](Group& g) { return g.pg->poisoned(); })
      .def("_bytes_sent", [](Group& g) { return g.pg->bytes_sent(); })
      .def(
          "abort",
          [](Group& g, const std::string& why) {
            py::gil_scoped_release nogil;
            g.pg->abort(why);
          },
          py::arg("why"), "The program on this rank failed: every peer raises 'rank R failed: <why>'.")
      .def(
          "shutdown",
          [](Group& g, bool check) {
            py::gil_scoped_release nogil;
            g.pg->shutdown(check ? ProcessGroup::Check::kFull : ProcessGroup::Check::kAtExit);
          },
          py::arg("check") = true,
          "Waits for queued work, compares the ranks' collectives (check=False: waits at most a second for the "
          "others) and closes the connections. Idempotent.")
      .def(
          "monitored_barrier",
          [](Group& g, double timeout) {
            if (!(timeout > 0)) {
              throw py::value_error("monitored_barrier: timeout must be a positive number of seconds");
            }
            py::gil_scoped_release nogil;
            g.pg->monitored_barrier(static_cast<int64_t>(timeout * 1000.0));
          },
          py::arg("timeout") = 1800.0)
      .def("all_reduce", on(&all_reduce), py::arg("arr"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
           py::arg("dtype") = py::none())
      .def("broadcast", on(&broadcast), py::arg("arr"), py::arg("src") = 0, py::arg("async_op") = false)
      .def("all_gather", on(&all_gather), py::arg("out"), py::arg("arr"), py::arg("async_op") = false)
      .def("reduce_scatter", on(&reduce_scatter), py::arg("out"), py::arg("inputs"), py::arg("op") = ReduceOp::kSum,
           py::arg("async_op") = false, py::arg("dtype") = py::none())
      .def("reduce", on(&reduce), py::arg("arr"), py::arg("dst") = 0, py::arg("op") = ReduceOp::kSum,
           py::arg("async_op") = false, py::arg("dtype") = py::none())
      .def("scatter", on(&scatter), py::arg("arr"), py::arg("scatter_list") = py::none(), py::arg("src") = 0,
           py::arg("async_op") = false)
      .def("gather", on(&gather), py::arg("arr"), py::arg("gather_list") = py::none(), py::arg("dst") = 0,
           py::arg("async_op") = false)
      .def("all_to_all", on(&all_to_all), py::arg("out"), py::arg("inputs"), py::arg("async_op") = false)
      .def("barrier", on(&barrier), py::arg("async_op") = false)
      .def("send", on(&send), py::arg("arr"), py::arg("dst"), py::arg("async_op") = false, py::arg("tag") = 0)
      .def("recv", on(&recv), py::arg("arr"), py::arg("src"), py::arg("async_op") = false, py::arg("tag") = 0)
      .def("recv_any", on(&recv_any), py::arg("arr"), py::arg("async_op") = false, py::arg("tag") = 0)
      .def("__repr__", [](Group& g) {
        return "<cx.distributed.Group rank " + std::to_string(g.pg->rank()) + " of " + std::to_string(g.pg->size()) +
               (g.pg->poisoned() ? ", failed>" : ">");
      });
}

}  // namespace

void bind_collectives(py::module_& m) {
  py::enum_<ReduceOp>(m, "ReduceOp", "How all_reduce, reduce and reduce_scatter combine values.")
      .value("SUM", ReduceOp::kSum)
      .value("AVG", ReduceOp::kAvg)
      .value("PRODUCT", ReduceOp::kProduct)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax)
      .value("BAND", ReduceOp::kBand)
      .value("BOR", ReduceOp::kBor)
      .value("BXOR", ReduceOp::kBxor);
  bind_work(m);

  // Each collective twice: on the default group (cx.distributed.all_reduce, ...) and as a method of a Group
  // (several groups in one process: pycyxwiz.torch makes one per torch process group).
  auto dflt = [](const char* caller) { return require_default_group(caller); };
  m.def("all_reduce", [=](py::object a, ReduceOp op, bool as, std::optional<std::string> dt) {
        return all_reduce(dflt("all_reduce()"), a, op, as, dt); },
        py::arg("arr"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false, py::arg("dtype") = py::none(),
        docs::kAllReduce);
  m.def("broadcast", [=](py::object a, int src, bool as) { return broadcast(dflt("broadcast()"), a, src, as); },
        py::arg("arr"), py::arg("src") = 0, py::arg("async_op") = false, docs::kBroadcast);
  m.def("all_gather", [=](py::object o, py::object a, bool as) { return all_gather(dflt("all_gather()"), o, a, as); },
        py::arg("out"), py::arg("arr"), py::arg("async_op") = false, docs::kAllGather);
  m.def("reduce_scatter", [=](py::object o, py::object i, ReduceOp op, bool as, std::optional<std::string> dt) {
        return reduce_scatter(dflt("reduce_scatter()"), o, i, op, as, dt); },
        py::arg("out"), py::arg("inputs"), py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
        py::arg("dtype") = py::none(), docs::kReduceScatter);
  m.def("reduce", [=](py::object a, int dst, ReduceOp op, bool as, std::optional<std::string> dt) {
        return reduce(dflt("reduce()"), a, dst, op, as, dt); },
        py::arg("arr"), py::arg("dst") = 0, py::arg("op") = ReduceOp::kSum, py::arg("async_op") = false,
        py::arg("dtype") = py::none(), docs::kReduce);
  m.def("scatter",
        [=](py::object a, py::object l, int src, bool as) { return scatter(dflt("scatter()"), a, l, src, as); },
        py::arg("arr"), py::arg("scatter_list") = py::none(), py::arg("src") = 0, py::arg("async_op") = false,
        docs::kScatter);
  m.def("gather", [=](py::object a, py::object l, int dst, bool as) { return gather(dflt("gather()"), a, l, dst, as); },
        py::arg("arr"), py::arg("gather_list") = py::none(), py::arg("dst") = 0, py::arg("async_op") = false,
        docs::kGather);
  m.def("all_to_all", [=](py::object o, py::object i, bool as) { return all_to_all(dflt("all_to_all()"), o, i, as); },
        py::arg("out"), py::arg("inputs"), py::arg("async_op") = false, docs::kAllToAll);
  m.def("barrier", [=](bool as) { return barrier(dflt("barrier()"), as); }, py::arg("async_op") = false,
        docs::kBarrier);
  m.def("send", [=](py::object a, int dst, bool as) { return send(dflt("send()"), a, dst, as); }, py::arg("arr"),
        py::arg("dst"), py::arg("async_op") = false, docs::kSend);
  m.def("recv", [=](py::object a, int src, bool as) { return recv(dflt("recv()"), a, src, as); }, py::arg("arr"),
        py::arg("src"), py::arg("async_op") = false, docs::kRecv);
  // Note [Keyword arguments before pybind11's dispatcher]: the defaults are the m.def's above.
  const py::object sum = py::cast(ReduceOp::kSum), no = py::bool_(false), none = py::none(), zero = py::int_(0);
  const py::object required;
  keyword_front(m, "all_reduce", {{"arr", required}, {"op", sum}, {"async_op", no}, {"dtype", none}});
  keyword_front(m, "broadcast", {{"arr", required}, {"src", zero}, {"async_op", no}});
  keyword_front(m, "all_gather", {{"out", required}, {"arr", required}, {"async_op", no}});
  keyword_front(m, "reduce_scatter",
                {{"out", required}, {"inputs", required}, {"op", sum}, {"async_op", no}, {"dtype", none}});
  keyword_front(m, "reduce", {{"arr", required}, {"dst", zero}, {"op", sum}, {"async_op", no}, {"dtype", none}});
  keyword_front(m, "scatter", {{"arr", required}, {"scatter_list", none}, {"src", zero}, {"async_op", no}});
  keyword_front(m, "gather", {{"arr", required}, {"gather_list", none}, {"dst", zero}, {"async_op", no}});
  keyword_front(m, "all_to_all", {{"out", required}, {"inputs", required}, {"async_op", no}});
  keyword_front(m, "barrier", {{"async_op", no}});
  keyword_front(m, "send", {{"arr", required}, {"dst", required}, {"async_op", no}});
  keyword_front(m, "recv", {{"arr", required}, {"src", required}, {"async_op", no}});
  bind_group(m);
}

}  // namespace cx::bindings
