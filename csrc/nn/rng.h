// defines: Rng (SplitMix64: small, fast, reproducible everywhere), the global
// seed sequence that gives each new module its own seed (manual_seed).
//
// Every random thing in nn/ (Linear init, Dropout masks) is seeded, so a model
// built twice with the same seed is bit-identical on every machine and rank.
#pragma once

#include <cmath>
#include <cstdint>

namespace cx::nn {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits (exactly representable floats).
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  uint64_t state() const { return s_; }
  void set_state(uint64_t s) { s_ = s; }

 private:
  uint64_t s_;
};

// A generator state for stream `stream` derived from `state`: stream 0 is
// `state` itself, other streams are hashed away from it (SplitMix64 states from
// distinct hashes sit far apart on its 2^64 cycle, so the streams do not
// overlap in practice). DDP gives rank r stream r (Note [Dropout across ranks]
// in train/ddp.h).
inline uint64_t fork_stream(uint64_t state, uint64_t stream) {
  if (stream == 0) return state;
  Rng r(state ^ (stream * 0xD1B54A32D192ED03ull));
  return r.next();
}

// Sets the global seed; modules created afterwards without an explicit seed
// draw theirs from it in creation order (default global seed: 0).
void manual_seed(uint64_t seed);
uint64_t next_module_seed();

}  // namespace cx::nn
