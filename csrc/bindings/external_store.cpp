// A Python key-value store (PyTorch's Store: set(key, bytes), check([key]) -> bool, get(key) -> bytes) as the
// core's KeyValue, so a process group can meet its peers through it (Note [Rendezvous through a framework's
// store] in distributed/store/external_store.h). The core calls it from any thread with the GIL released: each
// call takes the GIL for itself, and fails (never blocks) once the interpreter is exiting.
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/error.h"
#include "distributed/store/external_store.h"

namespace cx::bindings {

namespace {

bool interpreter_exiting() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

class PyKeyValue : public distributed::KeyValue {
 public:
  explicit PyKeyValue(py::object store) : store_(std::move(store)) {}
  ~PyKeyValue() override {
    if (interpreter_exiting()) {
      store_.release();  // the interpreter frees what is left
      return;
    }
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  void set(const std::string& key, const std::string& value) override {
    call("set", [&] { store_.attr("set")(key, py::bytes(value)); });
  }

  std::optional<std::string> get_if_set(const std::string& key) override {
    std::optional<std::string> out;
    call("get", [&] {
      py::list keys;
      keys.append(key);
      if (store_.attr("check")(keys).cast<bool>()) out = store_.attr("get")(key).cast<std::string>();
    });
    return out;
  }

 private:
  template <typename F>
  void call(const char* what, F&& f) {
    if (interpreter_exiting()) CX_THROW(ConnectionError, "the store cannot be reached: the interpreter is exiting");
    py::gil_scoped_acquire gil;
    try {
      f();
    } catch (py::error_already_set& e) {
      const std::string msg = e.what();
      CX_THROW(ConnectionError, "the process group's store failed in ", what, "(): ", msg);
    }
  }

  py::object store_;
};

}  // namespace

std::unique_ptr<distributed::Store> external_store(py::object store, const std::string& ip, int rank) {
  for (const char* m : {"set", "check", "get"}) {
    if (!py::hasattr(store, m)) {
      CX_THROW(TypeMismatch, "the store must have set(key, value), check(keys) and get(key) (a torch.distributed "
               "Store), but ", std::string(py::str(py::type::of(store).attr("__name__"))), " has no ", m, "()");
    }
  }
  return std::make_unique<distributed::ExternalStore>(std::make_shared<PyKeyValue>(std::move(store)), ip, rank);
}

}  // namespace cx::bindings
