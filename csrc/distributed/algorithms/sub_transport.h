// defines: SubTransport, a Transport over some of the ranks of another one, so
// that the hierarchical collectives (hierarchical.cpp) run the flat algorithms
// inside one host and across hosts unchanged.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "distributed/transport/transport.h"

namespace cx::distributed::algo {

class SubTransport final : public Transport {
 public:
  // `members`: ranks of `parent`, in the order of their rank here; must hold parent.rank().
  SubTransport(Transport& parent, std::vector<int> members) : parent_(parent), members_(std::move(members)) {
    rank_ = static_cast<int>(std::find(members_.begin(), members_.end(), parent_.rank()) - members_.begin());
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  // The parent's operation is under way: its descriptor and deadline hold for our messages too.
  void begin(const OpDesc&, const Deadline&) override {}
  Req isend(int peer, const void* buf, size_t bytes) override { return parent_.isend(members_[peer], buf, bytes); }
  Req irecv(int peer, void* buf, size_t bytes) override { return parent_.irecv(members_[peer], buf, bytes); }
  void wait(Req r) override { parent_.wait(r); }
  void wait_all() override { parent_.wait_all(); }
  void abort(ErrorKind kind, const std::string& msg) override { parent_.abort(kind, msg); }

 private:
  Transport& parent_;
  std::vector<int> members_;
  int rank_ = 0;
};

}  // namespace cx::distributed::algo
