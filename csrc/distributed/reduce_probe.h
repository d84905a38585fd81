// defines: ReduceProbe, what a float32 SUM/AVG all_reduce tells its caller
// about non-finite values it met while reducing (DDP's gradient check), and
// ProbeView, how an algorithm maps its combinations onto it.
//
// Note [Fused non-finite check]
// DDP must learn, for each bucket, whether the averaged gradient holds inf or
// NaN and, when it does, whose own gradient was already bad
// (Note [Non-finite gradients] in train/nonfinite.h). The reduction reads every
// byte of both anyway, so it is asked there: the kernel that adds a received
// chunk into ours (reduction_kernels.h: sum_probed) also tests, in the same
// loop and registers, the sum it makes: a NaN or inf in either value makes the
// sum one, so on the common path that is a mask and a compare per eight floats
// and a predictable branch per sixteen (12.6 us against 11.2 for the plain sum
// of 100 k floats in cache; 18.9 when it tested all three values). Only where a
// sum is not finite are the two values it came from (ours before, the one
// received) tested. Which of those values are worth recording is the algorithm's to say,
// so that each rank's own value of each element is tested exactly once by
// someone and each element of the result at least once:
//   - ring (reduce-scatter half): at every step the segment we add into holds
//     our own values, untouched until then: `ours` is ours. Our own segment we
//     send raw at step 0, unread; the right neighbour adds it at its step 0, so
//     there `theirs` is the left neighbour's own values. The last step finishes
//     a segment of the result: `sum` is tested there. The all-gather only copies
//     (TCP: recv() straight into the buffer; shared memory: a memcpy out of the
//     ring) what its owner tested.
//   - recursive doubling: a rank's first combination adds into its own values;
//     in the fold for a world that is not a power of two the odd rank also adds
//     the even one's own values (which that rank never reads); every rank that
//     finishes tests the whole result.
//   - halving-doubling: at the first step the half we keep holds our own values
//     and the partner's copy of it is its own (it sends that half unread); the
//     last halving step finishes our segment.
//   - hierarchical: the in-host reduce-scatter is the ring's (ranks named
//     through the host's members); the across-host all_reduce of host sums tests
//     only its result. With one host, the reduce-scatter finishes the result.
//   - reduce_scatter (ZeRO-1's gradients): at every step our own input is
//     added into the partial that arrived (`theirs` is ours), and at step 0 that
//     partial is the left neighbour's raw input, sent unread; the last step
//     finishes our block. Nothing travels in band: the caller agrees
//     (NonFiniteCheck::decide_sharded).
//   - the 16-bit casts of the fp16/bf16 hooks (all_reduce_cast, Note [Cast on
//     the wire] in algorithms/allreduce.cpp): narrowing reads each of our own
//     values once, widening writes every element of the result on every rank.
//   - hierarchical reduce_scatter: each in-host reduce-scatter is the one
//     above (ranks named through the host's members, blocks through the ranks
//     of the host they are for); adding the other hosts' sums finishes our block.
//   - anything else (a world of one; a backend without the fused kernels):
//     probe_whole, one read of our own values before and of the result after.
// So a rank learns its share of "was the result finite", and the OR across
// ranks travels in band where that is cheap: the ring sends one flag word after
// each all-gather step's segment (pipelined behind the data, no round trip of
// its own), and recursive doubling on a power of two leaves every rank holding
// the whole result anyway. Elsewhere (halving-doubling, the fold, hierarchical)
// the probe says local_only and DDP's small agreement message does the OR.
// And a rank learns the ranges of elements
// where a given rank's own values were not finite. Those ranges are recorded
// only on the rare path (a lane mask is nonzero), exactly once per element, so
// counting them per parameter names what each rank sent; the all-finite path
// records nothing and reads nothing twice. Measured cost: README "Benchmarks".
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cx::distributed {

// [begin, end): elements of the caller's buffer where `rank`'s own values were inf or NaN.
struct BadValues {
  int rank;
  size_t begin, end;
};

struct ReduceProbe {
  // In: the buffer holds this rank's own contribution (false: something not
  // attributable to this rank, e.g. an earlier average that went bad; then only
  // the result is tested).
  bool blame = true;
  // Out, added to across reductions until the caller clears them (the comm
  // thread writes them; the caller reads after waiting on the work).
  bool result_bad = false;        // a value this rank finished is inf or NaN (or, unless
  bool local_only = false;        //   local_only, any rank did: the algorithm carried the flags)
  std::vector<BadValues> bad;     // rare: where some rank's own values were not finite

  void clear() {
    result_bad = local_only = false;
    bad.clear();
  }
  // Appends [begin, end) for `rank`, merged with the last range where it continues it.
  void add(int rank, size_t begin, size_t end) {
    if (!bad.empty() && bad.back().rank == rank && bad.back().end == begin)
      bad.back().end = end;
    else
      bad.push_back({rank, begin, end});
  }
};

// One algorithm's view of a probe: `members[r]` is the group rank of the
// algorithm's transport rank r (null: the same), `base` the index of the
// algorithm's buffer in the caller's, `raw`: its inputs are ranks' own values,
// `result`: its last combinations finish the caller's result. reduce_scatter
// (whose inputs are one block per rank, anywhere) records element j of block
// i at base + block(i) * stride + j: block(i) is `blocks[i]` (null: i).
struct ProbeView {
  ReduceProbe* probe = nullptr;
  const std::vector<int>* members = nullptr;
  size_t base = 0;
  bool raw = true;
  bool result = true;
  size_t stride = 0;
  const std::vector<int>* blocks = nullptr;

  int group_rank(int r) const { return members ? (*members)[static_cast<size_t>(r)] : r; }
  size_t block(int i) const { return static_cast<size_t>(blocks ? (*blocks)[static_cast<size_t>(i)] : i); }
};

}  // namespace cx::distributed
