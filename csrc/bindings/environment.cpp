// Bindings of the environment-variable table (common/env.h), for the README's table and its tests.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/env.h"

namespace cx::bindings {

void bind_environment(py::module_& m) {
  m.def(
      "_environment_variables",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const auto& v : env::variables()) out.emplace_back(v.name, v.meaning, v.default_value);
        return out;
      },
      "Every environment variable pycyxwiz reads: (name, meaning, default).");
  m.def(
      "_env_get", [](const std::string& name) { return env::get(name.c_str()); }, py::arg("name"),
      "For tests: the core's reading of one variable (None when unset).");
}

}  // namespace cx::bindings
