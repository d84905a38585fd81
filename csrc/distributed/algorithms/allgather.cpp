#include <algorithm>
#include <cstring>
#include <deque>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/chunks.h"
#include "distributed/algorithms/scratch.h"

namespace cx::distributed::algo {

namespace {

// Note [Bruck's all_gather]
// The ring takes p-1 steps one after the other, each a message of one block. Where the blocks are small, each
// step costs its latency, not its bytes: a wake-up of the receiving rank, which where ranks outnumber cores means a
// context switch (4 ranks on 2 vCPUs over TCP: 95-120 us for 8 B-8 KiB, Open MPI's recursive doubling 50-65 us,
// 0.5x). Bruck's algorithm takes ceil(log2 p) steps for any p: rank r keeps the blocks it has in order from its own
// (tmp[i] = rank r+i's), and at the step of distance d sends its first min(d, p-d) blocks to rank r-d, in one
// message, and receives as many from rank r+d after them; at the end the blocks go to their places. The same bytes
// leave each rank as in the ring, plus one copy of the whole result; p >= 4 (on 2 and 3 ranks it takes the ring's
// number of steps). Measured against the ring on 2 vCPUs (osu_allgather's loop, benchmarks/osu.py's lib_column, 4
// runs on 4 ranks and 2 on 8, the order flipped each run, medians of the time per call): at 8 B-8 KiB over TCP
// 0.45-0.55x the ring's time on 4 ranks and 0.52-0.60x on 8, through shared memory 0.75-0.84x and 0.39-0.70x.
// Above 8 KiB it kept winning over TCP (0.55-0.82x up to 256 KiB), but through shared memory it lost from 32 KiB on
// 8 ranks (1.2-2.1x) and from 256 KiB on 4 (where the ring copies once, out of the sender's memory). So the
// threshold (AlgoOptions::small_all_gather_bytes) is 8 KiB where every pair goes through rings and 128 KiB where
// sockets carry some (agreed at init: CpuBackend::agree_on_single_copies).
// Its scratch holds the whole result (CallScratch: kept for the thread's next collective up to 4 MiB, allocated for
// the call above): at most this. Bruck takes log2 p steps where the ring takes p - 1, and sends the same bytes; the
// cost model (benchmarks/cost_model.py --op all_gather --per-host 1) has it at 0.28x the ring's time on 1024 hosts of
// one rank with 8 KiB blocks on 10 Gbit/s links (8 MiB in all), 0.08x on 100 Gbit/s; not measured (a 4 MiB cap kept
// those on the ring until a later session).
constexpr size_t kBruckMostBytes = 64u << 20;

void all_gather_bruck(Transport& t, const void* in, void* const* outs, size_t bytes) {
  const int p = t.size(), r = t.rank();
  const CallScratch scratch(static_cast<size_t>(p) * bytes);
  char* tmp = scratch.get();
  std::memcpy(tmp, in, bytes);
  for (int d = 1; d < p; d *= 2) {
    const size_t n = static_cast<size_t>(std::min(d, p - d)) * bytes;
    const Transport::Req s = t.isend((r - d + p) % p, tmp, n);
    const Transport::Req q = t.irecv((r + d) % p, tmp + static_cast<size_t>(d) * bytes, n);
    t.wait(q);
    t.wait(s);
  }
  for (int i = 0; i < p; ++i) {
    char* dst = static_cast<char*>(outs[(r + i) % p]);
    if (i > 0 || dst != in) std::memcpy(dst, tmp + static_cast<size_t>(i) * bytes, bytes);
  }
}

// Note [Bruck's all_gather between hosts]
// The 128 KiB bound where sockets carry a pair was measured over loopback, where a step costs a wake-up and a byte
// a fraction of a nanosecond. Bruck saves the ring p - 1 - ceil(log2 p) steps' latency, no bytes, and adds a copy
// of the whole and messages of several blocks at once. Behind 1 Gbit/s links (network namespaces, a rank a host,
// alpha 12 us, 8.3 ns a byte; `python -m benchmarks.allreduce --op all_gather --link 1gbit`, against a build with
// the ring above 8 KiB, 2 runs each alternating): on 8 hosts 0.91x the ring's time at 16 KiB blocks (a block's
// bytes 11 alphas), 1.03x at 64 and 128 KiB (45 and 90 alphas); on 4 hosts level at 16 and 64 KiB and 1.24x at
// 128 KiB. So where the ranks are each on a host of their own and the link was measured at init (Note [Choosing
// by the link] in allreduce.cpp; a hierarchical all_gather's columns too, which share the link), Bruck's blocks
// are also at most kBruckMostAlphas of the link's alpha in bytes: on a 10 Gbit/s link with 20 us that is 400 KB
// (the loopback bound stands), on 1 Gbit/s 23 KB. Against the build before it on the same links (3 runs on 4
// hosts, 2 on 8): 1.17x the speed at 128 KiB blocks on 4 hosts, 1.03-1.05x at 64-128 KiB on 8, level at 16 KiB.
constexpr double kBruckMostAlphas = 16;

bool bruck_pays(int p, size_t bytes, const AlgoOptions& o) {
  if (p < 4 || !bytes || bytes > o.small_all_gather_bytes || static_cast<size_t>(p) * bytes > kBruckMostBytes)
    return false;
  return !(o.across_hosts && o.link_beta > 0) ||
         static_cast<double>(bytes) * o.link_beta * std::max(1, o.link_share) <= kBruckMostAlphas * o.link_alpha;
}

}  // namespace

// Ring all-gather: at step s rank r receives block (r-s-1) mod p from the left
// straight into its place and forwards each chunk to the right as it arrives
// (except at the last step). No scratch. Small blocks on 4 ranks or more: Bruck's.
void all_gather(Transport& t, const void* in, void* const* outs, size_t bytes, const AlgoOptions& o) {
  const int p = t.size(), r = t.rank();
  if (bruck_pays(p, bytes, o)) {
    all_gather_bruck(t, in, outs, bytes);
    return;
  }
  if (outs[r] != in && bytes) std::memmove(outs[r], in, bytes);
  if (p == 1) return;
  const int left = (r - 1 + p) % p, right = (r + 1) % p;
  const size_t nc = chunk_count(bytes, o.chunk_bytes);
  auto mod = [p](int x) { return ((x % p) + p) % p; };

  for (size_t c = 0; c < nc; ++c) {
    size_t off, n;
    chunk_at(bytes, o.chunk_bytes, c, &off, &n);
    t.isend(right, static_cast<const char*>(in) + off, n);
  }
  std::deque<std::pair<Transport::Req, std::pair<int, size_t>>> inflight;
  for (int s = 0; s < p - 1; ++s) {
    int blk = mod(r - s - 1);
    for (size_t c = 0; c < nc; ++c) {
      size_t off, n;
      chunk_at(bytes, o.chunk_bytes, c, &off, &n);
      inflight.push_back({t.irecv(left, static_cast<char*>(outs[blk]) + off, n), {s, c}});
    }
  }
  while (!inflight.empty()) {
    auto [req, sc] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    auto [s, c] = sc;
    if (s + 1 < p - 1) {
      size_t off, n;
      chunk_at(bytes, o.chunk_bytes, c, &off, &n);
      t.isend(right, static_cast<char*>(outs[mod(r - s - 1)]) + off, n);
    }
  }
  t.wait_all();
}

}  // namespace cx::distributed::algo
