// defines: the process-wide default group behind cx.distributed.init()/finalize().
#pragma once

#include <memory>

#include "distributed/process_group.h"

namespace cx::distributed {

// Throws Error if a group exists already. Blocks until every rank has joined.
void init_default_group(const Config& cfg);
// Tears the group down (graceful); no-op if there is none. `at_exit`: called
// because the interpreter exits (ProcessGroup::Check::kAtExit).
void finalize_default_group(bool at_exit = false);
// The current group, or nullptr before init()/after finalize().
std::shared_ptr<ProcessGroup> default_group();
// The current group; throws Error "init() has not been called" if none.
std::shared_ptr<ProcessGroup> require_default_group(const char* caller);

}  // namespace cx::distributed
