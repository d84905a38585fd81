#include "distributed/transport/transport.h"

#include <sstream>

namespace cx::distributed {

std::string OpDesc::describe() const {
  std::ostringstream os;
  os << kind_name(kind) << "(count=" << count;
  if (dtype != DataType::kBytes) os << ", dtype=" << dtype_name(dtype);
  if (op != ReduceOp::kNone) os << ", op=" << op_name(op);
  if (root >= 0) os << ", " << (kind == CollectiveKind::kSendRecv ? "peer" : "root") << "=" << root;
  os << ")";
  if (kind == CollectiveKind::kSendRecv) {
    os << " as message #" << seq << " between the pair";
  } else {
    os << " as collective #" << seq;
  }
  return os.str();
}

}  // namespace cx::distributed
