// defines: the binding entry points module.cpp calls, one per file (or pair of classes), and shared_class.
// Every binding file converts Python objects to C++ views (arrays.h), releases the GIL and calls into the core;
// the logic lives in the C++ layers or in python/pycyxwiz. The calls' order is the registration order, which
// matters: a signature in a docstring names a class only if that class was registered before it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

namespace cx::nn {
struct StateDict;
}
namespace cx::distributed {
class Store;
}
namespace cx::train {
class DistributedDataParallel;
}

namespace cx::bindings {
namespace py = pybind11;

// optimizers.cpp: an optimizer's StateDict as the dict state_dict() returns (its arrays moved into the
// dict's, not copied), and back.
py::dict optimizer_state_to_py(nn::StateDict sd);
nn::StateDict optimizer_state_from_py(const py::dict& d);

// external_store.cpp: a Python store (torch.distributed's Store: set, check, get) as the core's Store; `ip` is
// the address this rank's peers reach it at.
std::unique_ptr<distributed::Store> external_store(py::object store, const std::string& ip, int rank);

// modules.cpp: a layer's `seed` argument: None takes the next seed of cx.manual_seed's sequence.
uint64_t seed_or_next(const py::object& seed);

// A class held by shared_ptr (what the core's objects share between Python and C++).
template <typename T, typename... Bases>
using shared_class = py::class_<T, Bases..., std::shared_ptr<T>>;

void bind_errors(py::module_& m);  // errors.cpp: the exception types and the C++ -> Python mapping
// errors.cpp: DDPConfig.nonfinite = "warn"'s text of the last step, as a RuntimeWarning (GIL held).
void warn_nonfinite(train::DistributedDataParallel& d);

// m is _core.dist
void bind_process_group(py::module_& m);  // process_group.cpp: BackendType, DistributedConfig, init, get_*
void bind_collectives(py::module_& m);    // collectives.cpp: ReduceOp, Work, the 11 collectives and Group
void bind_gpu(py::module_& m);            // gpu.cpp: GPU/NCCL library discovery and probes

// m is _core
void bind_nn_settings(py::module_& m);  // nn_settings.cpp: BLAS threads, manual_seed
void bind_modules(py::module_& m);      // modules.cpp: Module and the layers
void bind_model(py::module_& m);        // model.cpp: SequentialModel
void bind_layers(py::module_& m);       // layers.cpp: the layers of csrc/nn/layers/ (Conv2dModule, ...)
void bind_losses(py::module_& m);       // losses.cpp: CrossEntropyLoss, MSELoss, BCEWithLogitsLoss
void bind_optimizers(py::module_& m);   // optimizers.cpp: the optimizers and clip_grad_norm
void bind_schedulers(py::module_& m);   // optimizers.cpp: the learning-rate schedulers

// m is _core.dist
void bind_ddp(py::module_& m);      // ddp.cpp: DDPConfig, DistributedDataParallel
void bind_zero(py::module_& m);     // zero.cpp: ZeroRedundancyOptimizer, DistributedDataParallel.join
void bind_sampler(py::module_& m);  // sampler.cpp: DistributedSampler, DistributedBatchIterator
void bind_trainer(py::module_& m);  // trainer.cpp: _TrainerCore and the checkpoint helpers
void bind_environment(py::module_& m);  // environment.cpp: the table of environment variables
void bind_crypto(py::module_& m);       // crypto.cpp: SHA-256 and HMAC test hooks

}  // namespace cx::bindings
