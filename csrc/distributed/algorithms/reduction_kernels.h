// defines: the element-wise reduction kernels the algorithms call.
//
// Float16 and bfloat16 are widened to float32, combined and rounded back
// (round-to-nearest-even) one element at a time; every rank combines the same
// operands in the same order, so results are bitwise identical on all ranks.
#pragma once

#include <cstddef>

#include "distributed/reduce_probe.h"
#include "distributed/types.h"

namespace cx::distributed {

// dst[i] = dst[i] (op) src[i] for i < count. AVG reduces as SUM: the caller
// divides once at the end with scale_for_avg.
void reduce_into(void* dst, const void* src, size_t count, DataType t, ReduceOp op);

// dst[i] += src[i] over float32 (a SUM or AVG), testing in the same loop
// (Note [Fused non-finite check] in reduce_probe.h): where dst held inf/NaN
// and `ours` >= 0, or src did and `theirs` >= 0, the element (base + i) is
// recorded in `probe` for that rank; with `finishes`, a non-finite sum sets
// probe->result_bad. Vectorised (AVX2) where the CPU has it.
struct SumProbe {
  ReduceProbe* probe;
  size_t base;  // index of dst[0] in the caller's buffer
  int ours, theirs;  // whose own values dst and src hold (-1: a partial sum, not recorded)
  bool finishes;  // the sums are final values of the result
};
void sum_probed(float* dst, const float* src, size_t n, const SumProbe& k);
// The same test without a reduction, for a path that has no fused kernel: our
// own values (`own`, recorded for `rank`) or the finished result.
// `base`: the index of buf[0] in the caller's buffer.
void probe_whole(ReduceProbe& p, const float* buf, size_t n, size_t base, int rank, bool own);

// reduce_into, or, with a probe (float32 SUM/AVG), sum_probed: element `at` of
// the algorithm's buffer; `ours`/`theirs`: the transport ranks whose own values
// dst/src hold (-1: neither); `finishes`: the sums are final.
inline void reduce_probed(void* dst, const void* src, size_t count, DataType t, ReduceOp op, const ProbeView* pv,
                          size_t at, int ours, int theirs, bool finishes) {
  if (!pv) return reduce_into(dst, src, count, t, op);
  sum_probed(static_cast<float*>(dst), static_cast<const float*>(src), count,
             SumProbe{pv->probe, pv->base + at, pv->raw && ours >= 0 ? pv->group_rank(ours) : -1,
                      pv->raw && theirs >= 0 ? pv->group_rank(theirs) : -1, pv->result && finishes});
}

// buf[i] /= world for an AVG. No-op for other ops.
void finish_avg(void* buf, size_t count, DataType t, ReduceOp op, int world);

// The casts of a float32 all-reduce that travels as float16 or bfloat16 (`wire`;
// Note [Cast on the wire] in allreduce.cpp). Rounding is to nearest even, NaN
// kept quiet, as float_to_half / float_to_bf16; vectorised (F16C, AVX2) where the
// CPU has it, with the same bits as the scalar code.
//   narrow:     dst[i] = wire(src[i] * scale)
//   widen:      dst[i] = float(src[i])
//   narrow_sum: dst[i] = wire(float(wire(own[i] * scale)) + float(recv[i])), the
//               bits of narrow followed by reduce_into(SUM), in one pass
void narrow(const float* src, float scale, uint16_t* dst, size_t n, DataType wire);
void widen(const uint16_t* src, float* dst, size_t n, DataType wire);
void narrow_sum(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n, DataType wire);
// The same, also telling whether any float32 value they read (src / own) or, for
// widen, wrote (dst) is inf or NaN, tested in the same loop (Note [Fused
// non-finite check] in reduce_probe.h): a compare and an OR per eight lanes.
bool narrow_tested(const float* src, float scale, uint16_t* dst, size_t n, DataType wire);
bool widen_tested(const uint16_t* src, float* dst, size_t n, DataType wire);
bool narrow_sum_tested(const float* own, float scale, const uint16_t* recv, uint16_t* dst, size_t n, DataType wire);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace cx::distributed
