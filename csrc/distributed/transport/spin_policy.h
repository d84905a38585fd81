// defines: SpinPolicy, how long MeshTransport::wait busy-polls before it sleeps,
// learned from the waits before (Note [Waiting on a busy machine]); OthersOnTheCpus,
// whether other programs want the CPUs (Note [Ranks that share cores with other programs]).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

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

// Note [Ranks that share cores with other programs]
// With more ranks on a host than cores, a waiting rank's peer often waits for the rank's own core. On an
// otherwise idle machine the spin's sched_yield hands that core over at once (4 ranks on 2 vCPUs: 3-7 us for
// 8 B through shared memory), and sleeping instead costs tens of us (a wake-up that crosses to an idle vCPU).
// Beside busy programs (other sessions: another job, data loaders) a yield hands the core to whoever the
// scheduler prefers, often the busy program, for its whole time slice: 62-75 us a call in most runs, where
// sleeping at once (no spin) took 14-36 us, since a woken rank is run promptly. So a rank that shares cores
// with its peers (more local ranks than cores) and waits on shared-memory rings sleeps without spinning while
// other threads are runnable: /proc/loadavg's count of runnable threads, less the ranks on this host, at least
// one, looked at every kLook. Measured with 2 busy-loop processes on 2 vCPUs (benchmarks/README.md, "Busy, 4
// ranks, 8 B"): 8 B all_reduce on 4 ranks 74 -> 39 us, 4 KiB 65 -> 23 us (Open MPI 8.8 and 25), level from 1
// MiB. The count also holds the job's own other threads (a trainer's communication thread while its compute
// thread runs), so in training on an idle machine the rule may take hold: the 4-rank training benchmark
// measured level there (145k against 143k samples/s, then 143k against 143k, base first). In a container
// /proc/loadavg counts the whole machine's threads, so ranks there sleep at once more often than they need to
// (a slower wait, never a wrong result); without /proc the rule never applies. Not over TCP,
// where sleeping at once was slower (57 against 31 us), nor with a core per rank, where the peer runs
// elsewhere and the spin finds it (2 ranks: 0.8 us against 0.9-7.0 us sleeping).
class OthersOnTheCpus {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kLook = std::chrono::milliseconds(10);

  explicit OthersOnTheCpus(int local_ranks) : local_(local_ranks) {}
  // Whether threads besides our ranks were runnable when last looked (reads /proc/loadavg past kLook).
  bool runnable(Clock::time_point now);
  // For the tests: waits of this process that slept at once because of others (all its groups).
  static void count_sleep();
  static uint64_t sleeps();

 private:
  int local_;
  Clock::time_point next_{};
  bool others_ = false;
};

// Note [Two ranks that wake each other]
// A wait that outlasts the spin sleeps, and waking a sleeping rank costs ~90-130 us on these VMs (its vCPU went
// idle). If that is more than the peer's spin budget, the two feed each other: the woken rank arrives at the
// next collective late by its wake-up, so its peer's wait outlasts its spin and sleeps too, and so on; each
// wait then takes ~130 us, more than the full budget, so the rule that restores the budget never fires. One
// slow moment (start-up, a long wait that halved the budget) starts it for good. Seen in `python -m
// benchmarks.torch_backend`: a column's 8 B all_reduce at 105-146 us in every call of a run, where the same
// column took 4-8 us in other runs; 7 of 12 columns in six runs of `--parts allreduce --worlds 2 --sizes 8 64K
// --rounds 1 --columns cyxwiz cyxwiz-shm`, none with CX_SPIN_US=500. So a wait that ended asleep within 8 times
// the full budget sets the next budget to 1.5 times what it took (at most 8 times the full budget): the next
// wait outlasts the peer's wake-up and does not sleep, which ends the cycle; the first wait that ends within
// the full budget restores it. After the change: 1 of 12 columns stuck (at 46 us). Only on a machine where no
// other programs' threads run (OthersOnTheCpus): beside busy programs a longer spin keeps the core from the peer
// and loses (2 ranks beside 2 busy loops: a steady 32 us a call against 0.9 us, found before this condition).
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

  // After a wait that started at `start` and ended at `end`: `spun` if it busy-polled at all, `lost_core` if a
  // gap between two of its polls exceeded kLostCore, `slept` if it ended asleep.
  void after_wait(Clock::time_point start, Clock::time_point end, bool spun, bool lost_core, bool slept) {
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
    } else if (slept) {  // Note [Two ranks that wake each other]
      const auto us = std::chrono::duration_cast<std::chrono::microseconds>(took).count();
      budget_us_ = static_cast<int>(std::min<long long>(8LL * max_us_, us + us / 2));
    }
  }

 private:
  int max_us_;
  int budget_us_;
  Clock::duration backoff_ = kMinBackoff;
  Clock::time_point no_spin_until_{};
};

}  // namespace cx::distributed
