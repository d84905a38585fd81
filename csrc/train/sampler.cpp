#include "train/sampler.h"

#include <numeric>

#include "common/error.h"
#include "distributed/default_group.h"
#include "nn/rng.h"

namespace cx::train {

DistributedSampler::DistributedSampler(int64_t dataset_size, bool shuffle, uint64_t seed, bool drop_last,
                                       int num_replicas, int rank)
    : shuffle_(shuffle), drop_last_(drop_last), seed_(seed) {
  CX_CHECK(dataset_size >= 0, InvalidArgument, "DistributedSampler: dataset_size must be >= 0, got ", dataset_size);
  n_ = static_cast<size_t>(dataset_size);
  if (num_replicas < 0 || rank < 0) {
    auto g = distributed::default_group();
    CX_CHECK(g != nullptr, InvalidArgument,
             "DistributedSampler: no process group; call cx.distributed.init() first or pass num_replicas= and "
             "rank= explicitly");
    if (num_replicas < 0) num_replicas = g->size();
    if (rank < 0) rank = g->rank();
  }
  CX_CHECK(num_replicas >= 1, InvalidArgument, "DistributedSampler: num_replicas must be >= 1, got ", num_replicas);
  CX_CHECK(rank < num_replicas, InvalidArgument, "DistributedSampler: rank ", rank, " is out of range for ",
           num_replicas, " replicas (valid: 0..", num_replicas - 1, ")");
  replicas_ = num_replicas;
  rank_ = rank;
  local_ = drop_last_ ? n_ / replicas_ : (n_ + replicas_ - 1) / replicas_;
  build();
}

std::shared_ptr<DistributedSampler> make_sampler(int64_t dataset_size, bool shuffle, uint64_t seed, bool drop_last,
                                                 std::optional<int> num_replicas, std::optional<int> rank) {
  CX_CHECK(!num_replicas || *num_replicas >= 1, InvalidArgument, "DistributedSampler: num_replicas must be >= 1, got ",
           *num_replicas);
  CX_CHECK(!rank || *rank >= 0, InvalidArgument, "DistributedSampler: rank must be >= 0, got ", *rank);
  return std::make_shared<DistributedSampler>(dataset_size, shuffle, seed, drop_last, num_replicas.value_or(-1),
                                              rank.value_or(-1));
}

void DistributedSampler::set_epoch(int64_t epoch) {
  CX_CHECK(epoch >= 0, InvalidArgument, "DistributedSampler.set_epoch: epoch must be >= 0, got ", epoch);
  if (epoch == epoch_) return;
  epoch_ = epoch;
  build();
}

void DistributedSampler::build() {
  std::vector<int64_t> order(n_);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (shuffle_ && n_ > 1) {
    // One stream per (seed, epoch): mix both through a SplitMix64 step so that
    // nearby seeds and epochs give unrelated permutations.
    nn::Rng mix(seed_ ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(epoch_ + 1)));
    nn::Rng rng(mix.next());
    for (size_t i = n_ - 1; i > 0; --i) {
      // Lemire's multiply-shift: unbiased enough for any n < 2^32, and exact on every platform.
      size_t j = static_cast<size_t>((static_cast<unsigned __int128>(rng.next()) * (i + 1)) >> 64);
      std::swap(order[i], order[j]);
    }
  }
  indices_.clear();
  indices_.reserve(local_);
  // Note [Sampler layout]: position p of the padded order is order[p mod n].
  for (size_t k = 0; k < local_; ++k) {
    size_t p = k * replicas_ + rank_;
    indices_.push_back(order[p % n_]);
  }
}

DistributedBatchIterator::DistributedBatchIterator(std::shared_ptr<DistributedSampler> sampler, size_t batch_size,
                                                   bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  CX_CHECK(sampler_ != nullptr, InvalidArgument, "DistributedBatchIterator: sampler is None");
  CX_CHECK(batch_size_ >= 1, InvalidArgument, "DistributedBatchIterator: batch_size must be >= 1, got ", batch_size_);
  recount();
}

void DistributedBatchIterator::recount() {
  size_t n = sampler_->local_size();
  num_batches_ = drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

std::pair<const int64_t*, size_t> DistributedBatchIterator::next_view() {
  CX_CHECK(has_next(), InvalidArgument, "DistributedBatchIterator.next: all ", num_batches_,
           " batches of epoch ", sampler_->epoch(), " have been returned; call reset(epoch) to start the next epoch");
  const auto& idx = sampler_->get_indices();
  size_t begin = pos_ * batch_size_;
  size_t count = std::min(batch_size_, idx.size() - begin);
  ++pos_;
  return {idx.data() + begin, count};
}

std::vector<int64_t> DistributedBatchIterator::next() {
  auto [p, n] = next_view();
  return std::vector<int64_t>(p, p + n);
}

void DistributedBatchIterator::reset(int64_t epoch) {
  sampler_->set_epoch(epoch);
  recount();
  pos_ = 0;
}

void DistributedBatchIterator::set_position(size_t pos) {
  CX_CHECK(pos <= num_batches_, InvalidArgument, "DistributedBatchIterator.set_position: position ", pos,
           " is past the ", num_batches_, " batches of an epoch");
  pos_ = pos;
}

}  // namespace cx::train
