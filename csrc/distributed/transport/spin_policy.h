// defines: SpinPolicy, how long MeshTransport::wait busy-polls before it sleeps,
// learned from the waits before (Note [Waiting on a busy machine]).
#pragma once

#include <algorithm>
#include <chrono>

namespace cx::distributed {

// Note [Waiting on a busy machine]
// A waiting rank busy-polls its channels for up to CX_SPIN_US before it sleeps
// (futex on its doorbell, or poll()): waking a sleeping thread costs ~90 us on
// these VMs, a spin ~8 us. That holds while the rank has a core to itself. When
// another process wants the core (another job, a data loader, more ranks than
// cores), a spinning rank uses up its share of the core and is preempted; it is
// then runnable but waits for the other process's time slice to end (ms), while a
// rank that slept is woken with preemption (its virtual deadline is earlier) and
// runs within microseconds of its peer's wake-up. Measured on a 2-vCPU VM with
// one busy-loop process per core, 2 ranks, 8 B all_reduce through shared memory:
// medians of 1.6 to 118 us from run to run with the fixed spin, by where the
// scheduler put the ranks (figures with this policy in benchmarks/README.md).
//
// So the spin watches for the sign that the core is taken: two polls of one spin
// that found nothing to do take well under a microsecond apart; a gap of more
// than kLostCore means the thread was off its core (preempted, or its yield gave
// the core away for that long). After such a wait the rank spins only briefly
// (kBackoffSpinUs: a peer running beside us answers within it) for
// a while (kMinBackoff, doubling up to kMaxBackoff while it keeps happening) and
// then sleeps; after that it tries one full spin again. A spin that loses no time to
// others brings the backoff back to kMinBackoff. Independently, spinning only pays
// when the peer comes within the budget: a wait that took far longer than the
// budget (the peer was computing) halves the next budget, down to an eighth; one
// that ended within the full budget restores it.
//
// Measured side by side with the fixed spin (same machine, load 10-15, 2 busy-loop
// processes, 3 alternating rounds; benchmarks/README.md, "Busy machines"): over
// TCP 1.5-7.7x faster at 8 B-4 KiB, level from 4 MiB; through shared memory 1.4x
// at 8 B on 4 ranks, 1.3x at 64 MiB, 0.74x at 256 KiB on 4 ranks. A backoff spin
// of 5 us lost 17x through shared memory on 2 pinned ranks at 8 B (a peer on the
// other core answers within 10-30 us of Python); 25 us won 1.7x there in the next
// run, but that run-to-run spread is as large as the effect. Open MPI, which
// never sleeps, still answers 8 B on 4 ranks 3-10x sooner when its ranks share
// the cores. Most of that gap is where the ranks run, not how they wait: mpirun
// keeps its ranks in one session, our launcher (as torchrun) gives each its own,
// and the scheduler (autogroup) shares the CPU among sessions first, so between
// sessions neither the sched_yield below nor a sleep hands the core to the peer
// waited for. In one session (launch --one-session) 8 B on 4 ranks took 17 us
// against 104, Open MPI 14 (Note [One session or one per rank] in
// pycyxwiz/launch.py).
// The 256 KiB loss on 4 ranks is not the budget's halving: without it (same
// machine, --busy 2, 4 ranks through shared memory, 3 alternating rounds, load
// 8.5-9.5) 8 B-256 KiB were 0.62-0.70x as fast and 4 MiB 1.30x; with two ranks
// per core a longer spin takes the core from the peer it waits for.
class SpinPolicy {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kLostCore = std::chrono::microseconds(40);
  static constexpr auto kMinBackoff = std::chrono::milliseconds(5);
  static constexpr auto kMaxBackoff = std::chrono::milliseconds(640);
  static constexpr int kBackoffSpinUs = 25;

  explicit SpinPolicy(int max_us) : max_us_(std::max(0, max_us)), budget_us_(max_us_) {}

  // Busy-poll budget of a wait that starts at `now`: while backing off, a few polls
  // only (kBackoffSpinUs), which still catch a peer that runs beside us right now.
  int budget_us(Clock::time_point now) const {
    return now < no_spin_until_ ? std::min(budget_us_, kBackoffSpinUs) : budget_us_;
  }

  // After a wait that started at `start` and ended at `end`: `spun` if it
  // busy-polled at all, `lost_core` if a gap between two of its polls exceeded kLostCore.
  void after_wait(Clock::time_point start, Clock::time_point end, bool spun, bool lost_core) {
    if (!spun) return;
    if (lost_core) {
      no_spin_until_ = end + backoff_;
      backoff_ = std::min<Clock::duration>(backoff_ * 2, kMaxBackoff);
      return;
    }
    backoff_ = kMinBackoff;
    const auto took = end - start;
    if (took <= std::chrono::microseconds(max_us_)) {
      budget_us_ = max_us_;
    } else if (took > std::chrono::microseconds(8 * max_us_)) {
      budget_us_ = std::max(max_us_ / 8, budget_us_ / 2);
    }
  }

 private:
  int max_us_;
  int budget_us_;
  Clock::duration backoff_ = kMinBackoff;
  Clock::time_point no_spin_until_{};
};

}  // namespace cx::distributed
