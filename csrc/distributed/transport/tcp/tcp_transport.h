// defines: TcpTransport, the Transport over one TCP connection per pair of
// ranks (a full mesh made at init and reused for the life of the group), with
// shared-memory rings between ranks on the same host (Note [Same-host pairs]).
//
// Progress is driven by the thread that waits: non-blocking sockets, every
// pending send and receive advanced with sendmsg/recv until the awaited request
// is complete. While nothing moves it spins for a bounded time (waking a
// sleeping thread costs ~90 us on these VMs, a spin ~8 us), then blocks in
// poll() in slices until the deadline.
//
// Frame on the wire (40 bytes header, then payload):
//   u32 magic "CXF1" | u8 type | u8 kind | u8 dtype | u8 op | i32 root |
//   u32 abort_kind | u64 count | u64 seq | u64 payload_len
// A receive posted for N bytes accepts only a DATA frame of exactly N bytes
// whose descriptor equals ours; an ABORT frame carries a peer's error message.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "distributed/net/socket.h"
#include "distributed/store/store.h"
#include "distributed/transport/shm/shm.h"
#include "distributed/transport/transport.h"

namespace cx::distributed {

struct TcpOptions {
  int spin_us = 50;  // busy-poll this long before sleeping in poll()
  bool shm = true;   // same-host pairs use shared-memory rings (CX_SHM)
  size_t shm_ring_bytes = 1 << 20;  // per ordered pair (CX_SHM_RING_BYTES)
};

class TcpTransport : public Transport {
 public:
  // Connects the full mesh: publishes this rank's listening address in the
  // store, connects to lower ranks, accepts higher ones.
  TcpTransport(StoreClient& store, int rank, int world, uint64_t nonce, const Deadline& dl, TcpOptions opt);
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  void begin(const OpDesc& desc, const Deadline& dl) override;
  Req isend(int peer, const void* buf, size_t bytes) override;
  Req irecv(int peer, void* buf, size_t bytes) override;
  void wait(Req r) override;
  void wait_all() override;
  void abort(ErrorKind kind, const std::string& msg) override;
  void close(const Deadline& dl) override;

  static constexpr size_t kHeaderBytes = 40;

 private:
  struct SendOp {
    const char* buf;
    size_t len;
    size_t done;  // bytes of header + payload written
    Req id;
    char hdr[kHeaderBytes];
  };
  struct RecvOp {
    char* buf;
    size_t len;
    size_t done;
    Req id;
  };
  struct Peer {
    net::Fd fd;
    std::string addr;
    bool shm = false;      // data through the rings below; the socket carries only ABORT frames
    shm::Ring in, out;     // peer -> us (in our segment), us -> peer (in its segment)
    shm::Bell* bell = nullptr;  // the peer's doorbell
    std::deque<SendOp> sends;
    std::deque<RecvOp> recvs;
    char rhdr[kHeaderBytes];
    size_t rhdr_got = 0;
    bool in_payload = false;
  };

  bool progress();                 // true if any byte moved
  bool progress_send(int peer);
  bool progress_recv(int peer);
  bool progress_send_shm(int peer);
  bool progress_recv_shm(int peer);
  void setup_shm(uint64_t nonce, const Deadline& dl);
  // The socket of a shared-memory peer became readable: it aborted or died. Throws.
  [[noreturn]] void shm_peer_event(int peer);
  // Validates rhdr; throws on mismatch or a peer's abort. `early` holds bytes
  // that arrived right after the header (read in the same call).
  void check_header(int peer, const char* early, size_t early_n);
  void block();  // sleeps in poll() on the pending sockets, up to 100 ms or the deadline
  [[noreturn]] void peer_closed(int peer, const char* during);
  void salvage_abort(int peer);  // throws the peer's abort reason if it left one
  [[noreturn]] void timed_out();
  void fill_header(char* h, uint8_t type, uint64_t payload_len, uint32_t abort_kind) const;

  int rank_;
  int world_;
  TcpOptions opt_;
  std::vector<Peer> peers_;  // index = rank; peers_[rank_] unused
  shm::Segment seg_;                   // ours: our doorbell and the rings into us
  std::vector<shm::Segment> peer_seg_;  // index = rank: mapped segments of same-host peers
  OpDesc desc_;
  Deadline deadline_{};
  std::vector<char> done_;   // per request of the current operation
  int pending_ = 0;          // requests posted and not complete
  bool aborted_ = false;
};

}  // namespace cx::distributed
