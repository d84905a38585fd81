// defines: Store, what a process group needs of its rendezvous store, whoever
// keeps the keys: our own (StoreClient talking to rank 0's StoreServer,
// store.h) or a framework's (ExternalStore over PyTorch's TCPStore, FileStore
// or PrefixStore, external_store.h).
//
// A group uses its store at init (claim, publish and read addresses, agree on
// tuning), on failure (Note [Failures reach every rank through the store] in
// store.h; Note [Flight recorder] in process_group.h), and at finalize (Note
// [Collective fingerprint]). Every call takes a deadline; none waits past it.
#pragma once

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "distributed/types.h"

namespace cx::distributed {

// How Store::wait_keys waits.
struct WaitKeys {
  int64_t request_ms = 1000;     // the deadline of each look at the store
  bool stop_on_failure = true;   // ask check_failed() between rounds: a failed rank ends the wait (throws)
  const std::atomic<bool>* cancel = nullptr;  // set: stop at the next round, with what came
};

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value, const Deadline& dl) = 0;
  // Blocks until the key exists, a rank reported a failure (fail(): that
  // error), or the deadline passes (TimeoutError whose message is `waiting_for`).
  virtual std::string get(const std::string& key, const Deadline& dl, const std::string& waiting_for) = 0;
  // The value, or nullopt if the key is not set; never waits for it.
  virtual std::optional<std::string> try_get(const std::string& key, const Deadline& dl) = 0;
  // Tells every rank waiting in get() (now or later) that the group failed, and
  // why; only the first cause is kept.
  virtual void fail(ErrorKind kind, const std::string& why, const Deadline& dl) = 0;
  // Throws the failure a rank reported (fail()), if any.
  virtual void check_failed(const Deadline& dl) = 0;
  // This rank is leaving in order.
  virtual void done(const Deadline& dl) = 0;
  // The address of this host that its peers reach it at (the mesh publishes it).
  virtual std::string local_ip() const = 0;

  // Polls (never a parked get(), whose answer a deadline would leave to arrive
  // later on the connection) until every key is set, `dl` passes or how.cancel
  // is set; returns the values, nullopt for each key still missing. Between
  // rounds it sleeps 1 ms, doubling up to 50 ms: the waits it serves (flight
  // records, finalize, monitored_barrier) are not on a collective's path.
  std::vector<std::optional<std::string>> wait_keys(const std::vector<std::string>& keys, const Deadline& dl,
                                                    const WaitKeys& how = {});
};

}  // namespace cx::distributed
