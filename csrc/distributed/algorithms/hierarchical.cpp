#include "distributed/algorithms/hierarchical.h"

#include <algorithm>
#include <memory>

#include "common/error.h"
#include "distributed/algorithms/reduction_kernels.h"
#include "distributed/algorithms/sub_transport.h"

namespace cx::distributed::algo {

// Note [Hierarchical collectives]
// A flat ring puts every rank in one ring whatever the hosts. With H hosts of L
// ranks each, the ranks of a host next to each other in the ring, one edge of
// the ring leaves each host, and it carries what one rank sends: 2(p-1)/p * n
// per all_reduce of n bytes (p = H * L). Hierarchically:
//   1. inside each host, a ring reduce-scatter through shared memory: local rank
//      i ends holding slice (i+1) mod L of the host's sum;
//   2. across hosts, the L "columns" (the i-th rank of every host) each
//      all_reduce their slice (algo::all_reduce: recursive doubling or the ring
//      by size), all L at once over the hosts' links;
//   3. inside each host, a ring all-gather of the slices.
// A host's link then carries L * 2(H-1)/H * n/L = 2(H-1)/H * n: with 2 hosts of
// 2 ranks, n against the flat ring's 1.5 n; with many ranks per host, half.
// reduce_scatter and all_gather are the same two halves (the intra-host part once
// per host's block, the inter-host part by column); broadcast goes across hosts
// in the root's column, then inside every host.
//
// The hierarchy needs every host to hold the same number of ranks (the columns
// must be full); otherwise the collectives stay flat (CX_ALGORITHM=hierarchical
// is refused at init, naming the counts). AVG is summed throughout and divided
// by the world size at the end, as the flat algorithms do; float results may
// differ from the flat ones in the last bits (another summation order), but are
// the same on every rank.

std::optional<Hierarchy> Hierarchy::of(const std::vector<int>& hosts, std::string* why) {
  if (hosts.empty()) {
    if (why) *why = "the hosts of the ranks are unknown";
    return std::nullopt;
  }
  Hierarchy h;
  const int n_hosts = *std::max_element(hosts.begin(), hosts.end()) + 1;
  h.ranks.resize(static_cast<size_t>(n_hosts));
  h.host_of = hosts;
  h.local_of.resize(hosts.size());
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    auto& mine = h.ranks[static_cast<size_t>(hosts[r])];
    h.local_of[r] = static_cast<int>(mine.size());
    mine.push_back(r);
  }
  h.per_host = static_cast<int>(h.ranks[0].size());
  for (const auto& on_host : h.ranks) {
    if (static_cast<int>(on_host.size()) != h.per_host) {
      if (why) {
        std::string counts;
        for (const auto& c : h.ranks) counts += (counts.empty() ? "" : ", ") + std::to_string(c.size());
        *why = "the hosts do not all have the same number of ranks (" + counts + ")";
      }
      return std::nullopt;
    }
  }
  return h;
}

std::vector<int> Hierarchy::column(int local) const {
  std::vector<int> c;
  c.reserve(ranks.size());
  for (const auto& on_host : ranks) c.push_back(on_host[static_cast<size_t>(local)]);
  return c;
}

namespace {

// The blocks a hierarchical reduce_scatter or all_gather keeps between its two
// halves (one per host); like scratch_space, reused on this thread, but apart
// from it, since the flat algorithms called in between use that one.
char* between_phases(size_t bytes) {
  thread_local std::unique_ptr<char[]> buf;
  thread_local size_t cap = 0;
  if (bytes > cap) {
    buf.reset(new char[bytes]);
    cap = bytes;
  }
  return buf.get();
}

ReduceOp summed(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

}  // namespace

// With a probe (Note [Fused non-finite check] in reduce_probe.h): the in-host
// reduce-scatter reads every rank's own values (named through the host's
// members); across hosts only host sums travel, so only the result is tested.
void all_reduce_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op,
                             const AlgoOptions& o, const ProbeView* pv) {
  const int me = t.rank(), per_host = h.per_host, local = h.local_of[me];
  if (count < static_cast<size_t>(per_host)) return all_reduce(t, buf, count, dt, op, o, pv);  // empty slices
  const std::vector<int>& host = h.ranks[static_cast<size_t>(h.host_of[me])];
  SubTransport in_host(t, host);
  SubTransport across(t, h.column(local));
  size_t off, n;
  ring_segment(count, per_host, (local + 1) % per_host, &off, &n);
  ProbeView in_v, across_v;
  if (pv) {
    pv->probe->local_only = true;  // the in-host all-gather carries no flags; the caller does the OR
    in_v = {pv->probe, &host, pv->base, pv->raw, pv->result && h.ranks.size() == 1};
    across_v = {pv->probe, nullptr, pv->base + off, false, pv->result && h.ranks.size() > 1};
  }
  ring_reduce_scatter_inplace(in_host, buf, count, dt, summed(op), o, pv ? &in_v : nullptr);
  all_reduce(across, static_cast<char*>(buf) + off * dtype_size(dt), n, dt, summed(op), o, pv ? &across_v : nullptr);
  ring_all_gather_inplace(in_host, buf, count, dt, o);
  finish_avg(buf, count, dt, op, t.size());
}

void reduce_scatter_hierarchical(Transport& t, const Hierarchy& h, const void* const* ins, void* out, size_t count,
                                 DataType dt, ReduceOp op, const AlgoOptions& o) {
  const int me = t.rank();
  const size_t n_hosts = h.ranks.size(), block = count * dtype_size(dt);
  SubTransport in_host(t, h.ranks[static_cast<size_t>(h.host_of[me])]);
  SubTransport across(t, h.column(h.local_of[me]));
  // 1. For every host, our host's sum of the blocks its ranks get, each at the
  // rank of ours with the same local index: partial[host] is for (host, our index).
  char* partial = between_phases(n_hosts * block);
  std::vector<const void*> blocks(static_cast<size_t>(h.per_host));
  for (size_t host = 0; host < n_hosts; ++host) {
    for (int j = 0; j < h.per_host; ++j) blocks[j] = ins[h.ranks[host][static_cast<size_t>(j)]];
    reduce_scatter(in_host, blocks.data(), partial + host * block, count, dt, summed(op), o);
  }
  // 2. Across hosts, by column: the hosts' partials for us, summed.
  std::vector<const void*> partials(n_hosts);
  for (size_t host = 0; host < n_hosts; ++host) partials[host] = partial + host * block;
  reduce_scatter(across, partials.data(), out, count, dt, summed(op), o);
  finish_avg(out, count, dt, op, t.size());
}

void all_gather_hierarchical(Transport& t, const Hierarchy& h, const void* in, void* const* outs, size_t bytes,
                             const AlgoOptions& o) {
  const int me = t.rank();
  const size_t n_hosts = h.ranks.size();
  SubTransport in_host(t, h.ranks[static_cast<size_t>(h.host_of[me])]);
  SubTransport across(t, h.column(h.local_of[me]));
  // 1. Across hosts, by column: the blocks of the ranks with our local index.
  char* theirs = between_phases(n_hosts * bytes);
  std::vector<void*> column_outs(n_hosts);
  for (size_t host = 0; host < n_hosts; ++host) column_outs[host] = theirs + host * bytes;
  all_gather(across, in, column_outs.data(), bytes, o);
  // 2. Inside the host, once per host's blocks, straight into the caller's outputs.
  std::vector<void*> local_outs(static_cast<size_t>(h.per_host));
  for (size_t host = 0; host < n_hosts; ++host) {
    for (int j = 0; j < h.per_host; ++j) local_outs[j] = outs[h.ranks[host][static_cast<size_t>(j)]];
    all_gather(in_host, theirs + host * bytes, local_outs.data(), bytes, o);
  }
}

void broadcast_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t bytes, int root,
                            const AlgoOptions& o) {
  const int me = t.rank(), root_local = h.local_of[root];
  if (h.local_of[me] == root_local) {
    SubTransport across(t, h.column(root_local));
    broadcast(across, buf, bytes, h.host_of[root], o);  // the column is in host order
  }
  SubTransport in_host(t, h.ranks[static_cast<size_t>(h.host_of[me])]);
  broadcast(in_host, buf, bytes, root_local, o);
}

}  // namespace cx::distributed::algo
