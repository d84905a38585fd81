// defines: Bucket and assign_buckets, the pure function that groups a model's
// parameter tensors into gradient buckets for DistributedDataParallel; and
// BucketScheduler, the order in which buckets are launched during a backward,
// on either device (Note [Overlap] in ddp.h).
//
// Note [Bucket order]
// Backward produces gradients last layer first, so buckets are filled in
// reverse parameter order: bucket 0 holds the last parameters, the bucket with
// the highest index holds parameter 0. Because parameters lie in the flat
// buffer in layer order (Note [Flat buffers] in nn/sequential.h), the tensors
// of one bucket are adjacent there and a bucket is one slice [offset,
// offset+count) of the flat gradient buffer: it is all-reduced in place, with
// no packing copy. Bucket 0 is capped at first_cap_bytes (about 1 MiB) so that
// the first all-reduce starts early in backward; the others at cap_bytes. A
// tensor larger than the cap gets a bucket of its own. The result depends only
// on the sizes and the caps, so every rank computes the same buckets.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace cx::train {

struct Bucket {
  size_t first_param = 0;  // lowest parameter index in the bucket
  size_t last_param = 0;   // highest (inclusive)
  size_t offset = 0;       // element offset in the flat buffer
  size_t count = 0;        // elements
};

// param_counts: elements of each parameter tensor, in layer order (their
// offsets are the running sums). Empty tensors join whatever bucket is open.
std::vector<Bucket> assign_buckets(const std::vector<size_t>& param_counts, size_t elem_bytes,
                                   size_t first_cap_bytes, size_t cap_bytes);

// During a backward, parameters report their gradients final (param_ready); a
// bucket is ready once all of its parameters are; ready buckets are launched
// through `launch` strictly in index order (a bucket ready early waits for its
// predecessors), so every rank issues the same sequence of collectives
// whatever the order its hooks fire in. `launch` is the device's: an async
// all-reduce of the bucket's slice, on the CPU or through NCCL.
class BucketScheduler {
 public:
  using Launch = std::function<void(size_t bucket)>;
  BucketScheduler(std::vector<Bucket> buckets, size_t num_params, Launch launch);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  size_t bucket_of(size_t param) const { return bucket_of_.at(param); }

  // A backward begins: nothing seen or ready yet. Ready buckets are launched
  // as they become ready only if `launching`.
  void start(bool launching);
  // Parameter `param`'s gradient is final; a second report is ignored.
  void param_ready(size_t param);
  // The parameters not reported since start().
  std::vector<size_t> unseen() const;
  // Every bucket is ready as it is (Note [Unused parameters] in ddp.h).
  void mark_all_ready();
  // Launches the ready buckets not launched yet, in order.
  void launch_ready();
  // Launches every bucket not launched yet, in order, ready or not.
  void launch_rest();

 private:
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // param index -> bucket
  Launch launch_;
  std::vector<size_t> pending_;    // params of bucket b not yet final in this backward
  std::vector<char> ready_;        // all of bucket b final in this backward
  std::vector<char> seen_;         // param reported in this backward
  size_t next_ = 0;                // next bucket to launch in this backward
  bool launching_ = false;
};

}  // namespace cx::train
