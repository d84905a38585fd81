#include "nn/serialize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "common/error.h"

namespace cx::nn {

uint64_t fnv1a64(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

void ByteWriter::floats(const float* p, size_t n) {
  // The format is little-endian; so is every platform we build for.
  static_assert(sizeof(float) == 4, "f32");
  raw(p, n * sizeof(float));
}

void ByteReader::fail(const std::string& why) const { CX_THROW(IoError, what_, ": ", why); }

void ByteReader::raw(void* out, size_t n) {
  if (n > n_ - pos_) fail("unexpected end of data (file is malformed or truncated)");
  std::memcpy(out, p_ + pos_, n);
  pos_ += n;
}

void ByteReader::floats(float* out, size_t n) {
  if (n > (n_ - pos_) / sizeof(float)) fail("unexpected end of data in weights (file is malformed or truncated)");
  raw(out, n * sizeof(float));
}

uint64_t ByteReader::le(size_t k) {
  uint8_t b[8];
  raw(b, k);
  uint64_t v = 0;
  for (size_t i = 0; i < k; ++i) v |= static_cast<uint64_t>(b[i]) << (8 * i);
  return v;
}

namespace {
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};
std::string errno_str() { return std::strerror(errno); }
}  // namespace

void atomic_write_file(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (f.fd < 0) CX_THROW(IoError, "cannot write '", path, "': ", errno_str());
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t w = ::write(f.fd, bytes.data() + done, bytes.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        std::string e = errno_str();
        ::unlink(tmp.c_str());
        CX_THROW(IoError, "cannot write '", path, "': ", e);
      }
      done += static_cast<size_t>(w);
    }
    if (::fsync(f.fd) != 0) {
      std::string e = errno_str();
      ::unlink(tmp.c_str());
      CX_THROW(IoError, "cannot write '", path, "': fsync failed: ", e);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string e = errno_str();
    ::unlink(tmp.c_str());
    CX_THROW(IoError, "cannot write '", path, "': rename failed: ", e);
  }
  // Make the rename itself durable.
  std::string dir = ".";
  size_t slash = path.find_last_of('/');
  if (slash != std::string::npos) dir = slash == 0 ? "/" : path.substr(0, slash);
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd >= 0) ::fsync(d.fd);
}

std::string read_whole_file(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) CX_THROW(IoError, "cannot open '", path, "': ", errno_str());
  struct stat st;
  if (::fstat(f.fd, &st) != 0) CX_THROW(IoError, "cannot stat '", path, "': ", errno_str());
  if (S_ISDIR(st.st_mode)) CX_THROW(IoError, "cannot load '", path, "': it is a directory");
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t r = ::read(f.fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) CX_THROW(IoError, "cannot read '", path, "': ", errno_str());
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

}  // namespace cx::nn
