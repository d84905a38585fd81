#include "distributed/store/external_store.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace cx::distributed {

namespace {
constexpr const char* kFailedKey = "cx/failed";  // u8 ErrorKind + why
}  // namespace

ExternalStore::ExternalStore(std::shared_ptr<KeyValue> kv, std::string ip, int rank)
    : kv_(std::move(kv)), ip_(std::move(ip)), rank_(rank) {}

void ExternalStore::set(const std::string& key, const std::string& value, const Deadline&) { kv_->set(key, value); }

std::optional<std::string> ExternalStore::try_get(const std::string& key, const Deadline&) {
  return kv_->get_if_set(key);
}

std::string ExternalStore::get(const std::string& key, const Deadline& dl, const std::string& waiting_for) {
  int pause_ms = 1;
  for (;;) {
    if (auto v = kv_->get_if_set(key)) return *v;
    check_failed(dl);
    if (dl.expired()) CX_THROW(TimeoutError, waiting_for, " (rank ", rank_, " waited ", dl.timeout_ms, " ms)");
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(pause_ms, std::max(dl.remaining_ms(20), 1))));
    pause_ms = std::min(pause_ms * 2, 20);
  }
}

void ExternalStore::fail(ErrorKind kind, const std::string& why, const Deadline&) {
  if (kv_->get_if_set(kFailedKey)) return;  // the first cause is the one the ranks name
  kv_->set(kFailedKey, std::string(1, static_cast<char>(kind)) + why);
}

void ExternalStore::check_failed(const Deadline&) {
  auto v = kv_->get_if_set(kFailedKey);
  if (!v || v->empty()) return;
  rethrow_as(static_cast<ErrorKind>(static_cast<uint8_t>((*v)[0])), v->substr(1));
}

void ExternalStore::done(const Deadline&) {}

}  // namespace cx::distributed
