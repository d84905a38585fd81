#include "distributed/transport/shm/negotiate.h"

#include <algorithm>
#include <cstdio>

#include "common/error.h"

namespace cx::distributed::shm {

namespace {

// Each rank's host as a number: hosts numbered 0, 1, ... in the order of their lowest rank.
std::vector<int> number_hosts(const std::vector<std::string>& keys) {
  const int world = static_cast<int>(keys.size());
  std::vector<int> hosts(keys.size(), -1);
  for (int j = 0, next = 0; j < world; ++j) {
    if (hosts[j] >= 0) continue;
    for (int k = j; k < world; ++k) {
      if (keys[k] == keys[j]) hosts[k] = next;
    }
    ++next;
  }
  return hosts;
}

}  // namespace

// Note [Same-host pairs]
// Two ranks on one host move data through shared memory instead of their TCP
// connection: each rank makes a segment (shm.h) holding a receive ring per peer,
// and at init every pair tells each other, over the connection just made, its
// host key and segment name. A pair uses the rings only if both sides mapped
// the other's segment (same host, same /dev/shm, same ring size, CX_SHM not 0
// on either); otherwise it keeps TCP, so a mixed group still works. The
// connection stays open: ABORT frames still travel on it, and its end-of-stream
// is how a dead peer is noticed (a ring cannot tell). Frames in a ring are the
// same as on a socket (header, then payload), checked the same way, so
// mismatched collectives read the same. Once every peer answered, the segment's
// file is unlinked: the mappings live on, and a crash leaves nothing in /dev/shm.
Pairing negotiate(const std::vector<net::Fd>& socks, const std::vector<std::string>& addrs, int rank,
                  uint64_t nonce, bool enabled, size_t ring_bytes, const Deadline& dl) {
  const int world = static_cast<int>(socks.size());
  auto what = [&](int j) { return detail::concat("rank ", j, " (", addrs[j], ")"); };
  // Every message here is a few hundred bytes per peer: it fits the socket
  // buffers, so sending to all before receiving from any cannot deadlock.
  auto send_all = [&](auto&& payload_for) {
    for (int j = 0; j < world; ++j) {
      if (j == rank) continue;
      const std::string m = payload_for(j);
      const uint32_t n = static_cast<uint32_t>(m.size());
      net::send_exact(socks[j].get(), &n, sizeof(n), dl, what(j));
      net::send_exact(socks[j].get(), m.data(), m.size(), dl, what(j));
    }
  };
  auto recv_from = [&](int j) {
    uint32_t n = 0;
    net::recv_exact(socks[j].get(), &n, sizeof(n), dl, what(j));
    if (n > 4096) {
      CX_THROW(ConnectionError, "rank ", rank, ": garbled setup message from ", what(j),
               " (are the pycyxwiz versions the same on every rank?)");
    }
    std::string m(n, '\0');
    net::recv_exact(socks[j].get(), m.data(), n, dl, what(j));
    return m;
  };

  // 1. Which host: ranks with the same key may share memory (if CX_SHM allows).
  // Note [Hosts of the ranks]: the keys are exchanged even where CX_SHM=0, so that
  // every rank knows every rank's host (the hierarchical collectives group by it,
  // algorithms/hierarchical.cpp); CX_SHM only decides whether a pair shares memory
  // (a rank with it off makes no segment, so its pairs stay on TCP).
  const std::string key = host_key();
  send_all([&](int) { return key; });
  std::vector<int> local;
  std::vector<std::string> keys(static_cast<size_t>(world));
  keys[rank] = key;
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    keys[j] = recv_from(j);
    if (enabled && keys[j] == key) local.push_back(j);
  }
  Pairing out;
  out.hosts = number_hosts(keys);

  // 2. Our segment, with the rings of those peers reserved up front: a full
  // /dev/shm (64 MiB in a default Docker container) then means TCP, never a
  // SIGBUS in the middle of a collective. Ring size: CX_SHM_RING_BYTES, less when
  // many ranks share the host, so that all rings together stay near 256 MiB
  // (every rank on a host computes the same size).
  std::string name;
  size_t cap = ring_bytes;
  if (!local.empty()) {
    const size_t n = local.size() + 1;
    cap = std::min(cap, std::max<size_t>(64 * 1024, (size_t{256} << 20) / (n * (n - 1)) / 4096 * 4096));
    const std::string mine = segment_name(nonce, rank);
    remove_dead_segments();  // Note [Segments of dead ranks]
    try {
      out.own = Segment::create(mine, world, cap, local);
      name = mine;
    } catch (const Error&) {
      out.own = Segment();  // no room or no /dev/shm: this rank stays on TCP
    }
  }
  send_all([&](int) { return name; });
  out.peers.resize(static_cast<size_t>(world));
  std::vector<char> mapped(static_cast<size_t>(world), 0);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    const std::string theirs = recv_from(j);
    const bool is_local = std::find(local.begin(), local.end(), j) != local.end();
    if (out.own.ok() && is_local && !theirs.empty()) {
      out.peers[j] = Segment::open(theirs, world, cap);
      mapped[j] = out.peers[j].ok() ? 1 : 0;
    }
  }

  // 3. Whether each side mapped the other's: both, or the pair stays on TCP.
  send_all([&](int j) { return std::string(1, mapped[j]); });
  int used = 0;
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    const std::string theirs = recv_from(j);
    if (mapped[j] && theirs == std::string(1, 1)) {
      out.own.prefault(j);
      out.peers[j].prefault(rank);
      ++used;
    } else {
      out.peers[j] = Segment();
    }
  }
  out.own.unlink();  // every peer that writes into it has mapped it by now
  if (used == 0) out.own = Segment();
  return out;
}

}  // namespace cx::distributed::shm
