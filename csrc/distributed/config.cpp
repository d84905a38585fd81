#include "distributed/config.h"

#include <cctype>
#include <cstdlib>
#include <limits>

#include "common/error.h"

namespace cx::distributed {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int64_t parse_int(const char* name, const char* value, int64_t lo, int64_t hi, const char* meaning) {
  std::string s(value);
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  size_t j = s.size();
  while (j > i && std::isspace(static_cast<unsigned char>(s[j - 1]))) --j;
  std::string t = s.substr(i, j - i);
  bool ok = !t.empty();
  for (size_t k = 0; k < t.size() && ok; ++k) {
    ok = std::isdigit(static_cast<unsigned char>(t[k])) || (k == 0 && t[k] == '-');
  }
  if (ok && t != "-" && t.size() <= 18) {
    int64_t v = std::stoll(t);
    if (v >= lo && v <= hi) return v;
  }
  CX_THROW(InvalidArgument, "environment variable ", name, "='", value, "' is not valid: expected ", meaning);
}

// The first of `names` that is set, with its name.
const char* first_set(std::initializer_list<const char*> names, const char** which) {
  for (const char* n : names) {
    if (const char* v = env(n)) {
      *which = n;
      return v;
    }
  }
  return nullptr;
}

}  // namespace

Config Config::from_environment() {
  Config c;
  const char *rank_var = nullptr, *world_var = nullptr, *local_var = nullptr;
  const char* rank_s = first_set({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, &rank_var);
  const char* world_s = first_set({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, &world_var);
  if (rank_s && !world_s) {
    CX_THROW(InvalidArgument, rank_var, "=", rank_s,
             " is set but WORLD_SIZE is not: set WORLD_SIZE to the number of processes");
  }
  if (world_s && !rank_s) {
    CX_THROW(InvalidArgument, world_var, "=", world_s,
             " is set but RANK is not: set RANK to this process's rank (0 .. WORLD_SIZE-1)");
  }
  if (world_s) {
    c.world_size = static_cast<int>(parse_int(world_var, world_s, 1, 1 << 20, "a positive integer (number of processes)"));
    c.rank = static_cast<int>(parse_int(rank_var, rank_s, 0, 1 << 20, "an integer 0 .. WORLD_SIZE-1"));
    if (c.rank >= c.world_size) {
      CX_THROW(InvalidArgument, rank_var, "=", c.rank, " is out of range for ", world_var, "=", c.world_size,
               ": ranks are 0 .. ", c.world_size - 1);
    }
  }
  const char* local_s = first_set({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, &local_var);
  c.local_rank = local_s ? static_cast<int>(parse_int(local_var, local_s, 0, 1 << 20, "a non-negative integer"))
                         : c.rank;
  if (const char* a = env("MASTER_ADDR")) c.master_addr = a;
  if (const char* p = env("MASTER_PORT")) {
    c.master_port = static_cast<int>(parse_int("MASTER_PORT", p, 1, 65535, "a TCP port number 1 .. 65535"));
  }
  if (const char* b = env("DISTRIBUTED_BACKEND")) {
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
  if (const char* t = env("DISTRIBUTED_TIMEOUT_MS")) {
    c.timeout_ms = parse_int("DISTRIBUTED_TIMEOUT_MS", t, 1, std::numeric_limits<int32_t>::max(),
                             "a positive number of milliseconds");
  }
  if (const char* t = env("DISTRIBUTED_OPERATION_TIMEOUT_MS")) {
    c.operation_timeout_ms = parse_int("DISTRIBUTED_OPERATION_TIMEOUT_MS", t, 1,
                                       std::numeric_limits<int32_t>::max(), "a positive number of milliseconds");
  }
  if (const char* v = env("CX_CHUNK_BYTES")) c.chunk_bytes = parse_int("CX_CHUNK_BYTES", v, 1, 1LL << 30, "bytes (1 .. 2^30)");
  if (const char* v = env("CX_SMALL_ALLREDUCE_BYTES")) {
    c.small_allreduce_bytes = parse_int("CX_SMALL_ALLREDUCE_BYTES", v, -1, 1LL << 30, "bytes (0 .. 2^30, or -1 for automatic)");
  }
  if (const char* v = env("CX_HD_MAX_BYTES")) {
    c.halving_doubling_max_bytes = parse_int("CX_HD_MAX_BYTES", v, -1, 1LL << 40, "bytes (or -1 for automatic)");
  }
  if (const char* v = env("CX_SPIN_US")) c.spin_us = static_cast<int>(parse_int("CX_SPIN_US", v, 0, 1000000, "microseconds"));
  if (const char* v = env("CX_SHM")) c.shm = parse_int("CX_SHM", v, 0, 1, "0 (TCP only) or 1 (shared memory between ranks on one host)") == 1;
  if (const char* v = env("CX_SHM_RING_BYTES")) {
    c.shm_ring_bytes = parse_int("CX_SHM_RING_BYTES", v, 4096, 1LL << 30, "bytes (4096 .. 2^30)");
  }
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
