// defines: every conversion between a Python array and what the C++ core takes (pointer, count, dtype, shape),
// with the checks at that boundary, for all the binding files:
//   - View / view_of / blocks_of: the arrays of a collective: with the CPU backend a NumPy array, anything NumPy
//     views without a copy (buffer protocol, __array_interface__) or a host DLPack tensor (torch, JAX: __dlpack__,
//     or a DLPack capsule); with NCCL a __cuda_array_interface__ array (CuPy) or a CUDA DLPack tensor;
//   - float_array / shape_of / to_numpy / storage_view: the float32 arrays of the model stack;
//   - targets_of: the targets of a data set for the trainer;
//   - describe: "float64 array of shape (2, 3)" or "a list", for messages.
// A conversion checks what it must to hand out a valid pointer (type, dtype, contiguity, writability) and says
// what to pass instead; what the values must satisfy is checked by the C++ code that uses them.
#pragma once

#include <pybind11/numpy.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/types.h"
#include "nn/tensor.h"

namespace cx::train {
struct Targets;
}

namespace cx::bindings {
namespace py = pybind11;

// ---- collectives --------------------------------------------------------------------------------------------

// A checked view of an array handed to a collective.
struct View {
  py::object obj;  // keeps the array alive
  void* ptr = nullptr;
  size_t count = 0;  // elements (of dt)
  distributed::DataType dt = distributed::DataType::kBytes;
  size_t size = 0;  // elements of the array's own dtype
  size_t nbytes = 0;
  py::object dtype;  // the NumPy dtype (also for GPU arrays; uint16 for a DLPack bfloat16)
  std::string name;  // the dtype's name where NumPy has none (a DLPack bfloat16)
  std::string dtype_name() const { return name.empty() ? std::string(py::str(dtype.attr("name"))) : name; }
  std::vector<int64_t> shape;
  uintptr_t stream = 0;  // GPU arrays: the stream to order the collective after (0: legacy default)
};

// `gpu`: the group's backend is NCCL. `reduce`: the collective combines elements, so the dtype must be one we can
// reduce. `writable`: the collective writes into it. `dtype_override`: "bfloat16" for bfloat16 in uint16 storage.
// `what` names the array in messages ("the array", "the output array", ...).
View view_of(const py::handle& obj, const char* what, bool writable, bool reduce, bool gpu,
             const std::optional<std::string>& dtype_override = std::nullopt);

// Block 0 of `whole` cut into p equal blocks along its first axis (whose length is p): the layout every
// block must have.
View one_block(const View& whole, int p);

// p blocks like `ref`: a list (or tuple) of p arrays, or one array holding p blocks of ref's size. `viewed`: obj's
// view where the caller made it already (an array can be viewed only once when it is a DLPack capsule), or for a
// list, the view of its first entry.
std::vector<View> blocks_of(const py::handle& obj, const char* what, const View& ref, int p, bool writable, bool gpu,
                            const View* viewed = nullptr);

// Whether view_of can view obj without a copy (a GPU array when `gpu`, else a host array).
bool is_array(const py::handle& obj, bool gpu);
// The TypeError for an object that is not an array of the backend's kind, naming what to pass instead.
[[noreturn]] void not_an_array(const char* what, const py::handle& obj, bool gpu);

// ---- model stack --------------------------------------------------------------------------------------------

// "float64 array of shape (2, 3)", or "a list" for anything that is not an ndarray.
std::string describe(py::handle obj);

// obj as a float32, C-contiguous ndarray with at least min_ndim dimensions, else a TypeError / ValueError saying
// "<who>: expected ... of shape <expected>". Never copies: the core reads (and may keep reading) its memory.
py::array float_array(py::handle obj, std::string_view who, const char* expected, size_t min_ndim = 2);
// An array the core only reads (a model's input, a grad_output, a loss's output or targets, fit's X): anything
// np.asarray makes an array of real numbers (float16/32/64, integers, bools; a list) is taken as
// np.ascontiguousarray(obj, dtype=np.float32) would give it (a float32 C-contiguous array as it is, no copy),
// else TypeError (Note [One rule for input arrays] in arrays.cpp).
py::array float_input(py::handle obj, std::string_view who, const char* expected, size_t min_ndim = 2);

nn::Shape shape_of(const py::array& a);

// A new float32 ndarray holding a copy of t.
py::array_t<float> to_numpy(const nn::Tensor& t);

// A writable float32 view of storage[offset, offset + numel(shape)) that keeps the storage alive: a view outliving
// a re-layout (SequentialModel.add) or the model is stale but never dangling.
py::array storage_view(const std::shared_ptr<nn::FloatStorage>& storage, size_t offset, const nn::Shape& shape);

// ---- trainer ------------------------------------------------------------------------------------------------

// y as the trainer's targets: a C-contiguous ndarray of int64 / int32 class labels, shape (samples,), or of float32
// targets, shape (samples, ...). `who` starts the messages ("DistributedTrainer.fit"). Whether y fits X (as many
// samples) is for the caller: DistributedTrainer checks its data set in Python (_train.py, _as_data).
train::Targets targets_of(py::handle y, const char* who);

}  // namespace cx::bindings
