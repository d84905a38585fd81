// Bindings of the optimizers, clip_grad_norm and the learning-rate schedulers. state_dict() crosses as a dict of
// floats/ints and 1-D float32 arrays (StateDict in nn/optimizer.h).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bindings.h"
#include "common/error.h"
#include "nn/optimizer.h"
#include "nn/scheduler.h"
#include "nn/sequential.h"

namespace cx::bindings {

using namespace cx::nn;

// StateDict -> dict: "step" as an int and "nesterov" as a bool (the C++ side keeps every scalar as a double).
py::dict optimizer_state_to_py(StateDict sd) {
  py::dict d;
  d["type"] = sd.type;
  for (const auto& [k, v] : sd.scalars) {
    if (k == "step") d[k.c_str()] = static_cast<int64_t>(v);
    else if (k == "nesterov") d[k.c_str()] = v != 0.0;
    else d[k.c_str()] = v;
  }
  for (auto& [k, v] : sd.arrays) {  // each array handed over, not copied (a checkpoint takes one every epoch)
    auto* owned = new std::vector<float>(std::move(v));
    py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
    d[k.c_str()] = py::array_t<float>(static_cast<py::ssize_t>(owned->size()), owned->data(), owner);
  }
  return d;
}

StateDict optimizer_state_from_py(const py::dict& d) {
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

namespace {

template <typename T>
using optimizer_class = shared_class<T, Optimizer>;
template <typename T>
using scheduler_class = shared_class<T, LRScheduler>;

}  // namespace

void bind_optimizers(py::module_& m) {
  shared_class<Optimizer>(m, "Optimizer", "Base class of the optimizers.")
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
      .def_property_readonly("state_numel", &Optimizer::state_numel,
                             "Floats of state held (every state array together; 0 before the first step).")
      .def("state_dict", [](const Optimizer& o) { return optimizer_state_to_py(o.state_dict()); },
           "Hyper-parameters, step count and state as a dict of floats/ints and NumPy arrays.")
      .def("load_state_dict", [](Optimizer& o, const py::dict& d) { o.load_state_dict(optimizer_state_from_py(d)); },
           py::arg("state_dict"))
      .def("__repr__", &Optimizer::repr);
  optimizer_class<SGDOptimizer>(m, "SGDOptimizer", "SGD with optional (Nesterov) momentum and L2 weight decay.")
      .def(py::init<double, double, bool, double>(), py::arg("lr") = 0.01, py::arg("momentum") = 0.0,
           py::arg("nesterov") = false, py::arg("weight_decay") = 0.0);
  optimizer_class<AdamOptimizer>(m, "AdamOptimizer", "Adam; weight_decay adds L2 to the gradient.")
      .def(py::init<double, double, double, double, double>(), py::arg("lr") = 1e-3, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.0);
  shared_class<AdamWOptimizer, AdamOptimizer>(m, "AdamWOptimizer",
                                              "Adam with decoupled weight decay (p *= 1 - lr*weight_decay).")
      .def(py::init<double, double, double, double, double>(), py::arg("lr") = 1e-3, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.999, py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2);
  optimizer_class<RMSpropOptimizer>(m, "RMSpropOptimizer", "RMSprop (torch.optim.RMSprop, centered=False).")
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
}

void bind_schedulers(py::module_& m) {
  shared_class<LRScheduler>(m, "LRScheduler", "Base class of the learning-rate schedulers.")
      .def("step", &LRScheduler::step)
      .def("get_last_lr", &LRScheduler::get_last_lr)
      .def_property_readonly("last_epoch", &LRScheduler::last_epoch)
      .def_property_readonly("base_lr", &LRScheduler::base_lr)
      .def_property_readonly("optimizer", &LRScheduler::optimizer)
      .def("lr_at", &LRScheduler::lr_at, py::arg("epoch"))
      .def_property(
          "interval",
          [](const LRScheduler& s) { return s.interval() == LRScheduler::Interval::kStep ? "step" : "epoch"; },
          [](LRScheduler& s, const std::string& v) {
            CX_CHECK(v == "epoch" || v == "step", InvalidArgument, "scheduler.interval must be 'epoch' or 'step', got '",
                     v, "'");
            s.set_interval(v == "step" ? LRScheduler::Interval::kStep : LRScheduler::Interval::kEpoch);
          },
          "How often DistributedTrainer.fit steps it: 'epoch' (StepLR, CosineAnnealingLR) or 'step', once per\n"
          "optimizer step (LinearWarmupLR). Set it to change that.")
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
  scheduler_class<StepLR>(m, "StepLR", "lr = base_lr * gamma ** (epoch // step_size).")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("step_size"),
           py::arg("gamma") = 0.1);
  scheduler_class<CosineAnnealingLR>(m, "CosineAnnealingLR",
                                     "Cosine from base_lr down to eta_min over T_max steps, then eta_min.")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("T_max"),
           py::arg("eta_min") = 0.0);
  scheduler_class<LinearWarmupLR>(m, "LinearWarmupLR",
                                  "Linear ramp from start_factor*base_lr to base_lr over warmup_steps steps.")
      .def(py::init<std::shared_ptr<Optimizer>, int64_t, double>(), py::arg("optimizer"), py::arg("warmup_steps"),
           py::arg("start_factor") = 0.1);
}

}  // namespace cx::bindings
