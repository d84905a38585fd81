// Training bindings (issue 4): DDP, sampler, batch iterator, trainer.
#include "bindings/bindings.h"

namespace cx::bindings {
void bind_train(py::module_& m) {}
}  // namespace cx::bindings
