// Bindings of the default process group: BackendType, DistributedConfig, init/finalize and the get_* queries.
#include <pybind11/stl.h>

#include <string>

#include "bindings/bindings.h"
#include "distributed/default_group.h"
#include "distributed/transport/shm/shm.h"
#include "distributed/transport/spin_policy.h"

namespace cx::bindings {

using namespace cx::distributed;

namespace {

void bind_distributed_config(py::module_& m) {
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
      .def_readwrite("check_interval", &Config::check_interval,
                     "Every this many collectives the ranks compare what they called (0: only at barrier() and "
                     "finalize(); CX_CHECK_INTERVAL)")
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
}

}  // namespace

void bind_process_group(py::module_& m) {
  py::enum_<BackendType>(m, "BackendType", "Transport of the process group.")
      .value("CPU", BackendType::kCpu)
      .value("NCCL", BackendType::kNccl);
  bind_distributed_config(m);

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
  m.def("_finalize_at_exit", [] {
    py::gil_scoped_release nogil;
    finalize_default_group(true);
  });
  m.def("is_initialized", [] { return default_group() != nullptr; });
  m.def("get_rank", [] { return require_default_group("get_rank()")->rank(); });
  m.def("get_world_size", [] { return require_default_group("get_world_size()")->size(); });
  m.def("get_local_rank", [] { return require_default_group("get_local_rank()")->config().local_rank; });
  m.def("get_config", [] { return require_default_group("get_config()")->config(); });
  // For the benchmarks: payload bytes this rank has sent over its transport (0 with NCCL).
  m.def("_bytes_sent", [] { return require_default_group("_bytes_sent()")->bytes_sent(); });
  // For the tests: messages this process has copied straight out of a peer's memory (Note [Single-copy large
  // messages] in transport/shm/shm.h).
  m.def("_single_copies", [] { return shm::single_copies(); });
  // For the tests: waits that slept without spinning, the ranks sharing cores with other programs' threads (Note
  // [Ranks that share cores with other programs] in transport/spin_policy.h).
  m.def("_slept_for_others", [] { return OthersOnTheCpus::sleeps(); });
  m.def("_set_call_site", &set_call_site, py::arg("site"),
        "CX_DEBUG=DETAIL: the Python call site (file:line) of the next collective on this thread; \"\" clears it. "
        "Internal (Note [Call sites in CX_DEBUG=DETAIL]).");
  m.def(
      "_abort",
      [](const std::string& why) {
        auto pg = default_group();
        if (!pg) return false;
        py::gil_scoped_release nogil;
        pg->abort(why);
        return true;
      },
      py::arg("why"), "The program on this rank failed: tell every peer why (rank R failed: <why>). Internal.");
  m.def(
      "monitored_barrier",
      [](double timeout) {
        if (!(timeout > 0)) throw py::value_error("monitored_barrier: timeout must be a positive number of seconds");
        auto pg = require_default_group("monitored_barrier()");
        py::gil_scoped_release nogil;
        pg->monitored_barrier(static_cast<int64_t>(timeout * 1000.0));
      },
      py::arg("timeout") = 1800.0,
      "Every rank waits until all have arrived; ranks that did not within `timeout` seconds are named "
      "(DistributedTimeoutError on every rank that arrived).\n\n"
      "    cx.distributed.monitored_barrier(timeout=30)   # 'rank(s) 2 did not arrive within 30000 ms'");
  m.def(
      "_flight_record",
      [] {
        auto pg = require_default_group("flight_record()");
        FlightRecord f = pg->flight_record();
        py::list out;
        for (const auto& e : f.entries) {
          static const char* states[] = {"queued", "running", "done", "failed"};
          out.append(py::dict(py::arg("op") = kind_name(e.desc.kind), py::arg("seq") = e.desc.seq,
                              py::arg("count") = e.desc.count, py::arg("dtype") = dtype_name(e.desc.dtype),
                              py::arg("root") = e.desc.root, py::arg("state") = states[e.state],
                              py::arg("start_us") = e.start_us, py::arg("end_us") = e.end_us,
                              py::arg("describe") = e.desc.describe()));
        }
        return out;
      },
      "This rank's last operations, oldest first (the flight recorder). Internal.");
  m.def("_describe_setup", [] { return require_default_group("describe_setup()")->describe_setup(); });
}

}  // namespace cx::bindings
