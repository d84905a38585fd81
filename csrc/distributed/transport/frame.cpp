#include "distributed/transport/frame.h"

#include <algorithm>

namespace cx::distributed::frame {

void fill(char* h, uint8_t type, const OpDesc& desc, uint64_t payload_len, uint32_t abort_kind) {
  put<uint32_t>(h, 0, kMagic);
  h[4] = static_cast<char>(type);
  h[5] = static_cast<char>(desc.kind);
  h[6] = static_cast<char>(desc.dtype);
  h[7] = static_cast<char>(desc.op);
  put<int32_t>(h, 8, desc.root);
  // Note [Call sites in CX_DEBUG=DETAIL]; a send/recv's frame carries its tag there instead.
  put<uint32_t>(h, 12, type == kAbort ? abort_kind : desc.kind == CollectiveKind::kSendRecv ? desc.tag : desc.site);
  put<uint64_t>(h, 16, desc.count);
  put<uint64_t>(h, 24, desc.seq);
  put<uint64_t>(h, 32, payload_len);
}

OpDesc desc(const char* h) {
  OpDesc d;
  d.kind = static_cast<CollectiveKind>(static_cast<uint8_t>(h[5]));
  d.dtype = static_cast<DataType>(static_cast<uint8_t>(h[6]));
  d.op = static_cast<ReduceOp>(static_cast<uint8_t>(h[7]));
  d.root = get<int32_t>(h, 8);
  d.count = get<uint64_t>(h, 16);
  d.seq = get<uint64_t>(h, 24);
  if (static_cast<uint8_t>(h[4]) != kAbort) {
    (d.kind == CollectiveKind::kSendRecv ? d.tag : d.site) = get<uint32_t>(h, 12);
  }
  return d;
}

void raise_abort(const char* h, const std::string& text, int me, int peer, const OpDesc& during) {
  const auto code = get<uint32_t>(h, 12);
  ErrorKind kind = code >= 1 && code <= static_cast<uint32_t>(ErrorKind::kPeerFailed) ? static_cast<ErrorKind>(code)
                                                                                        : ErrorKind::kGeneric;
  const std::string report = printable(text, kMaxAbortText);
  if (kind == ErrorKind::kPeerFailed) {
    rethrow_as(ErrorKind::kPeerFailed,
               detail::concat("rank ", peer, " failed: ", report.empty() ? "(no reason given)" : report, " (rank ",
                              me, " was in ", during.describe(), "; rank ", peer,
                              " aborted the group: fix the error on that rank)"));
  }
  if (report.empty()) {
    rethrow_as(kind, detail::concat("rank ", me, ": rank ", peer, " aborted the group during ", during.describe(),
                                    " without saying why"));
  }
  rethrow_as(kind, detail::concat("rank ", me, ": rank ", peer, " aborted the group during ", during.describe(),
                                  "; rank ", peer, " reports: ", report));
}

}  // namespace cx::distributed::frame
