#include "distributed/transport/spin_policy.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace cx::distributed {

namespace {

std::atomic<uint64_t> g_sleeps{0};

// The runnable threads in a /proc/loadavg line ("0.52 0.61 0.70 3/152 4321"), or -1 if it is not one.
int runnable_in(const char* loadavg) {
  double load[3];
  int running = 0, total = 0;
  if (std::sscanf(loadavg, "%lf %lf %lf %d/%d", &load[0], &load[1], &load[2], &running, &total) != 5) return -1;
  return running;
}

}  // namespace

void OthersOnTheCpus::count_sleep() { g_sleeps.fetch_add(1, std::memory_order_relaxed); }
uint64_t OthersOnTheCpus::sleeps() { return g_sleeps.load(std::memory_order_relaxed); }

bool OthersOnTheCpus::runnable(Clock::time_point now) {
  if (now < next_) return others_;
  next_ = now + kLook;
  char text[128] = {};
  const int fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return others_ = false;
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  const int running = n > 0 ? runnable_in(text) : -1;
  return others_ = running - local_ >= 1;
}

}  // namespace cx::distributed
