// defines: ema_update, the per-step update of cx.callbacks.EMA's shadow weights
// (python/pycyxwiz/callbacks.py): shadow = decay * shadow + (1 - decay) * params
// over the flat parameter buffer, in one pass.
//
// In float32, each product rounded, then their sum: what NumPy computes for
// np.float32(decay) * shadow + np.float32(1 - decay) * params, bit for bit, so a
// test can check it against the plain recurrence. Compiled for AVX2 and for
// baseline x86-64 (target_clones, picked at load time), neither with FMA, so
// the compiler cannot fuse the multiply and the add. It streams 2.4 MB for the
// 200k parameters of the MLP benchmark: about 40 us with AVX2 here (SSE2:
// twice that), against a step of about 2 ms.
#pragma once

#include <cstddef>

namespace cx::train {

void ema_update(float* shadow, const float* params, size_t n, double decay);

}  // namespace cx::train
