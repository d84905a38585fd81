// defines: chunk_count / chunk_at, the pipelining unit shared by the chunked algorithms.
#pragma once

#include <algorithm>
#include <cstddef>

namespace cx::distributed::algo {

inline size_t chunk_count(size_t bytes, size_t chunk) { return bytes == 0 ? 1 : (bytes + chunk - 1) / chunk; }

// Byte range [*off, *off + *n) of chunk c of a `bytes`-long block.
inline void chunk_at(size_t bytes, size_t chunk, size_t c, size_t* off, size_t* n) {
  *off = c * chunk;
  *n = std::min(bytes - std::min(bytes, *off), chunk);
}

}  // namespace cx::distributed::algo
