#include "distributed/types.h"

#include <algorithm>

#include "common/error.h"

namespace cx::distributed {

size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUInt8: return 1;
    case DataType::kBytes: return 1;
    case DataType::kInt8: return 1;
    case DataType::kBool: return 1;
  }
  return 1;
}

const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kBytes: return "bytes";
    case DataType::kInt8: return "int8";
    case DataType::kBool: return "bool";
  }
  return "?";
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
    case ReduceOp::kNone: return "-";
  }
  return "?";
}

const char* kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kSendRecv: return "send/recv";
    case CollectiveKind::kInit: return "init";
    case CollectiveKind::kCheck: return "collective check";
  }
  return "?";
}

void check_reducible(DataType t, ReduceOp op) {
  if (t == DataType::kBytes) {
    CX_THROW(TypeMismatch, "cannot reduce an array of this dtype: reductions support float32, float64, "
                           "float16, bfloat16, int32, int64, int8, uint8 and bool");
  }
  if (op == ReduceOp::kAvg && (t == DataType::kInt32 || t == DataType::kInt64 || t == DataType::kUInt8 ||
                               t == DataType::kInt8 || t == DataType::kBool)) {
    CX_THROW(InvalidArgument, "ReduceOp.AVG is not defined for ", dtype_name(t),
             " arrays (the mean of integers is not an integer): use ReduceOp.SUM and divide, "
             "or reduce a floating-point array");
  }
  const bool floating = t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
                        t == DataType::kBFloat16;
  if ((op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) && floating) {
    CX_THROW(InvalidArgument, "ReduceOp.", op_name(op), " is defined for integer and bool arrays (int32, int64, "
             "int8, uint8, bool), not for ", dtype_name(t), ": reduce an integer view of the bits if that is meant "
             "(arr.view(np.int32) / t.view(torch.int32))");
  }
}

int Deadline::remaining_ms(int cap) const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left, cap));
}

}  // namespace cx::distributed
