// defines: the model math's threads: one pool shared by every layer, optimizer
// and GEMM of the CPU model stack (set_num_threads), and parallel_for, which
// cuts a loop into contiguous parts run on it.
//
// Note [One pool for the model math]
// The layers used to get their threads two ways: OpenBLAS's own pool inside each
// GEMM, and a std::thread started per part and call for the direct convolution.
// Everything else (ReLU, BatchNorm, the residual adds, pooling, the optimizer)
// ran on the calling thread. On 2 threads a ResNet-8 step ran 0.8-1.0x as fast
// as on one, where PyTorch's ran 1.6-1.9x: half the step could not use the second
// core, each call started its threads afresh (tens of microseconds on these VMs),
// and OpenBLAS's threads spun after every GEMM on the core the next part needed.
// So the model math has one pool of its own. OpenBLAS runs on one thread always;
// gemm() splits a large product into blocks of C on the pool (blas.cpp). A worker
// spins briefly after its part for the next one (the next layer comes within
// microseconds in a step), then sleeps, so an idle pool costs nothing.
//
// Results do not depend on the thread count where the parts are independent
// (element-wise loops, a channel's statistics reduced by one part in sample
// order); sums over the parts (a convolution's weight gradient) are added in part
// order, so they depend on the count but not on the timing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace cx::nn {

// The pool's size, the calling thread counted (cx.set_num_threads / get_num_threads): 1 .. kMaxThreads.
constexpr int kMaxThreads = 1024;
int num_threads();
void set_pool_threads(int n);

// Runs fn(part, begin, end) over [0, n) cut into contiguous parts of at least
// `grain` items, at most num_threads() (and most_parts) of them, part 0 on the
// calling thread; returns the number of parts. Parts are numbered in order of
// their ranges. After every part has ended, the first exception thrown (lowest
// part) is rethrown. A call made while the pool is busy (from inside a part, or
// from another thread at the same time) runs as one part on its own thread.
size_t parallel_for(size_t n, size_t grain, const std::function<void(size_t part, size_t begin, size_t end)>& fn,
                    size_t most_parts = SIZE_MAX);

// Element-wise loops cut into parts of at least this many floats (a part of fewer
// costs more to hand out than it saves).
constexpr size_t kGrainFloats = 16 * 1024;

// Runs f(begin, end) over n floats in parts on the pool, every boundary a multiple
// of 16 floats, so each element takes the vector or scalar path it takes in one
// part and an element-wise loop gives the same bits on any thread count.
template <typename F>
void parallel_floats(size_t n, F&& f) {
  if (n < 2 * kGrainFloats || num_threads() == 1) {
    f(size_t{0}, n);
    return;
  }
  const size_t blocks = n / 16;
  parallel_for(blocks, kGrainFloats / 16, [&](size_t, size_t b, size_t e) { f(b * 16, e == blocks ? n : e * 16); });
}

// parallel_for over `items` (planes, channels, samples) of about `floats_each` floats of work each.
inline size_t parallel_items(size_t items, size_t floats_each,
                             const std::function<void(size_t part, size_t begin, size_t end)>& fn) {
  return parallel_for(items, floats_each >= kGrainFloats ? 1 : kGrainFloats / (floats_each ? floats_each : 1), fn);
}

}  // namespace cx::nn
