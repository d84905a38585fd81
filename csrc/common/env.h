// defines: every environment variable pycyxwiz reads (variables(): name,
// meaning, default) and the readers they all go through. Nothing else in
// csrc/ calls getenv (tests/test_env.py checks both, and that the README's
// table lists every variable).
//
// Names: the launch variables are the ones other launchers set (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; mpirun's OMPI_COMM_WORLD_*,
// Slurm's SLURM_*), the guide's DISTRIBUTED_*, and the thread counts every
// numeric library reads; everything pycyxwiz adds is CX_*. The names of older
// releases (PYCYXWIZ_*) still work: pycyxwiz/_env.py copies them to their new
// names at import, with a DeprecationWarning.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

namespace cx::env {

struct Variable {
  const char* name;
  const char* meaning;
  const char* default_value;
};

// Every variable read anywhere (C++ or Python), in the README's order.
const std::vector<Variable>& variables();

// The value of `name`, or null when it is unset or empty. Throws Error for a
// name that is not in variables() (so the table cannot fall behind the code).
const char* get(const char* name);

// An integer in [lo, hi], or nullopt when unset. Throws InvalidArgument
// "environment variable NAME='v' is not valid: expected <meaning>".
std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi, const char* meaning);

// The first of `names` that is set, its name in *which; null if none is.
const char* first_of(std::initializer_list<const char*> names, const char** which);

}  // namespace cx::env
