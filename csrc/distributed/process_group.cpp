#include "distributed/process_group.h"

#include "distributed/backend/cpu_backend.h"
#include "distributed/backend/nccl/nccl_backend.h"
#include "distributed/net/auth.h"
#include "distributed/store/store.h"

namespace cx::distributed {

// ---- Work -------------------------------------------------------------------

bool Work::is_completed() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Work::wait(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_ms < 0) {
    cv_.wait(lk, [&] { return done_; });
  } else if (!cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return done_; })) {
    return false;
  }
  if (error_) rethrow_as(error_->first, error_->second);
  return true;
}

void Work::finish(std::optional<std::pair<ErrorKind, std::string>> err) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
    error_ = std::move(err);
    body_ = nullptr;
  }
  cv_.notify_all();
}

// ---- ProcessGroup -------------------------------------------------------------

ProcessGroup::ProcessGroup(const Config& cfg) : cfg_(cfg) {
  cfg_.validate();
  sent_.assign(static_cast<size_t>(cfg_.world_size), 0);
  recvd_.assign(static_cast<size_t>(cfg_.world_size), 0);
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
  try {
    if (cfg_.backend == BackendType::kNccl) {
      // The unique id travels through the store; NCCL then connects the ranks itself.
      backend_ = std::make_unique<NcclBackend>(store_.get(), cfg_, dl);
    } else {
      backend_ = make_cpu_backend(cfg_, store_.get(), secret, dl);
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
    shutdown();
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

ProcessGroup::WorkPtr ProcessGroup::submit(OpDesc desc, Backend::Body body, bool async) {
  auto w = std::make_shared<Work>();
  w->body_ = std::move(body);
  std::unique_lock<std::mutex> lk(mu_);
  if (shut_) CX_THROW(Error, "the process group has been finalized");
  if (poison_) rethrow_poison();
  // Collectives are numbered here, in submission order; point-to-point
  // messages come numbered per pair and direction (send/recv).
  if (desc.kind != CollectiveKind::kSendRecv) desc.seq = ++seq_;
  w->desc_ = desc;
  if (async) {
    queue_.push_back(w);
    if (!comm_.joinable()) comm_ = std::thread([this] { comm_loop(); });
    cv_.notify_all();
    return w;
  }
  cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  lk.unlock();
  execute(*w);
  w->wait();  // rethrows the collective's error
  return w;
}

void ProcessGroup::execute(Work& w) {
  std::lock_guard<std::mutex> ex(exec_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (poison_) {
      w.finish(std::make_pair(poison_->first, "the process group failed earlier and cannot be used any more: " +
                                                  poison_->second));
      return;
    }
  }
  try {
    backend_->begin(w.desc_, Deadline::after_ms(cfg_.operation_timeout_ms));
    w.body_();
    w.finish(std::nullopt);
  } catch (const Error& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!poison_) poison_ = std::make_pair(e.kind(), std::string(e.what()));
    }
    backend_->abort(e.kind(), e.what());
    w.finish(std::make_pair(e.kind(), std::string(e.what())));
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!poison_) poison_ = std::make_pair(ErrorKind::kGeneric, std::string(e.what()));
    }
    backend_->abort(ErrorKind::kGeneric, e.what());
    w.finish(std::make_pair(ErrorKind::kGeneric, std::string(e.what())));
  }
}

void ProcessGroup::comm_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    auto w = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    execute(*w);
    w.reset();
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

void ProcessGroup::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (shut_) return;
    shut_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  if (comm_.joinable()) comm_.join();
  bool failed = poisoned();
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
}

// ---- the collectives ----------------------------------------------------------

Backend& ProcessGroup::backend() {
  if (shut_.load(std::memory_order_acquire)) CX_THROW(Error, "the process group has been finalized");
  return *backend_;
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
  check_reducible(dt, op);
  return submit(make_desc(CollectiveKind::kAllReduce, dt, op, -1, count),
                backend().all_reduce(buf, count, dt, op, stream), async);
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

ProcessGroup::WorkPtr ProcessGroup::reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                                   ReduceOp op, bool async, uintptr_t stream) {
  check_reducible(dt, op);
  if (ins.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "reduce_scatter needs one input block per rank: got ", ins.size(), " for world size ",
             cfg_.world_size);
  }
  return submit(make_desc(CollectiveKind::kReduceScatter, dt, op, -1, count),
                backend().reduce_scatter(std::move(ins), out, count, dt, op, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, bool async,
                                           uintptr_t stream) {
  check_reducible(dt, op);
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
  return submit(make_desc(CollectiveKind::kBarrier, DataType::kBytes, ReduceOp::kNone, -1, 0), backend().barrier(),
                async);
}

// A send and its matching recv carry the same descriptor: kind send/recv,
// root = the sender, count, dtype, and the pair's message number.
ProcessGroup::WorkPtr ProcessGroup::send(const void* buf, size_t count, DataType dt, int dst, bool async,
                                         uintptr_t stream) {
  check_peer(dst, "dst");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, cfg_.rank, count);
  {
    std::lock_guard<std::mutex> lk(mu_);
    d.seq = ++sent_[static_cast<size_t>(dst)];
  }
  return submit(d, backend().send(buf, count, dt, dst, stream), async);
}

ProcessGroup::WorkPtr ProcessGroup::recv(void* buf, size_t count, DataType dt, int src, bool async, uintptr_t stream) {
  check_peer(src, "src");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, src, count);
  {
    std::lock_guard<std::mutex> lk(mu_);
    d.seq = ++recvd_[static_cast<size_t>(src)];
  }
  return submit(d, backend().recv(buf, count, dt, src, stream), async);
}

}  // namespace cx::distributed
