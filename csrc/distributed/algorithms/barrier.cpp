// The barrier: empty messages, no data.
#include "distributed/algorithms/algorithms.h"

namespace cx::distributed::algo {

// Dissemination barrier: in round k every rank signals rank+2^k and waits for
// rank-2^k; after ceil(log2 p) rounds everyone has heard, indirectly, from all.
void barrier(Transport& t) {
  const int p = t.size(), r = t.rank();
  for (int d = 1; d < p; d <<= 1) {
    auto s = t.isend((r + d) % p, nullptr, 0);
    auto rv = t.irecv((r - d + p) % p, nullptr, 0);
    t.wait(rv);
    t.wait(s);
  }
}

}  // namespace cx::distributed::algo
