#include "distributed/slurm.h"

#include <cctype>

#include "common/error.h"

namespace cx::distributed::slurm {

namespace {

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

std::string first_host(const std::string& hostlist, const char* variable) {
  auto bad = [&](const char* why) {
    CX_THROW(InvalidArgument, "environment variable ", variable, "='", hostlist,
             "' is not valid: expected a Slurm hostlist such as node[01-04,07],gpu5 (", why,
             "); set MASTER_ADDR to rank 0's host");
  };
  size_t i = 0;
  while (i < hostlist.size() && std::isspace(static_cast<unsigned char>(hostlist[i]))) ++i;
  std::string host;
  // The first entry ends at the first comma (or space) outside brackets. Each
  // bracket holds ranges ("01-04") and single numbers separated by commas; the
  // entry's first host takes the low end of each bracket's first range, as written.
  for (; i < hostlist.size(); ++i) {
    const char c = hostlist[i];
    if (c == ',' || std::isspace(static_cast<unsigned char>(c))) break;
    if (c == ']') bad("a ']' without its '['");
    if (c != '[') {
      host += c;
      continue;
    }
    const size_t close = hostlist.find(']', i);
    if (close == std::string::npos) bad("a '[' is not closed");
    const std::string inside = hostlist.substr(i + 1, close - i - 1);
    std::string first;
    size_t start = 0;
    for (;;) {
      const size_t comma = inside.find(',', start);
      const std::string item = inside.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      const size_t dash = item.find('-');
      const std::string lo = item.substr(0, dash);
      const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
      if (!all_digits(lo) || !all_digits(hi)) bad("brackets hold numbers and ranges such as [01-04,07]");
      if (lo.size() > 18 || hi.size() > 18 || std::stoll(lo) > std::stoll(hi)) bad("a range runs backwards");
      if (first.empty()) first = lo;
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    host += first;
    i = close;
  }
  if (host.empty()) bad("no host in it");
  return host;
}

// Note [MASTER_PORT from the job id]: every task must find rank 0's store without
// talking to the others first, so the port is a function of what they all share,
// SLURM_JOB_ID, the way sbatch scripts for other launchers commonly do it (e.g.
// `10000 + last 4 digits of SLURM_JOBID`; PyTorch Lightning's SLURM environment
// takes 15000 + the last 4 digits). 10000 .. 29999 stays above the ports that
// services usually take and below Linux's ephemeral range (32768 .. 60999), from
// which the kernel hands out the ports of outgoing connections and of every
// rank's own listening socket, so those never hold it; the modulus spreads
// consecutive job ids over 20000 ports, so two jobs sharing a first node collide
// only when their ids agree modulo 20000 (then rank 0 says the port is taken:
// Note [Who holds MASTER_PORT] in store/store.h). Two pycyxwiz steps running at
// once in one job share the port too: give them their own MASTER_PORT.
int port_for_job(int64_t job_id) { return static_cast<int>(10000 + job_id % 20000); }

}  // namespace cx::distributed::slurm
