// defines: Bucket and assign_buckets, the pure function that groups a model's
// parameter tensors into gradient buckets for DistributedDataParallel.
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

}  // namespace cx::train
