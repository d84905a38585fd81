// defines: broadcast_buffers, rank 0's module buffers (BatchNorm's running
// statistics) copied to every rank as one message, on either device.
//
// DistributedDataParallel (host buffers, memcpy) and the GPU engine (device
// buffers, copies on the device's stream) call the same function: only the copy
// and the stream differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "distributed/process_group.h"

namespace cx::train {

using FloatSpan = std::pair<float*, size_t>;  // (pointer, floats)
// Copies `floats` floats from src to dst, in the memory the spans live in.
using CopyFloats = std::function<void(float* dst, const float* src, size_t floats)>;

size_t total_floats(const std::vector<FloatSpan>& spans);

// Collective: every rank's spans get rank `root`'s values (rank 0's but under
// DistributedDataParallel::join: Note [Join] in ddp.h). Several spans are packed
// into `pack` (room for total_floats(spans)) and go as one float32 broadcast;
// one span goes in place; no span (a model without buffers) is no collective at
// all, on every rank alike (every rank has the same model). `stream` is the
// device stream for the NCCL backend (0 on the CPU).
void broadcast_buffers(distributed::ProcessGroup& group, const std::vector<FloatSpan>& spans, float* pack,
                       const CopyFloats& copy, uintptr_t stream = 0, int root = 0);

}  // namespace cx::train
