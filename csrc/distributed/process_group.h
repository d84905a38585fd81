// defines: ProcessGroup (one per init(): the collectives API) and Work (the
// handle an async collective returns).
//
// Execution model. Collectives run in submission order. An async collective is
// queued for the group's one communication thread; a blocking one first waits
// for that queue to drain and then runs on the calling thread (no thread
// hand-off on the latency path). Either way only one collective touches the
// backend at a time (exec_mu_).
//
// Failure model. The first failure, timeout or mismatch in a collective poisons the
// group: peers are told (Backend::abort), queued work fails with that error,
// and every later call raises it again. finalize() and a new init() start over.
//
// Backends. Each collective is checked here (roots, block counts, reducible
// dtypes), then handed to the group's Backend (backend/backend.h) once: the CPU
// backend runs the algorithms of algorithms/ over a Transport, the NCCL backend
// NCCL's own collectives on device pointers, ordered after `stream`, the
// caller's CUDA stream (ignored by the CPU backend). The queue, deadlines,
// poisoning and shutdown above are the group's, whatever the backend.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "distributed/backend/backend.h"
#include "distributed/config.h"

namespace cx::distributed {

class StoreServer;
class StoreClient;

class Work {
 public:
  bool is_completed();
  // Waits up to timeout_ms (< 0: until done; the collective itself has a
  // deadline, so this ends). Rethrows the collective's error. Returns false if
  // the timeout passed first.
  bool wait(int64_t timeout_ms = -1);

 private:
  friend class ProcessGroup;
  void finish(std::optional<std::pair<ErrorKind, std::string>> err);

  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::optional<std::pair<ErrorKind, std::string>> error_;
  OpDesc desc_;
  Backend::Body body_;
};

class ProcessGroup {
 public:
  // Rendezvous through rank 0's store, connect the mesh, and meet in a barrier.
  explicit ProcessGroup(const Config& cfg);
  ~ProcessGroup();

  int rank() const { return cfg_.rank; }
  int size() const { return cfg_.world_size; }
  const Config& config() const { return cfg_; }
  bool poisoned();
  // Payload bytes this rank has handed to its transport (Backend::bytes_sent).
  uint64_t bytes_sent() const { return backend_ ? backend_->bytes_sent() : 0; }

  using WorkPtr = std::shared_ptr<Work>;
  // Each returns a Work that is complete for blocking calls. Counts are elements
  // per rank's block; buffers follow the algorithms' conventions (algorithms.h).
  WorkPtr all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, bool async, uintptr_t stream = 0);
  WorkPtr broadcast(void* buf, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, bool async, uintptr_t stream = 0);
  WorkPtr reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op, bool async, uintptr_t stream = 0);
  WorkPtr reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, bool async, uintptr_t stream = 0);
  WorkPtr scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count, DataType dt, bool async, uintptr_t stream = 0);
  WorkPtr barrier(bool async);
  WorkPtr send(const void* buf, size_t count, DataType dt, int dst, bool async, uintptr_t stream = 0);
  WorkPtr recv(void* buf, size_t count, DataType dt, int src, bool async, uintptr_t stream = 0);

  // Waits for queued work, then closes every connection gracefully (peers see
  // end-of-stream, never a reset). Idempotent; also run by the destructor.
  void shutdown();

 private:
  WorkPtr submit(OpDesc desc, Backend::Body body, bool async);
  Backend& backend();  // throws once the group has been finalized
  void execute(Work& w);
  void comm_loop();
  void check_root(int root, const char* what) const;
  void check_peer(int peer, const char* what) const;
  [[noreturn]] void rethrow_poison();

  Config cfg_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<Backend> backend_;

  uint64_t seq_ = 0;                   // collectives submitted
  std::vector<uint64_t> sent_, recvd_;  // point-to-point messages per peer

  std::mutex exec_mu_;  // held while a collective runs on the backend
  std::mutex mu_;       // guards everything below
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool busy_ = false;  // the comm thread is running a work item
  bool stop_ = false;
  std::thread comm_;
  std::optional<std::pair<ErrorKind, std::string>> poison_;
  std::atomic<bool> shut_{false};  // written under mu_; read without it by backend()
};

}  // namespace cx::distributed
