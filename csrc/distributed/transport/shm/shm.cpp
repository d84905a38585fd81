#include "distributed/transport/shm/shm.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <new>

#include "common/error.h"

namespace cx::distributed::shm {

namespace {

constexpr size_t kCtlOffset = sizeof(Bell);
constexpr uint32_t kBellMagic = 0x4c4c4542;  // "BELL"
static_assert(sizeof(Bell) == 64 && sizeof(RingCtl) == 128, "the segment layout");

size_t segment_bytes(int world, size_t cap) {
  return kCtlOffset + static_cast<size_t>(world) * sizeof(RingCtl) + static_cast<size_t>(world) * cap;
}

std::string path_of(const std::string& name) { return "/dev/shm/" + name; }

// The inode of this process's pid namespace: pids mean something only within one.
unsigned long long pid_namespace() {
  struct stat st{};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0;
}

}  // namespace

// Note [Segments of dead ranks]
// A segment's file is unlinked as soon as every peer has mapped it (Note
// [Same-host pairs] in negotiate.cpp), but a rank killed between creating it and
// that moment leaves it in /dev/shm for good (4 of 30 kills during init did).
// The name says who made it: the pid and the inode of the maker's pid namespace.
// Before a rank makes its own segment it removes the files of makers of its own
// pid namespace that no longer exist (kill(pid, 0) answers ESRCH). A file from
// another pid namespace (a container sharing /dev/shm) says nothing we can check,
// so it is removed only once it is an hour old: a live segment lives for the
// seconds of one init.
std::string segment_name(uint64_t nonce, int rank) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "cx-%016llx-%d-%llu-%ld", static_cast<unsigned long long>(nonce), rank,
                pid_namespace(), static_cast<long>(::getpid()));
  return buf;
}

int remove_dead_segments() {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  const unsigned long long ours = pid_namespace();
  const time_t now = ::time(nullptr);
  int removed = 0;
  while (dirent* e = ::readdir(d)) {
    unsigned long long nonce = 0, ns = 0;
    int rank = 0, used = 0;
    long pid = 0;
    if (std::sscanf(e->d_name, "cx-%16llx-%d-%llu-%ld%n", &nonce, &rank, &ns, &pid, &used) != 4 ||
        e->d_name[used] != '\0' || pid <= 0) {
      continue;
    }
    const std::string path = path_of(e->d_name);
    bool dead = false;
    if (ns == ours && ours != 0) {
      dead = ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    } else {
      struct stat st{};
      dead = ::stat(path.c_str(), &st) == 0 && now - st.st_mtime > 3600;
    }
    if (dead && ::unlink(path.c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (owner_) unlink();
    if (base_) ::munmap(base_, len_);
    base_ = o.base_;
    len_ = o.len_;
    world_ = o.world_;
    cap_ = o.cap_;
    path_ = std::move(o.path_);
    owner_ = o.owner_;
    o.base_ = nullptr;
    o.owner_ = false;
  }
  return *this;
}

Segment::~Segment() {
  if (owner_) unlink();
  if (base_) ::munmap(base_, len_);
  base_ = nullptr;
}

Segment Segment::create(const std::string& name, int world, size_t cap, const std::vector<int>& peers) {
  Segment s;
  s.path_ = path_of(name);
  s.world_ = world;
  s.cap_ = cap;
  s.len_ = segment_bytes(world, cap);
  int fd = ::open(s.path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) CX_THROW(Error, "cannot create ", s.path_, ": ", std::strerror(errno));
  s.owner_ = true;
  // The file is sparse; the pages of the rings that will be used are reserved
  // now, so that a full tmpfs shows up here rather than as SIGBUS on a write.
  if (::ftruncate(fd, static_cast<off_t>(s.len_)) != 0) {
    int e = errno;
    ::close(fd);
    CX_THROW(Error, "cannot size ", s.path_, ": ", std::strerror(e));
  }
  const size_t data0 = kCtlOffset + static_cast<size_t>(world) * sizeof(RingCtl);
  int e = ::posix_fallocate(fd, 0, static_cast<off_t>(data0));
  for (size_t i = 0; i < peers.size() && e == 0; ++i) {
    e = ::posix_fallocate(fd, static_cast<off_t>(data0 + static_cast<size_t>(peers[i]) * cap),
                          static_cast<off_t>(cap));
  }
  if (e != 0) {
    ::close(fd);
    CX_THROW(Error, "cannot reserve ", s.path_, ": ", std::strerror(e));
  }
  void* p = ::mmap(nullptr, s.len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  e = errno;
  ::close(fd);
  if (p == MAP_FAILED) CX_THROW(Error, "cannot map ", s.path_, ": ", std::strerror(e));
  s.base_ = p;
  // A fresh file reads as zeros, which is the initial state of every counter;
  // construct the atomics there all the same.
  Bell* bell = new (s.bell()) Bell();
  bell->pid = static_cast<int32_t>(::getpid());
  bell->magic = kBellMagic;
  bell->magic_addr = reinterpret_cast<uintptr_t>(&bell->magic);
  for (int j = 0; j < world; ++j) new (s.ring(j).ctl) RingCtl();
  return s;
}

// Note [Single-copy large messages] in shm.h.
bool can_read_peer(const Bell* peer) {
  if (peer->pid <= 0) return false;
  uint32_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(peer->magic_addr)), sizeof(got)};
  return ::process_vm_readv(peer->pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) &&
         got == kBellMagic;
}

namespace {
std::atomic<uint64_t> g_single_copies{0};
}

int read_peer(int pid, char* dst, uint64_t addr, size_t len) {
  size_t done = 0;
  while (done < len) {
    iovec local{dst + done, len - done};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(addr + done)), len - done};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EFAULT;
    done += static_cast<size_t>(n);
  }
  g_single_copies.fetch_add(1, std::memory_order_relaxed);
  return 0;
}

uint64_t single_copies() { return g_single_copies.load(std::memory_order_relaxed); }

Segment Segment::open(const std::string& name, int world, size_t cap) {
  Segment s;
  s.path_ = path_of(name);
  s.world_ = world;
  s.cap_ = cap;
  s.len_ = segment_bytes(world, cap);
  int fd = ::open(s.path_.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Segment();
  struct stat st{};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != s.len_) {
    ::close(fd);
    return Segment();
  }
  void* p = ::mmap(nullptr, s.len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return Segment();
  s.base_ = p;
  return s;
}

void Segment::prefault(int peer) const {
#ifdef MADV_POPULATE_WRITE
  // Populates page tables without touching the contents, so it is safe while
  // the peer already uses the ring. Kernels before 5.14 refuse it: then the
  // first pass faults pages in as it goes.
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  auto populate = [&](char* b, size_t n) {
    char* lo = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(b) / page * page);
    ::madvise(lo, static_cast<size_t>(b + n - lo), MADV_POPULATE_WRITE);
  };
  populate(static_cast<char*>(base_), kCtlOffset + static_cast<size_t>(world_) * sizeof(RingCtl));
  populate(ring(peer).data, cap_);
#else
  (void)peer;
#endif
}

void Segment::unlink() {
  if (owner_) ::unlink(path_.c_str());
  owner_ = false;
}

Bell* Segment::bell() const { return static_cast<Bell*>(base_); }

Ring Segment::ring(int peer) const {
  char* b = static_cast<char*>(base_);
  Ring r;
  r.ctl = reinterpret_cast<RingCtl*>(b + kCtlOffset + static_cast<size_t>(peer) * sizeof(RingCtl));
  r.data = b + kCtlOffset + static_cast<size_t>(world_) * sizeof(RingCtl) + static_cast<size_t>(peer) * cap_;
  r.cap = cap_;
  return r;
}

// The writer owns head, the reader owns tail. The writer reads tail with
// acquire (the reader is done with those bytes) and publishes head with release
// (the bytes are in place); the reader mirrors it.
size_t write(const Ring& r, const char* src, size_t n) {
  const uint64_t head = r.ctl->head.load(std::memory_order_relaxed);
  const uint64_t tail = r.ctl->tail.load(std::memory_order_acquire);
  n = std::min<size_t>(n, r.cap - static_cast<size_t>(head - tail));
  if (n == 0) return 0;
  const size_t at = static_cast<size_t>(head % r.cap), first = std::min(n, r.cap - at);
  std::memcpy(r.data + at, src, first);
  if (first < n) std::memcpy(r.data, src + first, n - first);
  r.ctl->head.store(head + n, std::memory_order_release);
  return n;
}

bool peek(const Ring& r, char* dst, size_t n) {
  const uint64_t tail = r.ctl->tail.load(std::memory_order_relaxed);
  const uint64_t head = r.ctl->head.load(std::memory_order_acquire);
  if (head - tail < n) return false;
  const size_t at = static_cast<size_t>(tail % r.cap), first = std::min(n, r.cap - at);
  std::memcpy(dst, r.data + at, first);
  if (first < n) std::memcpy(dst + first, r.data, n - first);
  return true;
}

size_t read(const Ring& r, char* dst, size_t n) {
  const uint64_t tail = r.ctl->tail.load(std::memory_order_relaxed);
  const uint64_t head = r.ctl->head.load(std::memory_order_acquire);
  n = std::min<size_t>(n, static_cast<size_t>(head - tail));
  if (n == 0) return 0;
  const size_t at = static_cast<size_t>(tail % r.cap), first = std::min(n, r.cap - at);
  std::memcpy(dst, r.data + at, first);
  if (first < n) std::memcpy(dst + first, r.data, n - first);
  r.ctl->tail.store(tail + n, std::memory_order_release);
  return n;
}

// Note [No lost wake-up]
// Sleeper: seen = seq; sleeping = 1; fence; look for work once more; futex_wait(seq, seen).
// Waker:   publish the bytes (head/tail store); fence; if sleeping: seq += 1, futex_wake.
// The two fences (sequentially consistent) order each side's store before its
// load, so at least one side sees the other's store: either the sleeper's last
// look finds the bytes, or the waker sees sleeping == 1 and bumps seq, after
// which futex_wait either returns at once (seq != seen) or is woken. The
// sleeper's wait is bounded anyway (the caller passes a slice of its
// deadline), so a mistake here would cost time, never a hang.
void about_to_sleep(Bell* b) {
  b->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void notify(Bell* b) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (b->sleeping.load(std::memory_order_relaxed)) ring_bell(b);
}

void ring_bell(Bell* b) {
  b->seq.fetch_add(1, std::memory_order_seq_cst);
  if (b->sleeping.load(std::memory_order_seq_cst)) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&b->seq), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

void wait_bell(Bell* b, uint32_t seen, int timeout_ms) {
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&b->seq), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

std::string host_key() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat st{};
  // The device of /dev/shm tells apart containers on one host that do not share it.
  std::string dev = ::stat("/dev/shm", &st) == 0 ? std::to_string(st.st_dev) : "none";
  return std::string(host) + "|" + boot + "|" + dev;
}

}  // namespace cx::distributed::shm
