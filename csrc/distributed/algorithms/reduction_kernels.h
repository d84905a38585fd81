// defines: the element-wise reduction kernels the algorithms call.
//
// Float16 and bfloat16 are widened to float32, combined and rounded back
// (round-to-nearest-even) one element at a time; every rank combines the same
// operands in the same order, so results are bitwise identical on all ranks.
#pragma once

#include <cstddef>

#include "distributed/types.h"

namespace cx::distributed {

// dst[i] = dst[i] (op) src[i] for i < count. AVG reduces as SUM: the caller
// divides once at the end with scale_for_avg.
void reduce_into(void* dst, const void* src, size_t count, DataType t, ReduceOp op);

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

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace cx::distributed
