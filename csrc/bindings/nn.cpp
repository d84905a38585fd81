// Model stack bindings (issue 3). Filled in by the nn work.
#include "bindings/bindings.h"

namespace cx::bindings {
void bind_nn(py::module_& m) {}
}  // namespace cx::bindings
