#include "distributed/algorithms/hierarchical.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "distributed/algorithms/reduction_kernels.h"
#include "distributed/algorithms/scratch.h"
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
//      all_reduce their slice (a direct reduce-scatter + all-gather, or
//      algo::all_reduce below the small-message threshold), all L at once over
//      the hosts' links;
//   3. inside each host, a ring all-gather of the slices.
// A host's link then carries L * 2(H-1)/H * n/L = 2(H-1)/H * n: with 2 hosts of
// 2 ranks, n against the flat ring's 1.5 n; with many ranks per host, half.
// reduce_scatter and all_gather are the same two halves (the intra-host part once
// per host's block, the inter-host part by column); broadcast goes across hosts
// in the root's column, then inside every host. all_reduce, reduce_scatter and
// all_gather overlap their phases (Note [Pipelined hierarchical all_reduce]);
// broadcast runs its two one after the other.
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
// halves (one per host): scratch.h's second pool, since the flat algorithms
// called in between use the first.
char* between_phases(size_t bytes) { return scratch_space<Pool::kBetweenPhases>(bytes); }

ReduceOp summed(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

// For the flat all_gather and reduce_scatter run inside a host: their thresholds for the pairs there (through rings
// where shared memory carries them, Note [Bruck's all_gather] in allgather.cpp), not the world's, which sockets
// between hosts decide.
AlgoOptions in_host_options(const AlgoOptions& o) {
  AlgoOptions inside = o;
  inside.small_all_gather_bytes = o.in_host_all_gather_bytes;
  inside.small_reduce_scatter_bytes = o.in_host_reduce_scatter_bytes;
  return inside;
}

// For the flat collective a column runs across hosts: its ranks are each on a host of their own (Note [Choosing by
// the link] in allreduce.cpp), `share` columns using every host's link at once.
AlgoOptions column_options(const AlgoOptions& o, int share) {
  AlgoOptions column = o;
  column.across_hosts = true;
  column.link_share = share;
  return column;
}

}  // namespace

// Note [Pipelined hierarchical all_reduce]
// Run one after the other, the three phases of Note [Hierarchical collectives]
// leave the hosts' links idle while the ranks reduce and gather inside their
// hosts: on 2 hosts of 2 ranks behind 1 Gbit/s links the hierarchical all_reduce
// reached 1.21-1.32x the flat ring, where the bytes say 1.5x. So the buffer is cut
// into K slices and the phases overlap, slice by slice, as NCCL's tree does:
// while the hosts' links carry slice k, the ranks reduce slice k+1 inside the host
// and gather slice k-1. Step i of the loop below:
//   reduce_in_host(i)   ring reduce-scatter of slice i inside the host (blocking,
//                       shared memory); then post its trip across hosts:
//                       part j of our column segment to the rank of our column on
//                       host j, and theirs of our part into scratch;
//   sum_and_return(i-1) wait for slice i-1's parts, add them into ours, post ours
//                       to every host and receive theirs in place;
//   gather_in_host(i-2) wait for slice i-2's parts, ring all-gather it inside the
//                       host (blocking).
// Across hosts this is a direct reduce-scatter + all-gather of each column
// segment (H-1 peers at once): the ring's bytes, 2(H-1)/H of the segment each
// way, in two steps whatever H, and every step only posts, so the link always has
// the next slice queued behind the one it carries. The transport moves every
// posted message in whichever wait the rank is in (MeshTransport::progress), so
// the inter-host bytes flow under the blocking ring phases; a SubTransport's
// wait_all waits only for its own requests. Every rank posts to each peer in the
// same order, so messages pair up without tags; the scratch is two slots of
// (H-1) parts, since slice i's parts arrive while slice i-1's are being added.
// Measured side by side (benchmarks/README.md, issue 26): 1.50-1.52x the flat
// ring at 4-64 MiB, against 1.27-1.32x for the same code in one slice.
//
// The slice size, from the cost model (benchmarks/cost_model.py, "hier-pipe"):
// the links carry n bytes whatever K, and what is not hidden is the pipeline's
// fill and drain (one slice's phases inside the host: 2(L-1)/L * s through shared
// memory) plus a latency per slice across hosts, alpha * n/s; the sum is least at
// s = sqrt(n * alpha/beta_shm * L/(L-1)). With alpha 54 us and 2.2 GB/s per pair
// (measured on this VM: benchmarks/README.md) alpha/beta_shm is ~120 KB, hence
// kSliceScaleBytes: 64 MiB goes in 4 MiB slices (16), 1 MiB in 512 KiB (2).
// With one rank per host there is nothing to overlap: one slice.
// AlgoOptions::hierarchical_slice_bytes (CX_HIER_SLICE_BYTES) forces a size,
// for tests; every rank must use the same.
//
// Where: from the size at which a column would run the ring or halving-doubling
// (n/L above the small all_reduce threshold: the direct exchange moves their
// bytes), on up to kPipelinedMaxHosts hosts (measured on 2; the direct exchange
// posts H-1 messages a step, which we have not measured on many hosts), and
// always with a slice set. Below, or on more hosts, the three phases run one
// after the other, the column by the flat algorithms (recursive doubling below
// the threshold: log2(H) steps, where the direct exchange would take 2 of H-1
// messages each).
namespace {

constexpr double kSliceScaleBytes = 128 * 1024;
constexpr int kPipelinedMaxHosts = 8;

// With a probe (Note [Fused non-finite check] in reduce_probe.h): the in-host
// reduce-scatter reads every rank's own values (named through the host's
// members); across hosts only host sums travel, so only the result is tested.
void all_reduce_in_phases(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op,
                          const AlgoOptions& o, const ProbeView* pv) {
  const int me = t.rank(), per_host = h.per_host, local = h.local_of[me];
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
  const AlgoOptions column = column_options(o, per_host);  // every column at once
  all_reduce(across, static_cast<char*>(buf) + off * dtype_size(dt), n, dt, summed(op), column,
             pv ? &across_v : nullptr);
  ring_all_gather_inplace(in_host, buf, count, dt, o);
  finish_avg(buf, count, dt, op, t.size());
}

size_t slice_count(size_t count, size_t es, int per_host, int n_hosts, const AlgoOptions& o) {
  const double bytes = static_cast<double>(count * es);
  double slice = static_cast<double>(o.hierarchical_slice_bytes);
  if (slice <= 0) {
    if (per_host == 1) return 1;
    slice = std::sqrt(bytes * kSliceScaleBytes * per_host / (per_host - 1));
  }
  const size_t k = static_cast<size_t>(std::ceil(bytes / std::max(slice, 1.0)));
  // Every part of every slice at least one element.
  return std::clamp<size_t>(k, 1, count / (static_cast<size_t>(per_host) * static_cast<size_t>(n_hosts)));
}

}  // namespace

// With a probe (Note [Fused non-finite check] in reduce_probe.h): each slice's
// in-host reduce-scatter reads every rank's own values; the sum of the hosts'
// parts (or, on one host, the reduce-scatter) finishes the result.
void all_reduce_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op,
                             const AlgoOptions& o, const ProbeView* pv) {
  const int me = t.rank(), per_host = h.per_host, local = h.local_of[me], host = h.host_of[me];
  const int n_hosts = static_cast<int>(h.ranks.size());
  if (count < static_cast<size_t>(per_host)) return all_reduce(t, buf, count, dt, op, o, pv);  // empty slices
  const size_t es = dtype_size(dt);
  const bool pipelined = n_hosts <= kPipelinedMaxHosts && count >= static_cast<size_t>(per_host) * n_hosts &&
                         (o.hierarchical_slice_bytes > 0 || count * es / per_host > o.small_allreduce_bytes);
  if (!pipelined) return all_reduce_in_phases(t, h, buf, count, dt, op, o, pv);
  if (pv) pv->probe->local_only = true;  // the in-host all-gathers carry no flags; the caller does the OR
  const std::vector<int>& host_ranks = h.ranks[static_cast<size_t>(host)];
  const size_t slices = slice_count(count, es, per_host, n_hosts, o);
  const ReduceOp sop = summed(op);
  char* const base = static_cast<char*>(buf);
  SubTransport in_host(t, h.ranks[static_cast<size_t>(host)]);
  SubTransport across(t, h.column(local));  // in host order: host j is rank j here

  // Slice k: elements [off, off + n) of buf; our column's segment of it (the one
  // the ring reduce-scatter leaves with us) starts at seg and is cut into
  // n_hosts parts, part j reduced by host j.
  struct Slice {
    size_t off, n, seg, seg_n;
    std::vector<Transport::Req> reqs;  // the trip across hosts under way
  };
  std::vector<Slice> s(slices);
  size_t most = 0;  // elements of our part, at most
  for (size_t k = 0; k < slices; ++k) {
    ring_segment(count, static_cast<int>(slices), static_cast<int>(k), &s[k].off, &s[k].n);
    size_t seg_off;
    ring_segment(s[k].n, per_host, (local + 1) % per_host, &seg_off, &s[k].seg_n);
    s[k].seg = s[k].off + seg_off;
    most = std::max(most, s[k].seg_n / n_hosts + 1);
  }
  auto part = [&](const Slice& sl, int j, size_t* off, size_t* n) {
    ring_segment(sl.seg_n, n_hosts, j, off, n);
    *off += sl.seg;
  };
  const size_t slot_elems = static_cast<size_t>(n_hosts - 1) * most;
  char* const scratch = between_phases(2 * slot_elems * es);
  auto theirs = [&](size_t k, int j) {  // where host j's sum of our part of slice k lands
    return scratch + ((k % 2) * slot_elems + static_cast<size_t>(j < host ? j : j - 1) * most) * es;
  };

  auto reduce_in_host = [&](size_t k) {
    Slice& sl = s[k];
    ProbeView in_v;
    if (pv) in_v = {pv->probe, &host_ranks, pv->base + sl.off, pv->raw, pv->result && n_hosts == 1};
    ring_reduce_scatter_inplace(in_host, base + sl.off * es, sl.n, dt, sop, o, pv ? &in_v : nullptr);
    size_t mine_off, mine_n;
    part(sl, host, &mine_off, &mine_n);
    for (int j = 0; j < n_hosts; ++j) {
      if (j == host) continue;
      size_t off, n;
      part(sl, j, &off, &n);
      sl.reqs.push_back(across.isend(j, base + off * es, n * es));
      sl.reqs.push_back(across.irecv(j, theirs(k, j), mine_n * es));
    }
  };
  auto sum_and_return = [&](size_t k) {
    Slice& sl = s[k];
    for (auto r : sl.reqs) across.wait(r);
    sl.reqs.clear();
    size_t mine_off, mine_n;
    part(sl, host, &mine_off, &mine_n);
    const int last = host == n_hosts - 1 ? n_hosts - 2 : n_hosts - 1;
    const ProbeView sum_v{pv ? pv->probe : nullptr, nullptr, pv ? pv->base : 0, false, pv && pv->result};
    for (int j = 0; j < n_hosts; ++j) {
      if (j != host)
        reduce_probed(base + mine_off * es, theirs(k, j), mine_n, dt, sop, pv ? &sum_v : nullptr, mine_off, -1, -1,
                      j == last);
    }
    for (int j = 0; j < n_hosts; ++j) {
      if (j == host) continue;
      size_t off, n;
      part(sl, j, &off, &n);
      sl.reqs.push_back(across.isend(j, base + mine_off * es, mine_n * es));
      sl.reqs.push_back(across.irecv(j, base + off * es, n * es));
    }
  };
  auto gather_in_host = [&](size_t k) {
    Slice& sl = s[k];
    for (auto r : sl.reqs) across.wait(r);
    sl.reqs.clear();
    ring_all_gather_inplace(in_host, base + sl.off * es, sl.n, dt, o);
    finish_avg(base + sl.off * es, sl.n, dt, op, t.size());
  };

  for (size_t i = 0; i < slices + 2; ++i) {
    if (i < slices) reduce_in_host(i);
    if (i >= 1 && i - 1 < slices) sum_and_return(i - 1);
    if (i >= 2) gather_in_host(i - 2);
  }
}

// reduce_scatter and all_gather overlap their halves host block by host block
// (as Note [Pipelined hierarchical all_reduce] does by slice), on up to
// kPipelinedMaxHosts hosts: the column's part is a direct exchange, posted at
// once, whose bytes move under the blocking shared-memory phases. reduce_scatter
// sums inside the host the blocks for each other host first and posts each sum
// to that host's rank of our column as soon as it is made; all_gather posts our
// block to every host and gathers inside the host ours first, then each host's
// block as it arrives.
//
// With a probe (Note [Fused non-finite check] in reduce_probe.h): every in-host
// reduce-scatter tests each of our host's ranks' own values as the flat one does
// (in-host rank i named as the host's i-th rank; its block i is the block for
// host j's i-th rank); only host sums cross hosts, so adding them in tests only
// the result, which the last addition finishes (with one host, the in-host
// reduce-scatter does).
void reduce_scatter_hierarchical(Transport& t, const Hierarchy& h, const void* const* ins, void* out, size_t count,
                                 DataType dt, ReduceOp op, const AlgoOptions& o, const ProbeView* pv) {
  const int me = t.rank(), host = h.host_of[me];
  const int n_hosts = static_cast<int>(h.ranks.size());
  const size_t block = count * dtype_size(dt);
  const std::vector<int>& host_ranks = h.ranks[static_cast<size_t>(host)];
  SubTransport in_host(t, host_ranks);
  SubTransport across(t, h.column(h.local_of[me]));
  const AlgoOptions inside = in_host_options(o);
  std::vector<const void*> blocks(static_cast<size_t>(h.per_host));
  auto sum_in_host = [&](int j, void* into) {  // our host's sum of the blocks for (host j, our local index)
    const std::vector<int>& theirs = h.ranks[static_cast<size_t>(j)];
    for (int i = 0; i < h.per_host; ++i) blocks[i] = ins[theirs[static_cast<size_t>(i)]];
    ProbeView v;
    if (pv)
      v = {pv->probe, &host_ranks, pv->base, pv->raw, pv->result && n_hosts == 1, pv->stride ? pv->stride : count,
           &theirs};
    reduce_scatter(in_host, blocks.data(), into, count, dt, summed(op), inside, pv ? &v : nullptr);
  };
  const ProbeView sums_v{pv ? pv->probe : nullptr, nullptr, 0, false, pv && pv->result};  // host sums: the result
  if (n_hosts > kPipelinedMaxHosts) {
    // One host after the other, then across hosts by column (the ring).
    char* partial = between_phases(static_cast<size_t>(n_hosts) * block);
    std::vector<const void*> partials(static_cast<size_t>(n_hosts));
    for (int j = 0; j < n_hosts; ++j) {
      sum_in_host(j, partial + j * block);
      partials[j] = partial + j * block;
    }
    reduce_scatter(across, partials.data(), out, count, dt, summed(op), o, pv ? &sums_v : nullptr);
    finish_avg(out, count, dt, op, t.size());
    return;
  }
  // [0, n_hosts): our sums for host j (j != ours); [n_hosts, 2 n_hosts): host j's sum for us.
  char* partial = between_phases(2 * static_cast<size_t>(n_hosts) * block);
  std::vector<Transport::Req> reqs;
  for (int j = 0; j < n_hosts; ++j) {
    if (j != host) reqs.push_back(across.irecv(j, partial + (n_hosts + j) * block, block));
  }
  for (int k = 1; k <= n_hosts; ++k) {  // the other hosts first, ours last
    const int j = (host + k) % n_hosts;
    if (j == host) {
      sum_in_host(j, out);
    } else {
      sum_in_host(j, partial + j * block);
      reqs.push_back(across.isend(j, partial + j * block, block));
    }
  }
  for (auto r : reqs) across.wait(r);
  const int last = host == n_hosts - 1 ? n_hosts - 2 : n_hosts - 1;  // its addition finishes our block
  for (int j = 0; j < n_hosts; ++j) {
    if (j != host)
      reduce_probed(out, partial + (n_hosts + j) * block, count, dt, summed(op), pv ? &sums_v : nullptr, 0, -1, -1,
                    j == last);
  }
  finish_avg(out, count, dt, op, t.size());
}

void all_gather_hierarchical(Transport& t, const Hierarchy& h, const void* in, void* const* outs, size_t bytes,
                             const AlgoOptions& o) {
  const int me = t.rank(), host = h.host_of[me];
  const int n_hosts = static_cast<int>(h.ranks.size());
  SubTransport in_host(t, h.ranks[static_cast<size_t>(host)]);
  SubTransport across(t, h.column(h.local_of[me]));
  char* theirs = between_phases(static_cast<size_t>(n_hosts) * bytes);  // host j's block of our column
  const AlgoOptions inside = in_host_options(o);
  std::vector<void*> local_outs(static_cast<size_t>(h.per_host));
  auto gather_in_host = [&](int j, const void* from) {
    for (int i = 0; i < h.per_host; ++i) local_outs[i] = outs[h.ranks[static_cast<size_t>(j)][static_cast<size_t>(i)]];
    all_gather(in_host, from, local_outs.data(), bytes, inside);
  };
  if (n_hosts > kPipelinedMaxHosts) {
    // Across hosts by column (the ring), then inside the host once per host's blocks.
    std::vector<void*> column_outs(static_cast<size_t>(n_hosts));
    for (int j = 0; j < n_hosts; ++j) column_outs[j] = theirs + j * bytes;
    all_gather(across, in, column_outs.data(), bytes, column_options(o, h.per_host));  // every column at once
    for (int j = 0; j < n_hosts; ++j) gather_in_host(j, theirs + j * bytes);
    return;
  }
  std::vector<Transport::Req> got(static_cast<size_t>(n_hosts)), sent;
  for (int j = 0; j < n_hosts; ++j) {
    if (j == host) continue;
    sent.push_back(across.isend(j, in, bytes));
    got[j] = across.irecv(j, theirs + j * bytes, bytes);
  }
  for (int k = 0; k < n_hosts; ++k) {  // ours first: its blocks are here already
    const int j = (host + k) % n_hosts;
    if (j != host) across.wait(got[j]);
    gather_in_host(j, j == host ? in : theirs + j * bytes);
  }
  for (auto r : sent) across.wait(r);
}

void broadcast_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t bytes, int root,
                            const AlgoOptions& o) {
  const int me = t.rank(), root_local = h.local_of[root];
  if (h.local_of[me] == root_local) {
    SubTransport across(t, h.column(root_local));
    // The root's column alone (Note [Broadcast between hosts] in broadcast.cpp), in host order.
    broadcast(across, buf, bytes, h.host_of[root], column_options(o, 1));
  }
  SubTransport in_host(t, h.ranks[static_cast<size_t>(h.host_of[me])]);
  broadcast(in_host, buf, bytes, root_local, o);
}

// Note [Reduce across hosts of several ranks]
// The flat binomial tree's root takes the message through its host's link from every child on another host (on 4
// hosts of 2 ranks, two of its three children). So a hierarchical reduce, like broadcast the other way round: every
// host reduces onto its rank in the root's column (the flat tree through shared memory), then that column reduces
// across hosts, one rank a host (Note [Reduce between hosts] in reduce.cpp: the chain in the link's chunks where
// the link was measured). AVG is summed in both and divided once at the root.
void reduce_hierarchical(Transport& t, const Hierarchy& h, void* buf, size_t count, DataType dt, ReduceOp op, int root,
                         const AlgoOptions& o) {
  const int me = t.rank(), root_local = h.local_of[root];
  {
    SubTransport in_host(t, h.ranks[static_cast<size_t>(h.host_of[me])]);
    reduce(in_host, buf, count, dt, summed(op), root_local, o);
  }
  if (h.local_of[me] == root_local) {
    SubTransport across(t, h.column(root_local));
    reduce(across, buf, count, dt, summed(op), h.host_of[root], column_options(o, 1));
  }
  if (me == root) finish_avg(buf, count, dt, op, t.size());
}

}  // namespace cx::distributed::algo
