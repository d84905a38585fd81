#include "distributed/net/auth.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

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

constexpr size_t kMaxSecretFileBytes = 4096;

// The secret file's bytes. A regular file only, of at most 4 KiB, opened
// without blocking: a FIFO would block init forever, /dev/zero would be read
// until memory runs out, and a directory reads as empty.
std::string read_secret_file(const char* file, int rank) {
  const std::string where = "rank " + std::to_string(rank) + ": CX_AUTH_TOKEN_FILE=" + file;
  int fd = ::open(file, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    CX_THROW(InvalidArgument, where, ": cannot open it (", std::strerror(errno),
             "): check that the file exists on this machine and this user may read it");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) CX_THROW(InvalidArgument, where, ": cannot stat it (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    CX_THROW(InvalidArgument, where, " is ", kind, ": it must name a regular file holding the job's secret");
  }
  if (static_cast<size_t>(st.st_size) > kMaxSecretFileBytes) {
    CX_THROW(InvalidArgument, where, " is ", st.st_size, " bytes: a secret file holds at most ", kMaxSecretFileBytes,
             " bytes (is it the right file?)");
  }
  if (st.st_mode & (S_IRGRP | S_IROTH)) {
    std::fprintf(stderr,
                 "pycyxwiz: warning: %s can be read by other users (mode %03o): anyone who reads it can join the "
                 "job; run chmod 600 %s\n",
                 where.c_str(), static_cast<unsigned>(st.st_mode & 0777), file);
    std::fflush(stderr);
  }
  std::string out(kMaxSecretFileBytes + 1, '\0');
  size_t got = 0;
  while (got < out.size()) {
    ssize_t r = ::read(fd, &out[got], out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) CX_THROW(InvalidArgument, where, ": cannot read it (", std::strerror(errno), ")");
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  if (got > kMaxSecretFileBytes) {
    CX_THROW(InvalidArgument, where, " grew beyond ", kMaxSecretFileBytes, " bytes while it was read");
  }
  out.resize(got);
  return out;
}

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
  if (token) {
    std::string secret = strip(token);
    if (secret.empty()) {
      CX_THROW(InvalidArgument, "rank ", rank, ": CX_AUTH_TOKEN is only whitespace: set it to the job's secret (the "
               "same on every rank), e.g. from `python -c \"import secrets; print(secrets.token_hex(32))\"`");
    }
    return secret;
  }
  if (file) {
    std::string secret = strip(read_secret_file(file, rank));
    if (secret.empty()) {
      CX_THROW(InvalidArgument, "rank ", rank, ": CX_AUTH_TOKEN_FILE=", file,
               " is empty or only whitespace: write the job's secret into it (the same on every rank)");
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

Handshake::Client::Client(std::string secret, std::string context)
    : secret_(std::move(secret)), context_(std::move(context)), nonce_(fresh_nonce()) {}

std::optional<std::string> Handshake::Client::answer(const std::string& challenge) const {
  if (challenge.size() != kNonceBytes + kProofBytes) return std::nullopt;
  const std::string server_nonce = challenge.substr(0, kNonceBytes);
  if (!proof_ok(challenge.substr(kNonceBytes), secret_, kServerRole, context_, nonce_, server_nonce)) {
    return std::nullopt;
  }
  return proof(secret_, kClientRole, context_, nonce_, server_nonce);
}

Handshake::Server::Server(std::string secret, std::string context)
    : secret_(std::move(secret)), context_(std::move(context)) {}

std::string Handshake::Server::challenge(const std::string& client_nonce) {
  client_nonce_ = client_nonce;
  server_nonce_ = fresh_nonce();
  return server_nonce_ + proof(secret_, kServerRole, context_, client_nonce_, server_nonce_);
}

bool Handshake::Server::verify(const std::string& client_proof) const {
  return started() && proof_ok(client_proof, secret_, kClientRole, context_, client_nonce_, server_nonce_);
}

}  // namespace cx::distributed::net
