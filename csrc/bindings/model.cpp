// Bindings of SequentialModel. Arrays handed out by parameters()/gradients()/flat_*() are views into the model's
// flat buffers (arrays.h, storage_view).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "nn/sequential.h"

namespace cx::bindings {

using namespace cx::nn;

namespace {

using ModelClass = shared_class<SequentialModel>;

// One view per parameter tensor (grads: of its gradient), layer order, weight then bias.
py::list param_views(SequentialModel& s, bool grads) {
  py::list out;
  for (auto [mi, pi] : s.param_owners()) {
    auto& mod = *s.module(mi);
    out.append(storage_view(grads ? s.grad_storage() : s.param_storage(), mod.param_offset(pi),
                            mod.param_specs()[pi].shape));
  }
  return out;
}

std::string fspath(const py::object& p) { return py::module_::import("os").attr("fspath")(p).cast<std::string>(); }

// add, forward, backward, and the training mode.
void def_compute(ModelClass& c) {
  c.def(py::init<>())
      .def("add", &SequentialModel::add, py::arg("module"),
           "Appends a module. Views from parameters()/flat_parameters() taken before are stale afterwards.")
      .def(
          "forward",
          [](py::object self, py::handle x) {
            auto& model = self.cast<SequentialModel&>();
            auto a = float_input(x, "SequentialModel.forward", "(batch, features)");
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
          "__call__", [](py::object self, py::handle x) { return self.attr("forward")(x); }, py::arg("x"))
      .def(
          "backward",
          [](SequentialModel& model, py::handle g, bool input_grad) -> py::object {
            auto a = float_input(g, "SequentialModel.backward", "(batch, outputs) like the output of forward()");
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
          "train", [](py::object self, bool mode) { self.cast<SequentialModel&>().train(mode); return self; },
          py::arg("mode") = true)
      .def("eval", [](py::object self) { self.cast<SequentialModel&>().eval(); return self; })
      .def_property_readonly("training", &SequentialModel::training)
      .def_property("detect_anomaly", &SequentialModel::detect_anomaly, &SequentialModel::set_detect_anomaly,
                    "Anomaly mode (as torch.autograd.detect_anomaly), off by default: forward and backward check "
                    "every layer's output and gradients and raise cx.distributed.NonFiniteError naming the first "
                    "layer (index and type) that turned finite values into inf/NaN. Costs a read of every "
                    "activation and gradient.\n\n    model.detect_anomaly = True");
}

// Parameters, gradients, generator states and the gradient-ready hook.
void def_state(ModelClass& c) {
  c.def(
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
      .def("parameters", [](SequentialModel& s) { return param_views(s, false); },
           "Writable views of every parameter tensor, layer order, weight then bias.")
      .def("gradients", [](SequentialModel& s) { return param_views(s, true); })
      .def(
          "flat_parameters",
          [](SequentialModel& s) { return storage_view(s.param_storage(), s.base_offset(), {s.num_parameters()}); },
          "The flat parameter buffer itself (a writable 1-D view).")
      .def("flat_gradients",
           [](SequentialModel& s) { return storage_view(s.grad_storage(), s.base_offset(), {s.num_parameters()}); })
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
          py::arg("fn"), "Test hook: fn(param_index) as each gradient becomes final in backward (see sequential.h).");
}

// Printing, indexing, files.
void def_container_and_files(ModelClass& c) {
  c.def("summary", &SequentialModel::summary)
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
}

}  // namespace

void bind_model(py::module_& m) {
  ModelClass c(m, "SequentialModel", py::dynamic_attr(),
               "Layers applied in order; parameters and gradients in two flat float32 buffers.\n\n"
               "    model = cx.SequentialModel()\n"
               "    model.add(cx.LinearModule(784, 256)); model.add(cx.ReLUModule())");
  def_compute(c);
  def_state(c);
  def_container_and_files(c);
}

}  // namespace cx::bindings
