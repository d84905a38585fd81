// Bindings of DDPConfig and DistributedDataParallel (csrc/train/ddp.h), and of the bucket assignment for tests.
#include <pybind11/stl.h>

#include <cstring>
#include <sstream>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "distributed/default_group.h"
#include "train/buckets.h"
#include "train/ddp.h"

namespace cx::bindings {

using namespace cx::train;

namespace {

using DDPClass = shared_class<DistributedDataParallel>;

// What no_sync() returns: a context manager that turns gradient synchronisation off and restores it.
struct NoSync {
  std::shared_ptr<DistributedDataParallel> ddp;
  bool prev = true;
};

py::list bucket_tuples(const std::vector<Bucket>& buckets) {
  py::list out;
  for (auto& b : buckets) out.append(py::make_tuple(b.first_param, b.last_param, b.offset, b.count));
  return out;
}

const char* b(bool v) { return v ? "True" : "False"; }

std::string powersgd_repr(const PowerSGDConfig& c) {
  std::ostringstream os;
  os << "PowerSGDConfig(matrix_approximation_rank=" << c.matrix_approximation_rank
     << ", start_powerSGD_iter=" << c.start_powerSGD_iter << ", min_compression_rate=" << c.min_compression_rate
     << ", use_error_feedback=" << b(c.use_error_feedback) << ", warm_start=" << b(c.warm_start)
     << ", seed=" << c.seed << ")";
  return os.str();
}

void bind_powersgd(py::module_& m) {
  py::class_<PowerSGDConfig>(m, "PowerSGDConfig",
                             "Options of the 'powersgd' communication hook (the names and defaults of PyTorch's "
                             "PowerSGDState).\n\n"
                             "    cfg = cx.distributed.DDPConfig(); cfg.comm_hook = 'powersgd'\n"
                             "    cfg.powersgd.matrix_approximation_rank = 4; cfg.powersgd.start_powerSGD_iter = 10")
      .def(py::init<>())
      .def_readwrite("matrix_approximation_rank", &PowerSGDConfig::matrix_approximation_rank,
                     "Rank r of each matrix gradient's approximation (default 1); clipped to min(rows, cols).")
      .def_readwrite("start_powerSGD_iter", &PowerSGDConfig::start_powerSGD_iter,
                     "Steps of uncompressed float32 all-reduce before compression starts (default 1000).")
      .def_readwrite("min_compression_rate", &PowerSGDConfig::min_compression_rate,
                     "An n x m matrix is compressed only if n*m >= this * (n+m)*r (default 2); 0 compresses every "
                     "matrix.")
      .def_readwrite("use_error_feedback", &PowerSGDConfig::use_error_feedback,
                     "Add what the last approximation dropped to the next step's gradient (default True).")
      .def_readwrite("warm_start", &PowerSGDConfig::warm_start,
                     "Start each step's power iteration from the last step's Q (default True).")
      .def_readwrite("seed", &PowerSGDConfig::seed, "Seed of the random initial Q, the same on every rank (0).")
      .def("__repr__", &powersgd_repr);
}

void bind_config(py::module_& m) {
  bind_powersgd(m);
  py::class_<DDPConfig>(m, "DDPConfig",
                        "Options of DistributedDataParallel.\n\n"
                        "    cfg = cx.distributed.DDPConfig(); cfg.bucket_size_mb = 25\n"
                        "    ddp = cx.distributed.DistributedDataParallel(model, cfg)")
      .def(py::init<>())
      .def_readwrite("broadcast_parameters", &DDPConfig::broadcast_parameters,
                     "Copy rank 0's parameters to every rank at construction (default True).")
      .def_readwrite("broadcast_buffers", &DDPConfig::broadcast_buffers,
                     "Copy rank 0's module buffers (BatchNorm running statistics) to every rank before each forward "
                     "in training mode, so they do not drift apart (default True, as PyTorch's DDP).")
      .def_readwrite("bucket_size_mb", &DDPConfig::bucket_size_mb, "Cap of a gradient bucket in MiB (default 25).")
      .def_readwrite("find_unused_parameters", &DDPConfig::find_unused_parameters,
                     "Reduce parameters that got no gradient in a backward instead of raising (default False).")
      .def_readwrite("first_bucket_mb", &DDPConfig::first_bucket_mb,
                     "Cap of the first bucket (the last layers) in MiB, so communication starts early (default 1).")
      .def_property(
          "comm_hook", [](const DDPConfig& c) { return c.comm_hook; },
          [](DDPConfig& c, py::object v) {
            if (v.is_none()) {
              c.comm_hook = "none";
              return;
            }
            if (!py::isinstance<py::str>(v))
              throw py::type_error("DDPConfig.comm_hook must be a str ('none', 'fp16', 'bf16', 'powersgd') or None, "
                                   "got " + std::string(py::str(py::type::of(v).attr("__name__"))));
            c.comm_hook = v.cast<std::string>();
          },
          "How gradient buckets are reduced: 'none' (float32, default; None means the same), 'fp16' or 'bf16' "
          "(cast, all-reduced in that type, cast back: half the bytes) or 'powersgd' (low-rank matrices with error "
          "feedback; options in .powersgd). Checked when DDP is built.")
      .def_readwrite("powersgd", &DDPConfig::powersgd, "PowerSGDConfig: options of comm_hook = 'powersgd'.")
      .def_property(
          "nonfinite", [](const DDPConfig& c) { return c.nonfinite; },
          [](DDPConfig& c, py::object v) {
            if (!py::isinstance<py::str>(v))
              throw py::type_error("DDPConfig.nonfinite must be a str ('raise', 'skip', 'warn' or 'off'), got " +
                                   std::string(py::str(py::type::of(v).attr("__name__"))));
            c.nonfinite = v.cast<std::string>();
            parse_nonfinite(c.nonfinite, "DDPConfig.nonfinite");
          },
          "What a step whose gradient, averaged over the ranks, holds NaN or inf does: 'raise' (default: "
          "NonFiniteError on every rank naming the step, the parameters and the ranks whose own gradient was "
          "already bad; the step is not taken), 'skip' (the optimizer step is not taken, on every rank alike, and "
          "counted in ddp.skipped_steps), 'warn' (RuntimeWarning, the step is taken) or 'off' (no check).")
      .def("__repr__", [](const DDPConfig& c) {
        std::ostringstream os;
        os << "DDPConfig(broadcast_parameters=" << (c.broadcast_parameters ? "True" : "False")
           << ", broadcast_buffers=" << (c.broadcast_buffers ? "True" : "False")
           << ", bucket_size_mb=" << c.bucket_size_mb
           << ", find_unused_parameters=" << (c.find_unused_parameters ? "True" : "False")
           << ", first_bucket_mb=" << c.first_bucket_mb << ", comm_hook='" << c.comm_hook << "'";
        if (c.comm_hook == "powersgd") os << ", powersgd=" << powersgd_repr(c.powersgd);
        os << ", nonfinite='" << c.nonfinite << "'";
        os << ")";
        return os.str();
      });

  py::class_<NoSync>(m, "_NoSync")
      .def("__enter__",
           [](NoSync& s) {
             s.prev = s.ddp->require_sync();
             s.ddp->set_require_sync(false);
             return s.ddp;
           })
      .def("__exit__", [](NoSync& s, py::args) {
        s.ddp->set_require_sync(s.prev);
        return false;
      });
}

py::array ddp_forward(DistributedDataParallel& d, py::handle x) {
  auto a = float_input(x, "DistributedDataParallel.forward", "(batch, features)");
  const nn::Tensor* out;
  {
    py::gil_scoped_release nogil;
    out = &d.forward(static_cast<const float*>(a.data()), shape_of(a));
  }
  // The model reads the input again in backward (no copy): keep it alive, as SequentialModel.forward does.
  py::cast(d.model()).attr("_forward_input") = a;
  return to_numpy(*out);
}

// Construction, forward/backward and the gradient synchronisation.
void def_training(DDPClass& c) {
  c.def(py::init([](std::shared_ptr<nn::SequentialModel> model, const DDPConfig& cfg) {
         auto g = distributed::require_default_group("DistributedDataParallel");
         py::gil_scoped_release nogil;
         return std::make_shared<DistributedDataParallel>(std::move(model), cfg, std::move(g));
       }),
       py::arg("model"), py::arg("config") = DDPConfig(), py::keep_alive<1, 2>(),
       "Broadcasts rank 0's parameters (config.broadcast_parameters) and installs the gradient hook.")
      .def("forward", &ddp_forward, py::arg("input"),
           "The model's forward (the same replica on every rank); in training mode rank 0's buffers are broadcast "
           "first (config.broadcast_buffers).")
      .def("__call__", &ddp_forward, py::arg("input"))
      .def(
          "backward",
          [](DistributedDataParallel& d, py::handle g, bool input_grad) -> py::object {
            auto a = float_input(g, "DistributedDataParallel.backward", "(batch, outputs) like forward's output", 1);
            const nn::Tensor* gx;
            {
              py::gil_scoped_release nogil;
              gx = d.backward(static_cast<const float*>(a.data()), shape_of(a), input_grad);
            }
            if (!gx) return py::none();
            return to_numpy(*gx);
          },
          py::arg("grad_output"), py::arg("input_grad") = true,
          "Backward with bucket all-reduces launched as gradients become final; returns dL/d(input).")
      .def(
          "sync_gradients",
          [](DistributedDataParallel& d) {
            {
              py::gil_scoped_release nogil;
              d.sync_gradients();
            }
            warn_nonfinite(d);
            const auto& m = *d.model();
            return py::array_t<float>(static_cast<py::ssize_t>(m.num_parameters()), m.flat_grads());  // copies
          },
          "Waits for the outstanding buckets (launching those not yet sent): the model's gradients are then the\n"
          "average over ranks. Returns a copy of them, flat: values you can keep (update_parameters() zeroes the\n"
          "gradient buffer, which model.flat_gradients() views). The trainer never makes this copy.\n\n"
          "    synced_grads = ddp.sync_gradients()\n    ddp.update_parameters(optimizer)   # synced_grads unchanged")
      .def(
          "update_parameters",
          [](DistributedDataParallel& d, nn::Optimizer& opt) {
            {
              py::gil_scoped_release nogil;
              d.update_parameters(opt);
            }
            warn_nonfinite(d);
          },
          py::arg("optimizer"),
          "sync_gradients() if needed, optimizer.step(model) (not with config.nonfinite = 'skip' when the averaged "
          "gradient is not finite), then zero the gradients.")
      .def(
          "no_sync", [](std::shared_ptr<DistributedDataParallel> d) { return NoSync{std::move(d)}; },
          "Context manager: backward() inside it accumulates gradients without communicating.\n\n"
          "    with ddp.no_sync():\n        ddp.backward(g1)\n    ddp.backward(g2); ddp.update_parameters(opt)")
      .def_property_readonly("require_sync", &DistributedDataParallel::require_sync)
      .def(
          "register_comm_hook",
          [](DistributedDataParallel& d, const std::string& name, int rank, int64_t start, double rate,
             bool error_feedback, bool warm_start, uint64_t seed) {
            PowerSGDConfig c;
            c.matrix_approximation_rank = rank;
            c.start_powerSGD_iter = start;
            c.min_compression_rate = rate;
            c.use_error_feedback = error_feedback;
            c.warm_start = warm_start;
            c.seed = seed;
            py::gil_scoped_release nogil;
            d.register_comm_hook(name, c);
          },
          py::arg("name"), py::arg("matrix_approximation_rank") = 1, py::arg("start_powerSGD_iter") = 1000,
          py::arg("min_compression_rate") = 2.0, py::arg("use_error_feedback") = true, py::arg("warm_start") = true,
          py::arg("seed") = 0,
          "Reduces gradient buckets with a communication hook from the next step on: 'none', 'fp16', 'bf16' or\n"
          "'powersgd' (its options are those of PowerSGDConfig). Every rank registers the same hook, between steps.\n\n"
          "    ddp.register_comm_hook('bf16')\n"
          "    ddp.register_comm_hook('powersgd', matrix_approximation_rank=4, start_powerSGD_iter=100)")
      .def_property_readonly(
          "comm_hook", [](const DistributedDataParallel& d) { return d.config().comm_hook; },
          "The communication hook in use: 'none', 'fp16', 'bf16' or 'powersgd'.")
      .def("_comm_hook_state",
           [](DistributedDataParallel& d) {
             CommHookState s;
             {
               py::gil_scoped_release nogil;
               s = d.comm_hook_state();
             }
             py::array_t<float> q(static_cast<py::ssize_t>(s.q.size()));
             py::array_t<float> e(static_cast<py::ssize_t>(s.error.size()));
             if (!s.q.empty()) std::memcpy(q.mutable_data(), s.q.data(), s.q.size() * sizeof(float));
             if (!s.error.empty()) std::memcpy(e.mutable_data(), s.error.data(), s.error.size() * sizeof(float));
             return py::make_tuple(s.iteration, q, e);
           })
      .def("_set_comm_hook_state",
           [](DistributedDataParallel& d, int64_t iteration, py::array_t<float, py::array::c_style | py::array::forcecast> q,
              py::array_t<float, py::array::c_style | py::array::forcecast> e) {
             CommHookState s;
             s.iteration = iteration;
             s.q.assign(q.data(), q.data() + q.size());
             s.error.assign(e.data(), e.data() + e.size());
             py::gil_scoped_release nogil;
             d.set_comm_hook_state(s);
           },
           py::arg("iteration"), py::arg("q"), py::arg("error"));
}

// The replicas' consistency, the buckets and the queries.
void def_inspection(DDPClass& c) {
  c.def(
       "check_parameters",
       [](DistributedDataParallel& d, bool raise_on_mismatch) {
         std::vector<ParamMismatch> bad;
         {
           py::gil_scoped_release nogil;
           bad = d.check_parameters(raise_on_mismatch);
         }
         py::list out;
         for (auto& b : bad) out.append(py::make_tuple(b.param_index, b.ranks));
         return out;
       },
       py::arg("raise_on_mismatch") = true,
       "Collective: compares a hash of every parameter tensor with rank 0's. Returns [(param_index, [ranks])] "
       "of those that differ, or raises CollectiveMismatchError naming them.")
      .def("broadcast_parameters",
           [](DistributedDataParallel& d) {
             py::gil_scoped_release nogil;
             d.broadcast_parameters();
           },
           "Collective: copies rank 0's parameters and buffers to every rank.")
      .def_property_readonly(
          "buckets", [](const DistributedDataParallel& d) { return bucket_tuples(d.buckets()); },
          "(first_param, last_param, offset, count) of each bucket, in launch order.")
      .def_property_readonly("allreduce_count", &DistributedDataParallel::allreduce_count,
                             "Bucket all-reduces launched so far.")
      .def_property_readonly("config", &DistributedDataParallel::config)
      .def_property(
          "nonfinite", [](const DistributedDataParallel& d) { return std::string(d.nonfinite()); },
          [](DistributedDataParallel& d, const std::string& v) { d.set_nonfinite(v); },
          "config.nonfinite, settable between steps (every rank alike): 'raise', 'skip', 'warn' or 'off'.")
      .def_property_readonly("skipped_steps", &DistributedDataParallel::skipped_steps,
                             "Optimizer steps not taken because the averaged gradient was not finite "
                             "(nonfinite = 'skip').")
      .def_property(
          "_agree_by_message", nullptr,
          [](DistributedDataParallel& d, bool on) {
            py::gil_scoped_release nogil;
            d.set_check_path(d.fused_switch(), on);
          },
          "Benchmarks and tests only (Note [Non-finite gradients]): agree on the verdict by a small all-reduce "
          "behind the last bucket (True, the default) or by each rank reading the average. Collective: every rank "
          "sets it alike, between steps (MismatchError on every rank naming those that differ).")
      .def_property(
          "_fused_check", nullptr,
          [](DistributedDataParallel& d, bool on) {
            py::gil_scoped_release nogil;
            d.set_check_path(on, d.by_message_switch());
          },
          "Benchmarks and tests only (Note [Fused non-finite check] in distributed/reduce_probe.h): the buckets' "
          "reductions test for non-finite values (True, the default) or each bucket is read before it is reduced. "
          "Collective: every rank sets it alike, between steps (MismatchError on every rank naming those that "
          "differ).")
      .def_property_readonly("nonfinite_steps", &DistributedDataParallel::nonfinite_steps,
                             "Steps whose averaged gradient was not finite (whatever nonfinite did about them).")
      .def("is_master", &DistributedDataParallel::is_master)
      .def("get_rank", &DistributedDataParallel::rank)
      .def("get_world_size", &DistributedDataParallel::world_size)
      .def("get_model", [](DistributedDataParallel& d) { return d.model(); })
      .def("__repr__", [](const DistributedDataParallel& d) {
        std::ostringstream os;
        os << "DistributedDataParallel(rank=" << d.rank() << ", world_size=" << d.world_size()
           << ", parameters=" << d.model()->num_parameters() << ", buckets=" << d.buckets().size() << ")";
        return os.str();
      });
}

}  // namespace

void bind_ddp(py::module_& m) {
  bind_config(m);
  DDPClass c(m, "DistributedDataParallel",
             "Wraps a SequentialModel: gradients are averaged over all ranks in buckets, overlapped with backward.\n\n"
             "    ddp = cx.distributed.DistributedDataParallel(model, cx.distributed.DDPConfig())\n"
             "    out = ddp.forward(x); ddp.backward(loss_fn.backward()); ddp.update_parameters(opt)");
  def_training(c);
  def_inspection(c);

  m.def(
      "_assign_buckets",
      [](const std::vector<size_t>& counts, size_t elem_bytes, size_t first_cap, size_t cap) {
        return bucket_tuples(assign_buckets(counts, elem_bytes, first_cap, cap));
      },
      py::arg("param_counts"), py::arg("elem_bytes"), py::arg("first_cap_bytes"), py::arg("cap_bytes"));
}

}  // namespace cx::bindings
