// defines: the frame every message travels in, on a socket or through a
// shared-memory ring alike, and the functions that write and read its header.
//
// Frame (40 bytes header, then payload; fields in the host's byte order):
//   u32 magic "CXF1" | u8 type | u8 kind | u8 dtype | u8 op | i32 root |
//   u32 abort_kind (ABORT), or call site (DATA, REMOTE; send/recv: its tag) | u64 count | u64 seq | u64 payload_len
// A receive posted for N bytes accepts only a DATA frame of exactly N bytes
// whose descriptor equals ours; an ABORT frame carries a peer's error message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.h"
#include "distributed/transport/transport.h"

namespace cx::distributed::frame {

constexpr size_t kHeaderBytes = 40;
constexpr uint32_t kMagic = 0x31465843;  // "CXF1"
constexpr uint8_t kData = 1;
constexpr uint8_t kAbort = 2;
// Shared memory only: a DATA header, then the sender's buffer address (Note [Single-copy large messages]).
constexpr uint8_t kRemote = 3;
constexpr uint64_t kMaxAbortMessage = 64 * 1024;  // longer ABORT payloads are not read
constexpr size_t kMaxAbortText = 2048;             // what of it is shown to the user

// Note [ABORT frames are data]
// An ABORT frame is a peer's report, not an order: its kind must be one of the
// closed list of ErrorKind values (anything else is read as kGeneric), and its
// text is the peer's words, shown as such ("rank 1 reports: ...") after the
// rank we know we are talking to, cut to kMaxAbortText bytes, with control
// characters and invalid UTF-8 replaced, so a peer can neither forge who failed
// nor write escape sequences to our terminal or megabytes into our logs.

// A field of type T at byte offset `off` of an unaligned buffer.
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

// Writes the header of a frame of `type` belonging to `desc` into h[0, kHeaderBytes);
// `abort_kind` is an ErrorKind for an ABORT frame, 0 for DATA.
void fill(char* h, uint8_t type, const OpDesc& desc, uint64_t payload_len, uint32_t abort_kind);

inline bool has_magic(const char* h) { return get<uint32_t>(h, 0) == kMagic; }
inline uint8_t type(const char* h) { return static_cast<uint8_t>(h[4]); }
inline ErrorKind abort_kind(const char* h) { return static_cast<ErrorKind>(get<uint32_t>(h, 12)); }
inline uint64_t payload_len(const char* h) { return get<uint64_t>(h, 32); }
OpDesc desc(const char* h);

// Raises the error a peer's ABORT frame (header `h`, payload `text`, empty if it
// could not be read) stands for, as rank `me` sees it during `during`.
[[noreturn]] void raise_abort(const char* h, const std::string& text, int me, int peer, const OpDesc& during);

}  // namespace cx::distributed::frame
