#include "distributed/transport/tcp/tcp_channel.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>

namespace cx::distributed {

using frame::kHeaderBytes;

// Note [Empty frames ride along]
// A rooted collective posts an empty frame to the next rank before its own messages (Note [Rooted collectives
// agree on their root] in cpu_backend.cpp). Over loopback TCP every sendmsg costs microseconds of the sender's
// time, and the empty frame's went before the data: a broadcast or scatter of 8 B on 2 ranks took 6.9-8.3 us,
// 4.2-4.6 us without the frame (side by side, an experiment switch). So an empty frame is only queued; it leaves
// with the next frame posted to the same peer, whatever frames are queued going out in one sendmsg, or at the next
// progress pass, which every wait makes first. Whoever waits has sent it, so a peer that waits for it is never
// kept waiting by us.
void TcpChannel::isend(Transport::Req id, const char* buf, size_t len) {
  queue_send(id, buf, len);
  if (len) progress_send();
}

bool TcpChannel::progress() {
  bool moved = false;
  if (!sends_.empty()) moved |= progress_send();
  if (!recvs_.empty()) moved |= progress_recv();
  return moved;
}

WaitOn TcpChannel::wait_on() const {
  short ev = 0;
  if (!recvs_.empty()) ev |= POLLIN;
  if (!sends_.empty()) ev |= POLLOUT;
  return {ev, false};
}

bool TcpChannel::progress_send() {
  constexpr size_t kFramesPerCall = 8;  // queued frames that leave in one sendmsg (Note [Empty frames ride along])
  bool moved = false;
  while (!sends_.empty()) {
    iovec iov[2 * kFramesPerCall];
    int n = 0;
    for (size_t i = 0; i < sends_.size() && i < kFramesPerCall; ++i) {
      const SendOp& s = sends_[i];
      if (s.done < kHeaderBytes) {
        iov[n++] = {const_cast<char*>(s.hdr) + s.done, kHeaderBytes - s.done};
        if (s.len) iov[n++] = {const_cast<char*>(s.buf), s.len};
      } else {
        iov[n++] = {const_cast<char*>(s.buf) + (s.done - kHeaderBytes), s.len - (s.done - kHeaderBytes)};
      }
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(n);
    ssize_t k = ::sendmsg(fd_.get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
      peer_closed("sending to");
    }
    moved = true;
    for (size_t left = static_cast<size_t>(k); left > 0;) {
      SendOp& s = sends_.front();
      const size_t took = std::min(left, kHeaderBytes + s.len - s.done);
      s.done += took;
      left -= took;
      if (s.done < kHeaderBytes + s.len) break;
      complete(s.id);
      sends_.pop_front();
    }
  }
  return moved;
}

Channel::Next TcpChannel::peek(OpDesc* d) {
  char h[kHeaderBytes];
  const ssize_t k = ::recv(fd_.get(), h, kHeaderBytes, MSG_PEEK | MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Next::kNothing;
  if (k == 0) return Next::kEnded;
  if (k < 0) return Next::kRaise;
  if (static_cast<size_t>(k) < kHeaderBytes) return Next::kNothing;  // the rest of the header is on its way
  if (!frame::has_magic(h) || frame::type(h) != frame::kData) return Next::kRaise;  // an ABORT frame, or garbage
  *d = frame::desc(h);
  return Next::kFrame;
}

bool TcpChannel::progress_recv() {
  bool moved = false;
  while (!recvs_.empty()) {
    RecvOp& r = recvs_.front();
    if (!in_payload_) {
      // Header and payload in one readv: a small message costs one syscall. The
      // payload bytes land in the caller's buffer before the header is checked;
      // if the header turns out wrong the collective fails anyway.
      iovec iov[2];
      iov[0] = {rhdr_ + rhdr_got_, kHeaderBytes - rhdr_got_};
      iov[1] = {r.buf, r.len};
      ssize_t k = ::readv(fd_.get(), iov, 2);
      if (k == 0) peer_closed("receiving from");
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
        peer_closed("receiving from");
      }
      moved = true;
      size_t got = static_cast<size_t>(k);
      size_t hdr_part = std::min(got, kHeaderBytes - rhdr_got_);
      rhdr_got_ += hdr_part;
      if (rhdr_got_ < kHeaderBytes) continue;
      rhdr_got_ = 0;
      check_header(r.buf, got - hdr_part);
      in_payload_ = true;
      r.done = got - hdr_part;
    }
    if (r.done < r.len) {
      ssize_t k = ::recv(fd_.get(), r.buf + r.done, r.len - r.done, MSG_DONTWAIT);
      if (k == 0) peer_closed("receiving from");
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
        peer_closed("receiving from");
      }
      moved = true;
      r.done += static_cast<size_t>(k);
    }
    if (r.done == r.len) {
      in_payload_ = false;
      complete(r.id);
      recvs_.pop_front();
    }
  }
  return moved;
}

void TcpChannel::peer_closed(const char* during) {
  const int e = errno;
  // Mid-header the stream cannot be followed; mid-payload, the rest of it comes first.
  if (rhdr_got_ == 0) salvage_abort(in_payload_ && !recvs_.empty() ? recvs_.front().len - recvs_.front().done : 0);
  lost_connection(during, e);
}

void TcpChannel::abort(ErrorKind kind, const std::string& text) {
  auto dl = Deadline::after_ms(200);
  try {
    // A half-written frame would garble the stream: finish it first.
    if (!sends_.empty() && sends_.front().done > 0) {
      SendOp& s = sends_.front();
      if (s.done < kHeaderBytes) {
        net::send_exact(fd_.get(), s.hdr + s.done, kHeaderBytes - s.done, dl, "peer");
        s.done = kHeaderBytes;
      }
      net::send_exact(fd_.get(), s.buf + (s.done - kHeaderBytes), s.len - (s.done - kHeaderBytes), dl, "peer");
    }
    send_abort_frame(kind, text, dl);
  } catch (const Error&) {
    // The peer is gone or not reading: it will see the connection close.
  }
  sends_.clear();
  recvs_.clear();
  half_close();
}

}  // namespace cx::distributed
