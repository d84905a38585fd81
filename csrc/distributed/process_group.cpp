#include "distributed/process_group.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>

#include "distributed/store/store.h"
#include "distributed/transport/mesh_transport.h"
#include "distributed/transport/nccl/nccl_transport.h"

namespace cx::distributed {

namespace {

// The transport of a world of one: every collective is local, so nothing is
// ever sent; a send or receive means a caller asked to talk to itself.
class LocalTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void begin(const OpDesc&, const Deadline&) override {}
  Req isend(int, const void*, size_t) override { CX_THROW(InvalidArgument, "rank 0 cannot send to itself"); }
  Req irecv(int, void*, size_t) override { CX_THROW(InvalidArgument, "rank 0 cannot receive from itself"); }
  void wait(Req) override {}
  void wait_all() override {}
  void abort(ErrorKind, const std::string&) override {}
};

uint64_t make_nonce() {
  std::random_device rd;
  uint64_t a = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return a ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
         (static_cast<uint64_t>(::getpid()) << 17);
}

// Ranks on this machine: LOCAL_WORLD_SIZE if the launcher set it, else all of them.
int local_ranks(const Config& c) {
  const char* l = std::getenv("LOCAL_WORLD_SIZE");
  return l ? std::max(1, std::atoi(l)) : c.world_size;
}

// More ranks on this machine than cores?
bool oversubscribed(const Config& c) { return local_ranks(c) > ::sysconf(_SC_NPROCESSORS_ONLN); }

bool one_host(const Config& c) { return local_ranks(c) >= c.world_size; }

int default_spin_us(const Config& c) {
  if (c.spin_us >= 0) return c.spin_us;
  // Spinning pays when every rank has a core; with more ranks than cores a
  // spinning rank steals the core its peer needs (the spin yields, and is short).
  return oversubscribed(c) ? 30 : 50;
}

// Note [large all_reduce on one host]
// With a power-of-two world of 4 or more, halving-doubling moves the same bytes
// as the ring in 2 log2 p steps instead of 2(p-1). Measured side by side on a
// 2-vCPU VM with 4 ranks: 1.5-2x the ring's bandwidth at 1 MiB, level at 4 MiB,
// 10-20% behind from 16 MiB (its steps cannot be pipelined into each other as
// the ring's chunks are). Hence halving-doubling up to 2 MiB, the ring above.
// (A direct reduce-scatter + all-gather, every rank to every rank, was tried
// too: no better than the ring at 1-64 MiB on 3 and 4 ranks.)

// Note [Tuning agreed at init]
// Chunk size and the small-message threshold decide message boundaries, so all
// ranks must use the same values. Values set explicitly (CX_CHUNK_BYTES,
// CX_SMALL_ALLREDUCE_BYTES) are the user's to keep equal; automatic ones are
// chosen by rank 0 and sent to everyone with the group id. Measured on a 2-vCPU
// VM: 512 KiB chunks are best with a core per rank; with two ranks per core
// 1 MiB chunks (fewer wake-ups per byte) gain 10-20% at 4-32 MiB. For the
// threshold see Note [small all_reduce threshold].
struct GroupId {
  uint64_t nonce;
  uint64_t chunk_bytes;
  uint64_t small_allreduce_bytes;
};

}  // namespace

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
  // Note [Chunk size]: over loopback TCP every chunk costs syscalls and wake-ups, so
  // chunks are large (1 MiB where ranks share cores); through shared memory a chunk
  // costs a memcpy, and 256 KiB keeps the pipeline full (measured on 4 ranks / 2
  // cores: 4 MiB all_reduce 8.2 GB/s busbw at 256 KiB against 5.3 at 1 MiB; level on
  // 2 ranks).
  algo_.chunk_bytes = cfg_.chunk_bytes > 0 ? static_cast<size_t>(cfg_.chunk_bytes)
                      : cfg_.shm && one_host(cfg_) ? 256 * 1024
                      : oversubscribed(cfg_)       ? 1024 * 1024
                                                   : 512 * 1024;
  // Note [small all_reduce threshold]
  // Recursive doubling takes log2(p) dependent steps moving the whole message;
  // the ring takes 2(p-1) steps moving 2(p-1)/p of it. Measured side by side on
  // a 2-vCPU VM (medians, float32 SUM): with 2 ranks the two cross between 64
  // and 256 KiB; with 4 ranks (two per core, where every extra step costs a
  // context switch) between 256 KiB and 1 MiB. Recursive doubling needs a
  // scratch copy of the message, which these thresholds keep small.
  algo_.small_allreduce_bytes = cfg_.small_allreduce_bytes >= 0 ? static_cast<size_t>(cfg_.small_allreduce_bytes)
                                : cfg_.world_size <= 2                 ? 128 * 1024
                                                                       : 512 * 1024;
  algo_.halving_doubling_max_bytes = cfg_.halving_doubling_max_bytes >= 0
                                         ? static_cast<size_t>(cfg_.halving_doubling_max_bytes)
                                         : 2u << 20;  // Note [large all_reduce on one host]
  sent_.assign(static_cast<size_t>(cfg_.world_size), 0);
  recvd_.assign(static_cast<size_t>(cfg_.world_size), 0);
  const Deadline dl = Deadline::after_ms(cfg_.timeout_ms);  // setup; Note [Two deadlines] in config.h
  if (cfg_.backend == Backend::kNccl && cfg_.world_size == 1) {
    auto t = std::make_unique<NcclTransport>(nullptr, cfg_, dl);
    nccl_ = t.get();
    transport_ = std::move(t);
    return;
  }
  if (cfg_.world_size == 1) {
    transport_ = std::make_unique<LocalTransport>();
    return;
  }
  if (cfg_.rank == 0) server_ = std::make_unique<StoreServer>(cfg_.master_addr, cfg_.master_port, cfg_.world_size);
  store_ = std::make_unique<StoreClient>(cfg_.master_addr, cfg_.master_port, cfg_.rank, cfg_.world_size, dl);
  if (cfg_.backend == Backend::kNccl) {
    // The unique id travels through the store; NCCL then connects the ranks itself.
    auto t = std::make_unique<NcclTransport>(store_.get(), cfg_, dl);
    nccl_ = t.get();
    transport_ = std::move(t);
    return;
  }
  GroupId id{};
  if (cfg_.rank == 0) {
    id = {make_nonce(), algo_.chunk_bytes, algo_.small_allreduce_bytes};
    store_->set("group", std::string(reinterpret_cast<const char*>(&id), sizeof(id)), dl);
  } else {
    std::string v = store_->get("group", dl, "Timeout waiting for peers: rank 0 did not start the group");
    if (v.size() != sizeof(id)) CX_THROW(ConnectionError, "malformed group id from the store");
    std::memcpy(&id, v.data(), sizeof(id));
    // Note [large all_reduce on one host]
// With a power-of-two world of 4 or more, halving-doubling moves the same bytes
// as the ring in 2 log2 p steps instead of 2(p-1). Measured side by side on a
// 2-vCPU VM with 4 ranks: 1.5-2x the ring's bandwidth at 1 MiB, level at 4 MiB,
// 10-20% behind from 16 MiB (its steps cannot be pipelined into each other as
// the ring's chunks are). Hence halving-doubling up to 2 MiB, the ring above.
// (A direct reduce-scatter + all-gather, every rank to every rank, was tried
// too: no better than the ring at 1-64 MiB on 3 and 4 ranks.)

// Note [Tuning agreed at init]: automatic values are rank 0's.
    if (cfg_.chunk_bytes <= 0) algo_.chunk_bytes = id.chunk_bytes;
    if (cfg_.small_allreduce_bytes < 0) algo_.small_allreduce_bytes = id.small_allreduce_bytes;
  }
  const uint64_t nonce = id.nonce;
  MeshOptions topt;
  topt.spin_us = default_spin_us(cfg_);
  topt.shm = cfg_.shm;
  topt.shm_ring_bytes = static_cast<size_t>(cfg_.shm_ring_bytes) / 64 * 64;
  transport_ = std::make_unique<MeshTransport>(*store_, cfg_.rank, cfg_.world_size, nonce, dl, topt);
  OpDesc init;
  init.kind = CollectiveKind::kInit;
  transport_->begin(init, dl);
  algo::barrier(*transport_);
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

ProcessGroup::WorkPtr ProcessGroup::submit(OpDesc desc, std::function<void(Transport&)> body, bool async) {
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
    transport_->begin(w.desc_, Deadline::after_ms(cfg_.operation_timeout_ms));
    w.body_(*transport_);
    w.finish(std::nullopt);
  } catch (const Error& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!poison_) poison_ = std::make_pair(e.kind(), std::string(e.what()));
    }
    transport_->abort(e.kind(), e.what());
    w.finish(std::make_pair(e.kind(), std::string(e.what())));
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!poison_) poison_ = std::make_pair(ErrorKind::kGeneric, std::string(e.what()));
    }
    transport_->abort(ErrorKind::kGeneric, e.what());
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
  if (transport_) {
    std::lock_guard<std::mutex> ex(exec_mu_);
    // A short grace period only: a peer that is still working (or has died)
    // must not hold up this process's exit. Closing with nothing unread sends
    // a FIN, never a reset, so data we sent still reaches peers that read it.
    transport_->close(Deadline::after_ms(failed ? 20 : 100));
  }
  if (store_ && cfg_.rank != 0) {
    try {
      store_->done(Deadline::after_ms(200));
    } catch (const Error&) {
      // rank 0's store may already be gone; nothing depends on it any more
    }
  }
  nccl_ = nullptr;
  transport_.reset();
  store_.reset();
  server_.reset();
}

// ---- the collectives ----------------------------------------------------------

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

ProcessGroup::WorkPtr ProcessGroup::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, bool async, uintptr_t stream) {
  check_reducible(dt, op);
  if (nccl_) {
    auto ready = nccl_->mark(stream, {buf}, "the array");
    return submit(make_desc(CollectiveKind::kAllReduce, dt, op, -1, count),
                  [=, n = nccl_](Transport&) { n->all_reduce(buf, count, dt, op, ready); }, async);
  }
  auto o = algo_;
  return submit(make_desc(CollectiveKind::kAllReduce, dt, op, -1, count),
                [=](Transport& t) { algo::all_reduce(t, buf, count, dt, op, o); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::broadcast(void* buf, size_t count, DataType dt, int root, bool async, uintptr_t stream) {
  check_root(root, "src");
  auto o = algo_;
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    auto ready = nccl_->mark(stream, {buf}, "the array");
    return submit(make_desc(CollectiveKind::kBroadcast, dt, ReduceOp::kNone, root, count),
                  [=, n = nccl_](Transport&) { n->broadcast(buf, bytes, root, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kBroadcast, dt, ReduceOp::kNone, root, count),
                [=](Transport& t) { algo::broadcast(t, buf, bytes, root, o); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt,
                                               bool async, uintptr_t stream) {
  if (outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "all_gather needs one output per rank: got ", outs.size(), " for world size ",
             cfg_.world_size);
  }
  auto o = algo_;
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    std::vector<const void*> bufs(outs.begin(), outs.end());
    bufs.push_back(in);
    auto ready = nccl_->mark(stream, bufs, "the all_gather input or output");
    return submit(make_desc(CollectiveKind::kAllGather, dt, ReduceOp::kNone, -1, count),
                  [=, n = nccl_](Transport&) { n->all_gather(in, outs, bytes, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kAllGather, dt, ReduceOp::kNone, -1, count),
                [=](Transport& t) { algo::all_gather(t, in, outs.data(), bytes, o); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                                   ReduceOp op, bool async, uintptr_t stream) {
  check_reducible(dt, op);
  if (ins.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "reduce_scatter needs one input block per rank: got ", ins.size(), " for world size ",
             cfg_.world_size);
  }
  auto o = algo_;
  if (nccl_) {
    std::vector<const void*> bufs(ins);
    bufs.push_back(out);
    auto ready = nccl_->mark(stream, bufs, "the reduce_scatter input or output");
    return submit(make_desc(CollectiveKind::kReduceScatter, dt, op, -1, count),
                  [=, n = nccl_](Transport&) { n->reduce_scatter(ins, out, count, dt, op, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kReduceScatter, dt, op, -1, count),
                [=](Transport& t) { algo::reduce_scatter(t, ins.data(), out, count, dt, op, o); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, bool async, uintptr_t stream) {
  check_reducible(dt, op);
  check_root(root, "dst");
  auto o = algo_;
  if (nccl_) {
    auto ready = nccl_->mark(stream, {buf}, "the array");
    return submit(make_desc(CollectiveKind::kReduce, dt, op, root, count),
                  [=, n = nccl_](Transport&) { n->reduce(buf, count, dt, op, root, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kReduce, dt, op, root, count),
                [=](Transport& t) { algo::reduce(t, buf, count, dt, op, root, o); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                            int root, bool async, uintptr_t stream) {
  check_root(root, "src");
  if (cfg_.rank == root && ins.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "scatter on the source rank needs one input per rank: got ", ins.size(),
             " for world size ", cfg_.world_size);
  }
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    std::vector<const void*> bufs(ins);
    bufs.push_back(out);
    auto ready = nccl_->mark(stream, bufs, "the scatter input or output");
    return submit(make_desc(CollectiveKind::kScatter, dt, ReduceOp::kNone, root, count),
                  [=, n = nccl_](Transport&) { n->scatter(ins, out, bytes, root, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kScatter, dt, ReduceOp::kNone, root, count),
                [=](Transport& t) { algo::scatter(t, ins.data(), out, bytes, root); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::gather(const void* in, std::vector<void*> outs, size_t count, DataType dt,
                                           int root, bool async, uintptr_t stream) {
  check_root(root, "dst");
  if (cfg_.rank == root && outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "gather on the destination rank needs one output per rank: got ", outs.size(),
             " for world size ", cfg_.world_size);
  }
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    std::vector<const void*> bufs(outs.begin(), outs.end());
    bufs.push_back(in);
    auto ready = nccl_->mark(stream, bufs, "the gather input or output");
    return submit(make_desc(CollectiveKind::kGather, dt, ReduceOp::kNone, root, count),
                  [=, n = nccl_](Transport&) { n->gather(in, outs, bytes, root, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kGather, dt, ReduceOp::kNone, root, count),
                [=](Transport& t) { algo::gather(t, in, outs.data(), bytes, root); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count,
                                               DataType dt, bool async, uintptr_t stream) {
  if (ins.size() != static_cast<size_t>(cfg_.world_size) || outs.size() != static_cast<size_t>(cfg_.world_size)) {
    CX_THROW(InvalidArgument, "all_to_all needs one input and one output block per rank: got ", ins.size(), " and ",
             outs.size(), " for world size ", cfg_.world_size);
  }
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    std::vector<const void*> bufs(ins);
    bufs.insert(bufs.end(), outs.begin(), outs.end());
    auto ready = nccl_->mark(stream, bufs, "the all_to_all input or output");
    return submit(make_desc(CollectiveKind::kAllToAll, dt, ReduceOp::kNone, -1, count),
                  [=, n = nccl_](Transport&) { n->all_to_all(ins, outs, bytes, ready); }, async);
  }
  return submit(make_desc(CollectiveKind::kAllToAll, dt, ReduceOp::kNone, -1, count),
                [=](Transport& t) { algo::all_to_all(t, ins.data(), outs.data(), bytes); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::barrier(bool async) {
  if (nccl_) {
    return submit(make_desc(CollectiveKind::kBarrier, DataType::kBytes, ReduceOp::kNone, -1, 0),
                  [n = nccl_](Transport&) { n->barrier(); }, async);
  }
  return submit(make_desc(CollectiveKind::kBarrier, DataType::kBytes, ReduceOp::kNone, -1, 0),
                [](Transport& t) { algo::barrier(t); }, async);
}

// A send and its matching recv carry the same descriptor: kind send/recv,
// root = the sender, count, dtype, and the pair's message number.
ProcessGroup::WorkPtr ProcessGroup::send(const void* buf, size_t count, DataType dt, int dst, bool async, uintptr_t stream) {
  check_peer(dst, "dst");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, cfg_.rank, count);
  {
    std::lock_guard<std::mutex> lk(mu_);
    d.seq = ++sent_[static_cast<size_t>(dst)];
  }
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    auto ready = nccl_->mark(stream, {buf}, "the array");
    return submit(d, [=, n = nccl_](Transport&) { n->send(buf, bytes, dst, ready); }, async);
  }
  return submit(d, [=](Transport& t) { t.wait(t.isend(dst, buf, bytes)); }, async);
}

ProcessGroup::WorkPtr ProcessGroup::recv(void* buf, size_t count, DataType dt, int src, bool async, uintptr_t stream) {
  check_peer(src, "src");
  OpDesc d = make_desc(CollectiveKind::kSendRecv, dt, ReduceOp::kNone, src, count);
  {
    std::lock_guard<std::mutex> lk(mu_);
    d.seq = ++recvd_[static_cast<size_t>(src)];
  }
  size_t bytes = count * dtype_size(dt);
  if (nccl_) {
    auto ready = nccl_->mark(stream, {buf}, "the array");
    return submit(d, [=, n = nccl_](Transport&) { n->recv(buf, bytes, src, ready); }, async);
  }
  return submit(d, [=](Transport& t) { t.wait(t.irecv(src, buf, bytes)); }, async);
}

}  // namespace cx::distributed
