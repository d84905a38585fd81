// Bindings of DistributedSampler and DistributedBatchIterator (csrc/train/sampler.h); the iterator also speaks
// Python's iteration protocol.
#include <pybind11/stl.h>

#include <optional>
#include <sstream>

#include "bindings/bindings.h"
#include "train/sampler.h"

namespace cx::bindings {

using namespace cx::train;

namespace {

std::optional<int> optional_int(const py::object& v) {
  if (v.is_none()) return std::nullopt;
  return v.cast<int>();
}

void bind_distributed_sampler(py::module_& m) {
  shared_class<DistributedSampler>(
      m, "DistributedSampler",
      "This rank's share of a data set's indices, reshuffled every epoch, the same number on every rank.\n\n"
      "    sampler = cx.distributed.DistributedSampler(dataset_size=10000, shuffle=True, seed=42)\n"
      "    sampler.set_epoch(epoch); idx = sampler.get_indices()")
      .def(py::init([](int64_t n, bool shuffle, uint64_t seed, bool drop_last, py::object num_replicas,
                       py::object rank) {
             std::optional<int> nr = optional_int(num_replicas);
             std::optional<int> r = optional_int(rank);
             return make_sampler(n, shuffle, seed, drop_last, nr, r);
           }),
           py::arg("dataset_size"), py::arg("shuffle") = true, py::arg("seed") = 0, py::arg("drop_last") = false,
           py::arg("num_replicas") = py::none(), py::arg("rank") = py::none())
      .def("set_epoch", &DistributedSampler::set_epoch, py::arg("epoch"),
           "Selects the epoch's shuffle; call it at the start of every epoch.")
      .def("get_indices", &DistributedSampler::get_indices, "This rank's indices for the current epoch (a list).")
      .def("local_size", &DistributedSampler::local_size, "Samples for this rank per epoch.")
      .def("total_size", &DistributedSampler::total_size, "The data set's size.")
      .def("padded_size", &DistributedSampler::padded_size,
           "Samples over all ranks per epoch: the size padded (or, with drop_last, cut) to a multiple of the "
           "world size.")
      .def("__len__", &DistributedSampler::local_size)
      .def_property_readonly("epoch", &DistributedSampler::epoch)
      .def_property_readonly("num_replicas", &DistributedSampler::num_replicas)
      .def_property_readonly("rank", &DistributedSampler::rank)
      .def_property_readonly("shuffle", &DistributedSampler::shuffle)
      .def_property_readonly("seed", &DistributedSampler::seed)
      .def_property_readonly("drop_last", &DistributedSampler::drop_last)
      .def("__repr__", [](const DistributedSampler& s) {
        std::ostringstream os;
        os << "DistributedSampler(dataset_size=" << s.total_size() << ", rank=" << s.rank()
           << ", num_replicas=" << s.num_replicas() << ", local_size=" << s.local_size()
           << ", shuffle=" << (s.shuffle() ? "True" : "False") << ", seed=" << s.seed()
           << ", drop_last=" << (s.drop_last() ? "True" : "False") << ", epoch=" << s.epoch() << ")";
        return os.str();
      });
}

void bind_batch_iterator(py::module_& m) {
  shared_class<DistributedBatchIterator>(m, "DistributedBatchIterator",
                                         "This rank's indices in batches.\n\n"
                                         "    it = cx.distributed.DistributedBatchIterator(sampler, batch_size=64)\n"
                                         "    for idx in it: xb, yb = X[idx], y[idx]")
      .def(py::init<std::shared_ptr<DistributedSampler>, size_t, bool>(), py::arg("sampler"),
           py::arg("batch_size"), py::arg("drop_last") = false)
      .def("has_next", &DistributedBatchIterator::has_next)
      .def("next", &DistributedBatchIterator::next, "The next batch's indices (a list).")
      .def("reset", &DistributedBatchIterator::reset, py::arg("epoch"),
           "sampler.set_epoch(epoch) and back to the first batch.")
      .def("num_batches", &DistributedBatchIterator::num_batches, "Batches per epoch (the same on every rank).")
      .def("__len__", &DistributedBatchIterator::num_batches)
      .def("position", &DistributedBatchIterator::position, "Batches already returned this epoch.")
      .def("set_position", &DistributedBatchIterator::set_position, py::arg("position"),
           "Skips to batch `position` of the current epoch (resuming from a checkpoint).")
      .def_property_readonly("batch_size", &DistributedBatchIterator::batch_size)
      .def_property_readonly("sampler", &DistributedBatchIterator::sampler)
      .def("__iter__",
           [](std::shared_ptr<DistributedBatchIterator> it) {
             it->rewind();
             return it;
           },
           "Iterates over the current epoch's batches from the first.")
      .def("__next__",
           [](DistributedBatchIterator& it) {
             if (!it.has_next()) throw py::stop_iteration();
             return it.next();
           })
      .def("__repr__", [](const DistributedBatchIterator& it) {
        std::ostringstream os;
        os << "DistributedBatchIterator(batch_size=" << it.batch_size() << ", num_batches=" << it.num_batches()
           << ", position=" << it.position() << ", epoch=" << it.sampler()->epoch() << ")";
        return os.str();
      });
}

}  // namespace

void bind_sampler(py::module_& m) {
  bind_distributed_sampler(m);
  bind_batch_iterator(m);
}

}  // namespace cx::bindings
