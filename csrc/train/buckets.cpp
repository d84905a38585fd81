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

}  // namespace cx::train
