// defines: what pycyxwiz reads of a Slurm job for Config::from_environment (Note
// [Slurm] in config.cpp): the first host of a Slurm hostlist, and the
// MASTER_PORT every task of a job derives from its job id.
#pragma once

#include <cstdint>
#include <string>

namespace cx::distributed::slurm {

// The first host of a list in Slurm's hostlist syntax, as Slurm expands it:
//   "node[01-04,07],gpu5" -> "node01"   (a range keeps its zero padding)
//   "a-[1-2]b"            -> "a-1b"     (text may follow the brackets)
//   "rack[2-3]-n[5-6]"    -> "rack2-n5" (several brackets: the first of each)
//   "host1,host2"         -> "host1"
// Throws InvalidArgument naming `variable` and its value for a list it cannot read.
std::string first_host(const std::string& hostlist, const char* variable);

// The MASTER_PORT of a job, the same in every task: 10000 + job_id % 20000.
int port_for_job(int64_t job_id);

}  // namespace cx::distributed::slurm
