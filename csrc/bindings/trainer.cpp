// Bindings of the trainer's per-batch engine (_TrainerCore, csrc/train/trainer.h) and of the model bytes its
// checkpoints hold. DistributedTrainer itself (epoch loop, checks of X and y, checkpoint files) is Python:
// python/pycyxwiz/distributed/_train.py.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "distributed/default_group.h"
#include "nn/loss.h"
#include "nn/optimizer.h"
#include "nn/rng.h"
#include "nn/sequential.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace cx::bindings {

using namespace cx::train;

namespace {

using CoreClass = shared_class<TrainerCore>;

// loss_fn as the core's Loss: the three loss classes share no Python base class.
std::shared_ptr<nn::Loss> as_loss(py::handle obj) {
  if (py::isinstance<nn::CrossEntropyLoss>(obj)) return obj.cast<std::shared_ptr<nn::CrossEntropyLoss>>();
  if (py::isinstance<nn::MSELoss>(obj)) return obj.cast<std::shared_ptr<nn::MSELoss>>();
  if (py::isinstance<nn::BCEWithLogitsLoss>(obj)) return obj.cast<std::shared_ptr<nn::BCEWithLogitsLoss>>();
  CX_THROW(TypeMismatch, "DistributedTrainer: loss_fn must be cx.CrossEntropyLoss, cx.MSELoss or "
           "cx.BCEWithLogitsLoss, got ", describe(obj));
}

py::tuple stats_tuple(const BatchStats& s) { return py::make_tuple(s.loss_sum, s.correct, s.count); }

// Construction, training and evaluation.
void def_steps(CoreClass& c) {
  c.def(py::init([](std::shared_ptr<nn::SequentialModel> model, py::handle loss, std::shared_ptr<nn::Optimizer> opt,
                    const DDPConfig& cfg) {
         auto g = distributed::require_default_group("DistributedTrainer");
         auto l = as_loss(loss);
         py::gil_scoped_release nogil;
         return std::make_shared<TrainerCore>(std::move(model), std::move(l), std::move(opt), std::move(g), cfg);
       }),
       py::arg("model"), py::arg("loss_fn"), py::arg("optimizer"), py::arg("ddp_config") = DDPConfig(),
       py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<1, 4>())
      .def(
          "train_batch",
          [](TrainerCore& c, py::handle X, py::handle y, DistributedBatchIterator& it) {
            auto x = float_input(X, "DistributedTrainer.fit: X", "(samples, features)", 1);
            Targets t = targets_of(y, "DistributedTrainer.fit");
            BatchStats s;
            {
              py::gil_scoped_release nogil;
              s = c.train_batch(static_cast<const float*>(x.data()), shape_of(x), t, it);
            }
            warn_nonfinite(c.ddp());
            return stats_tuple(s);
          },
          py::arg("X"), py::arg("y"), py::arg("batch_iter"),
          "One optimizer step on the iterator's next batch; returns this rank's (loss_sum, correct, count).")
      .def(
          "train_rows",
          [](TrainerCore& c, py::handle X, py::handle y) {
            auto x = float_input(X, "DistributedTrainer.fit: a Dataset's X batch", "(samples, features)", 1);
            Targets t = targets_of(y, "DistributedTrainer.fit: a Dataset's y batch");
            BatchStats s;
            {
              py::gil_scoped_release nogil;
              s = c.train_rows(static_cast<const float*>(x.data()), shape_of(x), t);
            }
            warn_nonfinite(c.ddp());
            return stats_tuple(s);
          },
          py::arg("X"), py::arg("y"),
          "One optimizer step on the batch (X, y) (a Dataset's); returns this rank's (loss_sum, correct, count).")
      .def(
          "evaluate_rows",
          [](TrainerCore& c, py::handle X, py::handle y, size_t batch) {
            auto x = float_input(X, "DistributedTrainer.evaluate: a Dataset's X batch", "(samples, features)", 1);
            Targets t = targets_of(y, "DistributedTrainer.evaluate: a Dataset's y batch");
            const nn::Shape shape = shape_of(x);
            CX_CHECK(t.rows == shape[0], InvalidArgument, "DistributedTrainer.evaluate: a batch of ", shape[0],
                     " input rows has ", t.rows, " targets; they must match");
            CX_CHECK(batch >= 1, InvalidArgument, "DistributedTrainer.evaluate: batch_size must be >= 1");
            BatchStats s;
            {
              py::gil_scoped_release nogil;
              s = c.evaluate(static_cast<const float*>(x.data()), shape, t, 0, shape[0], batch);
            }
            return stats_tuple(s);
          },
          py::arg("X"), py::arg("y"), py::arg("batch_size") = 256,
          "This rank's (loss_sum, correct, count) over all of (X, y) in eval mode (not reduced over ranks).")
      .def(
          "evaluate",
          [](TrainerCore& c, py::handle X, py::handle y, size_t batch) {
            auto x = float_input(X, "DistributedTrainer.evaluate: X", "(samples, features)", 1);
            Targets t = targets_of(y, "DistributedTrainer.evaluate");
            BatchStats s;
            {
              py::gil_scoped_release nogil;
              s = c.evaluate_all(static_cast<const float*>(x.data()), shape_of(x), t, batch);
            }
            return stats_tuple(s);
          },
          py::arg("X"), py::arg("y"), py::arg("batch_size") = 256,
          "Collective: global (loss_sum, correct, count) over all of (X, y), each rank evaluating a shard.")
      .def(
          "reduce_stats",
          [](TrainerCore& c, double loss_sum, double correct, double count) {
            BatchStats s{loss_sum, correct, count};
            {
              py::gil_scoped_release nogil;
              s = c.reduce_stats(s);
            }
            return stats_tuple(s);
          },
          "Collective: SUM of (loss_sum, correct, count) over ranks, in float64.");
}

// The device, host copies and the host collectives of the trainer's bookkeeping.
void def_host_side(CoreClass& c) {
  c.def_property_readonly("ddp", &TrainerCore::ddp_ptr)
      .def("set_nonfinite", &TrainerCore::set_nonfinite, py::arg("mode"),
           "DistributedTrainingConfig.nonfinite: the DDP's nonfinite from now on (the GPU refuses 'skip'/'warn').")
      .def("set_matmul_precision", &TrainerCore::set_matmul_precision, py::arg("name"),
           "DistributedTrainingConfig.matmul_precision: 'float32', 'tf32' or 'bf16' for the GPU's GEMMs from now on "
           "(the CPU refuses all but 'float32').")
      .def("set_shard_optimizer_state", &TrainerCore::set_shard_optimizer_state,
           py::call_guard<py::gil_scoped_release>(), py::arg("on"),
           "Collective: ZeRO-1 on or off (the optimizer's state is cut to this rank's shard, or gathered whole).")
      .def_property_readonly("shard_optimizer_state", &TrainerCore::shard_optimizer_state)
      .def(
          "set_grad_clip",
          [](TrainerCore& c, double max_norm, double max_value) { c.set_grad_clip(GradClip{max_norm, max_value}); },
          py::arg("max_norm"), py::arg("max_value"),
          "Clip the averaged gradient before every step: its global L2 norm to max_norm, every element to "
          "[-max_value, max_value] (0: off), on the GPU engine too.")
      .def(
          "add_ema",
          [](TrainerCore& c, py::handle shadow, double decay) {
            auto s = float_array(shadow, "EMA: the shadow weights", "(parameters,)", 1);
            CX_CHECK(s.writeable(), InvalidArgument, "EMA: the shadow weights must be writable");
            c.add_ema(static_cast<float*>(s.mutable_data()), static_cast<size_t>(s.size()), decay);
          },
          py::arg("shadow"), py::arg("decay"),
          "Updates `shadow` (float32, one per parameter; keep it alive until clear_ema) after every step: "
          "decay * shadow + (1 - decay) * params, settled lazily (settle_ema).")
      .def("settle_ema", &TrainerCore::settle_ema, py::call_guard<py::gil_scoped_release>(),
           "Makes the EMA update owed for the last step (before reading a shadow or writing the parameters).")
      .def("clear_ema", &TrainerCore::clear_ema, "Stops updating the shadows add_ema registered.")
      .def(
          "next_indices",
          [](TrainerCore&, DistributedBatchIterator& it) {
            auto [idx, n] = it.next_view();
            py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
            std::copy(idx, idx + n, out.mutable_data());
            return out;
          },
          py::arg("batch_iter"), "The iterator's next batch of sample indices, as an int64 array.")
      .def_property_readonly("zero", &TrainerCore::zero, "The ZeroRedundancyOptimizer while sharded, else None.")
      .def(
          "optimizer_state_dict",
          [](TrainerCore& c, const py::dict& into) {
            std::map<std::string, nn::Optimizer::Destination> spans;
            for (auto [k, v] : into) {
              auto a = py::reinterpret_borrow<py::object>(v);
              if (!py::isinstance<py::array_t<float>>(a)) continue;
              auto arr = a.cast<py::array>();
              if (!(arr.flags() & py::array::c_style) || !arr.writeable()) continue;
              spans[k.cast<std::string>()] = {static_cast<float*>(arr.mutable_data()), static_cast<size_t>(arr.size())};
            }
            nn::StateDict sd;
            {
              py::gil_scoped_release nogil;
              sd = c.optimizer_state_dict(spans);
            }
            py::dict d = optimizer_state_to_py(std::move(sd));
            for (const auto& [name, span] : spans) d[name.c_str()] = into[name.c_str()];
            return d;
          },
          py::arg("into") = py::dict(),
          "The whole optimizer state (collective while sharded). `into`: float32 arrays by state name; one of its "
          "state's size is filled and returned in place of a new array (not while sharded).")
      .def(
          "load_optimizer_state_dict",
          [](TrainerCore& c, const py::dict& d) { c.load_optimizer_state_dict(optimizer_state_from_py(d)); },
          py::arg("state_dict"), "Loads a whole optimizer state (each rank keeps its shard while sharded).")
      .def_property_readonly("device", &TrainerCore::device,
                             "Where the model trains: '' for the CPU, else the GPU and its GEMM library.")
      .def("sync_to_host", &TrainerCore::sync_to_host, py::call_guard<py::gil_scoped_release>(),
           "GPU training: copy parameters, BatchNorm statistics, dropout states and optimizer state to the host.")
      .def("sync_from_host", &TrainerCore::sync_from_host, py::call_guard<py::gil_scoped_release>(),
           "GPU training: copy them from the host objects to the device again.")
      .def("parameter_report", &TrainerCore::parameter_report, py::call_guard<py::gil_scoped_release>(),
           "Collective: '' when every rank holds the same parameters, else which differ on which ranks.")
      .def("sync_buffers", &TrainerCore::sync_buffers, py::call_guard<py::gil_scoped_release>(),
           "Collective: rank 0's module buffers to every rank if DDPConfig.broadcast_buffers (fit: every epoch's "
           "end).")
      .def(
          "all_gather_host",
          [](TrainerCore& c, py::array out, py::array in) {
            CX_CHECK(out.flags() & py::array::c_style && in.flags() & py::array::c_style && out.writeable(),
                     InvalidArgument, "all_gather_host: arrays must be C-contiguous and out writable");
            size_t bytes = static_cast<size_t>(in.nbytes());
            CX_CHECK(static_cast<size_t>(out.nbytes()) == bytes * static_cast<size_t>(c.group().size()),
                     InvalidArgument, "all_gather_host: out must hold world_size times the input's bytes");
            const void* src = in.data();
            void* dst = out.mutable_data();
            py::gil_scoped_release nogil;
            c.all_gather_host(src, dst, bytes);
          },
          py::arg("out"), py::arg("mine"), "Collective: every rank's bytes of `mine`, in rank order, into `out`.")
      .def(
          "broadcast_host",
          [](TrainerCore& c, py::array buf, int root) {
            CX_CHECK(buf.flags() & py::array::c_style && buf.writeable(), InvalidArgument,
                     "broadcast_host: the array must be C-contiguous and writable");
            void* p = buf.mutable_data();
            size_t bytes = static_cast<size_t>(buf.nbytes());
            py::gil_scoped_release nogil;
            c.broadcast_host(p, bytes, root);
          },
          py::arg("buf"), py::arg("src"), "Collective: rank src's bytes of `buf` into every rank's `buf`.");
}

// The model bytes of checkpoints and the dropout streams of their ranks.
void bind_checkpoint_helpers(py::module_& m) {
  m.def(
      "_model_to_bytes",
      [](const nn::SequentialModel& model) {
        auto* s = new std::string;
        {
          py::gil_scoped_release nogil;
          *s = model.serialize();
        }
        py::capsule owner(s, [](void* p) { delete static_cast<std::string*>(p); });
        return py::array_t<uint8_t>(static_cast<py::ssize_t>(s->size()), reinterpret_cast<const uint8_t*>(s->data()),
                                    owner);
      },
      py::arg("model"), "The model as .cyxmodel bytes (architecture, parameters, buffers), in a uint8 array (not "
      "copied into a bytes object: a checkpoint takes them every epoch).");
  m.def("_fork_rng_stream", &nn::fork_stream, py::arg("state"), py::arg("stream"),
        "The generator state DDP gives rank `stream` for rank 0's `state` (Note [Dropout across ranks]).");
  m.def(
      "_model_load_bytes",
      [](nn::SequentialModel& model, const py::bytes& b, const std::string& what) {
        std::string s = b;
        py::gil_scoped_release nogil;
        load_model_state(model, s, what);
      },
      py::arg("model"), py::arg("data"), py::arg("what"),
      "Copies parameters and buffers from .cyxmodel bytes into model (same architecture).");
}

}  // namespace

void bind_trainer(py::module_& m) {
  CoreClass c(m, "_TrainerCore", "Per-batch engine of DistributedTrainer (see _train.py).");
  def_steps(c);
  def_host_side(c);
  bind_checkpoint_helpers(m);
}

}  // namespace cx::bindings
