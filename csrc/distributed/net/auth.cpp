#include "distributed/net/auth.h"

#include <arpa/inet.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/env.h"
#include "common/error.h"
#include "common/sha256.h"
#include "distributed/net/socket.h"

namespace cx::distributed::net {

namespace {

std::string strip(const std::string& s) {
  size_t i = s.find_first_not_of(" \t\r\n");
  if (i == std::string::npos) return "";
  size_t j = s.find_last_not_of(" \t\r\n");
  return s.substr(i, j - i + 1);
}

constexpr const char* kHowToSet =
    "give every rank of the job the same secret: CX_AUTH_TOKEN=<secret> (e.g. from `python -c \"import secrets; "
    "print(secrets.token_hex(32))\"`), or CX_AUTH_TOKEN_FILE=<a file only you can read>; pycyxwiz.launch and "
    "launch_distributed.sh make one themselves for a single node";

}  // namespace

bool is_loopback(const std::string& host) {
  try {
    sockaddr_in a = resolve(host, 0);
    return (ntohl(a.sin_addr.s_addr) >> 24) == 127;
  } catch (const Error&) {
    return false;  // unresolvable: listening or connecting says so later
  }
}

std::string job_secret(const std::string& master_addr, int rank) {
  const char* mode = env::get("CX_AUTH");
  const std::string m = mode ? mode : "on";
  if (m != "on" && m != "off") {
    CX_THROW(InvalidArgument, "environment variable CX_AUTH='", m,
             "' is not valid: expected on (the default) or off");
  }
  const bool loopback = is_loopback(master_addr);
  if (m == "off") {
    if (!loopback) {
      std::fprintf(stderr,
                   "pycyxwiz: warning: rank %d: CX_AUTH=off: the job on MASTER_ADDR=%s accepts any process that "
                   "can reach it as a rank (no job secret); use this only on a network you trust\n",
                   rank, master_addr.c_str());
      std::fflush(stderr);
    }
    return "";
  }
  const char* token = env::get("CX_AUTH_TOKEN");
  const char* file = env::get("CX_AUTH_TOKEN_FILE");
  if (token && file) {
    CX_THROW(InvalidArgument, "rank ", rank,
             ": both CX_AUTH_TOKEN and CX_AUTH_TOKEN_FILE are set: set only one of them (the same on every rank)");
  }
  if (token) return token;
  if (file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      CX_THROW(InvalidArgument, "rank ", rank, ": cannot read the job secret from CX_AUTH_TOKEN_FILE=", file,
               ": check that the file exists on this machine and this user may read it");
    }
    std::ostringstream s;
    s << in.rdbuf();
    std::string secret = strip(s.str());
    if (secret.empty()) {
      CX_THROW(InvalidArgument, "rank ", rank, ": CX_AUTH_TOKEN_FILE=", file,
               " is empty: write the job's secret into it (the same on every rank)");
    }
    return secret;
  }
  if (!loopback) {
    CX_THROW(InvalidArgument, "rank ", rank, ": MASTER_ADDR=", master_addr,
             " is not a loopback address, and no job secret is set: anyone who can reach it could join this job. ",
             kHowToSet, ". To run without one on a network you trust, set CX_AUTH=off");
  }
  return "";
}

std::string fresh_nonce() { return crypto::random_bytes(kNonceBytes); }

std::string proof(const std::string& secret, const char* role, const std::string& context,
                  const std::string& client_nonce, const std::string& server_nonce) {
  std::string msg = role;
  msg += '\0';
  msg += context;
  msg += '\0';
  msg += client_nonce;
  msg += server_nonce;
  crypto::Digest d = crypto::hmac_sha256(secret, msg);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

bool proof_ok(const std::string& got, const std::string& secret, const char* role, const std::string& context,
              const std::string& client_nonce, const std::string& server_nonce) {
  const std::string want = proof(secret, role, context, client_nonce, server_nonce);
  if (got.size() != want.size()) return false;
  return crypto::constant_time_equal(reinterpret_cast<const uint8_t*>(got.data()),
                                     reinterpret_cast<const uint8_t*>(want.data()), want.size());
}

}  // namespace cx::distributed::net
