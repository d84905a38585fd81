#include "distributed/store/store.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "distributed/net/auth.h"

namespace cx::distributed {

namespace {

constexpr uint32_t kMagic = 0x31535843;  // "CXS1"
constexpr uint32_t kMaxKey = 1024;
constexpr uint32_t kMaxValue = 1 << 20;
constexpr size_t kHeader = 16;

enum Cmd : uint8_t {
  kHello = 1, kSet = 2, kGet = 3, kDone = 4, kProbe = 5, kAuth1 = 6, kAuth2 = 7, kTryGet = 8, kFail = 9, kBye = 10
};
// kWarning: a line for the rank to print, ahead of the reply to its request (Note [Failed handshakes are
// told to the waiting ranks] in store.h).
enum Status : uint8_t { kOk = 0, kRetry = 1, kRefused = 2, kMissing = 3, kFailed = 4, kWarning = 5 };

// Note [A store strangers cannot stall] in store.h.
constexpr uint32_t kMaxPreAuthValue = 64;
constexpr int kMaxPreAuthFrames = 4;   // AUTH1, AUTH2, HELLO; or one PROBE
constexpr size_t kMaxPending = 256;    // connections that are not (yet) members
constexpr int64_t kJoinMs = 10000;
constexpr int64_t kReadMs = 10000;
constexpr int64_t kWriteMs = 10000;
constexpr int kTickMs = 200;           // how often those deadlines are looked at
constexpr size_t kMaxQueuedReply = 64 * 1024;
constexpr size_t kMaxBytesPerRank = 4u << 20;
constexpr size_t kMaxBytesTotal = 64u << 20;
constexpr size_t kMaxLogged = 1024;
constexpr size_t kMaxWarnings = 16;
constexpr const char* kStoreContext = "store";

void put_u32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
uint32_t get_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

std::string header(uint8_t code, uint32_t klen, uint32_t vlen) {
  std::string h(kHeader, '\0');
  put_u32(&h[0], kMagic);
  h[4] = static_cast<char>(code);
  put_u32(&h[8], klen);
  put_u32(&h[12], vlen);
  return h;
}

// PROBE: the asker's i32 WORLD_SIZE; its reply: i32 world_size | i32 ranks joined | u32 closing.
constexpr uint32_t kProbeReply = 12;
// How long a rank 0 that could not bind MASTER_PORT waits for what holds it to
// answer a PROBE. A store answers within milliseconds; a foreign program that
// accepts and stays silent costs this much before the plain "in use" message.
constexpr int64_t kProbeMs = 1000;

// Rank 0 could not bind MASTER_PORT: say who holds it (Note [Who holds MASTER_PORT]).
[[noreturn]] void explain_port_in_use(const std::string& host, int port, int world_size) {
  std::optional<StoreInfo> info = probe_store(host, port, world_size, Deadline::after_ms(kProbeMs));
  if (!info) CX_THROW(ConnectionError, net::in_use_message(host, port, "MASTER_PORT"));
  if (info->closing) {
    CX_THROW(ConnectionError, "MASTER_PORT ", port, " on ", host,
             " is held by the store of a pycyxwiz group that is shutting down (an earlier job's rank 0 still "
             "exiting?): wait for that process to exit, or choose another MASTER_PORT (e.g. MASTER_PORT=",
             port + 1, ")");
  }
  if (info->world_size != world_size) {
    CX_THROW(ConnectionError, "MASTER_PORT ", port, " on ", host,
             " is already in use by another pycyxwiz job: its rank 0's store answers there, with WORLD_SIZE=",
             info->world_size, " where this process has WORLD_SIZE=", world_size,
             ": choose another MASTER_PORT for this job (e.g. MASTER_PORT=", port + 1, ")");
  }
  CX_THROW(InvalidArgument, "RANK=0 is already taken by another process of this job (", host, ":", port,
           " answers as its store: WORLD_SIZE=", world_size, ", ", info->joined, " of ", world_size,
           " ranks joined): two processes were started with RANK=0 (each rank must be unique in 0..",
           world_size - 1, "); if that store is another job's, give this job another MASTER_PORT");
}

}  // namespace

std::optional<StoreInfo> probe_store(const std::string& host, int port, int world_size, const Deadline& dl) {
  const std::string what = "the process holding MASTER_PORT";
  try {
    net::Fd fd = net::connect_with_retry(host, port, dl, what);
    int32_t w = world_size;
    std::string req = header(kProbe, 0, 4) + std::string(reinterpret_cast<const char*>(&w), 4);
    net::send_exact(fd.get(), req.data(), req.size(), dl, what);
    char rep[kHeader + kProbeReply];
    net::recv_exact(fd.get(), rep, kHeader, dl, what);
    if (get_u32(rep) != kMagic || rep[4] != static_cast<char>(kOk) || get_u32(rep + 12) != kProbeReply) {
      return std::nullopt;  // not one of ours
    }
    net::recv_exact(fd.get(), rep + kHeader, kProbeReply, dl, what);
    StoreInfo info;
    int32_t v;
    std::memcpy(&v, rep + kHeader, 4);
    info.world_size = v;
    std::memcpy(&v, rep + kHeader + 4, 4);
    info.joined = v;
    info.closing = get_u32(rep + kHeader + 8) != 0;
    return info;
  } catch (const Error&) {
    return std::nullopt;  // refused, silent or closed: nothing we can name
  }
}

struct StoreServer::Frame {
  uint8_t cmd = 0;
  std::string key, value;
};

struct StoreServer::Client {
  net::Fd fd;
  std::string addr;            // the peer's ip:port, for the log
  std::string in;              // bytes received, not yet parsed
  std::string out;             // replies not yet written (from out_off)
  size_t out_off = 0;
  std::string waiting_key;     // non-empty: a GET parked until the key is set
  int rank = -1;               // >= 0: a member
  bool authed = false;
  int frames = 0;              // frames received before membership
  size_t warned = 0;           // how many of warnings_ it has been sent
  net::Handshake::Server handshake;  // Note [Job secret]: AUTH1 starts it, AUTH2 ends it
  Clock::time_point accepted, partial_since, write_stalled_since;
  size_t queued() const { return in.size() + out.size() - out_off; }
  bool done = false;           // it said DONE or BYE: its end of stream is a normal exit
};

StoreServer::StoreServer(const std::string& host, int port, int world_size, const std::string& secret,
                         int generation)
    : world_size_(world_size), generation_(generation), secret_(secret) {
  listen_ = net::try_listen_on(host, port);
  if (!listen_.valid()) explain_port_in_use(host, port, world_size);
  port_ = net::bound_port(listen_.get());
  where_ = host + ":" + std::to_string(port_);
  net::set_nonblocking(listen_.get(), true);
  if (::pipe2(wake_, O_CLOEXEC) != 0) CX_THROW(Error, "pipe(): ", std::strerror(errno));
  thread_ = std::thread([this] { serve(); });
}

void StoreServer::linger(int ms) const {
  const Deadline dl = Deadline::after_ms(ms);
  while (others_.load() > 0 && !dl.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

StoreServer::~StoreServer() {
  char b = 1;
  (void)!::write(wake_[1], &b, 1);
  if (thread_.joinable()) thread_.join();
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void StoreServer::cut(Client& c, const std::string& why) {
  if (!c.fd.valid()) return;
  const std::string ip = c.addr.substr(0, c.addr.rfind(':'));
  if (logged_.size() < kMaxLogged && logged_.insert(ip).second) {
    std::fprintf(stderr, "pycyxwiz: rank 0's store at %s cut off a connection from %s: %s\n", where_.c_str(),
                 c.addr.c_str(), why.c_str());
    std::fflush(stderr);
  }
  c.fd.reset();
}

void StoreServer::auth_failed(Client& c, const std::string& why) {
  auth_failures_.fetch_add(1);
  const std::string ip = c.addr.substr(0, c.addr.rfind(':'));
  const bool first = c.fd.valid() && !logged_.count(ip);
  const std::string addr = c.addr;
  cut(c, why);
  // Note [Failed handshakes are told to the waiting ranks]: once per address, as cut() logs.
  if (!first || warnings_.size() >= kMaxWarnings) return;
  warnings_.push_back(detail::concat("a connection from ", addr, " failed authentication: wrong secret? (at rank "
                                     "0's store: a rank of this job with another CX_AUTH_TOKEN or CX_AUTH_TOKEN_FILE, "
                                     "or a stranger; the job goes on)"));
  for (auto& m : clients_) {
    if (m->fd.valid() && m->rank > 0 && !m->waiting_key.empty()) warn(*m);
  }
}

void StoreServer::warn(Client& c) {
  if (c.rank <= 0) return;  // rank 0 is this process: cut() has said it on its stderr
  for (; c.warned < warnings_.size(); ++c.warned) reply(c, kWarning, warnings_[c.warned]);
}

size_t StoreServer::bytes_in_use() const {
  size_t n = stored_;
  for (const auto& c : clients_) n += c->queued();
  return n;
}

void StoreServer::reply(Client& c, uint8_t status, const std::string& value) {
  if (!c.fd.valid()) return;
  if (c.out.size() - c.out_off + kHeader + value.size() > kMaxBytesPerRank) {
    cut(c, "it does not read the store's replies");
    return;
  }
  if (c.out_off == c.out.size()) {
    c.out.clear();
    c.out_off = 0;
    c.write_stalled_since = Clock::now();
  }
  c.out += header(status, 0, static_cast<uint32_t>(value.size()));
  c.out += value;
  flush(c);
}

void StoreServer::flush(Client& c) {
  while (c.fd.valid() && c.out_off < c.out.size()) {
    ssize_t k = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c.out_off += static_cast<size_t>(k);
      c.write_stalled_since = Clock::now();
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      return;  // the rest when poll says the socket takes more
    } else {
      c.fd.reset();  // the client went away
      return;
    }
  }
  if (c.out_off == c.out.size()) {
    c.out.clear();
    c.out_off = 0;
  }
}

void StoreServer::fail(ErrorKind kind, const std::string& why) {
  if (!failure_.empty()) return;  // the first cause is the one worth telling
  failure_ = std::string(1, static_cast<char>(kind)) + why;
  for (auto& c : clients_) {
    if (c->fd.valid() && !c->waiting_key.empty()) {
      c->waiting_key.clear();
      reply(*c, kFailed, failure_);
    }
  }
}

void StoreServer::answer_waiters(const std::string& key) {
  for (auto& c : clients_) {
    if (c->fd.valid() && c->waiting_key == key) {
      c->waiting_key.clear();
      reply(*c, kOk, data_[key].second);
    }
  }
}

StoreServer::Parse StoreServer::next_frame(Client& c, Frame& f) {
  if (c.in.size() < kHeader) return Parse::kMore;
  if (get_u32(c.in.data()) != kMagic) {
    cut(c, "it does not speak the store's protocol");
    return Parse::kDrop;
  }
  f.cmd = static_cast<uint8_t>(c.in[4]);
  const uint32_t klen = get_u32(&c.in[8]), vlen = get_u32(&c.in[12]);
  const bool member = c.rank >= 0;
  if (!member && (klen > kMaxPreAuthValue || vlen > kMaxPreAuthValue || c.frames >= kMaxPreAuthFrames)) {
    cut(c, "it sent more than a newcomer may before joining");
    return Parse::kDrop;
  }
  if (klen > kMaxKey || vlen > kMaxValue) {  // refuse before allocating
    cut(c, detail::concat("it announced a frame larger than the store takes (key ", klen, ", value ", vlen,
                          " bytes)"));
    return Parse::kDrop;
  }
  if (c.in.size() < kHeader + klen + vlen) {
    if (c.partial_since == Clock::time_point{}) c.partial_since = Clock::now();
    return Parse::kMore;
  }
  c.partial_since = Clock::time_point{};
  if (!member) ++c.frames;
  f.key = c.in.substr(kHeader, klen);
  f.value = c.in.substr(kHeader + klen, vlen);
  c.in.erase(0, kHeader + klen + vlen);
  return Parse::kFrame;
}

// Note [A store strangers cannot stall]: what a connection may ask before it is a member.
bool StoreServer::admit(Client& c, uint8_t cmd) {
  if (c.rank < 0 && cmd != kAuth1 && cmd != kAuth2 && cmd != kProbe && cmd != kHello) {
    reply(c, kRefused, "the store of rank 0 takes this only from a rank that has joined the job");
    flush(c);
    cut(c, detail::concat("it sent command ", int(cmd), " before joining the job"));
    return false;
  }
  if (cmd == kHello && !c.authed) {
    reply(c, kRefused, "the store of rank 0 takes HELLO only after the job secret's handshake");
    flush(c);
    cut(c, "it sent HELLO without the job secret's handshake");
    return false;
  }
  return true;
}

bool StoreServer::handle(Client& c) {
  for (;;) {
    Frame f;
    const Parse p = next_frame(c, f);
    if (p != Parse::kFrame) return p == Parse::kMore;
    if (!admit(c, f.cmd) || !dispatch(c, f) || !c.fd.valid()) return false;
  }
}

bool StoreServer::dispatch(Client& c, Frame& f) {
  switch (f.cmd) {
    case kAuth1: return on_auth1(c, f);
    case kAuth2: return on_auth2(c, f);
    case kHello: return on_hello(c, f);
    case kSet: return on_set(c, f);
    case kGet: return on_get(c, f);
    case kTryGet: return on_try_get(c, f);
    case kFail:  // Note [Failures reach every rank through the store]
      if (f.value.empty()) return false;
      reply(c, kOk, "");
      fail(static_cast<ErrorKind>(f.value[0]), f.value.substr(1));
      return true;
    case kBye:  // the client is closing in order (no reply): its end of stream is no crash
      c.done = true;
      return true;
    case kDone:
      c.done = true;
      closing_ = true;
      reply(c, kOk, "");
      return true;
    case kProbe: return on_probe(c, f);
    default:
      cut(c, detail::concat("it sent an unknown command (", int(f.cmd), ")"));
      return false;
  }
}

bool StoreServer::on_auth1(Client& c, const Frame& f) {  // Note [Job secret]: the server proves itself first
  if (f.value.size() != net::kNonceBytes || c.handshake.started()) {
    cut(c, "a malformed job-secret handshake");
    return false;
  }
  reply(c, kOk, c.handshake.challenge(f.value));
  return true;
}

bool StoreServer::on_auth2(Client& c, const Frame& f) {
  if (!c.handshake.started() || c.authed || !c.handshake.verify(f.value)) {
    reply(c, kRefused, "the store of rank 0 refused this process: it does not know the job's secret "
                       "(every rank needs the same CX_AUTH_TOKEN or CX_AUTH_TOKEN_FILE)");
    flush(c);
    auth_failed(c, "it failed authentication: wrong secret? (a rank of this job with another CX_AUTH_TOKEN or "
                   "CX_AUTH_TOKEN_FILE, or a stranger; the job goes on)");
    return false;
  }
  c.authed = true;
  reply(c, kOk, "");
  return true;
}

bool StoreServer::on_hello(Client& c, const Frame& f) {
  if (f.value.size() != 12) return false;
  int32_t rank, world, generation;
  std::memcpy(&rank, f.value.data(), 4);
  std::memcpy(&world, f.value.data() + 4, 4);
  std::memcpy(&generation, f.value.data() + 8, 4);
  if (closing_) {
    reply(c, kRetry, "");
    flush(c);
    return false;
  }
  std::string refusal;
  const bool wrong_world = world != world_size_;  // the others would wait for it in vain: the group fails
  if (wrong_world) {
    refusal = detail::concat("rank ", rank, " was started with WORLD_SIZE=", world, " but rank 0 has WORLD_SIZE=",
                             world_size_, ": every rank must be given the same WORLD_SIZE");
  } else if (rank < 0 || rank >= world_size_) {
    refusal = detail::concat("RANK=", rank, " is not in 0..", world_size_ - 1);
  } else if (generation != generation_) {  // Config::generation; not a failure of this group: it stays open
    const bool stale = generation < generation_;
    refusal = detail::concat("rank ", rank, " (RESTART_COUNT=", generation, ") and rank 0 (RESTART_COUNT=",
                             generation_, ") belong to different starts of this job: ",
                             stale ? "this rank is left over from an earlier start"
                                   : "rank 0 is left over from an earlier start",
                             "; every rank of a restarted job must be started again by its launcher");
  } else if (claimed_.count(rank)) {
    refusal = detail::concat("RANK=", rank, " is already taken by another process: ",
                             "two processes were started with RANK=", rank, " (each rank must be unique in 0..",
                             world_size_ - 1, ")");
  }
  if (!refusal.empty()) {
    reply(c, kRefused, refusal);
    if (wrong_world) fail(ErrorKind::kInvalidArgument, refusal);
    flush(c);
    return false;
  }
  claimed_.insert(rank);
  c.rank = rank;
  if (rank > 0) others_.fetch_add(1);
  reply(c, kOk, "");
  return true;
}

bool StoreServer::on_set(Client& c, Frame& f) {
  auto it = data_.find(f.key);
  const size_t old = it != data_.end() && it->second.first == c.rank ? it->second.second.size() : 0;
  const size_t mine = stored_by_rank_[c.rank] - old + f.value.size();
  const size_t total = bytes_in_use() - old + f.value.size();
  if (mine > kMaxBytesPerRank || total > kMaxBytesTotal) {
    reply(c, kRefused,
          detail::concat("the store of rank 0 refused to store '", f.key.substr(0, 64), "' (", f.value.size(),
                         " bytes) for rank ", c.rank, ": that would make ", mine, " bytes stored by this rank (at most ",
                         kMaxBytesPerRank, ") and ", total, " in the whole store (at most ", kMaxBytesTotal,
                         "); the store only carries setup data (addresses, ids)"));
    return true;
  }
  if (it != data_.end()) {
    stored_by_rank_[it->second.first] -= it->second.second.size();
    stored_ -= it->second.second.size();
  }
  stored_by_rank_[c.rank] += f.value.size();
  stored_ += f.value.size();
  data_[f.key] = {c.rank, std::move(f.value)};
  reply(c, kOk, "");
  answer_waiters(f.key);
  return true;
}

bool StoreServer::on_get(Client& c, const Frame& f) {
  warn(c);
  auto it = data_.find(f.key);
  if (it != data_.end()) {
    reply(c, kOk, it->second.second);
  } else if (!failure_.empty()) {
    reply(c, kFailed, failure_);
  } else {
    c.waiting_key = f.key;
  }
  return true;
}

bool StoreServer::on_try_get(Client& c, const Frame& f) {  // never parks: the value, or kMissing
  if (f.key.empty()) warn(c);  // check_failed(): a rank that waits on something else
  auto it = data_.find(f.key);
  if (it != data_.end()) {
    reply(c, kOk, it->second.second);
  } else if (f.key.empty() && !failure_.empty()) {  // of the empty key: has the group failed?
    reply(c, kFailed, failure_);
  } else {
    reply(c, kMissing, "");
  }
  return true;
}

bool StoreServer::on_probe(Client& c, const Frame& f) {  // Note [Who holds MASTER_PORT]: read-only, claims nothing
  if (f.value.size() != 4) return false;
  int32_t asker;
  std::memcpy(&asker, f.value.data(), 4);
  if (asker == world_size_) turned_away_.fetch_add(1);  // a second RANK=0 of this job, it seems
  char v[kProbeReply];
  int32_t w = world_size_, joined = static_cast<int32_t>(claimed_.size());
  std::memcpy(v, &w, 4);
  std::memcpy(v + 4, &joined, 4);
  put_u32(v + 8, closing_ ? 1 : 0);
  reply(c, kOk, std::string(v, kProbeReply));
  return true;
}

void StoreServer::accept_all() {
  // Note [A store strangers cannot stall]: room is made by cutting the oldest newcomer.
  auto oldest_newcomer = [&](size_t* count) {
    Client* oldest = nullptr;
    for (auto& c : clients_) {
      if (c->rank >= 0 || !c->fd.valid()) continue;
      if (count) ++*count;
      if (!oldest || c->accepted < oldest->accepted) oldest = c.get();
    }
    return oldest;
  };
  auto take = [&](net::Fd fd, std::string addr) {
    size_t newcomers = 0;
    Client* oldest = oldest_newcomer(&newcomers);
    if (newcomers >= kMaxPending && oldest) {
      cut(*oldest, "too many connections to the store at once: the oldest newcomer is dropped");
    }
    auto cl = std::make_unique<Client>();
    cl->fd = std::move(fd);
    cl->addr = std::move(addr);
    cl->accepted = Clock::now();
    cl->handshake = net::Handshake::Server(secret_, kStoreContext);
    clients_.push_back(std::move(cl));
  };
  auto make_room = [&] {  // out of descriptors
    Client* oldest = oldest_newcomer(nullptr);
    if (!oldest) return false;
    cut(*oldest, "too many connections to the store at once: the oldest newcomer is dropped");
    oldest->fd.reset();
    return true;
  };
  net::accept_waiting(listen_.get(), take, make_room);
}

void StoreServer::enforce_deadlines() {
  const auto now = Clock::now();
  auto older = [&](Clock::time_point t, int64_t ms) {
    return t != Clock::time_point{} && now - t > std::chrono::milliseconds(ms);
  };
  for (auto& cp : clients_) {
    Client& c = *cp;
    if (!c.fd.valid()) continue;
    if (c.rank < 0 && older(c.accepted, kJoinMs)) {
      cut(c, detail::concat("it did not join the job within ", kJoinMs, " ms of connecting"));
    } else if (older(c.partial_since, kReadMs)) {
      cut(c, detail::concat("it left a request half sent for ", kReadMs, " ms"));
    } else if (c.out_off < c.out.size() && older(c.write_stalled_since, kWriteMs)) {
      cut(c, detail::concat("it did not read the store's replies for ", kWriteMs, " ms"));
    }
  }
}

void StoreServer::serve() {
  std::vector<pollfd> fds;
  std::vector<char> buf(64 * 1024);
  for (;;) {
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listen_.get(), POLLIN, 0});
    for (auto& c : clients_) {
      short ev = 0;
      // A client with replies piling up is not read until it reads them.
      if (c->out.size() - c->out_off < kMaxQueuedReply) ev |= POLLIN;
      if (c->out_off < c->out.size()) ev |= POLLOUT;
      fds.push_back({c->fd.get(), ev, 0});
    }
    // Deadlines to look at (Note [A store strangers cannot stall]): wake up every
    // kTickMs while any client has one running; members at rest have none.
    bool timed = false;
    for (auto& c : clients_) {
      timed = timed || c->rank < 0 || c->partial_since != Clock::time_point{} || c->out_off < c->out.size();
    }
    int rc = ::poll(fds.data(), fds.size(), timed ? kTickMs : -1);
    if (rc < 0 && errno != EINTR) return;
    if (fds[0].revents) return;
    const size_t n = clients_.size();  // accept_all appends after these
    for (size_t i = 2; i < n + 2; ++i) {
      if (!fds[i].revents) continue;
      Client& c = *clients_[i - 2];
      if (!c.fd.valid()) continue;
      if (fds[i].revents & POLLOUT) flush(c);
      if (!c.fd.valid() || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t k = ::recv(c.fd.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (k > 0) {
        c.in.append(buf.data(), static_cast<size_t>(k));
        if (!handle(c)) c.fd.reset();
      } else if (k == 0 || (errno != EAGAIN && errno != EINTR)) {
        if (c.rank < 0 && c.handshake.started() && !c.authed) {
          auth_failed(c, "it failed authentication: wrong secret? It left the job secret's handshake unfinished (a "
                         "rank with another CX_AUTH_TOKEN or CX_AUTH_TOKEN_FILE, or a stranger; the job goes on)");
        }
        c.fd.reset();
        if (c.rank > 0 && !c.done) {
          fail(ErrorKind::kConnection,
               detail::concat("rank ", c.rank, " exited, crashed or was killed: its connection to the store (rank 0) "
                              "closed before it finalized"));
        }
      }
    }
    if (fds[1].revents & POLLIN) accept_all();
    enforce_deadlines();
    for (size_t i = clients_.size(); i-- > 0;) {
      if (clients_[i]->fd.valid()) continue;
      if (clients_[i]->rank > 0) others_.fetch_sub(1);
      clients_.erase(clients_.begin() + static_cast<long>(i));
    }
  }
}

namespace {

// One reply of the store: (status, value); throws like recv_exact. Sets `fatal` when
// what answers is not a store (no point in retrying).
std::pair<uint8_t, std::string> read_reply(int fd, const Deadline& dl, const std::string& what,
                                           const std::string& host, int port, bool& fatal) {
  char rep[kHeader];
  net::recv_exact(fd, rep, kHeader, dl, what);
  if (get_u32(rep) != kMagic) {
    fatal = true;
    CX_THROW(ConnectionError, "something that is not a pycyxwiz store answers at ", host, ":", port,
             " (another program uses MASTER_PORT?): choose another MASTER_PORT");
  }
  uint32_t vlen = get_u32(rep + 12);
  if (vlen > kMaxValue) CX_THROW(ConnectionError, "store reply too large from ", host, ":", port);
  std::string value(vlen, '\0');
  net::recv_exact(fd, value.data(), vlen, dl, what);
  return {static_cast<uint8_t>(rep[4]), std::move(value)};
}

}  // namespace

StoreClient::StoreClient(const std::string& host, int port, int rank, int world_size, const std::string& secret,
                         const Deadline& dl, int generation)
    : host_(host), port_(port), rank_(rank) {
  std::string what = "the store of rank 0 (MASTER_ADDR:MASTER_PORT)";
  for (;;) {
    fd_ = net::connect_with_retry(host, port, dl, what);
    // Note [Job secret]: AUTH1 with our nonce; the store proves the secret with its
    // nonce; we prove it and claim our rank in one go (AUTH2 then HELLO).
    const net::Handshake::Client handshake(secret, kStoreContext);
    std::string auth1 = header(kAuth1, 0, net::kNonceBytes) + handshake.nonce();
    char hello[12];
    int32_t r = rank, w = world_size, g = generation;  // Config::generation
    std::memcpy(hello, &r, 4);
    std::memcpy(hello + 4, &w, 4);
    std::memcpy(hello + 8, &g, 4);
    bool retry = false, fatal = false;
    std::pair<uint8_t, std::string> rep;
    try {
      net::send_exact(fd_.get(), auth1.data(), auth1.size(), dl, what);
      rep = read_reply(fd_.get(), dl, what, host, port, fatal);
      if (rep.first != kOk || rep.second.size() != net::kNonceBytes + net::kProofBytes) {
        fatal = true;
        CX_THROW(ConnectionError, "rank ", rank, ": the store at ", host, ":", port,
                 " does not speak this version's handshake (a pycyxwiz of another version on rank 0?)");
      }
      const std::optional<std::string> answer = handshake.answer(rep.second);
      if (!answer) {
        fatal = true;
        CX_THROW(ConnectionError, "authentication failed: rank ", rank, ": the store at ", host, ":", port,
                 " does not know this job's secret: rank 0 was given another CX_AUTH_TOKEN (or none, or this one "
                 "none), or that is not this job's store. Give every rank the same CX_AUTH_TOKEN or "
                 "CX_AUTH_TOKEN_FILE");
      }
      std::string req = header(kAuth2, 0, net::kProofBytes) + *answer + header(kHello, 0, 12) + std::string(hello, 12);
      net::send_exact(fd_.get(), req.data(), req.size(), dl, what);
      rep = read_reply(fd_.get(), dl, what, host, port, fatal);
      if (rep.first == kRefused) {
        fatal = true;
        CX_THROW(ConnectionError, "authentication failed: rank ", rank, ": ", rep.second);
      }
      rep = read_reply(fd_.get(), dl, what, host, port, fatal);
    } catch (const ConnectionError&) {
      if (fatal) throw;
      retry = true;  // the previous group's store closing under us: try again
    }
    if (!retry) {
      if (rep.first == kOk) return;
      if (rep.first == kRefused) CX_THROW(InvalidArgument, rep.second);
    }
    if (dl.expired()) {
      CX_THROW(TimeoutError, "Timeout waiting for peers: rank ", rank, " could not join the store at ", host,
               ":", port, " within ", dl.timeout_ms, " ms (the previous group there was still shutting down)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string StoreClient::request(uint8_t cmd, const std::string& key, const std::string& value,
                                 const Deadline& dl, const std::string& waiting_for) {
  std::string what = "the store of rank 0 at " + host_ + ":" + std::to_string(port_);
  std::string req = header(cmd, static_cast<uint32_t>(key.size()), static_cast<uint32_t>(value.size())) + key + value;
  net::send_exact(fd_.get(), req.data(), req.size(), dl, what);
  std::string rep(kHeader, '\0'), out;
  for (;;) {
    try {
      net::recv_exact(fd_.get(), rep.data(), kHeader, dl, what);
    } catch (const TimeoutError&) {
      CX_THROW(TimeoutError, waiting_for);
    } catch (const ConnectionError& e) {
      CX_THROW(ConnectionError, "rank ", rank_, " lost the connection to ", what,
               ": rank 0 exited or crashed (", e.what(), ")");
    }
    if (get_u32(rep.data()) != kMagic) CX_THROW(ConnectionError, "garbled reply from ", what);
    uint32_t vlen = get_u32(&rep[12]);
    if (vlen > kMaxValue) CX_THROW(ConnectionError, "store reply larger than allowed from ", what);
    out.assign(vlen, '\0');
    net::recv_exact(fd_.get(), out.data(), vlen, dl, what);
    if (static_cast<uint8_t>(rep[4]) != kWarning) break;
    // Note [Failed handshakes are told to the waiting ranks]; the reply follows.
    std::fprintf(stderr, "pycyxwiz: warning: rank %d: %s\n", rank_, printable(out, 1024).c_str());
    std::fflush(stderr);
  }
  const auto status = static_cast<uint8_t>(rep[4]);
  if (status == kRefused) CX_THROW(InvalidArgument, "rank ", rank_, ": ", out);
  if (status == kFailed && !out.empty()) {
    auto kind = static_cast<ErrorKind>(out[0]);
    if (static_cast<int>(kind) < 1 || kind > ErrorKind::kPeerFailed) kind = ErrorKind::kGeneric;
    rethrow_as(kind,
               detail::concat("rank ", rank_, ": the group cannot go on: ", printable(out.substr(1), 4096)));
  }
  missing_ = status == kMissing;
  return out;
}

StoreClient::~StoreClient() {
  if (!fd_.valid()) return;
  try {
    std::string req = header(kBye, 0, 0);
    net::send_exact(fd_.get(), req.data(), req.size(), Deadline::after_ms(50), "the store");
  } catch (const Error&) {
    // rank 0 is gone already
  }
}

std::optional<std::string> StoreClient::try_get(const std::string& key, const Deadline& dl) {
  std::lock_guard<std::mutex> lk(mu_);
  std::string v = request(kTryGet, key, "", dl, "timed out reading '" + key + "' from the store");
  if (missing_) return std::nullopt;
  return v;
}

void StoreClient::fail(ErrorKind kind, const std::string& why, const Deadline& dl) {
  std::lock_guard<std::mutex> lk(mu_);
  request(kFail, "", std::string(1, static_cast<char>(kind)) + why.substr(0, kMaxValue / 2), dl,
          "timed out telling the store this rank failed");
}

void StoreClient::check_failed(const Deadline& dl) {
  std::lock_guard<std::mutex> lk(mu_);
  request(kTryGet, "", "", dl, "timed out asking the store whether the group failed");
}

void StoreClient::set(const std::string& key, const std::string& value, const Deadline& dl) {
  std::lock_guard<std::mutex> lk(mu_);
  request(kSet, key, value, dl, "timed out setting '" + key + "' in the store");
}

std::string StoreClient::get(const std::string& key, const Deadline& dl, const std::string& waiting_for) {
  std::lock_guard<std::mutex> lk(mu_);
  return request(kGet, key, "", dl, waiting_for);
}

void StoreClient::done(const Deadline& dl) {
  std::lock_guard<std::mutex> lk(mu_);
  request(kDone, "", "", dl, "timed out leaving the store");
}

std::string StoreClient::local_ip() const { return net::local_ip_of(fd_.get()); }

}  // namespace cx::distributed
