#include "bindings/bindings.h"
namespace cx::bindings {
void bind_dist(py::module_& m) {}
}
