// The conversions of arrays.h. No algorithm here: each function checks one Python object and describes it to C++.
#include "bindings/arrays.h"

#include <cstring>
#include <map>

#include "common/error.h"
#include "train/trainer.h"

namespace cx::bindings {

using distributed::DataType;

namespace {

// The reducible dtype of an array, from its descriptor's kind and size (cheap:
// this runs on every call); ml_dtypes' bfloat16 (kind 'V') is recognised by
// name. nullopt: not reducible (moved as bytes).
std::optional<DataType> reducible_dtype(const py::dtype& d) {
  const char kind = d.kind();
  const auto size = d.itemsize();
  switch (kind) {
    case 'f':
      if (size == 4) return DataType::kFloat32;
      if (size == 8) return DataType::kFloat64;
      if (size == 2) return DataType::kFloat16;
      break;
    case 'i':
      if (size == 4) return DataType::kInt32;
      if (size == 8) return DataType::kInt64;
      if (size == 1) return DataType::kInt8;
      break;
    case 'u':
      if (size == 1) return DataType::kUInt8;
      break;
    case 'b': return DataType::kBool;
    case 'V':
      if (size == 2 && std::string(py::str(d.attr("name"))) == "bfloat16") return DataType::kBFloat16;
      break;
    default: break;
  }
  return std::nullopt;
}

bool is_gpu_array(const py::handle& obj) { return py::hasattr(obj, "__cuda_array_interface__"); }
// The object's __cuda_array_interface__, or None where it has none. Read once per call: CuPy
// builds the dict anew on every read, which costs a microsecond.
py::object cuda_interface(const py::handle& obj) {
  PyObject* r = PyObject_GetAttrString(obj.ptr(), "__cuda_array_interface__");
  if (!r) {
    PyErr_Clear();
    return py::none();
  }
  return py::reinterpret_steal<py::object>(r);
}
py::object numpy_dtype(const std::string& name);
bool is_dlpack(const py::handle& obj) {
  return PyCapsule_CheckExact(obj.ptr()) || py::hasattr(obj, "__dlpack__");
}
// What NumPy can view without a copy: an ndarray, anything with the buffer protocol
// (memoryview, array.array, bytearray, ...) or the array interface. Objects that only
// have __array__ (a torch.Tensor, say) may hand NumPy a copy, and a collective that
// writes its result into a copy loses it: those are refused (not_an_array).
bool is_host_array(const py::handle& obj) {
  return py::isinstance<py::array>(obj) || PyObject_CheckBuffer(obj.ptr()) ||
         py::hasattr(obj, "__array_interface__");
}
// The ndarray viewing a host array's memory (see is_host_array). Buffers go through a
// memoryview: np.asarray(b"ab") would make a new 0-d string array, not a view.
py::array host_array(const py::handle& obj) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  auto asarray = py::module_::import("numpy").attr("asarray");
  if (PyObject_CheckBuffer(obj.ptr())) return asarray(py::memoryview(py::reinterpret_borrow<py::object>(obj)));
  return asarray(obj);
}
std::string type_name(const py::handle& obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// Refuses what cannot travel between processes as its bytes: Python objects
// (pointers, meaningless in another process; the receiver would crash reading
// them) and non-native byte order (reduced as if native, it gives wrong numbers
// without an error; moved, a peer with the native type would misread it).
void check_transferable(const py::dtype& d, const char* what) {
  constexpr uint64_t kHasObject = 0x01;  // NPY_ITEM_HASOBJECT: the dtype holds PyObject pointers
  if (d.flags() & kHasObject) {
    CX_THROW(TypeMismatch, what, " has dtype ", std::string(py::str(d)), ", which holds pointers to Python "
             "objects; they mean nothing in another process. Send bytes instead: pickle on your side, "
             "e.g. np.frombuffer(pickle.dumps(obj), np.uint8) (send its length first)");
  }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  constexpr char kForeign = '>';
#else
  constexpr char kForeign = '<';
#endif
  bool native = d.byteorder() != kForeign;
  if (native && d.has_fields()) native = d.attr("isnative").cast<bool>();  // byteorder is '|' for records
  if (!native) {
    CX_THROW(TypeMismatch, what, " has dtype ", std::string(py::str(d)), ", whose byte order is not this machine's: "
             "pass arr.astype(arr.dtype.newbyteorder('=')) (and use that array afterwards)");
  }
}

// Fills dt/count from the dtype (or the bfloat16 override); `natural`: the array's own reducible type, where the
// caller knows it (DLPack), else read from v.dtype.
void set_dtype(View& v, size_t itemsize, const char* what, bool reduce,
               const std::optional<std::string>& dtype_override, std::optional<DataType> natural = std::nullopt) {
  std::optional<DataType> dt;
  if (dtype_override) {
    if (*dtype_override != "bfloat16") {
      CX_THROW(InvalidArgument, "dtype='", *dtype_override, "' is not supported: the only override is 'bfloat16' "
                                "(for bfloat16 values stored in a uint16 array)");
    }
    if (itemsize != 2) {
      CX_THROW(TypeMismatch, "dtype='bfloat16' needs a 2-byte array (uint16 storage), got itemsize ", itemsize);
    }
    dt = DataType::kBFloat16;
  } else if (natural) {
    dt = natural;
  } else {
    dt = reducible_dtype(py::reinterpret_borrow<py::dtype>(v.dtype));
  }
  if (dt) {
    v.dt = *dt;
    v.count = v.size;
  } else if (reduce) {
    CX_THROW(TypeMismatch, what, " has dtype ", v.dtype_name(), ", which cannot be reduced: use float32, float64, "
             "float16, bfloat16 (ml_dtypes, or uint16 storage with dtype='bfloat16'), int32, int64, int8, uint8 or "
             "bool");
  } else {
    v.dt = DataType::kBytes;  // moved, never combined: any dtype works
    v.count = v.nbytes;
  }
}

const char* kContiguous = " must be C-contiguous (collectives work in place on the array's memory): ";

View numpy_view(const py::handle& obj, const char* what, bool writable, bool reduce,
                const std::optional<std::string>& dtype_override) {
  View v;
  py::array arr = host_array(obj);
  v.obj = arr;
  check_transferable(arr.dtype(), what);
  if (!(arr.flags() & py::array::c_style)) {
    CX_THROW(InvalidArgument, what, kContiguous, "pass numpy.ascontiguousarray(a) and use that array afterwards");
  }
  if (writable && !arr.writeable()) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  v.ptr = const_cast<void*>(arr.data());
  v.size = static_cast<size_t>(arr.size());
  v.nbytes = static_cast<size_t>(arr.nbytes());
  v.dtype = arr.dtype();
  for (py::ssize_t i = 0; i < arr.ndim(); ++i) v.shape.push_back(arr.shape(i));
  set_dtype(v, static_cast<size_t>(arr.itemsize()), what, reduce, dtype_override);
  return v;
}

// A GPU array's dtype as its typestr says it ('<f4'): the NumPy dtype and item size, looked up once each.
struct TypestrInfo {
  py::object dtype;
  size_t itemsize;
};
const TypestrInfo& typestr_info(const std::string& typestr) {
  static auto* known = new std::map<std::string, TypestrInfo>();  // never freed: the interpreter outlives it
  auto it = known->find(typestr);
  if (it == known->end()) {
    py::object d = numpy_dtype(typestr);
    it = known->emplace(typestr, TypestrInfo{d, d.attr("itemsize").cast<size_t>()}).first;
  }
  return it->second;  // a map's entries stay where they are
}

// __cuda_array_interface__ (versions 0..3): shape, typestr, data=(ptr, readonly),
// strides (None: C-contiguous), mask (must be None), stream (v3; None: no sync).
// Read through the C API with keys made once: this runs on every GPU
// collective, and pybind11's accessors (a new key string per lookup, a cast
// per element) cost more than the NCCL call itself (3 us against 0.3 at 1 KiB).
View gpu_view(const py::handle& obj, const py::object& interface, const char* what, bool writable, bool reduce,
              const std::optional<std::string>& dtype_override) {
  View v;
  v.obj = py::reinterpret_borrow<py::object>(obj);
  if (!PyDict_Check(interface.ptr())) {
    CX_THROW(TypeMismatch, what, " has an invalid __cuda_array_interface__ (a dict is required)");
  }
  auto bad = [&](const std::string& why) {
    CX_THROW(TypeMismatch, what, " has an invalid __cuda_array_interface__ (", why, ")");
  };
  static PyObject* const k_shape = PyUnicode_InternFromString("shape");
  static PyObject* const k_typestr = PyUnicode_InternFromString("typestr");
  static PyObject* const k_data = PyUnicode_InternFromString("data");
  static PyObject* const k_strides = PyUnicode_InternFromString("strides");
  static PyObject* const k_mask = PyUnicode_InternFromString("mask");
  static PyObject* const k_stream = PyUnicode_InternFromString("stream");
  PyObject* const cai = interface.ptr();
  auto get = [&](PyObject* key) -> PyObject* {  // borrowed; null where absent or None
    PyObject* x = PyDict_GetItem(cai, key);
    return x == Py_None ? nullptr : x;
  };
  // An int, or a TypeMismatch naming the field.
  auto integer = [&](PyObject* x, const char* field) -> long long {
    long long n = x && PyLong_Check(x) ? PyLong_AsLongLong(x) : -1;
    if (!x || !PyLong_Check(x) || (n == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      bad(std::string(field) + " must hold integers");
    }
    return n;
  };
  auto address = [&](PyObject* x, const char* field) -> uintptr_t {  // a pointer or a stream handle
    unsigned long long n = x && PyLong_Check(x) ? PyLong_AsUnsignedLongLong(x) : 0;
    if (!x || !PyLong_Check(x) || PyErr_Occurred()) {
      PyErr_Clear();
      bad(std::string(field) + " must be a non-negative integer");
    }
    return static_cast<uintptr_t>(n);
  };
  PyObject* shape = get(k_shape);
  PyObject* typestr = get(k_typestr);
  PyObject* data = get(k_data);
  if (!shape || !typestr || !data) bad("shape, typestr and data are required");
  if (get(k_mask)) CX_THROW(TypeMismatch, what, " is a masked GPU array; collectives need plain arrays");
  if (!PyTuple_Check(shape)) bad("shape must be a tuple");
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i)
    v.shape.push_back(integer(PyTuple_GET_ITEM(shape, i), "shape"));
  Py_ssize_t len = 0;
  const char* ts = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8AndSize(typestr, &len) : nullptr;
  if (!ts) {
    PyErr_Clear();
    bad("typestr must be a str");
  }
  const std::string typestr_s(ts, static_cast<size_t>(len));
  const TypestrInfo& info = typestr_info(typestr_s);
  const size_t itemsize = info.itemsize;
  if (typestr_s.size() < 3 || (typestr_s[0] == '>' && itemsize > 1)) {
    CX_THROW(TypeMismatch, what, " has typestr '", typestr_s, "': only little-endian GPU arrays are supported");
  }
  v.dtype = info.dtype;
  if (!PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2) bad("data must be (pointer, read_only)");
  v.ptr = reinterpret_cast<void*>(address(PyTuple_GET_ITEM(data, 0), "data's pointer"));
  if (writable && PyObject_IsTrue(PyTuple_GET_ITEM(data, 1)) == 1) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  v.size = 1;
  for (int64_t d : v.shape) v.size *= static_cast<size_t>(d);
  v.nbytes = v.size * itemsize;
  if (PyObject* strides = get(k_strides)) {
    if (!PyTuple_Check(strides) || static_cast<size_t>(PyTuple_GET_SIZE(strides)) != v.shape.size()) {
      bad("strides and shape differ in length");
    }
    int64_t expect = static_cast<int64_t>(itemsize);
    for (size_t i = v.shape.size(); i-- > 0;) {
      if (v.shape[i] > 1 && integer(PyTuple_GET_ITEM(strides, static_cast<Py_ssize_t>(i)), "strides") != expect) {
        CX_THROW(InvalidArgument, what, kContiguous, "pass cupy.ascontiguousarray(a) and use that array afterwards");
      }
      expect *= v.shape[i];
    }
  }
  if (PyObject* stream = get(k_stream)) v.stream = address(stream, "stream");
  set_dtype(v, itemsize, what, reduce, dtype_override);
  return v;
}

// Note [CuPy arrays without their interface]
// CuPy builds __cuda_array_interface__ anew on every read (a dict of six entries, the current stream looked up):
// 0.6 us on an H100 host, more than NCCL's own launch of a small all-reduce (0.2 us). A cupy.ndarray (that exact
// type) is read instead through the attributes the interface is made of: data.ptr, dtype, shape, _c_contiguous,
// and cupy.cuda.stream.get_current_stream_ptr() for its stream (0, the legacy default stream, reads as 1 in the
// interface, which stream_of takes for the same stream). The result is the interface's: a size-0 array's
// pointer is 0, a CuPy array is never read-only. Anything else (a subclass, a non-contiguous array, whose error
// the interface path words, a CuPy without these names) takes the interface.
namespace {
struct CupyNames {
  PyTypeObject* ndarray = nullptr;    // cupy.ndarray, exactly
  PyObject* current_stream = nullptr;  // cupy.cuda.stream.get_current_stream_ptr
};
const CupyNames* cupy_names() {
  static CupyNames* names = nullptr;  // never freed: the interpreter outlives it
  static bool looked = false;
  if (looked) return names;
  PyObject* mods = PyImport_GetModuleDict();
  PyObject* cupy = PyDict_GetItemString(mods, "cupy");              // borrowed; CuPy imported by the user
  PyObject* stream = PyDict_GetItemString(mods, "cupy.cuda.stream");
  if (!cupy || !stream) return nullptr;  // look again next time: CuPy may be imported later
  looked = true;
  PyObject* nd = PyObject_GetAttrString(cupy, "ndarray");
  PyObject* cur = PyObject_GetAttrString(stream, "get_current_stream_ptr");
  if (nd && PyType_Check(nd) && cur && PyCallable_Check(cur)) {
    names = new CupyNames{reinterpret_cast<PyTypeObject*>(nd), cur};
  } else {
    Py_XDECREF(nd);
    Py_XDECREF(cur);
  }
  PyErr_Clear();
  return names;
}
}  // namespace

// Fills v from a cupy.ndarray's attributes; false (v untouched) where the interface must be read instead.
bool cupy_view(const py::handle& obj, View& v, const char* what, bool reduce,
               const std::optional<std::string>& dtype_override) {
  const CupyNames* names = cupy_names();
  if (!names || Py_TYPE(obj.ptr()) != names->ndarray) return false;
  static PyObject* const k_data = PyUnicode_InternFromString("data");
  static PyObject* const k_ptr = PyUnicode_InternFromString("ptr");
  static PyObject* const k_dtype = PyUnicode_InternFromString("dtype");
  static PyObject* const k_shape = PyUnicode_InternFromString("shape");
  static PyObject* const k_contiguous = PyUnicode_InternFromString("_c_contiguous");
  auto get = [&](PyObject* o, PyObject* name) { return py::reinterpret_steal<py::object>(PyObject_GetAttr(o, name)); };
  py::object contiguous = get(obj.ptr(), k_contiguous);
  py::object shape = get(obj.ptr(), k_shape);
  py::object dtype = get(obj.ptr(), k_dtype);
  py::object data = get(obj.ptr(), k_data);
  py::object ptr = data ? get(data.ptr(), k_ptr) : py::object();
  py::object stream = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(names->current_stream));
  if (!contiguous || !shape || !dtype || !ptr || !stream || contiguous.ptr() != Py_True ||
      !PyTuple_Check(shape.ptr()) || !PyLong_Check(ptr.ptr()) || !PyLong_Check(stream.ptr())) {
    PyErr_Clear();
    return false;
  }
  // Each dtype object's typestr_info, found once (NumPy's dtypes of plain types are singletons); the dtype is
  // held, so its address cannot come back as another's.
  static auto* seen = new std::vector<std::pair<py::object, const TypestrInfo*>>();  // never freed, as above
  const TypestrInfo* k = nullptr;
  for (const auto& [d, info] : *seen) {
    if (d.ptr() == dtype.ptr()) k = info;
  }
  if (!k) {
    const std::string typestr = py::str(dtype.attr("str"));
    if (typestr.size() < 3 || typestr[0] == '>') return false;  // the interface's path words the error
    k = &typestr_info(typestr);
    seen->emplace_back(dtype, k);
  }
  View out;
  out.obj = py::reinterpret_borrow<py::object>(obj);
  out.dtype = k->dtype;
  out.size = 1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape.ptr()); ++i) {
    PyObject* d = PyTuple_GET_ITEM(shape.ptr(), i);
    const long long n = PyLong_AsLongLong(d);
    if (n < 0) {
      PyErr_Clear();
      return false;
    }
    out.shape.push_back(n);
    out.size *= static_cast<size_t>(n);
  }
  out.nbytes = out.size * k->itemsize;
  out.ptr = out.size ? reinterpret_cast<void*>(PyLong_AsUnsignedLongLong(ptr.ptr())) : nullptr;
  const long long s = PyLong_AsLongLong(stream.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  out.stream = static_cast<uintptr_t>(s == 0 ? 1 : s);  // as the interface says it (v3: 0 is not allowed)
  set_dtype(out, k->itemsize, what, reduce, dtype_override);
  v = std::move(out);
  return true;
}

// ---- DLPack ---------------------------------------------------------------------------------------------------
//
// The structs of the DLPack ABI (dlpack.h, v0.8 and v1.x; only what we read): a producer's __dlpack__() returns a
// capsule named "dltensor" (DLManagedTensor) or, when asked with max_version=(1, 0), "dltensor_versioned"
// (DLManagedTensorVersioned, whose flags say read-only). The consumer renames the capsule "used_..." and owns the
// tensor from then on: it calls the deleter when done, which here is when the View's `obj` (a capsule of ours)
// goes, so the producer's memory lives as long as the collective needs it.
namespace dl {
struct Device { int32_t type; int32_t id; };
struct DType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: C-contiguous
  uint64_t byte_offset;
};
struct Managed { Tensor t; void* ctx; void (*deleter)(Managed*); };
struct Version { uint32_t major; uint32_t minor; };
struct ManagedVersioned { Version version; void* ctx; void (*deleter)(ManagedVersioned*); uint64_t flags; Tensor t; };
constexpr int32_t kCpu = 1, kCuda = 2, kCudaHost = 3;
constexpr uint8_t kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kBool = 6;
constexpr uint64_t kReadOnly = 1;
}  // namespace dl

const char* device_name(int32_t type) {
  switch (type) {
    case dl::kCpu: return "the CPU";
    case dl::kCuda: return "a CUDA GPU";
    case dl::kCudaHost: return "pinned host memory";
    case 4: return "an OpenCL device";
    case 7: return "a Vulkan device";
    case 8: return "a Metal device";
    case 10: return "a ROCm GPU";
    case 14: return "a oneAPI device";
    default: return "a device of DLPack type";
  }
}

// The array's elements as NumPy names them (bfloat16: "" as NumPy has none), and its reducible type.
std::pair<std::string, std::optional<DataType>> dl_dtype(const dl::DType& t, const char* what) {
  if (t.lanes != 1) CX_THROW(TypeMismatch, what, " has vector elements (DLPack lanes=", t.lanes, "): not supported");
  const int b = t.bits;
  switch (t.code) {
    case dl::kFloat:
      if (b == 16) return {"float16", DataType::kFloat16};
      if (b == 32) return {"float32", DataType::kFloat32};
      if (b == 64) return {"float64", DataType::kFloat64};
      break;
    case dl::kBfloat:
      if (b == 16) return {"", DataType::kBFloat16};
      break;
    case dl::kInt:
      if (b == 8) return {"int8", DataType::kInt8};
      if (b == 16) return {"int16", std::nullopt};
      if (b == 32) return {"int32", DataType::kInt32};
      if (b == 64) return {"int64", DataType::kInt64};
      break;
    case dl::kUInt:
      if (b == 8) return {"uint8", DataType::kUInt8};
      if (b == 16 || b == 32 || b == 64) return {"uint" + std::to_string(b), std::nullopt};
      break;
    case dl::kBool:
      if (b == 8) return {"bool", DataType::kBool};
      break;
    default: break;
  }
  CX_THROW(TypeMismatch, what, " has a DLPack element type (code ", int(t.code), ", ", b,
           " bits) that cannot be sent: convert it to a standard dtype first");
}

// NumPy's dtype object for `name`, made once per name (this runs on every call of a collective on a tensor).
py::object numpy_dtype(const std::string& name) {
  static auto* cache = new std::map<std::string, py::object>();  // never freed: the interpreter outlives it
  auto it = cache->find(name);
  if (it == cache->end()) it = cache->emplace(name, py::dtype(name)).first;
  return it->second;
}

// Makes v.obj own the managed tensor `m` (its deleter runs when v.obj goes); returns its DLTensor.
template <typename M>
const dl::Tensor* own(M* m, View& v) {
  v.obj = py::capsule(m, [](void* p) {
    auto* mt = static_cast<M*>(p);
    if (mt->deleter) mt->deleter(mt);
  });
  return &m->t;
}

View dlpack_view(const py::handle& obj, const char* what, bool writable, bool reduce, bool gpu,
                 const std::optional<std::string>& dtype_override) {
  py::object cap;
  if (PyCapsule_CheckExact(obj.ptr())) {
    cap = py::reinterpret_borrow<py::object>(obj);
  } else {
    // With NCCL, refuse a host tensor before exporting it with a CUDA stream argument. On the host, the
    // exported tensor says where it lives (checked below), which saves a call per collective (microseconds on
    // a torch.Tensor).
    if (gpu && py::hasattr(obj, "__dlpack_device__")) {
      const int32_t type = py::tuple(obj.attr("__dlpack_device__")())[0].cast<int32_t>();
      if (type != dl::kCuda) {
        CX_THROW(TypeMismatch, what, " is on ", device_name(type), ", but the process group uses BackendType.NCCL, "
                 "which works on CUDA arrays: move it to the GPU (t.cuda()), or use the CPU backend for host arrays");
      }
    }
    py::object export_ = obj.attr("__dlpack__");
    try {
      // CUDA: stream 1 is the legacy default stream, which the NCCL backend orders the collective after.
      cap = gpu ? export_(py::arg("stream") = 1, py::arg("max_version") = py::make_tuple(1, 0))
                : export_(py::arg("max_version") = py::make_tuple(1, 0));
    } catch (const py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) {
        CX_THROW(TypeMismatch, what, " cannot be shared through DLPack: ", e.what(),
                 " (a torch tensor that requires grad: pass t.detach(), which shares its memory)");
      }
      try {  // a producer older than DLPack 1.0 takes no max_version
        cap = gpu ? export_(py::arg("stream") = 1) : export_();
      } catch (const py::error_already_set& e2) {
        CX_THROW(TypeMismatch, what, " cannot be shared through DLPack: ", e2.what());
      }
    }
  }
  const char* cname = PyCapsule_GetName(cap.ptr());
  const bool versioned = cname && std::strcmp(cname, "dltensor_versioned") == 0;
  if (!cname || (!versioned && std::strcmp(cname, "dltensor") != 0)) {
    CX_THROW(TypeMismatch, what, " is a DLPack capsule that was consumed already (named '", cname ? cname : "",
             "'): pass the tensor itself, or a fresh capsule");
  }
  void* raw = PyCapsule_GetPointer(cap.ptr(), cname);
  if (!raw) throw py::error_already_set();
  // Ours from here on: the producer's capsule must not free it too.
  PyCapsule_SetName(cap.ptr(), versioned ? "used_dltensor_versioned" : "used_dltensor");
  View v;
  const dl::Tensor* t = versioned ? own(static_cast<dl::ManagedVersioned*>(raw), v)
                                  : own(static_cast<dl::Managed*>(raw), v);
  const uint64_t flags = versioned ? static_cast<dl::ManagedVersioned*>(raw)->flags : 0;
  if (gpu ? t->device.type != dl::kCuda : (t->device.type != dl::kCpu && t->device.type != dl::kCudaHost)) {
    CX_THROW(TypeMismatch, what, " is on ", device_name(t->device.type), ", which the process group's backend (",
             gpu ? "NCCL" : "CPU", ") cannot reach: ", gpu ? "move it to the GPU" : "pass t.cpu()");
  }
  if (writable && (flags & dl::kReadOnly)) {
    CX_THROW(InvalidArgument, what, " is read-only, but the collective writes its result into it in place");
  }
  auto [name, natural] = dl_dtype(t->dtype, what);
  const size_t itemsize = (t->dtype.bits + 7) / 8;
  v.size = 1;
  for (int32_t i = 0; i < t->ndim; ++i) {
    v.shape.push_back(t->shape[i]);
    v.size *= static_cast<size_t>(t->shape[i]);
  }
  if (t->strides && v.size > 1) {
    int64_t expect = 1;
    for (int32_t i = t->ndim; i-- > 0;) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        CX_THROW(InvalidArgument, what, kContiguous, "pass t.contiguous() (torch) and use that tensor afterwards");
      }
      expect *= t->shape[i];
    }
  }
  v.ptr = static_cast<char*>(t->data) + t->byte_offset;
  v.nbytes = v.size * itemsize;
  if (name.empty()) {  // bfloat16: NumPy has no such dtype; its bits travel and reduce as bfloat16
    v.dtype = numpy_dtype("uint16");
    v.name = "bfloat16";
  } else {
    v.dtype = numpy_dtype(name);
  }
  set_dtype(v, itemsize, what, reduce, dtype_override, natural);
  return v;
}

void same_layout(const View& ref, const View& v, const std::string& what) {
  if (v.dt != ref.dt || v.count != ref.count || !v.dtype.equal(ref.dtype)) {
    CX_THROW(InvalidArgument, what, " has ", v.size, " elements of ", v.dtype_name(), " but ", ref.size,
             " elements of ", ref.dtype_name(), " are expected (every block must match the input array)");
  }
}

}  // namespace

// ---- collectives --------------------------------------------------------------------------------------------

bool is_array(const py::handle& obj, bool gpu) {
  if (gpu) return is_gpu_array(obj) || (is_dlpack(obj) && !py::isinstance<py::array>(obj));
  return !is_gpu_array(obj) && (is_host_array(obj) || is_dlpack(obj));
}

[[noreturn]] void not_an_array(const char* what, const py::handle& obj, bool gpu) {
  std::string tname = type_name(obj);
  if (gpu && py::isinstance<py::array>(obj)) {
    CX_THROW(TypeMismatch, what, " is a NumPy array, but the process group uses BackendType.NCCL, which works on "
             "GPU arrays: pass cupy.asarray(a) (and use that array afterwards), or use BackendType.CPU "
             "(DISTRIBUTED_BACKEND=cpu) for NumPy arrays");
  }
  if (gpu) {
    CX_THROW(TypeMismatch, what, " must be a GPU array (a CuPy array, or any object with __cuda_array_interface__) "
             "with BackendType.NCCL, got ", tname);
  }
  if (is_gpu_array(obj)) {
    CX_THROW(TypeMismatch, what, " is a GPU array (", tname, "), but the process group uses BackendType.CPU, which "
             "works on NumPy arrays: initialize with BackendType.NCCL (DISTRIBUTED_BACKEND=nccl) for GPU arrays, "
             "or copy it to the host with cupy.asnumpy(a)");
  }
  CX_THROW(TypeMismatch, what, " must be a NumPy array, a tensor with __dlpack__ (torch, JAX), or an object NumPy "
           "can view without a copy (a memoryview, array.array, bytearray, anything with the buffer protocol), got ",
           tname);
}

View view_of(const py::handle& obj, const char* what, bool writable, bool reduce, bool gpu,
             const std::optional<std::string>& dtype_override) {
  // Cheapest tests first: an ndarray, a capsule (what pycyxwiz.torch passes); a torch.Tensor's
  // hasattr(__cuda_array_interface__) raises inside, which costs microseconds.
  if (!gpu && py::isinstance<py::array>(obj)) return numpy_view(obj, what, writable, reduce, dtype_override);
  if (PyCapsule_CheckExact(obj.ptr())) return dlpack_view(obj, what, writable, reduce, gpu, dtype_override);
  if (!gpu && py::hasattr(obj, "__dlpack__") && !PyObject_CheckBuffer(obj.ptr()) &&
      !py::hasattr(obj, "__array_interface__")) {
    return dlpack_view(obj, what, writable, reduce, false, dtype_override);  // a torch.Tensor, a JAX array
  }
  if (gpu) {
    View fast;
    if (cupy_view(obj, fast, what, reduce, dtype_override)) return fast;  // Note [CuPy arrays without their interface]
    py::object cai = cuda_interface(obj);
    if (!cai.is_none()) return gpu_view(obj, cai, what, writable, reduce, dtype_override);
    if (is_dlpack(obj) && !py::isinstance<py::array>(obj)) {
      return dlpack_view(obj, what, writable, reduce, true, dtype_override);
    }
    not_an_array(what, obj, gpu);
  }
  if (!is_array(obj, gpu)) not_an_array(what, obj, gpu);
  return numpy_view(obj, what, writable, reduce, dtype_override);  // buffer protocol or __array_interface__
}

View one_block(const View& whole, int p) {
  View b = whole;
  const size_t n = static_cast<size_t>(p);
  b.size = whole.size / n;
  b.count = whole.count / n;
  b.nbytes = whole.nbytes / n;
  b.shape.assign(whole.shape.begin() + 1, whole.shape.end());
  return b;
}

std::vector<View> blocks_of(const py::handle& obj, const char* what, const View& ref, int p, bool writable, bool gpu,
                            const View* viewed) {
  std::vector<View> out;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    if (static_cast<int>(seq.size()) != p) {
      CX_THROW(InvalidArgument, what, " has ", seq.size(), " entries, but the world size is ", p,
               ": pass one array per rank");
    }
    for (size_t i = 0; i < seq.size(); ++i) {
      std::string item = std::string(what) + "[" + std::to_string(i) + "]";
      View v = i == 0 && viewed ? *viewed : view_of(seq[i], item.c_str(), writable, false, gpu);
      if (ref.dt != DataType::kBytes && v.dt == DataType::kBytes) same_layout(ref, v, item);
      v.dt = ref.dt;
      if (ref.dt != DataType::kBytes) v.count = v.size;
      same_layout(ref, v, item);
      out.push_back(std::move(v));
    }
    return out;
  }
  View whole = viewed ? *viewed : view_of(obj, what, writable, false, gpu);
  if (!whole.dtype.equal(ref.dtype) || whole.nbytes != p * ref.nbytes) {
    CX_THROW(InvalidArgument, what, " must hold world_size x ", ref.size, " elements of ", ref.dtype_name(), " (", p,
             " x ", ref.nbytes, " bytes); got ", whole.size, " elements of ", whole.dtype_name());
  }
  size_t block = ref.nbytes;
  for (int i = 0; i < p; ++i) {
    View v;
    v.obj = whole.obj;
    v.ptr = static_cast<char*>(whole.ptr) + block * static_cast<size_t>(i);
    v.count = ref.count;
    v.dt = ref.dt;
    out.push_back(std::move(v));
  }
  return out;
}

// ---- model stack --------------------------------------------------------------------------------------------

std::string describe(py::handle obj) {
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    return std::string(py::str(a.dtype())) + " array of shape " + nn::shape_str(shape_of(a));
  }
  return std::string("a ") + std::string(py::str(py::type::of(obj).attr("__name__")));
}

py::array float_array(py::handle obj, std::string_view who, const char* expected, size_t min_ndim) {
  if (!py::isinstance<py::array>(obj) || !py::dtype::of<float>().equal(py::reinterpret_borrow<py::array>(obj).dtype()))
    CX_THROW(TypeMismatch, who, ": expected a float32 NumPy array of shape ", expected, ", got ", describe(obj),
             " (convert with np.asarray(x, dtype=np.float32))");
  auto a = py::reinterpret_borrow<py::array>(obj);
  CX_CHECK(static_cast<size_t>(a.ndim()) >= min_ndim, InvalidArgument, who, ": expected an array of shape ", expected,
           ", got shape ", nn::shape_str(shape_of(a)));
  CX_CHECK(a.flags() & py::array::c_style, InvalidArgument, who, ": expected a C-contiguous array of shape ", expected,
           ", got a non-contiguous view (use np.ascontiguousarray(x))");
  return a;
}

// Note [One rule for input arrays]
// fit(X, y) always took what NumPy users pass (float64 from np.random, lists, slices) and converted it
// once, while model.forward refused all but float32 C-contiguous arrays. One rule now, the NumPy one
// (np.add(x, 1) takes any real dtype; scikit-learn's fit and predict convert): an array the core only
// reads is converted to float32 as np.ascontiguousarray(x, dtype=np.float32) would, which costs nothing
// when it already is one. Arrays the core writes in place (collectives, EMA shadows, flat views) stay
// strict (float_array): a silent copy there would lose the write. Complex, object and string arrays are
// refused by name. fit applies the same rule in Python (_as_inputs in distributed/_train.py).
py::array float_input(py::handle obj, std::string_view who, const char* expected, size_t min_ndim) {
  if (py::isinstance<py::array>(obj)) {
    auto a = py::reinterpret_borrow<py::array>(obj);
    if (py::dtype::of<float>().equal(a.dtype()) && (a.flags() & py::array::c_style))
      return float_array(obj, who, expected, min_ndim);
  }
  py::module_ np = py::module_::import("numpy");
  py::array a;
  try {
    a = np.attr("asarray")(obj);
  } catch (py::error_already_set&) {
    CX_THROW(TypeMismatch, who, ": expected an array of real numbers of shape ", expected, ", got ", describe(obj));
  }
  const char kind = a.dtype().kind();
  CX_CHECK(kind == 'f' || kind == 'i' || kind == 'u' || kind == 'b', TypeMismatch, who,
           ": expected an array of real numbers of shape ", expected, " (it is converted to float32), got ",
           describe(a), py::isinstance<py::array>(obj) ? "" : " (from " + describe(obj) + ")");
  return float_array(np.attr("ascontiguousarray")(a, py::arg("dtype") = "float32"), who, expected, min_ndim);
}

nn::Shape shape_of(const py::array& a) { return nn::Shape(a.shape(), a.shape() + a.ndim()); }

py::array_t<float> to_numpy(const nn::Tensor& t) {
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  py::array_t<float> out(shape);
  std::memcpy(out.mutable_data(), t.data(), t.numel() * sizeof(float));
  return out;
}

py::array storage_view(const std::shared_ptr<nn::FloatStorage>& storage, size_t offset, const nn::Shape& shape) {
  auto* keep = new std::shared_ptr<nn::FloatStorage>(storage);
  py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<nn::FloatStorage>*>(p); });
  std::vector<py::ssize_t> sh(shape.begin(), shape.end());
  return py::array(py::dtype::of<float>(), sh, {}, storage->data() + offset, base);
}

// ---- trainer ------------------------------------------------------------------------------------------------

train::Targets targets_of(py::handle y, const char* who) {
  using Kind = train::Targets::Kind;
  CX_CHECK(py::isinstance<py::array>(y), TypeMismatch, who, ": y must be a NumPy array, got ", describe(y));
  auto a = py::reinterpret_borrow<py::array>(y);
  CX_CHECK(a.flags() & py::array::c_style, InvalidArgument, who, ": y must be C-contiguous");
  train::Targets t;
  t.data = a.data();
  t.rows = a.ndim() ? static_cast<size_t>(a.shape(0)) : 0;
  if (py::dtype::of<int64_t>().equal(a.dtype())) t.kind = Kind::kInt64;
  else if (py::dtype::of<int32_t>().equal(a.dtype())) t.kind = Kind::kInt32;
  else if (py::dtype::of<float>().equal(a.dtype())) t.kind = Kind::kFloat32;
  else
    CX_THROW(TypeMismatch, who, ": y must be int64/int32 class labels or float32 targets, got ", describe(y));
  if (t.kind != Kind::kFloat32)
    CX_CHECK(a.ndim() == 1, InvalidArgument, who, ": integer labels must have shape (samples,), got ",
             nn::shape_str(shape_of(a)));
  else if (a.ndim() >= 1)
    t.row_shape = nn::Shape(a.shape() + 1, a.shape() + a.ndim());
  return t;
}

}  // namespace cx::bindings
