#include "distributed/transport/mesh_transport.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <sstream>

#include "distributed/net/socket.h"
#include "distributed/store/store.h"
#include "distributed/transport/frame.h"
#include "distributed/transport/shm/negotiate.h"
#include "distributed/transport/shm/shm_channel.h"
#include "distributed/transport/tcp/tcp_channel.h"

namespace cx::distributed {

namespace {

constexpr uint32_t kHandshakeMagic = 0x31485843;  // "CXH1"

}  // namespace

MeshTransport::MeshTransport(StoreClient& store, int rank, int world, uint64_t nonce, const Deadline& dl,
                             MeshOptions opt)
    : rank_(rank), world_(world), opt_(opt), channels_(static_cast<size_t>(world)) {
  using frame::get;
  using frame::put;
  std::vector<net::Fd> socks(static_cast<size_t>(world));
  std::vector<std::string> addrs(static_cast<size_t>(world));
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
    socks[j] = std::move(fd);
    addrs[j] = a;
  }
  // Higher ranks connect to us.
  int expected = world - 1 - rank;
  while (expected > 0) {
    // In slices: between them, ask the store whether a rank failed (Note
    // [Failures reach every rank through the store] in store/store.h).
    net::Fd fd;
    while (!fd.valid() && !dl.expired()) {
      Deadline slice = Deadline::after_ms(200);
      if (dl.at < slice.at) slice = dl;
      fd = net::accept_until(listener.get(), slice);
      if (!fd.valid() && !dl.expired()) store.check_failed(dl);
    }
    if (!fd.valid()) {
      std::ostringstream missing;
      for (int j = rank + 1; j < world; ++j)
        if (!socks[j].valid()) missing << (missing.tellp() ? ", " : "") << j;
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
        socks[j].valid()) {
      continue;  // stray or stale connection: drop it
    }
    char ack[8];
    put<uint32_t>(ack, 0, kHandshakeMagic);
    put<int32_t>(ack, 4, rank);
    net::send_exact(fd.get(), ack, sizeof(ack), dl, detail::concat("rank ", j));
    socks[j] = std::move(fd);
    addrs[j] = "rank " + std::to_string(j);
    --expected;
  }
  shm::Pairing pairs = shm::negotiate(socks, addrs, rank, nonce, opt_.shm, opt_.shm_ring_bytes, dl);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    net::set_nonblocking(socks[j].get(), true);
    if (j > rank) {
      // Learn the peer's listening address for messages.
      addrs[j] = store.get("addr/" + std::to_string(j), dl, "timed out reading a peer address");
    }
  }
  seg_ = std::move(pairs.own);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    if (pairs.peers[j].ok()) {
      channels_[j] = std::make_unique<ShmChannel>(rank, j, std::move(socks[j]), std::move(addrs[j]), op_, seg_,
                                                  std::move(pairs.peers[j]));
    } else {
      channels_[j] = std::make_unique<TcpChannel>(rank, j, std::move(socks[j]), std::move(addrs[j]), op_);
    }
  }
}

MeshTransport::~MeshTransport() = default;

void MeshTransport::begin(const OpDesc& desc, const Deadline& dl) {
  if (aborted_) CX_THROW(Error, "transport used after abort");
  op_.desc = desc;
  op_.deadline = dl;
  op_.done.clear();
  op_.pending = 0;
}

Transport::Req MeshTransport::isend(int peer, const void* buf, size_t bytes) {
  Req id = static_cast<Req>(op_.done.size());
  op_.done.push_back(0);
  ++op_.pending;
  channels_[peer]->isend(id, static_cast<const char*>(buf), bytes);
  return id;
}

Transport::Req MeshTransport::irecv(int peer, void* buf, size_t bytes) {
  Req id = static_cast<Req>(op_.done.size());
  op_.done.push_back(0);
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

void MeshTransport::timed_out() {
  std::ostringstream waiting;
  for (int j = 0; j < world_; ++j) {
    const Channel* c = channels_[j].get();
    if (c && c->busy()) waiting << (waiting.tellp() ? ", " : "") << "rank " << j << " (" << c->addr() << ")";
  }
  CX_THROW(TimeoutError, "rank ", rank_, ": ", op_.desc.describe(), " timed out after ", op_.deadline.timeout_ms,
           " ms waiting for ", waiting.str(),
           ". That rank is stuck, much slower, or did not call the same collective; raise operation_timeout_ms "
           "(DISTRIBUTED_OPERATION_TIMEOUT_MS) if it is only slow.");
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
    const WaitOn w = c->wait_on();
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
  auto spin_until = Clock::now() + std::chrono::microseconds(opt_.spin_us);
  while (!op_.done[static_cast<size_t>(r)]) {
    if (progress()) {
      spin_until = Clock::now() + std::chrono::microseconds(opt_.spin_us);
      continue;
    }
    if (Clock::now() < spin_until) {
      if (opt_.spin_us > 0 && world_ > 2) sched_yield();
      continue;
    }
    if (op_.deadline.expired()) timed_out();
    block();
  }
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
