// defines: cx::Error and its kinds, CX_CHECK / CX_THROW helpers.
//
// One small hierarchy, mapped to Python exceptions in one place
// (bindings/errors.cpp):
//   Error            -> cx.distributed.DistributedError (a RuntimeError)
//   TimeoutError     -> DistributedTimeoutError (also a TimeoutError)
//   ConnectionError  -> DistributedConnectionError (also a ConnectionError)
//   MismatchError    -> CollectiveMismatchError (also a ValueError)
//   InvalidArgument  -> ValueError
//   TypeMismatch     -> TypeError
//   IoError          -> OSError (files: model and checkpoint I/O)
//   PeerFailed       -> DistributedConnectionError (a peer's program failed and said why)
// Messages say what happened, on which rank, with which peer and operation,
// and what to do about it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace cx {

enum class ErrorKind : int {
  kGeneric = 1,
  kTimeout = 2,
  kConnection = 3,
  kMismatch = 4,
  kInvalidArgument = 5,
  kType = 6,
  kIo = 7,
  // Not a library error: the program on a rank failed (an exception escaped its
  // script, fit or a collective) and aborted the group saying why; its peers
  // raise PeerFailed naming that rank.
  kPeerFailed = 8,
  // A gradient or activation went NaN/inf (DDPConfig.nonfinite = "raise", anomaly
  // mode): cx.distributed.NonFiniteError, a FloatingPointError.
  kNonFinite = 9,
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, ErrorKind kind = ErrorKind::kGeneric)
      : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

struct TimeoutError : Error {
  explicit TimeoutError(const std::string& m) : Error(m, ErrorKind::kTimeout) {}
};
struct ConnectionError : Error {
  explicit ConnectionError(const std::string& m) : Error(m, ErrorKind::kConnection) {}
};
struct MismatchError : Error {
  explicit MismatchError(const std::string& m) : Error(m, ErrorKind::kMismatch) {}
};
struct InvalidArgument : Error {
  explicit InvalidArgument(const std::string& m) : Error(m, ErrorKind::kInvalidArgument) {}
};
struct TypeMismatch : Error {
  explicit TypeMismatch(const std::string& m) : Error(m, ErrorKind::kType) {}
};
struct IoError : Error {
  explicit IoError(const std::string& m) : Error(m, ErrorKind::kIo) {}
};
struct PeerFailed : Error {
  explicit PeerFailed(const std::string& m) : Error(m, ErrorKind::kPeerFailed) {}
};
struct NonFiniteError : Error {
  explicit NonFiniteError(const std::string& m) : Error(m, ErrorKind::kNonFinite) {}
};

// Rebuilds an error of the right kind from (kind, message): used when an error
// travels between ranks (abort frames) or threads (work handles).
[[noreturn]] void rethrow_as(ErrorKind kind, const std::string& msg);

// Text another process sent us (a peer's ABORT, the store's record of a failure),
// made safe to show: valid UTF-8 without control characters (each replaced by a
// space, or '?' for a byte that is not UTF-8), at most `max_bytes` bytes, with a
// note of how much was cut.
std::string printable(const std::string& text, size_t max_bytes);

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace cx

// CX_THROW(InvalidArgument, "count ", n, " is negative")
#define CX_THROW(Kind, ...) throw ::cx::Kind(::cx::detail::concat(__VA_ARGS__))
#define CX_CHECK(cond, Kind, ...) \
  do {                            \
    if (!(cond)) CX_THROW(Kind, __VA_ARGS__); \
  } while (0)
