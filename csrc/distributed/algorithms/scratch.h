// defines: scratch_space, the algorithms' reusable temporary memory.
#pragma once

#include <cstddef>
#include <memory>

namespace cx::distributed::algo {

// At least `bytes` of uninitialised memory, reused by every collective that runs
// on this thread (the caller's or the group's communication thread), valid until
// the next call on the same thread. A collective asks once, so nothing nests.
// Grown, never shrunk: its size is bounded by the largest chunk pool (a few
// chunks) or small message, never by a large message. Allocating and zeroing a
// fresh pool on every call cost ~20 us per call at 2 MiB, more than a whole
// small collective.
//
// Pool::kBetweenPhases is a second such buffer: what a collective made of flat
// ones (hierarchical.cpp) keeps across the flat collectives it calls, which use
// the first.
enum class Pool { kStep, kBetweenPhases };

template <Pool P = Pool::kStep>
inline char* scratch_space(size_t bytes) {
  thread_local std::unique_ptr<char[]> buf;
  thread_local size_t cap = 0;
  if (bytes > cap) {
    buf.reset(new char[bytes]);
    cap = bytes;
  }
  return buf.get();
}

// Memory for one call of a collective whose scratch grows with the world (Bruck's all_gather and the recursive-halving
// reduce_scatter hold p blocks): the thread's kept scratch_space up to kKeptMostBytes, so that small calls allocate
// nothing, and above it a fresh allocation freed when the call ends, so that the kept pool stays bounded.
inline constexpr size_t kKeptMostBytes = 4u << 20;

class CallScratch {
 public:
  explicit CallScratch(size_t bytes) {
    if (bytes <= kKeptMostBytes) {
      p_ = scratch_space(bytes);
    } else {
      own_.reset(new char[bytes]);
      p_ = own_.get();
    }
  }
  char* get() const { return p_; }

 private:
  std::unique_ptr<char[]> own_;
  char* p_ = nullptr;
};

}  // namespace cx::distributed::algo
