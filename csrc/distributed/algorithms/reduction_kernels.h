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

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);

}  // namespace cx::distributed
