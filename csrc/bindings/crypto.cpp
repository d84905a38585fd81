// Bindings of common/sha256.h, for tests/test_auth.py's known-answer vectors only.
#include "bindings/bindings.h"
#include "common/sha256.h"

namespace cx::bindings {

namespace {
py::bytes to_bytes(const crypto::Digest& d) { return py::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }
}  // namespace

void bind_crypto(py::module_& m) {
  m.def(
      "_sha256", [](const py::bytes& msg) { return to_bytes(crypto::sha256(std::string(msg))); }, py::arg("msg"),
      "For tests: SHA-256 of msg, as the job secret's handshake computes it.");
  m.def(
      "_hmac_sha256",
      [](const py::bytes& key, const py::bytes& msg) {
        return to_bytes(crypto::hmac_sha256(std::string(key), std::string(msg)));
      },
      py::arg("key"), py::arg("msg"), "For tests: HMAC-SHA256(key, msg), as the job secret's handshake computes it.");
}

}  // namespace cx::bindings
