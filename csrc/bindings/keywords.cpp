// The keyword front of the collectives (Note [Keyword arguments before pybind11's dispatcher] in keywords.h).
#include "bindings/keywords.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cx::bindings {

namespace {

constexpr size_t kMaxParams = 8;

struct Front {
  py::object inner;              // the pybind11 function
  std::vector<py::object> names;  // the parameters' names, interned
  std::vector<py::object> dflt;   // their defaults; null: required
  std::string name, doc;
  PyMethodDef def{};
};

// Where the call's keyword `key` goes among the parameters from `first` on, or -1.
Py_ssize_t slot_of(const Front& f, PyObject* key, size_t first) {
  for (size_t i = first; i < f.names.size(); ++i) {
    if (key == f.names[i].ptr()) return static_cast<Py_ssize_t>(i);
  }
  for (size_t i = first; i < f.names.size(); ++i) {  // a name built at run time: compare the text
    if (PyUnicode_Compare(key, f.names[i].ptr()) == 0) return static_cast<Py_ssize_t>(i);
  }
  PyErr_Clear();  // PyUnicode_Compare on a non-str key; the pybind11 function reports it
  return -1;
}

// `nargs` positional arguments, then one per name in `kwnames` (METH_FASTCALL | METH_KEYWORDS).
PyObject* front_call(const Front* f, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  const size_t np = f->names.size();
  const auto as_called = [&] {
    return PyObject_Vectorcall(f->inner.ptr(), args, static_cast<size_t>(nargs), kwnames);
  };
  if (nkw == 0 || nargs > static_cast<Py_ssize_t>(np)) return as_called();
  PyObject* slot[kMaxParams] = {};
  std::copy(args, args + nargs, slot);
  size_t used = static_cast<size_t>(nargs);
  bool plain = true;
  for (Py_ssize_t k = 0; k < nkw && plain; ++k) {
    const Py_ssize_t j = slot_of(*f, PyTuple_GET_ITEM(kwnames, k), static_cast<size_t>(nargs));
    plain = j >= 0 && !slot[j];
    if (plain) {
      slot[j] = args[nargs + k];
      used = std::max(used, static_cast<size_t>(j) + 1);
    }
  }
  for (size_t i = 0; i < used && plain; ++i) {
    if (!slot[i]) {
      plain = static_cast<bool>(f->dflt[i]);
      slot[i] = f->dflt[i].ptr();
    }
  }
  if (!plain) return as_called();  // its TypeError
  return PyObject_Vectorcall(f->inner.ptr(), slot, used, nullptr);
}

// Each front is a C function of its own, so that its self can be null: Python shows it as the
// <built-in function all_reduce> it replaces.
constexpr size_t kMaxFronts = 16;
Front* fronts[kMaxFronts];
size_t n_fronts = 0;

template <size_t I>
PyObject* call_front(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return front_call(fronts[I], args, nargs, kwnames);
}

template <size_t... I>
constexpr auto make_table(std::index_sequence<I...>) {
  return std::array<PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*), sizeof...(I)>{&call_front<I>...};
}
constexpr auto kCalls = make_table(std::make_index_sequence<kMaxFronts>{});

}  // namespace

void keyword_front(py::module_& m, const char* name, std::initializer_list<Param> params) {
  if (params.size() > kMaxParams || n_fronts == kMaxFronts) throw std::logic_error("keyword_front: too many");
  auto* f = new Front;  // lives as long as the process: the module's functions do
  const size_t index = n_fronts++;
  fronts[index] = f;
  f->inner = m.attr(name);
  f->name = name;
  f->doc = py::str(f->inner.attr("__doc__"));
  for (const Param& p : params) {
    f->names.push_back(py::reinterpret_steal<py::object>(PyUnicode_InternFromString(p.name)));
    f->dflt.push_back(p.dflt);
  }
  f->def.ml_name = f->name.c_str();
  f->def.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(kCalls[index]));
  f->def.ml_flags = METH_FASTCALL | METH_KEYWORDS;
  f->def.ml_doc = f->doc.c_str();
  py::object module_name = m.attr("__name__");
  auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&f->def, nullptr, module_name.ptr()));
  if (!fn) throw py::error_already_set();
  m.attr(name) = fn;
}

}  // namespace cx::bindings
