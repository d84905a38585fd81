// defines: StoreServer (rank 0's rendezvous key-value store) and StoreClient.
//
// The store lives on MASTER_ADDR:MASTER_PORT for the life of a process group.
// Ranks use it during init() to claim their rank, publish the address of their
// listening socket and read each other's; nothing else goes through it.
//
// Wire format (all little-endian, our own frames; nothing is ever unpickled):
//   request: u32 magic "CXS1" | u8 cmd | u8[3] 0 | u32 key_len | u32 val_len | key | value
//   reply:   u32 magic "CXS1" | u8 status | u8[3] 0 | u32 0     | u32 val_len | value
// key_len <= 1 KiB and val_len <= 1 MiB: a larger announcement closes the
// connection before anything is allocated.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "distributed/net/socket.h"
#include "distributed/types.h"

namespace cx::distributed {

class StoreServer {
 public:
  // Binds MASTER_ADDR:MASTER_PORT (only that interface) and starts serving.
  StoreServer(const std::string& host, int port, int world_size);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

 private:
  struct Client;
  void serve();
  bool handle(Client& c);  // false: drop the client
  void reply(Client& c, uint8_t status, const std::string& value);
  void answer_waiters(const std::string& key);

  int world_size_;
  int port_ = 0;
  net::Fd listen_;
  int wake_[2] = {-1, -1};
  std::thread thread_;

  // Only the serving thread touches these.
  std::map<std::string, std::string> data_;
  std::set<int> claimed_;
  bool closing_ = false;  // a rank has finalized: refuse new members
  std::vector<std::unique_ptr<Client>> clients_;
};

class StoreClient {
 public:
  // Connects (retrying until the deadline) and claims `rank`.
  StoreClient(const std::string& host, int port, int rank, int world_size, const Deadline& dl);

  void set(const std::string& key, const std::string& value, const Deadline& dl);
  // Blocks until the key exists or the deadline passes (then TimeoutError
  // whose message is `waiting_for`).
  std::string get(const std::string& key, const Deadline& dl, const std::string& waiting_for);
  // Tells the store this rank is leaving; the store then admits no new members.
  void done(const Deadline& dl);

  int fd() const { return fd_.get(); }
  std::string local_ip() const;

 private:
  std::string request(uint8_t cmd, const std::string& key, const std::string& value, const Deadline& dl,
                      const std::string& waiting_for);
  std::string host_;
  int port_;
  int rank_;
  net::Fd fd_;
};

}  // namespace cx::distributed
