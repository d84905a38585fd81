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
//
// Note [Collective fingerprint]
// Every rank folds the descriptor of each collective it submits (kind, root,
// count, dtype, op, number) into a running 64-bit hash: O(1) per call, no
// message. barrier() carries it in the signals it sends anyway (algo::barrier
// compares), CX_CHECK_INTERVAL adds such a check every N collectives, and
// finalize() compares every rank's through the store, together with how many
// point-to-point messages each rank sent to and received from each other (an
// unmatched send is an error on both sides). A difference is a MismatchError
// naming the first call that differs on each rank, found in the ranks' flight
// records; only a divergence older than the last kFlightEntries calls is named
// by its number alone.
//
// Note [Flight recorder]
// The last kFlightEntries operations of this rank (descriptor, submit, start and
// end time, state) are kept in a ring. When a collective fails by a timeout, a
// mismatch or a lost peer, the rank publishes its ring in the store, tells its
// peers (ABORT), and waits briefly (kGatherMs) for theirs; its error then says
// what each rank was last doing, and a timeout whose cause is that the ranks
// called different collectives (reduce with a different dst on each rank) is
// raised as the mismatch it is. A dead rank, or a rank 0 whose store is gone,
// leaves "no record"; the local record is always there.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "distributed/backend/backend.h"
#include "distributed/config.h"
#include "distributed/flight_record.h"

namespace cx::distributed {

class StoreServer;
class Store;

class ProcessGroup;

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
  bool done();

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};  // set under mu_ (for cv_); read without it by done()
  std::optional<std::pair<ErrorKind, std::string>> error_;
  OpDesc desc_;
  Backend::Body body_;
  uint64_t op_ = 0;  // number among all operations of the group (its flight-record slot)
  // A launched collective (Note [Collectives that are launches]): its Poll, and
  // the group whose waiter runs it, until it is done. The group completes every
  // one of these before it closes, so group_ outlives its use.
  Backend::Poll poll_;
  ProcessGroup* group_ = nullptr;
  std::mutex poll_mu_;  // one thread polls at a time
  // An async operation queued for the communication thread: the group, whose waiter may run it (Note [A waiter
  // runs what it waits for] in process_group.cpp). Weak: a Work may outlive its group.
  std::weak_ptr<ProcessGroup> queued_in_;
  // A small async receive: the comm thread leaves it to its waiter until then (Note [A waiter runs what it waits
  // for]); the epoch (never) for everything else.
  std::chrono::steady_clock::time_point lazy_until_{};
  // A send's or a receive's buffer (Note [Sends before receives] in process_group.cpp); null for the rest.
  const char* buf_ = nullptr;
  size_t bytes_ = 0;
};

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  // Rendezvous through rank 0's store, connect the mesh, and meet in a barrier.
  explicit ProcessGroup(const Config& cfg);
  // The same through a store that lives elsewhere (Note [Rendezvous through a
  // framework's store] in store/external_store.h): cfg's master_addr and
  // master_port are not used; `secret` proves the mesh's handshakes (Note [Job
  // secret]). Several such groups may live in one process, each with its own
  // connections, as long as each has its own key space in the store.
  ProcessGroup(const Config& cfg, std::unique_ptr<Store> store, const std::string& secret);
  ~ProcessGroup();

  int rank() const { return cfg_.rank; }
  int size() const { return cfg_.world_size; }
  const Config& config() const { return cfg_; }
  bool poisoned();
  // This process is a child made by fork() after the group was created: the
  // connections, shared memory and threads are its parent's, and using (or
  // closing) them would corrupt the parent's job. Every collective raises.
  bool inherited() const;
  // Payload bytes this rank has handed to its transport (Backend::bytes_sent).
  uint64_t bytes_sent() const { return backend_ ? backend_->bytes_sent() : 0; }

  using WorkPtr = std::shared_ptr<Work>;
  // Each returns a Work that is complete for blocking calls. Counts are elements
  // per rank's block; buffers follow the algorithms' conventions (algorithms.h).
  WorkPtr all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, bool async, uintptr_t stream = 0);
  // Float32 `buf` all-reduced as float16 / bfloat16 (Backend::all_reduce_cast):
  // the communication hooks' collective. Its peers see an all_reduce of count
  // wire_dt elements (SUM), which is what travels. `probe` (may be null; must
  // outlive the work): the casts test for non-finite values (Note [Fused
  // non-finite check] in reduce_probe.h, Note [Cast on the wire] in allreduce.cpp).
  WorkPtr all_reduce_cast(float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale, bool async,
                          ReduceProbe* probe = nullptr);
  // A float32 SUM/AVG all_reduce that also tests for inf/NaN into `probe`
  // (Note [Fused non-finite check] in reduce_probe.h: DDP's gradient check).
  // Its peers see an all_reduce; `probe` must outlive the work.
  WorkPtr all_reduce_probed(float* buf, size_t count, ReduceOp op, ReduceProbe& probe, bool async);
  WorkPtr broadcast(void* buf, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, bool async, uintptr_t stream = 0);
  WorkPtr reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op, bool async, uintptr_t stream = 0);
  // A float32 SUM/AVG reduce_scatter that also tests for inf/NaN into `probe`
  // (ZeRO-1's gradient check): ins[i]'s element j is recorded at base + i * stride + j,
  // and probe.result_bad says whether our block of the result is finite. Its peers
  // see a reduce_scatter; `probe` must outlive the work.
  WorkPtr reduce_scatter_probed(std::vector<const float*> ins, float* out, size_t count, ReduceOp op,
                                ReduceProbe& probe, size_t base, size_t stride, bool async);
  WorkPtr reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, bool async, uintptr_t stream = 0);
  WorkPtr scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root, bool async, uintptr_t stream = 0);
  WorkPtr all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count, DataType dt, bool async, uintptr_t stream = 0);
  WorkPtr barrier(bool async);
  // `tag`: torch's; a recv takes its sender's first message of that tag (Note [Messages out of order] in
  // transport/channel.cpp).
  WorkPtr send(const void* buf, size_t count, DataType dt, int dst, bool async, uintptr_t stream = 0,
               uint32_t tag = 0);
  WorkPtr recv(void* buf, size_t count, DataType dt, int src, bool async, uintptr_t stream = 0, uint32_t tag = 0);
  // From whichever rank sends first (Note [Receiving from any source] in mesh_transport.cpp); `*source` gets its
  // rank once the receive is done. A recv naming a source is refused while one of these is pending.
  WorkPtr recv_any(void* buf, size_t count, DataType dt, bool async, uint32_t tag, std::shared_ptr<int> source);

  // How much finalize() checks (Note [Collective fingerprint]). kFull: wait (up
  // to the operation deadline, like a barrier) for every rank's record and
  // compare. kAtExit: an interpreter that exits without finalize() may be
  // leaving because of an error its peers do not know of, so it waits at most
  // kAtExitWaitMs for their records and compares those that came. kNone: the
  // destructor's.
  enum class Check { kNone, kAtExit, kFull };
  static constexpr int kAtExitWaitMs = 1000;

  // Waits for queued work, compares the ranks' collectives (raises
  // MismatchError, or the error of a rank that failed), then closes every
  // connection gracefully (peers see end-of-stream, never a reset).
  // Idempotent; also run by the destructor, which checks nothing.
  void shutdown(Check check = Check::kFull);

  // The program on this rank failed (`why`: "ValueError: ..."): poisons the
  // group and tells every peer, through the transport (ABORT) and the store, so
  // they raise "rank R failed: ValueError: ..." at once. No-op if the group has
  // failed already (its peers have been told).
  void abort(const std::string& why);

  // Every rank arrives or the ones that did not are named (rank 0 collects the
  // arrivals through the store): TimeoutError "rank(s) 2, 3 did not arrive".
  void monitored_barrier(int64_t timeout_ms);

  // This rank's flight record (Note [Flight recorder]), and a readable summary.
  FlightRecord flight_record();
  std::string describe_setup() const;

  static constexpr size_t kFlightEntries = 64;
  // Async sends up to this size leave on the caller's thread when the group is idle, and async receives up to it
  // are left to their waiters (Notes [Small sends that leave at once], [A waiter runs what it waits for] in
  // process_group.cpp). Shared memory never copies a send/recv straight out of the sender's buffer (shm/shm.h).
  static constexpr size_t kSendAtOnceBytes = 64 * 1024;
  // How long the comm thread leaves a small async receive to its waiter, and a small message that a waiter left at
  // the front to the next; while waiters keep taking them it looks at most every kMostPatience (Note [A waiter runs
  // what it waits for]).
  static constexpr std::chrono::microseconds kLeftToWaiter{50};
  static constexpr std::chrono::microseconds kMostPatience{400};

 private:
  void refuse_if_inherited() const;
  // InvalidArgument unless reduce_scatter got one input block per rank.
  void check_input_blocks(size_t blocks) const;
  uint64_t fork_generation_;  // current_fork_generation() at construction
  int creator_pid_;
  // Both constructors: start the backend through store_, or name why not.
  void connect(const std::string& secret, const Deadline& dl);
  void check_reduction(DataType dt, ReduceOp op) const;  // check_reducible, and what the backend cannot reduce
  WorkPtr submit(OpDesc desc, Backend::Body body, bool async, const void* buf = nullptr, size_t bytes = 0);
  // A barrier (or, for CX_CHECK_INTERVAL, a check) carrying the fingerprint.
  WorkPtr submit_barrier(CollectiveKind kind, bool async);
  WorkPtr enqueue(std::shared_ptr<Work> w, bool async, std::unique_lock<std::mutex>& lk);
  // Note [Collectives that are launches]: runs w's body now, on this thread;
  // `ex` holds exec_mu_ (taken before mu_, so launches keep submission order)
  // and `lk` mu_. Blocking: returns once complete.
  WorkPtr launch(std::shared_ptr<Work> w, bool async, std::unique_lock<std::mutex>& ex,
                 std::unique_lock<std::mutex>& lk);
  // Polls launched `w` until it is done (true) or timeout_ms (< 0: none; the
  // Poll has the collective's deadline) has passed (false); `once`: one look.
  friend class Work;
  bool await(Work& w, int64_t timeout_ms, bool once = false);
  // Note [A waiter runs what it waits for]: runs queued operations, oldest first, up to `w`, while the
  // communication thread is not running one.
  void help(Work& w);
  // Under mu_ (held by `lk`, released while it runs), with no operation running: runs the queue's first.
  void run_front(std::unique_lock<std::mutex>& lk);
  void record_locked(Work& w);  // under mu_: the flight entry and the fingerprint
  void set_state(const Work& w, FlightEntry::State s);
  FlightRecord record_locked_snapshot() const;
  // Failure of `w` (Note [Flight recorder]): poison, publish, abort, explain (diagnostics.h).
  void fail(Work& w, ErrorKind kind, const std::string& msg);
  void publish_record(const std::string& key);
  Backend& backend();  // throws once the group has been finalized
  // Runs w's body under exec_mu_. `started`: the caller has already checked poison_ and marked w running under
  // mu_ (a blocking collective its submitter runs at once).
  // False if w's receive gave way to sends queued behind it (Note [Sends before receives]): w is not finished.
  bool execute(Work& w, bool on_submitter, bool started = false);
  // Note [Sends before receives]: the kinds of message, and whether send `s` may pass receive `q` queued before it.
  bool is_send(const Work& w) const { return w.desc_.kind == CollectiveKind::kSendRecv && w.desc_.root == cfg_.rank; }
  bool is_recv(const Work& w) const {
    return w.desc_.kind == CollectiveKind::kSendRecv && w.desc_.root != cfg_.rank && w.buf_ != nullptr;
  }
  bool passes(const Work& s, const Work& q) const {
    return is_recv(q) && !(s.buf_ < q.buf_ + q.bytes_ && q.buf_ < s.buf_ + s.bytes_);
  }
  // Whether send w passes every queued operation (true for an empty queue; false for anything but a send).
  bool passes_queue(const Work& w) const {
    return is_send(w) && std::all_of(queue_.begin(), queue_.end(),
                                     [&](const std::shared_ptr<Work>& q) { return passes(w, *q); });
  }
  // A send or receive of at most kSendAtOnceBytes (Note [Small sends that leave at once]).
  static bool small(const OpDesc& d) {
    return d.kind == CollectiveKind::kSendRecv && d.count * dtype_size(d.dtype) <= kSendAtOnceBytes;
  }
  // Queues w where Note [Sends before receives] puts it; a receive gives way if one runs.
  void queue_in_place(const std::shared_ptr<Work>& w);
  void comm_loop();
  void check_root(int root, const char* what) const;
  void check_peer(int peer, const char* what) const;
  [[noreturn]] void rethrow_poison();

  Config cfg_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Backend> backend_;

  uint64_t seq_ = 0;                   // collectives submitted
  uint64_t ops_ = 0;                   // operations submitted (collectives and point-to-point)
  uint64_t fingerprint_ = 0;           // Note [Collective fingerprint]
  uint64_t monitored_ = 0;             // monitored_barrier() calls
  std::vector<uint64_t> sent_, recvd_;  // point-to-point messages per peer
  // Their numbers per peer and tag (Note [Messages out of order] in transport/channel.cpp).
  std::map<std::pair<int, uint32_t>, uint64_t> sent_tag_, recvd_tag_;
  int any_pending_ = 0;                  // recv_any calls submitted and not ended
  std::array<FlightEntry, kFlightEntries> ring_{};  // Note [Flight recorder]; guarded by mu_

  std::mutex exec_mu_;  // held while a collective runs on the backend
  std::mutex mu_;       // guards everything below
  std::condition_variable cv_;       // an operation ended (busy_ cleared): for waiters running the queue
  std::condition_variable comm_cv_;  // the communication thread's: work queued, waiters gone, shutdown
  std::deque<std::shared_ptr<Work>> queue_;
  bool launches_ = false;  // backend_->launches(), fixed once it exists
  std::deque<std::shared_ptr<Work>> inflight_;  // launched async collectives, oldest first, until done
  bool busy_ = false;  // the comm thread (or a waiter: Note [A waiter runs what it waits for]) runs a work item
  int helpers_ = 0;    // waiters running queued work items: the comm thread starts none meanwhile
  bool comm_looks_ = false;  // the comm thread sleeps with a timeout, and looks at the queue on its own
  std::chrono::microseconds patience_{0};  // how long the comm thread sleeps again while waiters run a window
  Work* running_ = nullptr;  // the queued operation being run (run_front), if any
  std::atomic<bool> yield_{false};  // Note [Sends before receives]: the running receive gives way to sends
  bool stop_ = false;
  std::thread comm_;
  std::optional<std::pair<ErrorKind, std::string>> poison_;
  std::atomic<bool> shut_{false};  // written under mu_; read without it by backend()
};

}  // namespace cx::distributed
