// The collectives that talk to each peer directly: scatter, gather, all_to_all.
#include <cstring>

#include "distributed/algorithms/algorithms.h"

namespace cx::distributed::algo {

void scatter(Transport& t, const void* const* ins, void* out, size_t bytes, int root) {
  const int p = t.size(), r = t.rank();
  if (r == root) {
    for (int k = 1; k < p; ++k) {
      int j = (r + k) % p;
      t.isend(j, ins[j], bytes);
    }
    if (out != ins[r] && bytes) std::memmove(out, ins[r], bytes);
  } else {
    t.irecv(root, out, bytes);
  }
  t.wait_all();
}

void gather(Transport& t, const void* in, void* const* outs, size_t bytes, int root) {
  const int p = t.size(), r = t.rank();
  if (r == root) {
    for (int k = 1; k < p; ++k) {
      int j = (r + k) % p;
      t.irecv(j, outs[j], bytes);
    }
    if (outs[r] != in && bytes) std::memmove(outs[r], in, bytes);
  } else {
    t.isend(root, in, bytes);
  }
  t.wait_all();
}

void all_to_all(Transport& t, const void* const* ins, void* const* outs, size_t bytes) {
  const int p = t.size(), r = t.rank();
  // Post every receive first, then the sends in a rotated order so that no two
  // ranks start by sending to the same peer.
  for (int k = 1; k < p; ++k) {
    int j = (r - k + p) % p;
    t.irecv(j, outs[j], bytes);
  }
  for (int k = 1; k < p; ++k) {
    int j = (r + k) % p;
    t.isend(j, ins[j], bytes);
  }
  if (outs[r] != ins[r] && bytes) std::memmove(outs[r], ins[r], bytes);
  t.wait_all();
}

}  // namespace cx::distributed::algo
