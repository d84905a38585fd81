// defines: ema_update, the update of cx.callbacks.EMA's shadow weights
// (python/pycyxwiz/callbacks.py): shadow = decay * shadow + (1 - decay) * params
// over the flat parameter buffer, in one pass; and ParameterAverages, which the
// CPU engine uses to make that update after every optimizer step where it costs
// least.
//
// ema_update works in float32, each product rounded, then their sum: what NumPy
// computes for np.float32(decay) * shadow + np.float32(1 - decay) * params, bit
// for bit, so a test can check it against the plain recurrence. Compiled for
// AVX2 and for baseline x86-64 (target_clones, picked at load time), neither
// with FMA, so the compiler cannot fuse the multiply and the add; split over the
// model math's threads where a process has several (nn/parallel.h), which
// changes no element's arithmetic.
//
// Note [EMA off the critical path]
// The update streams the shadow and the parameters: 2.4 MB for the 200k
// parameters of the MLP benchmark, about 35 us, 3-4% of its 1 ms step, and
// memory-bound (no faster kernel exists). The update owed for step k only needs
// the parameters as step k left them, and they do not change until step k+1's
// optimizer step. So the engine settles it in step k+1 after backward, while
// DDP's bucket all-reduces are in flight and the trainer's thread would only
// wait for them (with one rank, or under ZeRO-1, which reduces nothing during
// backward, it is simply paid there). Whoever reads a shadow or writes the
// parameters between steps settles first (TrainerCore::settle_ema: the EMA
// callback's accessors, checkpoints, the end of fit); Python pays nothing per step.
// Folding the update into the optimizer's pass (the new parameter is in a
// register there) was measured and left out: it saves the parameters' reread,
// about 20 of the 42 us per step of 203k parameters from L3 (2% of a 1.1 ms
// step, one rank), but it would put the whole update on the critical path on
// more than one rank, where it now hides in the all-reduce's wait, and it
// would thread a train/ concept through every optimizer's kernel in nn/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cx::train {

void ema_update(float* shadow, const float* params, size_t n, double decay);

class ParameterAverages {
 public:
  // shadow (n floats, the parameters' count) is updated after every step until
  // clear(); its owner keeps it alive until then.
  void add(float* shadow, size_t n, double decay) { avgs_.push_back(Avg{shadow, n, decay}); }
  void clear() {
    avgs_.clear();
    owed_ = false;
  }
  bool empty() const { return avgs_.empty(); }
  // An optimizer step happened: every shadow owes an update.
  void owe() { owed_ = !avgs_.empty(); }
  // Makes the owed update from `params`, as the step left them (Note [EMA off the critical path]).
  void settle(const float* params) {
    if (!owed_) return;
    for (const Avg& a : avgs_) ema_update(a.shadow, params, a.n, a.decay);
    owed_ = false;
  }

 private:
  struct Avg {
    float* shadow;
    size_t n;
    double decay;
  };
  std::vector<Avg> avgs_;
  bool owed_ = false;
};

}  // namespace cx::train
