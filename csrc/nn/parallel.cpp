#include "nn/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cx::nn {

namespace {

// How long a worker spins for the next part before it sleeps, and the caller for the workers before it does
// (Note [One pool for the model math]): the layers of a step follow each other within microseconds, a wake-up
// costs tens of them on these VMs.
constexpr auto kSpin = std::chrono::microseconds(100);

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Workers 1 .. size-1; the caller of run() is part 0. Each run() publishes a ticket, (generation << 16) | parts:
// worker k takes part k of it if k < parts. A worker that is not needed by a run never reads its job, so the
// caller may publish the next job as soon as the parts of this one have ended.
class Pool {
 public:
  explicit Pool(int size) : size_(static_cast<size_t>(std::max(1, size))) {
    threads_.reserve(size_ - 1);
    for (size_t k = 1; k < size_; ++k) {
      try {
        threads_.emplace_back([this, k] { work(k); });
      } catch (const std::system_error&) {  // no more threads to be had: a smaller pool
        break;
      }
    }
    size_ = threads_.size() + 1;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  size_t size() const { return size_; }
  bool try_acquire() { return !busy_.exchange(true, std::memory_order_acquire); }
  void release() { busy_.store(false, std::memory_order_release); }

  // part(i) for i in [0, parts), parts <= size(); i = 0 here. Rethrows the lowest part's exception.
  void run(size_t parts, const std::function<void(size_t)>& part) {
    errors_.assign(parts, nullptr);
    job_ = &part;
    remaining_.store(parts - 1, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 16) + 1;
    ticket_.store(gen << 16 | parts, std::memory_order_seq_cst);
    // A worker counts itself among the sleepers before its last look at the ticket, and we publish the ticket
    // before we look at the count (both sequentially consistent): one of us sees the other's store.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      wake_.notify_all();
    }
    call(0);
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (remaining_.load(std::memory_order_acquire) != 0) {
      if (std::chrono::steady_clock::now() < until) {
        spin_pause();
        continue;
      }
      std::unique_lock<std::mutex> lk(mu_);
      caller_sleeps_ = true;
      done_.wait(lk, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
      caller_sleeps_ = false;
    }
    job_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void call(size_t k) {
    try {
      (*job_)(k);
    } catch (...) {
      errors_[k] = std::current_exception();
    }
  }

  void work(size_t k) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (t == seen && std::chrono::steady_clock::now() < until) {
        spin_pause();
        t = ticket_.load(std::memory_order_acquire);
      }
      if (t == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lk, [&] { return stop_ || ticket_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        if (stop_) return;
        t = ticket_.load(std::memory_order_acquire);
      }
      seen = t;
      if (k >= (t & 0xffff)) continue;  // this run needs fewer parts
      call(k);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(mu_);
        if (caller_sleeps_) done_.notify_one();
      }
    }
  }

  size_t size_;
  std::vector<std::thread> threads_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<size_t> remaining_{0};
  std::atomic<int> sleepers_{0};
  const std::function<void(size_t)>* job_ = nullptr;  // set before the ticket that announces it
  std::vector<std::exception_ptr> errors_;            // one per part, each written by its part only
  std::mutex mu_;                                     // guards the sleeps: stop_, caller_sleeps_
  std::condition_variable wake_, done_;
  bool stop_ = false;
  bool caller_sleeps_ = false;
};

std::mutex* g_pool_mu = new std::mutex;  // guards g_pool's replacement (never destroyed: see drop_pool_in_child)
Pool* g_pool = nullptr;                   // made on first use
std::atomic<int> g_size{1};

// A forked child has none of its parent's threads: it drops the parent's pool (leaked, as it cannot be destroyed
// without them) and the lock, which one of them may have held, and makes its own pool when it needs one.
void drop_pool_in_child() {
  g_pool_mu = new std::mutex;
  g_pool = nullptr;
}

// The pool, acquired for one run, or null: no pool of more than one thread wanted, or it is busy (a run from
// inside a part, or from another thread). A pool is replaced (its size changed) only while acquired, so one
// that a run holds is never destroyed under it.
Pool* acquire_pool() {
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, drop_pool_in_child);
    return true;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lk(*g_pool_mu);
  const int want = g_size.load(std::memory_order_relaxed);
  if (g_pool && !g_pool->try_acquire()) return nullptr;
  if (g_pool && static_cast<int>(g_pool->size()) != want) {
    delete g_pool;
    g_pool = nullptr;
  }
  if (!g_pool && want > 1) {
    g_pool = new Pool(want);
    if (!g_pool->try_acquire()) return nullptr;  // cannot happen: nobody else has seen it
  }
  return g_pool;
}

}  // namespace

int num_threads() { return g_size.load(std::memory_order_relaxed); }

void set_pool_threads(int n) { g_size.store(std::clamp(n, 1, kMaxThreads), std::memory_order_relaxed); }

size_t parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t, size_t)>& fn,
                    size_t most_parts) {
  if (n == 0) return 0;
  const size_t most = std::min(static_cast<size_t>(num_threads()), most_parts);
  size_t parts = std::min(most, n / std::max<size_t>(1, grain));
  Pool* p = parts > 1 ? acquire_pool() : nullptr;
  if (p) parts = std::min(parts, p->size());
  if (parts <= 1 || !p) {
    if (p) p->release();
    fn(0, 0, n);
    return 1;
  }
  struct Release {
    Pool* p;
    ~Release() { p->release(); }
  } release{p};
  p->run(parts, [&](size_t k) { fn(k, n * k / parts, n * (k + 1) / parts); });
  return parts;
}

}  // namespace cx::nn
