// Bindings of Module, the base class of every layer, and of the layers. Arrays handed out by parameters(),
// gradients(), weight and bias are views into the module's storage (arrays.h, storage_view).
#include <pybind11/stl.h>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "nn/modules.h"
#include "nn/registry.h"
#include "nn/rng.h"
#include "nn/sequential.h"

namespace cx::bindings {

using namespace cx::nn;

namespace {

template <typename T>
using module_class = shared_class<T, Module>;

py::list module_views(Module& m, bool grads) {
  py::list out;
  for (size_t i = 0; i < m.param_specs().size(); ++i)
    out.append(storage_view(grads ? m.grad_storage() : m.param_storage(), m.param_offset(i), m.param_specs()[i].shape));
  return out;
}


void bind_module_base(py::module_& m) {
  shared_class<Module>(m, "Module", "Base class of every layer.")
      .def_property_readonly("name", &Module::type_name)
      .def("__repr__", &Module::repr)
      .def("num_parameters", &Module::num_params)
      .def("parameters", [](Module& self) { return module_views(self, false); },
           "Writable views of the parameter tensors (weight, then bias).")
      .def("gradients", [](Module& self) { return module_views(self, true); })
      .def(
          "forward",
          [](Module& self, py::handle x, bool training) {
            auto a = float_input(x, self.type_name() + ".forward", "(batch, features)");
            const Tensor* out;
            {
              py::gil_scoped_release nogil;
              out = &self.forward_standalone(static_cast<const float*>(a.data()), shape_of(a), training);
            }
            return to_numpy(*out);
          },
          py::arg("x"), py::arg("training") = true)
      .def("backward", [](Module& self, py::handle g) {
        auto a = float_input(g, self.type_name() + ".backward", "(batch, features)");
        const Tensor* out;
        {
          py::gil_scoped_release nogil;
          out = &self.backward_standalone(static_cast<const float*>(a.data()), shape_of(a));
        }
        return to_numpy(*out);
      });
}

void bind_linear(py::module_& m) {
  module_class<LinearModule>(m, "LinearModule",
                             "y = x @ W.T + b, W of shape (out_features, in_features).\n\n"
                             "    model.add(cx.LinearModule(784, 256))\n"
                             "    cx.LinearModule(256, 10, bias=False, init='xavier', seed=0)")
      .def(py::init([](size_t in, size_t out, bool bias, const std::string& init, py::object seed) {
             LinearInit i = linear_init_from_name(init);
             return std::make_shared<LinearModule>(in, out, bias, i, seed_or_next(seed));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true, py::arg("init") = "kaiming",
           py::arg("seed") = py::none())
      .def_property_readonly("in_features", &LinearModule::in_features)
      .def_property_readonly("out_features", &LinearModule::out_features)
      .def_property_readonly("weight",
                             [](LinearModule& s) {
                               return storage_view(s.param_storage(), s.param_offset(0), s.param_specs()[0].shape);
                             })
      .def_property_readonly("bias",
                             [](LinearModule& s) -> py::object {
                               if (!s.has_bias()) return py::none();
                               return storage_view(s.param_storage(), s.param_offset(1), s.param_specs()[1].shape);
                             })
      .def("reset_parameters", [](LinearModule& s, py::object seed) { s.reset_parameters(seed_or_next(seed)); },
           py::arg("seed") = py::none());
}

// The layers after Linear, in the order the module defines them.
void bind_other_layers(py::module_& m) {
  module_class<ReLUModule>(m, "ReLUModule", "max(x, 0), element-wise.").def(py::init<>());
  module_class<LeakyReLUModule>(m, "LeakyReLUModule", "x if x > 0 else negative_slope * x.")
      .def(py::init<float>(), py::arg("negative_slope") = 0.01f)
      .def_property_readonly("negative_slope", &LeakyReLUModule::negative_slope);
  module_class<SigmoidModule>(m, "SigmoidModule", "1 / (1 + exp(-x)), element-wise.").def(py::init<>());
  module_class<TanhModule>(m, "TanhModule", "tanh(x), element-wise.").def(py::init<>());
  module_class<GELUModule>(m, "GELUModule", "x * Phi(x) (exact, erf-based), element-wise.").def(py::init<>());
  module_class<SoftmaxModule>(m, "SoftmaxModule", "Softmax over the features of each row.").def(py::init<>());
  module_class<DropoutModule>(m, "DropoutModule",
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
  module_class<BatchNormModule>(m, "BatchNormModule",
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
  module_class<FlattenModule>(m, "FlattenModule", "(batch, d1, d2, ...) -> (batch, d1*d2*...).").def(py::init<>());
}

// After BatchNormModule, its base.
void bind_sync_batchnorm(py::module_& m) {
  const char* convert_doc =
      "Replaces every BatchNormModule of `model` by a SyncBatchNormModule with the same parameters, running "
      "statistics, eps and momentum, in place, and returns the same model (as PyTorch's does for a container). "
      "Convert before wrapping the model in DistributedDataParallel or DistributedTrainer.\n\n"
      "    model = cx.SyncBatchNormModule.convert_sync_batchnorm(model)";
  auto convert = [](std::shared_ptr<SequentialModel> model) {
    CX_CHECK(model != nullptr, InvalidArgument, "convert_sync_batchnorm: model is None");
    convert_sync_batchnorm(*model);
    return model;
  };
  shared_class<SyncBatchNormModule, BatchNormModule>(
      m, "SyncBatchNormModule",
      "BatchNormModule whose training statistics are those of every rank's batch together, as "
      "torch.nn.SyncBatchNorm. Inside DistributedDataParallel or DistributedTrainer it all-reduces per-feature "
      "sums in forward and backward (on the GPU trainer through NCCL); alone, or in a world of one, it is "
      "BatchNormModule. Eval mode uses the running statistics and communicates nothing.\n\n"
      "    model.add(cx.SyncBatchNormModule(64))\n"
      "    model = cx.SyncBatchNormModule.convert_sync_batchnorm(model)   # or convert an existing model")
      .def(py::init<size_t, float, float>(), py::arg("num_features"), py::arg("eps") = 1e-5f,
           py::arg("momentum") = 0.1f)
      .def_static("convert_sync_batchnorm", convert, py::arg("model"), convert_doc);
  m.def("convert_sync_batchnorm", convert, py::arg("model"), convert_doc);
}

}  // namespace

uint64_t seed_or_next(const py::object& seed) {
  return seed.is_none() ? next_module_seed() : seed.cast<uint64_t>();
}

void bind_modules(py::module_& m) {
  m.def(
      "_layer_ids",
      [] {
        py::dict out;
        for (const auto& l : registered_layers()) out[py::int_(l.id)] = l.name;
        return out;
      },
      "The registered layers' file ids and names, {id: name} (Note [Layer ids] in csrc/nn/registry.h).");
  bind_module_base(m);
  bind_linear(m);
  bind_other_layers(m);
  bind_sync_batchnorm(m);
}

}  // namespace cx::bindings
