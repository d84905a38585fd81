// defines: Segment (one rank's shared-memory file: its doorbell and a receive
// ring per peer) and the ring and doorbell operations that ShmChannel and the
// mesh transport's sleep use for peers on the same host.
//
// Why: over loopback TCP the kernel copies every byte into a socket buffer and
// out again and runs the TCP stack on it; CPU-bound at ~3-4 GB/s per core on
// the 2-vCPU machines we measure on. Through shared memory the sender copies into
// the ring and the receiver copies out, each a plain memcpy.
//
// Layout of rank r's segment (a file in /dev/shm, unlinked once every peer has
// mapped it, so nothing is left behind when a process dies):
//   [Bell, 64 B] [RingCtl, 128 B] x world [ring data, cap B] x world
// Ring j of rank r carries bytes from rank j to rank r: j writes, r reads. Each
// ring is single-producer single-consumer: `head` counts bytes ever written
// (only the writer stores it), `tail` bytes ever read (only the reader).
//
// Sleeping: a rank with nothing to do sets its bell's `sleeping` and futex-waits
// on `seq` (bounded, so deadlines and dead peers are still noticed). Whoever
// writes into its rings or frees space in a ring it writes to bumps `seq` and
// wakes it if it sleeps. Note [No lost wake-up] in shm.cpp.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "distributed/transport/transport.h"

namespace cx::distributed::shm {

struct alignas(64) Bell {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint32_t> sleeping{0};
  // Written once by the owner at creation, for its peers' process_vm_readv (Note [Single-copy large messages]):
  // its pid, and the address in its own memory of `magic`, which a peer reads back to learn that it may.
  int32_t pid = 0;
  uint32_t magic = 0;
  uint64_t magic_addr = 0;
};

struct alignas(64) RingCtl {
  std::atomic<uint64_t> head{0};
  char pad_[64 - sizeof(std::atomic<uint64_t>)];
  std::atomic<uint64_t> tail{0};
  // Stored by the reader, as `tail` (Note [Single-copy large messages]): how many single-copy frames it has
  // read out of the writer's memory, and whether it can (1) at all.
  std::atomic<uint64_t> acks{0};
  std::atomic<uint32_t> can_read{0};
};

struct Ring {
  RingCtl* ctl = nullptr;
  char* data = nullptr;
  size_t cap = 0;
};

class Segment {
 public:
  // Creates /dev/shm/<name> (which must not exist) sized for `world` rings of
  // `cap` bytes, reserves the memory of the rings of `peers` (and the control
  // block) so that using them later cannot fail, and maps it. Throws Error with
  // the reason (no /dev/shm, not enough room in it).
  static Segment create(const std::string& name, int world, size_t cap, const std::vector<int>& peers);
  // Maps an existing segment; returns an unmapped Segment (ok() false) if it cannot.
  static Segment open(const std::string& name, int world, size_t cap);

  Segment() = default;
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  bool ok() const { return base_ != nullptr; }
  const std::string& path() const { return path_; }
  void unlink();  // removes the file (the mapping stays); idempotent
  Bell* bell() const;
  Ring ring(int peer) const;  // the ring that carries bytes from `peer` to this segment's owner
  // Maps the pages of the control block and of `peer`'s ring into this process
  // now, so that the first pass over a ring costs no page faults (1 MiB of ring
  // is 256 of them on each side: +4 us on each of the first 256 4 KiB messages).
  void prefault(int peer) const;

 private:
  void* base_ = nullptr;
  size_t len_ = 0;
  int world_ = 0;
  size_t cap_ = 0;
  std::string path_;
  bool owner_ = false;  // created it, so unlinks it (at the latest when destroyed)
};

// Copies up to n bytes into / out of the ring; returns how many moved (0 when
// full / empty).
size_t write(const Ring& r, const char* src, size_t n);
size_t read(const Ring& r, char* dst, size_t n);
// Copies the next n bytes out of the ring without taking them; false (nothing copied) while fewer are there.
bool peek(const Ring& r, char* dst, size_t n);

// Note [Publishing in pieces]
// The reader of a ring reads whatever the writer has published (`head`), so the two copies of a message (into
// the ring, out of it) overlap only as far as the writer publishes before it is done. A payload is therefore
// written and published kPublishBytes at a time: the reader starts on the first piece while the writer copies
// the second, and a message costs about one copy and a piece instead of two copies end to end. That matters
// where one side only sends and the other only receives, as in a broadcast (2 vCPUs, 2 ranks: 256 KiB 8.9 ->
// 14.4 GB/s, 1 MiB 13.9 -> 16.9; 4 ranks 256 KiB 2.0 -> 3.7, 4 MiB 3.2 -> 4.0; benchmarks/README.md, "Pieces and
// single copies"); all_reduce and all_gather, whose ranks send and receive at once, were level (16, 32 and 64
// KiB pieces alike there). Each piece is one more release store of `head`, on a line the reader polls anyway.
constexpr size_t kPublishBytes = 32 * 1024;

// Bumps the bell and wakes its owner if it sleeps.
void ring_bell(Bell* b);
// After publishing bytes or room in a ring: rings the bell only if its owner
// sleeps (or is about to), so a busy pair never touches the bell's cache line.
void notify(Bell* b);
// Marks the owner as about to sleep; the caller then looks for work once more
// before wait_bell (Note [No lost wake-up]).
void about_to_sleep(Bell* b);
// Sleeps until the bell moves past `seen` or `timeout_ms` passes.
void wait_bell(Bell* b, uint32_t seen, int timeout_ms);

// Note [Single-copy large messages]
// Through the rings a message is copied twice: into the ring by the sender, out of it by the receiver. From
// kSingleCopyMinBytes up a sender that its receiver can read (RingCtl::can_read) writes only a REMOTE frame:
// the DATA frame's header (same descriptor, same length, so it is checked alike) and the address of its
// buffer; the receiver copies the bytes straight out of the sender's memory into its own with
// process_vm_readv (one copy, in the kernel) and counts the frame in RingCtl::acks, which completes the
// sender's request (its buffer must stay put until then, as any isend's). Whether a receiver may read its
// peer is tried once, when the channel is made: it reads the peer's Bell::magic through process_vm_readv.
// That needs the same user and ptrace access (Yama's ptrace_scope 0, or CAP_SYS_PTRACE; a container's seccomp
// may forbid the call): where it fails the pair keeps the two copies, and so does CX_SHM_SINGLE_COPY=0. We do
// not call prctl(PR_SET_PTRACER_ANY) to make it work, as Open MPI does: that would let any process of the
// user attach to every rank. A sender whose collective fails (its deadline, a peer's abort) returns while a
// REMOTE frame of it may still be unread; a receiver that reads it later can get what the program has since
// written there, in a collective that the failure will end on that rank too (the group is poisoned either way).
// Measured on 2 vCPUs, no other jobs (benchmarks/README.md, "A machine to ourselves"): Open MPI 5, which copies
// large messages once this way, was 1.3-1.4x our two-copy all_reduce at 4 MiB.
// Where it pays, by collective, measured side by side (benchmarks/README.md, "Single copies" and "Pieces and
// single copies"), for messages of kSingleCopyMinBytes up, or kSingleCopyMinBytesCoreEach where every rank on
// the host has a core (there broadcast 1.5-1.8x at 8-32 KiB, all_gather and reduce_scatter 1.1-1.3x at 16-64 KiB
// on 2 ranks; with more ranks than cores messages of 16-32 KiB measured 0.74-0.95x, within that run's noise
// but never ahead, so they keep the higher bound):
// - all_gather and reduce_scatter, at every size: 1.3-2.2x on 2 ranks at 256 KiB-2 MiB, 1.1-1.3x on 4 at 256
//   KiB-4 MiB; 1.15-1.8x from 2 MiB up.
// - all_to_all and scatter, at every size: all_to_all 1.2-2.0x on 2-4 ranks at 64 KiB-64 MiB, scatter 1.3-2.2x on
//   2 ranks and 1.6-6x on 4 at 256 KiB-64 MiB (its receivers copy at once, where through the rings the root
//   wrote every block itself first). Not gather: the root then copies every block itself, one after the other,
//   where through the rings the senders' copies run beside its own (0.41-0.90x on 4 ranks at 256 KiB-64 MiB).
// - all_reduce from kSingleCopyMinAllReduceBytes (1.15-1.8x on 2 ranks, 1.0-1.6x on 4). Below it two copies
//   win, 0.5-0.8x with single copies at 64-256 KiB: recursive doubling and halving-doubling add what they
//   receive into their buffer at once, and that reduction ran 4x longer over what process_vm_readv had written
//   than over bytes that the ring's memcpy had just brought into the cache (perf, 128 KiB on 2 ranks:
//   reduce_into 42% of a 29 us call against 13% of 21 us).
// - broadcast below kSingleCopyMaxBroadcastBytes where every rank on the host has a core (1.9x at 64 KiB and
//   256 KiB, 1.2x at 1 MiB on 2 ranks, where Open MPI's single copy was 1.6-2.6x ours). From 2 MiB up the
//   rings' two copies run at once on two cores and are as fast, or faster (0.70-0.79x with single copies at 64
//   MiB). With more ranks than cores it was mixed (0.8-1.0x on 4 ranks): a single-copy send completes only
//   once its receiver has run, and there it often waits for a core. On more than two ranks a broadcast above
//   64 KiB goes from the root to all in single copies instead, wherever the ranks run (Transport::copy_once;
//   Note [Broadcast from the root to all] in algorithms/broadcast.cpp).
// - Not send/recv and reduce: not measured.
constexpr size_t kSingleCopyMinBytes = 64 * 1024;
constexpr size_t kSingleCopyMinBytesCoreEach = 8 * 1024;
constexpr size_t kSingleCopyMinAllReduceBytes = 2u << 20;
constexpr size_t kSingleCopyMaxBroadcastBytes = 2u << 20;
// Whether a message of `len` bytes of the collective `d` goes as a single copy, where the receiver can read us.
// `core_each`: no more ranks on this host than cores.
inline bool single_copy_pays(const OpDesc& d, size_t len, bool core_each) {
  if (len < (core_each ? kSingleCopyMinBytesCoreEach : kSingleCopyMinBytes)) return false;
  const size_t bytes = d.count * dtype_size(d.dtype);
  switch (d.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kScatter:
      return true;
    case CollectiveKind::kAllReduce:
      return bytes >= kSingleCopyMinAllReduceBytes;
    case CollectiveKind::kBroadcast:
      return core_each && bytes < kSingleCopyMaxBroadcastBytes;
    default:
      return false;
  }
}

// True if this process may read `peer`'s memory (its Bell, mapped here) with process_vm_readv.
bool can_read_peer(const Bell* peer);
// Copies `len` bytes at `addr` in process `pid` into dst; returns 0, or the errno of the failure (ESRCH: the
// peer is gone; EFAULT: the address is not mapped there).
int read_peer(int pid, char* dst, uint64_t addr, size_t len);
// REMOTE frames this process has read (all its groups), for the tests: whether single copies happen.
uint64_t single_copies();

// hostname + boot id: equal on two ranks that may share memory.
std::string host_key();

// The name of this rank's segment: "cx-<nonce>-<rank>-<pid namespace>-<pid>"
// (Note [Segments of dead ranks]).
std::string segment_name(uint64_t nonce, int rank);
// Removes /dev/shm/cx-* files that ranks killed during init left behind: those
// of this pid namespace whose process is gone, and any older than an hour.
// Returns how many it removed.
int remove_dead_segments();

}  // namespace cx::distributed::shm
