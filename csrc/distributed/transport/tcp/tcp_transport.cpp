#include "distributed/transport/tcp/tcp_transport.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace cx::distributed {

namespace {

constexpr uint32_t kFrameMagic = 0x31465843;  // "CXF1"
constexpr uint32_t kHandshakeMagic = 0x31485843;  // "CXH1"
constexpr uint8_t kData = 1;
constexpr uint8_t kAbort = 2;
constexpr uint64_t kMaxAbortMessage = 64 * 1024;

template <typename T>
void put(char* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof(T));
}
template <typename T>
T get(const char* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}

OpDesc desc_of(const char* h) {
  OpDesc d;
  d.kind = static_cast<CollectiveKind>(static_cast<uint8_t>(h[5]));
  d.dtype = static_cast<DataType>(static_cast<uint8_t>(h[6]));
  d.op = static_cast<ReduceOp>(static_cast<uint8_t>(h[7]));
  d.root = get<int32_t>(h, 8);
  d.count = get<uint64_t>(h, 16);
  d.seq = get<uint64_t>(h, 24);
  return d;
}

}  // namespace

std::string OpDesc::describe() const {
  std::ostringstream os;
  os << kind_name(kind) << "(count=" << count;
  if (dtype != DataType::kBytes) os << ", dtype=" << dtype_name(dtype);
  if (op != ReduceOp::kNone) os << ", op=" << op_name(op);
  if (root >= 0) os << ", " << (kind == CollectiveKind::kSendRecv ? "peer" : "root") << "=" << root;
  os << ")";
  if (kind == CollectiveKind::kSendRecv) {
    os << " as message #" << seq << " between the pair";
  } else {
    os << " as collective #" << seq;
  }
  return os.str();
}

TcpTransport::TcpTransport(StoreClient& store, int rank, int world, uint64_t nonce, const Deadline& dl,
                           TcpOptions opt)
    : rank_(rank), world_(world), opt_(opt), peers_(static_cast<size_t>(world)) {
  const std::string ip = store.local_ip();
  net::Fd listener = net::listen_on(ip, 0, "listening port");
  const int port = net::bound_port(listener.get());
  store.set("addr/" + std::to_string(rank), ip + ":" + std::to_string(port), dl);

  // Lower ranks: we connect. Each hello names our rank and the group's nonce, so a
  // stray connection (another job, a previous group) is never taken for a peer.
  for (int j = 0; j < rank; ++j) {
    std::string a = store.get("addr/" + std::to_string(j), dl,
                              detail::concat("Timeout waiting for peers: rank ", rank, " waited ", dl.timeout_ms,
                                             " ms for rank ", j, " to publish its address"));
    auto colon = a.rfind(':');
    std::string host = a.substr(0, colon);
    int p = std::stoi(a.substr(colon + 1));
    std::string what = detail::concat("rank ", j, " (", a, ")");
    net::Fd fd = net::connect_with_retry(host, p, dl, what);
    char hello[16];
    put<uint32_t>(hello, 0, kHandshakeMagic);
    put<int32_t>(hello, 4, rank);
    put<uint64_t>(hello, 8, nonce);
    net::send_exact(fd.get(), hello, sizeof(hello), dl, what);
    char ack[8];
    net::recv_exact(fd.get(), ack, sizeof(ack), dl, what);
    if (get<uint32_t>(ack, 0) != kHandshakeMagic || get<int32_t>(ack, 4) != j) {
      CX_THROW(ConnectionError, "rank ", rank, ": the process at ", a, " is not rank ", j, " of this group");
    }
    peers_[j].fd = std::move(fd);
    peers_[j].addr = a;
  }
  // Higher ranks connect to us.
  int expected = world - 1 - rank;
  while (expected > 0) {
    net::Fd fd = net::accept_until(listener.get(), dl);
    if (!fd.valid()) {
      std::ostringstream missing;
      for (int j = rank + 1; j < world; ++j)
        if (!peers_[j].fd.valid()) missing << (missing.tellp() ? ", " : "") << j;
      CX_THROW(TimeoutError, "Timeout waiting for peers: rank ", rank, " waited ", dl.timeout_ms,
               " ms for rank(s) ", missing.str(), " to connect. Start all WORLD_SIZE=", world,
               " processes, or raise DISTRIBUTED_TIMEOUT_MS");
    }
    char hello[16];
    try {
      net::recv_exact(fd.get(), hello, sizeof(hello), Deadline::after_ms(std::min<int64_t>(dl.timeout_ms, 5000)),
                      "a connecting peer");
    } catch (const Error&) {
      continue;  // not one of ours
    }
    int32_t j = get<int32_t>(hello, 4);
    if (get<uint32_t>(hello, 0) != kHandshakeMagic || get<uint64_t>(hello, 8) != nonce || j <= rank || j >= world ||
        peers_[j].fd.valid()) {
      continue;  // stray or stale connection: drop it
    }
    char ack[8];
    put<uint32_t>(ack, 0, kHandshakeMagic);
    put<int32_t>(ack, 4, rank);
    net::send_exact(fd.get(), ack, sizeof(ack), dl, detail::concat("rank ", j));
    peers_[j].fd = std::move(fd);
    peers_[j].addr = "rank " + std::to_string(j);
    --expected;
  }
  setup_shm(nonce, dl);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    net::set_nonblocking(peers_[j].fd.get(), true);
    if (j > rank) {
      // Learn the peer's listening address for messages.
      peers_[j].addr = store.get("addr/" + std::to_string(j), dl, "timed out reading a peer address");
    }
  }
}

TcpTransport::~TcpTransport() = default;

// Note [Same-host pairs]
// Two ranks on one host move data through shared memory instead of their TCP
// connection: each rank makes a segment (shm.h) holding a receive ring per peer,
// and at init every pair tells each other, over the connection just made, its
// host key and segment name. A pair uses the rings only if both sides mapped
// the other's segment (same host, same /dev/shm, same ring size, CX_SHM not 0
// on either); otherwise it keeps TCP, so a mixed group still works. The
// connection stays open: ABORT frames still travel on it, and its end-of-stream
// is how a dead peer is noticed (a ring cannot tell). Frames in a ring are the
// same as on a socket (header, then payload), checked the same way, so
// mismatched collectives read the same. Once every peer answered, the segment's
// file is unlinked: the mappings live on, and a crash leaves nothing in /dev/shm.
void TcpTransport::setup_shm(uint64_t nonce, const Deadline& dl) {
  auto what = [&](int j) { return detail::concat("rank ", j, " (", peers_[j].addr, ")"); };
  // Every message here is a few hundred bytes per peer: it fits the socket
  // buffers, so sending to all before receiving from any cannot deadlock.
  auto send_all = [&](auto&& payload_for) {
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      const std::string m = payload_for(j);
      const uint32_t n = static_cast<uint32_t>(m.size());
      net::send_exact(peers_[j].fd.get(), &n, sizeof(n), dl, what(j));
      net::send_exact(peers_[j].fd.get(), m.data(), m.size(), dl, what(j));
    }
  };
  auto recv_from = [&](int j) {
    uint32_t n = 0;
    net::recv_exact(peers_[j].fd.get(), &n, sizeof(n), dl, what(j));
    if (n > 4096) {
      CX_THROW(ConnectionError, "rank ", rank_, ": garbled setup message from ", what(j),
               " (are the pycyxwiz versions the same on every rank?)");
    }
    std::string m(n, '\0');
    net::recv_exact(peers_[j].fd.get(), m.data(), n, dl, what(j));
    return m;
  };

  // 1. Which host: ranks with the same key may share memory (if CX_SHM allows).
  const std::string key = opt_.shm ? shm::host_key() : std::string();
  send_all([&](int) { return key; });
  std::vector<int> local;
  for (int j = 0; j < world_; ++j) {
    if (j != rank_ && recv_from(j) == key && !key.empty()) local.push_back(j);
  }

  // 2. Our segment, with the rings of those peers reserved up front: a full
  // /dev/shm (64 MiB in a default Docker container) then means TCP, never a
  // SIGBUS in the middle of a collective. Ring size: CX_SHM_RING_BYTES, less when
  // many ranks share the host, so that all rings together stay near 256 MiB
  // (every rank on a host computes the same size).
  std::string name;
  size_t cap = opt_.shm_ring_bytes;
  if (!local.empty()) {
    const size_t n = local.size() + 1;
    cap = std::min(cap, std::max<size_t>(64 * 1024, (size_t{256} << 20) / (n * (n - 1)) / 4096 * 4096));
    char buf[64];
    std::snprintf(buf, sizeof(buf), "cx-%016llx-%d", static_cast<unsigned long long>(nonce), rank_);
    try {
      seg_ = shm::Segment::create(buf, world_, cap, local);
      name = buf;
    } catch (const Error&) {
      seg_ = shm::Segment();  // no room or no /dev/shm: this rank stays on TCP
    }
  }
  send_all([&](int) { return name; });
  peer_seg_.resize(static_cast<size_t>(world_));
  std::vector<char> mapped(static_cast<size_t>(world_), 0);
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const std::string theirs = recv_from(j);
    const bool is_local = std::find(local.begin(), local.end(), j) != local.end();
    if (seg_.ok() && is_local && !theirs.empty()) {
      peer_seg_[j] = shm::Segment::open(theirs, world_, cap);
      mapped[j] = peer_seg_[j].ok() ? 1 : 0;
    }
  }

  // 3. Whether each side mapped the other's: both, or the pair stays on TCP.
  send_all([&](int j) { return std::string(1, mapped[j]); });
  int used = 0;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const std::string theirs = recv_from(j);
    Peer& p = peers_[j];
    if (mapped[j] && theirs == std::string(1, 1)) {
      p.shm = true;
      p.in = seg_.ring(j);
      p.out = peer_seg_[j].ring(rank_);
      p.bell = peer_seg_[j].bell();
      seg_.prefault(j);
      peer_seg_[j].prefault(rank_);
      ++used;
    } else {
      peer_seg_[j] = shm::Segment();
    }
  }
  seg_.unlink();  // every peer that writes into it has mapped it by now
  if (used == 0) seg_ = shm::Segment();
}

bool TcpTransport::progress_send_shm(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.sends.empty()) {
    SendOp& s = p.sends.front();
    if (s.done < kHeaderBytes) {
      size_t n = shm::write(p.out, s.hdr + s.done, kHeaderBytes - s.done);
      if (n == 0) break;
      s.done += n;
      moved = true;
      if (s.done < kHeaderBytes) break;
    }
    const size_t sent = s.done - kHeaderBytes;
    if (sent < s.len) {
      size_t n = shm::write(p.out, s.buf + sent, s.len - sent);
      if (n == 0) break;
      s.done += n;
      moved = true;
    }
    if (s.done == kHeaderBytes + s.len) {
      done_[static_cast<size_t>(s.id)] = 1;
      --pending_;
      p.sends.pop_front();
    } else {
      break;  // ring full
    }
  }
  if (moved) shm::notify(p.bell);
  return moved;
}

bool TcpTransport::progress_recv_shm(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.recvs.empty()) {
    RecvOp& r = p.recvs.front();
    if (!p.in_payload) {
      size_t n = shm::read(p.in, p.rhdr + p.rhdr_got, kHeaderBytes - p.rhdr_got);
      if (n == 0) break;
      moved = true;
      p.rhdr_got += n;
      if (p.rhdr_got < kHeaderBytes) break;
      p.rhdr_got = 0;
      check_header(peer, nullptr, 0);
      p.in_payload = true;
      r.done = 0;
    }
    if (r.done < r.len) {
      size_t n = shm::read(p.in, r.buf + r.done, r.len - r.done);
      if (n == 0) break;
      moved = true;
      r.done += n;
    }
    if (r.done == r.len) {
      p.in_payload = false;
      done_[static_cast<size_t>(r.id)] = 1;
      --pending_;
      p.recvs.pop_front();
    } else {
      break;  // ring empty
    }
  }
  if (moved) shm::notify(p.bell);  // the writer may be waiting for room
  return moved;
}

void TcpTransport::shm_peer_event(int peer) {
  Peer& p = peers_[peer];
  char h[kHeaderBytes];
  bool framed = false;
  // Bounded by the operation's deadline too, so a dying peer cannot push us past it.
  auto bounded = [&] { return Deadline::after_ms(std::max(1, deadline_.remaining_ms(1000))); };
  try {
    net::recv_exact(p.fd.get(), h, kHeaderBytes, bounded(), "peer");
    framed = get<uint32_t>(h, 0) == kFrameMagic && static_cast<uint8_t>(h[4]) == kAbort;
  } catch (const Error&) {
  }
  if (framed) {
    // The peer failed and says why (TcpTransport::abort); raise its error here too.
    const uint64_t len = get<uint64_t>(h, 32);
    std::string msg = "rank " + std::to_string(peer) + " aborted the group";
    if (len <= kMaxAbortMessage) {
      std::string m(len, '\0');
      try {
        net::recv_exact(p.fd.get(), m.data(), len, bounded(), "an aborting peer");
        msg = std::move(m);
      } catch (const Error&) {
      }
    }
    rethrow_as(static_cast<ErrorKind>(get<uint32_t>(h, 12)), msg);
  }
  errno = 0;
  peer_closed(peer, p.recvs.empty() ? "sending to" : "receiving from");
}

void TcpTransport::begin(const OpDesc& desc, const Deadline& dl) {
  if (aborted_) CX_THROW(Error, "transport used after abort");
  desc_ = desc;
  deadline_ = dl;
  done_.clear();
  pending_ = 0;
}

void TcpTransport::fill_header(char* h, uint8_t type, uint64_t payload_len, uint32_t abort_kind) const {
  put<uint32_t>(h, 0, kFrameMagic);
  h[4] = static_cast<char>(type);
  h[5] = static_cast<char>(desc_.kind);
  h[6] = static_cast<char>(desc_.dtype);
  h[7] = static_cast<char>(desc_.op);
  put<int32_t>(h, 8, desc_.root);
  put<uint32_t>(h, 12, abort_kind);
  put<uint64_t>(h, 16, desc_.count);
  put<uint64_t>(h, 24, desc_.seq);
  put<uint64_t>(h, 32, payload_len);
}

Transport::Req TcpTransport::isend(int peer, const void* buf, size_t bytes) {
  Req id = static_cast<Req>(done_.size());
  done_.push_back(0);
  ++pending_;
  SendOp op{static_cast<const char*>(buf), bytes, 0, id, {}};
  fill_header(op.hdr, kData, bytes, 0);
  peers_[peer].sends.push_back(op);
  // Start writing at once: small messages usually leave in this one call.
  if (peers_[peer].shm) {
    progress_send_shm(peer);
  } else {
    progress_send(peer);
  }
  return id;
}

Transport::Req TcpTransport::irecv(int peer, void* buf, size_t bytes) {
  Req id = static_cast<Req>(done_.size());
  done_.push_back(0);
  ++pending_;
  peers_[peer].recvs.push_back(RecvOp{static_cast<char*>(buf), bytes, 0, id});
  return id;
}

bool TcpTransport::progress_send(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.sends.empty()) {
    SendOp& s = p.sends.front();
    iovec iov[2];
    int n = 0;
    if (s.done < kHeaderBytes) {
      iov[n++] = {s.hdr + s.done, kHeaderBytes - s.done};
      if (s.len) iov[n++] = {const_cast<char*>(s.buf), s.len};
    } else {
      iov[n++] = {const_cast<char*>(s.buf) + (s.done - kHeaderBytes), s.len - (s.done - kHeaderBytes)};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(n);
    ssize_t k = ::sendmsg(p.fd.get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
      peer_closed(peer, "sending to");
    }
    moved = true;
    s.done += static_cast<size_t>(k);
    if (s.done == kHeaderBytes + s.len) {
      done_[static_cast<size_t>(s.id)] = 1;
      --pending_;
      p.sends.pop_front();
    }
  }
  return moved;
}

void TcpTransport::check_header(int peer, const char* early, size_t early_n) {
  Peer& p = peers_[peer];
  const char* h = p.rhdr;
  if (get<uint32_t>(h, 0) != kFrameMagic) {
    CX_THROW(ConnectionError, "rank ", rank_, ": garbled data from rank ", peer, " during ", desc_.describe(),
             " (not a pycyxwiz frame)");
  }
  uint64_t len = get<uint64_t>(h, 32);
  if (static_cast<uint8_t>(h[4]) == kAbort) {
    // The peer failed and tells us why; read its message (bounded) and raise it.
    if (len > kMaxAbortMessage) CX_THROW(ConnectionError, "rank ", peer, " aborted (message too long)");
    std::string msg(len, '\0');
    size_t have = std::min<size_t>(early_n, len);  // read together with the header
    std::memcpy(msg.data(), early, have);
    try {
      net::recv_exact(p.fd.get(), msg.data() + have, len - have, Deadline::after_ms(1000), "an aborting peer");
    } catch (const Error&) {
      msg = "rank " + std::to_string(peer) + " aborted the group";
    }
    rethrow_as(static_cast<ErrorKind>(get<uint32_t>(h, 12)), msg);
  }
  OpDesc theirs = desc_of(h);
  if (!(theirs == desc_)) {
    CX_THROW(MismatchError, "mismatched collectives: rank ", rank_, " called ", desc_.describe(), " but rank ",
             peer, " called ", theirs.describe(),
             ". Every rank must call the same collectives in the same order with the same count, dtype, op "
             "and root.");
  }
  const RecvOp& r = p.recvs.front();
  if (len != r.len) {
    CX_THROW(MismatchError, "rank ", rank_, ": rank ", peer, " sent a message of ", len, " bytes where ", r.len,
             " were expected during ", desc_.describe(),
             " (ranks disagree on the message layout; are the pycyxwiz versions the same?)");
  }
}

bool TcpTransport::progress_recv(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.recvs.empty()) {
    RecvOp& r = p.recvs.front();
    if (!p.in_payload) {
      // Header and payload in one readv: a small message costs one syscall. The
      // payload bytes land in the caller's buffer before the header is checked;
      // if the header turns out wrong the collective fails anyway.
      iovec iov[2];
      iov[0] = {p.rhdr + p.rhdr_got, kHeaderBytes - p.rhdr_got};
      iov[1] = {r.buf, r.len};
      ssize_t k = ::readv(p.fd.get(), iov, 2);
      if (k == 0) peer_closed(peer, "receiving from");
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
        peer_closed(peer, "receiving from");
      }
      moved = true;
      size_t got = static_cast<size_t>(k);
      size_t hdr_part = std::min(got, kHeaderBytes - p.rhdr_got);
      p.rhdr_got += hdr_part;
      if (p.rhdr_got < kHeaderBytes) continue;
      p.rhdr_got = 0;
      check_header(peer, r.buf, got - hdr_part);
      p.in_payload = true;
      r.done = got - hdr_part;
    }
    if (r.done < r.len) {
      ssize_t k = ::recv(p.fd.get(), r.buf + r.done, r.len - r.done, MSG_DONTWAIT);
      if (k == 0) peer_closed(peer, "receiving from");
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
        peer_closed(peer, "receiving from");
      }
      moved = true;
      r.done += static_cast<size_t>(k);
    }
    if (r.done == r.len) {
      p.in_payload = false;
      done_[static_cast<size_t>(r.id)] = 1;
      --pending_;
      p.recvs.pop_front();
    }
  }
  return moved;
}

bool TcpTransport::progress() {
  bool moved = false;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    Peer& p = peers_[j];
    if (p.shm) {
      if (!p.sends.empty()) moved |= progress_send_shm(j);
      if (!p.recvs.empty()) moved |= progress_recv_shm(j);
    } else {
      if (!p.sends.empty()) moved |= progress_send(j);
      if (!p.recvs.empty()) moved |= progress_recv(j);
    }
  }
  return moved;
}

// A peer that gave up (timeout, mismatch, its own dead peer) leaves an ABORT
// frame in the stream before closing. When its connection fails under us, read
// on for that frame (bounded in time and bytes) so we raise its reason rather
// than a bare "connection lost".
void TcpTransport::salvage_abort(int peer) {
  Peer& p = peers_[peer];
  auto dl = Deadline::after_ms(200);
  std::vector<char> sink(64 * 1024);
  size_t budget = 64u << 20;
  auto skip = [&](size_t n) {
    while (n > 0) {
      size_t k = std::min(n, sink.size());
      net::recv_exact(p.fd.get(), sink.data(), k, dl, "peer");
      n -= k;
    }
  };
  try {
    // A shared-memory peer's stream holds nothing but an ABORT frame, if anything.
    if (!p.shm && p.rhdr_got > 0) return;  // mid-header: the stream cannot be followed
    if (!p.shm && p.in_payload && !p.recvs.empty()) {
      const RecvOp& r = p.recvs.front();
      if (r.len - r.done > budget) return;
      skip(r.len - r.done);
    }
    for (;;) {
      char h[kHeaderBytes];
      net::recv_exact(p.fd.get(), h, kHeaderBytes, dl, "peer");
      if (get<uint32_t>(h, 0) != kFrameMagic) return;
      uint64_t len = get<uint64_t>(h, 32);
      if (static_cast<uint8_t>(h[4]) == kAbort) {
        if (len > kMaxAbortMessage) return;
        std::string msg(len, '\0');
        net::recv_exact(p.fd.get(), msg.data(), len, dl, "peer");
        rethrow_as(static_cast<ErrorKind>(get<uint32_t>(h, 12)), msg);
      }
      if (len > budget) return;
      budget -= len;
      skip(len);
    }
  } catch (const ConnectionError&) {
  } catch (const TimeoutError&) {
  }
}

void TcpTransport::peer_closed(int peer, const char* during) {
  int e = errno;
  salvage_abort(peer);
  CX_THROW(ConnectionError, "rank ", rank_, ": lost the connection to rank ", peer, " (", peers_[peer].addr,
           ") while ", during, " it during ", desc_.describe(), ": rank ", peer,
           " exited, crashed or was killed (", e ? std::strerror(e) : "connection closed", ")");
}

void TcpTransport::timed_out() {
  std::ostringstream waiting;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    if (!peers_[j].recvs.empty() || !peers_[j].sends.empty()) {
      waiting << (waiting.tellp() ? ", " : "") << "rank " << j << " (" << peers_[j].addr << ")";
    }
  }
  CX_THROW(TimeoutError, "rank ", rank_, ": ", desc_.describe(), " timed out after ", deadline_.timeout_ms,
           " ms waiting for ", waiting.str(),
           ". That rank is stuck, much slower, or did not call the same collective; raise operation_timeout_ms "
           "(DISTRIBUTED_OPERATION_TIMEOUT_MS) if it is only slow.");
}

void TcpTransport::block() {
  std::vector<pollfd> fds;
  std::vector<int> who;
  fds.reserve(static_cast<size_t>(world_));
  bool tcp_io = false, shm_io = false;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const Peer& p = peers_[j];
    if (p.recvs.empty() && p.sends.empty()) continue;
    short ev = 0;
    if (p.shm) {
      shm_io = true;
      ev = POLLIN;  // anything on the socket of a shared-memory peer: it aborted or died
    } else {
      tcp_io = true;
      if (!p.recvs.empty()) ev |= POLLIN;
      if (!p.sends.empty()) ev |= POLLOUT;
    }
    fds.push_back({p.fd.get(), ev, 0});
    who.push_back(j);
  }
  if (fds.empty()) return;
  // Something on the socket of a shared-memory peer: an ABORT frame, or its end
  // (it exited). A peer that finished its part and exited normally may have left
  // its last bytes for us in the ring after our last look, so drain the rings
  // first; only a peer we still wait for afterwards has really failed us.
  auto shm_events = [&] {
    bool any = false;
    for (size_t i = 0; i < fds.size(); ++i) any |= peers_[who[i]].shm && fds[i].revents;
    if (!any) return;
    progress();
    for (size_t i = 0; i < fds.size(); ++i) {
      const Peer& p = peers_[who[i]];
      if (p.shm && fds[i].revents && (!p.recvs.empty() || !p.sends.empty())) shm_peer_event(who[i]);
    }
  };
  if (!shm_io) {
    int rc = ::poll(fds.data(), fds.size(), deadline_.remaining_ms(100));
    if (rc == 0 && deadline_.expired()) timed_out();
    return;
  }
  if (tcp_io) {
    // Both kinds pending (ranks on several hosts): poll the sockets in short
    // slices, looking at the rings in between.
    int rc = ::poll(fds.data(), fds.size(), deadline_.remaining_ms(1));
    if (rc > 0) shm_events();
    return;
  }
  if (::poll(fds.data(), fds.size(), 0) > 0) shm_events();
  // Only rings pending: sleep on our doorbell (Note [No lost wake-up] in shm.cpp),
  // in slices so that a dead peer's socket and the deadline are looked at.
  shm::Bell* bell = seg_.bell();
  const uint32_t seen = bell->seq.load(std::memory_order_seq_cst);
  shm::about_to_sleep(bell);
  bool moved = false;
  try {
    moved = progress();
  } catch (...) {
    bell->sleeping.store(0, std::memory_order_seq_cst);
    throw;
  }
  if (!moved) shm::wait_bell(bell, seen, std::max(1, deadline_.remaining_ms(20)));
  bell->sleeping.store(0, std::memory_order_seq_cst);
}

void TcpTransport::wait(Req r) {
  auto spin_until = Clock::now() + std::chrono::microseconds(opt_.spin_us);
  while (!done_[static_cast<size_t>(r)]) {
    if (progress()) {
      spin_until = Clock::now() + std::chrono::microseconds(opt_.spin_us);
      continue;
    }
    if (Clock::now() < spin_until) {
      if (opt_.spin_us > 0 && world_ > 2) sched_yield();
      continue;
    }
    if (deadline_.expired()) timed_out();
    block();
  }
}

void TcpTransport::wait_all() {
  for (size_t i = 0; i < done_.size(); ++i) wait(static_cast<Req>(i));
}

void TcpTransport::abort(ErrorKind kind, const std::string& msg) {
  if (aborted_) return;
  aborted_ = true;
  std::string text = msg.substr(0, kMaxAbortMessage);
  for (int j = 0; j < world_; ++j) {
    Peer& p = peers_[j];
    if (j == rank_ || !p.fd.valid()) continue;
    auto dl = Deadline::after_ms(200);
    try {
      // A half-written frame would garble the stream: finish it first.
      if (!p.shm && !p.sends.empty() && p.sends.front().done > 0) {
        SendOp& s = p.sends.front();
        if (s.done < kHeaderBytes) {
          net::send_exact(p.fd.get(), s.hdr + s.done, kHeaderBytes - s.done, dl, "peer");
          s.done = kHeaderBytes;
        }
        net::send_exact(p.fd.get(), s.buf + (s.done - kHeaderBytes), s.len - (s.done - kHeaderBytes), dl, "peer");
      }
      char h[kHeaderBytes];
      fill_header(h, kAbort, text.size(), static_cast<uint32_t>(kind));
      net::send_exact(p.fd.get(), h, kHeaderBytes, dl, "peer");
      net::send_exact(p.fd.get(), text.data(), text.size(), dl, "peer");
    } catch (const Error&) {
      // The peer is gone or not reading: it will see the connection close.
    }
    p.sends.clear();
    p.recvs.clear();
    if (p.shm) shm::ring_bell(p.bell);  // a peer asleep on its bell looks at the socket now
    // Half-close: the peer reads our abort frame, then end-of-stream. The
    // descriptor itself stays open until the group is destroyed, so no reset
    // can overtake the frame.
    ::shutdown(p.fd.get(), SHUT_WR);
  }
}

}  // namespace cx::distributed

namespace cx::distributed {

void TcpTransport::close(const Deadline& dl) {
  std::vector<int> open;
  for (int j = 0; j < world_; ++j) {
    if (j == rank_ || !peers_[j].fd.valid()) continue;
    ::shutdown(peers_[j].fd.get(), SHUT_WR);
    open.push_back(j);
  }
  // Read (and drop) whatever is left until every peer has closed its side too.
  char sink[4096];
  while (!open.empty() && !dl.expired()) {
    std::vector<pollfd> fds;
    for (int j : open) fds.push_back({peers_[j].fd.get(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), dl.remaining_ms(100)) <= 0) continue;
    std::vector<int> still;
    for (size_t i = 0; i < fds.size(); ++i) {
      int j = open[i];
      if (fds[i].revents) {
        ssize_t k = ::recv(peers_[j].fd.get(), sink, sizeof(sink), MSG_DONTWAIT);
        if (k > 0 || (k < 0 && (errno == EAGAIN || errno == EINTR))) {
          still.push_back(j);
        }
      } else {
        still.push_back(j);
      }
    }
    open.swap(still);
  }
}

}  // namespace cx::distributed
