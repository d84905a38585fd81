#include "distributed/config.h"

#include <cctype>
#include <limits>
#include <string>

#include "common/env.h"
#include "common/error.h"

namespace cx::distributed {

Config Config::from_environment() {
  Config c;
  const char *rank_var = nullptr, *world_var = nullptr, *local_var = nullptr;
  const char* rank_s = env::first_of({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, &rank_var);
  const char* world_s = env::first_of({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, &world_var);
  if (rank_s && !world_s) {
    CX_THROW(InvalidArgument, rank_var, "=", rank_s,
             " is set but WORLD_SIZE is not: set WORLD_SIZE to the number of processes");
  }
  if (world_s && !rank_s) {
    CX_THROW(InvalidArgument, world_var, "=", world_s,
             " is set but RANK is not: set RANK to this process's rank (0 .. WORLD_SIZE-1)");
  }
  if (world_s) {
    c.world_size = static_cast<int>(*env::integer(world_var, 1, 1 << 20, "a positive integer (number of processes)"));
    c.rank = static_cast<int>(*env::integer(rank_var, 0, 1 << 20, "an integer 0 .. WORLD_SIZE-1"));
    if (c.rank >= c.world_size) {
      CX_THROW(InvalidArgument, rank_var, "=", c.rank, " is out of range for ", world_var, "=", c.world_size,
               ": ranks are 0 .. ", c.world_size - 1);
    }
  }
  const char* local_s =
      env::first_of({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, &local_var);
  c.local_rank = local_s ? static_cast<int>(*env::integer(local_var, 0, 1 << 20, "a non-negative integer")) : c.rank;
  if (const char* a = env::get("MASTER_ADDR")) c.master_addr = a;
  if (auto v = env::integer("MASTER_PORT", 1, 65535, "a TCP port number 1 .. 65535")) {
    c.master_port = static_cast<int>(*v);
  }
  if (const char* b = env::get("DISTRIBUTED_BACKEND")) {
    std::string s(b);
    for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (s == "cpu" || s == "tcp") {
      c.backend = BackendType::kCpu;
    } else if (s == "nccl") {
      c.backend = BackendType::kNccl;
    } else {
      CX_THROW(InvalidArgument, "environment variable DISTRIBUTED_BACKEND='", b,
               "' is not valid: expected 'cpu' or 'nccl'");
    }
  }
  const int64_t max_ms = std::numeric_limits<int32_t>::max();
  if (auto v = env::integer("DISTRIBUTED_TIMEOUT_MS", 1, max_ms, "a positive number of milliseconds")) {
    c.timeout_ms = *v;
  }
  if (auto v = env::integer("DISTRIBUTED_OPERATION_TIMEOUT_MS", 1, max_ms, "a positive number of milliseconds")) {
    c.operation_timeout_ms = *v;
  }
  if (auto v = env::integer("CX_CHUNK_BYTES", 1, 1LL << 30, "bytes (1 .. 2^30)")) c.chunk_bytes = *v;
  if (auto v = env::integer("CX_SMALL_ALLREDUCE_BYTES", -1, 1LL << 30, "bytes (0 .. 2^30, or -1 for automatic)")) {
    c.small_allreduce_bytes = *v;
  }
  if (auto v = env::integer("CX_HD_MAX_BYTES", -1, 1LL << 40, "bytes (or -1 for automatic)")) {
    c.halving_doubling_max_bytes = *v;
  }
  if (auto v = env::integer("CX_SPIN_US", 0, 1000000, "microseconds")) c.spin_us = static_cast<int>(*v);
  if (auto v = env::integer("CX_SHM", 0, 1, "0 (TCP only) or 1 (shared memory between ranks on one host)")) {
    c.shm = *v == 1;
  }
  if (auto v = env::integer("CX_SHM_RING_BYTES", 4096, 1LL << 30, "bytes (4096 .. 2^30)")) c.shm_ring_bytes = *v;
  return c;
}

void Config::validate() const {
  if (world_size < 1) CX_THROW(InvalidArgument, "world_size must be at least 1, got ", world_size);
  if (rank < 0 || rank >= world_size) {
    CX_THROW(InvalidArgument, "rank ", rank, " is out of range for world_size ", world_size, ": ranks are 0 .. ",
             world_size - 1);
  }
  if (local_rank < 0) CX_THROW(InvalidArgument, "local_rank must be non-negative, got ", local_rank);
  if (master_port < 1 || master_port > 65535) {
    CX_THROW(InvalidArgument, "master_port ", master_port, " is not a TCP port number (1 .. 65535)");
  }
  if (master_addr.empty()) CX_THROW(InvalidArgument, "master_addr is empty: set MASTER_ADDR to rank 0's address");
  if (timeout_ms < 1) CX_THROW(InvalidArgument, "timeout_ms must be positive, got ", timeout_ms);
  if (operation_timeout_ms < 1) {
    CX_THROW(InvalidArgument, "operation_timeout_ms must be positive, got ", operation_timeout_ms);
  }
  if (chunk_bytes == 0 || chunk_bytes < -1) {
    CX_THROW(InvalidArgument, "chunk_bytes must be positive (or -1 for automatic), got ", chunk_bytes);
  }
}

}  // namespace cx::distributed
