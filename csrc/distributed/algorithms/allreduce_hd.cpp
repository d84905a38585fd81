#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/scratch.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

namespace {

// Sends buf[give) to `partner` while receiving its copy of buf[keep) into scratch
// and reducing it in, chunk by chunk (depth chunks in flight). Element ranges.
void exchange_reduce(Transport& t, int partner, char* buf, size_t give_lo, size_t give_hi, size_t keep_lo,
                     size_t keep_hi, DataType dt, ReduceOp op, size_t ce, size_t depth, char* scratch,
                     const ProbeView* pv, int ours, int theirs, bool finishes) {
  const size_t es = dtype_size(dt);
  for (size_t o = give_lo; o < give_hi; o += ce) t.isend(partner, buf + o * es, (std::min(give_hi, o + ce) - o) * es);
  const size_t n = keep_hi - keep_lo, nc = (n + ce - 1) / ce;
  std::deque<std::pair<Transport::Req, size_t>> inflight;
  size_t next = 0;
  auto post = [&] {
    size_t o = keep_lo + next * ce;
    inflight.emplace_back(t.irecv(partner, scratch + (next % depth) * ce * es, (std::min(keep_hi, o + ce) - o) * es),
                          next);
    ++next;
  };
  while (next < nc && inflight.size() < depth) post();
  while (!inflight.empty()) {
    auto [req, c] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    size_t o = keep_lo + c * ce;
    reduce_probed(buf + o * es, scratch + (c % depth) * ce * es, std::min(keep_hi, o + ce) - o, dt, op, pv, o, ours,
                  theirs, finishes);
    if (next < nc) post();
  }
  t.wait_all();
}

void exchange_copy(Transport& t, int partner, char* buf, size_t send_lo, size_t send_hi, size_t recv_lo,
                   size_t recv_hi, size_t es, size_t ce) {
  for (size_t o = send_lo; o < send_hi; o += ce) t.isend(partner, buf + o * es, (std::min(send_hi, o + ce) - o) * es);
  for (size_t o = recv_lo; o < recv_hi; o += ce) t.irecv(partner, buf + o * es, (std::min(recv_hi, o + ce) - o) * es);
  t.wait_all();
}

struct Step {
  int partner, keep_lo, keep_hi, give_lo, give_hi;
};

// A world of p ranks seen as pof2 (the largest power of two <= p) virtual ranks, for the halving (Note
// [Reduce-scatter on a world that is not a power of two]): of the first 2 rem ranks (rem = p - pof2) each odd one
// stands for itself and the even one before it; the others are one each.
struct Fold {
  int p, pof2, rem;
  explicit Fold(int world) : p(world), pof2(1), rem(0) {
    while (pof2 * 2 <= p) pof2 *= 2;
    rem = p - pof2;
  }
  int real(int v) const { return v < rem ? 2 * v + 1 : v + rem; }
  int virtual_of(int r) const { return r < 2 * rem ? (r % 2 ? r / 2 : -1) : r - rem; }
  int first_block(int v) const { return v < rem ? 2 * v : v + rem; }  // of the blocks virtual rank v stands for
};

// The halving half over f's virtual ranks: off holds the f.pof2 + 1 bounds of their segments; afterwards our
// virtual rank's segment of buf is reduced (AVG divided by f.p); the steps, for the doubling half to retrace.
std::vector<Step> recursive_halving(Transport& t, const Fold& f, char* buf, const std::vector<size_t>& off,
                                    DataType dt, ReduceOp op, size_t ce, size_t depth, char* scratch,
                                    const ProbeView* pv) {
  const int r = t.rank(), v = f.virtual_of(r);
  const size_t es = dtype_size(dt);
  // Halving: the partner at step k is v ^ masks[k]; each step keeps the half of
  // the current range on our side of that bit. The doubling steps retrace them
  // backwards, so at each one our range is exactly what we kept there and the
  // partner's is what we gave.
  // (Pairing nearest partners first instead made no measurable difference.)
  std::vector<Step> steps;
  int lo = 0, hi = f.pof2;
  for (int mask = f.pof2 / 2; mask >= 1; mask >>= 1) {
    const int mid = (lo + hi) / 2;
    const bool upper = (v & mask) != 0;
    Step st{f.real(v ^ mask), upper ? mid : lo, upper ? hi : mid, upper ? lo : mid, upper ? mid : hi};
    const bool first = mask == f.pof2 / 2;
    exchange_reduce(t, st.partner, buf, off[st.give_lo], off[st.give_hi], off[st.keep_lo], off[st.keep_hi], dt, op,
                    ce, depth, scratch, pv, first ? r : -1, first ? st.partner : -1, mask == 1);
    steps.push_back(st);
    lo = st.keep_lo;
    hi = st.keep_hi;
  }
  finish_avg(buf + off[lo] * es, off[hi] - off[lo], dt, op, f.p);
  return steps;
}

// Each step is one exchange with one partner, pipelined within itself only:
// smaller chunks than the ring's start the reduction sooner (measured: 256 KiB
// beats 1 MiB by 1.5-2x at 1 MiB messages on 4 ranks).
size_t hd_chunk(size_t count, size_t es, const AlgoOptions& o) {
  return std::max<size_t>(1, std::min(count / 2 + 1, std::min<size_t>(o.chunk_bytes, 256 * 1024) / es));
}

}  // namespace

// Halving-doubling (Rabenseifner): a reduce-scatter by recursive halving, then an
// all-gather by recursive doubling; p must be a power of two.
//
// Rank r holds a range of segments [lo, hi), at first all p. At each halving step
// it pairs with r ^ mask (mask = p/2, p/4, ..., 1), keeps the half of its range
// on its own side of that bit, sends the other half and adds the partner's copy
// of the kept half into its buffer; after log2 p steps it holds segment r, fully
// reduced (each segment is finished in exactly one place, so all ranks end with
// the same bits). The doubling steps then swap ever larger finished ranges with
// the same partners in reverse order, receiving in place.
//
// Bytes per rank equal the ring's (2(p-1)/p * n) but in 2 log2 p steps instead of
// 2(p-1): where ranks share cores every step costs a peer's wake-up, and this
// wins (Note [large all_reduce on one host] in process_group.cpp).
// With a probe (Note [Fused non-finite check] in reduce_probe.h): at the first
// step the half we keep holds our own values and the partner sends its own
// copy of it, which it never reads; the last step finishes our segment.
void all_reduce_halving_doubling(Transport& t, void* buf_v, size_t count, DataType dt, ReduceOp op,
                                 const AlgoOptions& o, const ProbeView* pv) {
  const int p = t.size();
  const size_t es = dtype_size(dt);
  char* buf = static_cast<char*>(buf_v);
  const size_t ce = hd_chunk(count, es, o);
  const size_t depth = static_cast<size_t>(std::max(1, o.depth));
  std::vector<size_t> off(static_cast<size_t>(p) + 1);
  for (int i = 0; i < p; ++i) off[i + 1] = off[i] + count / p + (static_cast<size_t>(i) < count % p ? 1 : 0);
  char* scratch = scratch_space(depth * ce * es);
  if (pv) pv->probe->local_only = true;  // each rank finished one segment; the caller does the OR
  const std::vector<Step> steps = recursive_halving(t, Fold(p), buf, off, dt, op, ce, depth, scratch, pv);
  for (size_t k = steps.size(); k-- > 0;) {
    const Step& st = steps[k];
    exchange_copy(t, st.partner, buf, off[st.keep_lo], off[st.keep_hi], off[st.give_lo], off[st.give_hi], es, ce);
  }
}

// Note [Reduce-scatter by recursive halving]
// The ring reduce-scatter takes p-1 steps one after the other; with small blocks each costs its latency, a wake-up
// of a rank that shares its core where ranks outnumber cores (4 ranks on 2 vCPUs over TCP: 85-130 us up to 64 KiB
// in all, 0.45-0.80x Open MPI's). Where p is a power of two (4 or more) and the blocks are small, the halving half
// of all_reduce_halving_doubling does it in log2 p steps: the blocks copied in rank order into one buffer, each
// step sends the half of the range that the partner keeps and reduces the half it keeps, and block r ends reduced
// here. The same bytes leave each rank as in the ring, plus a copy of the inputs. Measured against the ring on 2
// vCPUs (osu_reduce_scatter's loop, benchmarks/osu.py's lib_column, 4 runs on 4 ranks and 2 on 8, the order flipped
// each run, medians of the time per call; sizes are the whole input): over TCP 0.38-0.52x the ring's time up to 64
// KiB on 4 ranks (0.69-0.79x at 128-256 KiB) and 0.39-0.66x up to 64 KiB on 8 (level at 256 KiB, 1.25x at 1 MiB);
// through shared memory 0.31-0.48x up to 16 KiB on 8 ranks, but on 4 level up to 4 KiB and 2x slower from 16 KiB,
// where the ring's few steps through the rings are cheap. So the largest block (AlgoOptions::
// small_reduce_scatter_bytes) is 16 KiB where sockets carry some pair and 1 KiB through rings.
// Note [Reduce-scatter on a world that is not a power of two]
// From 5 ranks a world that is not a power of two folds onto pof2 virtual ranks (the largest power of two below
// p; rem = p - pof2), as MPICH's recursive halving does: of the first 2 rem ranks each even one sends its whole
// input to the odd one after it, which adds it in and stands for both of them in the halving (its virtual segment
// is both their blocks); at the end it sends the even rank its block. log2(pof2) + 2 steps instead of the ring's
// p - 1, and the pairs send p blocks more each. Measured against the ring on 2 vCPUs (a loop of back-to-back
// reduce_scatters, float32, the two alternating over 4 runs with their order flipped, medians of the time per
// call; blocks of 4 B-16 KiB over TCP, 4 B-1 KiB through shared memory, the thresholds above): over TCP 0.51-0.71x
// the ring's time on 5 ranks, 0.49-0.57x on 6, 0.62-0.66x on 7 up to 1 KiB and 0.49-0.62x at 2-16 KiB (6 runs);
// through shared memory 0.76-0.95x on 5, 0.89-0.97x on 6 and 0.37-0.46x on 7. On 3 ranks it would take 3 steps to
// the ring's 2.
void reduce_scatter_halving(Transport& t, const void* const* ins, void* out, size_t count, DataType dt,
                            ReduceOp op, const AlgoOptions& o) {
  const int p = t.size(), r = t.rank();
  const Fold f(p);
  const size_t es = dtype_size(dt), bytes = count * es, whole = static_cast<size_t>(p) * bytes;
  const size_t total = static_cast<size_t>(p) * count;
  const size_t ce = hd_chunk(total, es, o);
  const size_t depth = static_cast<size_t>(std::max(1, o.depth));
  const CallScratch scratch(whole + depth * ce * es);  // the blocks in rank order, then the chunks received
  char* all = scratch.get();
  for (int i = 0; i < p; ++i) std::memcpy(all + static_cast<size_t>(i) * bytes, ins[i], bytes);
  const bool paired = r < 2 * f.rem;  // Note [Reduce-scatter on a world that is not a power of two]
  if (paired && r % 2 == 0) {  // the odd rank after us stands for us: our blocks to it, our result from it
    for (size_t at = 0; at < total; at += ce) t.isend(r + 1, all + at * es, (std::min(total, at + ce) - at) * es);
    t.wait(t.irecv(r + 1, out, bytes));
    t.wait_all();
    return;
  }
  if (paired) exchange_reduce(t, r - 1, all, 0, 0, 0, total, dt, op, ce, depth, all + whole, nullptr, -1, -1, false);
  std::vector<size_t> off(static_cast<size_t>(f.pof2) + 1);
  for (int v = 0; v < f.pof2; ++v) off[v] = static_cast<size_t>(f.first_block(v)) * count;
  off[f.pof2] = total;
  recursive_halving(t, f, all, off, dt, op, ce, depth, all + whole, nullptr);
  if (paired) t.isend(r - 1, all + static_cast<size_t>(r - 1) * bytes, bytes);
  std::memcpy(out, all + static_cast<size_t>(r) * bytes, bytes);
  t.wait_all();
}

}  // namespace cx::distributed::algo
