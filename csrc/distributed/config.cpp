#include "distributed/config.h"

#include <cctype>
#include <cstring>
#include <limits>
#include <string>

#include "common/env.h"
#include "common/error.h"
#include "distributed/net/socket.h"
#include "distributed/slurm.h"

namespace cx::distributed {

namespace {

bool is(const char* var, const char* name) { return var && std::strcmp(var, name) == 0; }

// Note [Slurm]: how a task of srun is told from a process that merely runs inside
// a Slurm allocation. Slurm's own code (src/common/env.c) is the evidence:
//  - srun gives every task SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS (the
//    step's task count), and SLURM_STEP_ID, the number of its step
//    (env_array_for_step; slurmstepd's setup_env for each task).
//  - an sbatch script runs as the job's "batch" step: it has SLURM_JOB_ID,
//    SLURM_JOB_NODELIST and SLURM_NTASKS (the job's, env_array_for_batch_job),
//    and slurmstepd gives it SLURM_PROCID=0 and SLURM_LOCALID=0 as its one
//    task, but no SLURM_STEP_ID: setup_env sets that only for a step id that is
//    non-negative as an int, and the batch step's is SLURM_BATCH_SCRIPT,
//    0xfffffffb (an salloc shell run as the "interactive" step, 0xfffffffa, alike).
//  - a plain salloc shell has SLURM_JOB_ID and SLURM_NTASKS (with -n), and no
//    SLURM_PROCID or SLURM_STEP_ID (env_array_for_job).
// So RANK and WORLD_SIZE taken from SLURM_PROCID/SLURM_NTASKS in a job
// (SLURM_JOB_ID) of several tasks without SLURM_STEP_ID mean `python train.py`
// in the batch script or the salloc shell: one process that would wait for
// peers nobody starts. That is refused at once. Explicit RANK/WORLD_SIZE (and
// mpirun's, PMI's variables) always win: then Slurm's are not read for this.
// Under srun, MASTER_ADDR defaults to the first host of the step's nodes (where
// srun's block and cyclic distributions put task 0), SLURM_STEP_NODELIST, else
// the job's, SLURM_JOB_NODELIST; MASTER_PORT to slurm::port_for_job(SLURM_JOB_ID).
void refuse_slurm_batch_without_srun(const char* rank_var, const char* world_var) {
  if (!is(world_var, "SLURM_NTASKS") || (rank_var && !is(rank_var, "SLURM_PROCID"))) return;
  const char* job = env::get("SLURM_JOB_ID");
  if (!job || env::get("SLURM_STEP_ID")) return;
  const int64_t n = *env::integer("SLURM_NTASKS", 1, 1 << 20, "a positive integer (number of tasks)");
  if (n < 2) return;
  CX_THROW(InvalidArgument, "this looks like a Slurm allocation of ", n, " tasks (SLURM_JOB_ID=", job,
           ", SLURM_NTASKS=", n, "), but this process was not started by srun (SLURM_STEP_ID is unset: this is the ",
           "batch script or an salloc shell), so the other ", n - 1,
           " task(s) would never come: run `srun python train.py` (srun starts one process per task), or set ",
           "RANK and WORLD_SIZE yourself (explicit RANK/WORLD_SIZE always win)");
}

}  // namespace

namespace {
// Variables read where they are used (the sockets, the CPU backend): read here
// too, so that a bad value fails init at once, before any connection.
void check_read_where_used() {
  net::socket_buffer_bytes();
  net::tcp_congestion();
  local_world_size_from_environment();
}
}  // namespace

Config Config::from_environment() {
  Config c;
  const char *rank_var = nullptr, *world_var = nullptr, *local_var = nullptr;
  const char* rank_s = env::first_of({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}, &rank_var);
  const char* world_s = env::first_of({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}, &world_var);
  refuse_slurm_batch_without_srun(rank_var, world_var);  // Note [Slurm]
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
  // Under srun (Note [Slurm]) rank 0's address and port come from the job.
  const bool srun = is(rank_var, "SLURM_PROCID") && is(world_var, "SLURM_NTASKS") && c.world_size > 1;
  const char* nodes_var = nullptr;
  if (const char* a = env::get("MASTER_ADDR")) {
    c.master_addr = a;
  } else if (const char* nodes = srun ? env::first_of({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}, &nodes_var)
                                      : nullptr) {
    c.master_addr = slurm::first_host(nodes, nodes_var);
  }
  if (auto v = env::integer("MASTER_PORT", 1, 65535, "a TCP port number 1 .. 65535")) {
    c.master_port = static_cast<int>(*v);
  } else if (srun) {
    if (auto job = env::integer("SLURM_JOB_ID", 0, std::numeric_limits<int64_t>::max() / 2, "a Slurm job id")) {
      c.master_port = slurm::port_for_job(*job);
    }
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
  if (const char* a = env::get("CX_ALGORITHM")) {
    std::string s(a);
    for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (s == "auto") {
      c.algorithm = Algorithm::kAuto;
    } else if (s == "flat") {
      c.algorithm = Algorithm::kFlat;
    } else if (s == "hierarchical") {
      c.algorithm = Algorithm::kHierarchical;
    } else {
      CX_THROW(InvalidArgument, "environment variable CX_ALGORITHM='", a,
               "' is not valid: expected 'auto', 'flat' or 'hierarchical'");
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
  if (auto v = env::integer("CX_HIER_SLICE_BYTES", 1, 1LL << 40, "bytes (1 .. 2^40)")) {
    c.hierarchical_slice_bytes = *v;
  }
  if (auto v = env::integer("CX_SPIN_US", 0, 1000000, "microseconds")) c.spin_us = static_cast<int>(*v);
  if (auto v = env::integer("CX_SHM", 0, 1, "0 (TCP only) or 1 (shared memory between ranks on one host)")) {
    c.shm = *v == 1;
  }
  if (auto v = env::integer("RESTART_COUNT", 0, 1 << 20, "a non-negative integer (the launchers set it)")) {
    c.generation = static_cast<int>(*v);
  }
  if (auto v = env::integer("CX_SHM_RING_BYTES", 4096, 1LL << 30, "bytes (4096 .. 2^30)")) c.shm_ring_bytes = *v;
  if (auto v = env::integer("CX_SHM_SINGLE_COPY", 0, 1, "0 (large messages copied through the rings) or 1 (copied "
                            "once, out of the sender's memory, where the kernel allows)")) {
    c.shm_single_copy = *v == 1;
  }
  if (auto v = env::integer("CX_CHECK_INTERVAL", 0, 1LL << 40, "a number of collectives (0: off)")) {
    c.check_interval = *v;
  }
  check_read_where_used();
  return c;
}

std::optional<int> local_world_size_from_environment() {
  auto v = env::integer("LOCAL_WORLD_SIZE", 1, 1 << 20, "a positive integer (ranks on this machine)");
  return v ? std::optional<int>(static_cast<int>(*v)) : std::nullopt;
}

void Config::validate() const {
  check_read_where_used();  // a config made by hand meets the environment's checks too
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
  if (check_interval < 0) CX_THROW(InvalidArgument, "check_interval must be 0 (off) or positive, got ", check_interval);
  if (chunk_bytes == 0 || chunk_bytes < -1) {
    CX_THROW(InvalidArgument, "chunk_bytes must be positive (or -1 for automatic), got ", chunk_bytes);
  }
}

}  // namespace cx::distributed
