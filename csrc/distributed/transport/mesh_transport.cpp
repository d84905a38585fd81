#include "distributed/transport/mesh_transport.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "distributed/net/auth.h"
#include "distributed/net/socket.h"
#include "distributed/store/store.h"
#include "distributed/transport/frame.h"
#include "distributed/transport/shm/negotiate.h"
#include "distributed/transport/shm/shm_channel.h"
#include "distributed/transport/tcp/tcp_channel.h"

namespace cx::distributed {

namespace {

// Note [Mesh handshake]
// A rank connects to each lower rank and is accepted by each higher one. Every
// link runs the challenge-response of Note [Job secret] (net/auth.h), bound to
// this group (its nonce from the store) and to both ranks:
//   connector -> acceptor: u32 "CXH2" | i32 rank | u64 group nonce | 32-byte nonce
//   acceptor -> connector: u32 "CXH2" | i32 rank | 32-byte nonce | proof (acceptor role)
//   connector -> acceptor: proof (connector role)
// The acceptor serves every connection it has accepted at once, in one poll loop,
// each with its own short deadline (kHandshakeMs), so connections that stay
// silent or send garbage cost nothing but their descriptor: they cannot delay a
// real peer. Beyond kMaxPendingLinks unfinished ones the oldest is dropped. One
// that fails the proof is dropped and its address logged to stderr, once.
constexpr uint32_t kHandshakeMagic = 0x32485843;  // "CXH2"
constexpr size_t kHelloBytes = 16 + net::kNonceBytes;
constexpr size_t kAckBytes = 8 + net::kNonceBytes + net::kProofBytes;
constexpr int64_t kHandshakeMs = 5000;
constexpr size_t kMaxPendingLinks = 64;

std::string link_context(uint64_t group_nonce, int connector, int acceptor) {
  return detail::concat("mesh ", group_nonce, " ", connector, " -> ", acceptor);
}

// A connection accepted by this rank, part way through Note [Mesh handshake].
struct Pending {
  net::Fd fd;
  std::string addr;
  std::string got;  // bytes received so far
  int peer = -1;    // the rank it claims, once its hello is in
  net::Handshake::Server handshake;  // started once its hello is in
  Deadline dl;
};

void log_refused(std::set<std::string>& logged, int rank, const std::string& addr, const std::string& why) {
  const std::string ip = addr.substr(0, addr.rfind(':'));
  if (logged.size() < 1024 && logged.insert(ip).second) {
    std::fprintf(stderr, "pycyxwiz: rank %d refused a connection from %s: %s\n", rank, addr.c_str(), why.c_str());
    std::fflush(stderr);
  }
}

// What the steps of the mesh's setup share: the links made so far (index = rank).
struct Setup {
  Store& store;
  int rank, world;
  uint64_t nonce;  // the group's (Note [Mesh handshake])
  const std::string& secret;
  const Deadline& dl;
  std::vector<net::Fd> socks;
  std::vector<std::string> addrs;
};

// Step 1: listen on an ephemeral port of the address the store reaches us at, and publish it.
net::Fd publish(Setup& s) {
  const std::string ip = s.store.local_ip();
  net::Fd listener = net::listen_on(ip, 0, "listening port");
  const int port = net::bound_port(listener.get());
  s.store.set("addr/" + std::to_string(s.rank), ip + ":" + std::to_string(port), s.dl);
  return listener;
}

// Step 2, for one lower rank j: connect to its published address and run the
// connector's half of Note [Mesh handshake].
void connect_to(Setup& s, int j) {
  using frame::get;
  using frame::put;
  const int rank = s.rank;
  std::string a = s.store.get("addr/" + std::to_string(j), s.dl,
                              detail::concat("Timeout waiting for peers: rank ", rank, " waited ", s.dl.timeout_ms,
                                             " ms for rank ", j, " to publish its address"));
  auto colon = a.rfind(':');
  std::string host = a.substr(0, colon);
  int p = 0;
  try {
    p = colon == std::string::npos ? 0 : std::stoi(a.substr(colon + 1));
  } catch (const std::exception&) {
  }
  if (p <= 0 || p > 65535) {
    CX_THROW(ConnectionError, "rank ", rank, ": the store holds a malformed address for rank ", j, ": '",
             a.substr(0, 64), "'");
  }
  std::string what = detail::concat("rank ", j, " (", a, ")");
  net::Fd fd = net::connect_with_retry(host, p, s.dl, what);
  const net::Handshake::Client handshake(s.secret, link_context(s.nonce, rank, j));
  char hello[kHelloBytes];
  put<uint32_t>(hello, 0, kHandshakeMagic);
  put<int32_t>(hello, 4, rank);
  put<uint64_t>(hello, 8, s.nonce);
  std::memcpy(hello + 16, handshake.nonce().data(), net::kNonceBytes);
  net::send_exact(fd.get(), hello, sizeof(hello), s.dl, what);
  char ack[kAckBytes];
  net::recv_exact(fd.get(), ack, sizeof(ack), s.dl, what);
  if (get<uint32_t>(ack, 0) != kHandshakeMagic || get<int32_t>(ack, 4) != j) {
    CX_THROW(ConnectionError, "rank ", rank, ": the process at ", a, " is not rank ", j, " of this group");
  }
  const std::optional<std::string> mine = handshake.answer(std::string(ack + 8, kAckBytes - 8));
  if (!mine) {
    CX_THROW(ConnectionError, "authentication failed: rank ", rank, ": the process at ", a,
             " that answers as rank ", j,
             " does not know this job's secret: every rank needs the same CX_AUTH_TOKEN or CX_AUTH_TOKEN_FILE");
  }
  net::send_exact(fd.get(), mine->data(), mine->size(), s.dl, what);
  s.socks[j] = std::move(fd);
  s.addrs[j] = a;
}

// Step 3: the higher ranks connect to us. Serves every accepted connection at
// once, in one poll loop (Note [Mesh handshake]), until each higher rank has a link.
class Acceptor {
 public:
  Acceptor(Setup& s, net::Fd& listener) : s_(s), listener_(listener), expected_(s.world - 1 - s.rank) {}

  void run() {
    net::set_nonblocking(listener_.get(), true);
    auto next_store_check = Clock::now() + std::chrono::milliseconds(200);
    while (expected_ > 0) {
      if (s_.dl.expired()) timed_out();
      std::vector<pollfd> fds;
      fds.push_back({listener_.get(), POLLIN, 0});
      for (auto& q : pending_) fds.push_back({q.fd.get(), POLLIN, 0});
      int wait_ms = s_.dl.remaining_ms(100);
      for (auto& q : pending_) wait_ms = std::min(wait_ms, q.dl.remaining_ms(100));
      int rc = ::poll(fds.data(), fds.size(), std::max(0, wait_ms));
      if (rc < 0 && errno != EINTR) CX_THROW(ConnectionError, "rank ", s_.rank, ": poll(): ", std::strerror(errno));
      // Between polls, ask the store now and then whether a rank failed (Note
      // [Failures reach every rank through the store] in store/store.h).
      if (Clock::now() >= next_store_check) {
        // The deadline may run out during the poll just before: then the missing ranks are the news, not a
        // store that was asked with no time left ("timed out asking the store ..." hid who never came).
        if (s_.dl.expired()) timed_out();
        try {
          s_.store.check_failed(s_.dl);
        } catch (const Error& e) {
          if (e.kind() == ErrorKind::kTimeout && s_.dl.expired()) timed_out();
          throw;
        }
        next_store_check = Clock::now() + std::chrono::milliseconds(200);
      }
      for (size_t i = 0; i < pending_.size(); ++i) {
        Pending& q = pending_[i];
        if (fds[i + 1].revents) {
          read(q);
        } else if (q.dl.expired()) {
          q.fd.reset();  // silent: drop it
        }
      }
      pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](const Pending& q) { return !q.fd.valid(); }),
                     pending_.end());
      if (fds[0].revents & POLLIN) accept_new();
    }
    net::set_nonblocking(listener_.get(), false);
  }

 private:
  [[noreturn]] void timed_out() {
    std::ostringstream missing;
    for (int j = s_.rank + 1; j < s_.world; ++j)
      if (!s_.socks[j].valid()) missing << (missing.tellp() ? ", " : "") << j;
    CX_THROW(TimeoutError, "Timeout waiting for peers: rank ", s_.rank, " waited ", s_.dl.timeout_ms,
             " ms for rank(s) ", missing.str(), " to connect. Start all WORLD_SIZE=", s_.world,
             " processes, or raise DISTRIBUTED_TIMEOUT_MS");
  }

  // What came on q's socket: its hello (then we answer), or its proof (then it is a link).
  void read(Pending& q) {
    const size_t want = q.peer < 0 ? kHelloBytes : net::kProofBytes;
    char buf[kHelloBytes];
    ssize_t k = ::recv(q.fd.get(), buf, want - q.got.size(), MSG_DONTWAIT);
    if (k <= 0) {
      if (k == 0 || (errno != EAGAIN && errno != EINTR)) q.fd.reset();
      return;
    }
    q.got.append(buf, static_cast<size_t>(k));
    if (q.got.size() < want) return;
    if (q.peer < 0) {
      on_hello(q);
    } else {
      on_proof(q);
    }
  }

  void on_hello(Pending& q) {
    using frame::get;
    using frame::put;
    const char* h = q.got.data();
    int32_t j = get<int32_t>(h, 4);
    if (get<uint32_t>(h, 0) != kHandshakeMagic || get<uint64_t>(h, 8) != s_.nonce || j <= s_.rank || j >= s_.world ||
        s_.socks[j].valid()) {
      q.fd.reset();  // stray or stale connection (another job, a previous group): drop it
      return;
    }
    q.peer = j;
    q.handshake = net::Handshake::Server(s_.secret, link_context(s_.nonce, j, s_.rank));
    const std::string challenge = q.handshake.challenge(q.got.substr(16, net::kNonceBytes));
    q.got.clear();
    char ack[kAckBytes];
    put<uint32_t>(ack, 0, kHandshakeMagic);
    put<int32_t>(ack, 4, s_.rank);
    std::memcpy(ack + 8, challenge.data(), challenge.size());
    try {
      net::send_exact(q.fd.get(), ack, sizeof(ack), q.dl, "a connecting peer");
    } catch (const Error&) {
      q.fd.reset();
    }
  }

  void on_proof(Pending& q) {
    if (s_.socks[q.peer].valid() || !q.handshake.verify(q.got)) {
      log_refused(logged_, s_.rank, q.addr,
                  detail::concat("it claimed to be rank ", q.peer, " but does not know the job's secret"));
      q.fd.reset();
      return;
    }
    net::set_nonblocking(q.fd.get(), false);
    s_.socks[q.peer] = std::move(q.fd);
    s_.addrs[q.peer] = "rank " + std::to_string(q.peer);
    --expected_;
  }

  void accept_new() {
    auto take = [&](net::Fd fd, std::string addr) {
      if (pending_.size() >= kMaxPendingLinks) pending_.erase(pending_.begin());
      Pending q;
      q.fd = std::move(fd);
      q.addr = std::move(addr);
      q.dl = Deadline::after_ms(std::min<int64_t>(s_.dl.timeout_ms, kHandshakeMs));
      pending_.push_back(std::move(q));
    };
    auto make_room = [&] {  // out of descriptors: drop the oldest newcomer
      if (pending_.empty()) return false;
      pending_.erase(pending_.begin());
      return true;
    };
    net::accept_waiting(listener_.get(), take, make_room);
  }

  Setup& s_;
  net::Fd& listener_;
  int expected_;
  std::vector<Pending> pending_;
  std::set<std::string> logged_;
};

// Whether what peer j sends next (Channel::peek's answer and descriptor) is a send/recv message of its own.
bool own_message(Channel::Next next, const OpDesc& d, int j) {
  return next == Channel::Next::kFrame && d.kind == CollectiveKind::kSendRecv && d.root == j;
}

}  // namespace

MeshTransport::MeshTransport(Store& store, int rank, int world, uint64_t nonce, const std::string& secret,
                             const Deadline& dl, MeshOptions opt)
    : rank_(rank),
      world_(world),
      opt_(opt),
      spin_(opt.spin_us),
      others_(world),
      channels_(static_cast<size_t>(world)) {
  Setup s{store, rank, world, nonce, secret, dl, std::vector<net::Fd>(static_cast<size_t>(world)),
          std::vector<std::string>(static_cast<size_t>(world))};
  net::Fd listener = publish(s);
  for (int j = 0; j < rank; ++j) connect_to(s, j);  // lower ranks: we connect
  Acceptor(s, listener).run();                      // higher ranks connect to us
  // Step 4: which pairs share memory; each pair's channel.
  shm::Pairing pairs = shm::negotiate(s.socks, s.addrs, rank, nonce, opt_.shm, opt_.shm_ring_bytes, dl);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    net::set_nonblocking(s.socks[j].get(), true);
    if (j > rank) {
      // Learn the peer's listening address for messages.
      s.addrs[j] = store.get("addr/" + std::to_string(j), dl, "timed out reading a peer address");
    }
  }
  seg_ = std::move(pairs.own);
  hosts_ = std::move(pairs.hosts);
  if (static_cast<int>(hosts_.size()) == world) {
    others_ = OthersOnTheCpus(static_cast<int>(std::count(hosts_.begin(), hosts_.end(), hosts_[rank_])));
  }
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    if (pairs.peers[j].ok()) {
      channels_[j] = std::make_unique<ShmChannel>(rank, j, std::move(s.socks[j]), std::move(s.addrs[j]), op_, seg_,
                                                  std::move(pairs.peers[j]), opt_.shm_single_copy, opt_.core_each);
    } else {
      if (net::congestion_between_ranks(s.socks[j].get(), opt_.core_each)) by_size_.add(s.socks[j].get());
      channels_[j] = std::make_unique<TcpChannel>(rank, j, std::move(s.socks[j]), std::move(s.addrs[j]), op_);
    }
  }
}

MeshTransport::~MeshTransport() = default;

void MeshTransport::begin(const OpDesc& desc, const Deadline& dl) {
  if (aborted_) CX_THROW(Error, "transport used after abort");
  op_.desc = desc;
  by_size_.before(desc.count * dtype_size(desc.dtype));
  op_.deadline = dl;
  op_.done.clear();
  op_.pending = 0;
  op_.copy_once = false;
  peer_of_.clear();
}

bool MeshTransport::reads_peers() const {
  for (const auto& c : channels_) {
    if (c && !c->copies_once()) return false;
  }
  return world_ > 1;
}

bool MeshTransport::rings_only(bool own_host) const {
  if (own_host && static_cast<int>(hosts_.size()) != world_) return false;
  bool any = false;
  for (int j = 0; j < world_; ++j) {
    const Channel* c = channels_[static_cast<size_t>(j)].get();
    if (!c || (own_host && hosts_[static_cast<size_t>(j)] != hosts_[static_cast<size_t>(rank_)])) continue;
    if (!c->wait_on().bell) return false;
    any = true;
  }
  return any;
}

Transport::Req MeshTransport::isend(int peer, const void* buf, size_t bytes) {
  Req id = static_cast<Req>(op_.done.size());
  op_.done.push_back(0);
  peer_of_.push_back(peer);
  ++op_.pending;
  count_sent(bytes);
  channels_[peer]->isend(id, static_cast<const char*>(buf), bytes);
  return id;
}

Transport::Req MeshTransport::irecv(int peer, void* buf, size_t bytes) {
  Req id = static_cast<Req>(op_.done.size());
  op_.done.push_back(0);
  peer_of_.push_back(peer);
  ++op_.pending;
  channels_[peer]->irecv(id, static_cast<char*>(buf), bytes);
  return id;
}

bool MeshTransport::progress() {
  bool moved = false;
  for (int j = 0; j < world_; ++j) {
    Channel* c = channels_[j].get();
    if (c && c->busy()) moved |= c->progress();
  }
  return moved;
}

// Note [Receiving from any source]
// torch's dist.recv(t) without a source takes the first message sent to this rank by anyone. The receiver looks
// at each peer's next frame without reading it (Channel::peek: MSG_PEEK on a socket, the ring's bytes before its
// tail moves) and takes the first peer whose next frame is a send/recv message from that peer; the message is
// then received like any other, its descriptor (the pair's next message number, count, dtype, tag) checked as
// usual. A message of that tag read ahead into a channel's stash (Note [Messages out of order] in channel.cpp)
// counts as its peer's next; a message of another tag is read into the stash, to see what comes after it. A peer
// whose next frame belongs to a collective is no candidate (that frame is for later); an ABORT
// frame or a reset is one, so that the receive raises it. A peer that closed its side has nothing more to send
// (it may have finished, and others may still send): a candidate only once every peer has, to name one. The
// wait spins for 50 us, then sleeps until a peer that had nothing whole may have more (block_any): its socket
// readable, or our doorbell rung by a write into a ring; a peer whose next frame is for later is not watched (its
// socket would stay readable). It slept in slices of 50 us before, which cost 16-18% of a core while a rank
// waited (a receive from any source that waited 3 s: 0.48-0.54 s of CPU, against 0.003-0.011 s for one naming
// its source). Senders need nothing new.
int MeshTransport::wait_any_message() {
  const auto start = Clock::now();
  std::vector<Channel*> quiet;  // peers with nothing whole yet
  while (true) {
    int ended = -1, open = 0;
    quiet.clear();
    for (int j = 0; j < world_; ++j) {
      Channel* c = channels_[j].get();
      if (!c) continue;
      if (c->has_stashed(j, op_.desc.tag)) return j;  // read ahead of its receive (Note [Messages out of order])
      OpDesc d;
      const Channel::Next next = c->peek(&d);
      if (next == Channel::Next::kRaise) return j;
      if (own_message(next, d, j)) {
        if (d.tag == op_.desc.tag) return j;
        read_next_aside(j);  // another tag's message, so that one of ours behind it can be seen
        --j;                 // this peer again
        continue;
      }
      if (next == Channel::Next::kEnded) {
        ended = j;
      } else {
        ++open;
        if (next == Channel::Next::kNothing) quiet.push_back(c);
      }
    }
    if (open == 0 && ended >= 0) return ended;  // everyone has gone: the receive names one
    const auto now = Clock::now();
    if (now >= op_.deadline.at) {
      CX_THROW(TimeoutError, "rank ", rank_, ": ", op_.desc.describe(), " timed out after ", op_.deadline.timeout_ms,
               " ms: no rank sent it a message of tag ", op_.desc.tag, ". Is a dist.send to this rank missing, or did "
               "the sender name another rank?", unreceived());
    }
    if (now - start > std::chrono::microseconds(50)) {
      // Note [Sends before receives] in process_group.cpp: sends queued behind this receive go first. Nothing is
      // taken yet (a message of another tag read aside stays in its stash).
      if (yield_ && yield_->load(std::memory_order_acquire)) throw OpYielded{};
      block_any(quiet);
    }
  }
}

void MeshTransport::block_any(const std::vector<Channel*>& quiet) {
  std::vector<pollfd> fds;
  bool rings = false, sockets = false;
  for (Channel* c : quiet) {
    fds.push_back({c->fd(), POLLIN, 0});  // through shared memory: the peer's ABORT frame or its end
    (c->wait_on().bell ? rings : sockets) = true;
  }
  if (!rings) {  // nothing to wait for but the deadline, or sockets only
    ::poll(fds.data(), fds.size(), op_.deadline.remaining_ms(100));
    return;
  }
  if (sockets) {  // both kinds (ranks on several hosts): the sockets in short slices, the rings in between
    ::poll(fds.data(), fds.size(), op_.deadline.remaining_ms(1));
    return;
  }
  if (::poll(fds.data(), fds.size(), 0) > 0) return;
  // Rings only: sleep on our doorbell, announced before the last look (Note [No lost wake-up] in shm.cpp).
  shm::Bell* bell = seg_.bell();
  const uint32_t seen = bell->seq.load(std::memory_order_seq_cst);
  shm::about_to_sleep(bell);
  OpDesc d;
  const bool moved = std::any_of(quiet.begin(), quiet.end(), [&](Channel* c) {
    return c->peek(&d) != Channel::Next::kNothing;
  });
  if (!moved) shm::wait_bell(bell, seen, std::max(1, op_.deadline.remaining_ms(20)));
  bell->sleeping.store(0, std::memory_order_seq_cst);
}

// Note [Sends that read while they wait]
// A group runs its operations one at a time, in order. Two ranks that each post a send to the other and then the
// receive of the other's message (torch's batch_isend_irecv, a halo exchange, two pipeline stages) each run their
// send first; where the message is larger than the ring (1 MiB) or the socket's buffer, each send waits for the
// other's receive, which waits behind the other's send: both timed out (4 MiB through shared memory, 64 MiB over
// TCP). gloo and MPI progress both at once. So a send/recv operation about to sleep reads aside, into the
// channel's stash (Note [Messages out of order] in channel.cpp), the next message of every peer that sent one and
// has no receive posted here: the peer's send then completes, its receive takes ours, and the receive we post
// next takes the message from the stash. It reads each message whole before going on (wait(aside)), so that the
// operation ends with no receive half done. That costs a copy of the message, and its size in memory until its
// receive is posted; only sends that could not finish before they would sleep pay it, and a collective never.
// Over TCP a send also wakes for the peer's bytes (TcpChannel::wait_on); through shared memory a peer's write
// rings our doorbell either way.
void MeshTransport::read_next_aside(int j) {
  const Req aside = static_cast<Req>(op_.done.size());
  op_.done.push_back(0);
  peer_of_.push_back(j);
  ++op_.pending;
  channels_[j]->irecv_aside(aside);
  wait(aside);
}

bool MeshTransport::read_aside() {
  bool any = false;
  for (int j = 0; j < world_; ++j) {
    Channel* c = channels_[j].get();
    if (!c || c->receiving()) continue;  // a posted receive reads what comes on its own
    OpDesc d;
    const Channel::Next next = c->peek(&d);
    // Note [A send whose peer sent something else]: the peer we send to gave up (its ABORT frame) or broke off
    // mid-frame; reading on raises that, as a receive from it would.
    if (next == Channel::Next::kRaise && c->busy()) read_next_aside(j);
    if (!own_message(next, d, j)) continue;
    read_next_aside(j);
    any = true;
  }
  return any;
}

// Note [A send whose peer sent something else]
// A send/recv operation over TCP that waits for its peer to take a message also wakes when the peer's socket is
// readable, to read the peer's own message aside (Note [Sends that read while they wait]). Where the peer's next
// frame is no such message (a collective's frame, which waits for that collective), or the peer will send nothing
// more, the socket stays readable and nothing reads it: the wait woke at once, again and again, a core spinning
// until the peer took the message or the deadline passed. So the sleep leaves that socket's readability out then,
// and wakes for the send's room alone; and where the peer's next frame is its ABORT frame (it gave up) or the
// stream broke off, read_aside reads on and raises that at once, where the wait used to spin until the peer's
// process had gone. Measured (64 MiB sends over TCP, the tests of this in test_collectives.py, quiet machine):
// a send to a rank in a collective, 3 s deadline: 3.0-3.1 s of CPU before, 0.03-0.05 s now; a send to a rank
// that raised a mismatch and stayed on for 6 s: raised after 6.6 s (6.6 s of CPU) before, after 0.26-0.28 s now.
bool MeshTransport::aside_may_come(int j) {
  OpDesc d;
  const Channel::Next next = channels_[j]->peek(&d);
  return next == Channel::Next::kNothing || next == Channel::Next::kRaise || own_message(next, d, j);
}

void MeshTransport::timed_out() {
  std::ostringstream waiting;
  for (int j = 0; j < world_; ++j) {
    const Channel* c = channels_[j].get();
    if (c && c->busy()) waiting << (waiting.tellp() ? ", " : "") << "rank " << j << " (" << c->addr() << ")";
  }
  const bool receives = op_.desc.kind == CollectiveKind::kSendRecv && op_.desc.root != rank_;
  CX_THROW(TimeoutError, "rank ", rank_, ": ", op_.desc.describe(), " timed out after ", op_.deadline.timeout_ms,
           " ms waiting for ", waiting.str(),
           ". That rank is stuck, much slower, or did not call the same collective; raise operation_timeout_ms "
           "(DISTRIBUTED_OPERATION_TIMEOUT_MS) if it is only slow.", receives ? unreceived() : std::string());
}

// Note [A receive that timed out names the messages nobody took]
// A receive that names the wrong source or tag waits for a message that never comes, while the one meant for it
// lies here unread: in its peer's socket or ring, or read ahead into the stash (Note [Messages out of order] in
// channel.cpp). Its timeout lists those messages, so that the mistake shows in the error (a recv from rank 2
// where rank 0 sent: "a message from rank 0 ... that no receive has taken"), as gloo's and MPI's do not.
std::string MeshTransport::unreceived() {
  std::ostringstream os;
  int n = 0;
  auto add = [&](int j, const OpDesc& d) {
    if (n++ < 3) {
      os << (n > 1 ? "; " : "") << "from rank " << j << ", " << d.count << " x " << dtype_name(d.dtype) << ", tag "
         << d.tag;
    }
  };
  for (int j = 0; j < world_; ++j) {
    Channel* c = channels_[j].get();
    if (!c) continue;
    for (const OpDesc& d : c->stashed()) add(j, d);
    OpDesc d;
    // peek is for channels with no receive posted: this receive's own peer has one
    if (!c->receiving() && own_message(c->peek(&d), d, j)) add(j, d);
  }
  if (n == 0) return std::string();
  std::ostringstream out;
  out << " Messages this rank was sent that no receive has taken: " << os.str() << (n > 3 ? "; ..." : "")
      << ". This receive names src=" << (op_.desc.root < 0 ? std::string("any") : std::to_string(op_.desc.root))
      << ", tag " << op_.desc.tag << ": is its source or tag wrong?";
  return out.str();
}

void MeshTransport::block() {
  std::vector<pollfd> fds;
  std::vector<Channel*> who;
  std::vector<char> rings;  // who[i] moves its data through rings
  fds.reserve(static_cast<size_t>(world_));
  bool socket_io = false, ring_io = false;
  for (int j = 0; j < world_; ++j) {
    Channel* c = channels_[j].get();
    if (!c || !c->busy()) continue;
    WaitOn w = c->wait_on();
    if (!w.bell && (w.events & POLLIN) && !c->receiving() && !aside_may_come(j)) w.events &= ~POLLIN;
    (w.bell ? ring_io : socket_io) = true;
    fds.push_back({c->fd(), w.events, 0});
    who.push_back(c);
    rings.push_back(w.bell);
  }
  if (fds.empty()) return;
  // Something on the socket of a shared-memory peer: an ABORT frame, or its end
  // (it exited). A peer that finished its part and exited normally may have left
  // its last bytes for us in the ring after our last look, so drain the rings
  // first; only a peer we still wait for afterwards has really failed us.
  auto ring_peer_events = [&] {
    bool any = false;
    for (size_t i = 0; i < fds.size(); ++i) any |= rings[i] && fds[i].revents;
    if (!any) return;
    progress();
    for (size_t i = 0; i < fds.size(); ++i) {
      if (rings[i] && fds[i].revents && who[i]->busy()) who[i]->socket_event();
    }
  };
  if (!ring_io) {
    int rc = ::poll(fds.data(), fds.size(), op_.deadline.remaining_ms(100));
    if (rc == 0 && op_.deadline.expired()) timed_out();
    return;
  }
  if (socket_io) {
    // Both kinds pending (ranks on several hosts): poll the sockets in short
    // slices, looking at the rings in between.
    int rc = ::poll(fds.data(), fds.size(), op_.deadline.remaining_ms(1));
    if (rc > 0) ring_peer_events();
    return;
  }
  if (::poll(fds.data(), fds.size(), 0) > 0) ring_peer_events();
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
  if (!moved) shm::wait_bell(bell, seen, std::max(1, op_.deadline.remaining_ms(20)));
  bell->sleeping.store(0, std::memory_order_seq_cst);
}

void MeshTransport::wait(Req r) {
  if (op_.done[static_cast<size_t>(r)]) return;
  // Small messages often find the peer's bytes already here: done without reading the clock (a wait
  // that never spun teaches the policy nothing).
  if (progress() && op_.done[static_cast<size_t>(r)]) return;
  // Note [Waiting on a busy machine]: spin (for a budget the policy learns), or
  // spin only briefly while the core has lately been wanted by others.
  const auto start = Clock::now();
  auto budget = std::chrono::microseconds(spin_.budget_us(start));
  // Note [Ranks that share cores with other programs]: then sleep at once.
  if (!opt_.core_each && channels_[peer_of_[static_cast<size_t>(r)]]->wait_on().bell && others_.runnable(start)) {
    budget = std::chrono::microseconds(0);
    OthersOnTheCpus::count_sleep();
  }
  auto spin_until = start + budget;
  auto last = start;
  bool spun = false, lost_core = false, slept = false;
  while (!op_.done[static_cast<size_t>(r)]) {
    if (progress()) {
      last = Clock::now();
      spin_until = last + budget;
      continue;
    }
    const auto now = Clock::now();
    if (now < spin_until) {
      spun = true;
      lost_core |= now - last > SpinPolicy::kLostCore;
      last = now;
      if (world_ > 2) sched_yield();
      continue;
    }
    if (op_.deadline.expired()) timed_out();
    if (op_.desc.kind == CollectiveKind::kSendRecv) {
      if (read_aside()) continue;
      // Note [Sends before receives] in process_group.cpp: sends queued behind this receive go first.
      if (yield_ && yield_->load(std::memory_order_acquire) &&
          channels_[peer_of_[static_cast<size_t>(r)]]->cancel_untouched_recv(r)) {
        throw OpYielded{};
      }
    }
    block();
    slept = true;
    last = Clock::now();
  }
  // `last` was read after the progress or block that finished it. Note [Two ranks that wake each other]: a
  // sleep counts only on a machine without other programs running.
  spin_.after_wait(start, last, spun, lost_core, slept && !others_.runnable(last));
}

void MeshTransport::wait_all() {
  for (size_t i = 0; i < op_.done.size(); ++i) wait(static_cast<Req>(i));
}

void MeshTransport::abort(ErrorKind kind, const std::string& msg) {
  if (aborted_) return;
  aborted_ = true;
  const std::string text = msg.substr(0, frame::kMaxAbortMessage);
  for (auto& c : channels_) {
    if (c) c->abort(kind, text);
  }
}

void MeshTransport::close(const Deadline& dl) {
  std::vector<int> open;
  for (int j = 0; j < world_; ++j) {
    if (!channels_[j]) continue;
    channels_[j]->half_close();
    open.push_back(j);
  }
  // Read (and drop) whatever is left until every peer has closed its side too.
  while (!open.empty() && !dl.expired()) {
    std::vector<pollfd> fds;
    for (int j : open) fds.push_back({channels_[j]->fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), dl.remaining_ms(100)) <= 0) continue;
    std::vector<int> still;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents || channels_[open[i]]->drain()) still.push_back(open[i]);
    }
    open.swap(still);
  }
}

}  // namespace cx::distributed
