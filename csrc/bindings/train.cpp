// Training bindings (issue 4): DDPConfig, DistributedDataParallel,
// DistributedSampler, DistributedBatchIterator and the trainer's per-batch core
// (_TrainerCore). Converts NumPy arrays to pointer + shape, checks them at the
// boundary, releases the GIL and calls into train/.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <sstream>

#include "bindings/bindings.h"
#include "common/error.h"
#include "distributed/default_group.h"
#include "nn/loss.h"
#include "nn/optimizer.h"
#include "nn/rng.h"
#include "nn/sequential.h"
#include "train/buckets.h"
#include "train/ddp.h"
#include "train/sampler.h"
#include "train/trainer.h"

namespace cx::bindings {

using namespace cx::train;
using cx::nn::Shape;

namespace {

Shape shape_of(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

std::string describe(py::handle obj) {
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    return std::string(py::str(a.dtype())) + " array of shape " + nn::shape_str(shape_of(a));
  }
  return std::string("a ") + std::string(py::str(py::type::of(obj).attr("__name__")));
}

py::array float_array(py::handle obj, const std::string& who, const char* expected, size_t min_ndim) {
  if (!py::isinstance<py::array>(obj) ||
      !py::dtype::of<float>().equal(py::reinterpret_borrow<py::array>(obj).dtype()))
    CX_THROW(TypeMismatch, who, ": expected a float32 NumPy array of shape ", expected, ", got ", describe(obj),
             " (convert with np.asarray(x, dtype=np.float32))");
  auto a = py::reinterpret_borrow<py::array>(obj);
  CX_CHECK(static_cast<size_t>(a.ndim()) >= min_ndim, InvalidArgument, who, ": expected an array of shape ",
           expected, ", got shape ", nn::shape_str(shape_of(a)));
  CX_CHECK(a.flags() & py::array::c_style, InvalidArgument, who, ": expected a C-contiguous array of shape ",
           expected, ", got a non-contiguous view (use np.ascontiguousarray(x))");
  return a;
}

py::array_t<float> to_numpy(const nn::Tensor& t) {
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  py::array_t<float> out(shape);
  std::memcpy(out.mutable_data(), t.data(), t.numel() * sizeof(float));
  return out;
}

// The data set for the trainer: X float32 (rows, ...), y labels (rows,) or float32 (rows, ...).
struct DataView {
  py::array X, y;
  Shape x_shape;
  Targets t;
};

DataView data_view(py::handle X, py::handle y, const char* who) {
  DataView d;
  d.X = float_array(X, std::string(who) + ": X", "(samples, features)", 2);
  d.x_shape = shape_of(d.X);
  CX_CHECK(py::isinstance<py::array>(y), TypeMismatch, who, ": y must be a NumPy array, got ", describe(y));
  d.y = py::reinterpret_borrow<py::array>(y);
  CX_CHECK(d.y.flags() & py::array::c_style, InvalidArgument, who, ": y must be C-contiguous");
  CX_CHECK(d.y.ndim() >= 1 && static_cast<size_t>(d.y.shape(0)) == d.x_shape[0], InvalidArgument, who, ": X has ",
           d.x_shape[0], " samples but y has ", d.y.ndim() ? d.y.shape(0) : 0, "; they must match");
  d.t.data = d.y.data();
  d.t.rows = d.x_shape[0];
  if (py::dtype::of<int64_t>().equal(d.y.dtype())) d.t.kind = Targets::Kind::kInt64;
  else if (py::dtype::of<int32_t>().equal(d.y.dtype())) d.t.kind = Targets::Kind::kInt32;
  else if (py::dtype::of<float>().equal(d.y.dtype())) d.t.kind = Targets::Kind::kFloat32;
  else
    CX_THROW(TypeMismatch, who, ": y must be int64/int32 class labels or float32 targets, got ", describe(y));
  if (d.t.kind != Targets::Kind::kFloat32)
    CX_CHECK(d.y.ndim() == 1, InvalidArgument, who, ": integer labels must have shape (samples,), got ",
             nn::shape_str(shape_of(d.y)));
  else
    d.t.row_shape = Shape(d.y.shape() + 1, d.y.shape() + d.y.ndim());
  return d;
}

std::shared_ptr<nn::Loss> as_loss(py::handle obj) {
  if (py::isinstance<nn::CrossEntropyLoss>(obj)) return obj.cast<std::shared_ptr<nn::CrossEntropyLoss>>();
  if (py::isinstance<nn::MSELoss>(obj)) return obj.cast<std::shared_ptr<nn::MSELoss>>();
  if (py::isinstance<nn::BCEWithLogitsLoss>(obj)) return obj.cast<std::shared_ptr<nn::BCEWithLogitsLoss>>();
  CX_THROW(TypeMismatch, "DistributedTrainer: loss_fn must be cx.CrossEntropyLoss, cx.MSELoss or "
           "cx.BCEWithLogitsLoss, got ", describe(obj));
}

std::string param_name(const nn::SequentialModel& m, size_t i) {
  auto [mi, pi] = m.param_owners().at(i);
  std::ostringstream os;
  os << i << " (layer " << mi << " " << m.module(mi)->type_name() << "." << m.module(mi)->param_specs()[pi].name
     << ")";
  return os.str();
}

struct NoSync {
  std::shared_ptr<DistributedDataParallel> ddp;
  bool prev = true;
};

py::tuple stats_tuple(const BatchStats& s) { return py::make_tuple(s.loss_sum, s.correct, s.count); }

}  // namespace

void bind_train(py::module_& m) {
  // ------------------------------------------------------------ DDP
  py::class_<DDPConfig>(m, "DDPConfig",
                        "Options of DistributedDataParallel.\n\n"
                        "    cfg = cx.distributed.DDPConfig(); cfg.bucket_size_mb = 25\n"
                        "    ddp = cx.distributed.DistributedDataParallel(model, cfg)")
      .def(py::init<>())
      .def_readwrite("broadcast_parameters", &DDPConfig::broadcast_parameters,
                     "Copy rank 0's parameters to every rank at construction (default True).")
      .def_readwrite("bucket_size_mb", &DDPConfig::bucket_size_mb, "Cap of a gradient bucket in MiB (default 25).")
      .def_readwrite("find_unused_parameters", &DDPConfig::find_unused_parameters,
                     "Reduce parameters that got no gradient in a backward instead of raising (default False).")
      .def_readwrite("first_bucket_mb", &DDPConfig::first_bucket_mb,
                     "Cap of the first bucket (the last layers) in MiB, so communication starts early (default 1).")
      .def("__repr__", [](const DDPConfig& c) {
        std::ostringstream os;
        os << "DDPConfig(broadcast_parameters=" << (c.broadcast_parameters ? "True" : "False")
           << ", bucket_size_mb=" << c.bucket_size_mb
           << ", find_unused_parameters=" << (c.find_unused_parameters ? "True" : "False")
           << ", first_bucket_mb=" << c.first_bucket_mb << ")";
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

  py::class_<DistributedDataParallel, std::shared_ptr<DistributedDataParallel>>(
      m, "DistributedDataParallel",
      "Wraps a SequentialModel: gradients are averaged over all ranks in buckets, overlapped with backward.\n\n"
      "    ddp = cx.distributed.DistributedDataParallel(model, cx.distributed.DDPConfig())\n"
      "    out = ddp.forward(x); ddp.backward(loss_fn.backward()); ddp.update_parameters(opt)")
      .def(py::init([](std::shared_ptr<nn::SequentialModel> model, const DDPConfig& cfg) {
             auto g = distributed::require_default_group("DistributedDataParallel");
             py::gil_scoped_release nogil;
             return std::make_shared<DistributedDataParallel>(std::move(model), cfg, std::move(g));
           }),
           py::arg("model"), py::arg("config") = DDPConfig(), py::keep_alive<1, 2>(),
           "Broadcasts rank 0's parameters (config.broadcast_parameters) and installs the gradient hook.")
      .def(
          "forward", [](DistributedDataParallel& d, py::handle x) { return py::cast(d.model()).attr("forward")(x); },
          py::arg("input"), "The model's forward (the same replica on every rank).")
      .def("__call__", [](DistributedDataParallel& d, py::handle x) { return py::cast(d.model()).attr("forward")(x); })
      .def(
          "backward",
          [](DistributedDataParallel& d, py::handle g, bool input_grad) -> py::object {
            auto a = float_array(g, "DistributedDataParallel.backward", "(batch, outputs) like forward's output", 1);
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
            return py::cast(d.model()).attr("flat_gradients")();
          },
          "Waits for the outstanding buckets (launching those not yet sent): gradients are then the average over "
          "ranks. Returns the flat gradient buffer (a view).")
      .def(
          "update_parameters",
          [](DistributedDataParallel& d, nn::Optimizer& opt) {
            py::gil_scoped_release nogil;
            d.update_parameters(opt);
          },
          py::arg("optimizer"), "sync_gradients() if needed, optimizer.step(model), then zero the gradients.")
      .def(
          "no_sync", [](std::shared_ptr<DistributedDataParallel> d) { return NoSync{std::move(d)}; },
          "Context manager: backward() inside it accumulates gradients without communicating.\n\n"
          "    with ddp.no_sync():\n        ddp.backward(g1)\n    ddp.backward(g2); ddp.update_parameters(opt)")
      .def_property_readonly("require_sync", &DistributedDataParallel::require_sync)
      .def(
          "check_parameters",
          [](DistributedDataParallel& d, bool raise_on_mismatch) {
            std::vector<ParamMismatch> bad;
            {
              py::gil_scoped_release nogil;
              bad = d.check_parameters();
            }
            py::list out;
            for (auto& b : bad) out.append(py::make_tuple(b.param_index, b.ranks));
            if (!bad.empty() && raise_on_mismatch) {
              std::ostringstream os;
              os << "check_parameters (rank " << d.rank() << "): parameters differ across ranks:";
              for (auto& b : bad) {
                os << "\n  parameter " << param_name(*d.model(), b.param_index) << " differs from rank 0's on ranks [";
                for (size_t i = 0; i < b.ranks.size(); ++i) os << (i ? ", " : "") << b.ranks[i];
                os << "]";
              }
              os << "\nLikely causes: DDPConfig.broadcast_parameters = False with different initial weights, "
                    "different random seeds, or parameters changed on one rank outside the optimizer step.";
              CX_THROW(MismatchError, os.str());
            }
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
      .def_property_readonly("buckets",
                             [](const DistributedDataParallel& d) {
                               py::list out;
                               for (auto& b : d.buckets())
                                 out.append(py::make_tuple(b.first_param, b.last_param, b.offset, b.count));
                               return out;
                             },
                             "(first_param, last_param, offset, count) of each bucket, in launch order.")
      .def_property_readonly("allreduce_count", &DistributedDataParallel::allreduce_count,
                             "Bucket all-reduces launched so far.")
      .def_property_readonly("config", &DistributedDataParallel::config)
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

  m.def(
      "_assign_buckets",
      [](const std::vector<size_t>& counts, size_t elem_bytes, size_t first_cap, size_t cap) {
        py::list out;
        for (auto& b : assign_buckets(counts, elem_bytes, first_cap, cap))
          out.append(py::make_tuple(b.first_param, b.last_param, b.offset, b.count));
        return out;
      },
      py::arg("param_counts"), py::arg("elem_bytes"), py::arg("first_cap_bytes"), py::arg("cap_bytes"));

  // ------------------------------------------------------------ sampler and iterator
  py::class_<DistributedSampler, std::shared_ptr<DistributedSampler>>(
      m, "DistributedSampler",
      "This rank's share of a data set's indices, reshuffled every epoch, the same number on every rank.\n\n"
      "    sampler = cx.distributed.DistributedSampler(dataset_size=10000, shuffle=True, seed=42)\n"
      "    sampler.set_epoch(epoch); idx = sampler.get_indices()")
      .def(py::init([](int64_t n, bool shuffle, uint64_t seed, bool drop_last, py::object num_replicas,
                       py::object rank) {
             int nr = num_replicas.is_none() ? -1 : num_replicas.cast<int>();
             int r = rank.is_none() ? -1 : rank.cast<int>();
             CX_CHECK(num_replicas.is_none() || nr >= 1, InvalidArgument,
                      "DistributedSampler: num_replicas must be >= 1, got ", nr);
             CX_CHECK(rank.is_none() || r >= 0, InvalidArgument, "DistributedSampler: rank must be >= 0, got ", r);
             return std::make_shared<DistributedSampler>(n, shuffle, seed, drop_last, nr, r);
           }),
           py::arg("dataset_size"), py::arg("shuffle") = true, py::arg("seed") = 0, py::arg("drop_last") = false,
           py::arg("num_replicas") = py::none(), py::arg("rank") = py::none())
      .def("set_epoch", &DistributedSampler::set_epoch, py::arg("epoch"),
           "Selects the epoch's shuffle; call it at the start of every epoch.")
      .def("get_indices", &DistributedSampler::get_indices, "This rank's indices for the current epoch (a list).")
      .def("local_size", &DistributedSampler::local_size, "Samples for this rank per epoch.")
      .def("total_size", &DistributedSampler::total_size, "The data set's size.")
      .def("padded_size", &DistributedSampler::padded_size,
           "Samples over all ranks per epoch: the size padded (or, with drop_last, cut) to a multiple of the "
           "world size.")
      .def("__len__", &DistributedSampler::local_size)
      .def_property_readonly("epoch", &DistributedSampler::epoch)
      .def_property_readonly("num_replicas", &DistributedSampler::num_replicas)
      .def_property_readonly("rank", &DistributedSampler::rank)
      .def_property_readonly("shuffle", &DistributedSampler::shuffle)
      .def_property_readonly("seed", &DistributedSampler::seed)
      .def_property_readonly("drop_last", &DistributedSampler::drop_last)
      .def("__repr__", [](const DistributedSampler& s) {
        std::ostringstream os;
        os << "DistributedSampler(dataset_size=" << s.total_size() << ", rank=" << s.rank()
           << ", num_replicas=" << s.num_replicas() << ", local_size=" << s.local_size()
           << ", shuffle=" << (s.shuffle() ? "True" : "False") << ", seed=" << s.seed()
           << ", drop_last=" << (s.drop_last() ? "True" : "False") << ", epoch=" << s.epoch() << ")";
        return os.str();
      });

  py::class_<DistributedBatchIterator, std::shared_ptr<DistributedBatchIterator>>(
      m, "DistributedBatchIterator",
      "This rank's indices in batches.\n\n"
      "    it = cx.distributed.DistributedBatchIterator(sampler, batch_size=64)\n"
      "    for idx in it: xb, yb = X[idx], y[idx]")
      .def(py::init<std::shared_ptr<DistributedSampler>, size_t, bool>(), py::arg("sampler"),
           py::arg("batch_size"), py::arg("drop_last") = false)
      .def("has_next", &DistributedBatchIterator::has_next)
      .def("next", &DistributedBatchIterator::next, "The next batch's indices (a list).")
      .def("reset", &DistributedBatchIterator::reset, py::arg("epoch"),
           "sampler.set_epoch(epoch) and back to the first batch.")
      .def("num_batches", &DistributedBatchIterator::num_batches, "Batches per epoch (the same on every rank).")
      .def("__len__", &DistributedBatchIterator::num_batches)
      .def("position", &DistributedBatchIterator::position, "Batches already returned this epoch.")
      .def("set_position", &DistributedBatchIterator::set_position, py::arg("position"),
           "Skips to batch `position` of the current epoch (resuming from a checkpoint).")
      .def_property_readonly("batch_size", &DistributedBatchIterator::batch_size)
      .def_property_readonly("sampler", &DistributedBatchIterator::sampler)
      .def("__iter__",
           [](std::shared_ptr<DistributedBatchIterator> it) {
             it->rewind();
             return it;
           },
           "Iterates over the current epoch's batches from the first.")
      .def("__next__",
           [](DistributedBatchIterator& it) {
             if (!it.has_next()) throw py::stop_iteration();
             return it.next();
           })
      .def("__repr__", [](const DistributedBatchIterator& it) {
        std::ostringstream os;
        os << "DistributedBatchIterator(batch_size=" << it.batch_size() << ", num_batches=" << it.num_batches()
           << ", position=" << it.position() << ", epoch=" << it.sampler()->epoch() << ")";
        return os.str();
      });

  // ------------------------------------------------------------ trainer core
  py::class_<TrainerCore, std::shared_ptr<TrainerCore>>(m, "_TrainerCore",
                                                        "Per-batch engine of DistributedTrainer (see _train.py).")
      .def(py::init([](std::shared_ptr<nn::SequentialModel> model, py::handle loss,
                       std::shared_ptr<nn::Optimizer> opt, const DDPConfig& cfg) {
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
            DataView d = data_view(X, y, "DistributedTrainer.fit");
            BatchStats s;
            {
              py::gil_scoped_release nogil;
              s = c.train_batch(static_cast<const float*>(d.X.data()), d.x_shape, d.t, it);
            }
            return stats_tuple(s);
          },
          py::arg("X"), py::arg("y"), py::arg("batch_iter"),
          "One optimizer step on the iterator's next batch; returns this rank's (loss_sum, correct, count).")
      .def(
          "evaluate",
          [](TrainerCore& c, py::handle X, py::handle y, size_t batch) {
            DataView d = data_view(X, y, "DistributedTrainer.evaluate");
            CX_CHECK(batch >= 1, InvalidArgument, "DistributedTrainer.evaluate: batch_size must be >= 1");
            size_t n = d.x_shape[0];
            size_t p = static_cast<size_t>(c.group().size()), r = static_cast<size_t>(c.group().rank());
            BatchStats s;
            {
              // Each rank takes a contiguous shard, no padding: every sample counted exactly once.
              py::gil_scoped_release nogil;
              s = c.evaluate(static_cast<const float*>(d.X.data()), d.x_shape, d.t, n * r / p, n * (r + 1) / p, batch);
              s = c.reduce_stats(s);
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
          "Collective: SUM of (loss_sum, correct, count) over ranks, in float64.")
      .def_property_readonly("ddp", &TrainerCore::ddp_ptr)
      .def_property_readonly("device", &TrainerCore::device,
                             "Where the model trains: '' for the CPU, else the GPU and its GEMM library.")
      .def("sync_to_host", &TrainerCore::sync_to_host, py::call_guard<py::gil_scoped_release>(),
           "GPU training: copy parameters, BatchNorm statistics, dropout states and optimizer state to the host.")
      .def("sync_from_host", &TrainerCore::sync_from_host, py::call_guard<py::gil_scoped_release>(),
           "GPU training: copy them from the host objects to the device again.")
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

  // ------------------------------------------------------------ model bytes for checkpoints
  m.def(
      "_model_to_bytes",
      [](const nn::SequentialModel& model) {
        std::string s;
        {
          py::gil_scoped_release nogil;
          s = model.serialize();
        }
        return py::bytes(s);
      },
      py::arg("model"), "The model as .cyxmodel bytes (architecture, parameters, buffers).");
  m.def("_fork_rng_stream", &nn::fork_stream, py::arg("state"), py::arg("stream"),
        "The generator state DDP gives rank `stream` for rank 0's `state` (Note [Dropout across ranks]).");
  m.def(
      "_model_load_bytes",
      [](nn::SequentialModel& model, const py::bytes& b, const std::string& what) {
        std::string s = b;
        py::gil_scoped_release nogil;
        auto src = nn::SequentialModel::deserialize(s, what);
        CX_CHECK(src->size() == model.size() && src->num_parameters() == model.num_parameters() &&
                     src->param_slices() == model.param_slices(),
                 InvalidArgument, "load_checkpoint: ", what, " holds a model with ", src->size(), " layers and ",
                 src->num_parameters(), " parameters, but this trainer's model has ", model.size(), " layers and ",
                 model.num_parameters(), " parameters; build the same architecture before loading");
        for (size_t i = 0; i < model.size(); ++i)
          CX_CHECK(src->module(i)->type_name() == model.module(i)->type_name(), InvalidArgument, "load_checkpoint: ",
                   what, " has ", src->module(i)->type_name(), " at layer ", i, " where this model has ",
                   model.module(i)->type_name());
        std::memcpy(model.flat_params(), src->flat_params(), model.num_parameters() * sizeof(float));
        for (size_t i = 0; i < model.size(); ++i) {
          auto dst_b = model.module(i)->buffers();
          auto src_b = src->module(i)->buffers();
          for (size_t k = 0; k < dst_b.size() && k < src_b.size(); ++k) *dst_b[k] = *src_b[k];
        }
      },
      py::arg("model"), py::arg("data"), py::arg("what"),
      "Copies parameters and buffers from .cyxmodel bytes into model (same architecture).");
}

}  // namespace cx::bindings
