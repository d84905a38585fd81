// The extension module pycyxwiz._core: the binding files, in registration order (see bindings.h).
#include "bindings/bindings.h"

PYBIND11_MODULE(_core, m) {
  using namespace cx::bindings;
  m.doc() = "pycyxwiz C++ core: collectives (dist), model stack (nn), training (train)";
  bind_errors(m);
  auto dist = m.def_submodule("dist", "process group and collectives");
  bind_process_group(dist);
  bind_collectives(dist);
  bind_gpu(dist);
  bind_nn_settings(m);
  bind_modules(m);
  bind_model(m);
  bind_layers(m);
  bind_losses(m);
  bind_optimizers(m);
  bind_schedulers(m);
  bind_ddp(dist);
  bind_zero(dist);
  bind_sampler(dist);
  bind_trainer(dist);
  bind_environment(m);
  bind_crypto(m);
}
