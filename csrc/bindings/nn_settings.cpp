// Bindings of the model stack's process-wide settings: the model math's thread count and the module seed sequence.
#include "bindings/bindings.h"
#include "nn/blas.h"
#include "nn/rng.h"

namespace cx::bindings {

void bind_nn_settings(py::module_& m) {
  cx::nn::apply_default_num_threads();

  m.def("set_num_threads", &cx::nn::set_num_threads, py::arg("n"),
        "Sets the number of threads the model math (layers, GEMMs, optimizers) runs on, the caller's counted.");
  m.def("get_num_threads", &cx::nn::get_num_threads,
        "Number of threads the model math runs on (default: OMP_NUM_THREADS or OPENBLAS_NUM_THREADS, else 1 "
        "where several ranks share the host, else every CPU this process may use).");
  m.def("manual_seed", &cx::nn::manual_seed, py::arg("seed"),
        "Seeds the sequence that gives modules created without seed= their seeds.");
}

}  // namespace cx::bindings
