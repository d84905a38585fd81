// defines: Fd (an owned file descriptor) and the blocking-with-deadline socket
// helpers. Below both the rendezvous store (store/) and the transport (its mesh's
// setup and handshake, the channels' ABORT frames), and knows nothing of either.
#pragma once

#include <netinet/in.h>

#include <functional>
#include <string>
#include <vector>

#include "distributed/types.h"

namespace cx::distributed::net {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Resolves host (a dotted IPv4 address or a name) to an IPv4 address.
sockaddr_in resolve(const std::string& host, int port);
std::string addr_to_string(const sockaddr_in& a);

// Listens on host:port (port 0 = ephemeral). Throws ConnectionError; a port in
// use gets its own message naming `what` (e.g. "MASTER_PORT"): in_use_message.
Fd listen_on(const std::string& host, int port, const char* what);
// The same, but a port in use (EADDRINUSE) returns an invalid Fd, for a caller
// that finds out who holds it (the store: Note [Who holds MASTER_PORT]).
Fd try_listen_on(const std::string& host, int port);
std::string in_use_message(const std::string& host, int port, const char* what);
int bound_port(int fd);
std::string local_ip_of(int fd);  // the address this connected socket uses

// Connects to host:port, retrying refused/unreachable attempts every few ms
// until the deadline. `what` names the thing being reached in errors.
Fd connect_with_retry(const std::string& host, int port, const Deadline& dl, const std::string& what);

// Accepts one connection before the deadline; returns an invalid Fd on timeout.
Fd accept_until(int listen_fd, const Deadline& dl);

// Accepts every connection waiting on the non-blocking `listen_fd` (each
// non-blocking, close-on-exec and tuned), handing each with its ip:port to
// `take`. Out of descriptors it asks `make_room` to close a connection (the
// caller's oldest newcomer: Note [A store strangers cannot stall] in
// store/store.h): true if it did (then it accepts on), false to stop.
void accept_waiting(int listen_fd, const std::function<void(Fd fd, std::string addr)>& take,
                    const std::function<bool()>& make_room);

void set_nonblocking(int fd, bool on);
void tune_socket(int fd);  // TCP_NODELAY, buffers, keepalive, a congestion control CX_TCP_CONGESTION names
// CX_SOCKET_BUFFER_BYTES (0: unset, the kernel's autotuning); throws InvalidArgument
// naming its range for a value outside it.
int socket_buffer_bytes();
// CX_TCP_CONGESTION: "auto" (unset), "system", or a congestion control the kernel lets this process set (which
// tune_socket gives every socket); throws InvalidArgument naming the kernel's choices.
std::string tcp_congestion();
// A connected data socket between two ranks: reno where both are on this host and each rank here has a core,
// unless CX_TCP_CONGESTION says otherwise (Note [Congestion control between ranks on one host] in socket.cpp).
// True where the socket should follow the operations' sizes instead (CongestionBySize): both on this host, more
// ranks than cores, CX_TCP_CONGESTION unset or auto.
bool congestion_between_ranks(int fd, bool core_each);

// The connections to ranks of this host where ranks outnumber cores: reno for operations of kRenoFromBytes and
// more, the machine's congestion control for those of kMachineFromBytes up to that, unchanged for smaller ones
// (Note [Congestion control between ranks on one host]). The sockets must outlive it.
class CongestionBySize {
 public:
  static constexpr size_t kMachineFromBytes = 64u << 10;
  static constexpr size_t kRenoFromBytes = 2u << 20;
  void add(int fd);              // a connected socket, still on the machine's congestion control
  void before(size_t bytes);     // an operation of `bytes` (per rank) begins

 private:
  std::vector<int> fds_;
  std::string machine_;
  bool reno_ = false;
};

// Blocking exact-length I/O bounded by a deadline (socket may be blocking or not).
// Throw TimeoutError / ConnectionError with `what` in the message.
void send_exact(int fd, const void* buf, size_t n, const Deadline& dl, const std::string& what);
void recv_exact(int fd, void* buf, size_t n, const Deadline& dl, const std::string& what);

}  // namespace cx::distributed::net
