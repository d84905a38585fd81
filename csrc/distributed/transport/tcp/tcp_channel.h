// defines: TcpChannel, the Channel that moves frames over the pair's
// non-blocking TCP socket: sendmsg of header and payload together, one readv of
// the next header and payload, so a small message costs one syscall each way.
// Empty frames wait for the next frame to the peer or the next progress pass, and
// leave with it in one sendmsg (Note [Empty frames ride along]).
#pragma once

#include <sys/uio.h>

#include <string>

#include "distributed/transport/channel.h"

namespace cx::distributed {

class TcpChannel final : public Channel {
 public:
  using Channel::Channel;

  void isend(Transport::Req id, const char* buf, size_t len) override;
  bool progress() override;
  WaitOn wait_on() const override;
  Next peek(OpDesc* d) override;
  void socket_event() override {}  // the socket carries the data: progress() reads what it says
  void abort(ErrorKind kind, const std::string& text) override;

 private:
  bool progress_send();
  bool progress_recv();
  // readv from the bytes read ahead while there are any, else from the socket (Note [Messages out of order]).
  ssize_t read_in(iovec* iov, int n);
  // read_in into iov: true with *got bytes; false when nothing has come yet; throws when the peer has gone.
  bool take(iovec* iov, int n, size_t* got);
  [[noreturn]] void peer_closed(const char* during);

  std::string ahead_;  // bytes read with a stashed message's header that belong to the frames after it
};

}  // namespace cx::distributed
