// defines: DataType, ReduceOp, CollectiveKind and their names/sizes; Deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace cx::distributed {

// Element types a reduction understands. Data-movement collectives (broadcast,
// gather, ...) carry any type as bytes and use kBytes.
enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kBytes = 7,
  kInt8 = 8,
  kBool = 9,  // one byte, 0 or 1: SUM, MAX and BOR are "or", PRODUCT, MIN and BAND "and" (as NumPy's and
              // PyTorch's), BXOR "exclusive or"
};

// Numbered as torch's ReduceOp.RedOpType (BAND, BOR and BXOR too), which pycyxwiz.torch relies on. The bitwise
// ones reduce integers and bool only (check_reducible).
enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kProduct = 2,
  kMin = 3,
  kMax = 4,
  kBand = 5,
  kBor = 6,
  kBxor = 7,
  kNone = 255
};

enum class CollectiveKind : uint8_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kAllGather = 3,
  kReduceScatter = 4,
  kReduce = 5,
  kScatter = 6,
  kGather = 7,
  kAllToAll = 8,
  kBarrier = 9,
  kSendRecv = 10,  // point-to-point: send on one side, recv on the other
  kInit = 11,      // the barrier that ends init()
  kCheck = 12,     // the ranks compare their collective fingerprints (CX_CHECK_INTERVAL)
};

size_t dtype_size(DataType t);
const char* dtype_name(DataType t);
const char* op_name(ReduceOp op);
const char* kind_name(CollectiveKind k);

// Throws InvalidArgument for pairs that make no sense (AVG of integers,
// any reduction of raw bytes).
void check_reducible(DataType t, ReduceOp op);

using Clock = std::chrono::steady_clock;

// A point in time after which a wait gives up. Every blocking wait takes one.
struct Deadline {
  Clock::time_point at;
  int64_t timeout_ms;  // what the user asked for, for messages

  static Deadline after_ms(int64_t ms) { return {Clock::now() + std::chrono::milliseconds(ms), ms}; }
  bool expired() const { return Clock::now() >= at; }
  // Milliseconds left, clamped to [0, cap].
  int remaining_ms(int cap) const;
};

}  // namespace cx::distributed
