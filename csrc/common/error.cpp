#include "common/error.h"

#include <algorithm>
#include <cstdint>

namespace cx {

std::string printable(const std::string& text, size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  size_t i = 0;
  const size_t n = text.size();
  while (i < n && out.size() < max_bytes) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      out += (c < 0x20 || c == 0x7f) ? ' ' : static_cast<char>(c);
      ++i;
      continue;
    }
    // A multi-byte UTF-8 sequence: copied whole if valid and not a C1 control.
    size_t len = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c <= 0xdf ? 2 : 0;
    if (c >= 0xf5) len = 0;
    bool ok = len > 0 && i + len <= n;
    uint32_t cp = ok ? (c & (0xff >> (len + 1))) : 0;
    for (size_t k = 1; ok && k < len; ++k) {
      const auto d = static_cast<unsigned char>(text[i + k]);
      ok = (d & 0xc0) == 0x80;
      cp = (cp << 6) | (d & 0x3f);
    }
    ok = ok && !(len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) && !(len == 4 && (cp < 0x10000 || cp > 0x10ffff));
    if (ok && cp >= 0x80 && cp <= 0x9f) ok = false;
    if (!ok) {
      out += '?';
      ++i;
      continue;
    }
    if (out.size() + len > max_bytes) break;
    out.append(text, i, len);
    i += len;
  }
  if (i < n) out += detail::concat(" ... (", n - i, " more bytes not shown)");
  return out;
}

void rethrow_as(ErrorKind kind, const std::string& msg) {
  switch (kind) {
    case ErrorKind::kTimeout: throw TimeoutError(msg);
    case ErrorKind::kConnection: throw ConnectionError(msg);
    case ErrorKind::kPeerFailed: throw PeerFailed(msg);
    case ErrorKind::kMismatch: throw MismatchError(msg);
    case ErrorKind::kInvalidArgument: throw InvalidArgument(msg);
    case ErrorKind::kType: throw TypeMismatch(msg);
    case ErrorKind::kIo: throw IoError(msg);
    case ErrorKind::kNonFinite: throw NonFiniteError(msg);
    default: throw Error(msg);
  }
}

}  // namespace cx
