#include "distributed/transport/tcp/tcp_channel.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

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
  // A message's send also wakes for the peer's messages, to read them aside (Note [Sends that read while they
  // wait] in mesh_transport.cpp).
  if (!recvs_.empty() || (!sends_.empty() && op_.desc.kind == CollectiveKind::kSendRecv)) ev |= POLLIN;
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
  // Bytes read ahead (Note [Messages out of order]) come first.
  const size_t have = std::min(ahead_.size(), kHeaderBytes);
  std::memcpy(h, ahead_.data(), have);
  if (have < kHeaderBytes) {
    const ssize_t k = ::recv(fd_.get(), h + have, kHeaderBytes - have, MSG_PEEK | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Next::kNothing;
    if (k == 0) return have ? Next::kRaise : Next::kEnded;  // the peer ended inside a frame: the receive raises
    if (k < 0) return Next::kRaise;
    if (have + static_cast<size_t>(k) < kHeaderBytes) return Next::kNothing;  // the rest of the header is coming
  }
  if (!frame::has_magic(h) || frame::type(h) != frame::kData) return Next::kRaise;  // an ABORT frame, or garbage
  *d = frame::desc(h);
  return Next::kFrame;
}

ssize_t TcpChannel::read_in(iovec* iov, int n) {
  if (ahead_.empty()) return ::readv(fd_.get(), iov, n);
  size_t took = 0;  // from the bytes read ahead only; the socket's come at the next call
  for (int i = 0; i < n && took < ahead_.size(); ++i) {
    const size_t c = std::min(iov[i].iov_len, ahead_.size() - took);
    std::memcpy(iov[i].iov_base, ahead_.data() + took, c);
    took += c;
    if (c < iov[i].iov_len) break;
  }
  ahead_.erase(0, took);
  return static_cast<ssize_t>(took);
}

bool TcpChannel::take(iovec* iov, int n, size_t* got) {
  const ssize_t k = read_in(iov, n);
  if (k > 0) {
    *got = static_cast<size_t>(k);
    return true;
  }
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  peer_closed("receiving from");
}

bool TcpChannel::progress_recv() {
  bool moved = false;
  while (!recvs_.empty()) {
    RecvOp& r = recvs_.front();
    if (diverting_) {  // Note [Messages out of order]: a message for a later receive, into the stash
      if (div_done_ < div_.payload.size()) {
        iovec iov{div_.payload.data() + div_done_, div_.payload.size() - div_done_};
        size_t k;
        if (!take(&iov, 1, &k)) return moved;
        moved = true;
        div_done_ += k;
      }
      if (div_done_ == div_.payload.size()) stashed_one();
      continue;
    }
    if (!in_payload_) {
      // Header and payload in one readv: a small message costs one syscall. The
      // payload bytes land in the caller's buffer before the header is checked;
      // if the header turns out wrong the collective fails anyway.
      iovec iov[2];
      iov[0] = {rhdr_ + rhdr_got_, kHeaderBytes - rhdr_got_};
      iov[1] = {r.buf, r.len};
      size_t got;
      if (!take(iov, 2, &got)) return moved;
      moved = true;
      size_t hdr_part = std::min(got, kHeaderBytes - rhdr_got_);
      rhdr_got_ += hdr_part;
      if (rhdr_got_ < kHeaderBytes) continue;
      rhdr_got_ = 0;
      const size_t early = got - hdr_part;
      if (!check_header(r.buf, early)) {
        // Note [Messages out of order]: the message's bytes that came with its header are its payload's start;
        // any beyond its end belong to the frames after it, read again from ahead_.
        start_diverting();
        div_done_ = std::min(early, div_.payload.size());
        if (div_done_) std::memcpy(div_.payload.data(), r.buf, div_done_);
        if (early > div_done_) ahead_.insert(0, r.buf + div_done_, early - div_done_);
        continue;
      }
      in_payload_ = true;
      r.done = early;
    }
    if (r.done < r.len) {
      iovec iov{r.buf + r.done, r.len - r.done};
      size_t k;
      if (!take(&iov, 1, &k)) return moved;
      moved = true;
      r.done += k;
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
  if (rhdr_got_ == 0) {
    salvage_abort(diverting_ ? div_.payload.size() - div_done_
                  : in_payload_ && !recvs_.empty() ? recvs_.front().len - recvs_.front().done : 0);
  }
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
