// defines: StoreServer (rank 0's rendezvous key-value store) and StoreClient.
//
// The store lives on MASTER_ADDR:MASTER_PORT for the life of a process group.
// Ranks use it during init() to claim their rank, publish the address of their
// listening socket and read each other's; afterwards only failures go through it
// (the first cause, and each failing rank's flight record: Note [Flight recorder]
// in process_group.h) and finalize()'s comparison of the ranks' collectives.
//
// Note [Failures reach every rank through the store]
// A rank that cannot start (a WORLD_SIZE other than rank 0's, an error in init)
// or whose store connection ends before it said DONE (it died, in init or later)
// (a process that ends in order says BYE first, so only a crash or a kill counts)
// is a failure of the whole group, and the store records its cause once: every
// GET parked then or later is answered with it (status FAILED), and ranks that
// wait on something else (their listener, for peers to connect) ask with
// check_failed() between slices of their wait. So every rank fails within
// milliseconds, naming the rank and the cause, instead of waiting the deadline.
//
// Wire format (all little-endian, our own frames; nothing is ever unpickled):
//   request: u32 magic "CXS1" | u8 cmd | u8[3] 0 | u32 key_len | u32 val_len | key | value
//   reply:   u32 magic "CXS1" | u8 status | u8[3] 0 | u32 0     | u32 val_len | value
// key_len <= 1 KiB and val_len <= 1 MiB: a larger announcement closes the
// connection before anything is allocated.
//
// Commands: AUTH1 (client nonce) -> server nonce | server proof; AUTH2 (client
// proof); HELLO (rank, WORLD_SIZE) claims a rank; SET, GET (parked until the key
// exists), DONE; PROBE (Note [Who holds MASTER_PORT]). A connection starts with
// AUTH1, AUTH2 then HELLO (Note [Job secret] in net/auth.h; without a secret the
// proofs use an empty key and prove nothing); SET, GET and DONE are for members
// (a claimed rank) only.
//
// Note [A store strangers cannot stall]
// Rank 0's store answers on a port anyone on the network may reach, from one
// thread that serves every rank's setup, so nobody may hold that thread or its
// memory:
//  - Before it has proved the secret a connection may send at most
//    kMaxPreAuthFrames small frames (AUTH1, AUTH2, PROBE, HELLO; kMaxPreAuthValue
//    bytes each); anything else, or more, cuts it off. One that is not a member
//    within kJoinMs is cut off too, and beyond kMaxPending such connections the
//    oldest is cut to make room, so idle strangers cannot fill the store (its
//    members are never cut for that).
//  - Replies are queued and written as the socket takes them; a client that
//    lets kMaxQueuedReply bytes pile up is no longer read until it reads, and one
//    whose queue does not move for kWriteMs, or that leaves a frame half sent for
//    kReadMs, is cut off.
//  - Each member may store kMaxBytesPerRank bytes, all of them kMaxBytesTotal
//    (counting every queued byte); a SET beyond either is refused with a message
//    that says so (the connection stays).
// A connection cut for misbehaving is logged to rank 0's stderr, once per address.
//
// Note [Failed handshakes are told to the waiting ranks]
// A connection that fails the job secret's handshake (a rank given another
// secret, or a stranger) is cut off and logged on rank 0's stderr, and every
// other rank that is waiting on the store hears of it at once: a GET parked then
// is sent a WARNING frame ahead of its answer (the GET stays parked), and a rank
// that waits on its listener gets it with its next check_failed(). The rank
// prints "pycyxwiz: warning: rank R: a connection from ADDR failed
// authentication: wrong secret? ..." and goes on waiting: a warning ends nothing, so
// a stranger cannot end the job with it. Once per address (as the log), at most
// kMaxWarnings in all; a rank that joins later hears of the earlier ones at its
// first wait.
//
// Note [Who holds MASTER_PORT]: when rank 0 cannot bind MASTER_PORT, the process
// holding it is either a foreign program or a pycyxwiz store: most often that of
// another process started with RANK=0 in the same job. Only a store speaks our
// frames, so rank 0 connects and sends one PROBE with its WORLD_SIZE (read-only:
// it claims nothing, and the store's ranks see nothing of it) and waits a bounded
// time (kProbeMs) for the answer: WORLD_SIZE, how many ranks joined, whether the
// group is closing. A store with our WORLD_SIZE is taken for this job's ("RANK=0 is
// already taken"), another WORLD_SIZE for another job's; no answer, a garbled one
// or a closed connection (a program that is not ours, or a pycyxwiz older than
// PROBE) keeps the plain "already in use by another process". The store counts
// the probes with its WORLD_SIZE, and when its rank 0 times out waiting for ranks
// that never came, it says a second RANK=0 was turned away (ProcessGroup's
// constructor).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "distributed/net/socket.h"
#include "common/error.h"
#include "distributed/store/store_interface.h"
#include "distributed/types.h"

namespace cx::distributed {

class StoreServer {
 public:
  // Binds MASTER_ADDR:MASTER_PORT (only that interface) and starts serving.
  // Connections must prove `secret` (Note [Job secret]; "" proves nothing).
  // Admits ranks of `generation` only (Config::generation, RESTART_COUNT).
  StoreServer(const std::string& host, int port, int world_size, const std::string& secret, int generation = 0);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  // How many processes with this WORLD_SIZE that could not bind MASTER_PORT asked
  // this store who holds it (Note [Who holds MASTER_PORT]): second RANK=0s.
  int turned_away() const { return turned_away_.load(); }
  // How many connections failed the job secret's handshake (Note [Job secret]).
  int auth_failures() const { return auth_failures_.load(); }
  // Waits until no rank but 0 is connected, or `ms` passes: a rank 0 that fails
  // in init() lets the others read the failure before its store goes.
  void linger(int ms) const;

 private:
  struct Client;
  struct Frame;
  enum class Parse { kMore, kFrame, kDrop };
  void serve();
  void accept_all();
  bool handle(Client& c);  // false: drop the client
  // The next whole frame of `c` (kMore: not in yet); kDrop: `c` was cut off for
  // its announcement (Note [A store strangers cannot stall]).
  Parse next_frame(Client& c, Frame& f);
  bool admit(Client& c, uint8_t cmd);  // what a connection may ask before it is a member
  bool dispatch(Client& c, Frame& f);  // one handler per command; false: drop the client
  bool on_auth1(Client& c, const Frame& f);
  bool on_auth2(Client& c, const Frame& f);
  bool on_hello(Client& c, const Frame& f);
  bool on_set(Client& c, Frame& f);
  bool on_get(Client& c, const Frame& f);
  bool on_try_get(Client& c, const Frame& f);
  bool on_probe(Client& c, const Frame& f);
  void auth_failed(Client& c, const std::string& why);  // counts, logs and cuts it; warns the waiting ranks
  void warn(Client& c);  // the warnings `c` has not had yet, ahead of its next reply
  void reply(Client& c, uint8_t status, const std::string& value);
  void flush(Client& c);
  void answer_waiters(const std::string& key);
  void cut(Client& c, const std::string& why);  // drop a misbehaving client, logging its address once
  void enforce_deadlines();
  size_t bytes_in_use() const;
  // Note [Failures reach every rank through the store]: records `why` (the
  // first cause only) and answers every parked and later GET with it.
  void fail(ErrorKind kind, const std::string& why);

  int world_size_;
  int generation_;
  std::string secret_;
  std::string where_;  // host:port, for the log
  int port_ = 0;
  std::atomic<int> turned_away_{0};
  std::atomic<int> auth_failures_{0};
  std::atomic<int> others_{0};  // connected clients that claimed a rank other than 0
  net::Fd listen_;
  int wake_[2] = {-1, -1};
  std::thread thread_;

  // Only the serving thread touches these.
  std::map<std::string, std::pair<int, std::string>> data_;  // key -> (rank that set it, value)
  std::map<int, size_t> stored_by_rank_;
  size_t stored_ = 0;
  std::set<std::string> logged_;  // addresses already logged by cut()
  std::vector<std::string> warnings_;  // Note [Failed handshakes are told to the waiting ranks]
  std::set<int> claimed_;
  bool closing_ = false;  // a rank has finalized: refuse new members
  std::string failure_;   // u8 ErrorKind + why, once the group has failed
  std::vector<std::unique_ptr<Client>> clients_;
};

// What a store answering on host:port says of itself (Note [Who holds MASTER_PORT]).
struct StoreInfo {
  int world_size = 0;
  int joined = 0;        // ranks that have claimed their rank
  bool closing = false;  // a rank has finalized: the group is ending
};
// Asks host:port for its StoreInfo within `dl`, saying this process's WORLD_SIZE;
// nullopt when what answers is not a pycyxwiz store (or nothing answers in time).
// Never throws.
std::optional<StoreInfo> probe_store(const std::string& host, int port, int world_size, const Deadline& dl);

class StoreClient : public Store {
 public:
  // Connects (retrying until the deadline), proves `secret` (Note [Job secret])
  // and claims `rank` of `generation`.
  StoreClient(const std::string& host, int port, int rank, int world_size, const std::string& secret,
              const Deadline& dl, int generation = 0);
  // Says BYE: the store then takes this rank's end of stream for an orderly exit,
  // not a crash (Note [Failures reach every rank through the store]).
  ~StoreClient() override;
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  // Store (store_interface.h); failures as Note [Failures reach every rank
  // through the store] says; done() makes the store admit no new members.
  void set(const std::string& key, const std::string& value, const Deadline& dl) override;
  std::string get(const std::string& key, const Deadline& dl, const std::string& waiting_for) override;
  std::optional<std::string> try_get(const std::string& key, const Deadline& dl) override;
  void fail(ErrorKind kind, const std::string& why, const Deadline& dl) override;
  void check_failed(const Deadline& dl) override;
  void done(const Deadline& dl) override;
  std::string local_ip() const override;

  int fd() const { return fd_.get(); }

 private:
  std::string request(uint8_t cmd, const std::string& key, const std::string& value, const Deadline& dl,
                      const std::string& waiting_for);
  std::string host_;
  int port_;
  int rank_;
  net::Fd fd_;
  std::mutex mu_;         // one request at a time (the group's thread and the caller's)
  bool missing_ = false;  // the last reply said kMissing
};

}  // namespace cx::distributed
