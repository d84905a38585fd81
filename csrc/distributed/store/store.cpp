#include "distributed/store/store.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "common/error.h"

namespace cx::distributed {

namespace {

constexpr uint32_t kMagic = 0x31535843;  // "CXS1"
constexpr uint32_t kMaxKey = 1024;
constexpr uint32_t kMaxValue = 1 << 20;
constexpr size_t kHeader = 16;

enum Cmd : uint8_t { kHello = 1, kSet = 2, kGet = 3, kDone = 4, kProbe = 5, kTryGet = 6, kFail = 7, kBye = 8 };
enum Status : uint8_t { kOk = 0, kRetry = 1, kRefused = 2, kMissing = 3, kFailed = 4 };

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

struct StoreServer::Client {
  net::Fd fd;
  std::string in;              // bytes received, not yet parsed
  std::string waiting_key;     // non-empty: a GET parked until the key is set
  int rank = -1;
  bool done = false;           // it said DONE: its end of stream is a normal exit
};

StoreServer::StoreServer(const std::string& host, int port, int world_size) : world_size_(world_size) {
  listen_ = net::try_listen_on(host, port);
  if (!listen_.valid()) explain_port_in_use(host, port, world_size);
  port_ = net::bound_port(listen_.get());
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

void StoreServer::reply(Client& c, uint8_t status, const std::string& value) {
  std::string msg = header(status, 0, static_cast<uint32_t>(value.size())) + value;
  // Replies are small; a client that does not read them within a second is dropped.
  try {
    net::send_exact(c.fd.get(), msg.data(), msg.size(), Deadline::after_ms(1000), "store client");
  } catch (const Error&) {
    c.fd.reset();
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
      reply(*c, kOk, data_[key]);
    }
  }
}

bool StoreServer::handle(Client& c) {
  for (;;) {
    if (c.in.size() < kHeader) return true;
    if (get_u32(c.in.data()) != kMagic) return false;  // not one of ours
    uint8_t cmd = static_cast<uint8_t>(c.in[4]);
    uint32_t klen = get_u32(&c.in[8]), vlen = get_u32(&c.in[12]);
    if (klen > kMaxKey || vlen > kMaxValue) return false;  // refuse before allocating
    if (c.in.size() < kHeader + klen + vlen) return true;
    std::string key = c.in.substr(kHeader, klen);
    std::string value = c.in.substr(kHeader + klen, vlen);
    c.in.erase(0, kHeader + klen + vlen);
    switch (cmd) {
      case kHello: {
        if (value.size() != 8) return false;
        int32_t rank, world;
        std::memcpy(&rank, value.data(), 4);
        std::memcpy(&world, value.data() + 4, 4);
        if (closing_) {
          reply(c, kRetry, "");
          return false;
        }
        if (world != world_size_) {
          const std::string why = detail::concat("rank ", rank, " was started with WORLD_SIZE=", world,
                                                 " but rank 0 has WORLD_SIZE=", world_size_,
                                                 ": every rank must be given the same WORLD_SIZE");
          reply(c, kRefused, why);
          fail(ErrorKind::kInvalidArgument, why);  // the others would wait for it in vain
          return false;
        }
        if (claimed_.count(rank)) {
          reply(c, kRefused, detail::concat("RANK=", rank, " is already taken by another process: ",
                                            "two processes were started with RANK=", rank,
                                            " (each rank must be unique in 0..", world_size_ - 1, ")"));
          return false;
        }
        claimed_.insert(rank);
        c.rank = rank;
        if (rank > 0) others_.fetch_add(1);
        reply(c, kOk, "");
        break;
      }
      case kSet:
        data_[key] = value;
        reply(c, kOk, "");
        answer_waiters(key);
        break;
      case kGet: {
        auto it = data_.find(key);
        if (it != data_.end()) {
          reply(c, kOk, it->second);
        } else if (!failure_.empty()) {
          reply(c, kFailed, failure_);
        } else {
          c.waiting_key = key;
        }
        break;
      }
      case kTryGet: {  // never parks: the value, or kMissing; of the empty key: has the group failed?
        auto it = data_.find(key);
        if (it != data_.end()) {
          reply(c, kOk, it->second);
        } else if (key.empty() && !failure_.empty()) {
          reply(c, kFailed, failure_);
        } else {
          reply(c, kMissing, "");
        }
        break;
      }
      case kFail:  // Note [Failures reach every rank through the store]
        if (value.empty()) return false;
        reply(c, kOk, "");
        fail(static_cast<ErrorKind>(value[0]), value.substr(1));
        break;
      case kBye:  // the client is closing in order (no reply): its end of stream is no crash
        c.done = true;
        break;
      case kDone:
        c.done = true;
        closing_ = true;
        reply(c, kOk, "");
        break;
      case kProbe: {  // Note [Who holds MASTER_PORT]: read-only, claims nothing
        if (value.size() != 4) return false;
        int32_t asker;
        std::memcpy(&asker, value.data(), 4);
        if (asker == world_size_) turned_away_.fetch_add(1);  // a second RANK=0 of this job, it seems
        char v[kProbeReply];
        int32_t w = world_size_, joined = static_cast<int32_t>(claimed_.size());
        std::memcpy(v, &w, 4);
        std::memcpy(v + 4, &joined, 4);
        put_u32(v + 8, closing_ ? 1 : 0);
        reply(c, kOk, std::string(v, kProbeReply));
        break;
      }
      default: return false;
    }
    if (!c.fd.valid()) return false;
  }
}

void StoreServer::serve() {
  std::vector<pollfd> fds;
  char buf[4096];
  for (;;) {
    fds.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listen_.get(), POLLIN, 0});
    for (auto& c : clients_) fds.push_back({c->fd.get(), POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), -1);
    if (rc < 0 && errno != EINTR) return;
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) {
      int c = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) {
        auto cl = std::make_unique<Client>();
        cl->fd.reset(c);
        net::tune_socket(c);
        clients_.push_back(std::move(cl));
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Client& c = *clients_[i - 2];
      ssize_t k = ::recv(c.fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
      if (k > 0) {
        c.in.append(buf, static_cast<size_t>(k));
        if (c.in.size() > kHeader + kMaxKey + kMaxValue || !handle(c)) c.fd.reset();
      } else if (k == 0 || (errno != EAGAIN && errno != EINTR)) {
        c.fd.reset();
        if (c.rank > 0 && !c.done) {
          fail(ErrorKind::kConnection,
               detail::concat("rank ", c.rank, " exited, crashed or was killed: its connection to the store (rank 0) "
                              "closed before it finalized"));
        }
      }
    }
    for (size_t i = clients_.size(); i-- > 0;) {
      if (clients_[i]->fd.valid()) continue;
      if (clients_[i]->rank > 0) others_.fetch_sub(1);
      clients_.erase(clients_.begin() + static_cast<long>(i));
    }
  }
}

StoreClient::StoreClient(const std::string& host, int port, int rank, int world_size, const Deadline& dl)
    : host_(host), port_(port), rank_(rank) {
  std::string what = "the store of rank 0 (MASTER_ADDR:MASTER_PORT)";
  for (;;) {
    fd_ = net::connect_with_retry(host, port, dl, what);
    char hello[8];
    int32_t r = rank, w = world_size;
    std::memcpy(hello, &r, 4);
    std::memcpy(hello + 4, &w, 4);
    std::string req = header(kHello, 0, 8) + std::string(hello, 8);
    std::string rep(kHeader, '\0');
    bool retry = false;
    try {
      net::send_exact(fd_.get(), req.data(), req.size(), dl, what);
      net::recv_exact(fd_.get(), rep.data(), kHeader, dl, what);
    } catch (const ConnectionError&) {
      retry = true;  // the previous group's store closing under us: try again
    }
    if (!retry) {
      if (get_u32(rep.data()) != kMagic) {
        CX_THROW(ConnectionError, "something that is not a pycyxwiz store answers at ", host, ":", port,
                 " (another program uses MASTER_PORT?): choose another MASTER_PORT");
      }
      uint8_t status = static_cast<uint8_t>(rep[4]);
      uint32_t vlen = get_u32(&rep[12]);
      if (vlen > kMaxValue) CX_THROW(ConnectionError, "store reply too large");
      std::string value(vlen, '\0');
      net::recv_exact(fd_.get(), value.data(), vlen, dl, what);
      if (status == kOk) return;
      if (status == kRefused) CX_THROW(InvalidArgument, value);
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
  std::string rep(kHeader, '\0');
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
  std::string out(vlen, '\0');
  net::recv_exact(fd_.get(), out.data(), vlen, dl, what);
  const auto status = static_cast<uint8_t>(rep[4]);
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
