#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/env.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "pycyxwiz C++ core: collectives (dist), model stack (nn), training (train)";
  cx::bindings::bind_errors(m);
  auto dist = m.def_submodule("dist", "process group and collectives");
  cx::bindings::bind_dist(dist);
  cx::bindings::bind_nn(m);
  cx::bindings::bind_train(dist);
  m.def(
      "_environment_variables",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const auto& v : cx::env::variables()) out.emplace_back(v.name, v.meaning, v.default_value);
        return out;
      },
      "Every environment variable pycyxwiz reads: (name, meaning, default).");
  m.def(
      "_env_get", [](const std::string& name) { return cx::env::get(name.c_str()); }, py::arg("name"),
      "For tests: the core's reading of one variable (None when unset).");
}
