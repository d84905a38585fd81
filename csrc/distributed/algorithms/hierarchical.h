// defines: Hierarchy (which ranks share a host) and the hierarchical all_reduce,
// reduce_scatter, all_gather, broadcast and reduce: shared memory inside a host, one
// rank per host and per slice of the data across hosts (Note [Hierarchical
// collectives] in hierarchical.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "distributed/algorithms/algorithms.h"

namespace cx::distributed::algo {

struct Hierarchy {
  // hosts[r]: rank r's host (Transport::hosts()). Empty where the hosts do not all
  // have the same number of ranks, or are unknown; `why` then says which.
  static std::optional<Hierarchy> of(const std::vector<int>& hosts, std::string* why);

  int per_host = 0;                      // ranks on each host
  std::vector<std::vector<int>> ranks;  // [host][local index] -> rank, ascending within a host
  std::vector<int> host_of, local_of;    // index = rank

  // More than one host, and more than one rank on them: where the hierarchy pays.
  bool pays() const { return ranks.size() > 1 && per_host > 1; }
  std::vector<int> column(int local) const;  // the rank of that local index on every host, by host
};

void all_reduce_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op,
                             const AlgoOptions& o, const ProbeView* pv = nullptr);
void reduce_scatter_hierarchical(Transport& t, const Hierarchy& h, const void* const* ins, void* out, size_t count,
                                 DataType dt, ReduceOp op, const AlgoOptions& o, const ProbeView* pv = nullptr);
void all_gather_hierarchical(Transport& t, const Hierarchy& h, const void* in, void* const* outs, size_t bytes,
                             const AlgoOptions& o);
void broadcast_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t bytes, int root,
                            const AlgoOptions& o);
// The result lands in buf on `root`; other ranks' buf hold partial results afterwards (as algo::reduce).
void reduce_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op, int root,
                         const AlgoOptions& o);

}  // namespace cx::distributed::algo
