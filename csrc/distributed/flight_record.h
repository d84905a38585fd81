// defines: FlightEntry and FlightRecord (one rank's flight recorder, what it tells
// the others of itself: Note [Flight recorder] in process_group.h), their wire
// encoding, the fingerprint step (Note [Collective fingerprint]), and the
// comparisons of several ranks' records that name where they diverged.
// Knows nothing of the store or the group: diagnostics.h moves the records.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "distributed/transport/transport.h"

namespace cx::distributed {

// One operation in the flight recorder (Note [Flight recorder]).
struct FlightEntry {
  enum State : uint8_t { kQueued = 0, kRunning = 1, kDone = 2, kFailed = 3 };
  uint64_t op = 0;           // number among all operations of this rank (0: empty slot)
  OpDesc desc;
  uint64_t fingerprint = 0;  // after this collective (send/recv: unchanged)
  int64_t submit_us = 0, start_us = 0, end_us = 0;  // wall clock, microseconds
  State state = kQueued;
};

// What one rank tells the others of itself (in the store, on failure and at finalize).
struct FlightRecord {
  int rank = -1;
  bool failed = false;       // its group was poisoned
  uint64_t fingerprint = 0;
  uint64_t collectives = 0;  // how many it submitted
  std::vector<uint64_t> sent, recvd;  // point-to-point messages per peer
  std::vector<FlightEntry> entries;   // oldest first
  std::string error;                  // its error, if failed

  std::string encode() const;
  static std::optional<FlightRecord> decode(const std::string& bytes);
};

int64_t now_us();  // wall clock, for FlightEntry's times

// The running fingerprint `h` folded with one more collective (Note [Collective fingerprint]).
uint64_t fold(uint64_t h, const OpDesc& d);

// "2, 3"
std::string join_ranks(const std::vector<int>& v);

// The first collective (by number) that `a` and `b` both recorded and called
// differently; nullopt if their records agree where they overlap.
std::optional<uint64_t> first_difference(const FlightRecord& a, const FlightRecord& b);

// "the first call that differs is collective #5: rank 0 called ..., rank 1 called ..."
std::string name_difference(const std::vector<std::optional<FlightRecord>>& recs, uint64_t seq);

// " What each rank was last doing (flight recorder, newest last): [rank 0: ...] ..."
std::string what_each_was_doing(const std::vector<std::optional<FlightRecord>>& recs);

// What finalize() finds wrong between this rank's record `mine` and a peer's `r`
// (differing collectives, unmatched sends), as sentences; "" when they agree.
// Sets `peer_failed` when `r` is that of a rank that failed earlier.
std::string compare_at_finalize(const FlightRecord& mine, const FlightRecord& r, size_t kept, bool& peer_failed);

}  // namespace cx::distributed
