// defines: ByteWriter / ByteReader (little-endian, bounds-checked), fnv1a64,
// atomic_write_file, read_file, and the .cyxmodel container constants.
//
// Note [.cyxmodel format, version 1]
//   offset  size  field
//        0     8  magic "CYXMODEL"
//        8     4  u32 format version (kModelFormatVersion)
//       12     4  u32 flags (0)
//       16     8  u64 payload length L
//       24     L  payload: u32 module count, then per module
//                   u16 layer id (Note [Layer ids] in registry.h), the layer's
//                   hyper-parameters (its write_config),
//                   u32 parameter-tensor count, per tensor: u64 count, count x f32
//                   u32 buffer count, per buffer: u64 count, count x f32
//     24+L     8  u64 FNV-1a-64 of bytes [0, 24+L)
// All integers and floats little-endian. Weights are stored as raw f32 bits, so a
// loaded model computes bit-identical outputs. A reader checks magic, version,
// length and checksum before it parses anything, and builds the whole model
// before handing it out: a bad file never yields a half-loaded model.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace cx::nn {

constexpr char kModelMagic[8] = {'C', 'Y', 'X', 'M', 'O', 'D', 'E', 'L'};
constexpr uint32_t kModelFormatVersion = 1;
constexpr size_t kModelHeaderSize = 24;

uint64_t fnv1a64(const void* data, size_t n);

class ByteWriter {
 public:
  void u8(uint8_t v) { raw(&v, 1); }
  void u16(uint16_t v) { le(v); }
  void u32(uint32_t v) { le(v); }
  void u64(uint64_t v) { le(v); }
  void f32(float v) { uint32_t b; std::memcpy(&b, &v, 4); le(b); }
  void f64(double v) { uint64_t b; std::memcpy(&b, &v, 8); le(b); }
  void floats(const float* p, size_t n);
  void raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string& bytes() { return buf_; }

 private:
  template <typename T>
  void le(T v) {
    char b[sizeof(T)];
    for (size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
    raw(b, sizeof(T));
  }
  std::string buf_;
};

// Every read is bounds-checked; running off the end throws IoError naming `what`.
class ByteReader {
 public:
  ByteReader(const uint8_t* p, size_t n, std::string what) : p_(p), n_(n), what_(std::move(what)) {}
  uint8_t u8() { uint8_t v; raw(&v, 1); return v; }
  uint16_t u16() { return static_cast<uint16_t>(le(2)); }
  uint32_t u32() { return static_cast<uint32_t>(le(4)); }
  uint64_t u64() { return le(8); }
  float f32() { uint32_t b = u32(); float v; std::memcpy(&v, &b, 4); return v; }
  double f64() { uint64_t b = u64(); double v; std::memcpy(&v, &b, 8); return v; }
  void floats(float* out, size_t n);
  void raw(void* out, size_t n);
  size_t remaining() const { return n_ - pos_; }
  [[noreturn]] void fail(const std::string& why) const;

 private:
  uint64_t le(size_t k);
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  std::string what_;
};

// Writes via "<path>.tmp.<pid>" in the same directory, fsync, rename, fsync(dir):
// a crash mid-save leaves the previous file intact. Throws IoError.
void atomic_write_file(const std::string& path, const std::string& bytes);
std::string read_whole_file(const std::string& path);  // throws IoError

}  // namespace cx::nn
