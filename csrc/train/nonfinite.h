// defines: NonFiniteMode (DDPConfig.nonfinite) and NonFiniteCheck, how
// DistributedDataParallel finds, agrees on and names a step whose gradient
// went NaN or inf.
//
// Note [Non-finite gradients]
// A NaN or inf in one rank's gradient becomes, through the average, a NaN or
// inf in every rank's parameters at the next step, and a sum of finite
// gradients can still overflow (float16 tops out at 65504). Each step, on the
// plain path (no communication hook, more than one rank: the default), with the
// fp16/bf16 hooks and under ZeRO-1, DDP reads nothing itself:
//   - fused (Note [Fused non-finite check] in distributed/reduce_probe.h): each
//     bucket goes to all_reduce_probed, whose reduction kernels test the values
//     they add in the same loop: each rank finishes a part of the average and
//     learns whether that part is finite, and each rank's own value of each
//     element is tested exactly once (by itself, or, for what it sends unread,
//     by the rank that adds it), which records where it was not finite (rare).
//     Where the algorithm carried the result flags to every rank (the ring,
//     recursive doubling on a power of two) every rank already knows, per
//     bucket, whether the average is finite, and nothing more travels. Else
//     (halving-doubling, the fold of recursive doubling, hierarchical:
//     ReduceProbe::local_only, the same on every rank) sync_gradients' SUM
//     all-reduce of world + buckets float64s, once the buckets are done, does
//     the OR: slot world + b counts the ranks whose part of bucket b's average
//     is not finite (slot r: the ranks that saw rank r's own values bad).
//     Every rank gets the same flags and takes the same decision. Only a bad
//     step does more: the flagged buckets of the average (the same bytes on
//     every rank) are read to name the parameters, and one all-reduce of
//     world * parameters counts tells every rank which ranks' own values were
//     bad, and where (decide_fused).
//   - with the fp16/bf16 hooks the same probe is filled by the casts to and from
//     the wire type (Note [Cast on the wire] in distributed/algorithms/allreduce.cpp):
//     narrowing tests this rank's own values, widening the whole result on every
//     rank, so the flags are every rank's already and nothing more travels.
//   - ZeRO-1 (zero.cpp): its reduce-scatter tests what it adds the same way
//     (ProcessGroup::reduce_scatter_probed; the tail all-reduce, all_reduce_probed);
//     each rank finishes only its shard, so one SUM all-reduce of world + 1
//     float64s always agrees (decide_sharded); a bad step then counts each shard
//     per parameter and all-reduces (world + 1) * parameters counts.
//   - a bucket reduced twice in a step (the first accumulation cycle): Note [A
//     bucket reduced twice] in nonfinite.cpp.
//   - the switches that choose the path (ddp._fused_check, _agree_by_message,
//     for benchmarks and tests) decide what the gradient collectives carry (the
//     ring's flag words, the message's size), so setting one is collective: a
//     small all-reduce compares every rank's choice and a MismatchError names the
//     ranks on every rank where they differ (DistributedDataParallel::set_check_path).
//   - inside join() the whole buffer's SUM all-reduce is probed on every rank,
//     the joined ones (adding zeros) too, which then answer the same agreement
//     as ZeRO-1's (decide_sharded; rank 0 counts the average on a bad step):
//     the ranks whose own gradient was bad are named there as well.
// Elsewhere (PowerSGD, one rank, or the benchmark's "scan"/"read" variants) the
// check reads for itself:
//   - own contribution: when a bucket is handed to its reduction (launch(), on
//     the thread running backward, the moment the bucket's last gradient is
//     written, so it is still in cache), one pass over it computes the largest
//     |g| as bits (nn::kernels::max_abs_bits: Note [Finding non-finite values
//     by their bits]), which says at once whether any value is inf/NaN. Only a
//     bucket found bad is looked at again, parameter by parameter, to name
//     them. The PowerSGD hook folds its own check into the loop that adds the
//     residual (comm_hooks.cpp).
//   - agreement (by message, the default): sync_gradients queues one SUM
//     all-reduce of world + 2 * buckets float64s right behind the last bucket (a few hundred
//     bytes on the group's comm thread, so it follows the buckets without a
//     gap): slot r is rank r's count of bad buckets, then per bucket how many
//     ranks sent non-finite values and the sum over ranks of max |g|. Every
//     rank gets the same numbers and so takes the same decision: no rank steps
//     while another skips. (Appending a flag word to each bucket instead would
//     need a packing copy, since buckets are slices of the flat gradient
//     buffer reduced in place: more bytes touched than this message.)
//   - the averaged gradient: a bucket can only hold inf/NaN after the average
//     if some rank sent one, or if the sum over ranks of max |g| reaches the
//     wire type's range (float32's, or 65504 * world for the fp16 hook, which
//     divides by world before the cast); only such buckets are read again,
//     parameter by parameter. The result is the same bytes on every rank
//     (the all-gather copies it; replicas that differ would be a bug that
//     check_every_n_steps reports), so every rank names the same parameters.
//     Under ZeRO-1 unfused ("scan") each rank holds only its shard of the
//     average: it counts its shard's non-finite values per parameter (one pass
//     over 1/world of the buffer) and those counts ride in the same message.
//   - the alternative (ddp._agree_by_message = False, kept for the benchmark):
//     no message; every rank reads the whole average (the same bytes
//     everywhere, so the same verdict) and only a bad step communicates, to
//     name the ranks. It trades the small all-reduce's latency for a second
//     pass over the gradients; benchmarks/checks.py found no clear winner on
//     a busy 2-core machine (README "Benchmarks"), so the message, which reads
//     the gradients once, is the default.
// DDPConfig.nonfinite then: "raise" (NonFiniteError on every rank, the step
// not taken), "skip" (the optimizer step is not taken, on every rank alike,
// and counted: ddp.skipped_steps), "warn" (RuntimeWarning, the step taken),
// "off" (no scan, no message). Measured cost: README "Benchmarks" (benchmarks/checks.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "distributed/process_group.h"
#include "nn/sequential.h"
#include "train/buckets.h"

namespace cx::train {

enum class NonFiniteMode { kRaise, kSkip, kWarn, kOff };

// "raise", "skip", "warn", "off" (case-insensitive); InvalidArgument naming
// `who` and the choices otherwise.
NonFiniteMode parse_nonfinite(const std::string& name, const std::string& who);
const char* nonfinite_name(NonFiniteMode m);

// What one step's check found; the same on every rank (but `own`).
struct NonFiniteVerdict {
  bool bad = false;                                  // the averaged gradient holds inf or NaN
  std::vector<std::pair<size_t, size_t>> params;     // (parameter tensor, non-finite values) of the average
  std::vector<int> ranks;                            // ranks whose own gradient was not finite (empty: unknown
  bool ranks_known = true;                           //   or none; ranks_known false under join())
  std::vector<std::pair<size_t, size_t>> own;        // this rank's own non-finite parameters (index, values)
  int averaged_over = 0;                             // the ranks the average is over (0: all; join(): the active)
};

class NonFiniteCheck {
 public:
  NonFiniteCheck(std::shared_ptr<nn::SequentialModel> model, std::vector<Bucket> buckets, int world, int rank);

  // The probe bucket b's reduction fills (the fused path: Note [Fused
  // non-finite check] in distributed/reduce_probe.h); it blames this rank
  // unless the bucket holds an earlier average that was already bad.
  distributed::ReduceProbe& probe(size_t b);
  // Bucket b's own contribution in `g` (the flat gradient buffer), about to be reduced.
  void scan(size_t b, const float* g);
  // A backward is about to add into the buffer `g`: buckets reduced since the
  // last call hold an average; note which are not finite (Note [A bucket reduced twice]).
  void before_accumulating(const float* g);
  // Every bucket's (ZeRO-1 and join(), which reduce the whole buffer at once).
  void scan_all(const float* g);
  // The numbers to SUM over ranks (float64): world + 2 * buckets, then, with
  // `shard` (ZeRO-1), one per parameter tensor: the non-finite values of this
  // rank's shard [offset, offset+count) of the averaged gradient `g`.
  std::vector<double>& pack(const float* g = nullptr, size_t shard_offset = 0, size_t shard_count = 0,
                            bool shard = false);
  // The verdict from the summed message (in place of pack()'s buffer) and the
  // averaged gradient `g` (the same on every rank unless `shard`); `limit`: a
  // bucket whose summed max |g| reaches it may have overflowed. Resets the
  // scan for the next step.
  NonFiniteVerdict decide(const float* g, double limit, bool shard = false);
  // The fused path's message (world + buckets float64s, SUM over ranks),
  // written into `msg` by the comm thread right before it travels, once every
  // bucket's probe is filled: slot r counts the ranks that saw rank r's own
  // values bad, slot world + b the ranks that finished a non-finite part of
  // bucket b's average.
  // False (and nothing travels, on every rank alike) where every bucket's
  // reduction carried its result flags to every rank (ReduceProbe::local_only).
  size_t fused_size() const { return static_cast<size_t>(world_) + buckets_.size(); }
  bool pack_fused(double* msg);
  // The verdict from the summed message; a bad step (rare) reads the flagged
  // buckets of the average and all-reduces world * parameters counts of what
  // each rank sent (collective: every rank gets here alike). Resets.
  NonFiniteVerdict decide_fused(const double* msg, const float* g, distributed::ProcessGroup& group);
  // ZeRO-1, fused (and join(), whose whole-buffer all-reduce fills it on every
  // rank: DistributedDataParallel::decide_joined): the probe its reduce-scatter of
  // the whole buffer fills (cleared; element indices of the flat buffer), and the
  // verdict (collective):
  // one SUM all-reduce of world + 1 float64s (slot r: the ranks that saw rank r's
  // own values bad; slot world: the ranks that finished a non-finite part of the
  // average); only a bad step does more: each rank counts its shard
  // [offset, offset+count) of the average per parameter, and one all-reduce of
  // (world + 1) * parameters counts names what each rank sent and where the
  // average went bad, the same on every rank. Resets.
  distributed::ReduceProbe& shard_probe();
  NonFiniteVerdict decide_sharded(const float* g, size_t shard_offset, size_t shard_count,
                                  distributed::ProcessGroup& group);
  // join() unfused: no agreement message; the averaged gradient (the same on
  // every active rank) is read whole. Resets the scan.
  NonFiniteVerdict decide_local(const float* g);
  // A bad step found by decide_local on every rank: one SUM all-reduce of world float64s names the ranks
  // whose own gradient was bad (collective; every rank calls it for the same step).
  void name_ranks(NonFiniteVerdict& v, distributed::ProcessGroup& group);

  // The error/warning text: who ("DistributedDataParallel (rank R)"), step,
  // what was found, the likely cause (`fp16`: the fp16 hook was on) and what
  // `taken` says of the step.
  std::string describe(const NonFiniteVerdict& v, const std::string& who, uint64_t step, bool fp16,
                       const std::string& outcome) const;

 private:
  void agree_on_counts(std::vector<double>& counts, size_t np, distributed::ProcessGroup& group,
                       NonFiniteVerdict& v) const;
  std::vector<std::pair<size_t, size_t>> count_params(const float* g, size_t first, size_t last, size_t lo,
                                                      size_t hi) const;
  // Adds, per parameter, the elements of `bad`'s ranges (shifted by `offset`) to counts[rank * params + i].
  void count_ranges(const std::vector<distributed::BadValues>& bad, size_t offset, std::vector<double>& counts) const;
  void reset();

  std::shared_ptr<nn::SequentialModel> model_;
  std::vector<Bucket> buckets_;
  int world_, rank_;
  std::vector<uint32_t> own_bits_;                   // per bucket: max |g| bits since the last verdict
  std::vector<distributed::ReduceProbe> probes_;     // per bucket: what its reductions found (fused path)
  distributed::ReduceProbe shard_probe_;             // ZeRO-1's reduce-scatter (fused path)
  bool summed_ = false;                              // pack_fused's message travelled
  std::vector<char> reduced_, checked_bad_;          // per bucket: reduced since before_accumulating; its
                                                     //   average was found not finite (this step)
  std::vector<std::pair<size_t, size_t>> own_;       // this rank's non-finite parameters since then
  std::vector<double> msg_;
};

// The parameter tensor as a message names it: "2 (layer 2 Linear.weight)".
std::string param_name(const nn::SequentialModel& m, size_t i);

}  // namespace cx::train
