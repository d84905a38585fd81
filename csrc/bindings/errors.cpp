// The one place where C++ errors become Python exceptions.
#include <Python.h>

#include "bindings/bindings.h"
#include "common/error.h"
#include "train/ddp.h"

namespace cx::bindings {

namespace {
PyObject* g_base = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_connection = nullptr;
PyObject* g_mismatch = nullptr;
PyObject* g_nonfinite = nullptr;

PyObject* new_exception(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string qual = std::string("pycyxwiz.distributed.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(qual.c_str(), doc, bases, nullptr);
  if (!t) throw py::error_already_set();
  m.add_object(name, py::handle(t));
  return t;
}
}  // namespace

void bind_errors(py::module_& m) {
  g_base = new_exception(m, "DistributedError", PyExc_RuntimeError,
                         "Base class of every error raised by pycyxwiz's distributed layer.");
  g_timeout = new_exception(m, "DistributedTimeoutError",
                            py::make_tuple(py::handle(g_base), py::handle(PyExc_TimeoutError)).release().ptr(),
                            "A wait ran past its deadline (timeout_ms in init(), operation_timeout_ms in a collective).");
  g_connection = new_exception(m, "DistributedConnectionError",
                               py::make_tuple(py::handle(g_base), py::handle(PyExc_ConnectionError)).release().ptr(),
                               "A peer could not be reached, closed its connection or died.");
  g_mismatch = new_exception(m, "CollectiveMismatchError",
                             py::make_tuple(py::handle(g_base), py::handle(PyExc_ValueError)).release().ptr(),
                             "Ranks called different collectives (kind, count, dtype, op or root).");
  g_nonfinite = new_exception(m, "NonFiniteError",
                              py::make_tuple(py::handle(g_base), py::handle(PyExc_FloatingPointError)).release().ptr(),
                              "A loss, gradient or layer output that is NaN or infinite, named where it arose: the "
                              "step, parameters and ranks (DDPConfig.nonfinite), the epoch, batch and rows (fit), or "
                              "the layer (detect_anomaly).");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cx::Error& e) {
      switch (e.kind()) {
        case ErrorKind::kTimeout: PyErr_SetString(g_timeout, e.what()); return;
        case ErrorKind::kConnection:
        case ErrorKind::kPeerFailed: PyErr_SetString(g_connection, e.what()); return;
        case ErrorKind::kMismatch: PyErr_SetString(g_mismatch, e.what()); return;
        case ErrorKind::kInvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case ErrorKind::kType: PyErr_SetString(PyExc_TypeError, e.what()); return;
        case ErrorKind::kIo: PyErr_SetString(PyExc_OSError, e.what()); return;
        case ErrorKind::kNonFinite: PyErr_SetString(g_nonfinite, e.what()); return;
        default: PyErr_SetString(g_base, e.what()); return;
      }
    }
  });
}

void warn_nonfinite(train::DistributedDataParallel& d) {
  const std::string msg = d.take_warning();
  if (!msg.empty() && PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) < 0) throw py::error_already_set();
}

}  // namespace cx::bindings
