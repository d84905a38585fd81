#include <vector>

#include "distributed/algorithms/algorithms.h"
#include "distributed/algorithms/scratch.h"
#include "distributed/algorithms/reduction_kernels.h"

namespace cx::distributed::algo {

// Binomial-tree reduce toward `root`, chunk by chunk: a rank adds each child's
// partial for a chunk into its own buffer and passes the chunk up while the next
// one is still arriving. Scratch: one chunk per child.
void reduce(Transport& t, void* buf_v, size_t count, DataType dt, ReduceOp op, int root, const AlgoOptions& o) {
  const int p = t.size();
  if (p == 1) return;
  const int vr = (t.rank() - root + p) % p;
  const size_t es = dtype_size(dt);
  char* buf = static_cast<char*>(buf_v);
  std::vector<int> children;
  int parent = -1;
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      parent = ((vr - mask) + root) % p;
      break;
    }
    if (vr + mask < p) children.push_back(((vr + mask) + root) % p);
  }
  const size_t ce = std::max<size_t>(1, std::min(count, o.chunk_bytes / es));
  const size_t nc = count == 0 ? 1 : (count + ce - 1) / ce;
  char* scratch = scratch_space(children.size() * ce * es);
  std::vector<Transport::Req> reqs(children.size());
  for (size_t c = 0; c < nc; ++c) {
    size_t off = c * ce, n = std::min(count - std::min(count, off), ce);
    for (size_t i = 0; i < children.size(); ++i) reqs[i] = t.irecv(children[i], scratch + i * ce * es, n * es);
    for (size_t i = 0; i < children.size(); ++i) {
      t.wait(reqs[i]);
      reduce_into(buf + off * es, scratch + i * ce * es, n, dt, op);
    }
    if (parent >= 0) t.isend(parent, buf + off * es, n * es);
  }
  t.wait_all();
  if (vr == 0) finish_avg(buf, count, dt, op, p);
}

}  // namespace cx::distributed::algo
