// defines: SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104), a constant-time compare
// and random bytes from the kernel: what the job secret's challenge-response
// (distributed/net/auth.h) is built from, and nothing more.
//
// Written from the specifications rather than taken from OpenSSL so that a wheel
// depends on no libcrypto; tests/test_auth.py checks it against the FIPS 180-2
// examples and the RFC 4231 HMAC test vectors through _core._sha256/_hmac_sha256.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace cx::crypto {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_n_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const std::string& msg);
Digest hmac_sha256(const std::string& key, const std::string& msg);

// Equal contents, in time that depends only on the length (never on where they differ).
bool constant_time_equal(const uint8_t* a, const uint8_t* b, size_t n);

// n bytes from the kernel's CSPRNG (getrandom, else /dev/urandom); throws Error if neither works.
std::string random_bytes(size_t n);

}  // namespace cx::crypto
