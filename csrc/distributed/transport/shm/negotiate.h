// defines: shm::negotiate, which finds out at init, over each pair's fresh TCP
// connection, which peers this rank shares memory with, and maps their
// segments (Note [Same-host pairs] in negotiate.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "distributed/net/socket.h"
#include "distributed/transport/shm/shm.h"
#include "distributed/types.h"

namespace cx::distributed::shm {

struct Pairing {
  Segment own;                 // our doorbell and the rings into us; unmapped if no pair uses it
  std::vector<Segment> peers;  // index = rank: the peer's segment, mapped iff the pair shares memory
  // index = rank: its host, numbered 0, 1, ... in the order of each host's lowest
  // rank; equal on every rank (whatever CX_SHM says: Note [Hosts of the ranks]).
  std::vector<int> hosts;
};

// Every rank of the group calls it at once. `socks[j]`: the blocking connection
// to rank j (index `rank` unused), named `addrs[j]` in errors. `enabled`: CX_SHM
// on this rank; `ring_bytes`: CX_SHM_RING_BYTES. Throws ConnectionError or
// TimeoutError if a peer fails to answer; every other failure means TCP.
Pairing negotiate(const std::vector<net::Fd>& socks, const std::vector<std::string>& addrs, int rank,
                  uint64_t nonce, bool enabled, size_t ring_bytes, const Deadline& dl);

}  // namespace cx::distributed::shm
