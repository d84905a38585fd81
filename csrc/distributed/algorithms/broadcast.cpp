#include <algorithm>
#include <cmath>
#include <deque>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/chunks.h"

namespace cx::distributed::algo {

namespace {

// Binomial tree over ranks relative to the root: log2(p) rounds, latency-bound messages.
void broadcast_tree(Transport& t, void* buf, size_t bytes, int root) {
  const int p = t.size();
  const int vr = (t.rank() - root + p) % p;
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      t.wait(t.irecv(((vr - mask) + root) % p, buf, bytes));
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  while (mask > 0) {
    if (vr + mask < p) t.isend(((vr + mask) + root) % p, buf, bytes);
    mask >>= 1;
  }
  t.wait_all();
}

// Pipelined chain root -> root+1 -> ... : each chunk is forwarded as soon as it
// arrives, so the time is ~(chunks + p - 2) chunk transfers, not (p-1) messages.
void broadcast_chain(Transport& t, void* buf_v, size_t bytes, int root, size_t chunk) {
  const int p = t.size();
  const int vr = (t.rank() - root + p) % p;
  const int prev = (t.rank() - 1 + p) % p, next = (t.rank() + 1) % p;
  char* buf = static_cast<char*>(buf_v);
  const size_t nc = chunk_count(bytes, chunk);
  if (vr == 0) {
    for (size_t c = 0; c < nc; ++c) {
      size_t off, n;
      chunk_at(bytes, chunk, c, &off, &n);
      t.isend(next, buf + off, n);
    }
    t.wait_all();
    return;
  }
  // Receives go straight into the buffer, so any number may be in flight.
  std::deque<std::pair<Transport::Req, size_t>> inflight;
  for (size_t c = 0; c < nc; ++c) {
    size_t off, n;
    chunk_at(bytes, chunk, c, &off, &n);
    inflight.emplace_back(t.irecv(prev, buf + off, n), c);
  }
  while (!inflight.empty()) {
    auto [req, c] = inflight.front();
    inflight.pop_front();
    t.wait(req);
    if (vr + 1 < p) {
      size_t off, n;
      chunk_at(bytes, chunk, c, &off, &n);
      t.isend(next, buf + off, n);
    }
  }
  t.wait_all();
}

// Note [Broadcast from the root to all]
// Where every rank of the group copies every other's messages once, straight out of the sender's memory (one
// host, shared memory, single copies: Note [Single-copy large messages] in shm/shm.h), a broadcast of more than
// small_broadcast_bytes on more than two ranks goes from the root to every rank at once: the root posts its
// buffer's address to each (Transport::copy_once) and waits until all have read it; each reads it in one copy,
// all at the same time. The chain costs more hops in a row: through the rings each byte is copied twice per hop
// where ranks outnumber cores (single copies there wait for their receiver to get a core), and below a chunk its
// hops run one after the other. Measured side by side on 2 vCPUs (benchmarks/README.md, "Broadcast from the
// root to all"): 4 ranks 1.1-1.8x the chain at 128 KiB-64 MiB, 8 ranks 1.5-2.0x; 3 ranks 1.3-2.5x below 768
// KiB and 1.2-2.2x from 4 MiB, but 0.65-0.9x between, where the chain's two hops keep up, so three ranks keep
// the chain there (star_broadcast_skip_from/to). 2 ranks keep the chain (one hop). Not measured where every
// rank has a core (the chain copies once there too). Every rank must agree to it, as on any algorithm:
// CpuBackend asks all ranks at init (an all_reduce of their Transport::reads_peers).
void broadcast_star(Transport& t, void* buf, size_t bytes, int root) {
  t.copy_once();
  if (t.rank() == root) {
    for (int j = 1; j < t.size(); ++j) t.isend((root + j) % t.size(), buf, bytes);
  } else {
    t.irecv(root, buf, bytes);
  }
  t.wait_all();
}

}  // namespace

// Note [Broadcast between hosts]
// Above small_broadcast_bytes the chain was measured best over loopback and through shared memory, where ranks
// share cores and the tree's root sends the whole message log2 p times. Between hosts each of the chain's p - 1
// hops adds a chunk's time on the link before the last rank has its first chunk: (p - 2 + k)(a + c b) for k chunks
// of c bytes, against the binomial tree's ceil(log2 p)(a + n b). The cost model (benchmarks/cost_model.py --op
// broadcast) put the chain at 5.5x the tree's time on 64 hosts of one rank at 1 MiB and 10 Gbit/s, 52x on 1024.
// But the tree's figure is a floor: its root posts the sends to all its children at once, which share its link.
// Behind 1 Gbit/s links (network namespaces, 4 hosts of one rank) the tree took 1.14x and 1.25x the model's time
// at 512 KiB and 1 MiB, and 1.25x the chain's at 1 MiB, where the model has them level; taken wherever the model
// had it cheaper, it lost 0.48-0.85x on 3 and 4 hosts. So where the ranks of a transport are each on a host of
// their own and at least three, and the link was measured at init (Note [Choosing by the link] in allreduce.cpp; a
// hierarchical broadcast's column too), the tree takes over only where the model gives it at most kTreeShare of
// the chain's time, the chain's in chunks of the link's (below). With a latency of 20 us the model takes it at 1
// MiB from 384 hosts of one rank on 10 Gbit/s and from 24 on 100, at 128 KiB from 32 and 8, never below 32 hosts
// on 1 Gbit/s.
constexpr double kTreeShare = 0.6;

// Note [The chain's chunk between hosts]
// The chain's time between hosts, (p - 2 + k)(a + n/k b) for k chunks of a message of n bytes, is least at
// k = sqrt(n b (p - 2) / a): the first chunk's p - 2 hops are a fill that small chunks make short, and each chunk
// costs a latency. With the agreed chunk (512 KiB) the fill was most of a broadcast's time: behind 1 Gbit/s links
// on 8 hosts of one rank a 1 MiB broadcast took 29 ms, 3.3 times the link's time for its bytes. So where the chain
// runs between hosts with the link measured (as the tree's choice above), its chunk is the one of the better whole
// number of chunks beside that k, rounded up to 4 KiB, at least kLeastLinkChunk (below it the calls, not the link,
// would cost) and at most the agreed chunk (larger chunks, which the model gives 100 Gbit/s links for 256 MiB, are
// not measured here). Behind the namespaces' 1 Gbit/s links (alpha about 12 us) that is 16-64 KiB for 128 KiB to
// 16 MiB on 8 hosts: measured against the agreed chunk, side by side (benchmarks/README.md, "The chain's chunk
// between hosts"), 3.1-3.7x the speed at 128 KiB-1 MiB on 8 hosts, 1.7-2.4x at 256 KiB-1 MiB on 4, 1.1-1.6x on 3;
// 1.2-1.9x for the column of 3 and 4 hosts of 2 ranks. Every size from 128 KiB up then runs at the link's rate.
constexpr size_t kLeastLinkChunk = 16 * 1024;

size_t chain_chunk_by_link(int p, size_t bytes, const AlgoOptions& o) {
  const size_t least = std::min(kLeastLinkChunk, o.chunk_bytes);
  const double a = o.link_alpha, b = o.link_beta, n = static_cast<double>(bytes);
  if (!(a > 0)) return least;
  auto cost = [&](double k) { return (p - 2 + k) * (a + n / k * b); };
  const double best = std::max(1.0, std::sqrt(n * b * (p - 2) / a));
  const double k = cost(std::floor(best)) <= cost(std::ceil(best)) ? std::floor(best) : std::ceil(best);
  const size_t c = (static_cast<size_t>(std::ceil(n / k)) + 4095) / 4096 * 4096;
  return std::clamp(c, least, o.chunk_bytes);
}

bool tree_by_link(int p, size_t bytes, size_t chunk, const AlgoOptions& o) {
  const double a = o.link_alpha, b = o.link_beta, n = static_cast<double>(bytes);
  const double c = std::min(n, static_cast<double>(std::max<size_t>(1, chunk)));
  int rounds = 0;
  while ((1 << rounds) < p) ++rounds;
  return rounds * (a + n * b) <= kTreeShare * (p - 2 + std::ceil(n / c)) * (a + c * b);
}

void broadcast(Transport& t, void* buf, size_t bytes, int root, const AlgoOptions& o) {
  if (t.size() == 1) return;
  if (o.across_hosts && o.link_beta > 0 && t.size() >= 3 && bytes > o.small_broadcast_bytes) {
    const size_t chunk = chain_chunk_by_link(t.size(), bytes, o);
    if (tree_by_link(t.size(), bytes, chunk, o)) {
      broadcast_tree(t, buf, bytes, root);
    } else {
      broadcast_chain(t, buf, bytes, root, chunk);
    }
    return;
  }
  if (o.star_broadcast && t.size() > 2 && bytes > o.small_broadcast_bytes &&
      !(bytes >= o.star_broadcast_skip_from && bytes < o.star_broadcast_skip_to)) {
    broadcast_star(t, buf, bytes, root);
    return;
  }
  if (bytes <= o.small_broadcast_bytes || t.size() == 2) {
    if (t.size() == 2 && bytes > o.small_broadcast_bytes) {
      broadcast_chain(t, buf, bytes, root, o.chunk_bytes);  // chunking still helps the receiver start early
    } else {
      broadcast_tree(t, buf, bytes, root);
    }
  } else {
    broadcast_chain(t, buf, bytes, root, o.chunk_bytes);
  }
}

}  // namespace cx::distributed::algo
