// defines: NcclBackend, the GPU backend of a ProcessGroup: one NCCL communicator
// on GPU LOCAL_RANK, and the collectives NCCL does natively.
//
// Streams and completion. A collective is submitted with the caller's CUDA
// stream (the array's __cuda_array_interface__ 'stream', or the legacy default
// stream), and launched at once on the submitting thread (Note [Collectives
// that are launches] in process_group.cpp). A blocking call launches NCCL on the
// caller's stream itself, as a hand-written NCCL call would: no cross-stream
// wait, which costs microseconds on a small collective. An async one (or a
// blocking one while async ones are still in flight) launches on the
// backend's own stream, made to wait for the caller's first, so the caller's
// stream is not held up by the collective. The waiting thread then polls an
// event recorded after an async launch, or the stream a blocking one ran on
// (and, every few polls, ncclCommGetAsyncError) until done or until the
// group's deadline. So a blocking collective returns, and Work::wait() of an
// async one returns, only once the result is in the array: the caller's
// stream is ordered after it with no further synchronisation, and a hung or
// failed collective surfaces as an exception on the host instead of a stream
// that never drains.
//
// Failure. An NCCL async error (a peer died, the network failed) raises
// DistributedConnectionError; the deadline passing raises
// DistributedTimeoutError. Either poisons the group, and ProcessGroup then calls
// abort(), which is ncclCommAbort: kernels still waiting on a dead peer exit,
// and every later call raises. Each surviving rank finds out by itself (its own
// async error or its own deadline), so all of them raise instead of hanging.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/module.h"
#include "distributed/backend/backend.h"
#include "distributed/backend/nccl/nccl_api.h"
#include "distributed/config.h"

namespace cx::distributed {

class Store;

// The caller's stream, which a collective is ordered after. `known` false:
// there is none (the barrier).
struct Ready {
  cuda::CUstream stream = nullptr;
  bool known = false;
};

// Events to reuse: creating and destroying one per collective costs more than
// a small collective's launch.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  std::shared_ptr<cuda::Event> take();

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<cuda::Event>> free_;
};

class NcclBackend : public Backend {
 public:
  // Checks the GPU and NCCL, exchanges the unique id through `store` (null for
  // a world of one) and creates the communicator on GPU cfg.local_rank.
  NcclBackend(Store* store, const Config& cfg, const Deadline& dl);
  ~NcclBackend() override;

  // Each checks, on the submitting thread, that every buffer is memory of this
  // rank's GPU (TypeMismatch otherwise), and makes this GPU's context current
  // there, where the body runs next.
  Body all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, uintptr_t stream) override;
  Body broadcast(void* buf, size_t count, DataType dt, int root, uintptr_t stream) override;
  Body all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, uintptr_t stream) override;
  Body reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op,
                      uintptr_t stream) override;
  Body reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, uintptr_t stream) override;
  Body scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root,
               uintptr_t stream) override;
  Body gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root,
              uintptr_t stream) override;
  Body all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count, DataType dt,
                  uintptr_t stream) override;
  Body barrier(uint64_t fingerprint) override;
  Body send(const void* buf, size_t count, DataType dt, int dst, uintptr_t stream) override;
  Body recv(void* buf, size_t count, DataType dt, int src, uintptr_t stream) override;

  void begin(const OpDesc& desc, const Deadline& dl, bool on_submitter) override;
  bool launches() const override { return true; }
  Poll launched(bool async) override;
  void abort(ErrorKind kind, const std::string& msg) override;  // ncclCommAbort
  void close(const Deadline& dl) override;                       // ncclCommDestroy

 private:
  Ready mark(uintptr_t stream, const void* const* bufs, size_t n, const char* what);
  Ready mark(uintptr_t stream, const std::vector<const void*>& bufs, const char* what) {
    return mark(stream, bufs.data(), bufs.size(), what);
  }
  Ready mark(uintptr_t stream, const void* buf, const char* what) { return mark(stream, &buf, 1, what); }
  // Each launches the collective after the work queued on `ready` so far.
  void run_all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, const Ready& ready);
  void run_broadcast(void* buf, size_t bytes, int root, const Ready& ready);
  void run_all_gather(const void* in, const std::vector<void*>& outs, size_t bytes, const Ready& ready);
  void run_reduce_scatter(const std::vector<const void*>& ins, void* out, size_t count, DataType dt, ReduceOp op,
                          const Ready& ready);
  void run_reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, const Ready& ready);
  void run_scatter(const std::vector<const void*>& ins, void* out, size_t bytes, int root, const Ready& ready);
  void run_gather(const void* in, const std::vector<void*>& outs, size_t bytes, int root, const Ready& ready);
  void run_all_to_all(const std::vector<const void*>& ins, const std::vector<void*>& outs, size_t bytes,
                      const Ready& ready);
  void run_send(const void* buf, size_t bytes, int peer, const Ready& ready);
  void run_recv(void* buf, size_t bytes, int peer, const Ready& ready);
  void run_barrier();
  // x[i] *= f for n elements of a floating-point dtype, on our stream.
  void scale(void* x, size_t n, DataType dt, double f);

  void setup(Store* store, const Deadline& dl);
  void make_current() const;
  void start(const Ready& ready);     // picks the stream to run on (run_), ordered after `ready`
  void check(nccl::ncclResult_t r);  // throws for a failed NCCL call
  // One look at a launched collective: its event `done`, or without one the stream it ran on (`n`: how many
  // looks before this one).
  bool poll(const cuda::Event* done, cuda::CUstream stream, const OpDesc& desc, const Deadline& dl, int n);
  [[noreturn]] void fail_async(nccl::ncclResult_t r, const OpDesc& desc);

  int rank_, size_, device_;
  const nccl::NcclApi* api_ = nullptr;
  cuda::CUcontext ctx_ = nullptr;
  cuda::CUstream stream_ = nullptr;  // our own, for work that runs after its submission
  cuda::CUstream run_ = nullptr;     // the stream the running body launches on
  bool on_submitter_ = false;
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();  // the launched collectives' ends
  cuda::CUevent ready_ = nullptr;  // recorded on the caller's stream for our stream to wait on
  cuda::CUdeviceptr scratch_ = 0;  // 4 bytes: the barrier's all-reduce
  // Launches use comm_ under ProcessGroup's exec_mu_, as abort() and close() do; a waiting thread's poll
  // runs without it (Note [Collectives that are launches]), so its reads of comm_ and abort()'s end of it
  // also take comm_mu_.
  std::mutex comm_mu_;
  nccl::ncclComm_t comm_ = nullptr;
  std::unique_ptr<cuda::Module> scale_;  // scale.cu: AVG by hand on NCCL < 2.10
  OpDesc desc_;
  Deadline dl_ = Deadline::after_ms(0);
};

// The unique-id exchange, on its own so that it can be tested without a GPU.
// Every rank runs `prepare` (its local checks); rank 0 then calls make_id and
// publishes the id (or its error) in the store, and every rank publishes
// whether it is ready. Returns the id on every rank, or throws: this rank's
// own error first, else the first other rank's ("rank 2 could not join ...").
std::string exchange_nccl_id(Store& store, int rank, int world, const Deadline& dl,
                             const std::function<void()>& prepare, const std::function<std::string()>& make_id);

// For tests: runs exchange_nccl_id through a real store on cfg's address with
// a random 128-byte id; `fail_rank` fails its local checks. Returns the id.
std::string nccl_id_exchange_selftest(const Config& cfg, int fail_rank, int first_byte = -1);

}  // namespace cx::distributed
