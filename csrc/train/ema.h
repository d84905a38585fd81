// defines: ema_update, the per-step update of cx.callbacks.EMA's shadow weights
// (python/pycyxwiz/callbacks.py): shadow = decay * shadow + (1 - decay) * params
// over the flat parameter buffer, in one pass.
//
// In float32, each product rounded, then their sum: what NumPy computes for
// np.float32(decay) * shadow + np.float32(1 - decay) * params, bit for bit, so a
// test can check it against the plain recurrence. The loop carries no target
// attribute: baseline x86-64 has no FMA, so the compiler cannot fuse the
// multiply and the add (it vectorises with SSE2, four floats at a time: about
// 25 us for 200k parameters here, against a step of milliseconds).
#pragma once

#include <cstddef>

namespace cx::train {

void ema_update(float* shadow, const float* params, size_t n, double decay);

}  // namespace cx::train
