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
  ShmChannel(int rank, int peer, net::Fd fd, std::string addr, Operation& op, const shm::Segment& own,
             shm::Segment theirs);

  void isend(Transport::Req id, const char* buf, size_t len) override;
  bool progress() override;
  WaitOn wait_on() const override;
  [[noreturn]] void socket_event() override;
  void abort(ErrorKind kind, const std::string& text) override;

 private:
  bool progress_send();
  bool progress_recv();

  shm::Segment theirs_;
  shm::Ring in_, out_;  // peer -> us (in our segment), us -> peer (in its segment)
  shm::Bell* bell_;     // the peer's doorbell
};

}  // namespace cx::distributed
