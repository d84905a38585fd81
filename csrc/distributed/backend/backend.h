// defines: Backend, what a ProcessGroup runs its collectives on: the CPU backend
// (the algorithms of algorithms/ over a Transport, on host memory) or the NCCL
// backend (NCCL's own collectives, on GPU memory).
//
// ProcessGroup keeps what every backend shares: the submission order, the queue
// of async work and its thread, deadlines, poisoning and shutdown. It calls the
// backend once per collective, on the submitting thread, and the backend returns
// the Body that does the work: whatever must happen at submission (NCCL records
// an event on the caller's stream, so the collective is ordered after the work
// that produced the array) happens in that call; the group then runs the bodies
// in submission order, each between begin() and its end, on whichever thread the
// group chooses. Counts are elements of dt per rank's block, as in ProcessGroup;
// arguments have been checked there (roots, block counts, reducible dtypes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "distributed/algorithms/reduction_kernels.h"  // probe_whole
#include "distributed/reduce_probe.h"
#include "distributed/transport/transport.h"
#include "distributed/types.h"

namespace cx::distributed {

class Backend {
 public:
  using Body = std::function<void()>;
  virtual ~Backend() = default;

  // `stream`: the caller's CUDA stream for GPU arrays (0: the legacy default);
  // the CPU backend ignores it.
  virtual Body all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, uintptr_t stream) = 0;
  virtual Body broadcast(void* buf, size_t count, DataType dt, int root, uintptr_t stream) = 0;
  virtual Body all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, uintptr_t stream) = 0;
  virtual Body reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, ReduceOp op,
                              uintptr_t stream) = 0;
  virtual Body reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, uintptr_t stream) = 0;
  virtual Body scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root,
                       uintptr_t stream) = 0;
  virtual Body gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root,
                      uintptr_t stream) = 0;
  virtual Body all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count, DataType dt,
                          uintptr_t stream) = 0;
  // Every rank passes its collective fingerprint; the CPU backend compares them
  // along the way (MismatchError), NCCL's ignores them (finalize() compares).
  virtual Body barrier(uint64_t fingerprint) = 0;
  // float32 `buf` becomes the SUM over ranks of its values times `scale`,
  // travelling as `wire_dt` (float16 / bfloat16) through `wire`, count 16-bit
  // elements of scratch (algo::all_reduce_cast; `probe`, may be null: the casts
  // test for non-finite values, ours recorded for `rank`). Host memory: the CPU backend's.
  virtual Body all_reduce_cast(float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale,
                               ReduceProbe* probe, int rank) {
    (void)buf, (void)wire, (void)count, (void)scale, (void)probe, (void)rank;
    CX_THROW(InvalidArgument, "an all-reduce of float32 carried as ", dtype_name(wire_dt),
             " (the fp16/bf16 communication hooks) runs on the CPU backend only; this group's backend cannot");
  }
  // A float32 SUM/AVG all_reduce of host memory that also tests for non-finite
  // values into `probe` (Note [Fused non-finite check] in reduce_probe.h);
  // `rank`: ours. By default one read of our values before and of the result
  // after; the CPU backend tests inside its reduction kernels.
  virtual Body all_reduce_probed(float* buf, size_t count, ReduceOp op, ReduceProbe* probe, int rank) {
    Body run = all_reduce(buf, count, DataType::kFloat32, op, 0);
    return [run = std::move(run), buf, count, probe, rank] {
      if (probe->blame) probe_whole(*probe, buf, count, 0, rank, true);
      run();
      probe_whole(*probe, buf, count, 0, rank, false);
      probe->local_only = true;
    };
  }
  // A float32 SUM/AVG reduce_scatter of host memory that tests for non-finite
  // values into `probe` likewise: ins[i]'s element j is recorded at
  // base + i * stride + j. By default one read of our inputs before and of our
  // block of the result after; the CPU backend tests inside its reduction kernels.
  virtual Body reduce_scatter_probed(std::vector<const float*> ins, float* out, size_t count, ReduceOp op,
                                     ReduceProbe* probe, size_t base, size_t stride, int rank) {
    Body run = reduce_scatter(std::vector<const void*>(ins.begin(), ins.end()), out, count, DataType::kFloat32, op, 0);
    return [run = std::move(run), ins = std::move(ins), out, count, probe, base, stride, rank] {
      if (probe->blame)
        for (size_t i = 0; i < ins.size(); ++i) probe_whole(*probe, ins[i], count, base + i * stride, rank, true);
      run();
      probe_whole(*probe, out, count, 0, rank, false);
    };
  }
  virtual Body send(const void* buf, size_t count, DataType dt, int dst, uintptr_t stream) = 0;
  // Note [Sends before receives] in process_group.cpp; the NCCL backend's operations never wait on the host.
  virtual void set_yield(std::atomic<bool>* flag) { (void)flag; }
  virtual Body recv(void* buf, size_t count, DataType dt, int src, uintptr_t stream) = 0;
  // A receive from whichever rank sends first (Note [Receiving from any source] in mesh_transport.cpp):
  // `desc_of(j)` gives the message's descriptor once its sender j is known; `source` gets j.
  virtual Body recv_any(void* buf, size_t count, DataType dt, std::function<OpDesc(int)> desc_of, int* source) {
    CX_THROW(InvalidArgument, "recv from any source is supported on the CPU backend only: name the source rank");
  }

  // The next body to run belongs to `desc`; its waits give up at `dl`.
  // `on_submitter`: a blocking call that runs on the submitting thread right
  // after its submission, with nothing of this group still in flight, so
  // nothing can have been queued on the caller's stream since: NCCL then
  // launches on that stream itself.
  virtual void begin(const OpDesc& desc, const Deadline& dl, bool on_submitter) = 0;

  // A backend whose collectives are launches on a GPU stream (NCCL) says so
  // here (Note [Collectives that are launches] in process_group.cpp): then
  // ProcessGroup runs every body on the submitting thread, in submission
  // order, async or not; the body only launches, and launched() hands back how
  // to wait for what it launched.
  virtual bool launches() const { return false; }
  // A check of a launched collective, for whichever thread waits: true once
  // complete; throws its failure, or the deadline's TimeoutError. Never blocks.
  using Poll = std::function<bool()>;
  // Right after a body ran (launches() only): the Poll of what it launched;
  // `async`: it may be polled later, after other launches.
  virtual Poll launched(bool async) {
    (void)async;
    return {};
  }
  // Fails the group: peers are told why where the backend can tell them (CPU),
  // the communicator is torn down where it cannot (NCCL: ncclCommAbort).
  virtual void abort(ErrorKind kind, const std::string& msg) = 0;
  // Graceful end, once every body has run.
  virtual void close(const Deadline& dl) = 0;
  // Payload bytes this rank's transport has sent (Transport::bytes_sent); 0
  // where the backend cannot tell (NCCL).
  virtual uint64_t bytes_sent() const { return 0; }
  // The algorithm choices, for CX_DEBUG logs.
  virtual std::string describe() const { return ""; }
};

}  // namespace cx::distributed
