#include "distributed/transport/shm/shm_channel.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace cx::distributed {

using frame::kHeaderBytes;

ShmChannel::ShmChannel(int rank, int peer, net::Fd fd, std::string addr, Operation& op, const shm::Segment& own,
                       shm::Segment theirs, bool single_copy, bool core_each)
    : Channel(rank, peer, std::move(fd), std::move(addr), op),
      theirs_(std::move(theirs)),
      in_(own.ring(peer)),
      out_(theirs_.ring(rank)),
      bell_(theirs_.bell()),
      peer_pid_(bell_->pid),
      core_each_(core_each) {
  // Note [Single-copy large messages]: tell the peer whether we can read its memory.
  if (single_copy && shm::can_read_peer(bell_)) in_.ctl->can_read.store(1, std::memory_order_release);
}

void ShmChannel::isend(Transport::Req id, const char* buf, size_t len) {
  const bool remote = (op_.copy_once || shm::single_copy_pays(op_.desc, len, core_each_)) &&
                      out_.ctl->can_read.load(std::memory_order_acquire) == 1;
  queue_send(id, buf, len, remote);
  progress_send();
}

bool ShmChannel::progress() {
  bool moved = false;
  if (!sends_.empty()) moved |= progress_send();
  if (!recvs_.empty()) moved |= progress_recv();
  if (!unacked_.empty()) moved |= progress_acks();
  return moved;
}

bool ShmChannel::progress_acks() {
  const uint64_t acks = out_.ctl->acks.load(std::memory_order_acquire);
  bool moved = false;
  while (!unacked_.empty() && acks >= unacked_.front().second) {
    complete(unacked_.front().first);
    unacked_.pop_front();
    moved = true;
  }
  return moved;
}

Channel::Next ShmChannel::peek(OpDesc* d) {
  char h[kHeaderBytes];
  if (shm::peek(in_, h, kHeaderBytes)) {
    const uint8_t type = frame::type(h);
    if (!frame::has_magic(h) || (type != frame::kData && type != frame::kRemote)) return Next::kRaise;
    *d = frame::desc(h);
    return Next::kFrame;
  }
  // Nothing in the ring: on the socket, the peer's ABORT frame, or its end.
  char c;
  const ssize_t k = ::recv(fd_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Next::kNothing;
  return k == 0 ? Next::kEnded : Next::kRaise;
}

WaitOn ShmChannel::wait_on() const {
  return {POLLIN, true};  // anything on the socket: the peer aborted or died
}

bool ShmChannel::progress_send() {
  bool moved = false;
  while (!sends_.empty()) {
    SendOp& s = sends_.front();
    if (s.done < kHeaderBytes) {
      size_t n = shm::write(out_, s.hdr + s.done, kHeaderBytes - s.done);
      if (n == 0) break;
      s.done += n;
      moved = true;
      if (s.done < kHeaderBytes) break;
    }
    // A REMOTE frame's payload on the wire is the buffer's address; the bytes stay where they are.
    const uintptr_t where = reinterpret_cast<uintptr_t>(s.buf);
    const char* payload = s.remote ? reinterpret_cast<const char*>(&where) : s.buf;
    const size_t wire = s.remote ? sizeof(uint64_t) : s.len;
    // Note [Publishing in pieces] in shm.h: the peer reads each piece while we copy the next.
    while (s.done < kHeaderBytes + wire) {
      const size_t sent = s.done - kHeaderBytes;
      const size_t n = shm::write(out_, payload + sent, std::min(wire - sent, shm::kPublishBytes));
      if (n == 0) break;
      s.done += n;
      moved = true;
    }
    if (s.done == kHeaderBytes + wire) {
      if (s.remote) {
        unacked_.emplace_back(s.id, ++remote_sent_);  // done when the peer has read it
      } else {
        complete(s.id);
      }
      sends_.pop_front();
    } else {
      break;  // ring full
    }
  }
  if (moved) shm::notify(bell_);
  return moved;
}

bool ShmChannel::progress_recv() {
  bool moved = false;
  while (!recvs_.empty()) {
    RecvOp& r = recvs_.front();
    if (!in_payload_ && !diverting_) {
      size_t n = shm::read(in_, rhdr_ + rhdr_got_, kHeaderBytes - rhdr_got_);
      if (n == 0) break;
      moved = true;
      rhdr_got_ += n;
      if (rhdr_got_ < kHeaderBytes) break;
      rhdr_got_ = 0;
      remote_in_ = frame::type(rhdr_) == frame::kRemote;
      raddr_got_ = 0;
      if (!check_header(nullptr, 0, true)) {
        start_diverting();  // Note [Messages out of order]: a message for a later receive, into the stash
      } else {
        in_payload_ = true;
        r.done = 0;
      }
    }
    if (diverting_) {
      char* into = div_.payload.data();
      const size_t len = div_.payload.size();
      if (remote_in_) {
        if (!read_remote(into, len, moved)) break;
        div_done_ = len;
        moved = true;
      } else if (div_done_ < len) {
        size_t n = shm::read(in_, into + div_done_, len - div_done_);
        if (n == 0) break;
        moved = true;
        div_done_ += n;
      }
      if (div_done_ < len) break;  // ring empty
      stashed_one();
      continue;
    }
    if (remote_in_) {
      if (!read_remote(r.buf, r.len, moved)) break;
      r.done = r.len;
      moved = true;
    } else if (r.done < r.len) {
      size_t n = shm::read(in_, r.buf + r.done, r.len - r.done);
      if (n == 0) break;
      moved = true;
      r.done += n;
    }
    if (r.done == r.len) {
      in_payload_ = false;
      complete(r.id);
      recvs_.pop_front();
    } else {
      break;  // ring empty
    }
  }
  if (moved) shm::notify(bell_);  // the writer may be waiting for room
  return moved;
}

// A REMOTE frame's payload: its address from the ring (false while not all of it is there), then `len` bytes
// copied out of the peer's memory, and the peer's buffer acknowledged. `moved`: whether a byte moved.
bool ShmChannel::read_remote(char* into, size_t len, bool& moved) {
  if (raddr_got_ < sizeof(raddr_)) {
    size_t n = shm::read(in_, raddr_ + raddr_got_, sizeof(raddr_) - raddr_got_);
    moved |= n > 0;
    raddr_got_ += n;
    if (raddr_got_ < sizeof(raddr_)) return false;
  }
  uint64_t addr;
  std::memcpy(&addr, raddr_, sizeof(addr));
  if (const int err = shm::read_peer(peer_pid_, into, addr, len)) {
    salvage_abort(0);  // the peer's own error, if it left one
    lost_connection("receiving from", err);
  }
  in_.ctl->acks.fetch_add(1, std::memory_order_release);  // the peer's buffer is free again
  return true;
}

void ShmChannel::socket_event() {
  char h[kHeaderBytes] = {};
  bool framed = false;
  // Bounded by the operation's deadline too, so a dying peer cannot push us past it.
  auto bounded = [&] { return Deadline::after_ms(std::max(1, op_.deadline.remaining_ms(1000))); };
  try {
    net::recv_exact(fd_.get(), h, kHeaderBytes, bounded(), "peer");
    framed = frame::has_magic(h) && frame::type(h) == frame::kAbort;
  } catch (const Error&) {
  }
  // Only ABORT frames travel on this socket: anything else ends the connection.
  if (!framed && frame::has_magic(h) && frame::type(h) != frame::kAbort) unknown_frame(frame::type(h));
  if (framed) {
    // The peer failed and says why (Channel::abort); raise its error here too.
    const uint64_t len = frame::payload_len(h);
    std::string msg;
    if (len <= frame::kMaxAbortMessage) {
      std::string m(len, '\0');
      try {
        net::recv_exact(fd_.get(), m.data(), len, bounded(), "an aborting peer");
        msg = std::move(m);
      } catch (const Error&) {
      }
    }
    frame::raise_abort(h, msg, rank_, peer_, op_.desc);
  }
  // Its stream holds nothing but an ABORT frame, if anything.
  salvage_abort(0);
  lost_connection(recvs_.empty() ? "sending to" : "receiving from", 0);
}

void ShmChannel::abort(ErrorKind kind, const std::string& text) {
  try {
    send_abort_frame(kind, text, Deadline::after_ms(200));
  } catch (const Error&) {
    // The peer is gone or not reading: it will see the connection close.
  }
  sends_.clear();
  recvs_.clear();
  unacked_.clear();
  shm::ring_bell(bell_);  // a peer asleep on its bell looks at the socket now
  half_close();
}

}  // namespace cx::distributed
