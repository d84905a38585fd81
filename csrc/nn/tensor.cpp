#include "nn/tensor.h"

#include <new>

namespace cx::nn {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  if (s.size() == 1) out += ",";
  return out + ")";
}

AlignedPtr aligned_floats(size_t n) {
  size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
  if (bytes == 0) bytes = 64;
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return AlignedPtr(static_cast<float*>(p));
}

void Tensor::resize(const Shape& s) {
  size_t n = cx::nn::numel(s);
  if (n > capacity_ || !data_) {
    data_ = aligned_floats(n);
    capacity_ = n;
  }
  shape_ = s;
}

}  // namespace cx::nn
