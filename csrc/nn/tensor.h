// defines: Shape, numel/shape_str, FloatStorage (shared, 64-byte aligned flat
// buffer), Tensor (owning, grow-only activation buffer).
//
// nn/ works on batches laid out row-major as (batch, features...). A Tensor is
// deliberately small: a shape and an aligned float buffer that only grows, so a
// training loop with a fixed batch size allocates once and then never again.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace cx::nn {

using Shape = std::vector<size_t>;

inline size_t numel(const Shape& s) {
  size_t n = 1;
  for (size_t d : s) n *= d;
  return n;
}

// "(64, 784)"
std::string shape_str(const Shape& s);

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using AlignedPtr = std::unique_ptr<float[], AlignedFree>;

// Zero-filled, 64-byte aligned; n == 0 gives a valid non-null pointer.
AlignedPtr aligned_floats(size_t n);

// The storage behind a model's flat parameter (or gradient) buffer. Shared so
// that NumPy views handed to Python keep it alive: after a re-layout (add()) an
// old view still points at valid memory, it just no longer belongs to the model.
class FloatStorage {
 public:
  explicit FloatStorage(size_t n) : data_(aligned_floats(n)), size_(n) {}
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  AlignedPtr data_;
  size_t size_;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(const Shape& s) { resize(s); }
  // Grow-only: keeps the allocation when the new shape fits.
  void resize(const Shape& s);
  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  const Shape& shape() const { return shape_; }
  size_t numel() const { return cx::nn::numel(shape_); }
  size_t rows() const { return shape_.empty() ? 0 : shape_[0]; }
  size_t cols() const { return rows() ? numel() / rows() : 0; }

 private:
  Shape shape_;
  AlignedPtr data_;
  size_t capacity_ = 0;
};

}  // namespace cx::nn
