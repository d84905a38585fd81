// defines: the per-area binding entry points called from module.cpp.
// Each lives in its own file: errors.cpp, dist.cpp, nn.cpp, train.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace cx::bindings {
namespace py = pybind11;

void bind_errors(py::module_& m);
void bind_dist(py::module_& m);   // m is _core.dist
void bind_nn(py::module_& m);     // m is _core
void bind_train(py::module_& m);  // m is _core.dist

}  // namespace cx::bindings
