// Bindings of the layers that register themselves (csrc/nn/layers/, nn/registry.h): one class each. After
// SequentialModel (model.cpp), which ResidualModule's signature names. Weight views as modules.cpp's.
#include <pybind11/stl.h>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "nn/layers/batchnorm2d.h"
#include "nn/layers/conv2d.h"
#include "nn/layers/conv2d_direct.h"
#include "nn/layers/pooling.h"
#include "nn/layers/residual.h"
#include "nn/rng.h"

namespace cx::bindings {

using namespace cx::nn;

namespace {

template <typename T>
using module_class = shared_class<T, Module>;

// stride=None: the window's size, as PyTorch's pooling.
int64_t stride_or_kernel(const py::object& stride, int64_t kernel_size) {
  return stride.is_none() ? kernel_size : stride.cast<int64_t>();
}

py::object param_view(Module& m, size_t i) {
  if (i >= m.param_specs().size()) return py::none();
  return storage_view(m.param_storage(), m.param_offset(i), m.param_specs()[i].shape);
}

void bind_conv2d(py::module_& m) {
  module_class<Conv2dModule>(
      m, "Conv2dModule",
      "2-D convolution over (batch, in_channels, height, width) float32 images, as torch.nn.Conv2d with a square "
      "kernel: weight (out_channels, in_channels/groups, k, k), bias (out_channels,). Kaiming-uniform init, "
      "seeded. On the CPU and the GPU.\n\n"
      "    model.add(cx.Conv2dModule(3, 16, 3, padding=1))\n"
      "    cx.Conv2dModule(16, 32, 1, stride=2, bias=False)   # a ResNet shortcut")
      .def(py::init([](int64_t in, int64_t out, int64_t k, int64_t stride, int64_t padding, bool bias,
                       int64_t dilation, int64_t groups, const py::object& seed) {
             return std::make_shared<Conv2dModule>(in, out, k, stride, padding, bias, dilation, groups,
                                                   seed_or_next(seed));
           }),
           py::arg("in_channels"), py::arg("out_channels"), py::arg("kernel_size"), py::arg("stride") = 1,
           py::arg("padding") = 0, py::arg("bias") = true, py::arg("dilation") = 1, py::arg("groups") = 1,
           py::arg("seed") = py::none())
      .def_property_readonly("in_channels", [](Conv2dModule& s) { return s.geometry().in; })
      .def_property_readonly("out_channels", [](Conv2dModule& s) { return s.geometry().out; })
      .def_property_readonly("kernel_size", [](Conv2dModule& s) { return s.geometry().k; })
      .def_property_readonly("stride", [](Conv2dModule& s) { return s.geometry().stride; })
      .def_property_readonly("padding", [](Conv2dModule& s) { return s.geometry().padding; })
      .def_property_readonly("dilation", [](Conv2dModule& s) { return s.geometry().dilation; })
      .def_property_readonly("groups", [](Conv2dModule& s) { return s.geometry().groups; })
      .def_property_readonly("weight", [](Conv2dModule& s) { return param_view(s, 0); })
      .def_property_readonly("bias", [](Conv2dModule& s) { return param_view(s, 1); })
      .def("reset_parameters", [](Conv2dModule& s, const py::object& seed) { s.reset_parameters(seed_or_next(seed)); },
           py::arg("seed") = py::none());
}

template <typename Pool>
void bind_pool(py::module_& m, const char* name, const char* doc) {
  module_class<Pool>(m, name, doc)
      .def(py::init([](int64_t k, const py::object& stride) {
             return std::make_shared<Pool>(k, stride_or_kernel(stride, k));
           }),
           py::arg("kernel_size"), py::arg("stride") = py::none())
      .def_property_readonly("kernel_size", &Pool::kernel_size)
      .def_property_readonly("stride", &Pool::stride);
}

void bind_residual(py::module_& m) {
  module_class<ResidualModule>(
      m, "ResidualModule",
      "y = block(x) + shortcut(x), block and shortcut SequentialModels (shortcut=None: the identity). Their "
      "parameters become the residual's, block's first, and move with it into the model; the models may not "
      "grow afterwards. Nests: a block may hold ResidualModules. On the CPU and the GPU.\n\n"
      "    block = cx.SequentialModel(); block.add(cx.Conv2dModule(16, 16, 3, padding=1)); ...\n"
      "    model.add(cx.ResidualModule(block))")
      .def(py::init([](std::shared_ptr<SequentialModel> block, std::shared_ptr<SequentialModel> shortcut) {
             return std::make_shared<ResidualModule>(std::move(block), std::move(shortcut));
           }),
           py::arg("block"), py::arg("shortcut") = py::none())
      .def_property_readonly("block", &ResidualModule::block)
      .def_property_readonly("shortcut", &ResidualModule::shortcut);
}

}  // namespace

void bind_layers(py::module_& m) {
  bind_conv2d(m);
  m.def("_conv2d_unfold_floats", &Conv2dModule::set_unfold_floats, py::arg("n"),
        "For tests: the most floats one Conv2d unfolding may hold (0: the default), returning the previous "
        "setting (Note [Unfolding in chunks] in csrc/nn/layers/conv2d.h).");
  m.def("_conv2d_direct_available", &direct_conv::available,
        "For tests: whether this CPU runs Conv2d's direct kernels (AVX-512F, and CX_NN_SCALAR is not 1), which "
        "then take most 3x3 convolutions of stride 1 and 2 (Note [Direct convolution] in "
        "csrc/nn/layers/conv2d_direct.cpp).");
  m.def("_conv2d_direct", &direct_conv::switch_on, py::arg("on"),
        "For tests and benchmarks: switches Conv2d's direct kernels on or off (the GEMMs then take every "
        "convolution), returning the previous setting.");
  bind_pool<MaxPool2dModule>(m, "MaxPool2dModule",
                             "The maximum of each kernel_size x kernel_size window, moved by stride (default: "
                             "kernel_size), of (batch, C, H, W) images. On the CPU and the GPU.\n\n"
                             "    model.add(cx.MaxPool2dModule(2))             # (N, C, 32, 32) -> (N, C, 16, 16)");
  bind_pool<AvgPool2dModule>(m, "AvgPool2dModule",
                             "The mean of each kernel_size x kernel_size window, moved by stride (default: "
                             "kernel_size), of (batch, C, H, W) images. On the CPU and the GPU.\n\n"
                             "    model.add(cx.AvgPool2dModule(2))             # (N, C, 32, 32) -> (N, C, 16, 16)");
  module_class<GlobalAvgPool2dModule>(m, "GlobalAvgPool2dModule",
                                      "The mean of each channel: (batch, C, H, W) -> (batch, C). On the CPU and the "
                                      "GPU.\n\n"
                                      "    model.add(cx.GlobalAvgPool2dModule())   # then a LinearModule(C, classes)")
      .def(py::init<>());
  shared_class<BatchNorm2dModule, BatchNormModule>(
      m, "BatchNorm2dModule",
      "Batch normalisation of (batch, C, H, W) images, per channel over batch, height and width, with running "
      "statistics for eval mode (torch.nn.BatchNorm2d). cx.convert_sync_batchnorm turns it into a "
      "SyncBatchNormModule. On the CPU and the GPU.\n\n"
      "    model.add(cx.BatchNorm2dModule(16))")
      .def(py::init<size_t, float, float>(), py::arg("num_features"), py::arg("eps") = 1e-5f,
           py::arg("momentum") = 0.1f);
  bind_residual(m);
}

}  // namespace cx::bindings
