// defines: CpuBackend (the collectives of algorithms/ over a Transport, on host
// memory) and make_cpu_backend(), which sets one up at init.
#pragma once

#include <memory>
#include <optional>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/hierarchical.h"
#include "distributed/backend/backend.h"
#include "distributed/config.h"

namespace cx::distributed {

class Store;

class CpuBackend : public Backend {
 public:
  // `algorithm`: flat or hierarchical collectives across hosts (Config::algorithm);
  // InvalidArgument if hierarchical is asked for where the hosts cannot have it.
  CpuBackend(std::unique_ptr<Transport> transport, const algo::AlgoOptions& opt,
             Algorithm algorithm = Algorithm::kAuto);

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
  Body all_reduce_cast(float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale, ReduceProbe* probe,
                       int rank) override;
  Body all_reduce_probed(float* buf, size_t count, ReduceOp op, ReduceProbe* probe, int rank) override;
  Body reduce_scatter_probed(std::vector<const float*> ins, float* out, size_t count, ReduceOp op,
                             ReduceProbe* probe, size_t base, size_t stride, int rank) override;
  Body send(const void* buf, size_t count, DataType dt, int dst, uintptr_t stream) override;
  Body recv(void* buf, size_t count, DataType dt, int src, uintptr_t stream) override;
  Body recv_any(void* buf, size_t count, DataType dt, std::function<OpDesc(int)> desc_of, int* source) override;

  void begin(const OpDesc& desc, const Deadline& dl, bool) override { t_->begin(desc, dl); }
  void abort(ErrorKind kind, const std::string& msg) override { t_->abort(kind, msg); }
  void set_yield(std::atomic<bool>* flag) override { t_->set_yield(flag); }
  void close(const Deadline& dl) override { t_->close(dl); }
  uint64_t bytes_sent() const override { return t_->bytes_sent(); }
  std::string describe() const override;

  // At init, inside its operation, on every rank at once: whether every rank copies every other's messages once
  // (Transport::reads_peers), which decides the mid-size broadcast (Note [Broadcast from the root to all] in
  // algorithms/broadcast.cpp), and whether every pair goes through shared-memory rings (Transport::through_rings),
  // which sets the small all_gather and reduce_scatter thresholds (Note [Bruck's all_gather] in
  // algorithms/allgather.cpp).
  void agree_on_single_copies();
  // At init, the same way, where three or more hosts take part: the link between hosts, timed by rank 0 and
  // sent to every rank (Note [Choosing by the link] in algorithms/allreduce.cpp).
  void measure_link();

 private:
  std::string flat_description() const;
  // Whether a collective moving `bytes` goes hierarchical (Note [When to go hierarchical] in
  // cpu_backend.cpp): `from` is the size it takes.
  bool hierarchical(size_t bytes, size_t from) const { return hier_ && (forced_ || bytes >= from); }

  std::unique_ptr<Transport> t_;
  algo::AlgoOptions opt_;
  std::optional<algo::Hierarchy> hier_;  // set where the collectives go hierarchical
  bool forced_ = false;                  // CX_ALGORITHM=hierarchical: at every size
};

// At init: agrees with the other ranks on the group (rank 0's nonce and
// automatic tuning, through `store`), connects the transport and meets in a
// barrier. A world of one (store null) talks to no one.
// `secret` is the job's (Note [Job secret] in net/auth.h): every mesh link proves it.
std::unique_ptr<Backend> make_cpu_backend(const Config& cfg, Store* store, const std::string& secret,
                                          const Deadline& dl);

}  // namespace cx::distributed
