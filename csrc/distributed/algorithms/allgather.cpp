#include <cstring>
#include <deque>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/chunks.h"

namespace cx::distributed::algo {

// Ring all-gather: at step s rank r receives block (r-s-1) mod p from the left
// straight into its place and forwards each chunk to the right as it arrives
// (except at the last step). No scratch.
void all_gather(Transport& t, const void* in, void* const* outs, size_t bytes, const AlgoOptions& o) {
  const int p = t.size(), r = t.rank();
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
