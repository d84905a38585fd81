// defines: ShmChannel, the Channel of a pair of ranks on one host: frames go
// through two shared-memory rings (shm.h), one in each rank's segment, and the
// pair's TCP socket is kept only for ABORT frames and to notice that the peer
// died (a ring cannot tell). Set up by shm::negotiate (Note [Same-host pairs]).
#pragma once

#include "distributed/transport/channel.h"
#include "distributed/transport/shm/shm.h"

namespace cx::distributed {

class ShmChannel final : public Channel {
 public:
  // `own`: our segment, holding the ring from `peer` to us; `theirs`: the
  // peer's segment, mapped, holding the ring to it and its doorbell. The
  // channel keeps `theirs` mapped; `own` must outlive it.
  // `single_copy`: read the peer's large messages out of its memory where the kernel allows (Note [Single-copy
  // large messages] in shm.h); `core_each`: no more ranks on this host than cores, which decides it for some.
  ShmChannel(int rank, int peer, net::Fd fd, std::string addr, Operation& op, const shm::Segment& own,
             shm::Segment theirs, bool single_copy, bool core_each);

  void isend(Transport::Req id, const char* buf, size_t len) override;
  bool progress() override;
  WaitOn wait_on() const override;
  Next peek(OpDesc* d) override;
  bool copies_once() const override {
    return in_.ctl->can_read.load(std::memory_order_acquire) == 1 &&
           out_.ctl->can_read.load(std::memory_order_acquire) == 1;
  }
  [[noreturn]] void socket_event() override;
  void abort(ErrorKind kind, const std::string& text) override;

 private:
  bool progress_send();
  bool progress_recv();
  bool progress_acks();
  bool read_remote(char* into, size_t len, bool& moved);

  shm::Segment theirs_;
  shm::Ring in_, out_;  // peer -> us (in our segment), us -> peer (in its segment)
  shm::Bell* bell_;     // the peer's doorbell
  // Note [Single-copy large messages] in shm.h.
  int peer_pid_;
  bool core_each_;
  uint64_t remote_sent_ = 0;        // REMOTE frames written to the peer
  bool remote_in_ = false;          // the frame being received is a REMOTE one
  char raddr_[8] = {};              // its sender's buffer address, as it arrives
  size_t raddr_got_ = 0;
};

}  // namespace cx::distributed
