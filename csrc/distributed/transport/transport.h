// defines: Transport, the interface every collective algorithm is written over,
// and OpDesc, the description of the collective a message belongs to.
//
// An algorithm never sees a socket. It posts non-blocking sends and receives of
// byte ranges to and from peer ranks and waits for them; the transport moves the
// bytes (TCP today; shared memory or NCCL would implement the same interface).
//
// Ordering: sends to one peer leave in the order they were posted, and receives
// from one peer are matched in the order they were posted, so two ranks that run
// the same algorithm agree on every message without tags.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "distributed/types.h"

namespace cx::distributed {

// Every message carries the descriptor of the operation it belongs to; a
// receiver whose own descriptor differs raises MismatchError naming both.
struct OpDesc {
  CollectiveKind kind = CollectiveKind::kBarrier;
  DataType dtype = DataType::kBytes;
  ReduceOp op = ReduceOp::kNone;
  int32_t root = -1;
  uint64_t count = 0;  // elements per rank, as the caller passed them
  uint64_t seq = 0;    // collective number (per peer pair for send/recv)
  uint32_t site = 0;   // CX_DEBUG=DETAIL: the Python call site (call_site_id), else 0; not for send/recv
  uint32_t tag = 0;    // send/recv: the caller's tag (torch's), which the two sides must agree on

  // A send and its recv are two call sites by nature: their sites stay local (Note [Call sites in
  // CX_DEBUG=DETAIL]), and their frames carry the tag in that word instead.
  bool operator==(const OpDesc& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count &&
           seq == o.seq && tag == o.tag && (kind == CollectiveKind::kSendRecv || site == o.site);
  }
  // "all_reduce(count=10, dtype=float32, op=SUM) as collective #5" (" at train.py:12" with a site)
  std::string describe() const;
};

// Note [Call sites in CX_DEBUG=DETAIL]
// Two collectives of the same shape issued in different orders on two ranks
// (a branch taken on one rank only) pair up silently: every message matches.
// With CX_DEBUG=DETAIL the Python wrappers name the caller's file:line before
// each collective (set_call_site); it travels as a 32-bit id in the frame
// header (the DATA and REMOTE frames' unused abort-kind word) and in the
// fingerprint, so the call itself raises MismatchError naming both sites. A
// send and its recv are two sites by nature: theirs are not compared, and
// their frames carry the caller's tag in that word. The texts are kept
// per process (and travel in flight records), so a rank can name a peer's site.
// Off by default: the frame lookup and the id cost 2.9 us a call (measured on a
// loaded 2-vCPU machine), on top of DETAIL's log line.
uint32_t call_site_id(const std::string& text);  // nonzero; remembers the text
// The site the next collective submitted on this thread belongs to ("" clears it).
void set_call_site(const std::string& text);
uint32_t current_call_site();
// "train.py:12", or "call site 0x1234abcd" for an id this process never saw.
std::string call_site_text(uint32_t id);

// Thrown by a receive that gave way to sends queued behind it (Note [Sends before receives] in
// process_group.cpp): its operation goes back to the queue, not failed.
struct OpYielded {};

class Transport {
 public:
  using Req = int;

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The host of every rank (index = rank), numbered 0, 1, ... in the order of each
  // host's lowest rank, the same on every rank; empty where unknown (then
  // collectives treat the group as flat).
  virtual std::vector<int> hosts() const { return {}; }
  // Whether this rank and every other copy each other's messages once, straight out of the sender's memory
  // (shared memory with single copies: Note [Single-copy large messages] in shm/shm.h). What this rank knows of
  // its own pairs; valid once every rank has made its transport (after the first operation).
  virtual bool reads_peers() const { return false; }
  // Whether every pair of this rank's moves its messages through shared-memory rings (no socket).
  virtual bool through_rings() const { return false; }
  // The same for the pairs of this rank's on its own host (false where the hosts are unknown or it has none).
  virtual bool host_through_rings() const { return false; }

  // Starts an operation: messages sent from now on carry `desc`, messages
  // received must carry an equal one, and every wait gives up at `dl`.
  virtual void begin(const OpDesc& desc, const Deadline& dl) = 0;

  // Post a send/receive of exactly `bytes` bytes. The buffer must stay valid
  // and (for a send) unchanged until the request completes.
  virtual Req isend(int peer, const void* buf, size_t bytes) = 0;
  virtual Req irecv(int peer, void* buf, size_t bytes) = 0;
  // The sends posted from now until the operation ends go as single copies to every peer that can read our
  // memory, whatever the size rule for the collective says: for an algorithm built on them (Note [Broadcast
  // from the root to all] in algorithms/broadcast.cpp).
  virtual void copy_once() {}

  // Drives progress until `r` is complete. Throws TimeoutError, ConnectionError
  // (peer closed or died), MismatchError, or the error a peer aborted with.
  virtual void wait(Req r) = 0;
  virtual void wait_all() = 0;

  // Note [Receiving from any source]: waits (until the operation's deadline) for a peer whose next frame is a
  // send/recv message from it, or an ABORT or its end, and returns that peer without reading anything; then
  // set_desc() to that message's descriptor, and irecv() from the peer as usual.
  virtual int wait_any_message() { CX_THROW(InvalidArgument, "recv from any source is not supported here"); }
  virtual void set_desc(const OpDesc& desc) {}
  // Note [Sends before receives] in process_group.cpp: while *flag is set, a send/recv operation's receive that
  // would sleep before any byte of its message came drops its request and throws OpYielded.
  virtual void set_yield(std::atomic<bool>* flag) { (void)flag; }

  // Fails the group: every peer is told (best effort, bounded time) why, so a
  // rank that waits on us raises the same error instead of timing out.
  virtual void abort(ErrorKind kind, const std::string& msg) = 0;

  // Graceful end: tells peers we are done and waits (until `dl`) for them to
  // say the same, so no connection is torn down under data still in flight.
  virtual void close(const Deadline& dl) {}

  // Payload bytes handed to isend since the transport was made (frame headers
  // not counted); read from any thread. The benchmarks count a step's bytes
  // with it (cx.distributed._bytes_sent()).
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

 protected:
  void count_sent(size_t bytes) { bytes_sent_.fetch_add(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> bytes_sent_{0};
};

}  // namespace cx::distributed
