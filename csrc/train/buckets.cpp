#include "train/buckets.h"

#include <algorithm>

#include "common/error.h"

namespace cx::train {

std::vector<Bucket> assign_buckets(const std::vector<size_t>& param_counts, size_t elem_bytes,
                                   size_t first_cap_bytes, size_t cap_bytes) {
  CX_CHECK(elem_bytes > 0, InvalidArgument, "assign_buckets: elem_bytes must be > 0");
  std::vector<size_t> offsets(param_counts.size());
  size_t off = 0;
  for (size_t i = 0; i < param_counts.size(); ++i) {
    offsets[i] = off;
    off += param_counts[i];
  }
  std::vector<Bucket> out;
  bool open = false;
  Bucket cur;
  size_t cur_bytes = 0;
  for (size_t k = param_counts.size(); k-- > 0;) {
    size_t bytes = param_counts[k] * elem_bytes;
    size_t cap = std::max<size_t>(out.empty() ? first_cap_bytes : cap_bytes, 1);
    if (open && cur_bytes > 0 && cur_bytes + bytes > cap) {
      out.push_back(cur);
      open = false;
    }
    if (!open) {
      cur = Bucket{k, k, offsets[k] + param_counts[k], 0};
      cur_bytes = 0;
      open = true;
    }
    cur.first_param = k;
    cur.offset = offsets[k];
    cur.count += param_counts[k];
    cur_bytes += bytes;
  }
  if (open) out.push_back(cur);
  return out;
}

BucketScheduler::BucketScheduler(std::vector<Bucket> buckets, size_t num_params, Launch launch)
    : buckets_(std::move(buckets)), bucket_of_(num_params, 0), launch_(std::move(launch)) {
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t p = buckets_[b].first_param; p <= buckets_[b].last_param && p < num_params; ++p) bucket_of_[p] = b;
  pending_.assign(buckets_.size(), 0);
  ready_.assign(buckets_.size(), 0);
  seen_.assign(num_params, 0);
}

void BucketScheduler::start(bool launching) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = buckets_[b].last_param - buckets_[b].first_param + 1;
    ready_[b] = 0;
  }
  std::fill(seen_.begin(), seen_.end(), 0);
  next_ = 0;
  launching_ = launching;
}

void BucketScheduler::param_ready(size_t param) {
  if (param >= seen_.size() || seen_[param]) return;
  seen_[param] = 1;
  const size_t b = bucket_of_[param];
  if (--pending_[b] == 0) {
    ready_[b] = 1;
    if (launching_) launch_ready();
  }
}

std::vector<size_t> BucketScheduler::unseen() const {
  std::vector<size_t> out;
  for (size_t p = 0; p < seen_.size(); ++p)
    if (!seen_[p]) out.push_back(p);
  return out;
}

void BucketScheduler::mark_all_ready() { std::fill(ready_.begin(), ready_.end(), 1); }

void BucketScheduler::launch_ready() {
  while (next_ < buckets_.size() && ready_[next_]) launch_(next_++);
}

void BucketScheduler::launch_rest() {
  while (next_ < buckets_.size()) launch_(next_++);
}

}  // namespace cx::train
