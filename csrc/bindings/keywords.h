// defines: keyword_front, which puts a cheap keyword-argument parser in front of a bound function: the
// collectives' calls with op=..., async_op=... (Note [Keyword arguments before pybind11's dispatcher]).
#pragma once

#include <initializer_list>

#include "bindings/bindings.h"

namespace cx::bindings {

// Note [Keyword arguments before pybind11's dispatcher]
// pybind11 3's dispatcher matches each keyword argument of a call by interning the parameter's name
// (PyUnicode_InternFromString: a new string and a dict lookup) for every parameter the caller did not pass
// by position, on every call. For cx.distributed.all_reduce(x, op=ReduceOp.AVG) that cost 240 ns of a
// 585 ns call on one rank (344 ns with op passed by position; measured with timeit, world 1), a fifth of an
// 8-byte all_reduce between two ranks. So the collectives' module functions are replaced by a front that
// reads the keywords itself, comparing the call's keyword names with the parameters' names interned once
// (the names a caller writes in source are interned too, so a pointer comparison finds them), puts every
// argument in its place with the parameter's default in the gaps, and calls the pybind11 function with
// positional arguments only. Anything it does not recognise (an unknown or repeated keyword, too many
// arguments) goes to the pybind11 function as it came, which raises its usual TypeError. Conversions,
// errors and the docstring are the pybind11 function's.

// One parameter of the front: its name and its default (a null object: required).
struct Param {
  const char* name;
  py::object dflt;
};

// Replaces m.<name> (a pybind11 function) with the front described above; `params` in the function's order.
void keyword_front(py::module_& m, const char* name, std::initializer_list<Param> params);

}  // namespace cx::bindings
