#include "distributed/net/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/env.h"
#include "common/error.h"

namespace cx::distributed::net {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

sockaddr_in resolve(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1) return a;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    CX_THROW(ConnectionError, "cannot resolve host '", host, "': ", gai_strerror(rc),
             " (check MASTER_ADDR)");
  }
  a.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return a;
}

std::string addr_to_string(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

std::string in_use_message(const std::string& host, int port, const char* what) {
  return detail::concat(what, " ", port, " on ", host,
                        " is already in use by another process: stop it, or choose a free port (e.g. ", what, "=",
                        port + 1, ")");
}

Fd try_listen_on(const std::string& host, int port) {
  sockaddr_in a = resolve(host, port);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) CX_THROW(ConnectionError, "socket(): ", std::strerror(errno));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    int e = errno;
    if (e == EADDRINUSE) return Fd();
    if (e == EADDRNOTAVAIL) {
      CX_THROW(ConnectionError, "cannot listen on ", host, ":", port, ": ", host,
               " is not an address of this machine (rank 0 must run on MASTER_ADDR)");
    }
    CX_THROW(ConnectionError, "cannot listen on ", host, ":", port, ": ", std::strerror(e));
  }
  if (::listen(fd.get(), 128) != 0) {
    // With SO_REUSEADDR two processes may both bind a port before either listens;
    // the second listen() then finds it taken, as a bind would have.
    if (errno == EADDRINUSE) return Fd();
    CX_THROW(ConnectionError, "listen(): ", std::strerror(errno));
  }
  return fd;
}

Fd listen_on(const std::string& host, int port, const char* what) {
  Fd fd = try_listen_on(host, port);
  if (!fd.valid()) CX_THROW(ConnectionError, in_use_message(host, port, what));
  return fd;
}

int bound_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

std::string local_ip_of(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  char buf[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf));
  return buf;
}

void set_nonblocking(int fd, bool on) {
  int fl = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

// Socket buffer size: CX_SOCKET_BUFFER_BYTES, default 0 = the kernel's
// autotuning. Setting SO_SNDBUF/SO_RCVBUF turns autotuning off and is silently
// capped at net.core.{w,r}mem_max (208 KiB on many systems), so a fixed size
// only helps where those limits are raised. Below 64 KiB a ring stops
// streaming (4 KiB made a 400 KB all_reduce take 10 s), so that is refused.
int socket_buffer_bytes() {
  return static_cast<int>(env::integer("CX_SOCKET_BUFFER_BYTES", 64 << 10, 1 << 30,
                                       "bytes, 65536 (64 KiB) .. 1073741824 (1 GiB); unset: the kernel's "
                                       "autotuning, which is best almost everywhere")
                              .value_or(0));
}

// Note [Congestion control between ranks on one host]
// Many machines run BBR (net.ipv4.tcp_congestion_control=bbr; this project's VMs do). Over loopback, where the
// round trip is microseconds, BBR's model of the path (bandwidth x min RTT) keeps a connection's window at 14-26
// segments and drops and re-sends some (ss -ti on our data connections after 1.5 GB of ping-pong: cwnd 14-26,
// 78-144 socket drops; with reno cwnd 57-107, 0-2 drops), so a large message stalls on ACKs. Measured on 2 vCPUs,
// our TCP transport with the machine's BBR against reno (the kernel's own, which every user may pick), side by
// side: 2 ranks ping-pong of 1 MiB 341 -> 178 us, of 4 MiB 1544 -> 886 us; loopback itself (benchmarks/
// loopback.py, both directions, data in memory) 2.2 -> 4.0 GB/s each way; PyTorch DDP of the MLP over "cyxwiz"
// (TCP) 35.0-36.4 -> 29.6-33.9 ms a step on 2 ranks. So a connection between two ranks of one host, where each
// rank on the host has a core, uses reno: no congestion is there to control. With more ranks than cores (4 ranks
// on 2 cores) reno was 1.4-1.9x faster from 2 MiB but 0.5-1.0x at 128 KiB-1 MiB (BBR's figure there depends on what
// ran before) and 0.4-0.6x beside busy programs, also with the ring in place of recursive doubling and
// halving-doubling. So there the connections to ranks of this host follow the operation's size (CongestionBySize):
// reno for an operation of kRenoFromBytes or more, the machine's for one of kMachineFromBytes up to that, and
// whatever they had for smaller ones, where the window does not matter (a barrier between two large all_reduces
// switches nothing). A switch is one setsockopt per such connection, made when the operation begins, and only when
// the size class changes (benchmarks/README.md, "TCP between ranks of one host", has the figures).
// Across hosts the machine's choice stands (links shared with others, and losses, are what it was made for; over
// the 1 Gbit/s links of the netns tests the two were level). CX_TCP_CONGESTION names one for every connection
// (reno, cubic, bbr, ... as the kernel has and allows them), or "system" keeps the machine's everywhere.
namespace {

bool same_host(int fd) {
  sockaddr_in self{}, peer{};
  socklen_t ls = sizeof(self), lp = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &ls) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &lp) != 0 || peer.sin_family != AF_INET) {
    return false;
  }
  return self.sin_addr.s_addr == peer.sin_addr.s_addr || (ntohl(peer.sin_addr.s_addr) >> 24) == 127;
}

bool set_congestion(int fd, const std::string& name) {
  return ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0;
}

std::string first_line(const char* path) {
  std::string line;
  if (FILE* f = std::fopen(path, "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof(buf), f)) line = buf;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line.empty() ? std::string("unknown") : line;
}

// CX_TCP_CONGESTION as set, "auto" where unset; tcp_congestion() checked it at init (a name the environment
// changed to since then is tried, and where the kernel refuses it its own choice stays).
std::string congestion_setting() {
  const char* v = env::get("CX_TCP_CONGESTION");
  return v ? v : "auto";
}

}  // namespace

std::string tcp_congestion() {
  const std::string name = congestion_setting();
  if (name == "auto" || name == "system") return name;
  int e = ENAMETOOLONG;  // the kernel's names are shorter than TCP_CA_NAME_MAX (16)
  if (name.size() < 16) {
    Fd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe.valid() && set_congestion(probe.get(), name)) return name;
    e = errno;
  }
  CX_THROW(InvalidArgument, "environment variable CX_TCP_CONGESTION='", name, "' is not valid: the kernel refused ",
           "it (", std::strerror(e), "). Expected auto (reno between ranks of one host, by operation size where ",
           "ranks outnumber cores; the machine's across hosts), system (the machine's everywhere), or one of the ",
           "kernel's congestion controls: ",
           first_line("/proc/sys/net/ipv4/tcp_available_congestion_control"), " (without privileges: ",
           first_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control"), ")");
}

void tune_socket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int buf = 0;
  try {
    buf = socket_buffer_bytes();  // checked by Config::from_environment before any socket is made
  } catch (const Error&) {
    // the environment changed under a running job (this may be the store's thread): the kernel's default
  }
  if (buf) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  }
  const std::string cc = congestion_setting();
  if (cc != "auto" && cc != "system") set_congestion(fd, cc);
}

bool congestion_between_ranks(int fd, bool core_each) {
  // Note [Congestion control between ranks on one host]; where the kernel says no, its own choice stays.
  if (!same_host(fd) || congestion_setting() != "auto") return false;
  if (!core_each) return true;
  set_congestion(fd, "reno");
  return false;
}

void CongestionBySize::add(int fd) {
  if (fds_.empty()) {
    char name[16] = {0};
    socklen_t len = sizeof(name) - 1;
    if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return;
    machine_ = name;
  }
  fds_.push_back(fd);
}

void CongestionBySize::before(size_t bytes) {
  if (fds_.empty() || bytes < kMachineFromBytes) return;
  const bool reno = bytes >= kRenoFromBytes;
  if (reno == reno_) return;
  for (int fd : fds_) set_congestion(fd, reno ? std::string("reno") : machine_);
  reno_ = reno;
}

Fd connect_with_retry(const std::string& host, int port, const Deadline& dl, const std::string& what) {
  sockaddr_in a = resolve(host, port);
  std::string last = "no attempt";
  int delay_ms = 2;
  for (;;) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) CX_THROW(ConnectionError, "socket(): ", std::strerror(errno));
    set_nonblocking(fd.get(), true);
    int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a));
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      int pr = ::poll(&p, 1, dl.remaining_ms(1000));
      if (pr > 0) {
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      } else {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      set_nonblocking(fd.get(), false);
      tune_socket(fd.get());
      return fd;
    }
    last = std::strerror(err);
    if (err != ECONNREFUSED && err != ETIMEDOUT && err != ENETUNREACH && err != EHOSTUNREACH &&
        err != ECONNRESET && err != EAGAIN) {
      CX_THROW(ConnectionError, "cannot connect to ", what, " at ", host, ":", port, ": ", last);
    }
    if (dl.expired()) {
      CX_THROW(TimeoutError, "Timeout waiting for peers: could not reach ", what, " at ", host, ":", port,
               " within ", dl.timeout_ms, " ms (last error: ", last,
               "). Is that process running, and are MASTER_ADDR/MASTER_PORT the same on every rank?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(delay_ms, dl.remaining_ms(1000) + 1)));
    delay_ms = std::min(delay_ms * 2, 100);
  }
}

void accept_waiting(int listen_fd, const std::function<void(Fd fd, std::string addr)>& take,
                    const std::function<bool()>& make_room) {
  for (;;) {
    sockaddr_in a{};
    socklen_t len = sizeof(a);
    int c = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&a), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && make_room()) continue;
      return;  // EAGAIN: all taken
    }
    tune_socket(c);
    take(Fd(c), addr_to_string(a));
  }
}

Fd accept_until(int listen_fd, const Deadline& dl) {
  for (;;) {
    pollfd p{listen_fd, POLLIN, 0};
    int pr = ::poll(&p, 1, dl.remaining_ms(1000));
    if (pr > 0) {
      int c = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) {
        tune_socket(c);
        return Fd(c);
      }
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      CX_THROW(ConnectionError, "accept(): ", std::strerror(errno));
    }
    if (pr < 0 && errno != EINTR) CX_THROW(ConnectionError, "poll(): ", std::strerror(errno));
    if (dl.expired()) return Fd();
  }
}

void send_exact(int fd, const void* buf, size_t n, const Deadline& dl, const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd pf{fd, POLLOUT, 0};
      if (::poll(&pf, 1, dl.remaining_ms(1000)) == 0 && dl.expired()) {
        CX_THROW(TimeoutError, "timed out after ", dl.timeout_ms, " ms sending to ", what);
      }
      continue;
    }
    CX_THROW(ConnectionError, "lost the connection to ", what, " while sending: ",
             k == 0 ? "closed" : std::strerror(errno));
  }
}

void recv_exact(int fd, void* buf, size_t n, const Deadline& dl, const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) CX_THROW(ConnectionError, "connection closed by ", what);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, dl.remaining_ms(1000)) == 0 && dl.expired()) {
        CX_THROW(TimeoutError, "timed out after ", dl.timeout_ms, " ms waiting for ", what);
      }
      continue;
    }
    CX_THROW(ConnectionError, "lost the connection to ", what, ": ", std::strerror(errno));
  }
}

}  // namespace cx::distributed::net
