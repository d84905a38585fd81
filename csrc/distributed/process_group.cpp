#include "distributed/process_group.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>

#include "distributed/backend/cpu_backend.h"
#include "distributed/backend/nccl/nccl_backend.h"
#include "distributed/diagnostics.h"
#include "distributed/net/auth.h"
#include "distributed/store/store.h"

namespace cx::distributed {

// ---- Work -------------------------------------------------------------------

bool Work::done() { return done_.load(std::memory_order_acquire); }

bool Work::is_completed() {
  if (group_ && !done()) return group_->await(*this, 0, true);
  return done();
}

bool Work::wait(int64_t timeout_ms) {
  if (group_ && !done() && !group_->await(*this, timeout_ms)) return false;
  if (timeout_ms < 0 && !done()) {
    if (auto g = queued_in_.lock()) g->help(*this);  // Note [A waiter runs what it waits for]
  }
  if (!done()) {
    std::unique_lock<std::mutex> lk(mu_);
    if (timeout_ms < 0) {
      cv_.wait(lk, [&] { return done(); });
    } else if (!cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return done(); })) {
      return false;
    }
  }
  if (error_) rethrow_as(error_->first, error_->second);  // written before done_ was set
  return true;
}

void Work::finish(std::optional<std::pair<ErrorKind, std::string>> err) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = std::move(err);
    body_ = nullptr;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// ---- ProcessGroup -------------------------------------------------------------

namespace {
// Counts the fork()s that made this process (pthread_atfork's child handler):
// a group compares it with the count at its construction, at no cost per call.
std::atomic<uint64_t> g_forks{0};
uint64_t current_fork_generation() {
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  return g_forks.load(std::memory_order_relaxed);
}
}  // namespace

bool ProcessGroup::inherited() const { return current_fork_generation() != fork_generation_; }

void ProcessGroup::refuse_if_inherited() const {
  if (inherited()) {
    CX_THROW(Error, "this process (pid ", ::getpid(), ") was made by fork() from process ", creator_pid_,
             " after it initialized rank ", cfg_.rank, "'s process group: a child cannot use its parent's connections. "
             "Call cx.distributed.init() in the child to make a group of its own, or fork before init()");
  }
}

ProcessGroup::ProcessGroup(const Config& cfg)
    : fork_generation_(current_fork_generation()), creator_pid_(::getpid()), cfg_(cfg) {
  cfg_.validate();
  const Deadline dl = Deadline::after_ms(cfg_.timeout_ms);  // setup; Note [Two deadlines] in config.h
  std::string secret;  // Note [Job secret] in net/auth.h
  if (cfg_.world_size > 1) {
    secret = net::job_secret(cfg_.master_addr, cfg_.rank);
    if (cfg_.rank == 0) {
      server_ = std::make_unique<StoreServer>(cfg_.master_addr, cfg_.master_port, cfg_.world_size, secret,
                                              cfg_.generation);
    }
    store_ = std::make_unique<StoreClient>(cfg_.master_addr, cfg_.master_port, cfg_.rank, cfg_.world_size, secret, dl,
                                           cfg_.generation);
  }
  connect(secret, dl);
}

ProcessGroup::ProcessGroup(const Config& cfg, std::unique_ptr<Store> store, const std::string& secret)
    : fork_generation_(current_fork_generation()), creator_pid_(::getpid()), cfg_(cfg) {
  cfg_.validate();
  const Deadline dl = Deadline::after_ms(cfg_.timeout_ms);
  if (cfg_.world_size > 1) store_ = std::move(store);
  connect(secret, dl);
}

void ProcessGroup::connect(const std::string& secret, const Deadline& dl) {
  sent_.assign(static_cast<size_t>(cfg_.world_size), 0);
  recvd_.assign(static_cast<size_t>(cfg_.world_size), 0);
  try {
    try {
      if (cfg_.backend == BackendType::kNccl) {
        // The unique id travels through the store; NCCL then connects the ranks itself.
        backend_ = std::make_unique<NcclBackend>(store_.get(), cfg_, dl);
      } else {
        backend_ = make_cpu_backend(cfg_, store_.get(), secret, dl);
      }
      launches_ = backend_->launches();
      backend_->set_yield(&yield_);  // Note [Sends before receives]
    } catch (const Error& e) {
      // Note [Failures reach every rank through the store]: the others are told
      // at once (the store keeps the first cause, so an error that is itself the
      // store's answer changes nothing). NCCL's setup reports its ranks' errors
      // through its own keys, each rank's own words (exchange_nccl_id).
      if (store_ && cfg_.backend != BackendType::kNccl) {
        try {
          store_->fail(e.kind(), detail::concat("rank ", cfg_.rank, " failed in init(): ", e.what()),
                       Deadline::after_ms(200));
        } catch (const Error&) {
        }
      }
      // The store is in this process: keep it until the others have read why.
      if (server_) server_->linger(1000);
      throw;
    }
  } catch (const TimeoutError& e) {
    // Note [Who holds MASTER_PORT] in store/store.h: a rank that never came may
    // have been started with RANK=0 and turned away by this store.
    const int n = server_ ? server_->turned_away() : 0;
    const int strangers = server_ ? server_->auth_failures() : 0;
    if (n == 0 && strangers > 0) {
      CX_THROW(TimeoutError, e.what(), ". Meanwhile ", strangers,
               " connection(s) to this rank's store failed the job secret's handshake (their addresses are on "
               "stderr): was a missing rank given another CX_AUTH_TOKEN?");
    }
    if (n == 0) throw;
    CX_THROW(TimeoutError, e.what(), ". Meanwhile ", n == 1 ? "another process" : std::to_string(n) + " other processes",
             " started with RANK=0 found this rank's store on ", cfg_.master_addr, ":", cfg_.master_port,
             " and gave up: was ", n == 1 ? "it" : "one of them", " meant to be a missing rank?");
  }
}

ProcessGroup::~ProcessGroup() {
  try {
    shutdown(Check::kNone);
  } catch (...) {
  }
}

bool ProcessGroup::poisoned() {
  std::lock_guard<std::mutex> lk(mu_);
  return poison_.has_value();
}

void ProcessGroup::rethrow_poison() {
  rethrow_as(poison_->first, "the process group failed earlier and cannot be used any more: " + poison_->second +
                                 " (call cx.distributed.finalize() and init() to start a new group)");
}

ProcessGroup::WorkPtr ProcessGroup::submit(OpDesc desc, Backend::Body body, bool async, const void* buf,
                                           size_t bytes) {
  refuse_if_inherited();
  auto w = std::make_shared<Work>();
  w->body_ = std::move(body);
  w->buf_ = static_cast<const char*>(buf);
  w->bytes_ = bytes;
  std::unique_lock<std::mutex> ex(exec_mu_, std::defer_lock);
  if (launches_) ex.lock();  // before mu_, as execute() takes them
  std::unique_lock<std::mutex> lk(mu_);
  if (shut_) CX_THROW(Error, "the process group has been finalized");
  if (poison_) rethrow_poison();
  // Collectives are numbered here, in submission order; point-to-point
  // messages come numbered per pair and direction (send/recv).
  if (desc.kind != CollectiveKind::kSendRecv) desc.seq = ++seq_;
  desc.site = current_call_site();
  w->desc_ = desc;
  record_locked(*w);
  const bool check = cfg_.check_interval > 0 && desc.kind != CollectiveKind::kSendRecv &&
                     seq_ % static_cast<uint64_t>(cfg_.check_interval) == 0;
  WorkPtr r = launches_ ? launch(w, async, ex, lk) : enqueue(w, async, lk);
  if (lk.owns_lock()) lk.unlock();
  if (ex.owns_lock()) ex.unlock();
  if (check) submit_barrier(CollectiveKind::kCheck, async);
  return r;
}

ProcessGroup::WorkPtr ProcessGroup::submit_barrier(CollectiveKind kind, bool async) {
  refuse_if_inherited();
  auto w = std::make_shared<Work>();
  std::unique_lock<std::mutex> ex(exec_mu_, std::defer_lock);
  if (launches_) ex.lock();
  std::unique_lock<std::mutex> lk(mu_);
  if (shut_) CX_THROW(Error, "the process group has been finalized");
  if (poison_) rethrow_poison();
  OpDesc d;
  d.kind = kind;
  d.seq = ++seq_;
  d.site = current_call_site();
  w->desc_ = d;
  record_locked(*w);  // the fingerprint sent includes this barrier itself
  w->body_ = backend_->barrier(fingerprint_);
  return launches_ ? launch(w, async, ex, lk) : enqueue(w, async, lk);
}

void ProcessGroup::record_locked(Work& w) {
  w.op_ = ++ops_;
  if (w.desc_.kind != CollectiveKind::kSendRecv) fingerprint_ = fold(fingerprint_, w.desc_);
  FlightEntry& e = ring_[w.op_ % kFlightEntries];
  e = FlightEntry{};
  e.op = w.op_;
  e.desc = w.desc_;
  e.fingerprint = fingerprint_;
  e.submit_us = now_us();
}

void ProcessGroup::set_state(const Work& w, FlightEntry::State s) {
  std::lock_guard<std::mutex> lk(mu_);
  FlightEntry& e = ring_[w.op_ % kFlightEntries];
  if (e.op != w.op_) return;  // overwritten by a newer operation
  e.state = s;
  (s == FlightEntry::kRunning ? e.start_us : e.end_us) = now_us();
}

// Note [Small sends that leave at once]
// An async send goes to the communication thread like any async operation: a Work, the queue, a wake-up of that
// thread, and a second one of whoever waits for the Work. For a small message that costs several times the send
// itself: in OSU's osu_bw pattern (windows of 64 non-blocking sends; benchmarks/osu.py), 16 B through shared
// memory to a rank receiving them blocking took 1.9-3.5 us a message, against 0.6 us sent blocking. So a
// send of at most kSendAtOnceBytes made while the group has nothing queued or running (but receives that it passes:
// Note [Sends before receives]) is written by its caller at once, as a blocking one is, and its Work is returned
// complete (an error it met is raised by wait(), as for any async operation). Nothing else changes: the group's
// operations still run one at a time in the order they were submitted (sends passing receives aside), and the message
// goes into the ring or the socket's buffer, which the peer drains whatever it is doing (Note [Messages out of order]
// in transport/channel.cpp). The caller waits only where the peer has left that buffer full (1 MiB of shared-memory
// ring, or the socket's), where the communication thread would have waited in its place with every operation behind it.
// Measured: 0.9-1.1 us a message after it (2 ranks, alternating with the build before), at up to 4 KiB. That
// bound came from a belief that from 8 KiB up shared memory may copy a send straight out of the sender's buffer,
// which would wait for the receiver; but it never does for send/recv (single_copy_pays in shm/shm.h). At 64 KiB
// (the copy into the ring or the socket takes a few us, the hand-over to the thread as long), with receives up to
// the same size left to their waiters: osu_bw's loop on 2 ranks (benchmarks/osu.py's lib_column, 6 runs, the
// order of the settings flipped each run, medians) 1.4-2.5x through shared memory at 8-64 KiB and 1.2-1.3x over
// TCP, level at 1-4 KiB. Larger sends stay on the thread, where the caller may compute while they are copied.
ProcessGroup::WorkPtr ProcessGroup::enqueue(std::shared_ptr<Work> w, bool async, std::unique_lock<std::mutex>& lk) {
  const OpDesc& d = w->desc_;
  const bool small_message = async && small(d);
  const bool sends = d.root == cfg_.rank;
  // A small send also leaves at once ahead of receives it passes (Note [Sends before receives]).
  const bool at_once = small_message && sends && !busy_ && passes_queue(*w);
  if (async && !at_once) {  // else it leaves at once, below
    w->queued_in_ = weak_from_this();
    // A small receive is left for its waiter to run (Note [A waiter runs what it waits for]).
    const bool lazy = small_message && !sends;
    if (lazy) w->lazy_until_ = std::chrono::steady_clock::now() + kLeftToWaiter;
    queue_in_place(w);
    if (!comm_.joinable()) comm_ = std::thread([this] { comm_loop(); });
    if (!lazy || !comm_looks_) comm_cv_.notify_one();  // a thread that looks on its own needs no wake-up
    return w;
  }
  // Behind queued operations: run them here while no other thread runs one (Note [A waiter runs what it waits for]).
  // A send passes queued receives it does not read from (Note [Sends before receives]).
  bool waited = false;
  ++helpers_;
  for (;;) {
    const bool passes_all = passes_queue(*w);
    if (busy_) {
      if (passes_all && running_ && passes(*w, *running_)) yield_.store(true, std::memory_order_release);
      waited = true;
      cv_.wait(lk);
      continue;
    }
    if (queue_.empty() || passes_all) break;
    waited = true;
    run_front(lk);
  }
  --helpers_;
  const bool ahead = !queue_.empty();  // receives queued behind it: they wait for it as for a running one
  if (ahead) busy_ = true;
  yield_.store(false, std::memory_order_relaxed);  // a receive of ours runs to its end
  // Running from now: poison_ and the flight entry under the lock submit() holds (or retook after a wait), as
  // execute() would check and set them, saving it two turns of mu_ and a clock read.
  if (poison_) {
    lk.unlock();
    execute(*w, true);  // finishes w with the poison's error
  } else {
    FlightEntry& e = ring_[w->op_ % kFlightEntries];
    if (e.op == w->op_) {
      e.state = FlightEntry::kRunning;
      e.start_us = waited ? now_us() : e.submit_us;
    }
    lk.unlock();
    execute(*w, true, true);
  }
  if (ahead) {
    lk.lock();
    busy_ = false;
    cv_.notify_all();
    if (helpers_ == 0) comm_cv_.notify_one();  // the receives behind it
    lk.unlock();
  }
  if (!async) w->wait();  // rethrows the collective's error (an async send's: from its wait())
  return w;
}

// Note [Collectives that are launches]
// NCCL's collectives are launches: ncclAllReduce queues kernels on a stream and
// returns. Handing one to the communication thread, as the CPU backend's
// async collectives are, costs a thread wake-up (microseconds; NCCL's own call
// takes about one) and delays the launch by as much. So for such a backend
// every body runs here, on the submitting thread, under exec_mu_ taken before
// mu_: launches keep the order of submission, which every rank must share.
// A blocking collective then polls its end before returning; an async one
// joins inflight_ and is polled by whichever thread waits for it (Work::wait,
// is_completed), or by shutdown(), which completes every one before closing.
// A blocking collective launched while async ones are in flight goes on the
// backend's stream behind them (on_submitter false), so that nothing of this
// communicator overtakes what was launched before it on another stream.
ProcessGroup::WorkPtr ProcessGroup::launch(std::shared_ptr<Work> w, bool async, std::unique_lock<std::mutex>& ex,
                                           std::unique_lock<std::mutex>& lk) {
  while (!inflight_.empty() && inflight_.front()->done()) inflight_.pop_front();
  const bool on_caller_stream = !async && inflight_.empty();
  FlightEntry& e = ring_[w->op_ % kFlightEntries];  // running from now, as set_state would say it
  e.state = FlightEntry::kRunning;
  e.start_us = e.submit_us;
  lk.unlock();
  try {
    backend_->begin(w->desc_, Deadline::after_ms(cfg_.operation_timeout_ms), on_caller_stream);
    w->body_();
    w->body_ = nullptr;
    w->poll_ = backend_->launched(async);
  } catch (const Error& e) {
    w->body_ = nullptr;
    fail(*w, e.kind(), e.what());
  } catch (const std::exception& e) {
    w->body_ = nullptr;
    fail(*w, ErrorKind::kGeneric, e.what());
  }
  if (!w->done()) {
    w->group_ = this;
    if (async) {
      lk.lock();
      inflight_.push_back(w);
      lk.unlock();
    }
  }
  ex.unlock();  // polling takes it again only to fail
  if (!async) w->wait();  // rethrows the collective's error
  return w;
}

bool ProcessGroup::await(Work& w, int64_t timeout_ms, bool once) {
  const auto until = timeout_ms < 0 ? std::chrono::steady_clock::time_point::max()
                                    : std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::unique_lock<std::mutex> pl(w.poll_mu_, std::defer_lock);
  if (once) {
    if (!pl.try_lock()) return w.done();  // another thread is polling it
  } else {
    pl.lock();
  }
  for (int polls = 0;; ++polls) {
    if (w.done()) return true;
    std::optional<std::pair<ErrorKind, std::string>> err;
    bool landed = false;
    try {
      landed = w.poll_();
    } catch (const Error& e) {
      err = std::make_pair(e.kind(), std::string(e.what()));
    } catch (const std::exception& e) {
      err = std::make_pair(ErrorKind::kGeneric, std::string(e.what()));
    }
    if (err) {
      w.poll_ = nullptr;
      std::lock_guard<std::mutex> ex(exec_mu_);
      fail(w, err->first, err->second);
      return true;
    }
    if (landed) {
      w.poll_ = nullptr;  // its event goes back to the backend's pool
      set_state(w, FlightEntry::kDone);
      w.finish(std::nullopt);
      return true;
    }
    if (once || (timeout_ms >= 0 && std::chrono::steady_clock::now() >= until)) return false;
    // Spin briefly (a small collective ends within microseconds), then yield, then sleep.
    if (polls < 64) {
      continue;
    } else if (polls < 200) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 2000 ? 20 : 200));
    }
  }
}

bool ProcessGroup::execute(Work& w, bool on_submitter, bool started) {
  std::lock_guard<std::mutex> ex(exec_mu_);
  if (!started) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (poison_) {
        w.finish(std::make_pair(poison_->first, "the process group failed earlier and cannot be used any more: " +
                                                    poison_->second));
        return true;
      }
    }
    set_state(w, FlightEntry::kRunning);
  }
  try {
    backend_->begin(w.desc_, Deadline::after_ms(cfg_.operation_timeout_ms), on_submitter);
    w.body_();
    set_state(w, FlightEntry::kDone);
    w.finish(std::nullopt);
  } catch (const OpYielded&) {
    return false;  // Note [Sends before receives]: run_front queues it again
  } catch (const Error& e) {
    fail(w, e.kind(), e.what());
  } catch (const std::exception& e) {
    fail(w, ErrorKind::kGeneric, e.what());
  }
  return true;
}

void ProcessGroup::fail(Work& w, ErrorKind kind, const std::string& msg) {
  set_state(w, FlightEntry::kFailed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!poison_) poison_ = std::make_pair(kind, msg);
  }
  const bool explained = store_ && (kind == ErrorKind::kTimeout || kind == ErrorKind::kMismatch ||
                                    kind == ErrorKind::kConnection);
  // A peer's failure ("rank 2 failed: ValueError ...") is its cause already, and
  // this rank says it at once; its record still helps the others explain theirs.
  if (store_ && (explained || kind == ErrorKind::kPeerFailed)) publish_record("cx/fr/" + std::to_string(cfg_.rank));
  // A peer's failure is relayed as what it is to the others: a lost peer, which
  // this rank reports (only the failed rank itself says "rank R failed").
  backend_->abort(kind == ErrorKind::kPeerFailed ? ErrorKind::kConnection : kind, msg);
  if (!explained) {
    w.finish(std::make_pair(kind, msg));
    return;
  }
  auto why = diagnostics::explain(*store_, flight_record(), cfg_.world_size, kind, msg);
  {
    std::lock_guard<std::mutex> lk(mu_);
    poison_ = why;
  }
  w.finish(std::move(why));
}

FlightRecord ProcessGroup::record_locked_snapshot() const {
  FlightRecord f;
  f.rank = cfg_.rank;
  f.failed = poison_.has_value();
  if (poison_) f.error = poison_->second;
  f.fingerprint = fingerprint_;
  f.collectives = seq_;
  f.sent = sent_;
  f.recvd = recvd_;
  const uint64_t first = ops_ >= kFlightEntries ? ops_ - kFlightEntries + 1 : 1;
  for (uint64_t n = first; n <= ops_; ++n) {
    const FlightEntry& e = ring_[n % kFlightEntries];
    if (e.op == n) f.entries.push_back(e);
  }
  return f;
}

FlightRecord ProcessGroup::flight_record() {
  std::lock_guard<std::mutex> lk(mu_);
  return record_locked_snapshot();
}

void ProcessGroup::publish_record(const std::string& key) {
  diagnostics::publish(*store_, key, flight_record());
}

// Note [A waiter runs what it waits for]
// A program that posts several async operations and then waits for them (MPI's Waitall, osu_bw's window of 64
// sends or receives, a Work per message) paid a hand-over per operation: the communication thread woken to run
// it, then the waiter woken by its end, two thread switches on cores that the ranks share. So a thread that
// waits without a timeout for an operation of the queue takes the operations from the front, up to its own, and
// runs them itself. The communication thread finishes the one it is running, if any, and starts no other while
// a waiter is there (helpers_): busy_ keeps two threads from running operations at once, and they are taken in
// submission order either way. A waiter that leaves operations queued behind its own wakes the thread for them.
// A small receive (up to kSendAtOnceBytes) is not woken for: the thread leaves it for kLeftToWaiter to whoever
// waits for it (a posted receive needs no progress before its message comes; the ring or the socket holds it),
// so that the next wait of a window of them finds its own still queued; and a blocking call behind queued
// operations runs them first itself. The thread never polls: it sleeps until it is woken, or until the first
// small receive's time when one is at the front. (A first version looked every 50 us while a waiter ran
// operations; the training benchmark gave 79k and 105k samples/s in 2 of 3 runs against 135-140k for the build
// before. The build before later had such runs too, so that was not proven, but wake-ups every 50 us take a core
// from the ranks for nothing. As it is, 6 alternating runs each: level within the noise.) A wait
// with a timeout only waits (running a receive could outlast it). The overlap of computing with communicating is
// kept: a thread that waits has nothing else to do, and collectives and large messages still wake the thread.
// osu_bw, 2 ranks, best of 3 runs alternating with the build before: 1.4-2.0x at 8 B-4 KiB through shared memory
// and 1.6-2.0x over TCP, but 0.78-0.93x through shared memory at 16-256 KiB (that loss did not hold up: with
// each rank pinned to a core, 8 runs alternating, the build before was 0.59-0.96x this one's speed there, its
// single runs 3-4x apart). Posting 64 small
// async receives and waiting for them cost 0.75 + 0.8 us a message, against 1.3-2.2 + 0.8-1.7 before
// (benchmarks/README.md, "Against MPI on its own benchmark").
// A receive's time ran from when it was posted, so in a window that outlasts kLeftToWaiter (64 small receives
// take about 50 us to post) the thread took over the rest, one hand-over per message. So a waiter that leaves a
// small message at the front gives it kLeftToWaiter from then, and the thread, sleeping until that time, looks
// again twice as late each time it finds the time moved on (patience_, up to kMostPatience): a window's messages
// stay with their waiters, and the thread wakes a few times a window instead of never or every 50 us. Large
// messages still go to the thread when their waiter leaves. And the thread sleeps on a condition variable of
// its own (comm_cv_): on the one waiters share, every operation a waiter ran woke it, to find a waiter still
// there (a futex call and a context switch per message: 15,994 against 1,385 on the receiver of 300 windows of
// 512 B over TCP, perf stat). osu_bw's loop (benchmarks/osu.py, 2 ranks, 5 runs alternating with the build
// before, medians): 1.18-1.25x through shared memory at 512 B-4 KiB, 0.97-1.06x at 8-64 B, level within the
// noise above; over TCP 0.94-1.12x, level. Windows of async sends to async receives, a barrier before each (60
// a size, 8 runs each, medians): 1.15-1.38x through shared memory at 8 B-4 KiB, over TCP 1.00-1.10x.
// Note [Sends before receives]
// A group runs its operations one at a time, in order. MPI's safe idiom for an exchange posts the receive first
// and then the send (irecv, isend, wait for both); torch's batch_isend_irecv takes its list in either order.
// Run in order, every rank's receive waited for a message that the peer's send, queued behind the peer's own
// receive, would never write: each timed out, at any size. gloo and MPI run them at once. So a send passes
// receives queued before it whose memory it does not read (a send of the buffer a queued receive fills, a relay,
// still goes after it): it is queued ahead of them, and a blocking send runs before them. A receive that is
// already running and would sleep before any byte of its message has come gives way to such a send: it drops its
// request (Channel::cancel_untouched_recv), throws OpYielded out of its body, and goes back to the queue behind
// the sends that pass it (yield_, set where such a send is queued or waits). Only receives are passed: a send
// never waits for anything but room in the ring or the socket, and while it waits for that it reads the peers'
// messages aside (Note [Sends that read while they wait] in mesh_transport.cpp), so running sends earlier cannot
// leave anyone waiting; a receive passing a send could (the peer may answer only what we send). Messages of a
// pair and tag keep their order, sends among sends and receives among receives. Collectives are never passed. A
// receive from any source gives way too while it looks for a sender (MeshTransport::wait_any_message); once it has
// taken one and the pair's message number, it keeps them for its next run (CpuBackend::recv_any), and
// any_pending_ still counts it, so no receive naming a source takes a number meanwhile.
void ProcessGroup::queue_in_place(const std::shared_ptr<Work>& w) {
  if (!is_send(*w)) {
    queue_.push_back(w);
    return;
  }
  auto pos = queue_.end();
  while (pos != queue_.begin() && passes(*w, **std::prev(pos))) --pos;
  const bool first = pos == queue_.begin();
  queue_.insert(pos, w);
  if (first && running_ && passes(*w, *running_)) yield_.store(true, std::memory_order_release);
}

void ProcessGroup::run_front(std::unique_lock<std::mutex>& lk) {
  auto w = queue_.front();
  queue_.pop_front();
  busy_ = true;
  running_ = w.get();
  yield_.store(false, std::memory_order_relaxed);
  lk.unlock();
  const bool ran = execute(*w, false);
  if (ran) w.reset();
  lk.lock();
  running_ = nullptr;
  busy_ = false;
  if (!ran) {  // it gave way: back to the queue, behind the sends that pass it (Note [Sends before receives])
    size_t i = 0;
    while (i < queue_.size() && is_send(*queue_[i]) && passes(*queue_[i], *w)) ++i;
    queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(i), w);
    FlightEntry& e = ring_[w->op_ % kFlightEntries];
    if (e.op == w->op_) e.state = FlightEntry::kQueued;
  }
  cv_.notify_all();
  if (stop_) comm_cv_.notify_one();  // a thread draining the queue waits for the last operation's end
}

void ProcessGroup::help(Work& w) {
  std::unique_lock<std::mutex> lk(mu_);
  auto queued = [&] {
    return std::any_of(queue_.begin(), queue_.end(), [&](const std::shared_ptr<Work>& q) { return q.get() == &w; });
  };
  if (w.done() || (!busy_ && !queued())) return;
  ++helpers_;  // the communication thread starts no operation meanwhile
  while (!w.done()) {
    if (busy_) {  // another thread runs one (w itself, maybe): its end wakes us
      cv_.wait(lk);
      continue;
    }
    if (!queued()) break;  // done by now
    run_front(lk);
  }
  --helpers_;
  // What is left behind our operation: the thread takes it up now, or a small receive at its time (wait_until
  // in comm_loop) if it sleeps with that deadline already; until then our next wait may run it here.
  if (helpers_ == 0 && !queue_.empty()) {
    Work& next = *queue_.front();
    const auto now = std::chrono::steady_clock::now();
    if (small(next.desc_)) {  // a window's next small message
      next.lazy_until_ = std::max(next.lazy_until_, now + kLeftToWaiter);
      if (!comm_looks_) comm_cv_.notify_one();  // the thread learns its time
    } else if (!(comm_looks_ && next.lazy_until_ > now)) {
      comm_cv_.notify_one();
    }
  }
}

void ProcessGroup::comm_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {  // Note [A waiter runs what it waits for]
    if (!queue_.empty()) {
      auto until = queue_.front()->lazy_until_;
      const auto now = std::chrono::steady_clock::now();
      if (until > now) {  // a small message, left to its waiter until then
        if (patience_.count() > 0) until = std::max(until, now + patience_);
        comm_looks_ = true;
        const bool timed_out = comm_cv_.wait_until(lk, until) == std::cv_status::timeout;
        comm_looks_ = false;
        // Woken at that time, we may find the front's time moved on: waiters are running a window of small
        // messages. Each time, look again twice as late (up to kMostPatience).
        if (timed_out) patience_ = patience_.count() == 0 ? kLeftToWaiter : std::min(2 * patience_, kMostPatience);
        continue;
      }
      patience_ = std::chrono::microseconds(0);
      if (!busy_ && helpers_ == 0) {
        run_front(lk);
        continue;
      }
    } else {
      patience_ = std::chrono::microseconds(0);
    }
    if (stop_ && queue_.empty() && !busy_) return;  // drained
    comm_cv_.wait(lk);  // for work, for the waiters running it to leave, or for shutdown
  }
}

void ProcessGroup::shutdown(Check check) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_) return;
    shut_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  comm_cv_.notify_one();
  if (comm_.joinable()) comm_.join();
  // Launched async collectives end before anything closes (Note [Collectives that are launches]).
  std::deque<std::shared_ptr<Work>> flying;
  {
    std::lock_guard<std::mutex> lk(mu_);
    flying.swap(inflight_);
  }
  for (auto& w : flying) {
    if (!poisoned()) {
      await(*w, -1);
      continue;
    }
    std::lock_guard<std::mutex> pl(w->poll_mu_);
    if (w->done()) continue;
    w->poll_ = nullptr;
    std::lock_guard<std::mutex> lk(mu_);
    w->finish(std::make_pair(poison_->first, "the process group failed earlier: " + poison_->second));
  }
  std::optional<Error> check_error;
  try {
    if (store_ && cfg_.world_size > 1 && check != Check::kNone) {
      diagnostics::check_at_finalize(*store_, flight_record(), cfg_.world_size, check == Check::kFull,
                                     check == Check::kFull ? cfg_.operation_timeout_ms : kAtExitWaitMs,
                                     cfg_.operation_timeout_ms, kFlightEntries);
    }
  } catch (const Error& e) {
    check_error = e;
  }
  bool failed = poisoned() || check_error;
  if (backend_) {
    std::lock_guard<std::mutex> ex(exec_mu_);
    // A short grace period only: a peer that is still working (or has died)
    // must not hold up this process's exit. Closing with nothing unread sends
    // a FIN, never a reset, so data we sent still reaches peers that read it.
    backend_->close(Deadline::after_ms(failed ? 20 : 100));
  }
  if (store_ && cfg_.rank != 0) {
    try {
      store_->done(Deadline::after_ms(200));
    } catch (const Error&) {
      // rank 0's store may already be gone; nothing depends on it any more
    }
  }
  backend_.reset();
  store_.reset();
  server_.reset();
  if (check_error) rethrow_as(check_error->kind(), check_error->what());
}

void ProcessGroup::abort(const std::string& why) {
  const std::string text = detail::concat("rank ", cfg_.rank, " failed: ", why);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (poison_ || shut_) return;
    poison_ = std::make_pair(ErrorKind::kPeerFailed, text);
  }
  if (!store_) return;
  publish_record("cx/fr/" + std::to_string(cfg_.rank));
  try {
    store_->fail(ErrorKind::kPeerFailed, text, Deadline::after_ms(200));
  } catch (const Error&) {
  }
  // A collective of ours may be under way on the group's thread: its own
  // failure (now that we are poisoned, at its next step or deadline) tells the
  // peers then; otherwise tell them now.
  std::unique_lock<std::mutex> ex(exec_mu_, std::defer_lock);
  for (int i = 0; i < 100 && !ex.try_lock(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (ex.owns_lock() && backend_) backend_->abort(ErrorKind::kPeerFailed, why);
}

void ProcessGroup::monitored_barrier(int64_t timeout_ms) {
  uint64_t n;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (shut_) CX_THROW(Error, "the process group has been finalized");
    if (poison_) rethrow_poison();
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
    n = ++monitored_;
  }
  if (store_) diagnostics::monitored_barrier(*store_, cfg_.rank, cfg_.world_size, n, timeout_ms);
}

std::string ProcessGroup::describe_setup() const {
  return detail::concat("rank ", cfg_.rank, " of ", cfg_.world_size, ", backend ",
                        cfg_.backend == BackendType::kNccl ? "nccl" : "cpu", ", store ", cfg_.master_addr, ":",
                        cfg_.master_port, ", timeouts ", cfg_.timeout_ms, " ms (init) / ", cfg_.operation_timeout_ms,
                        " ms (operation), check interval ", cfg_.check_interval,
                        backend_ ? "; " + backend_->describe() : std::string());
}

// ---- the collectives ----------------------------------------------------------

Backend& ProcessGroup::backend() {
  if (shut_.load(std::memory_order_acquire)) CX_THROW(Error, "the process group has been finalized");
  return *backend_;
}

void ProcessGroup::check_reduction(DataType dt, ReduceOp op) const {
  check_reducible(dt, op);
  // Note: int8 and bool reductions are new and have not run on a GPU (GPU code lands verified or refused).
  if ((dt == DataType::kBool || dt == DataType::kInt8) && cfg_.backend == BackendType::kNccl) {
    CX_THROW(TypeMismatch, dtype_name(dt), " arrays are reduced by the CPU backend only (not yet run on a GPU): "
             "reduce an int32 array on NCCL (for bool, uint8 with ReduceOp.MAX for or, ReduceOp.MIN for and)");
  }
  if ((op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) && cfg_.backend == BackendType::kNccl) {
    CX_THROW(InvalidArgument, "ReduceOp.", op_name(op), " is reduced by the CPU backend only: NCCL has no bitwise "
             "reductions (for flags, ReduceOp.MAX is \"or\" and ReduceOp.MIN \"and\" of 0/1 values)");
  }
}

void ProcessGroup::check_root(int root, const char* what) const {
  if (root < 0 || root >= cfg_.world_size) {
    CX_THROW(InvalidArgument, what, "=", root, " is not a rank of this group (ranks are 0 .. ", cfg_.world_size - 1,
             ")");
  }
}

void ProcessGroup::check_peer(int peer, const char* what) const {
  check_root(peer, what);
  if (peer == cfg_.rank) CX_THROW(InvalidArgument, what, "=", peer, " is this rank itself: a rank cannot send to or receive from itself");
}

namespace {
OpDesc make_desc(CollectiveKind k, DataType dt, ReduceOp op, int root, size_t count) {
  OpDesc d;
  d.kind = k;
  d.dtype = dt;
  d.op = op;
  d.root = root;
  d.count = count;
  return d;
}
}  // namespace

ProcessGroup::WorkPtr ProcessGroup::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, bool async,
                                               uintptr_t stream) {
  check_reduction(dt, op);
  return submit(make_desc(CollectiveKind::kAllReduce, dt, op, -1, count),
                backend().all_reduce(buf, count, dt, op, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::all_reduce_probed(float* buf, size_t count, ReduceOp op, ReduceProbe& probe,
                                                      bool async) {
  CX_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, InvalidArgument,
           "all_reduce_probed: SUM or AVG only, not ", op_name(op));
  return submit(make_desc(CollectiveKind::kAllReduce, DataType::kFloat32, op, -1, count),
                backend().all_reduce_probed(buf, count, op, &probe, cfg_.rank), async);
}

ProcessGroup::WorkPtr ProcessGroup::all_reduce_cast(float* buf, uint16_t* wire, size_t count, DataType wire_dt,
                                                    float scale, bool async, ReduceProbe* probe) {
  CX_CHECK(wire_dt == DataType::kFloat16 || wire_dt == DataType::kBFloat16, InvalidArgument,
           "all_reduce_cast carries float32 as float16 or bfloat16, not ", dtype_name(wire_dt));
  return submit(make_desc(CollectiveKind::kAllReduce, wire_dt, ReduceOp::kSum, -1, count),
                backend().all_reduce_cast(buf, wire, count, wire_dt, scale, probe, cfg_.rank), async);
}

ProcessGroup::WorkPtr ProcessGroup::broadcast(void* buf, size_t count, DataType dt, int root, bool async,
                                              uintptr_t stream) {
  check_root(root, "src");
  return submit(make_desc(CollectiveKind::kBroadcast, dt, ReduceOp::kNone, root, count),
                backend().broadcast(buf, count, dt, root, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt,
                                               bool async, uintptr_t stream) {
  if (outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "all_gather needs one output per rank: got ", outs.size(), " for world size ",
             cfg_.world_size);
  }
  return submit(make_desc(CollectiveKind::kAllGather, dt, ReduceOp::kNone, -1, count),
                backend().all_gather(in, std::move(outs), count, dt, stream), async);
}

void ProcessGroup::check_input_blocks(size_t blocks) const {
  if (blocks != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "reduce_scatter needs one input block per rank: got ", blocks, " for world size ",
             cfg_.world_size);
  }
}

ProcessGroup::WorkPtr ProcessGroup::reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                                   ReduceOp op, bool async, uintptr_t stream) {
  check_reduction(dt, op);
  check_input_blocks(ins.size());
  return submit(make_desc(CollectiveKind::kReduceScatter, dt, op, -1, count),
                backend().reduce_scatter(std::move(ins), out, count, dt, op, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::reduce_scatter_probed(std::vector<const float*> ins, float* out, size_t count,
                                                          ReduceOp op, ReduceProbe& probe, size_t base, size_t stride,
                                                          bool async) {
  CX_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, InvalidArgument,
           "reduce_scatter_probed: SUM or AVG only, not ", op_name(op));
  check_input_blocks(ins.size());
  return submit(make_desc(CollectiveKind::kReduceScatter, DataType::kFloat32, op, -1, count),
                backend().reduce_scatter_probed(std::move(ins), out, count, op, &probe, base, stride, cfg_.rank),
                async);
}

ProcessGroup::WorkPtr ProcessGroup::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, bool async,
                                           uintptr_t stream) {
  check_reduction(dt, op);
  check_root(root, "dst");
  return submit(make_desc(CollectiveKind::kReduce, dt, op, root, count),
                backend().reduce(buf, count, dt, op, root, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                            int root, bool async, uintptr_t stream) {
  check_root(root, "src");
  if (cfg_.rank == root && ins.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "scatter on the source rank needs one input per rank: got ", ins.size(),
             " for world size ", cfg_.world_size);
  }
  return submit(make_desc(CollectiveKind::kScatter, dt, ReduceOp::kNone, root, count),
                backend().scatter(std::move(ins), out, count, dt, root, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::gather(const void* in, std::vector<void*> outs, size_t count, DataType dt,
                                           int root, bool async, uintptr_t stream) {
  check_root(root, "dst");
  if (cfg_.rank == root && outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "gather on the destination rank needs one output per rank: got ", outs.size(),
             " for world size ", cfg_.world_size);
  }
  return submit(make_desc(CollectiveKind::kGather, dt, ReduceOp::kNone, root, count),
                backend().gather(in, std::move(outs), count, dt, root, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count,
                                               DataType dt, bool async, uintptr_t stream) {
  if (ins.size() != static_cast<size_t>(cfg_.world_size) || outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "all_to_all needs one input and one output block per rank: got ", ins.size(), " and ",
             outs.size(), " for world size ", cfg_.world_size);
  }
  return submit(make_desc(CollectiveKind::kAllToAll, dt, ReduceOp::kNone, -1, count),
                backend().all_to_all(std::move(ins), std::move(outs), count, dt, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::barrier(bool async) {
  backend();  // throws once finalized
  return submit_barrier(CollectiveKind::kBarrier, async);
}

// A send and its matching recv carry the same descriptor: kind send/recv,
// root = the sender, count, dtype, tag, and the pair's message number for that tag
// (Note [Messages out of order] in transport/channel.cpp).
ProcessGroup::WorkPtr ProcessGroup::send(const void* buf, size_t count, DataType dt, int dst, bool async,
                                         uintptr_t stream, uint32_t tag) {
  check_peer(dst, "dst");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, cfg_.rank, count);
  d.tag = tag;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++sent_[static_cast<size_t>(dst)];
    d.seq = ++sent_tag_[{dst, tag}];
  }
  return submit(d, backend().send(buf, count, dt, dst, stream), async, buf, count * dtype_size(dt));
}

ProcessGroup::WorkPtr ProcessGroup::recv(void* buf, size_t count, DataType dt, int src, bool async, uintptr_t stream,
                                         uint32_t tag) {
  check_peer(src, "src");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, src, count);
  d.tag = tag;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Its message number would be given before the pending recv from any source takes one (at its run).
    CX_CHECK(any_pending_ == 0, InvalidArgument, "a recv from rank ", src, " while a recv from any source is still "
             "pending: wait for that one first");
    ++recvd_[static_cast<size_t>(src)];
    d.seq = ++recvd_tag_[{src, tag}];
  }
  return submit(d, backend().recv(buf, count, dt, src, stream), async, buf, count * dtype_size(dt));
}

ProcessGroup::WorkPtr ProcessGroup::recv_any(void* buf, size_t count, DataType dt, bool async, uint32_t tag,
                                             std::shared_ptr<int> source) {
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, -1, count);  // root -1: from any rank
  d.tag = tag;
  // The message's number on its pair is taken when it runs, once its sender is known (Note [Receiving from any
  // source] in mesh_transport.cpp).
  auto desc_of = [this, d](int j) {
    OpDesc m = d;
    m.root = j;
    std::lock_guard<std::mutex> lk(mu_);
    ++recvd_[static_cast<size_t>(j)];
    m.seq = ++recvd_tag_[{j, m.tag}];
    return m;
  };
  Backend::Body inner = backend().recv_any(buf, count, dt, desc_of, source.get());
  auto ended = std::make_shared<std::atomic<bool>>(false);
  auto end = [this, ended] {
    if (ended->exchange(true)) return;
    std::lock_guard<std::mutex> lk(mu_);
    --any_pending_;
  };
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++any_pending_;
  }
  Backend::Body body = [inner = std::move(inner), end, source] {
    try {
      inner();
    } catch (const OpYielded&) {
      throw;  // gave way to sends (Note [Sends before receives]): still pending, it runs again
    } catch (...) {
      end();
      throw;
    }
    end();
  };
  try {
    return submit(d, std::move(body), async, buf, count * dtype_size(dt));
  } catch (...) {
    end();  // refused before it ran, or it ran and failed (then it ended already)
    throw;
  }
}

}  // namespace cx::distributed
