// Bindings of ZeroRedundancyOptimizer (csrc/train/zero.h) and of DistributedDataParallel.join (Note [Join] in
// csrc/train/ddp.h), which this file adds to the class ddp.cpp registers.
#include <pybind11/stl.h>

#include <sstream>

#include "bindings/bindings.h"
#include "nn/optimizer.h"
#include "train/ddp.h"
#include "train/zero.h"

namespace cx::bindings {

using namespace cx::train;

namespace {

using DDPClass = shared_class<DistributedDataParallel>;
using ZeroClass = shared_class<ZeroRedundancyOptimizer>;

// What ddp.join() returns: a context manager for uneven inputs.
struct JoinContext {
  std::shared_ptr<DistributedDataParallel> ddp;
};

void def_join(py::module_& m) {
  py::class_<JoinContext>(m, "_Join")
      .def("__enter__",
           [](JoinContext& j) {
             py::gil_scoped_release nogil;
             j.ddp->join_begin();
             return j.ddp;
           })
      .def("__exit__", [](JoinContext& j, py::handle exc_type, py::handle exc, py::handle) {
        if (!exc_type.is_none()) {
          // Peers may be anywhere (shadowing this rank's collectives, or waiting in their own): leave
          // without communicating, and fail the group so that each of them raises at once "rank R
          // failed: <the exception>", as when an exception leaves DistributedTrainer.fit.
          j.ddp->join_abort();
          std::string why = py::str(exc_type.attr("__name__")).cast<std::string>() + ": " +
                            py::str(exc).cast<std::string>();
          py::gil_scoped_release nogil;
          try {
            j.ddp->group()->abort(why);
          } catch (...) {  // never hide the exception on its way out
          }
          return false;
        }
        py::gil_scoped_release nogil;
        try {
          j.ddp->join_end();
        } catch (const std::exception& e) {  // the same for an error of join_end itself (a NonFiniteError)
          try {
            j.ddp->group()->abort(e.what());
          } catch (...) {
          }
          throw;
        }
        return false;
      });

  auto ddp = py::reinterpret_borrow<DDPClass>(m.attr("DistributedDataParallel"));
  ddp.def(
         "join", [](std::shared_ptr<DistributedDataParallel> d) { return JoinContext{std::move(d)}; },
         "Context manager for uneven inputs (as torch.distributed.algorithms.Join): a rank whose loop ends first\n"
         "answers its peers' collectives with zeros until every rank's has, and gradients are averaged over the\n"
         "ranks still active; on leaving, every rank takes the parameters of the last ones active. Collective.\n\n"
         "    with ddp.join():\n        for x, y in my_batches: ...; ddp.update_parameters(opt)")
      .def_property_readonly("joining", &DistributedDataParallel::joining, "Whether inside join().")
      .def(
          "update_parameters",
          [](DistributedDataParallel& d, ZeroRedundancyOptimizer& z) {
            CX_CHECK(z.ddp().get() == &d, InvalidArgument, "DistributedDataParallel.update_parameters (rank ",
                     d.rank(), "): this ZeroRedundancyOptimizer wraps another DistributedDataParallel");
            {
              py::gil_scoped_release nogil;
              z.step();
            }
            warn_nonfinite(d);
          },
          py::arg("optimizer"), "With a ZeroRedundancyOptimizer of this DDP: zero.step().");
}

void def_zero(py::module_& m) {
  ZeroClass c(m, "ZeroRedundancyOptimizer",
              "ZeRO-1: each rank keeps and updates the optimizer state of its 1/world_size slice of the flat\n"
              "parameters; gradients are reduce-scattered instead of all-reduced and the updated parameters\n"
              "all-gathered (Note [ZeRO-1] in csrc/train/zero.h). Results equal the unsharded optimizer's.\n\n"
              "    zero = cx.distributed.ZeroRedundancyOptimizer(ddp, cx.AdamOptimizer(1e-3))\n"
              "    ddp.forward(x); ddp.backward(loss_fn.backward()); zero.step()");
  c.def(py::init([](std::shared_ptr<DistributedDataParallel> ddp, std::shared_ptr<nn::Optimizer> opt) {
         py::gil_scoped_release nogil;
         return std::make_shared<ZeroRedundancyOptimizer>(std::move(ddp), std::move(opt));
       }),
       py::arg("ddp"), py::arg("optimizer"),
       "Shards `optimizer` (SGD, Adam, AdamW, RMSprop) over ddp's ranks; its state, if any, is cut to this rank's "
       "shard. Collective in use: every rank makes one and steps it.")
      .def("step",
           [](ZeroRedundancyOptimizer& z) {
             {
               py::gil_scoped_release nogil;
               z.step();
             }
             warn_nonfinite(*z.ddp());
           },
           "Collective: reduce-scatter the gradients, step this rank's shard, all-gather the parameters, zero the "
           "gradients.")
      .def("zero_grad", [](ZeroRedundancyOptimizer& z) { z.ddp()->model()->zero_grad(); },
           "Zeroes the model's gradients.")
      .def(
          "state_dict",
          [](ZeroRedundancyOptimizer& z) {
            nn::StateDict sd;
            {
              py::gil_scoped_release nogil;
              sd = z.state_dict();
            }
            return optimizer_state_to_py(std::move(sd));
          },
          "Collective: the whole optimizer state (every rank's shard gathered), as the wrapped optimizer's "
          "state_dict() would be without ZeRO; loadable with another world size.")
      .def(
          "load_state_dict",
          [](ZeroRedundancyOptimizer& z, const py::dict& d) { z.load_state_dict(optimizer_state_from_py(d)); },
          py::arg("state_dict"), "A whole state (state_dict()): this rank keeps its shard. Not collective.")
      .def_property_readonly(
          "shard", [](const ZeroRedundancyOptimizer& z) { return py::make_tuple(z.shard().offset, z.shard().count); },
          "(offset, count): the slice of the flat parameters whose optimizer state this rank holds.")
      .def_property_readonly("state_numel", &ZeroRedundancyOptimizer::state_numel,
                             "Floats of optimizer state held on this rank (every state array together).")
      .def_property_readonly("optimizer", &ZeroRedundancyOptimizer::optimizer_ptr,
                             "The wrapped optimizer (its lr, set_lr, steps; its state is this rank's shard).")
      .def_property_readonly("ddp", &ZeroRedundancyOptimizer::ddp)
      .def("__repr__", [](ZeroRedundancyOptimizer& z) {
        std::ostringstream os;
        os << "ZeroRedundancyOptimizer(" << z.optimizer().repr() << ", rank=" << z.ddp()->rank()
           << ", shard=(" << z.shard().offset << ", " << z.shard().count << "))";
        return os.str();
      });
}

}  // namespace

void bind_zero(py::module_& m) {
  def_zero(m);
  def_join(m);
}

}  // namespace cx::bindings
