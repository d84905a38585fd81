#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/scratch.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

namespace {
enum class Algo { kRecursiveDoubling, kHalvingDoubling, kRing };

// Note [Choosing by the link]
// The thresholds below (Note [small all_reduce threshold] in cpu_backend.cpp) were measured over loopback,
// where a message costs tens of microseconds and a byte a fraction of a nanosecond: recursive doubling, whose
// log2(p) steps each carry the whole message, wins up to 512 KiB there. Between hosts the balance is the
// link's: behind 1 Gbit/s links (network namespaces, 4 and 3 hosts of one rank) halving-doubling and the ring
// were 1.33x and 1.5-2.3x faster than recursive doubling at 8-512 KiB. So where the ranks of a transport are
// each on a host of their own and at least three, and the link was measured at init (CpuBackend::
// measure_link: rank 0 times round trips of 8 bytes and of 1 MiB to a rank on another host, and sends every
// rank the same two numbers, so every rank chooses alike), all_reduce takes the cheapest of the three by the
// alpha-beta model benchmarks/cost_model.py validates (within 13% on those links), the links' time per byte
// multiplied by the transports that share them at once (a hierarchical column's neighbours):
//   recursive doubling  (log2 q + 2 [q != p]) (a + n b)        q = the largest power of two <= p
//   halving-doubling    2 log2 p a + 2 n b (p-1)/p           p a power of two >= 4, n <= its bound
//   ring                2 (p-1) (a + n/p b)
// Up to 4 KiB recursive doubling stays: its fewer steps won there on every link measured (on 3 hosts the
// model's ring lost 0.42-0.62x at 512 B-2 KiB behind the namespaces' token buckets, which let a burst of
// 128 KiB through at the veth's speed; a real 1 Gbit/s NIC puts 2 KiB on the wire in 16 us, and even then the
// model crosses over near 4 KiB). With two ranks the rule stays too (recursive doubling is the cheaper of the
// two in the model at any size), and CX_SMALL_ALLREDUCE_BYTES set by the user keeps the thresholds everywhere
// (nothing is measured).
constexpr size_t kByLinkFromBytes = 4096;

Algo by_link(int p, size_t bytes, const AlgoOptions& o, bool hd) {
  const double a = o.link_alpha, b = o.link_beta * std::max(1, o.link_share), n = static_cast<double>(bytes);
  int lg = 0;
  while ((2 << lg) <= p) ++lg;
  const double rd = (lg + ((1 << lg) != p ? 2 : 0)) * (a + n * b);
  const double ring = 2.0 * (p - 1) * (a + n / p * b);
  const double hdc = 2.0 * lg * a + 2.0 * n * b * (p - 1) / p;
  // Recursive doubling needs a scratch copy of the message: never above the loopback threshold, whatever the
  // numbers say (a link measured faster than it is would otherwise ask for it at any size).
  const bool rd_ok = bytes <= o.small_allreduce_bytes;
  if (hd && hdc <= ring && (!rd_ok || hdc < rd)) return Algo::kHalvingDoubling;
  return rd_ok && rd <= ring ? Algo::kRecursiveDoubling : Algo::kRing;
}

// Which algorithm all_reduce runs for `count` elements of `es` bytes (every
// rank decides alike: the choice depends only on sizes and options).
Algo choose(const Transport& t, size_t count, size_t es, const AlgoOptions& o) {
  const size_t bytes = count * es;
  if (count < static_cast<size_t>(t.size())) return Algo::kRecursiveDoubling;
  const bool hd = t.size() >= 4 && (t.size() & (t.size() - 1)) == 0 && bytes <= o.halving_doubling_max_bytes;
  if (o.across_hosts && o.link_beta > 0 && t.size() >= 3 && bytes > kByLinkFromBytes)
    return by_link(t.size(), bytes, o, hd);
  if (bytes <= o.small_allreduce_bytes) return Algo::kRecursiveDoubling;
  return hd ? Algo::kHalvingDoubling : Algo::kRing;
}
}  // namespace

void all_reduce(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op, const AlgoOptions& o,
                const ProbeView* pv) {
  if (t.size() == 1) {  // nothing to combine: our values are the result (Note [Fused non-finite check])
    if (pv && (pv->raw || pv->result))
      probe_whole(*pv->probe, static_cast<const float*>(buf), count, pv->base, pv->group_rank(0), pv->raw);
    return;
  }
  switch (choose(t, count, dtype_size(dt), o)) {
    case Algo::kRecursiveDoubling: all_reduce_recursive_doubling(t, buf, count, dt, op, pv); break;
    case Algo::kHalvingDoubling: all_reduce_halving_doubling(t, buf, count, dt, op, o, pv); break;
    case Algo::kRing: all_reduce_ring(t, buf, count, dt, op, o, pv); break;
  }
}

// Recursive doubling, with the usual fold for a world that is not a power of
// two: of the first 2*rem ranks, each even one hands its data to the odd one
// above it and sits out; the remaining pof2 ranks exchange whole buffers with
// partners at distance 1, 2, 4, ...; the odd ranks finally hand the result back.
// Each combination step joins the same two partial results on both partners, and
// a op b == b op a bitwise for IEEE +, *, min and max, so every rank ends with
// identical bits.
void all_reduce_recursive_doubling(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op,
                                   const ProbeView* pv) {
  const int p = t.size(), r = t.rank();
  const size_t bytes = count * dtype_size(dt);
  char* scratch = scratch_space(bytes);
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  const int rem = p - pof2;
  if (pv && rem) pv->probe->local_only = true;  // the folded ranks do not see the result's flag

  int newrank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      t.wait(t.isend(r + 1, buf, bytes));
      newrank = -1;
    } else {
      t.wait(t.irecv(r - 1, scratch, bytes));
      // Our own values, and the even rank's, which it never reads itself.
      reduce_probed(buf, scratch, count, dt, op, pv, 0, r, r - 1, false);
      newrank = r / 2;
    }
  } else {
    newrank = r - rem;
  }
  if (newrank >= 0) {
    for (int mask = 1; mask < pof2; mask <<= 1) {
      int np = newrank ^ mask;
      int partner = np < rem ? np * 2 + 1 : np + rem;
      auto s = t.isend(partner, buf, bytes);
      auto rv = t.irecv(partner, scratch, bytes);
      t.wait(rv);
      t.wait(s);
      // Our own values at our first combination (unless the fold came first); the last one finishes.
      const bool first = mask == 1 && r >= 2 * rem;
      reduce_probed(buf, scratch, count, dt, op, pv, 0, first ? r : -1, -1, mask * 2 >= pof2);
    }
  }
  if (r < 2 * rem) {
    if (r % 2 == 1) {
      t.wait(t.isend(r - 1, buf, bytes));
    } else {
      t.wait(t.irecv(r + 1, buf, bytes));
    }
  }
  finish_avg(buf, count, dt, op, p);
}

// Ring all-reduce as one pipeline of chunks.
//
// The buffer is cut into p segments (sizes differ by at most one element) and
// each segment into chunks of at most chunk_bytes. Over 2(p-1) steps, at step s
// rank r receives segment (r-s-1) mod p from its left neighbour and sends
// segment (r-s) mod p to its right one. The first p-1 steps are the
// reduce-scatter: a received chunk lands in scratch and is reduced into the
// caller's buffer, so after step p-2 rank r holds the full reduction of segment
// (r+1) mod p. The last p-1 steps are the all-gather: received chunks land
// straight in the caller's buffer.
//
// The segment sent at step s+1 is exactly the one received at step s, so every
// chunk is forwarded to the right as soon as it has been received (and reduced):
// no step waits for the previous one to finish, the wire never idles while we
// reduce, and the only scratch is `depth` chunks whatever the message size.
//
// Why the in-place buffer is safe: a region we receive into during the
// all-gather was last sent by us during the reduce-scatter, and its final value
// can only reach us after our own contribution went round the ring, i.e. after
// that send completed.
//
// `Data` says what the bytes on the wire are made of (PlainData: the caller's
// buffer itself; CastData: Note [Cast on the wire]):
//   wire(off)                   where element `off` travels from and lands
//   own(off, n)                 before our own segment's first send
//   reduce(off, n, in, first, last)  a reduce-scatter chunk arrived in `in` (`first`: at step 0, so it
//                               holds the left neighbour's own values); `last`: it is now complete
//   gathered(off, n)            an all-gather chunk arrived at wire(off)
namespace {

// Steps [first, end) of the 2(p-1): all of them for all_reduce; [0, p-1) is the
// reduce-scatter alone (rank r ends holding segment (r+1) mod p reduced), and
// [p-1, 2(p-1)) the all-gather alone (which starts from there): the hierarchical
// all_reduce runs the two halves inside a host with an all_reduce across hosts
// in between (hierarchical.cpp).
template <typename Data>
void ring(Transport& t, size_t count, size_t es, const AlgoOptions& o, Data& data, int first, int end) {
  const int p = t.size(), r = t.rank();
  const int left = (r - 1 + p) % p, right = (r + 1) % p;
  // No larger than a segment, so small messages ask for little scratch.
  const size_t chunk_elems = std::max<size_t>(1, std::min(count / p + 1, o.chunk_bytes / es));

  std::vector<size_t> seg_off(static_cast<size_t>(p) + 1);
  for (int i = 0; i < p; ++i) {
    size_t n = count / p + (static_cast<size_t>(i) < count % p ? 1 : 0);
    seg_off[i + 1] = seg_off[i] + n;
  }
  auto seg_chunks = [&](int seg) {
    size_t n = seg_off[seg + 1] - seg_off[seg];
    return (n + chunk_elems - 1) / chunk_elems;
  };
  auto chunk_range = [&](int seg, size_t c, size_t* off, size_t* n) {
    size_t begin = seg_off[seg] + c * chunk_elems;
    size_t end = std::min(seg_off[seg + 1], begin + chunk_elems);
    *off = begin;
    *n = end - begin;
  };
  auto mod = [p](int x) { return ((x % p) + p) % p; };

  // The receive sequence: (step, chunk) in order.
  // With a probe that finishes the result (Note [Fused non-finite check]), a
  // flag word follows each all-gather step's segment: the OR of the finished
  // segments' flags seen so far, so after the last step every rank has all p.
  bool* flag = first == 0 && count >= static_cast<size_t>(p) ? data.result_flag() : nullptr;
  std::vector<uint32_t> flag_in(flag ? 2 * p : 0), flag_out(flag ? 2 * p : 0);
  struct Item {
    int step;
    size_t chunk;
    bool is_flag;
  };
  std::vector<Item> items;
  for (int s = first; s < end; ++s) {
    size_t nc = seg_chunks(mod(r - s - 1));
    for (size_t c = 0; c < nc; ++c) items.push_back({s, c, false});
    if (flag && s >= p - 1) items.push_back({s, 0, true});
  }
  auto send_flag = [&](int step) {
    flag_out[step] = *flag ? 1u : 0u;
    t.isend(right, &flag_out[step], sizeof(uint32_t));
  };

  const int depth = std::max(1, o.depth);
  char* scratch = scratch_space(static_cast<size_t>(depth) * chunk_elems * es);

  // The first step: our own segment (at step 0; the one we completed, at step
  // p-1) goes out whole, chunk by chunk.
  if (first < end) {
    int seg = mod(r - first);
    for (size_t c = 0; c < seg_chunks(seg); ++c) {
      size_t off, n;
      chunk_range(seg, c, &off, &n);
      if (first == 0) data.own(off, n);
      t.isend(right, data.wire(off), n * es);
    }
  }

  std::deque<std::pair<Transport::Req, size_t>> inflight;  // (request, item index)
  size_t next_post = 0;
  auto post = [&](size_t k) {
    const Item& it = items[k];
    if (it.is_flag) {
      inflight.emplace_back(t.irecv(left, &flag_in[it.step], sizeof(uint32_t)), k);
      return;
    }
    size_t off, n;
    chunk_range(mod(r - it.step - 1), it.chunk, &off, &n);
    void* dst = it.step < p - 1 ? static_cast<void*>(scratch + (k % depth) * chunk_elems * es)
                                 : static_cast<void*>(data.wire(off));
    inflight.emplace_back(t.irecv(left, dst, n * es), k);
  };
  while (next_post < items.size() && inflight.size() < static_cast<size_t>(depth)) post(next_post++);

  while (!inflight.empty()) {
    auto [req, k] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    const Item& it = items[k];
    if (it.is_flag) {
      if (flag_in[it.step]) *flag = true;
      if (next_post < items.size()) post(next_post++);
      if (it.step + 1 < end) send_flag(it.step + 1);
      continue;
    }
    const int seg = mod(r - it.step - 1);
    size_t off, n;
    chunk_range(seg, it.chunk, &off, &n);
    if (it.step < p - 1)
      data.reduce(off, n, scratch + (k % depth) * chunk_elems * es, it.step == 0, it.step == p - 2);
    else
      data.gathered(off, n);
    if (next_post < items.size()) post(next_post++);  // its scratch slot (k % depth) is free again
    if (it.step + 1 < end) t.isend(right, data.wire(off), n * es);
    if (flag && it.step == p - 2 && p - 1 < end && it.chunk + 1 == seg_chunks(seg)) send_flag(p - 1);  // finished
  }
  t.wait_all();
}

// With a probe: every reduce-scatter step adds into our own values (untouched
// until then), and step 0 brings the left neighbour's own segment, which it
// sent unread (Note [Fused non-finite check] in reduce_probe.h).
struct PlainData {
  char* buf;
  size_t es;
  DataType dt;
  ReduceOp op;
  int p;
  const ProbeView* pv = nullptr;
  int me = 0, left = 0;
  char* wire(size_t off) const { return buf + off * es; }
  bool* result_flag() const { return pv && pv->result ? &pv->probe->result_bad : nullptr; }
  void own(size_t, size_t) const {}
  void reduce(size_t off, size_t n, const char* in, bool first, bool last) const {
    reduce_probed(wire(off), in, n, dt, op, pv, off, me, first ? left : -1, last);
    if (last) finish_avg(wire(off), n, dt, op, p);
  }
  void gathered(size_t, size_t) const {}
};

// Note [Cast on the wire]
// The 16-bit communication hooks (train/comm_hooks.cpp) all-reduce float32
// gradients as float16 or bfloat16: each rank's values times `scale` rounded to
// the 16-bit type, summed in it (rounding after every addition), and the sum
// widened back. Done as three passes (narrow the whole buffer, all-reduce the
// 16-bit copy, widen it back) that is two extra trips through memory for every
// element, which on a machine whose ranks share memory bandwidth costs about
// what halving the bytes saves. Here the casts ride in the ring instead, each
// on a chunk at the moment the ring touches it, while it is in cache: our own
// segment is narrowed just before its first send; every other segment of ours
// is narrowed inside the reduction with the chunk that arrives for it
// (narrow_sum); and a chunk is widened into the float32 buffer the moment it is
// complete (the last reduction, or its arrival in the all-gather). The float32
// values are read once and written once, and the 16-bit copy is only ever
// touched chunk by chunk. The bytes on the wire, the chunking and every
// rounding are those of the three-pass form (narrow_sum rounds our value before
// adding, as narrow then reduce_into would), so the results are bit for bit the
// same, on every rank.
//
// With a probe (DDP's check with the fp16/bf16 hooks: Note [Fused non-finite
// check] in reduce_probe.h) the casts test what they touch, in the same loop: a
// narrowing reads each of our own float32 values exactly once (narrow or
// narrow_sum), so it tests them (only a chunk found bad is read again, to record
// where); every widening writes an element of the result, and every rank widens
// every element, so each learns whether the whole result is finite: the same
// answer on every rank, with nothing added on the wire.
struct CastData {
  float* buf;
  uint16_t* w;
  DataType wire_dt;
  float scale;
  ReduceProbe* probe = nullptr;
  int rank = 0;
  uint16_t* wire(size_t off) const { return w + off; }
  bool* result_flag() const { return nullptr; }
  bool blame() const { return probe && probe->blame; }
  void own(size_t off, size_t n) const {
    if (!blame()) return narrow(buf + off, scale, w + off, n, wire_dt);
    if (narrow_tested(buf + off, scale, w + off, n, wire_dt)) probe_whole(*probe, buf + off, n, off, rank, true);
  }
  void reduce(size_t off, size_t n, const char* in, bool, bool last) const {
    const auto* recv = reinterpret_cast<const uint16_t*>(in);
    if (!blame())
      narrow_sum(buf + off, scale, recv, w + off, n, wire_dt);
    else if (narrow_sum_tested(buf + off, scale, recv, w + off, n, wire_dt))
      probe_whole(*probe, buf + off, n, off, rank, true);  // still our own values: widened below
    if (last) gathered(off, n);
  }
  void gathered(size_t off, size_t n) const {
    if (!probe) return widen(w + off, buf + off, n, wire_dt);
    if (widen_tested(w + off, buf + off, n, wire_dt)) probe->result_bad = true;
  }
};

}  // namespace

void all_reduce_ring(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op, const AlgoOptions& o,
                     const ProbeView* pv) {
  const int p = t.size();
  PlainData data{static_cast<char*>(buf), dtype_size(dt), dt, op, p, pv, t.rank(), (t.rank() + p - 1) % p};
  ring(t, count, data.es, o, data, 0, 2 * (p - 1));
}

void ring_reduce_scatter_inplace(Transport& t, void* buf, size_t count, DataType dt, ReduceOp op,
                                 const AlgoOptions& o, const ProbeView* pv) {
  const int p = t.size();
  PlainData data{static_cast<char*>(buf), dtype_size(dt), dt, op, p, pv, t.rank(), (t.rank() + p - 1) % p};
  ring(t, count, data.es, o, data, 0, p - 1);
}

void ring_all_gather_inplace(Transport& t, void* buf, size_t count, DataType dt, const AlgoOptions& o) {
  PlainData data{static_cast<char*>(buf), dtype_size(dt), dt, ReduceOp::kSum, t.size()};
  ring(t, count, data.es, o, data, t.size() - 1, 2 * (t.size() - 1));
}

void ring_segment(size_t count, int p, int seg, size_t* off, size_t* n) {
  const size_t base = count / static_cast<size_t>(p), extra = count % static_cast<size_t>(p);
  const size_t s = static_cast<size_t>(seg);
  *off = s * base + std::min(s, extra);
  *n = base + (s < extra ? 1 : 0);
}

void all_reduce_cast(Transport& t, float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale,
                     const AlgoOptions& o, ReduceProbe* probe, int rank) {
  if (!count) return;
  CastData data{buf, wire, wire_dt, scale, probe, rank};
  if (t.size() == 1 || choose(t, count, 2, o) != Algo::kRing) {
    // The whole-buffer algorithms (and one rank): three passes (narrow, the
    // all_reduce all_reduce picks for these 16-bit bytes, widen), tested alike.
    data.own(0, count);
    all_reduce(t, wire, count, wire_dt, ReduceOp::kSum, o);
    data.gathered(0, count);
    return;
  }
  ring(t, count, 2, o, data, 0, 2 * (t.size() - 1));
}

}  // namespace cx::distributed::algo
