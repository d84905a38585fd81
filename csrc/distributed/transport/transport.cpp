#include "distributed/transport/transport.h"

#include <cstdio>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace cx::distributed {

std::string OpDesc::describe() const {
  std::ostringstream os;
  os << kind_name(kind) << "(count=" << count;
  if (dtype != DataType::kBytes) os << ", dtype=" << dtype_name(dtype);
  if (op != ReduceOp::kNone) os << ", op=" << op_name(op);
  // A message's root is its sender, on both sides (the receiver's peer, the sender itself).
  if (root >= 0) os << ", " << (kind == CollectiveKind::kSendRecv ? "src" : "root") << "=" << root;
  if (root < 0 && kind == CollectiveKind::kSendRecv) os << ", src=any";
  if (tag) os << ", tag=" << tag;
  os << ")";
  if (site) os << " at " << call_site_text(site);
  if (kind == CollectiveKind::kSendRecv && root < 0) {
    os << " from any rank";
  } else if (kind == CollectiveKind::kSendRecv) {
    os << " as message #" << seq << (tag ? " of its tag" : "") << " between the pair";
  } else {
    os << " as collective #" << seq;
  }
  return os.str();
}

namespace {
std::mutex g_sites_mu;
std::unordered_map<uint32_t, std::string>& sites() {
  static auto* m = new std::unordered_map<uint32_t, std::string>();  // never freed: threads may outlive statics
  return *m;
}
thread_local uint32_t t_site = 0;
}  // namespace

uint32_t call_site_id(const std::string& text) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char ch : text) h = (h ^ ch) * 16777619u;
  if (h == 0) h = 1;
  std::lock_guard<std::mutex> lk(g_sites_mu);
  sites().emplace(h, text);
  return h;
}

void set_call_site(const std::string& text) { t_site = text.empty() ? 0 : call_site_id(text); }
uint32_t current_call_site() { return t_site; }

std::string call_site_text(uint32_t id) {
  std::lock_guard<std::mutex> lk(g_sites_mu);
  auto it = sites().find(id);
  if (it != sites().end()) return it->second;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "call site 0x%08x", id);
  return buf;
}

}  // namespace cx::distributed
