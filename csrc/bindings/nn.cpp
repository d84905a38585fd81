// Model stack bindings (issue 3): converts NumPy arrays to pointer + shape, checks
// dtype/contiguity at the boundary, releases the GIL and calls into nn/.
//
// Arrays handed out by parameters()/gradients()/flat_*() are views into the
// model's flat buffers; each keeps that buffer alive (a capsule holding its
// shared_ptr), so a view outliving a re-layout (add()) or the model is stale
// but never dangling.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bindings.h"
#include "common/error.h"
#include "nn/blas.h"
#include "nn/loss.h"
#include "nn/modules.h"
#include "nn/optimizer.h"
#include "nn/rng.h"
#include "nn/scheduler.h"
#include "nn/sequential.h"

namespace cx::bindings {

using namespace cx::nn;

namespace {

std::string describe(py::handle obj) {
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    Shape s(a.shape(), a.shape() + a.ndim());
    return std::string(py::str(a.dtype())) + " array of shape " + shape_str(s);
  }
  return std::string("a ") + std::string(py::str(py::type::of(obj).attr("__name__")));
}

// A float32, C-contiguous ndarray with at least min_ndim dims, else TypeError /
// ValueError saying what was expected.
py::array float_array(py::handle obj, const char* who, const char* expected, size_t min_ndim = 2) {
  if (!py::isinstance<py::array>(obj) || !py::dtype::of<float>().equal(py::reinterpret_borrow<py::array>(obj).dtype()))
    CX_THROW(TypeMismatch, who, ": expected a float32 NumPy array of shape ", expected, ", got ", describe(obj),
             " (convert with np.asarray(x, dtype=np.float32))");
  auto a = py::reinterpret_borrow<py::array>(obj);
  if (static_cast<size_t>(a.ndim()) < min_ndim)
    CX_THROW(InvalidArgument, who, ": expected an array of shape ", expected, ", got shape ",
             shape_str(Shape(a.shape(), a.shape() + a.ndim())));
  if (!(a.flags() & py::array::c_style))
    CX_THROW(InvalidArgument, who, ": expected a C-contiguous array of shape ", expected,
             ", got a non-contiguous view (use np.ascontiguousarray(x))");
  return a;
}

Shape shape_of(const py::array& a) { return Shape(a.shape(), a.shape() + a.ndim()); }

py::array_t<float> to_numpy(const Tensor& t) {
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  py::array_t<float> out(shape);
  std::memcpy(out.mutable_data(), t.data(), t.numel() * sizeof(float));
  return out;
}

// Writable view of storage[offset, offset + numel(shape)), keeping storage alive.
py::array view(const std::shared_ptr<FloatStorage>& storage, size_t offset, const Shape& shape) {
  auto* keep = new std::shared_ptr<FloatStorage>(storage);
  py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<FloatStorage>*>(p); });
  std::vector<py::ssize_t> sh(shape.begin(), shape.end());
  return py::array(py::dtype::of<float>(), sh, {}, storage->data() + offset, base);
}

py::list module_views(Module& m, bool grads) {
  py::list out;
  for (size_t i = 0; i < m.param_specs().size(); ++i)
    out.append(view(grads ? m.grad_storage() : m.param_storage(), m.param_offset(i), m.param_specs()[i].shape));
  return out;
}

uint64_t seed_or_next(const py::object& seed) {
  return seed.is_none() ? next_module_seed() : seed.cast<uint64_t>();
}

std::string fspath(const py::object& p) { return py::module_::import("os").attr("fspath")(p).cast<std::string>(); }

py::dict state_to_py(const StateDict& sd) {
  py::dict d;
  d["type"] = sd.type;
  for (const auto& [k, v] : sd.scalars) {
    if (k == "step") d[k.c_str()] = static_cast<int64_t>(v);
    else if (k == "nesterov") d[k.c_str()] = v != 0.0;
    else d[k.c_str()] = v;
  }
  for (const auto& [k, v] : sd.arrays) {
    py::array_t<float> a(static_cast<py::ssize_t>(v.size()));
    std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
    d[k.c_str()] = a;
  }
  return d;
}

StateDict state_from_py(const py::dict& d) {
  StateDict sd;
  CX_CHECK(d.contains("type"), InvalidArgument, "load_state_dict: state_dict lacks 'type'");
  sd.type = d["type"].cast<std::string>();
  for (auto [k, v] : d) {
    std::string key = k.cast<std::string>();
    if (key == "type") continue;
    if (py::isinstance<py::array>(v)) {
      auto a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(v);
      CX_CHECK(a && a.ndim() == 1, InvalidArgument, "load_state_dict: '", key, "' must be a 1-D float32 array");
      sd.arrays[key] = std::vector<float>(a.data(), a.data() + a.size());
    } else {
      sd.scalars[key] = v.cast<double>();
    }
  }
  return sd;
}

template <typename T>
using cls = py::class_<T, std::shared_ptr<T>>;
template <typename T>
using module_cls = py::class_<T, Module, std::shared_ptr<T>>;
template <typename T>
using optim_cls = py::class_<T, Optimizer, std::shared_ptr<T>>;
template <typename T>
using sched_cls = py::class_<T, LRScheduler, std::shared_ptr<T>>;

// Loss targets: dense float32 of the output's shape.
py::array dense_target(py::handle t, const char* who) { return float_array(t, who, "(batch, ...) like the output", 1); }

}  // namespace

void bind_nn(py::module_& m) {
  cx::nn::apply_default_num_threads();

  m.def("set_num_threads", &cx::nn::set_num_threads, py::arg("n"),
        "Sets the number of BLAS threads used by the model math.");
  m.def("get_num_threads", &cx::nn::get_num_threads, "Number of BLAS threads used by the model math.");
  m.def("manual_seed", &cx::nn::manual_seed, py::arg("seed"),
        "Seeds the sequence that gives modules created without seed= their seeds.");

  // ------------------------------------------------------------ modules
  cls<Module>(m, "Module", "Base class of every layer.")
      .def_property_readonly("name", &Module::type_name)
      .def("__repr__", &Module::repr)
      .def("num_parameters", &Module::num_params)
      .def("parameters", [](Module& self) { return module_views(self, false); },
           "Writable views of the parameter tensors (weight, then bias).")
      .def("gradients", [](Module& self) { return module_views(self, true); })
      .def(
          "forward",
          [](Module& self, py::handle x, bool training) {
            auto a = float_array(x, (self.type_name() + ".forward").c_str(), "(batch, features)");
            const Tensor* out;
            {
              py::gil_scoped_release nogil;
              out = &self.forward_standalone(static_cast<const float*>(a.data()), shape_of(a), training);
            }
            return to_numpy(*out);
          },
          py::arg("x"), py::arg("training") = true)
      .def("backward", [](Module& self, py::handle g) {
        auto a = float_array(g, (self.type_name() + ".backward").c_str(), "(batch, features)");
        const Tensor* out;
        {
          py::gil_scoped_release nogil;
          out = &self.backward_standalone(static_cast<const float*>(a.data()), shape_of(a));
        }
        return to_numpy(*out);
      });

  module_cls<LinearModule>(m, "LinearModule",
                           "y = x @ W.T + b, W of shape (out_features, in_features).\n\n"
                           "    model.add(cx.LinearModule(784, 256))\n"
                           "    cx.LinearModule(256, 10, bias=False, init='xavier', seed=0)")
      .def(py::init([](size_t in, size_t out, bool bias, const std::string& init, py::object seed) {
             LinearInit i = LinearInit::kKaiming;
             if (init == "xavier") i = LinearInit::kXavier;
             else if (init != "kaiming")
               CX_THROW(InvalidArgument, "LinearModule: init must be 'kaiming' or 'xavier', got '", init, "'");
             return std::make_shared<LinearModule>(in, out, bias, i, seed_or_next(seed));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true, py::arg("init") = "kaiming",
           py::arg("seed") = py::none())
      .def_property_readonly("in_features", &LinearModule::in_features)
      .def_property_readonly("out_features", &LinearModule::out_features)
      .def_property_readonly("weight",
                             [](LinearModule& s) { return view(s.param_storage(), s.param_offset(0), s.param_specs()[0].shape); })
      .def_property_readonly("bias",
                             [](LinearModule& s) -> py::object {
                               if (!s.has_bias()) return py::none();
                               return view(s.param_storage(), s.param_offset(1), s.param_specs()[1].shape);
                             })
      .def("reset_parameters", [](LinearModule& s, py::object seed) { s.reset_parameters(seed_or_next(seed)); },
           py::arg("seed") = py::none());

  module_cls<ReLUModule>(m, "ReLUModule", "max(x, 0), element-wise.").def(py::init<>());
  module_cls<LeakyReLUModule>(m, "LeakyReLUModule", "x if x > 0 else negative_slope * x.")
      .def(py::init<float>(), py::arg("negative_slope") = 0.01f)
      .def_property_readonly("negative_slope", &LeakyReLUModule::negative_slope);
  module_cls<SigmoidModule>(m, "SigmoidModule", "1 / (1 + exp(-x)), element-wise.").def(py::init<>());
  module_cls<TanhModule>(m, "TanhModule", "tanh(x), element-wise.").def(py::init<>());
  module_cls<GELUModule>(m, "GELUModule", "x * Phi(x) (exact, erf-based), element-wise.").def(py::init<>());
  module_cls<SoftmaxModule>(m, "SoftmaxModule", "Softmax over the features of each row.").def(py::init<>());
  module_cls<DropoutModule>(m, "DropoutModule",
                            "Zeroes elements with probability p in training (scaling the rest by 1/(1-p)); "
                            "identity in eval mode. Seeded.")
      .def(py::init([](float p, py::object seed) { return std::make_shared<DropoutModule>(p, seed_or_next(seed)); }),
           py::arg("p") = 0.5f, py::arg("seed") = py::none())
      .def_property_readonly("p", &DropoutModule::p)
      .def_property_readonly("seed", &DropoutModule::seed)
      .def("get_rng_state", &DropoutModule::rng_state,
           "The mask generator's state (an int): where its random stream stands now.\n\n"
           "    s = drop.get_rng_state(); ...; drop.set_rng_state(s)   # the same masks again")
      .def("set_rng_state", &DropoutModule::set_rng_state, py::arg("state"),
           "Restores a state from get_rng_state().");
  module_cls<BatchNormModule>(m, "BatchNormModule",
                              "Batch normalisation over (batch, features) with running statistics for eval mode.")
      .def(py::init<size_t, float, float>(), py::arg("num_features"), py::arg("eps") = 1e-5f,
           py::arg("momentum") = 0.1f)
      .def_property_readonly("num_features", &BatchNormModule::features)
      .def_property_readonly("eps", &BatchNormModule::eps)
      .def_property_readonly("momentum", &BatchNormModule::momentum)
      .def_property_readonly("running_mean",
                             [](BatchNormModule& s) {
                               auto& v = s.running_mean();
                               return py::array_t<float>(static_cast<py::ssize_t>(v.size()), v.data());
                             })
      .def_property_readonly("running_var", [](BatchNormModule& s) {
        auto& v = s.running_var();
        return py::array_t<float>(static_cast<py::ssize_t>(v.size()), v.data());
      });
  module_cls<FlattenModule>(m, "FlattenModule", "(batch, d1, d2, ...) -> (batch, d1*d2*...).").def(py::init<>());

  // ------------------------------------------------------------ model
  cls<SequentialModel>(m, "SequentialModel", py::dynamic_attr(),
                       "Layers applied in order; parameters and gradients in two flat float32 buffers.\n\n"
                       "    model = cx.SequentialModel()\n"
                       "    model.add(cx.LinearModule(784, 256)); model.add(cx.ReLUModule())")
      .def(py::init<>())
      .def("add", &SequentialModel::add, py::arg("module"),
           "Appends a module. Views from parameters()/flat_parameters() taken before are stale afterwards.")
      .def(
          "forward",
          [](py::object self, py::handle x) {
            auto& model = self.cast<SequentialModel&>();
            auto a = float_array(x, "SequentialModel.forward", "(batch, features)");
            const Tensor* out;
            {
              py::gil_scoped_release nogil;
              out = &model.forward(static_cast<const float*>(a.data()), shape_of(a));
            }
            // The model reads the input again in backward (no copy): keep it alive.
            self.attr("_forward_input") = a;
            return to_numpy(*out);
          },
          py::arg("x"), "Returns the output (a new float32 array).")
      .def(
          "__call__",
          [](py::object self, py::handle x) { return self.attr("forward")(x); }, py::arg("x"))
      .def(
          "backward",
          [](SequentialModel& model, py::handle g, bool input_grad) -> py::object {
            auto a = float_array(g, "SequentialModel.backward", "(batch, outputs) like the output of forward()");
            const Tensor* gx;
            {
              py::gil_scoped_release nogil;
              gx = model.backward(static_cast<const float*>(a.data()), shape_of(a), input_grad);
            }
            if (!gx) return py::none();
            return to_numpy(*gx);
          },
          py::arg("grad_output"), py::arg("input_grad") = true,
          "Accumulates parameter gradients; returns dL/d(input), or None with input_grad=False.")
      .def("zero_grad", &SequentialModel::zero_grad)
      .def(
          "get_rng_state",
          [](const SequentialModel& s) {
            auto v = s.rng_states();
            py::array_t<uint64_t> out(static_cast<py::ssize_t>(v.size()));
            if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(uint64_t));
            return out;
          },
          "Generator states of the modules that have one (Dropout), layer order, as a uint64 array.\n\n"
          "    state = model.get_rng_state(); ...; model.set_rng_state(state)   # same dropout masks again")
      .def(
          "set_rng_state",
          [](SequentialModel& s, py::array_t<uint64_t, py::array::c_style | py::array::forcecast> a) {
            CX_CHECK(a.ndim() == 1, InvalidArgument, "SequentialModel.set_rng_state: expected a 1-D array from "
                     "get_rng_state(), got ", a.ndim(), " dimensions");
            s.set_rng_states(std::vector<uint64_t>(a.data(), a.data() + a.size()));
          },
          py::arg("state"), "Restores the states from get_rng_state() (same number of Dropout modules).")
      .def(
          "train", [](py::object self, bool mode) { self.cast<SequentialModel&>().train(mode); return self; },
          py::arg("mode") = true)
      .def("eval", [](py::object self) { self.cast<SequentialModel&>().eval(); return self; })
      .def_property_readonly("training", &SequentialModel::training)
      .def("parameters",
           [](SequentialModel& s) {
             py::list out;
             for (auto [mi, pi] : s.param_owners()) {
               auto& mod = *s.module(mi);
               out.append(view(s.param_storage(), mod.param_offset(pi), mod.param_specs()[pi].shape));
             }
             return out;
           },
           "Writable views of every parameter tensor, layer order, weight then bias.")
      .def("gradients",
           [](SequentialModel& s) {
             py::list out;
             for (auto [mi, pi] : s.param_owners()) {
               auto& mod = *s.module(mi);
               out.append(view(s.grad_storage(), mod.param_offset(pi), mod.param_specs()[pi].shape));
             }
             return out;
           })
      .def("flat_parameters", [](SequentialModel& s) { return view(s.param_storage(), 0, {s.num_parameters()}); },
           "The flat parameter buffer itself (a writable 1-D view).")
      .def("flat_gradients", [](SequentialModel& s) { return view(s.grad_storage(), 0, {s.num_parameters()}); })
      .def("param_slices", &SequentialModel::param_slices,
           "(offset, count) of every parameter tensor in the flat buffers.")
      .def("num_parameters", &SequentialModel::num_parameters)
      .def(
          "_set_grad_ready_hook",
          [](SequentialModel& s, py::object fn) {
            if (fn.is_none()) return s.clear_grad_ready_hook();
            // For tests and tools: the C++ hook runs without the GIL, so take it.
            auto holder = std::make_shared<py::object>(fn);
            s.set_grad_ready_hook([holder](size_t i) {
              py::gil_scoped_acquire gil;
              (*holder)(i);
            });
          },
          py::arg("fn"), "Test hook: fn(param_index) as each gradient becomes final in backward (see sequential.h).")
      .def("summary", &SequentialModel::summary)
      .def("__repr__", &SequentialModel::repr)
      .def("__len__", &SequentialModel::size)
      .def("__getitem__",
           [](SequentialModel& s, py::ssize_t i) {
             py::ssize_t n = static_cast<py::ssize_t>(s.size());
             if (i < 0) i += n;
             if (i < 0 || i >= n) throw py::index_error("SequentialModel index out of range");
             return s.module(static_cast<size_t>(i));
           })
      .def(
          "save",
          [](SequentialModel& s, py::object path) {
            std::string p = fspath(path);
            py::gil_scoped_release nogil;
            s.save(p);
          },
          py::arg("path"), "Writes a .cyxmodel file (atomically: temporary file, fsync, rename).")
      .def_static(
          "load",
          [](py::object path) {
            std::string p = fspath(path);
            py::gil_scoped_release nogil;
            return SequentialModel::load(p);
          },
          py::arg("path"), "Rebuilds a model saved with save(); raises OSError naming the file if it is bad.");

  // ------------------------------------------------------------ losses
  cls<CrossEntropyLoss>(m, "CrossEntropyLoss",
                        "Softmax cross-entropy on logits, mean over the batch. Targets: int32/int64 labels of "
                        "shape (batch,) or float32 one-hot of shape (batch, classes).")
      .def(py::init<>())
      .def("forward",
           [](CrossEntropyLoss& loss, py::handle out, py::handle target) {
             auto o = float_array(out, "CrossEntropyLoss.forward", "(batch, classes)");
             Shape os = shape_of(o);
             const float* op = static_cast<const float*>(o.data());
             if (py::isinstance<py::array>(target)) {
               auto t = py::reinterpret_borrow<py::array>(target);
               bool i64 = py::dtype::of<int64_t>().equal(t.dtype()), i32 = py::dtype::of<int32_t>().equal(t.dtype());
               if (i64 || i32) {
                 CX_CHECK(t.ndim() == 1, InvalidArgument,
                          "CrossEntropyLoss.forward: integer labels must have shape (batch,), got ",
                          shape_str(shape_of(t)));
                 CX_CHECK(t.flags() & py::array::c_style, InvalidArgument,
                          "CrossEntropyLoss.forward: labels must be C-contiguous");
                 size_t n = static_cast<size_t>(t.shape(0));
                 py::gil_scoped_release nogil;
                 return i64 ? loss.forward(op, os, static_cast<const int64_t*>(t.data()), n)
                            : loss.forward(op, os, static_cast<const int32_t*>(t.data()), n);
               }
               if (py::dtype::of<float>().equal(t.dtype())) {
                 auto tt = float_array(t, "CrossEntropyLoss.forward", "(batch, classes)", 1);
                 py::gil_scoped_release nogil;
                 return loss.forward(op, os, static_cast<const float*>(tt.data()), shape_of(tt));
               }
             }
             CX_THROW(TypeMismatch,
                      "CrossEntropyLoss.forward: target must be int32/int64 labels of shape (batch,) or float32 "
                      "one-hot of shape (batch, classes), got ",
                      describe(target));
           },
           py::arg("output"), py::arg("target"), "Returns the mean loss.")
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", [](CrossEntropyLoss& l) { return to_numpy(l.backward()); }, "dL/d(output) of the last forward.")
      .def("accuracy", &CrossEntropyLoss::accuracy, "Fraction of rows of the last forward classified correctly.")
      .def("correct", &CrossEntropyLoss::correct, "Rows of the last forward classified correctly.")
      .def("__repr__", &CrossEntropyLoss::repr);

  cls<MSELoss>(m, "MSELoss", "Mean of (output - target)^2 over all elements.")
      .def(py::init<>())
      .def("forward",
           [](MSELoss& loss, py::handle out, py::handle target) {
             auto o = float_array(out, "MSELoss.forward", "(batch, ...)", 1);
             auto t = dense_target(target, "MSELoss.forward");
             py::gil_scoped_release nogil;
             return loss.forward(static_cast<const float*>(o.data()), shape_of(o), static_cast<const float*>(t.data()),
                                 shape_of(t));
           },
           py::arg("output"), py::arg("target"))
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", [](MSELoss& l) { return to_numpy(l.backward()); })
      .def("__repr__", &MSELoss::repr);

  cls<BCEWithLogitsLoss>(m, "BCEWithLogitsLoss", "Binary cross-entropy on logits (stable), mean over all elements.")
      .def(py::init<>())
      .def("forward",
           [](BCEWithLogitsLoss& loss, py::handle out, py::handle target) {
             auto o = float_array(out, "BCEWithLogitsLoss.forward", "(batch, ...)", 1);
             auto t = dense_target(target, "BCEWithLogitsLoss.forward");
             py::gil_scoped_release nogil;
             return loss.forward(static_cast<const float*>(o.data()), shape_of(o), static_cast<const float*>(t.data()),
                                 shape_of(t));
           },
           py::arg("output"), py::arg("target"))
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", [](BCEWithLogitsLoss& l) { return to_numpy(l.backward()); })
      .def("__repr__", &BCEWithLogitsLoss::repr);

  // ------------------------------------------------------------ optimizers
  cls<Optimizer>(m, "Optimizer", "Base class of the optimizers.")
      .def(
          "step",
          [](Optimizer& o, SequentialModel& model) {
            py::gil_scoped_release nogil;
            o.step(model);
          },
          py::arg("model"), "One update of model's flat parameters from its flat gradients.")
      .def("zero_grad", &Optimizer::zero_grad, py::arg("model"))
      .def_property("lr", &Optimizer::lr, &Optimizer::set_lr)
      .def_property_readonly("steps", &Optimizer::steps)
      .def("state_dict", [](const Optimizer& o) { return state_to_py(o.state_dict()); },
           "Hyper-parameters, step count and state as a dict of floats/ints and NumPy arrays.")
      .def("load_state_dict", [](Optimizer& o, const py::dict& d) { o.load_state_dict(state_from_py(d)); },
           py::arg("state_dict"))
      .def("__repr__", &Optimizer::repr);
  optim_cls<SGDOptimizer>(m, "SGDOptimizer", "SGD with optional (Nesterov) momentum and L2 weight decay.")
      .def(py::init<double, double, bool, double>(), py::arg("lr") = 0.01, py::arg("momentum") = 0.0,
           py::arg("nesterov") = false, py::arg("weight_decay") = 0.0);
  optim_cls<AdamOptimizer>(m, "AdamOptimizer", "Adam; weight_decay adds L2 to the gradient.")
      .def(py::init<double, double, double, double, double>(), py::arg("lr") = 1e-3, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0);
  py::class_<AdamWOptimizer, AdamOptimizer, std::shared_ptr<AdamWOptimizer>>(
      m, "AdamWOptimizer", "Adam with decoupled weight decay (p *= 1 - lr*weight_decay).")
      .def(py::init<double, double, double, double, double>(), py::arg("lr") = 1e-3, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2);
  optim_cls<RMSpropOptimizer>(m, "RMSpropOptimizer", "RMSprop (torch.optim.RMSprop, centered=False).")
      .def(py::init<double, double, double, double, double>(), py::arg("lr") = 1e-2, py::arg("alpha") = 0.99,
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0, py::arg("momentum") = 0.0);

  m.def(
      "clip_grad_norm",
      [](SequentialModel& model, double max_norm) {
        py::gil_scoped_release nogil;
        return cx::nn::clip_grad_norm(model, max_norm);
      },
      py::arg("model"), py::arg("max_norm"),
      "Scales the model's gradients so their global L2 norm is <= max_norm; returns the norm before.");

  // ------------------------------------------------------------ schedulers
  cls<LRScheduler>(m, "LRScheduler", "Base class of the learning-rate schedulers.")
      .def("step", &LRScheduler::step)
      .def("get_last_lr", &LRScheduler::get_last_lr)
      .def_property_readonly("last_epoch", &LRScheduler::last_epoch)
      .def_property_readonly("base_lr", &LRScheduler::base_lr)
      .def_property_readonly("optimizer", &LRScheduler::optimizer)
      .def("lr_at", &LRScheduler::lr_at, py::arg("epoch"))
      .def("state_dict",
           [](const LRScheduler& s) {
             py::dict d;
             d["last_epoch"] = s.last_epoch();
             d["base_lr"] = s.base_lr();
             return d;
           })
      .def("load_state_dict",
           [](LRScheduler& s, const py::dict& d) {
             CX_CHECK(d.contains("last_epoch") && d.contains("base_lr"), InvalidArgument,
                      "load_state_dict: scheduler state needs 'last_epoch' and 'base_lr'");
             s.load(d["last_epoch"].cast<int64_t>(), d["base_lr"].cast<double>());
           },
           py::arg("state_dict"))
      .def("__repr__", &LRScheduler::repr);
  sched_cls<StepLR>(m, "StepLR", "lr = base_lr * gamma ** (epoch // step_size).")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("step_size"),
           py::arg("gamma") = 0.1);
  sched_cls<CosineAnnealingLR>(m, "CosineAnnealingLR",
                               "Cosine from base_lr down to eta_min over T_max steps, then eta_min.")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("T_max"),
           py::arg("eta_min") = 0.0);
  sched_cls<LinearWarmupLR>(m, "LinearWarmupLR",
                            "Linear ramp from start_factor*base_lr to base_lr over warmup_steps steps.")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("warmup_steps"),
           py::arg("start_factor") = 0.1);
}

}  // namespace cx::bindings
