// defines: KeyValue (set/get of a key-value store that lives elsewhere) and
// ExternalStore, the Store (store_interface.h) a process group uses over it.
//
// Note [Rendezvous through a framework's store]
// Under PyTorch (pycyxwiz.torch) the job already has a store: torch's TCPStore
// holds MASTER_PORT, and each process group gets its own PrefixStore of it. A
// group of ours then meets its peers through that store instead of ours: the
// bindings implement KeyValue by calling the Python store's set/check/get, and
// ExternalStore adds what a group expects of a Store on top of plain keys:
//  - get() waits by polling (1 ms, doubling to 20 ms) until the key or its
//    deadline, so no call into the framework's store blocks for long (it may
//    have a timeout of its own, and its calls hold the Python side's GIL);
//  - fail() writes "cx/failed" (the first cause) and every get() and
//    check_failed() of every rank reads it: a rank that fails in init or later
//    is named at once on the others, as with our store (Note [Failures reach
//    every rank through the store] in store.h). A rank that dies without a word
//    is not seen here; its peers see its closed connections (mesh transport).
// Keys are our own ("addr/3", "group", "cx/fin/1", ...), so two groups must not
// share a key space: torch's PrefixStore per group gives each its own.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "distributed/store/store_interface.h"

namespace cx::distributed {

class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value, or nullopt if the key is not set; returns at once.
  virtual std::optional<std::string> get_if_set(const std::string& key) = 0;
};

class ExternalStore : public Store {
 public:
  // `ip`: the address of this host its peers reach (published by the mesh).
  ExternalStore(std::shared_ptr<KeyValue> kv, std::string ip, int rank);

  void set(const std::string& key, const std::string& value, const Deadline& dl) override;
  std::string get(const std::string& key, const Deadline& dl, const std::string& waiting_for) override;
  std::optional<std::string> try_get(const std::string& key, const Deadline& dl) override;
  void fail(ErrorKind kind, const std::string& why, const Deadline& dl) override;
  void check_failed(const Deadline& dl) override;
  void done(const Deadline& dl) override;
  std::string local_ip() const override { return ip_; }

 private:
  std::shared_ptr<KeyValue> kv_;
  std::string ip_;
  int rank_;
};

}  // namespace cx::distributed
