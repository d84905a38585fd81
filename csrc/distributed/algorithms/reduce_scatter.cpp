#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

// Ring reduce-scatter that leaves the inputs untouched. At step s rank r sends
// its running partial of block (r-s-1) mod p to the right and receives the left
// neighbour's partial of block (r-s-2) mod p, adds its own input for that block
// and passes it on; after p-1 steps the partial of block r is complete and lands
// in `out`. The partials live in `out` itself, chunk by chunk: a chunk is received
// into its place in `out`, our input added, and sent on from there; its next
// receive is posted only once that send is complete. No scratch.
//
// Why not a pool of a few chunk slots (as before): a slot was reused only once
// the send that carried it was complete, and that send is queued behind our
// whole step-0 block on the connection to the right, which the neighbour reads
// only as fast as it posts receives, itself waiting on its slots: once a block
// outgrew the socket buffers every rank waited on a send nobody read (64 MiB on
// 4 ranks over TCP hung, on one host and across hosts). Here the receive of
// (step s, chunk c) waits only on the send of (s-1, c), which the neighbour
// takes with an earlier receive of its own, so the waits cannot close a cycle.
// At most one receive per chunk is in flight, so that two never share a place.
void reduce_scatter(Transport& t, const void* const* ins, void* out_v, size_t count, DataType dt, ReduceOp op,
                    const AlgoOptions& o) {
  const int p = t.size(), r = t.rank();
  const size_t es = dtype_size(dt);
  char* out = static_cast<char*>(out_v);
  if (p == 1) {
    if (out != ins[0] && count) std::memmove(out, ins[0], count * es);
    return;
  }
  const int left = (r - 1 + p) % p, right = (r + 1) % p;
  const size_t ce = std::max<size_t>(1, std::min(count, o.chunk_bytes / es));
  const size_t nc = count == 0 ? 1 : (count + ce - 1) / ce;
  auto range = [&](size_t c, size_t* off, size_t* n) {
    *off = c * ce;
    *n = std::min(count - std::min(count, *off), ce);
  };
  auto mod = [p](int x) { return ((x % p) + p) % p; };
  auto in_at = [&](int blk, size_t off) { return static_cast<const char*>(ins[blk]) + off * es; };

  for (size_t c = 0; c < nc; ++c) {  // step 0: our raw input for block r-1
    size_t off, n;
    range(c, &off, &n);
    t.isend(right, in_at(mod(r - 1), off), n * es);
  }
  std::vector<Transport::Req> sending(nc, -1);  // the send of out's chunk c still on the wire

  struct Item {
    int step;
    size_t chunk;
  };
  std::vector<Item> items;
  for (int s = 0; s < p - 1; ++s)
    for (size_t c = 0; c < nc; ++c) items.push_back({s, c});

  std::deque<std::pair<Transport::Req, size_t>> inflight;
  const size_t window = std::min(nc, static_cast<size_t>(std::max(1, o.depth)));
  size_t next = 0;
  auto post = [&](size_t k) {
    const size_t c = items[k].chunk;
    size_t off, n;
    range(c, &off, &n);
    if (sending[c] >= 0) t.wait(sending[c]);  // its partial of the step before is still leaving
    sending[c] = -1;
    inflight.emplace_back(t.irecv(left, out + off * es, n * es), k);
  };
  while (next < items.size() && inflight.size() < window) post(next++);
  while (!inflight.empty()) {
    auto [req, k] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    const Item& it = items[k];
    const int blk = mod(r - it.step - 2);
    size_t off, n;
    range(it.chunk, &off, &n);
    reduce_into(out + off * es, in_at(blk, off), n, dt, op);
    if (it.step == p - 2) {
      finish_avg(out + off * es, n, dt, op, p);
    } else {
      sending[it.chunk] = t.isend(right, out + off * es, n * es);
    }
    if (next < items.size()) post(next++);
  }
  t.wait_all();
}

}  // namespace cx::distributed::algo
