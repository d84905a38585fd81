#include "distributed/backend/nccl/nccl_backend.h"

#include <algorithm>

#include <cstring>
#include <exception>
#include <random>
#include <thread>

#include "distributed/net/auth.h"
#include "distributed/store/store.h"

namespace cx::distributed {

using namespace cx::cuda;
using namespace cx::distributed::nccl;

namespace {
// Store values start with a tag byte: the id is random bytes and may begin with
// anything (NCCL's starts with a random magic), so it is never told apart from
// an error by its own first byte.
const char kErrorMark = '\x01';  // an error message follows
const char kIdMark = 'I';         // the unique id follows
}

// ---- the unique id ------------------------------------------------------------------

std::string exchange_nccl_id(Store& store, int rank, int world, const Deadline& dl,
                             const std::function<void()>& prepare, const std::function<std::string()>& make_id) {
  std::exception_ptr err;  // this rank's own failure, rethrown as it was
  std::string mine;
  std::string id;
  try {
    prepare();
    if (rank == 0) id = make_id();
  } catch (const std::exception& e) {
    err = std::current_exception();
    mine = e.what();
  }
  if (rank == 0) store.set("nccl/id", mine.empty() ? kIdMark + id : kErrorMark + mine, dl);
  store.set("nccl/ready/" + std::to_string(rank), mine.empty() ? "" : kErrorMark + mine, dl);
  // Rank 0 hosts the store, so it stays until every rank has read what it
  // needs ("seen"), even when it is about to fail itself.
  std::string other;  // the first other rank's error
  if (!err || rank == 0) {
    for (int q = 0; q < world && (rank == 0 || other.empty()); ++q) {
      if (q == rank) continue;
      std::string v = store.get("nccl/ready/" + std::to_string(q), dl,
                                detail::concat("Timeout waiting for peers: rank ", rank, " waited for rank ", q,
                                               " to join the NCCL communicator"));
      if (!v.empty() && v[0] == kErrorMark && other.empty()) {
        other = detail::concat("rank ", q, " could not join the NCCL communicator: ", v.substr(1));
      }
    }
  }
  if (rank != 0 && !err && other.empty()) {
    std::string v = store.get("nccl/id", dl, "Timeout waiting for peers: rank 0 did not publish the NCCL unique id");
    if (!v.empty() && v[0] == kErrorMark) throw Error("rank 0 could not join the NCCL communicator: " + v.substr(1));
    if (v.empty() || v[0] != kIdMark) CX_THROW(ConnectionError, "malformed NCCL unique id from the store");
    id = v.substr(1);
  }
  if (rank != 0) store.set("nccl/seen/" + std::to_string(rank), "", dl);
  if (rank == 0) {
    for (int q = 1; q < world; ++q) {
      store.get("nccl/seen/" + std::to_string(q), dl,
                detail::concat("Timeout waiting for peers: rank 0 waited for rank ", q, " to read the NCCL unique id"));
    }
  }
  if (err) std::rethrow_exception(err);
  if (!other.empty()) throw Error(other);
  if (id.size() != kUniqueIdBytes) {
    CX_THROW(ConnectionError, "malformed NCCL unique id from the store (", id.size(), " bytes, expected ",
             kUniqueIdBytes, ")");
  }
  return id;
}

std::string nccl_id_exchange_selftest(const Config& cfg, int fail_rank, int first_byte) {
  const Deadline dl = Deadline::after_ms(cfg.timeout_ms);
  std::unique_ptr<StoreServer> server;
  const std::string secret = net::job_secret(cfg.master_addr, cfg.rank);
  if (cfg.rank == 0) {
    server = std::make_unique<StoreServer>(cfg.master_addr, cfg.master_port, cfg.world_size, secret);
  }
  StoreClient store(cfg.master_addr, cfg.master_port, cfg.rank, cfg.world_size, secret, dl);
  std::string id = exchange_nccl_id(
      store, cfg.rank, cfg.world_size, dl,
      [&] {
        if (cfg.rank == fail_rank) CX_THROW(InvalidArgument, "LOCAL_RANK=", cfg.local_rank, " has no GPU (test)");
      },
      [first_byte] {
        std::random_device rd;
        std::string s(kUniqueIdBytes, '\0');
        for (auto& c : s) c = static_cast<char>(rd());
        if (first_byte >= 0) s[0] = static_cast<char>(first_byte);
        return s;
      });
  return id;  // no store.done(): rank 0 may already be gone once every rank has seen the id
}

// ---- NcclBackend ---------------------------------------------------------------------

NcclBackend::NcclBackend(Store* store, const Config& cfg, const Deadline& dl)
    : rank_(cfg.rank), size_(cfg.world_size), device_(cfg.local_rank) {
  try {
    setup(store, dl);
  } catch (...) {
    try {
      close(dl);  // release what was made before the failure
    } catch (...) {
    }
    throw;
  }
}

void NcclBackend::setup(Store* store, const Deadline& dl) {
  // The local checks, in the order a user fixes them: a GPU, then NCCL.
  auto prepare = [&] {
    const CudaDriver& d = cuda_driver();
    int n = 0;
    check_cu(d.cuDeviceGetCount(&n), "cuDeviceGetCount");
    check_local_rank(device_, n);
    CUdevice dev;
    check_cu(d.cuDeviceGet(&dev, device_), "cuDeviceGet");
    check_cu(d.cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
    make_current();
    api_ = &nccl_api();
  };
  auto make_id = [&] {
    ncclUniqueId uid;
    ncclResult_t r = api_->ncclGetUniqueId(&uid);
    if (r != ncclSuccess) CX_THROW(Error, "ncclGetUniqueId failed: ", api_->error_text(r));
    return std::string(uid.internal, kUniqueIdBytes);
  };
  std::string id;
  if (store) {
    id = exchange_nccl_id(*store, rank_, size_, dl, prepare, make_id);
  } else {
    prepare();
    id = make_id();
  }
  const CudaDriver& d = cuda_driver();
  check_cu(d.cuStreamCreate(&stream_, kStreamNonBlocking), "cuStreamCreate");
  check_cu(d.cuEventCreate(&ready_, kEventDisableTiming), "cuEventCreate");
  check_cu(d.cuMemAlloc(&scratch_, 4), "cuMemAlloc");
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), kUniqueIdBytes);
  // Every rank has just shown up in the store, so this meets them promptly.
  ncclResult_t r = api_->ncclCommInitRank(&comm_, size_, uid, rank_);
  if (r != ncclSuccess) {
    comm_ = nullptr;
    CX_THROW(ConnectionError, "rank ", rank_, ": ncclCommInitRank on GPU ", device_, " failed: ", api_->error_text(r));
  }
  OpDesc init;
  init.kind = CollectiveKind::kInit;
  begin(init, dl, false);
  run_barrier();
  Poll landed = launched(false);
  while (!landed()) std::this_thread::yield();
}

NcclBackend::~NcclBackend() {
  try {
    close(Deadline::after_ms(0));
  } catch (...) {
  }
}

void NcclBackend::make_current() const { check_cu(cuda_driver().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

void NcclBackend::begin(const OpDesc& desc, const Deadline& dl, bool on_submitter) {
  desc_ = desc;
  dl_ = dl;
  on_submitter_ = on_submitter;
}

std::shared_ptr<cuda::Event> EventPool::take() {
  std::unique_ptr<cuda::Event> e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      e = std::move(free_.back());
      free_.pop_back();
    }
  }
  if (!e) e = std::make_unique<cuda::Event>();
  // A wait already enqueued on an event is unaffected by recording it again.
  return std::shared_ptr<cuda::Event>(e.release(), [pool = shared_from_this()](cuda::Event* ev) {
    std::lock_guard<std::mutex> lk(pool->mu_);
    pool->free_.emplace_back(ev);
  });
}

void NcclBackend::abort(ErrorKind, const std::string&) {
  std::lock_guard<std::mutex> lk(comm_mu_);
  if (comm_) {
    api_->ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

void NcclBackend::close(const Deadline&) {
  if (!ctx_) return;  // construction failed before anything was made
  const CudaDriver& d = cuda_driver();
  d.cuCtxSetCurrent(ctx_);
  std::lock_guard<std::mutex> lk(comm_mu_);
  if (comm_) {
    // Every collective has completed (each one is waited for), so nothing is in flight.
    api_->ncclCommDestroy(comm_);
    comm_ = nullptr;
  }
  scale_.reset();
  events_ = std::make_shared<EventPool>();  // the pooled events go while the context is current
  if (scratch_) d.cuMemFree(scratch_);
  if (ready_) d.cuEventDestroy(ready_);
  if (stream_) d.cuStreamDestroy(stream_);
  scratch_ = 0;
  ready_ = nullptr;
  stream_ = nullptr;
  CUdevice dev;
  if (d.cuDeviceGet(&dev, device_) == kSuccess) d.cuDevicePrimaryCtxRelease(dev);
  ctx_ = nullptr;
}

Ready NcclBackend::mark(uintptr_t stream, const void* const* bufs, size_t n, const char* what) {
  const CudaDriver& d = cuda_driver();
  make_current();
  for (size_t i = 0; i < n; ++i) {
    const void* p = bufs[i];
    if (!p) continue;  // an empty array
    // One driver call for both attributes; memory the driver does not know reads as type 0.
    int attrs[2] = {kPointerAttributeMemoryType, kPointerAttributeDeviceOrdinal};
    unsigned type = 0;
    int ordinal = -1;
    void* data[2] = {&type, &ordinal};
    CUresult r = d.cuPointerGetAttributes(2, attrs, data, reinterpret_cast<CUdeviceptr>(p));
    if (r != kSuccess || type == 0 || type == kMemoryTypeHost) {
      CX_THROW(TypeMismatch, what, " is in host memory, but BackendType.NCCL works on GPU memory: pass a CuPy "
                               "array (cupy.asarray(a)) or use BackendType.CPU for NumPy arrays");
    }
    if (type == kMemoryTypeDevice && ordinal >= 0 && ordinal != device_) {
      CX_THROW(TypeMismatch, what, " is on GPU ", ordinal, ", but rank ", rank_, "'s communicator is on GPU ",
               device_, " (LOCAL_RANK): allocate it under cupy.cuda.Device(", device_, ")");
    }
  }
  return Ready{stream_of(stream), true};
}

void NcclBackend::start(const Ready& ready) {
  if (!comm_) CX_THROW(Error, "rank ", rank_, ": the NCCL communicator was aborted");
  if (!ready.known) make_current();  // mark() did, on this thread, for the others
  if (on_submitter_ && ready.known) {
    run_ = ready.stream;  // after the caller's work by running there
    return;
  }
  run_ = stream_;
  if (ready.known) {
    // A wait already enqueued on an event is unaffected by recording it again, so one event serves every launch.
    const CudaDriver& d = cuda_driver();
    check_cu(d.cuEventRecord(ready_, ready.stream), "cuEventRecord on the array's stream");
    check_cu(d.cuStreamWaitEvent(stream_, ready_, 0), "cuStreamWaitEvent");
  }
}

void NcclBackend::check(ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) {
    CX_THROW(InvalidArgument, "rank ", rank_, ": NCCL refused ", desc_.describe(), ": ", api_->error_text(r, comm_));
  }
  fail_async(r, desc_);
}

void NcclBackend::fail_async(ncclResult_t r, const OpDesc& desc) {
  CX_THROW(ConnectionError, "rank ", rank_, ": ", desc.describe(), " failed on GPU ", device_, ": ",
           api_->error_text(r, comm_),
           ". A peer rank probably died or lost its network; the NCCL communicator has been aborted");
}

Backend::Poll NcclBackend::launched(bool async) {
  // A blocking collective is waited for at once, by a query of the stream it ran on: work queued there after
  // it can only make the wait longer, and a query costs less than recording an event and querying that. An
  // async one gets an event, so its wait does not include what is launched after it.
  std::shared_ptr<cuda::Event> done;
  if (async) {
    done = events_->take();
    check_cu(cuda_driver().cuEventRecord(done->get(), run_), "cuEventRecord");
  }
  return [this, done = std::move(done), stream = run_, desc = desc_, dl = dl_, n = 0]() mutable {
    return poll(done.get(), stream, desc, dl, n++);
  };
}

bool NcclBackend::poll(const cuda::Event* done, cuda::CUstream stream, const OpDesc& desc, const Deadline& dl,
                       int n) {
  const CudaDriver& d = cuda_driver();
  if (n == 0) make_current();  // the waiting thread may not be the one that launched
  CUresult q = done ? d.cuEventQuery(done->get()) : d.cuStreamQuery(stream);
  if (q == kSuccess) {
    // An aborted communicator's kernels end too, with nothing done: that is no success.
    std::lock_guard<std::mutex> lk(comm_mu_);
    if (!comm_) CX_THROW(Error, "rank ", rank_, ": ", desc.describe(), ": the NCCL communicator was aborted");
    return true;
  }
  if (q != kErrorNotReady) {
    CX_THROW(Error, "rank ", rank_, ": ", desc.describe(), " failed on GPU ", device_, ": ", d.error_text(q));
  }
  if (n % 16 == 15) {
    std::lock_guard<std::mutex> lk(comm_mu_);  // abort() may end the communicator from another thread
    if (!comm_) CX_THROW(Error, "rank ", rank_, ": the NCCL communicator was aborted");
    ncclResult_t async = ncclSuccess;
    if (api_->ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      fail_async(async, desc);
    }
  }
  if (dl.expired()) {
    CX_THROW(TimeoutError, "rank ", rank_, ": ", desc.describe(), " on GPU ", device_, " did not complete within ",
             dl.timeout_ms, " ms (operation_timeout_ms, DISTRIBUTED_OPERATION_TIMEOUT_MS): a peer rank is late, "
             "stuck or dead. The NCCL communicator has been aborted");
  }
  return false;
}

// ---- the collectives ---------------------------------------------------------------

Backend::Body NcclBackend::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, uintptr_t stream) {
  auto ready = mark(stream, buf, "the array");
  return [=] { run_all_reduce(buf, count, dt, op, ready); };
}

Backend::Body NcclBackend::broadcast(void* buf, size_t count, DataType dt, int root, uintptr_t stream) {
  auto ready = mark(stream, buf, "the array");
  return [=, bytes = count * dtype_size(dt)] { run_broadcast(buf, bytes, root, ready); };
}

Backend::Body NcclBackend::all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt,
                                      uintptr_t stream) {
  std::vector<const void*> bufs(outs.begin(), outs.end());
  bufs.push_back(in);
  auto ready = mark(stream, bufs, "the all_gather input or output");
  return [=, bytes = count * dtype_size(dt)] { run_all_gather(in, outs, bytes, ready); };
}

Backend::Body NcclBackend::reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                          ReduceOp op, uintptr_t stream) {
  std::vector<const void*> bufs(ins);
  bufs.push_back(out);
  auto ready = mark(stream, bufs, "the reduce_scatter input or output");
  return [=] { run_reduce_scatter(ins, out, count, dt, op, ready); };
}

Backend::Body NcclBackend::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, uintptr_t stream) {
  auto ready = mark(stream, buf, "the array");
  return [=] { run_reduce(buf, count, dt, op, root, ready); };
}

Backend::Body NcclBackend::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root,
                                   uintptr_t stream) {
  std::vector<const void*> bufs(ins);
  bufs.push_back(out);
  auto ready = mark(stream, bufs, "the scatter input or output");
  return [=, bytes = count * dtype_size(dt)] { run_scatter(ins, out, bytes, root, ready); };
}

Backend::Body NcclBackend::gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root,
                                  uintptr_t stream) {
  std::vector<const void*> bufs(outs.begin(), outs.end());
  bufs.push_back(in);
  auto ready = mark(stream, bufs, "the gather input or output");
  return [=, bytes = count * dtype_size(dt)] { run_gather(in, outs, bytes, root, ready); };
}

Backend::Body NcclBackend::all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count,
                                      DataType dt, uintptr_t stream) {
  std::vector<const void*> bufs(ins);
  bufs.insert(bufs.end(), outs.begin(), outs.end());
  auto ready = mark(stream, bufs, "the all_to_all input or output");
  return [=, bytes = count * dtype_size(dt)] { run_all_to_all(ins, outs, bytes, ready); };
}

Backend::Body NcclBackend::barrier(uint64_t) {
  return [this] { run_barrier(); };
}

Backend::Body NcclBackend::send(const void* buf, size_t count, DataType dt, int dst, uintptr_t stream) {
  auto ready = mark(stream, buf, "the array");
  return [=, bytes = count * dtype_size(dt)] { run_send(buf, bytes, dst, ready); };
}

Backend::Body NcclBackend::recv(void* buf, size_t count, DataType dt, int src, uintptr_t stream) {
  auto ready = mark(stream, buf, "the array");
  return [=, bytes = count * dtype_size(dt)] { run_recv(buf, bytes, src, ready); };
}

void NcclBackend::scale(void* x, size_t n, DataType dt, double f) {
  if (n == 0) return;
  if (!scale_) {
    scale_ = std::make_unique<cuda::Module>("scale", "ReduceOp.AVG on NCCL older than 2.10 needs them: reinstall "
                                                     "pycyxwiz where nvcc is on PATH, or update NCCL to 2.10 or newer");
  }
  unsigned long long count = n;
  float ff = static_cast<float>(f);
  void* args[3] = {&x, &count, &ff};
  const char* kernel = nullptr;
  switch (dt) {
    case DataType::kFloat32: kernel = "cx_scale_f32"; break;
    case DataType::kFloat16: kernel = "cx_scale_f16"; break;
    case DataType::kBFloat16: kernel = "cx_scale_bf16"; break;
    case DataType::kFloat64: kernel = "cx_scale_f64"; args[2] = &f; break;
    default: CX_THROW(InvalidArgument, "cannot scale ", dtype_name(dt), " values");
  }
  const unsigned block = 256;
  const unsigned grid = static_cast<unsigned>(std::min<size_t>((n + block - 1) / block, 4096));
  check_cu(cuda_driver().cuLaunchKernel(scale_->fn(kernel), grid, 1, 1, block, 1, 1, 0, run_, args, nullptr),
           "launching cx_scale");
}

void NcclBackend::run_all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, const Ready& ready) {
  start(ready);
  bool avg_by_hand = op == ReduceOp::kAvg && !api_->has_avg();
  ncclRedOp_t nop = to_nccl(avg_by_hand ? ReduceOp::kSum : op);
  check(api_->ncclAllReduce(buf, buf, count, to_nccl(dt), nop, comm_, run_));
  if (avg_by_hand) {
    scale(buf, count, dt, 1.0 / size_);
  }
}

void NcclBackend::run_broadcast(void* buf, size_t bytes, int root, const Ready& ready) {
  start(ready);
  check(api_->ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, run_));
}

void NcclBackend::run_all_gather(const void* in, const std::vector<void*>& outs, size_t bytes, const Ready& ready) {
  start(ready);
  bool contiguous = true;
  for (size_t r = 0; r < outs.size(); ++r) {
    contiguous = contiguous && static_cast<char*>(outs[r]) == static_cast<char*>(outs[0]) + r * bytes;
  }
  if (contiguous) {
    check(api_->ncclAllGather(in, outs[0], bytes, ncclUint8, comm_, run_));
  } else {
    // Separate output arrays: one broadcast from each rank, fused into one launch.
    check(api_->ncclGroupStart());
    for (int r = 0; r < size_; ++r) check(api_->ncclBroadcast(in, outs[r], bytes, ncclUint8, r, comm_, run_));
    check(api_->ncclGroupEnd());
  }
}

void NcclBackend::run_reduce_scatter(const std::vector<const void*>& ins, void* out, size_t count, DataType dt,
                                   ReduceOp op, const Ready& ready) {
  if (op == ReduceOp::kAvg && !api_->has_avg()) {
    CX_THROW(InvalidArgument, "reduce_scatter with ReduceOp.AVG needs NCCL 2.10 or newer (this is ", api_->version,
             "): use SUM and divide");
  }
  start(ready);
  size_t bytes = count * dtype_size(dt);
  bool contiguous = true;
  for (size_t r = 0; r < ins.size(); ++r) {
    contiguous = contiguous && static_cast<const char*>(ins[r]) == static_cast<const char*>(ins[0]) + r * bytes;
  }
  if (contiguous) {
    check(api_->ncclReduceScatter(ins[0], out, count, to_nccl(dt), to_nccl(op), comm_, run_));
  } else {
    // Separate input arrays: block r is reduced onto rank r.
    check(api_->ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
      check(api_->ncclReduce(ins[r], out, count, to_nccl(dt), to_nccl(op), r, comm_, run_));
    }
    check(api_->ncclGroupEnd());
  }
}

void NcclBackend::run_reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, const Ready& ready) {
  if (op == ReduceOp::kAvg && !api_->has_avg()) {
    CX_THROW(InvalidArgument, "reduce with ReduceOp.AVG needs NCCL 2.10 or newer (this is ", api_->version,
             "): use SUM and divide");
  }
  start(ready);
  check(api_->ncclReduce(buf, buf, count, to_nccl(dt), to_nccl(op), root, comm_, run_));
}

void NcclBackend::run_scatter(const std::vector<const void*>& ins, void* out, size_t bytes, int root,
                            const Ready& ready) {
  start(ready);
  check(api_->ncclGroupStart());
  if (rank_ == root) {
    for (int r = 0; r < size_; ++r) check(api_->ncclSend(ins[r], bytes, ncclUint8, r, comm_, run_));
  }
  check(api_->ncclRecv(out, bytes, ncclUint8, root, comm_, run_));
  check(api_->ncclGroupEnd());
}

void NcclBackend::run_gather(const void* in, const std::vector<void*>& outs, size_t bytes, int root,
                           const Ready& ready) {
  start(ready);
  check(api_->ncclGroupStart());
  check(api_->ncclSend(in, bytes, ncclUint8, root, comm_, run_));
  if (rank_ == root) {
    for (int r = 0; r < size_; ++r) check(api_->ncclRecv(outs[r], bytes, ncclUint8, r, comm_, run_));
  }
  check(api_->ncclGroupEnd());
}

void NcclBackend::run_all_to_all(const std::vector<const void*>& ins, const std::vector<void*>& outs, size_t bytes,
                               const Ready& ready) {
  start(ready);
  check(api_->ncclGroupStart());
  for (int r = 0; r < size_; ++r) {
    check(api_->ncclSend(ins[r], bytes, ncclUint8, r, comm_, run_));
    check(api_->ncclRecv(outs[r], bytes, ncclUint8, r, comm_, run_));
  }
  check(api_->ncclGroupEnd());
}

void NcclBackend::run_send(const void* buf, size_t bytes, int peer, const Ready& ready) {
  start(ready);
  check(api_->ncclSend(buf, bytes, ncclUint8, peer, comm_, run_));
}

void NcclBackend::run_recv(void* buf, size_t bytes, int peer, const Ready& ready) {
  start(ready);
  check(api_->ncclRecv(buf, bytes, ncclUint8, peer, comm_, run_));
}

void NcclBackend::run_barrier() {
  start(Ready{});
  check(api_->ncclAllReduce(reinterpret_cast<void*>(scratch_), reinterpret_cast<void*>(scratch_), 1, ncclFloat32,
                            ncclSum, comm_, run_));
}

}  // namespace cx::distributed
