#include "distributed/default_group.h"

#include <mutex>

namespace cx::distributed {

namespace {
std::mutex g_group_mu;
std::shared_ptr<ProcessGroup> g_group;
bool g_initializing = false;

// A child of fork() holds a copy of its parent's group: its connections are the
// parent's and its threads do not exist here, so it is neither used nor closed
// (closing would end the parent's job), only forgotten.
void forget_if_inherited() {
  if (g_group && g_group->inherited()) new std::shared_ptr<ProcessGroup>(std::move(g_group));  // never freed
}
}  // namespace

void init_default_group(const Config& cfg) {
  {
    std::lock_guard<std::mutex> lk(g_group_mu);
    forget_if_inherited();  // init() in a forked child makes a group of its own
    if (g_group || g_initializing) {
      CX_THROW(Error, "cx.distributed.init() was already called in this process (rank ",
               g_group ? g_group->rank() : cfg.rank, "): call cx.distributed.finalize() before initializing again");
    }
    g_initializing = true;
  }
  try {
    auto pg = std::make_shared<ProcessGroup>(cfg);
    std::lock_guard<std::mutex> lk(g_group_mu);
    g_group = std::move(pg);
    g_initializing = false;
  } catch (...) {
    std::lock_guard<std::mutex> lk(g_group_mu);
    g_initializing = false;
    throw;
  }
}

void finalize_default_group(bool at_exit) {
  std::shared_ptr<ProcessGroup> pg;
  {
    std::lock_guard<std::mutex> lk(g_group_mu);
    forget_if_inherited();
    pg = std::move(g_group);
  }
  if (pg) pg->shutdown(at_exit ? ProcessGroup::Check::kAtExit : ProcessGroup::Check::kFull);
}

std::shared_ptr<ProcessGroup> default_group() {
  std::lock_guard<std::mutex> lk(g_group_mu);
  return g_group;
}

std::shared_ptr<ProcessGroup> require_default_group(const char* caller) {
  auto pg = default_group();
  if (!pg) {
    CX_THROW(Error, caller, ": the process group is not initialized: call cx.distributed.init() first");
  }
  return pg;
}

}  // namespace cx::distributed
