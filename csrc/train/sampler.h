// defines: DistributedSampler (which samples this rank sees in an epoch) and
// DistributedBatchIterator (those samples cut into batches).
//
// Note [Sampler layout]
// Every rank computes the same epoch-wide order: 0..n-1, shuffled (when
// `shuffle`) by a Fisher-Yates pass driven by SplitMix64 seeded from
// (seed, epoch), so it is identical on every rank and every machine for a given
// seed and epoch, and different across epochs. The order is then made a
// multiple of the world size:
//   drop_last = false: padded by wrapping around to the start of the order
//                      (repeatedly if n < world), so up to world-1 samples
//                      are seen twice per epoch;
//   drop_last = true:  the tail (n mod world samples) is dropped.
// Rank r takes positions r, r + world, r + 2*world, ... of that order. Every
// rank therefore has exactly local_size() samples and num_batches() batches, so
// no rank waits in a collective that another never calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace cx::train {

class DistributedSampler {
 public:
  // num_replicas/rank < 0: take them from the default process group (which
  // must exist). Throws InvalidArgument for impossible combinations.
  DistributedSampler(int64_t dataset_size, bool shuffle = true, uint64_t seed = 0, bool drop_last = false,
                     int num_replicas = -1, int rank = -1);

  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // This rank's indices for the current epoch (local_size() of them).
  const std::vector<int64_t>& get_indices() const { return indices_; }

  size_t local_size() const { return local_; }
  size_t total_size() const { return n_; }          // the data set's size
  size_t padded_size() const { return local_ * replicas_; }  // all ranks' samples together
  int num_replicas() const { return replicas_; }
  int rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  bool drop_last() const { return drop_last_; }
  uint64_t seed() const { return seed_; }

 private:
  void build();

  size_t n_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  int replicas_, rank_;
  size_t local_ = 0;
  int64_t epoch_ = 0;
  std::vector<int64_t> indices_;
};

// The Python constructor's form: num_replicas and rank absent (nullopt) take the default process group's; given,
// they must be valid (InvalidArgument: a negative value is not a way to ask for the group's).
std::shared_ptr<DistributedSampler> make_sampler(int64_t dataset_size, bool shuffle, uint64_t seed, bool drop_last,
                                                 std::optional<int> num_replicas, std::optional<int> rank);

class DistributedBatchIterator {
 public:
  // Batches of batch_size of the sampler's indices, in order; the last one is
  // shorter unless drop_last (then it is skipped).
  DistributedBatchIterator(std::shared_ptr<DistributedSampler> sampler, size_t batch_size, bool drop_last = false);

  bool has_next() const { return pos_ < num_batches_; }
  // Indices of the next batch; throws InvalidArgument when the epoch is over.
  std::vector<int64_t> next();
  // The same without a copy: (pointer into the sampler's indices, count).
  std::pair<const int64_t*, size_t> next_view();
  // sampler.set_epoch(epoch) and back to the first batch.
  void reset(int64_t epoch);
  // Back to the first batch of the current epoch (Python iteration).
  void rewind() { pos_ = 0; }

  size_t num_batches() const { return num_batches_; }
  size_t batch_size() const { return batch_size_; }
  bool drop_last() const { return drop_last_; }
  // Batches already handed out this epoch (checkpoints store it).
  size_t position() const { return pos_; }
  void set_position(size_t pos);
  const std::shared_ptr<DistributedSampler>& sampler() const { return sampler_; }

 private:
  void recount();

  std::shared_ptr<DistributedSampler> sampler_;
  size_t batch_size_;
  bool drop_last_;
  size_t num_batches_ = 0;
  size_t pos_ = 0;
};

}  // namespace cx::train
