// defines: MeshTransport, the Transport over a full mesh of connections made at
// init through the rendezvous store and kept for the life of the group, with
// one Channel per peer (channel.h): shared-memory rings for a pair on one host
// (Note [Same-host pairs]), TCP for the others.
//
// Progress is driven by the thread that waits: every busy channel is asked to
// move what it can, peer by peer in rank order, until the awaited request is
// complete. While nothing moves it spins for a bounded time (waking a sleeping
// thread costs ~90 us on these VMs, a spin ~8 us; not while others want the
// core: Note [Waiting on a busy machine] in spin_policy.h), then sleeps until the
// deadline in slices: in poll() when only sockets are pending (100 ms), on our
// shared-memory doorbell when only rings are (20 ms), in 1 ms polls when both.
#pragma once

#include <memory>
#include <vector>

#include "distributed/net/socket.h"
#include "distributed/transport/channel.h"
#include "distributed/transport/shm/shm.h"
#include "distributed/transport/spin_policy.h"
#include "distributed/transport/transport.h"

namespace cx::distributed {

class Store;

struct MeshOptions {
  int spin_us = 50;  // busy-poll at most this long before sleeping (Note [Waiting on a busy machine])
  bool shm = true;   // same-host pairs use shared-memory rings (CX_SHM)
  size_t shm_ring_bytes = 1 << 20;  // per ordered pair (CX_SHM_RING_BYTES)
  bool shm_single_copy = true;      // CX_SHM_SINGLE_COPY (Note [Single-copy large messages])
  bool core_each = true;            // no more ranks on this host than cores
};

class MeshTransport : public Transport {
 public:
  // Connects the full mesh: publishes this rank's listening address in the
  // store, connects to lower ranks, accepts higher ones, then finds out which
  // pairs share memory.
  // Every link proves `secret` (Note [Job secret] in net/auth.h) before it is taken
  // for a peer; connections that do not are dropped and logged (Note [Mesh handshake]).
  MeshTransport(Store& store, int rank, int world, uint64_t nonce, const std::string& secret,
                const Deadline& dl, MeshOptions opt);
  ~MeshTransport() override;
  MeshTransport(const MeshTransport&) = delete;
  MeshTransport& operator=(const MeshTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::vector<int> hosts() const override { return hosts_; }
  bool reads_peers() const override;
  bool through_rings() const override { return rings_only(false); }
  bool host_through_rings() const override { return rings_only(true); }
  void begin(const OpDesc& desc, const Deadline& dl) override;
  Req isend(int peer, const void* buf, size_t bytes) override;
  Req irecv(int peer, void* buf, size_t bytes) override;
  void copy_once() override { op_.copy_once = true; }
  void wait(Req r) override;
  void wait_all() override;
  int wait_any_message() override;
  void set_desc(const OpDesc& desc) override { op_.desc = desc; }
  void set_yield(std::atomic<bool>* flag) override { yield_ = flag; }
  void abort(ErrorKind kind, const std::string& msg) override;
  void close(const Deadline& dl) override;

 private:
  bool progress();  // one pass over the busy channels; true if any byte moved
  void block();     // sleeps until something may have moved, up to one slice or the deadline
  // Note [Receiving from any source]: sleeps until one of `quiet` (peers with nothing whole yet; rings: through
  // shared memory) may have more, up to one slice or the deadline.
  void block_any(const std::vector<Channel*>& quiet);
  // Note [Sends that read while they wait]: reads into the stash every peer's next message, where it is a
  // send/recv message and no receive is posted to that peer; true if it read any.
  bool read_aside();
  // Reads peer j's next message, a send/recv message (peek said so), whole into its channel's stash.
  void read_next_aside(int j);
  // Note [A send whose peer sent something else]: whether peer j's socket may yet bring a message to read aside.
  bool aside_may_come(int j);
  // Whether every pair of this rank's (own_host: on its host) goes through rings, and it has one.
  bool rings_only(bool own_host) const;
  [[noreturn]] void timed_out();
  // Note [A receive that timed out names the messages nobody took]: "" where there are none.
  std::string unreceived();

  int rank_;
  int world_;
  MeshOptions opt_;
  net::CongestionBySize by_size_;  // Note [Congestion control between ranks on one host]
  SpinPolicy spin_;
  // Consulted only where ranks share cores (Note [Ranks that share cores with other programs]).
  OthersOnTheCpus others_;
  std::vector<int> hosts_;  // index = rank: its host (Note [Hosts of the ranks] in shm/negotiate.cpp)
  Operation op_;
  shm::Segment seg_;  // ours: our doorbell and the rings into us (unmapped if no pair shares memory)
  std::vector<std::unique_ptr<Channel>> channels_;  // index = rank; channels_[rank_] empty
  bool aborted_ = false;
  std::vector<int> peer_of_;  // index = request of the current operation: its peer
  std::atomic<bool>* yield_ = nullptr;  // Note [Sends before receives] in process_group.cpp
};

}  // namespace cx::distributed
