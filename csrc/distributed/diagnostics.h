// defines: what a process group learns through its store when a collective
// fails or the group ends: a failure explained from every rank's flight record
// (Note [Flight recorder] in process_group.h), finalize()'s comparison of the
// ranks' collectives (Note [Collective fingerprint]), and monitored_barrier.
// Each takes this rank's FlightRecord and the store; none touches the group's
// queue or backend.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/error.h"
#include "distributed/flight_record.h"
#include "distributed/store/store_interface.h"

namespace cx::distributed::diagnostics {

// How long a failing rank waits for its peers' records.
constexpr int kGatherMs = 500;

// Puts `rec` under `key` in the store; a store that is gone (rank 0 exited) is
// no error: the peers will say "no record" of this rank.
void publish(Store& store, const std::string& key, const FlightRecord& rec);

// The error a failed collective raises (Note [Flight recorder]): `msg` with what
// each rank was last doing, or, where the records show the ranks called different
// collectives, the MismatchError that names the first difference.
std::pair<ErrorKind, std::string> explain(Store& store, const FlightRecord& mine, int world, ErrorKind kind,
                                          const std::string& msg);

// finalize()'s check (Note [Collective fingerprint]): publishes `mine`, waits up
// to `wait_ms` for every other rank's record (full: a missing rank is a
// TimeoutError), and raises MismatchError, or the error of a rank that failed,
// where they disagree. Rank 0, whose process holds the store, waits up to
// `linger_ms` for every rank to have read what it needs.
void check_at_finalize(Store& store, const FlightRecord& mine, int world, bool full, int64_t wait_ms,
                       int64_t linger_ms, size_t kept);

// Every rank arrives at barrier number `n` within `timeout_ms`, or the ones that
// did not are named (rank 0 collects the arrivals and tells the others).
void monitored_barrier(Store& store, int rank, int world, uint64_t n, int64_t timeout_ms);

}  // namespace cx::distributed::diagnostics
