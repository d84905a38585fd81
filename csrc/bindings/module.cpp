#include "bindings/bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "pycyxwiz C++ core: collectives (dist), model stack (nn), training (train)";
  cx::bindings::bind_errors(m);
  auto dist = m.def_submodule("dist", "process group and collectives");
  cx::bindings::bind_dist(dist);
  cx::bindings::bind_nn(m);
  cx::bindings::bind_train(dist);
}
