#include "nn/rng.h"

#include <atomic>

namespace cx::nn {

namespace {
std::atomic<uint64_t> g_seed{0};
std::atomic<uint64_t> g_counter{0};
}  // namespace

void manual_seed(uint64_t seed) {
  g_seed = seed;
  g_counter = 0;
}

uint64_t next_module_seed() {
  Rng r(g_seed.load() * 0x100000001B3ull + g_counter.fetch_add(1));
  return r.next();
}

}  // namespace cx::nn
