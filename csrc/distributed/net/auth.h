// defines: the job secret (where it comes from, when it is required) and the
// challenge-response every connection of a job runs with it, as a client half
// and a server half (Handshake): the store's (store/store.h) and each
// rank-to-rank one (transport/mesh_transport.cpp). Each carries the halves'
// messages in frames of its own; the halves know nothing of sockets.
//
// Note [Job secret]
// Who may join a job and speak in it is decided by one shared secret, never by
// what a peer says about itself. Each side of a connection sends a fresh random
// nonce (32 bytes from the kernel), and each proves it knows the secret with
// HMAC-SHA256(secret, role | context | client nonce | server nonce): the server
// ("acceptor") first, then the client ("connector"). The roles differ, so a
// proof cannot be reflected back; both nonces are fresh, so a recorded handshake
// cannot be replayed; the context names the connection's purpose (the store, or
// a mesh link with its group nonce and both ranks), so a proof for one cannot be
// reused for another. The secret itself never travels. Proofs are compared in
// constant time. Nothing is encrypted: the secret decides who may join and
// speak, not who may listen (README, "Threat model").
//
// Without a secret (none set, or CX_AUTH=off) every proof is computed with an
// empty key: the same frames, proving nothing, as before secrets existed. That
// is allowed only where MASTER_ADDR is a loopback address, or on the user's
// explicit CX_AUTH=off (with a warning).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace cx::distributed::net {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;

// The job's secret for a process whose rank 0 is at master_addr: CX_AUTH_TOKEN,
// or the contents of CX_AUTH_TOKEN_FILE (surrounding whitespace stripped); ""
// for none. Throws InvalidArgument when both or neither is set on a
// non-loopback MASTER_ADDR (saying how to set one), for an unreadable or empty
// file, or for a CX_AUTH other than on/off. CX_AUTH=off returns "" and warns on
// stderr where master_addr is not loopback.
std::string job_secret(const std::string& master_addr, int rank);

bool is_loopback(const std::string& host);

std::string fresh_nonce();  // kNonceBytes random bytes

// HMAC-SHA256(secret, role | context | client_nonce | server_nonce) (Note [Job secret]).
std::string proof(const std::string& secret, const char* role, const std::string& context,
                  const std::string& client_nonce, const std::string& server_nonce);
constexpr const char* kServerRole = "cx-auth-1 acceptor";
constexpr const char* kClientRole = "cx-auth-1 connector";

// Constant-time: does `got` equal proof(...)?
bool proof_ok(const std::string& got, const std::string& secret, const char* role, const std::string& context,
              const std::string& client_nonce, const std::string& server_nonce);

// Note [Job secret]'s challenge-response for one connection, whose purpose
// `context` names. The messages, in order:
//   client -> server: client.nonce()                       (kNonceBytes)
//   server -> client: server.challenge(client nonce)       (kNonceBytes + kProofBytes: its nonce, its proof)
//   client -> server: *client.answer(server's challenge)   (kProofBytes; nullopt: the server failed the proof)
//   server: server.verify(client's answer)                 (false: the client does not know the secret)
struct Handshake {
  class Client {
   public:
    Client(std::string secret, std::string context);
    const std::string& nonce() const { return nonce_; }
    // The client's proof, or nullopt when the server does not know the secret.
    std::optional<std::string> answer(const std::string& challenge) const;

   private:
    std::string secret_, context_, nonce_;
  };
  class Server {
   public:
    Server() = default;
    Server(std::string secret, std::string context);
    bool started() const { return !server_nonce_.empty(); }  // challenge() has been called
    std::string challenge(const std::string& client_nonce);
    bool verify(const std::string& client_proof) const;

   private:
    std::string secret_, context_, client_nonce_, server_nonce_;
  };
};

}  // namespace cx::distributed::net
