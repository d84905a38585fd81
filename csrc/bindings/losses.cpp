// Bindings of the losses: CrossEntropyLoss (integer labels or float32 one-hot targets), MSELoss, BCEWithLogitsLoss.
#include <pybind11/stl.h>

#include "bindings/arrays.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "nn/loss.h"

namespace cx::bindings {

using namespace cx::nn;

namespace {

// Loss.backward(scale=1.0): a new array, dL/d(output) times scale.
template <typename L>  // each loss class (Loss itself is not bound)
py::array_t<float> backward_of(const L& l, float scale) {
  const Shape& shape = l.backward().shape();
  py::array_t<float> out(std::vector<py::ssize_t>(shape.begin(), shape.end()));
  l.backward_into(out.mutable_data(), scale);
  return out;
}

constexpr const char* kBackwardDoc =
    "dL/d(output) of the last forward, times `scale`: a new array.\n\n"
    "    ddp.backward(loss_fn.backward(1 / accumulation_steps))   # k micro-batches add up to the big batch's\n\n"
    "Without autograd, dividing the float that forward() returns changes no gradient: pass the scale here.";

// Loss targets: dense float32 of the output's shape.
py::array dense_target(py::handle t, const char* who) { return float_input(t, who, "(batch, ...) like the output", 1); }

// CrossEntropyLoss.forward: the target's dtype picks the overload (int64 / int32 labels, float32 one-hot).
float cross_entropy_forward(CrossEntropyLoss& loss, py::handle out, py::handle target) {
  auto o = float_input(out, "CrossEntropyLoss.forward", "(batch, classes)");
  Shape os = shape_of(o);
  const float* op = static_cast<const float*>(o.data());
  if (py::isinstance<py::array>(target)) {
    auto t = py::reinterpret_borrow<py::array>(target);
    bool i64 = py::dtype::of<int64_t>().equal(t.dtype()), i32 = py::dtype::of<int32_t>().equal(t.dtype());
    if (i64 || i32) {
      CX_CHECK(t.ndim() == 1, InvalidArgument,
               "CrossEntropyLoss.forward: integer labels must have shape (batch,), got ", shape_str(shape_of(t)));
      CX_CHECK(t.flags() & py::array::c_style, InvalidArgument,
               "CrossEntropyLoss.forward: labels must be C-contiguous");
      size_t n = static_cast<size_t>(t.shape(0));
      py::gil_scoped_release nogil;
      return i64 ? loss.forward(op, os, static_cast<const int64_t*>(t.data()), n)
                 : loss.forward(op, os, static_cast<const int32_t*>(t.data()), n);
    }
    if (py::dtype::of<float>().equal(t.dtype())) {
      auto tt = float_input(t, "CrossEntropyLoss.forward", "(batch, classes)", 1);
      py::gil_scoped_release nogil;
      return loss.forward(op, os, static_cast<const float*>(tt.data()), shape_of(tt));
    }
  }
  CX_THROW(TypeMismatch,
           "CrossEntropyLoss.forward: target must be int32/int64 labels of shape (batch,) or float32 one-hot of "
           "shape (batch, classes), got ",
           describe(target));
}

// forward(output, target) of a loss whose targets are dense float32 like the output (MSELoss, BCEWithLogitsLoss).
template <typename L>
float dense_forward(L& loss, py::handle out, py::handle target, const char* who) {
  auto o = float_input(out, who, "(batch, ...)", 1);
  auto t = dense_target(target, who);
  py::gil_scoped_release nogil;
  return loss.forward(static_cast<const float*>(o.data()), shape_of(o), static_cast<const float*>(t.data()),
                      shape_of(t));
}

}  // namespace

void bind_losses(py::module_& m) {
  shared_class<CrossEntropyLoss>(m, "CrossEntropyLoss",
                                 "Softmax cross-entropy on logits, mean over the batch. Targets: int32/int64 labels "
                                 "of shape (batch,) or float32 one-hot of shape (batch, classes).")
      .def(py::init<>())
      .def("forward", &cross_entropy_forward, py::arg("output"), py::arg("target"), "Returns the mean loss.")
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", &backward_of<CrossEntropyLoss>, py::arg("scale") = 1.0f, kBackwardDoc)
      .def("accuracy", &CrossEntropyLoss::accuracy, "Fraction of rows of the last forward classified correctly.")
      .def("correct", &CrossEntropyLoss::correct, "Rows of the last forward classified correctly.")
      .def("__repr__", &CrossEntropyLoss::repr);

  shared_class<MSELoss>(m, "MSELoss", "Mean of (output - target)^2 over all elements.")
      .def(py::init<>())
      .def(
          "forward",
          [](MSELoss& loss, py::handle out, py::handle target) {
            return dense_forward(loss, out, target, "MSELoss.forward");
          },
          py::arg("output"), py::arg("target"))
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", &backward_of<MSELoss>, py::arg("scale") = 1.0f, kBackwardDoc)
      .def("__repr__", &MSELoss::repr);

  shared_class<BCEWithLogitsLoss>(m, "BCEWithLogitsLoss",
                                  "Binary cross-entropy on logits (stable), mean over all elements.")
      .def(py::init<>())
      .def(
          "forward",
          [](BCEWithLogitsLoss& loss, py::handle out, py::handle target) {
            return dense_forward(loss, out, target, "BCEWithLogitsLoss.forward");
          },
          py::arg("output"), py::arg("target"))
      .def("__call__", [](py::object self, py::handle o, py::handle t) { return self.attr("forward")(o, t); })
      .def("backward", &backward_of<BCEWithLogitsLoss>, py::arg("scale") = 1.0f, kBackwardDoc)
      .def("__repr__", &BCEWithLogitsLoss::repr);
}

}  // namespace cx::bindings
