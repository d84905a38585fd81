// The barrier: empty messages, no data.
#include "distributed/algorithms/algorithms.h"

namespace cx::distributed::algo {

// Dissemination barrier: in round k every rank signals rank+2^k and waits for
// rank-2^k; after ceil(log2 p) rounds everyone has heard, indirectly, from all.
// Each signal carries the sender's 8-byte fingerprint and each receiver compares
// it with its own: the d=1 round alone links every rank to the next in a ring,
// so if any two ranks differ, some rank sees a neighbour differ (Note
// [Collective fingerprint] in process_group.h).
void barrier(Transport& t, uint64_t fingerprint) {
  const int p = t.size(), r = t.rank();
  for (int d = 1; d < p; d <<= 1) {
    uint64_t theirs = 0;
    const int from = (r - d + p) % p;
    auto s = t.isend((r + d) % p, &fingerprint, sizeof(fingerprint));
    auto rv = t.irecv(from, &theirs, sizeof(theirs));
    t.wait(rv);
    t.wait(s);
    if (theirs != fingerprint) {
      CX_THROW(MismatchError, "mismatched collectives: rank ", r, " and rank ", from,
               " called different collectives before this barrier (their fingerprints differ)");
    }
  }
}

}  // namespace cx::distributed::algo
