#include "distributed/backend/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <utility>

#include "common/env.h"
#include "distributed/store/store.h"
#include "distributed/transport/mesh_transport.h"

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
  return local_world_size_from_environment().value_or(c.world_size);
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

algo::AlgoOptions default_options(const Config& cfg) {
  algo::AlgoOptions o;
  // Note [Chunk size]: over loopback TCP every chunk costs syscalls and wake-ups, so
  // chunks are large (1 MiB where ranks share cores); through shared memory a chunk
  // costs a memcpy, and 256 KiB keeps the pipeline full (measured on 4 ranks / 2
  // cores: 4 MiB all_reduce 8.2 GB/s busbw at 256 KiB against 5.3 at 1 MiB; level on
  // 2 ranks).
  o.chunk_bytes = cfg.chunk_bytes > 0    ? static_cast<size_t>(cfg.chunk_bytes)
                  : cfg.shm && one_host(cfg) ? 256 * 1024
                  : oversubscribed(cfg)      ? 1024 * 1024
                                             : 512 * 1024;
  // Note [small all_reduce threshold]
  // Recursive doubling takes log2(p) dependent steps moving the whole message;
  // the ring takes 2(p-1) steps moving 2(p-1)/p of it. Measured side by side on
  // a 2-vCPU VM (medians, float32 SUM): with 2 ranks the two cross between 64
  // and 256 KiB; with 4 ranks (two per core, where every extra step costs a
  // context switch) between 256 KiB and 1 MiB. Recursive doubling needs a
  // scratch copy of the message, which these thresholds keep small.
  o.small_allreduce_bytes = cfg.small_allreduce_bytes >= 0 ? static_cast<size_t>(cfg.small_allreduce_bytes)
                            : cfg.world_size <= 2             ? 128 * 1024
                                                              : 512 * 1024;
  o.halving_doubling_max_bytes = cfg.halving_doubling_max_bytes >= 0
                                     ? static_cast<size_t>(cfg.halving_doubling_max_bytes)
                                     : 2u << 20;  // Note [large all_reduce on one host]
  o.hierarchical_slice_bytes =
      cfg.hierarchical_slice_bytes > 0 ? static_cast<size_t>(cfg.hierarchical_slice_bytes) : 0;
  return o;
}

// Note [large all_reduce on one host]
// With a power-of-two world of 4 or more, halving-doubling moves the same bytes
// as the ring in 2 log2 p steps instead of 2(p-1). Measured side by side on a
// 2-vCPU VM with 4 ranks: 1.5-2x the ring's bandwidth at 1 MiB, level at 4 MiB,
// 10-20% behind from 16 MiB (its steps cannot be pipelined into each other as
// the ring's chunks are). Hence halving-doubling up to 2 MiB, the ring above.
// (A direct reduce-scatter + all-gather, every rank to every rank, was tried
// too: no better than the ring at 1-64 MiB on 3 and 4 ranks.)

// Note [When to go hierarchical]
// Across hosts with several ranks each (auto), all_reduce, reduce_scatter and
// all_gather go hierarchical from kHierarchicalMinBytes up, broadcast from the
// small-broadcast threshold. Measured on 2 hosts of 2 ranks behind 1 Gbit/s links
// (network namespaces), all_reduce hierarchical / flat: 0.47-0.72x at 8 B-16 KiB
// (two more steps inside each host, latency-bound), 1.16x at 32 KiB, 2.0x at
// 64-256 KiB, 1.9x at 1 MiB, 1.2-1.35x at 4-64 MiB with its phases one after
// the other, 1.50-1.52x pipelined (Note [Pipelined hierarchical all_reduce]). The cost model
// (benchmarks/cost_model.py) agrees that below 512 KiB, where the flat group
// runs recursive doubling, every exchange across hosts carries the whole message
// once per rank of the host, 2-8x the hierarchical cost at 64-1024 ranks.
constexpr size_t kHierarchicalMinBytes = 32 * 1024;
// Note [Broadcast from the root to all] in broadcast.cpp: on three ranks the chain's two hops are faster here.
constexpr size_t kStarBroadcastSkipFromThreeRanks = 768u << 10;
constexpr size_t kStarBroadcastSkipToThreeRanks = 4u << 20;
// Note [Bruck's all_gather] in allgather.cpp and Note [Reduce-scatter by recursive halving] in allreduce_hd.cpp:
// the largest block each goes to, through shared-memory rings and where sockets carry some pair.
constexpr size_t kSmallAllGatherBytesRings = 8 * 1024;
constexpr size_t kSmallAllGatherBytesSockets = 128 * 1024;
constexpr size_t kSmallReduceScatterBytesRings = 1024;
constexpr size_t kSmallReduceScatterBytesSockets = 16 * 1024;

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

std::unique_ptr<Backend> make_cpu_backend(const Config& cfg, Store* store, const std::string& secret,
                                          const Deadline& dl) {
  algo::AlgoOptions opt = default_options(cfg);
  if (!store) return std::make_unique<CpuBackend>(std::make_unique<LocalTransport>(), opt);
  GroupId id{};
  if (cfg.rank == 0) {
    id = {make_nonce(), opt.chunk_bytes, opt.small_allreduce_bytes};
    store->set("group", std::string(reinterpret_cast<const char*>(&id), sizeof(id)), dl);
  } else {
    std::string v = store->get("group", dl, "Timeout waiting for peers: rank 0 did not start the group");
    if (v.size() != sizeof(id)) CX_THROW(ConnectionError, "malformed group id from the store");
    std::memcpy(&id, v.data(), sizeof(id));
    // Note [Tuning agreed at init]: automatic values are rank 0's.
    if (cfg.chunk_bytes <= 0) opt.chunk_bytes = id.chunk_bytes;
    if (cfg.small_allreduce_bytes < 0) opt.small_allreduce_bytes = id.small_allreduce_bytes;
  }
  MeshOptions topt;
  topt.spin_us = default_spin_us(cfg);
  topt.shm = cfg.shm;
  topt.shm_ring_bytes = static_cast<size_t>(cfg.shm_ring_bytes) / 64 * 64;
  topt.shm_single_copy = cfg.shm_single_copy;
  topt.core_each = !oversubscribed(cfg);
  auto backend = std::make_unique<CpuBackend>(
      std::make_unique<MeshTransport>(*store, cfg.rank, cfg.world_size, id.nonce, secret, dl, topt), opt,
      cfg.algorithm);
  OpDesc init;
  init.kind = CollectiveKind::kInit;
  backend->begin(init, dl, true);
  backend->barrier(0)();
  backend->agree_on_single_copies();
  if (cfg.small_allreduce_bytes < 0) backend->measure_link();  // set by the user: the thresholds stand
  return backend;
}

CpuBackend::CpuBackend(std::unique_ptr<Transport> transport, const algo::AlgoOptions& opt, Algorithm algorithm)
    : t_(std::move(transport)), opt_(opt) {
  if (algorithm == Algorithm::kFlat || t_->size() == 1) return;
  std::string why;
  auto h = algo::Hierarchy::of(t_->hosts(), &why);
  if (algorithm == Algorithm::kHierarchical && !h) {
    // Every rank sees the same hosts, so every rank refuses alike.
    CX_THROW(InvalidArgument, "rank ", t_->rank(), ": CX_ALGORITHM=hierarchical cannot be used here: ", why,
             "; use CX_ALGORITHM=auto or flat");
  }
  if (h && (algorithm == Algorithm::kHierarchical || h->pays())) {
    hier_ = std::move(h);
    forced_ = algorithm == Algorithm::kHierarchical;
  }
}

void CpuBackend::agree_on_single_copies() {
  if (t_->size() < 3) return;  // the broadcast from the root to all is for more than two ranks
  int32_t all[3] = {t_->reads_peers() ? 1 : 0, t_->through_rings() ? 1 : 0, t_->host_through_rings() ? 1 : 0};
  algo::all_reduce(*t_, all, 3, DataType::kInt32, ReduceOp::kMin, opt_);
  opt_.star_broadcast = all[0] == 1;
  // Note [Bruck's all_gather] in allgather.cpp, Note [Reduce-scatter by recursive halving] in allreduce_hd.cpp:
  // where a step costs a socket's latency they pay to larger blocks than through rings.
  opt_.small_all_gather_bytes = all[1] == 1 ? kSmallAllGatherBytesRings : kSmallAllGatherBytesSockets;
  opt_.small_reduce_scatter_bytes = all[1] == 1 ? kSmallReduceScatterBytesRings : kSmallReduceScatterBytesSockets;
  opt_.in_host_all_gather_bytes = all[2] == 1 ? kSmallAllGatherBytesRings : kSmallAllGatherBytesSockets;
  opt_.in_host_reduce_scatter_bytes = all[2] == 1 ? kSmallReduceScatterBytesRings : kSmallReduceScatterBytesSockets;
  if (all[0] == 1 && t_->size() == 3) {
    opt_.star_broadcast_skip_from = kStarBroadcastSkipFromThreeRanks;
    opt_.star_broadcast_skip_to = kStarBroadcastSkipToThreeRanks;
  }
}

void CpuBackend::measure_link() {
  const std::vector<int> hosts = t_->hosts();
  const int p = t_->size(), me = t_->rank();
  if (hosts.size() != static_cast<size_t>(p)) return;
  std::vector<int> distinct(hosts);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  if (distinct.size() < 3) return;  // by the link only among three or more hosts
  int peer = 0;
  while (hosts[static_cast<size_t>(peer)] == hosts[0]) ++peer;
  double v[2] = {0, 0};  // rank 0's: seconds per message, seconds per byte
  if (me == 0 || me == peer) {
    using clock = std::chrono::steady_clock;
    constexpr size_t kLarge = 1 << 20;
    std::vector<char> big(kLarge);
    uint64_t word = 0;
    const int other = me == 0 ? peer : 0;
    auto round_trip = [&](void* buf, size_t n) {  // seconds, as rank 0 sees it
      const auto t0 = clock::now();
      if (me == 0) {
        t_->wait(t_->isend(other, buf, n));
        t_->wait(t_->irecv(other, buf, n));
      } else {
        t_->wait(t_->irecv(other, buf, n));
        t_->wait(t_->isend(other, buf, n));
      }
      return std::chrono::duration<double>(clock::now() - t0).count();
    };
    double small = 1e9, large = 1e9;  // fixed counts: each round trip takes both ends, whatever either measures
    for (int i = 0; i < 10; ++i) small = std::min(small, round_trip(&word, sizeof(word)));
    for (int i = 0; i < 4; ++i) large = std::min(large, round_trip(big.data(), kLarge));
    v[0] = small / 2;
    v[1] = std::max(0.0, large / 2 - small / 2) / static_cast<double>(kLarge);
  }
  algo::broadcast(*t_, v, sizeof(v), 0, opt_);  // rank 0's numbers everywhere: every rank chooses alike
  opt_.link_alpha = v[0];
  opt_.link_beta = v[1];
  opt_.across_hosts = distinct.size() == static_cast<size_t>(p);
}

std::string CpuBackend::describe() const {
  if (hier_) {
    return detail::concat("hierarchical across ", hier_->ranks.size(), " hosts of ", hier_->per_host,
                          " ranks (all_reduce, reduce_scatter, all_gather, broadcast, reduce",
                          forced_ ? std::string()
                                  : detail::concat(" from ", kHierarchicalMinBytes,
                                                   " bytes, broadcast and reduce from ", opt_.small_broadcast_bytes,
                                                   " bytes"),
                          "): ring inside a host, the flat algorithms across hosts by column (all_reduce: direct "
                          "across hosts, pipelined in slices ",
                          opt_.hierarchical_slice_bytes ? detail::concat("of ", opt_.hierarchical_slice_bytes, " bytes")
                                                        : std::string("from the cost model"),
                          "); flat otherwise: ",
                          flat_description());
  }
  return flat_description();
}

std::string CpuBackend::flat_description() const {
  const std::string link =
      opt_.link_beta > 0
          ? detail::concat("; between hosts ", static_cast<int>(opt_.link_alpha * 1e6 + 0.5), " us and ",
                           static_cast<int>(1e-6 / opt_.link_beta + 0.5),
                           " MB/s measured at init: all_reduce, broadcast and all_gather among ranks a host each "
                           "by that link's cost")
          : std::string();
  return detail::concat("all_reduce: recursive doubling up to ", opt_.small_allreduce_bytes,
                        " bytes, halving-doubling (4, 8, ... ranks) up to ", opt_.halving_doubling_max_bytes,
                        " bytes, else the ring; all_gather: Bruck's (4 ranks or more) up to ",
                        opt_.small_all_gather_bytes, " bytes a rank, else the ring; reduce_scatter: recursive halving "
                        "(4 ranks or more) up to ", opt_.small_reduce_scatter_bytes, " bytes a rank, else the ring; "
                        "broadcast: binomial tree up to ",
                        opt_.small_broadcast_bytes,
                        !opt_.star_broadcast ? std::string(" bytes, else a pipelined chain")
                        : opt_.star_broadcast_skip_to
                            ? detail::concat(" bytes, a pipelined chain from ", opt_.star_broadcast_skip_from,
                                             " to ", opt_.star_broadcast_skip_to,
                                             " bytes, else from the root to every rank at once (single copies)")
                            : std::string(" bytes, else from the root to every rank at once (single copies)"),
                        "; chunk ", opt_.chunk_bytes, " bytes", link);
}

// Bodies capture the transport by pointer: the group runs them before it closes us.

namespace {

// Note [Rooted collectives agree on their root]
// Ranks that disagree on the root of a broadcast or scatter would each, thinking
// itself the root, only send and return: no frame would ever be compared, and
// the disagreement would surface at some later collective. Of a gather or
// reduce, they would wait for each other until the operation deadline. So a
// rooted collective also sends an empty frame, which carries its descriptor
// (root and op included), to the next rank of the ring and receives the
// previous rank's: where ranks disagree, some neighbours do, and the receiver
// raises MismatchError naming both calls; its abort reaches every rank at once.
// Posted before the algorithm's own messages and awaited after them: one small
// frame per rank, not a round trip; over TCP it leaves with the rank's first
// message to that peer, or when the rank first waits (Note [Empty frames ride
// along] in tcp_channel.cpp). The root still waits for its neighbour's frame,
// so a rooted collective returns on no rank before the rank before it has
// called it (Open MPI's root of a small broadcast returns once its message is
// written).
template <typename F>
void agreeing_on_the_root(Transport& t, F&& run) {
  const int p = t.size();
  if (p == 1) return run();
  static const char none = 0;
  char got = 0;
  auto s = t.isend((t.rank() + 1) % p, &none, 0);
  auto r = t.irecv((t.rank() + p - 1) % p, &got, 0);
  run();
  t.wait(r);
  t.wait(s);
}

// Note [Inputs that are also outputs]
// all_to_all(a, a) and reduce_scatter(blocks[r], blocks), which NumPy users write, name the same memory as input
// and output. The algorithms write an output block while a peer, or our own ring, may still read the input under
// it: reduce_scatter's result was wrong every time, all_to_all's in 3-8% of calls on 4 ranks (33-49% once it
// copied once, its peers reading our memory later; 20 calls at each of 4 sizes per rank). Where they overlap,
// all_to_all first copies its input aside, and reduce_scatter writes its result aside and copies it in at the
// end: one more copy, and only then.
bool overlap(const void* a, const void* b, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return bytes && x < y + bytes && y < x + bytes;
}

bool any_overlap(const std::vector<const void*>& ins, const void* out, size_t bytes) {
  for (const void* in : ins) {
    if (overlap(in, out, bytes)) return true;
  }
  return false;
}

// Whether any block of `outs` overlaps any of `ins`. Where each side's blocks lie within bounds that do not meet
// (an input array and an output array), one pass over each; else block against block.
bool any_overlap(const std::vector<const void*>& ins, const std::vector<void*>& outs, size_t bytes) {
  auto span = [](const auto& blocks) {
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (const void* p : blocks) {
      lo = std::min(lo, reinterpret_cast<uintptr_t>(p));
      hi = std::max(hi, reinterpret_cast<uintptr_t>(p));
    }
    return std::make_pair(lo, hi);
  };
  const auto [in_lo, in_hi] = span(ins);
  const auto [out_lo, out_hi] = span(outs);
  if (!bytes || in_lo >= out_hi + bytes || out_lo >= in_hi + bytes) return false;
  return std::any_of(outs.begin(), outs.end(), [&](const void* out) { return any_overlap(ins, out, bytes); });
}

}  // namespace

Backend::Body CpuBackend::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op, uintptr_t) {
  if (hierarchical(count * dtype_size(dt), kHierarchicalMinBytes)) {
    return [t = t_.get(), h = &*hier_, o = opt_, buf, count, dt, op] {
      algo::all_reduce_hierarchical(*t, *h, buf, count, dt, op, o);
    };
  }
  return [t = t_.get(), o = opt_, buf, count, dt, op] { algo::all_reduce(*t, buf, count, dt, op, o); };
}

// Note [Fused non-finite check] in reduce_probe.h: the algorithms test while they reduce.
Backend::Body CpuBackend::all_reduce_probed(float* buf, size_t count, ReduceOp op, ReduceProbe* probe, int) {
  const DataType dt = DataType::kFloat32;
  if (hierarchical(count * dtype_size(dt), kHierarchicalMinBytes)) {
    return [t = t_.get(), h = &*hier_, o = opt_, buf, count, dt, op, probe] {
      const ProbeView v{probe, nullptr, 0, probe->blame, true};
      algo::all_reduce_hierarchical(*t, *h, buf, count, dt, op, o, &v);
    };
  }
  return [t = t_.get(), o = opt_, buf, count, dt, op, probe] {
    const ProbeView v{probe, nullptr, 0, probe->blame, true};
    algo::all_reduce(*t, buf, count, dt, op, o, &v);
  };
}

Backend::Body CpuBackend::all_reduce_cast(float* buf, uint16_t* wire, size_t count, DataType wire_dt, float scale,
                                          ReduceProbe* probe, int rank) {
  return [t = t_.get(), o = opt_, buf, wire, count, wire_dt, scale, probe, rank] {
    algo::all_reduce_cast(*t, buf, wire, count, wire_dt, scale, o, probe, rank);
  };
}

Backend::Body CpuBackend::broadcast(void* buf, size_t count, DataType dt, int root, uintptr_t) {
  if (hierarchical(count * dtype_size(dt), opt_.small_broadcast_bytes)) {
    return [t = t_.get(), h = &*hier_, o = opt_, buf, bytes = count * dtype_size(dt), root] {
      agreeing_on_the_root(*t, [&] { algo::broadcast_hierarchical(*t, *h, buf, bytes, root, o); });
    };
  }
  return [t = t_.get(), o = opt_, buf, bytes = count * dtype_size(dt), root] {
    agreeing_on_the_root(*t, [&] { algo::broadcast(*t, buf, bytes, root, o); });
  };
}

Backend::Body CpuBackend::all_gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, uintptr_t) {
  if (hierarchical(count * dtype_size(dt) * outs.size(), kHierarchicalMinBytes)) {
    return [t = t_.get(), h = &*hier_, o = opt_, in, outs = std::move(outs), bytes = count * dtype_size(dt)] {
      algo::all_gather_hierarchical(*t, *h, in, outs.data(), bytes, o);
    };
  }
  return [t = t_.get(), o = opt_, in, outs = std::move(outs), bytes = count * dtype_size(dt)] {
    algo::all_gather(*t, in, outs.data(), bytes, o);
  };
}

Backend::Body CpuBackend::reduce_scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt,
                                         ReduceOp op, uintptr_t) {
  const algo::Hierarchy* h = hierarchical(count * dtype_size(dt) * ins.size(), kHierarchicalMinBytes) ? &*hier_
                                                                                                   : nullptr;
  return [t = t_.get(), h, o = opt_, ins = std::move(ins), out, count, dt, op] {
    // Note [Inputs that are also outputs]
    const size_t bytes = count * dtype_size(dt);
    std::vector<char> aside(any_overlap(ins, out, bytes) ? bytes : 0);
    void* result = aside.empty() ? out : aside.data();
    if (h)
      algo::reduce_scatter_hierarchical(*t, *h, ins.data(), result, count, dt, op, o);
    else
      algo::reduce_scatter(*t, ins.data(), result, count, dt, op, o);
    if (!aside.empty()) std::memcpy(out, aside.data(), bytes);
  };
}

// Note [Fused non-finite check] in reduce_probe.h.
Backend::Body CpuBackend::reduce_scatter_probed(std::vector<const float*> ins, float* out, size_t count, ReduceOp op,
                                                ReduceProbe* probe, size_t base, size_t stride, int) {
  const algo::Hierarchy* h =
      hierarchical(count * sizeof(float) * ins.size(), kHierarchicalMinBytes) ? &*hier_ : nullptr;
  return [t = t_.get(), h, o = opt_, ins = std::move(ins), out, count, op, probe, base, stride] {
    const ProbeView v{probe, nullptr, base, probe->blame, true, stride};
    std::vector<const void*> in(ins.begin(), ins.end());
    if (h)
      algo::reduce_scatter_hierarchical(*t, *h, in.data(), out, count, DataType::kFloat32, op, o, &v);
    else
      algo::reduce_scatter(*t, in.data(), out, count, DataType::kFloat32, op, o, &v);
  };
}

Backend::Body CpuBackend::reduce(void* buf, size_t count, DataType dt, ReduceOp op, int root, uintptr_t) {
  if (hierarchical(count * dtype_size(dt), opt_.small_broadcast_bytes)) {  // as broadcast, the other way round
    return [t = t_.get(), h = &*hier_, o = opt_, buf, count, dt, op, root] {
      agreeing_on_the_root(*t, [&] { algo::reduce_hierarchical(*t, *h, buf, count, dt, op, root, o); });
    };
  }
  return [t = t_.get(), o = opt_, buf, count, dt, op, root] {
    agreeing_on_the_root(*t, [&] { algo::reduce(*t, buf, count, dt, op, root, o); });
  };
}

Backend::Body CpuBackend::scatter(std::vector<const void*> ins, void* out, size_t count, DataType dt, int root,
                                  uintptr_t) {
  return [t = t_.get(), ins = std::move(ins), out, bytes = count * dtype_size(dt), root] {
    agreeing_on_the_root(*t, [&] { algo::scatter(*t, ins.data(), out, bytes, root); });
  };
}

Backend::Body CpuBackend::gather(const void* in, std::vector<void*> outs, size_t count, DataType dt, int root,
                                 uintptr_t) {
  return [t = t_.get(), in, outs = std::move(outs), bytes = count * dtype_size(dt), root] {
    agreeing_on_the_root(*t, [&] { algo::gather(*t, in, outs.data(), bytes, root); });
  };
}

Backend::Body CpuBackend::all_to_all(std::vector<const void*> ins, std::vector<void*> outs, size_t count,
                                     DataType dt, uintptr_t) {
  return [t = t_.get(), ins = std::move(ins), outs = std::move(outs), bytes = count * dtype_size(dt)] {
    // Note [Inputs that are also outputs]
    std::vector<char> aside;
    std::vector<const void*> copied;
    if (any_overlap(ins, outs, bytes)) {
      aside.resize(ins.size() * bytes);
      for (size_t j = 0; j < ins.size(); ++j) {
        copied.push_back(aside.data() + j * bytes);
        std::memcpy(aside.data() + j * bytes, ins[j], bytes);
      }
    }
    algo::all_to_all(*t, copied.empty() ? ins.data() : copied.data(), outs.data(), bytes);
  };
}

Backend::Body CpuBackend::barrier(uint64_t fingerprint) {
  return [t = t_.get(), fingerprint] { algo::barrier(*t, fingerprint); };
}

Backend::Body CpuBackend::send(const void* buf, size_t count, DataType dt, int dst, uintptr_t) {
  return [t = t_.get(), buf, bytes = count * dtype_size(dt), dst] { t->wait(t->isend(dst, buf, bytes)); };
}

Backend::Body CpuBackend::recv(void* buf, size_t count, DataType dt, int src, uintptr_t) {
  return [t = t_.get(), buf, bytes = count * dtype_size(dt), src] { t->wait(t->irecv(src, buf, bytes)); };
}

Backend::Body CpuBackend::recv_any(void* buf, size_t count, DataType dt, std::function<OpDesc(int)> desc_of,
                                   int* source) {
  // The sender and the message number, once taken: a receive that gives way to sends (OpYielded, Note [Sends before
  // receives] in process_group.cpp) after it took them runs again with them, not with the next number.
  auto taken = std::make_shared<std::optional<std::pair<int, OpDesc>>>();
  return [t = t_.get(), buf, bytes = count * dtype_size(dt), desc_of = std::move(desc_of), source, taken] {
    if (!*taken) {
      const int j = t->wait_any_message();
      *taken = std::make_pair(j, desc_of(j));
    }
    const int j = (*taken)->first;
    t->set_desc((*taken)->second);
    t->wait(t->irecv(j, buf, bytes));
    *source = j;
  };
}

}  // namespace cx::distributed
