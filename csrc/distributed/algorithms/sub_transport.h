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
  Req isend(int peer, const void* buf, size_t bytes) override {
    return posted(parent_.isend(members_[peer], buf, bytes));
  }
  Req irecv(int peer, void* buf, size_t bytes) override { return posted(parent_.irecv(members_[peer], buf, bytes)); }
  void wait(Req r) override { parent_.wait(r); }
  // Only our own requests: the pipelined hierarchical all_reduce keeps requests
  // of the other SubTransport in flight across our waits (hierarchical.cpp).
  void wait_all() override {
    for (Req r : mine_) parent_.wait(r);
    mine_.clear();
  }
  void abort(ErrorKind kind, const std::string& msg) override { parent_.abort(kind, msg); }

 private:
  Req posted(Req r) {
    mine_.push_back(r);
    return r;
  }

  Transport& parent_;
  std::vector<int> members_;
  std::vector<Req> mine_;  // posted since the last wait_all
  int rank_ = 0;
};

}  // namespace cx::distributed::algo
