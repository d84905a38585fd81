#include "distributed/store/store_interface.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace cx::distributed {

std::vector<std::optional<std::string>> Store::wait_keys(const std::vector<std::string>& keys, const Deadline& dl,
                                                         const WaitKeys& how) {
  std::vector<std::optional<std::string>> got(keys.size());
  size_t missing = keys.size();
  int pause_ms = 1;
  for (;;) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (got[i]) continue;
      got[i] = try_get(keys[i], Deadline::after_ms(how.request_ms));
      if (got[i]) --missing;
    }
    if (missing == 0 || dl.expired() || (how.cancel && how.cancel->load())) return got;
    if (how.stop_on_failure) check_failed(Deadline::after_ms(how.request_ms));
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    pause_ms = std::min(pause_ms * 2, 50);
  }
}

}  // namespace cx::distributed
