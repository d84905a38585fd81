#include "common/error.h"

namespace cx {

void rethrow_as(ErrorKind kind, const std::string& msg) {
  switch (kind) {
    case ErrorKind::kTimeout: throw TimeoutError(msg);
    case ErrorKind::kConnection: throw ConnectionError(msg);
    case ErrorKind::kMismatch: throw MismatchError(msg);
    case ErrorKind::kInvalidArgument: throw InvalidArgument(msg);
    case ErrorKind::kType: throw TypeMismatch(msg);
    case ErrorKind::kIo: throw IoError(msg);
    default: throw Error(msg);
  }
}

}  // namespace cx
