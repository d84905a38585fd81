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

void Channel::check_header(const char* early, size_t early_n, bool remote_ok) {
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
  if (!(theirs == op_.desc)) {
    CX_THROW(MismatchError, "mismatched collectives: rank ", rank_, " called ", op_.desc.describe(), " but rank ",
             peer_, " called ", theirs.describe(),
             ". Every rank must call the same collectives in the same order with the same count, dtype, op "
             "and root.");
  }
  const RecvOp& r = recvs_.front();
  if (len != r.len) {
    CX_THROW(MismatchError, "rank ", rank_, ": rank ", peer_, " sent a message of ", len, " bytes where ", r.len,
             " were expected during ", op_.desc.describe(),
             " (ranks disagree on the message layout; are the pycyxwiz versions the same?)");
  }
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
