// defines: Channel, one peer as a MeshTransport sees it (the connection to that
// peer, the sends and receives posted to it, and how their bytes move), and
// Operation, the state of the collective under way that all channels share.
//
// Two implementations, chosen per pair of ranks at setup (mesh_transport.cpp):
//   TcpChannel (tcp/tcp_channel.h): frames over the pair's non-blocking socket.
//   ShmChannel (shm/shm_channel.h): frames through shared-memory rings; the socket
//     carries only ABORT frames, and its end-of-stream says the peer died.
// Both carry the same frames (frame.h) and raise the same errors with the same
// words, so an algorithm cannot tell them apart.
//
// The transport calls a busy channel once per progress pass, never per byte;
// when nothing moves it asks each what to wait on (wait_on) and sleeps.
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "distributed/net/socket.h"
#include "distributed/transport/frame.h"
#include "distributed/transport/transport.h"

namespace cx::distributed {

// The collective under way. The transport owns it and resets it in begin();
// channels read the descriptor and deadline and mark their requests done.
struct Operation {
  OpDesc desc;
  Deadline deadline{};
  std::vector<char> done;  // per request of the current operation
  int pending = 0;         // requests posted and not complete
  bool copy_once = false;  // Transport::copy_once() was called in this operation
};

// What a busy channel waits on when no byte moves.
struct WaitOn {
  short events;  // for poll() on the channel's socket
  bool bell;     // its data comes through rings: sleep on our doorbell; the socket only says abort or death
};

class Channel {
 public:
  // `rank`: ours; `fd`: the connected socket to `peer` (non-blocking); `addr`
  // names the peer in errors; `op` outlives the channel.
  Channel(int rank, int peer, net::Fd fd, std::string addr, Operation& op);
  virtual ~Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int fd() const { return fd_.get(); }
  const std::string& addr() const { return addr_; }
  bool busy() const { return !sends_.empty() || !recvs_.empty() || !unacked_.empty(); }
  bool receiving() const { return !recvs_.empty(); }
  // Drops receive `id` if it is the only one posted and none of its frame has been read (its request stays
  // undone); false otherwise (Note [Sends before receives] in process_group.cpp).
  bool cancel_untouched_recv(Transport::Req id);

  // Queues a send of request `id` and starts writing at once: small messages
  // usually leave in this one call.
  virtual void isend(Transport::Req id, const char* buf, size_t len) = 0;
  // Queues a receive; a send/recv message read earlier for it (Note [Messages out of order]) completes it at once.
  void irecv(Transport::Req id, char* buf, size_t len);
  // A send/recv message from `root` with `tag` was read ahead and waits for its receive.
  bool has_stashed(int root, uint32_t tag) const;
  // The send/recv messages read ahead that wait for their receives, oldest first.
  std::vector<OpDesc> stashed() const;
  // Request `id` completes once the peer's next frame, a send/recv message (peek said so), is in the stash.
  void irecv_aside(Transport::Req id) { recvs_.push_back(RecvOp{nullptr, 0, 0, id, true}); }

  // One pass: moves what can move of the pending sends, then the pending
  // receives, without blocking, and marks finished requests done. True if any
  // byte moved. Throws ConnectionError, MismatchError, or a peer's abort error.
  virtual bool progress() = 0;
  virtual WaitOn wait_on() const = 0;
  // With no receive posted, what the peer sent next, without reading it (Note [Receiving from any source]):
  // nothing whole yet; a DATA or REMOTE frame, its descriptor in *d; something a receive posted here raises
  // (an ABORT frame, a reset); or the peer's end (it closed its side: it sends nothing more).
  enum class Next { kNothing, kFrame, kRaise, kEnded };
  virtual Next peek(OpDesc* d) = 0;
  // Whether each side of the pair copies the other's messages straight out of its memory (Note [Single-copy
  // large messages] in shm/shm.h); known once the peer has made its channel too.
  virtual bool copies_once() const { return false; }
  // The socket of a channel whose data does not travel on it (WaitOn::bell)
  // polled readable and the channel is still busy after its rings were drained:
  // the peer aborted or died. Throws its error.
  virtual void socket_event() = 0;
  // Tells the peer why the group fails (an ABORT frame, best effort, 200 ms),
  // drops the pending requests and half-closes the socket.
  virtual void abort(ErrorKind kind, const std::string& text) = 0;

  // Graceful end, in two halves so that the transport can wait on all peers at
  // once: half_close() says we send nothing more; drain() reads and drops what
  // the peer sent, once its socket polled readable, and returns false when the
  // peer has closed its side too.
  void half_close();
  bool drain();

 protected:
  struct SendOp {
    const char* buf;
    size_t len;
    size_t done;  // bytes of header + payload written
    Transport::Req id;
    char hdr[frame::kHeaderBytes];
    // A REMOTE frame: its payload on the wire is buf's address (Note [Single-copy large messages] in shm/shm.h).
    bool remote = false;
  };
  struct RecvOp {
    char* buf;
    size_t len;
    size_t done;
    Transport::Req id;
    bool aside = false;  // irecv_aside's: done when one message is stashed
  };
  // div_ is whole: into the stash, and the front receive done if it only wanted that message aside.
  void stashed_one();

  void queue_send(Transport::Req id, const char* buf, size_t len, bool remote = false) {
    SendOp op{buf, len, 0, id, {}, remote};
    frame::fill(op.hdr, remote ? frame::kRemote : frame::kData, op_.desc, len, 0);
    sends_.push_back(op);
  }
  void complete(Transport::Req id) {
    op_.done[static_cast<size_t>(id)] = 1;
    --op_.pending;
  }
  // Validates rhdr_ against the operation and the front receive; throws on a
  // mismatch or a peer's abort. `early` holds bytes that arrived right after the
  // header (read in the same call). False: the frame is a send/recv message for a
  // later receive, which the channel reads into the stash (Note [Messages out of order]).
  // A REMOTE frame passes only where `remote_ok` (a shared-memory channel).
  bool check_header(const char* early, size_t early_n, bool remote_ok = false);
  // Throws MismatchError unless a frame of `theirs` with `len` payload bytes is what the operation's receive of
  // `want` bytes expects.
  void check_matches(const OpDesc& theirs, uint64_t len, size_t want) const;
  // Note [Messages out of order]: rhdr_'s frame goes to the stash; its payload is read into div_.
  void start_diverting();
  // Reads on, after the connection failed under us, for the ABORT frame the
  // peer may have left; throws its error if there is one. `skip` payload bytes
  // come before the next header.
  void salvage_abort(size_t skip);
  [[noreturn]] void lost_connection(const char* during, int err);
  // A frame that is neither DATA nor ABORT: ConnectionError naming its type.
  [[noreturn]] void unknown_frame(uint8_t type);
  void send_abort_frame(ErrorKind kind, const std::string& text, const Deadline& dl);

  const int rank_;
  const int peer_;
  net::Fd fd_;
  std::string addr_;
  Operation& op_;
  std::deque<SendOp> sends_;
  std::deque<RecvOp> recvs_;
  // REMOTE frames written and not yet read by the peer: the request, and the count of the peer's acks that
  // completes it (Note [Single-copy large messages]).
  std::deque<std::pair<Transport::Req, uint64_t>> unacked_;
  char rhdr_[frame::kHeaderBytes];  // header of the frame being received
  size_t rhdr_got_ = 0;
  bool in_payload_ = false;
  // Note [Messages out of order]: send/recv messages read ahead of their receive, in the order they came, and the
  // one being read now (diverting_: its payload, div_done_ bytes of it so far).
  struct Stashed {
    OpDesc desc;
    std::vector<char> payload;
  };
  std::deque<Stashed> stash_;
  Stashed div_;
  size_t div_done_ = 0;
  bool diverting_ = false;
};

}  // namespace cx::distributed
