// defines: BackendType, Config (Python's DistributedConfig) and its environment parsing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace cx::distributed {

enum class BackendType : uint8_t { kCpu = 0, kNccl = 1 };

// Which shape the CPU collectives take across hosts (CX_ALGORITHM): kAuto picks
// hierarchical where more than one host has more than one rank (Note [Hierarchical
// collectives] in algorithms/hierarchical.cpp), flat otherwise; the others force one.
enum class Algorithm : uint8_t { kAuto = 0, kFlat = 1, kHierarchical = 2 };

struct Config {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  BackendType backend = BackendType::kCpu;
  // Note [Two deadlines]: setting up and running are bounded separately. A dead
  // peer is noticed within about a second through its closed connection whatever
  // these are; they only bound the wait for a live rank that never comes.
  //  - timeout_ms (DISTRIBUTED_TIMEOUT_MS, the guide's "connection timeout"): how
  //    long init() waits for every rank to arrive. 10 minutes, as torchrun's
  //    rendezvous: the nodes of a cluster job may start minutes apart.
  //  - operation_timeout_ms (DISTRIBUTED_OPERATION_TIMEOUT_MS): how long one
  //    collective waits for its peers. 30 minutes, as PyTorch's default: rank 0
  //    may evaluate or save a checkpoint for minutes while the others wait.
  int64_t timeout_ms = 10 * 60 * 1000;
  int64_t operation_timeout_ms = 30 * 60 * 1000;

  // Tuning knobs (every rank must agree). Environment: CX_CHUNK_BYTES,
  // CX_SMALL_ALLREDUCE_BYTES, CX_SPIN_US. Tests use a tiny chunk to force the
  // multi-chunk paths with small messages.
  // Pipelining unit of the ring/chain algorithms; -1: automatic (Note [Tuning
  // agreed at init] in process_group.cpp).
  int64_t chunk_bytes = -1;
  // At or below this many bytes all_reduce uses recursive doubling instead of
  // the ring. -1: by world size, from measurements on 2-vCPU VMs (see
  // process_group.cpp, Note [small all_reduce threshold]).
  int64_t small_allreduce_bytes = -1;
  // all_reduce with a power-of-two world >= 4 uses halving-doubling up to this
  // many bytes, the ring above; -1: automatic. CX_HD_MAX_BYTES.
  int64_t halving_doubling_max_bytes = -1;
  // Slice of the pipelined hierarchical all_reduce; -1: from the cost model
  // (Note [Pipelined hierarchical all_reduce]). CX_HIER_SLICE_BYTES.
  int64_t hierarchical_slice_bytes = -1;
  int spin_us = -1;  // -1: chosen from the number of ranks per core
  // Flat or hierarchical collectives; CX_ALGORITHM=auto|flat|hierarchical. Every
  // rank must use the same.
  Algorithm algorithm = Algorithm::kAuto;
  // Ranks on one host exchange data through shared memory (Note [Same-host
  // pairs] in transport/shm/negotiate.cpp). CX_SHM=0 keeps every pair on TCP.
  bool shm = true;
  int64_t shm_ring_bytes = 1 << 20;  // ring per ordered pair; CX_SHM_RING_BYTES
  // Large messages between ranks on one host copied once, out of the sender's memory, where the kernel allows
  // it (Note [Single-copy large messages] in transport/shm/shm.h); CX_SHM_SINGLE_COPY=0 keeps two copies.
  bool shm_single_copy = true;
  // Which start of the job this is: RESTART_COUNT, set by the launchers (0 the
  // first time, k after the k-th restart: Note [Restarts] in pycyxwiz/launch.py).
  // Rank 0's store admits only ranks of its own generation, so a rank left over
  // from an earlier start cannot join a restarted group (nor the reverse).
  int generation = 0;
  // Every this many collectives the ranks compare their collective fingerprints
  // (Note [Collective fingerprint] in process_group.h) in an extra check message
  // round; 0: only at barrier() and finalize(). CX_CHECK_INTERVAL.
  int64_t check_interval = 0;

  // Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
  // DISTRIBUTED_BACKEND, DISTRIBUTED_TIMEOUT_MS, DISTRIBUTED_OPERATION_TIMEOUT_MS, RESTART_COUNT; under mpirun or srun also
  // OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK} and SLURM_{PROCID,NTASKS,LOCALID}, and
  // under srun MASTER_ADDR/MASTER_PORT default to the job's (Note [Slurm] in config.cpp).
  // Neither RANK nor WORLD_SIZE anywhere: a single process (rank 0 of 1).
  // Throws InvalidArgument naming the variable and its value, or saying that a
  // Slurm job's batch script or salloc shell was not started by srun.
  static Config from_environment();

  // Throws InvalidArgument for an impossible configuration.
  void validate() const;
};

// LOCAL_WORLD_SIZE (ranks on this machine, as the launchers set it), or nullopt
// when unset; InvalidArgument for a value that is not a positive integer.
std::optional<int> local_world_size_from_environment();

}  // namespace cx::distributed
