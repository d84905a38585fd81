#include <algorithm>
#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/chunks.h"
#include "distributed/algorithms/scratch.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

namespace {

// Note [Reduce between hosts]
// The binomial tree's root receives the whole message from each of its ceil(log2 p) children, all through its one
// link: behind 1 Gbit/s links (network namespaces, a rank a host) reduce ran at half the link's rate on 3 and 4
// hosts and a third on 8, at every size from 128 KiB. The chain below moves the message once through every link,
// as broadcast's chain does the other way, so between hosts it takes the broadcast's rule: where the ranks are
// each on a host of their own, at least three, and the link was measured at init, above small_broadcast_bytes,
// the chain in the link's chunks (Note [The chain's chunk between hosts] in broadcast.cpp) unless the model gives
// the tree at most kTreeShare of its time (Note [Broadcast between hosts]). Measured side by side with the tree
// (benchmarks/README.md, "Reduce between hosts"): 2.0x its speed on 3 and 4 hosts, 2.8-3.0x on 8. On one host the
// tree stays: over loopback the chain took 1.0-1.7x its time on 3 and 4 ranks at 64 KiB-64 MiB, and through
// shared memory it won at 1-16 MiB (0.49-0.88x) but lost at 64 KiB and 64 MiB on 3 ranks (1.27x, 1.36x).
//
// Pipelined chain toward `root`: rank root+p-1 sends its buffer chunk by chunk to root+p-2, which adds each chunk
// into its own and passes it on, ..., to the root; up to `depth` chunks are received ahead. Every rank receives
// and sends the message once (the tree's root receives it ceil(log2 p) times). Scratch: `depth` chunks.
void reduce_chain(Transport& t, void* buf_v, size_t count, DataType dt, ReduceOp op, int root, size_t chunk,
                  int depth) {
  const int p = t.size(), vr = (t.rank() - root + p) % p;
  const int toward = (t.rank() - 1 + p) % p, from = (t.rank() + 1) % p;
  const size_t es = dtype_size(dt);
  char* buf = static_cast<char*>(buf_v);
  const size_t ce = std::max<size_t>(1, std::min(count, chunk / es));  // elements a chunk
  const size_t nc = chunk_count(count, ce);
  if (vr == p - 1) {
    for (size_t c = 0; c < nc; ++c) {
      size_t off, n;
      chunk_at(count, ce, c, &off, &n);
      t.isend(toward, buf + off * es, n * es);
    }
    t.wait_all();
    return;
  }
  const size_t slots = std::min<size_t>(nc, static_cast<size_t>(std::max(1, depth)));
  char* scratch = scratch_space(slots * ce * es);
  std::vector<Transport::Req> reqs(slots);
  auto post = [&](size_t c) {
    size_t off, n;
    chunk_at(count, ce, c, &off, &n);
    reqs[c % slots] = t.irecv(from, scratch + (c % slots) * ce * es, n * es);
  };
  for (size_t c = 0; c < slots; ++c) post(c);
  for (size_t c = 0; c < nc; ++c) {
    size_t off, n;
    chunk_at(count, ce, c, &off, &n);
    t.wait(reqs[c % slots]);
    reduce_into(buf + off * es, scratch + (c % slots) * ce * es, n, dt, op);
    if (vr > 0) t.isend(toward, buf + off * es, n * es);
    if (c + slots < nc) post(c + slots);  // its slot is free: this chunk is added in
  }
  t.wait_all();
  if (vr == 0) finish_avg(buf, count, dt, op, p);
}

}  // namespace

// Binomial-tree reduce toward `root`, chunk by chunk: a rank adds each child's
// partial for a chunk into its own buffer and passes the chunk up while the next
// one is still arriving. Scratch: one chunk per child. Between hosts, the chain above
// (Note [Reduce between hosts]).
void reduce(Transport& t, void* buf_v, size_t count, DataType dt, ReduceOp op, int root, const AlgoOptions& o) {
  const int p = t.size();
  if (p == 1) return;
  const size_t bytes = count * dtype_size(dt);
  if (o.across_hosts && o.link_beta > 0 && p >= 3 && bytes > o.small_broadcast_bytes) {
    const size_t chunk = chain_chunk_by_link(p, bytes, o);
    if (!tree_by_link(p, bytes, chunk, o)) {
      reduce_chain(t, buf_v, count, dt, op, root, chunk, o.depth);
      return;
    }
  }
  const int vr = (t.rank() - root + p) % p;
  const size_t es = dtype_size(dt);
  char* buf = static_cast<char*>(buf_v);
  std::vector<int> children;
  int parent = -1;
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      parent = ((vr - mask) + root) % p;
      break;
    }
    if (vr + mask < p) children.push_back(((vr + mask) + root) % p);
  }
  const size_t ce = std::max<size_t>(1, std::min(count, o.chunk_bytes / es));
  const size_t nc = count == 0 ? 1 : (count + ce - 1) / ce;
  char* scratch = scratch_space(children.size() * ce * es);
  std::vector<Transport::Req> reqs(children.size());
  for (size_t c = 0; c < nc; ++c) {
    size_t off = c * ce, n = std::min(count - std::min(count, off), ce);
    for (size_t i = 0; i < children.size(); ++i) reqs[i] = t.irecv(children[i], scratch + i * ce * es, n * es);
    for (size_t i = 0; i < children.size(); ++i) {
      t.wait(reqs[i]);
      reduce_into(buf + off * es, scratch + i * ce * es, n, dt, op);
    }
    if (parent >= 0) t.isend(parent, buf + off * es, n * es);
  }
  t.wait_all();
  if (vr == 0) finish_avg(buf, count, dt, op, p);
}

}  // namespace cx::distributed::algo
