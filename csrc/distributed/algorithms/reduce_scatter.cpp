#include <cstring>
#include <deque>
#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/scratch.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

// Ring reduce-scatter that leaves the inputs untouched. At step s rank r sends
// its running partial of block (r-s-1) mod p to the right and receives the left
// neighbour's partial of block (r-s-2) mod p, adds its own input for that block
// and passes it on; after p-1 steps the partial of block r is complete and lands
// in `out`. Partials live in a pool of `depth` chunk-sized slots: a slot is
// reused only once the send that carried it is complete, so scratch stays a few
// chunks whatever the message size.
//
// Note [Reduce-scatter in groups of chunks]
// The chunks go around the ring in groups of g = depth/2 (at least 1): every
// step of one group, then the next group. Done step by step over the whole
// message instead (every chunk's raw input first, then every chunk's step 1,
// ...), the ring deadlocked once a block held more chunks than the slots and
// the transport's buffers together (4 ranks, 64 MiB, over TCP and shared
// memory alike): a rank's first forwarded partial queued behind all of its raw
// chunks, which its right neighbour could only take into slots freed by its own
// forwarded partials, queued behind its own raw chunks, all around the ring.
// With 2g <= depth the receives of a group's step s+1 never wait for a slot
// still holding one of its step s partials, so each step's receives can be
// posted once the step before last was sent, and that needs only the right
// neighbour to have posted the step before: progress by induction on the step.
// A group's raw chunks are sent once the previous group's last partial is
// (the order the right neighbour posts its receives in). Two ranks forward
// nothing (every receive lands in `out`): all raw chunks go at once.
//
// With a probe (Note [Fused non-finite check] in reduce_probe.h) the reductions
// test what they add: at every step our input is our own values (`theirs` for
// sum_probed, which adds it into the partial that arrived), and at step 0 the
// partial that arrives is the left neighbour's raw input, which it sent unread
// (`ours`: the destination's values). So each rank's own value of each element is
// tested exactly once, and the last step tests the sums it finishes: a rank learns
// whether its block of the result is finite, and nothing more travels.
void reduce_scatter(Transport& t, const void* const* ins, void* out_v, size_t count, DataType dt, ReduceOp op,
                    const AlgoOptions& o, const ProbeView* pv) {
  const int p = t.size(), r = t.rank();
  const size_t es = dtype_size(dt);
  char* out = static_cast<char*>(out_v);
  // Where element `off` of block `blk` is recorded, past pv->base.
  auto at = [&](int blk, size_t off) { return pv->block(blk) * (pv->stride ? pv->stride : count) + off; };
  if (p == 1) {
    if (out != ins[0] && count) std::memmove(out, ins[0], count * es);
    if (pv && count) {
      if (pv->raw) probe_whole(*pv->probe, static_cast<const float*>(ins[0]), count, pv->base + at(0, 0),
                               pv->group_rank(0), true);
      if (pv->result) probe_whole(*pv->probe, reinterpret_cast<const float*>(out), count, 0, 0, false);
    }
    return;
  }
  // p >= 4: Note [Reduce-scatter on a world that is not a power of two] in allreduce_hd.cpp
  if (!pv && count && p >= 4 && count * es <= o.small_reduce_scatter_bytes) {
    reduce_scatter_halving(t, ins, out, count, dt, op, o);
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

  const size_t depth = static_cast<size_t>(std::max(2, o.depth));
  const size_t group = p == 2 ? nc : std::max<size_t>(1, depth / 2);  // Note [Reduce-scatter in groups of chunks]
  auto send_raw = [&](size_t first) {  // step 0 of the group starting at chunk `first`: our raw input for block r-1
    for (size_t c = first; c < std::min(nc, first + group); ++c) {
      size_t off, n;
      range(c, &off, &n);
      t.isend(right, in_at(mod(r - 1), off), n * es);
    }
  };
  send_raw(0);
  char* slots = scratch_space(depth * ce * es);
  std::vector<Transport::Req> slot_send(depth, -1);

  struct Item {
    int step;
    size_t chunk;
    bool last_forward;  // the group's last partial passed on: the next group's raw chunks follow it
  };
  std::vector<Item> items;
  for (size_t g0 = 0; g0 < nc; g0 += group) {
    const size_t g1 = std::min(nc, g0 + group);
    for (int s = 0; s < p - 1; ++s)
      for (size_t c = g0; c < g1; ++c) items.push_back({s, c, s == p - 3 && c == g1 - 1});
  }

  std::deque<std::pair<Transport::Req, size_t>> inflight;
  size_t next = 0;
  auto post = [&](size_t k) {
    const Item& it = items[k];
    size_t off, n;
    range(it.chunk, &off, &n);
    char* dst;
    if (it.step == p - 2) {
      dst = out + off * es;
    } else {
      size_t slot = k % depth;
      if (slot_send[slot] >= 0) t.wait(slot_send[slot]);  // slot still on the wire
      slot_send[slot] = -1;
      dst = slots + slot * ce * es;
    }
    inflight.emplace_back(t.irecv(left, dst, n * es), k);
  };
  while (next < items.size() && inflight.size() + 1 < depth) post(next++);
  while (!inflight.empty()) {
    auto [req, k] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    const Item& it = items[k];
    const int blk = mod(r - it.step - 2);
    size_t off, n;
    range(it.chunk, &off, &n);
    // Our own input goes into the partial that arrived (at step 0, the left neighbour's own values).
    const size_t e = pv ? at(blk, off) : 0;
    if (it.step == p - 2) {
      reduce_probed(out + off * es, in_at(blk, off), n, dt, op, pv, e, it.step == 0 ? left : -1, r, true);
      finish_avg(out + off * es, n, dt, op, p);
    } else {
      char* slot = slots + (k % depth) * ce * es;
      reduce_probed(slot, in_at(blk, off), n, dt, op, pv, e, it.step == 0 ? left : -1, r, false);
      slot_send[k % depth] = t.isend(right, slot, n * es);
      if (it.last_forward && it.chunk + 1 < nc) send_raw(it.chunk + 1);
    }
    if (next < items.size()) post(next++);
  }
  t.wait_all();
}

}  // namespace cx::distributed::algo
