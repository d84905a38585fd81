#include "distributed/diagnostics.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <vector>

namespace cx::distributed::diagnostics {

namespace {

// The keys `prefix` + rank of every rank from `from` on but `me`.
std::vector<int> others(int world, int me, int from) {
  std::vector<int> v;
  for (int j = from; j < world; ++j)
    if (j != me) v.push_back(j);
  return v;
}

std::vector<std::string> keys_of(const std::string& prefix, const std::vector<int>& ranks) {
  std::vector<std::string> keys;
  for (int j : ranks) keys.push_back(prefix + std::to_string(j));
  return keys;
}

}  // namespace

void publish(Store& store, const std::string& key, const FlightRecord& rec) {
  try {
    store.set(key, rec.encode(), Deadline::after_ms(200));
  } catch (const Error&) {
    // rank 0 (the store) is gone: the peers will say "no record" of us
  }
}

std::pair<ErrorKind, std::string> explain(Store& store, const FlightRecord& mine, int world, ErrorKind kind,
                                          const std::string& msg) {
  const int me = mine.rank;
  std::vector<std::optional<FlightRecord>> recs(static_cast<size_t>(world));
  recs[me] = mine;
  const std::vector<int> peers = others(world, me, 0);
  try {
    WaitKeys how;
    how.request_ms = 200;
    how.stop_on_failure = false;  // the group has failed: that is why we are here
    auto got = store.wait_keys(keys_of("cx/fr/", peers), Deadline::after_ms(kGatherMs), how);
    for (size_t i = 0; i < peers.size(); ++i)
      if (got[i]) recs[peers[i]] = FlightRecord::decode(*got[i]);
  } catch (const Error&) {
    // the store is gone (rank 0 exited): what we have is all there is
  }
  std::optional<uint64_t> first;
  for (int j : peers) {
    if (!recs[j]) continue;
    auto d = first_difference(mine, *recs[j]);
    if (d && (!first || *d < *first)) first = d;
  }
  if (first) {
    return {ErrorKind::kMismatch,
            detail::concat("mismatched collectives: rank ", me, " and its peers called different collectives: ",
                           name_difference(recs, *first),
                           ". Every rank must call the same collectives in the same order with the same count, dtype, "
                           "op and root. (Rank ", me, "'s error: ", msg, ")", what_each_was_doing(recs))};
  }
  const bool ended = !msg.empty() && (msg.back() == '.' || msg.back() == '?');
  return {kind, msg + (ended ? "" : ".") + what_each_was_doing(recs)};
}

void check_at_finalize(Store& store, const FlightRecord& mine, int world, bool full, int64_t wait_ms,
                       int64_t linger_ms, size_t kept) {
  const int me = mine.rank;
  publish(store, "cx/fin/" + std::to_string(me), mine);
  std::vector<std::optional<FlightRecord>> recs(static_cast<size_t>(world));
  std::optional<Error> err;
  if (!mine.failed) {
    // full: waits, like a barrier, up to the operation deadline for every rank to finalize too.
    const Deadline dl = Deadline::after_ms(wait_ms);
    const std::vector<int> peers = others(world, me, 0);
    try {
      auto got = store.wait_keys(keys_of("cx/fin/", peers), dl);
      std::vector<int> missing;
      for (size_t i = 0; i < peers.size(); ++i) {
        if (got[i]) {
          recs[peers[i]] = FlightRecord::decode(*got[i]);
        } else {
          missing.push_back(peers[i]);
        }
      }
      if (full && !missing.empty()) {
        err = TimeoutError(detail::concat("finalize() timed out: rank ", me, " waited ", dl.timeout_ms,
                                          " ms for rank(s) ", join_ranks(missing),
                                          " to call finalize() too (stuck, or still calling collectives this rank "
                                          "does not; raise DISTRIBUTED_OPERATION_TIMEOUT_MS if only slow)"));
      }
    } catch (const Error& e) {
      err = e;
    }
  }
  try {
    store.set("cx/fin-read/" + std::to_string(me), "", Deadline::after_ms(1000));
    if (me == 0) {
      // The store lives in this process: it stays until every rank has read what it needs.
      const int64_t ms = mine.failed || err || !full ? 2000 : linger_ms;
      store.wait_keys(keys_of("cx/fin-read/", others(world, me, 1)), Deadline::after_ms(ms));
    }
  } catch (const Error&) {
    // a rank that died: it has nothing left to read
  }
  if (err) throw *err;
  if (mine.failed) return;  // this rank has raised its error already
  std::string problems;
  bool peer_failed = false;
  for (int j = 0; j < world; ++j) {
    if (j != me && recs[j]) problems += compare_at_finalize(mine, *recs[j], kept, peer_failed);
  }
  if (problems.empty()) return;
  if (!peer_failed) {
    CX_THROW(MismatchError, "mismatched collectives found by finalize() on rank ", me, ":", problems,
             " Every rank must call the same collectives in the same order with the same count, dtype, op and "
             "root.");
  }
  rethrow_as(ErrorKind::kPeerFailed, detail::concat("finalize() on rank ", me, ":", problems));
}

void monitored_barrier(Store& store, int rank, int world, uint64_t n, int64_t timeout_ms) {
  const std::string base = "cx/mb/" + std::to_string(n) + "/";
  const Deadline dl = Deadline::after_ms(timeout_ms);
  store.set(base + std::to_string(rank), "", dl);
  WaitKeys how;
  how.stop_on_failure = false;
  if (rank == 0) {
    const std::vector<int> peers = others(world, 0, 1);
    auto got = store.wait_keys(keys_of(base, peers), dl, how);
    std::vector<int> missing;
    for (size_t i = 0; i < peers.size(); ++i)
      if (!got[i]) missing.push_back(peers[i]);
    store.set(base + "result", join_ranks(missing), Deadline::after_ms(1000));
    if (!missing.empty()) {
      CX_THROW(TimeoutError, "monitored_barrier: rank(s) ", join_ranks(missing), " did not arrive within ", timeout_ms,
               " ms (rank 0 waited for all ", world, " ranks; those are stuck, slower, or not calling "
               "monitored_barrier)");
    }
    return;
  }
  // Rank 0 answers once its own wait is over: allow it that, and some more.
  const Deadline verdict = Deadline::after_ms(timeout_ms + std::max<int64_t>(2000, timeout_ms / 2));
  if (auto v = store.wait_keys({base + "result"}, verdict, how)[0]) {
    if (v->empty()) return;
    CX_THROW(TimeoutError, "monitored_barrier: rank 0 reports that rank(s) ", *v, " did not arrive within ",
             timeout_ms, " ms (seen from rank ", rank, ")");
  }
  CX_THROW(TimeoutError, "monitored_barrier: rank ", rank, " had no answer from rank 0 within ", verdict.timeout_ms,
           " ms: rank 0 did not arrive (stuck, slower, or not calling monitored_barrier)");
}

}  // namespace cx::distributed::diagnostics
