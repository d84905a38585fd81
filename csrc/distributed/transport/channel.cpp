#include "distributed/transport/channel.h"

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

namespace cx::distributed {

Channel::Channel(int rank, int peer, net::Fd fd, std::string addr, Operation& op)
    : rank_(rank), peer_(peer), fd_(std::move(fd)), addr_(std::move(addr)), op_(op) {}

// Note [Messages out of order]
// torch's gloo backend matches a recv to the message of its sender and tag, whatever else the pair exchanged
// first: rank 0's isend then all_reduce against rank 1's all_reduce then recv runs, and so do two tags received
// in the other order than sent. Our frames between two ranks keep one order, so a receive that finds a
// send/recv message where it expects its own frame -- a collective's, or a message of another tag or from
// another sender -- reads that message into the channel's stash (its payload copied out of the socket, the ring
// or, for a REMOTE frame, the sender's memory, which completes the sender's send) and reads on. A later recv
// of that sender and tag takes the first such message from the stash before it reads the connection. Messages
// of one sender and tag keep their order (the pair's message numbers count per tag: ProcessGroup::send), and the
// stashed message is checked as any other (count, dtype, number). What stays an error: a collective's frame
// where a recv waits (gloo would hang there too) and any disagreement between collectives. A message never
// received stays in the stash until the group ends, as it would in gloo's buffers.
void Channel::irecv(Transport::Req id, char* buf, size_t len) {
  if (!stash_.empty() && op_.desc.kind == CollectiveKind::kSendRecv) {
    for (auto it = stash_.begin(); it != stash_.end(); ++it) {
      if (it->desc.root != op_.desc.root || it->desc.tag != op_.desc.tag) continue;
      check_matches(it->desc, it->payload.size(), len);
      if (len) std::memcpy(buf, it->payload.data(), len);
      stash_.erase(it);
      complete(id);
      return;
    }
  }
  recvs_.push_back(RecvOp{buf, len, 0, id});
}

bool Channel::has_stashed(int root, uint32_t tag) const {
  for (const Stashed& m : stash_)
    if (m.desc.root == root && m.desc.tag == tag) return true;
  return false;
}

std::vector<OpDesc> Channel::stashed() const {
  std::vector<OpDesc> out;
  for (const Stashed& m : stash_) out.push_back(m.desc);
  return out;
}

void Channel::start_diverting() {
  div_.desc = frame::desc(rhdr_);
  div_.payload.resize(frame::payload_len(rhdr_));
  div_done_ = 0;
  diverting_ = true;
}

void Channel::stashed_one() {
  stash_.push_back(std::move(div_));
  div_ = Stashed{};
  diverting_ = false;
  if (recvs_.front().aside) {
    complete(recvs_.front().id);
    recvs_.pop_front();
  }
}

bool Channel::cancel_untouched_recv(Transport::Req id) {
  if (recvs_.size() != 1 || recvs_.front().id != id || recvs_.front().aside || in_payload_ || diverting_ ||
      rhdr_got_ != 0) {
    return false;
  }
  recvs_.clear();
  --op_.pending;
  return true;
}

void Channel::check_matches(const OpDesc& theirs, uint64_t len, size_t want) const {
  if (!(theirs == op_.desc)) {
    CX_THROW(MismatchError, "mismatched collectives: rank ", rank_, " called ", op_.desc.describe(), " but rank ",
             peer_, " called ", theirs.describe(),
             ". Every rank must call the same collectives in the same order with the same count, dtype, op "
             "and root.");
  }
  if (len != want) {
    CX_THROW(MismatchError, "rank ", rank_, ": rank ", peer_, " sent a message of ", len, " bytes where ", want,
             " were expected during ", op_.desc.describe(),
             " (ranks disagree on the message layout; are the pycyxwiz versions the same?)");
  }
}

bool Channel::check_header(const char* early, size_t early_n, bool remote_ok) {
  const char* h = rhdr_;
  if (!frame::has_magic(h)) {
    CX_THROW(ConnectionError, "rank ", rank_, ": garbled data from rank ", peer_, " during ", op_.desc.describe(),
             " (not a pycyxwiz frame)");
  }
  uint64_t len = frame::payload_len(h);
  if (frame::type(h) == frame::kAbort) {
    // The peer failed and tells us why; read its message (bounded) and raise it.
    if (len > frame::kMaxAbortMessage) {
      frame::raise_abort(h, detail::concat("(a report of ", len, " bytes, longer than the ", frame::kMaxAbortMessage,
                                           " allowed: not read)"), rank_, peer_, op_.desc);
    }
    std::string msg(len, '\0');
    size_t have = std::min<size_t>(early_n, len);  // read together with the header
    std::memcpy(msg.data(), early, have);
    try {
      net::recv_exact(fd_.get(), msg.data() + have, len - have, Deadline::after_ms(1000), "an aborting peer");
    } catch (const Error&) {
      msg.clear();
    }
    frame::raise_abort(h, msg, rank_, peer_, op_.desc);
  }
  if (frame::type(h) != frame::kData && !(remote_ok && frame::type(h) == frame::kRemote)) unknown_frame(frame::type(h));
  OpDesc theirs = frame::desc(h);
  // Note [Messages out of order]: a send/recv message that is not this receive's (a collective is under way, or a
  // recv of another sender or tag) waits in the stash for its own.
  if (theirs.kind == CollectiveKind::kSendRecv &&
      !(op_.desc.kind == CollectiveKind::kSendRecv && op_.desc.root == theirs.root && op_.desc.tag == theirs.tag)) {
    return false;
  }
  check_matches(theirs, len, recvs_.front().len);
  return true;
}

// A peer that gave up (timeout, mismatch, its own dead peer) leaves an ABORT
// frame in the stream before closing. When its connection fails under us, read
// on for that frame (bounded in time and bytes) so we raise its reason rather
// than a bare "connection lost".
void Channel::salvage_abort(size_t skip_first) {
  auto dl = Deadline::after_ms(200);
  char abort_hdr[frame::kHeaderBytes];
  std::optional<std::string> abort_text;
  std::vector<char> sink(64 * 1024);
  size_t budget = 64u << 20;
  auto skip = [&](size_t n) {
    while (n > 0) {
      size_t k = std::min(n, sink.size());
      net::recv_exact(fd_.get(), sink.data(), k, dl, "peer");
      n -= k;
    }
  };
  try {
    if (skip_first > budget) return;
    skip(skip_first);
    for (;;) {
      char h[frame::kHeaderBytes];
      net::recv_exact(fd_.get(), h, frame::kHeaderBytes, dl, "peer");
      if (!frame::has_magic(h)) return;
      uint64_t len = frame::payload_len(h);
      if (frame::type(h) == frame::kAbort) {
        if (len > frame::kMaxAbortMessage) return;
        std::string msg(len, '\0');
        net::recv_exact(fd_.get(), msg.data(), len, dl, "peer");
        std::memcpy(abort_hdr, h, frame::kHeaderBytes);
        abort_text = std::move(msg);
        break;
      }
      if (len > budget) return;
      budget -= len;
      skip(len);
    }
  } catch (const ConnectionError&) {
  } catch (const TimeoutError&) {
  }
  // Raised outside the try: the peer's error may itself be a ConnectionError.
  if (abort_text) frame::raise_abort(abort_hdr, *abort_text, rank_, peer_, op_.desc);
}

void Channel::unknown_frame(uint8_t type) {
  CX_THROW(ConnectionError, "rank ", rank_, ": unknown frame type ", int(type), " from rank ", peer_, " (", addr_,
           ") during ", op_.desc.describe(),
           ": the connection is not trusted any more (a pycyxwiz of another version on that rank?)");
}

void Channel::lost_connection(const char* during, int err) {
  CX_THROW(ConnectionError, "rank ", rank_, ": lost the connection to rank ", peer_, " (", addr_, ") while ", during,
           " it during ", op_.desc.describe(), ": rank ", peer_, " exited, crashed or was killed (",
           err ? std::strerror(err) : "connection closed", ")");
}

void Channel::send_abort_frame(ErrorKind kind, const std::string& text, const Deadline& dl) {
  char h[frame::kHeaderBytes];
  frame::fill(h, frame::kAbort, op_.desc, text.size(), static_cast<uint32_t>(kind));
  net::send_exact(fd_.get(), h, frame::kHeaderBytes, dl, "peer");
  net::send_exact(fd_.get(), text.data(), text.size(), dl, "peer");
}

void Channel::half_close() {
  // After an abort, the peer reads our ABORT frame, then end-of-stream. The
  // descriptor itself stays open until the group is destroyed, so no reset can
  // overtake the frame.
  ::shutdown(fd_.get(), SHUT_WR);
}

bool Channel::drain() {
  char sink[4096];
  ssize_t k = ::recv(fd_.get(), sink, sizeof(sink), MSG_DONTWAIT);
  return k > 0 || (k < 0 && (errno == EAGAIN || errno == EINTR));
}

}  // namespace cx::distributed
