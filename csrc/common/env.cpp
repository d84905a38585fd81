#include "common/env.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/error.h"

namespace cx::env {

const std::vector<Variable>& variables() {
  static const std::vector<Variable> all = {
      // Where this process sits in the job (DistributedConfig.from_environment()).
      {"RANK", "this process's rank (0 .. WORLD_SIZE-1)", "neither RANK nor WORLD_SIZE: a world of one"},
      {"WORLD_SIZE", "number of processes in the job", "neither RANK nor WORLD_SIZE: a world of one"},
      {"LOCAL_RANK", "this process's index on its machine: its GPU with NCCL", "RANK"},
      {"LOCAL_WORLD_SIZE", "processes on this machine (the launchers set it)", "WORLD_SIZE"},
      {"MASTER_ADDR", "rank 0's address: its store listens there", "127.0.0.1"},
      {"MASTER_PORT", "rank 0's store port", "29500"},
      {"DISTRIBUTED_BACKEND", "cpu or nccl", "cpu"},
      {"RESTART_COUNT", "which start of the job this is (the launchers set it: 0, then 1 after the first restart); "
       "rank 0 admits only ranks of its own", "0"},
      {"DISTRIBUTED_TIMEOUT_MS", "how long init() waits for every rank (ms)", "600000 (10 min)"},
      {"DISTRIBUTED_OPERATION_TIMEOUT_MS", "how long one collective waits for its peers (ms)", "1800000 (30 min)"},
      {"OMPI_COMM_WORLD_RANK", "under mpirun: RANK", "-"},
      {"OMPI_COMM_WORLD_SIZE", "under mpirun: WORLD_SIZE", "-"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "under mpirun: LOCAL_RANK", "-"},
      {"PMI_RANK", "under a PMI launcher (MPICH, Intel MPI): RANK", "-"},
      {"PMI_SIZE", "under a PMI launcher: WORLD_SIZE", "-"},
      {"MPI_LOCALRANKID", "under MPICH: LOCAL_RANK", "-"},
      {"SLURM_PROCID", "under srun: RANK", "-"},
      {"SLURM_NTASKS", "under srun: WORLD_SIZE", "-"},
      {"SLURM_LOCALID", "under srun: LOCAL_RANK", "-"},
      {"SLURM_STEP_NODELIST", "under srun: MASTER_ADDR is its first host, unless MASTER_ADDR is set", "-"},
      {"SLURM_JOB_NODELIST", "under srun, without SLURM_STEP_NODELIST: the same", "-"},
      {"SLURM_JOB_ID", "under srun: MASTER_PORT is 10000 + SLURM_JOB_ID % 20000, unless MASTER_PORT is set", "-"},
      {"SLURM_STEP_ID", "set by srun for its tasks: without it, a job (SLURM_JOB_ID) of SLURM_NTASKS > 1 is refused "
       "at init() (the batch script or an salloc shell, not srun's tasks)", "-"},
      // The job secret (README, "Threat model").
      {"CX_AUTH_TOKEN", "the job's secret: every connection (store and rank to rank) proves it; the same on every "
       "rank", "the launchers make one per job; otherwise none (allowed only on a loopback MASTER_ADDR)"},
      {"CX_AUTH_TOKEN_FILE", "a file holding the job's secret (instead of CX_AUTH_TOKEN)", "-"},
      {"CX_AUTH", "off: run without a secret on a non-loopback MASTER_ADDR (with a warning)", "on"},
      // Threads of the model math.
      {"OMP_NUM_THREADS", "threads of the model math per rank (OpenBLAS reads it)",
       "the launchers: CPUs / ranks per node; otherwise 1 when ranks share a machine"},
      {"OPENBLAS_NUM_THREADS", "the same, for OpenBLAS only (wins over OMP_NUM_THREADS)", "-"},
      // Tuning of the CPU backend (every rank must agree; automatic values are rank 0's).
      {"CX_SHM", "0: every pair of ranks talks TCP, even on one host", "1: ranks on one host share memory"},
      {"CX_SHM_RING_BYTES", "shared-memory ring per ordered pair of ranks on one host", "1 MiB"},
      {"CX_SHM_SINGLE_COPY", "0: large messages between ranks on one host go through the rings (two copies)",
       "1: messages from 64 KiB (8 KiB where each rank on the host has a core) are copied once, out of the sender's "
       "memory (process_vm_readv), where the kernel allows it: in all_gather and reduce_scatter, all_reduce of 2 MiB "
       "or more, and broadcast below 2 MiB where each rank on the host has a core"},
      {"CX_CHUNK_BYTES", "pipelining unit of the ring and chain algorithms",
       "256 KiB through shared memory, else 512 KiB (1 MiB with more ranks than cores)"},
      {"CX_SMALL_ALLREDUCE_BYTES",
       "at or below: recursive-doubling all_reduce; set, it also turns off the choice by the link measured between "
       "3+ hosts",
       "128 KiB for 2 ranks, else 512 KiB; among 3+ ranks a host each, by the link's cost above 4 KiB"},
      {"CX_HD_MAX_BYTES", "at or below, on 4, 8, ... ranks: halving-doubling all_reduce", "2 MiB"},
      {"CX_HIER_SLICE_BYTES", "slice of the pipelined hierarchical all_reduce",
       "from the cost model: about sqrt(bytes x 256 KiB) with 2 ranks per host (4 MiB at 64 MiB)"},
      {"CX_SPIN_US", "busy-poll at most this long before sleeping (us); not while others take the core",
       "50 (30 with more ranks than cores)"},
      {"CX_ALGORITHM", "auto, flat or hierarchical: the collectives' shape across hosts",
       "auto: hierarchical where more than one host has more than one rank"},
      {"CX_SOCKET_BUFFER_BYTES", "SO_SNDBUF/SO_RCVBUF of the data sockets", "the kernel's"},
      {"CX_TCP_CONGESTION", "TCP congestion control of the connections: system (the machine's), or one the kernel "
       "has and allows (reno, cubic, bbr, ...)",
       "auto: between ranks of one host reno (with more ranks than cores: reno for operations from 2 MiB, the "
       "machine's from 64 KiB up to that); across hosts the machine's"},
      // Faults and debugging.
      {"CX_CHECK_INTERVAL",
       "every this many collectives the ranks compare what they called (CollectiveMismatchError if it differs)",
       "0: only at barrier() and finalize()"},
      {"CX_DEBUG", "INFO: log setup and each collective to Python's logger \"pycyxwiz\"; DETAIL: also their "
       "arguments, timings and the flight record of a failure", "off"},
      // The GPU.
      {"CX_NCCL_LIBRARY", "the NCCL library to load (a path)", "the nvidia-nccl wheel's, else the system's"},
      {"CX_CUBLAS_LIBRARY", "the cuBLAS library to load (a path)", "the nvidia-cublas wheel's, else the system's"},
      {"CX_CUDA_DRIVER_LIBRARY", "the CUDA driver library to load (for tests)", "libcuda.so.1"},
      {"CX_GPU_GEMM", "tiled: the model's GEMMs use pycyxwiz's kernel, not cuBLAS", "cuBLAS where one loads"},
      {"CUDA_VISIBLE_DEVICES", "the GPUs this process sees (read for messages)", "all"},
      // Tests and the launcher.
      {"CX_NN_SCALAR", "1: the model math's plain scalar paths instead of AVX2 (tests compare them)", "0"},
      {"CX_MAX_RESTARTS", "python -m pycyxwiz.launch and launch_distributed.sh: restart every rank up to this many "
       "times when one fails (--max-restarts wins)", "0"},
      {"CX_ONE_SESSION", "python -m pycyxwiz.launch and launch_distributed.sh: 1 keeps the ranks in the launcher's "
       "session (--one-session)", "0: a session per rank"},
      {"CX_ERROR_FILE", "where a rank records an uncaught exception for its launcher (set by the launcher)", "-"},
      {"CX_PROGRESS_BAR",
       "1: rank 0's DistributedTrainer draws its progress bar though its stdout is a pipe (the launchers set it "
       "for the rank they show first when their own stdout is a terminal); 0: plain lines even on a terminal",
       "a bar exactly when stdout is a terminal"},
  };
  return all;
}

const char* get(const char* name) {
  bool known = false;
  for (const auto& v : variables()) known = known || std::strcmp(v.name, name) == 0;
  if (!known) CX_THROW(Error, "internal: environment variable ", name, " is not in common/env.cpp's table");
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi, const char* meaning) {
  const char* value = get(name);
  if (!value) return std::nullopt;
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

const char* first_of(std::initializer_list<const char*> names, const char** which) {
  for (const char* n : names) {
    if (const char* v = get(n)) {
      *which = n;
      return v;
    }
  }
  return nullptr;
}

}  // namespace cx::env
