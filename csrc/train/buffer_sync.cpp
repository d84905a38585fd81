#include "train/buffer_sync.h"

namespace cx::train {

size_t total_floats(const std::vector<FloatSpan>& spans) {
  size_t n = 0;
  for (const auto& s : spans) n += s.second;
  return n;
}

void broadcast_buffers(distributed::ProcessGroup& group, const std::vector<FloatSpan>& spans, float* pack,
                       const CopyFloats& copy, uintptr_t stream, int root) {
  const size_t n = total_floats(spans);
  if (n == 0) return;
  if (spans.size() == 1) {
    group.broadcast(spans[0].first, n, distributed::DataType::kFloat32, root, false, stream);
    return;
  }
  const bool is_root = group.rank() == root;  // packs; the others unpack
  size_t off = 0;
  if (is_root)
    for (const auto& [p, k] : spans) copy(pack + off, p, k), off += k;
  group.broadcast(pack, n, distributed::DataType::kFloat32, root, false, stream);
  off = 0;
  if (!is_root)
    for (const auto& [p, k] : spans) copy(p, pack + off, k), off += k;
}

}  // namespace cx::train
