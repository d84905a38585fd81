#include "nn/sequential.h"

#include <algorithm>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "common/error.h"
#include "nn/kernels.h"
#include "nn/parallel.h"
#include "nn/registry.h"
#include "nn/serialize.h"

namespace cx::nn {

void SequentialModel::add(std::shared_ptr<Module> m) {
  CX_CHECK(m != nullptr, InvalidArgument, "SequentialModel.add: module is None");
  CX_CHECK(!m->in_model(), InvalidArgument, "SequentialModel.add: ", m->repr(),
           " already belongs to a model; create a new module for each model");
  CX_CHECK(!holder_, InvalidArgument, "SequentialModel.add: this model is the block or shortcut of a "
           "ResidualModule now; add() every module before making the ResidualModule");
  size_t new_total = total_ + m->num_params();
  if (m->num_params()) {
    // Re-layout: fresh buffers, every module's values copied across (attach).
    auto p = std::make_shared<FloatStorage>(new_total);
    auto g = std::make_shared<FloatStorage>(new_total);
    size_t off = 0;
    for (auto& mod : modules_) {
      if (mod->num_params()) mod->attach(p, g, off);
      off += mod->num_params();
    }
    m->attach(p, g, off);
    params_ = std::move(p);
    grads_ = std::move(g);
    base_ = 0;
  }
  first_param_.push_back(owners_.size());
  for (size_t i = 0; i < m->param_specs().size(); ++i) owners_.emplace_back(modules_.size(), i);
  m->set_in_model();
  modules_.push_back(std::move(m));
  total_ = new_total;
  have_forward_ = false;
}

void SequentialModel::replace(size_t i, std::shared_ptr<Module> m) {
  CX_CHECK(i < modules_.size(), InvalidArgument, "SequentialModel.replace: index ", i, " is out of range for ",
           modules_.size(), " modules");
  CX_CHECK(m != nullptr, InvalidArgument, "SequentialModel.replace: module is None");
  CX_CHECK(!m->in_model(), InvalidArgument, "SequentialModel.replace: ", m->repr(),
           " already belongs to a model; create a new module for each model");
  const std::shared_ptr<Module>& old = modules_[i];
  const auto& a = old->param_specs();
  const auto& b = m->param_specs();
  bool same = a.size() == b.size();
  for (size_t k = 0; same && k < a.size(); ++k) same = a[k].name == b[k].name && a[k].shape == b[k].shape;
  CX_CHECK(same, InvalidArgument, "SequentialModel.replace: ", m->repr(), " does not declare the same parameter "
           "tensors as layer ", i, " (", old->repr(), ")");
  const size_t offset = old->num_params() ? old->param_offset(0) : 0;
  old->detach();
  if (m->num_params()) m->attach(params_, grads_, offset);
  m->set_in_model();
  modules_[i] = std::move(m);
  have_forward_ = false;
}

std::vector<std::pair<size_t, size_t>> SequentialModel::param_slices() const {
  std::vector<std::pair<size_t, size_t>> out;
  out.reserve(owners_.size());
  for (auto [mi, pi] : owners_) {
    const Module& m = *modules_[mi];
    out.emplace_back(m.param_offset(pi) - base_, numel(m.param_specs()[pi].shape));
  }
  return out;
}

void SequentialModel::adopt_storage(std::shared_ptr<FloatStorage> params, std::shared_ptr<FloatStorage> grads,
                                    size_t offset) {
  size_t off = offset;
  for (auto& m : modules_) {
    if (m->num_params()) m->attach(params, grads, off);
    off += m->num_params();
  }
  params_ = std::move(params);
  grads_ = std::move(grads);
  base_ = offset;
}

std::vector<Shape> SequentialModel::layer_shapes(const Shape& shape) const {
  std::vector<Shape> shapes{shape};
  for (size_t i = 0; i < modules_.size(); ++i) {
    try {
      shapes.push_back(modules_[i]->output_shape(shapes[i]));
    } catch (const InvalidArgument& e) {
      CX_THROW(InvalidArgument, "layer ", i, ": ", e.what());
    }
  }
  return shapes;
}

std::vector<Shape> SequentialModel::shapes_for(const Shape& shape) const {
  CX_CHECK(!modules_.empty(), InvalidArgument, "SequentialModel.forward: the model has no modules; add() some first");
  CX_CHECK(shape.size() >= 2 && shape[0] >= 1, InvalidArgument,
           "SequentialModel.forward: expected input of shape (batch, features) with batch >= 1, got ", shape_str(shape));
  try {
    return layer_shapes(shape);
  } catch (const InvalidArgument& e) {
    CX_THROW(InvalidArgument, "SequentialModel.forward: ", e.what());
  }
}

namespace {
bool finite(const float* x, size_t n) { return kernels::max_abs_bits(x, n) < kernels::kNonFiniteBits; }

std::string layer_name(const SequentialModel& m, size_t i) {
  return detail::concat("layer ", i, " (", m.module(i)->type_name(), ")");
}
}  // namespace

const Tensor& SequentialModel::forward(const float* x, const Shape& shape) {
  have_forward_ = false;
  shapes_ = shapes_for(shape);
  const size_t n = modules_.size();
  acts_.resize(n);
  for (size_t i = 0; i < n; ++i) acts_[i].resize(shapes_[i + 1]);
  input_ = x;
  in_shape_ = shape;
  const float* cur = x;
  if (detect_anomaly_) {
    const size_t in = numel(shape);
    CX_CHECK(finite(x, in), NonFiniteError, "detect_anomaly: the input of ", layer_name(*this, 0), " in forward holds ",
             kernels::count_nonfinite(x, in), " non-finite values (of ", in, "): the data itself is not finite");
  }
  for (size_t i = 0; i < n; ++i) {
    modules_[i]->forward(cur, shapes_[i], acts_[i].data(), training_);
    cur = acts_[i].data();
    // Note: the input of layer i was checked (the data, or layer i-1's output), so this one is to blame.
    CX_CHECK(!detect_anomaly_ || finite(cur, acts_[i].numel()), NonFiniteError, "detect_anomaly: ",
             layer_name(*this, i), " produced ", kernels::count_nonfinite(cur, acts_[i].numel()),
             " non-finite values (of ", acts_[i].numel(), ") in its forward output from a finite input",
             modules_[i]->num_params() ? "; look at its parameters (a weight already inf/NaN?)" : "");
  }
  have_forward_ = true;
  return acts_.back();
}

const Tensor* SequentialModel::backward(const float* grad_output, const Shape& shape, bool input_grad) {
  CX_CHECK(have_forward_, InvalidArgument,
           "SequentialModel.backward: call forward() first (no forward since the model was built or changed)");
  CX_CHECK(shape == shapes_.back(), InvalidArgument, "SequentialModel.backward: grad_output must have the output's shape ",
           shape_str(shapes_.back()), ", got ", shape_str(shape));
  const size_t n = modules_.size();
  const float* gy = grad_output;
  int slot = 0;
  if (detect_anomaly_) {
    const size_t go = numel(shape);
    CX_CHECK(finite(gy, go), NonFiniteError, "detect_anomaly: the gradient of the output (the loss's backward) "
             "holds ", kernels::count_nonfinite(gy, go), " non-finite values (of ", go, "), before ",
             layer_name(*this, n - 1), "'s backward");
  }
  for (size_t k = n; k-- > 0;) {
    Module& m = *modules_[k];
    bool need_gx = k > 0 || input_grad;
    if (!need_gx && m.num_params() == 0) break;
    float* gx = nullptr;
    if (need_gx) {
      gbuf_[slot].resize(shapes_[k]);
      gx = gbuf_[slot].data();
    }
    const float* x = k == 0 ? input_ : acts_[k - 1].data();
    size_t base = first_param_[k];
    if (hook_) {
      m.backward(x, acts_[k].data(), shapes_[k], gy, gx, [this, base](size_t i) { hook_(base + i); });
    } else {
      static const ParamDone kNoop = [](size_t) {};
      m.backward(x, acts_[k].data(), shapes_[k], gy, gx, kNoop);
    }
    if (detect_anomaly_) check_backward(k, gx);
    gy = gx;
    slot ^= 1;
  }
  return input_grad ? &gbuf_[slot ^ 1] : nullptr;
}

// Anomaly mode: layer k's backward got a finite gradient of its output (checked
// before it); were its parameter gradients and its input gradient finite?
void SequentialModel::check_backward(size_t k, const float* gx) const {
  const auto slices = param_slices();
  const size_t base = first_param_[k];
  for (size_t i = 0; i < modules_[k]->param_specs().size(); ++i) {
    auto [off, cnt] = slices[base + i];
    CX_CHECK(finite(flat_grads() + off, cnt), NonFiniteError, "detect_anomaly: ", layer_name(*this, k),
             " produced a non-finite gradient for its parameter '", modules_[k]->param_specs()[i].name, "' (",
             kernels::count_nonfinite(flat_grads() + off, cnt), " of ", cnt,
             " values) in backward from a finite gradient of its output",
             "; its forward input or saved values may be huge, or the gradient was already inf/NaN before this "
             "backward (zero_grad)");
  }
  if (gx) {
    const size_t m = numel(shapes_[k]);
    CX_CHECK(finite(gx, m), NonFiniteError, "detect_anomaly: ", layer_name(*this, k), " produced ",
             kernels::count_nonfinite(gx, m), " non-finite values (of ", m,
             ") in the gradient of its input in backward from a finite gradient of its output");
  }
}

std::vector<uint64_t> SequentialModel::rng_states() const {
  std::vector<uint64_t> out;
  for (const auto& m : modules_)
    if (m->has_rng_state()) out.push_back(m->rng_state());
  return out;
}

void SequentialModel::set_rng_states(const std::vector<uint64_t>& states) {
  size_t n = 0;
  for (const auto& m : modules_) n += m->has_rng_state() ? 1 : 0;
  CX_CHECK(states.size() == n, InvalidArgument, "SequentialModel.set_rng_state: this model has ", n,
           " module(s) with a random-number generator (Dropout), got ", states.size(), " state(s)");
  size_t k = 0;
  for (const auto& m : modules_)
    if (m->has_rng_state()) m->set_rng_state(states[k++]);
}

void SequentialModel::zero_grad() {
  if (!total_) return;
  float* g = flat_grads();
  parallel_floats(total_, [&](size_t b, size_t e) { std::memset(g + b, 0, (e - b) * sizeof(float)); });
}

std::string SequentialModel::repr() const {
  std::ostringstream os;
  os << "SequentialModel(";
  if (modules_.empty()) return "SequentialModel()";
  os << "\n";
  for (size_t i = 0; i < modules_.size(); ++i) os << "  (" << i << "): " << modules_[i]->repr() << "\n";
  os << ")";
  return os.str();
}

std::string SequentialModel::summary() const {
  std::ostringstream os;
  os << std::left << std::setw(6) << "#" << std::setw(40) << "layer" << std::right << std::setw(14) << "parameters"
     << "\n";
  os << std::string(60, '-') << "\n";
  for (size_t i = 0; i < modules_.size(); ++i)
    os << std::left << std::setw(6) << i << std::setw(40) << modules_[i]->repr() << std::right << std::setw(14)
       << modules_[i]->num_params() << "\n";
  os << std::string(60, '-') << "\n";
  os << "total parameters: " << total_ << " (" << std::fixed << std::setprecision(2)
     << (total_ * 4.0 / (1024.0 * 1024.0)) << " MiB float32)\n";
  os << "mode: " << (training_ ? "train" : "eval");
  return os.str();
}

// ---------------------------------------------------------------- files

std::string SequentialModel::serialize() const {
  // One buffer, reserved for the weights up front, its header's length field filled in at the end: a
  // ModelCheckpoint serializes the model after every epoch, and growing a payload buffer and copying it
  // into a second one cost more than the weights' copy itself (Note [Checkpoints written in the background]
  // in pycyxwiz/distributed/_train.py).
  size_t floats = total_;
  for (const auto& m : modules_)
    for (auto* b : m->buffers()) floats += b->size();
  ByteWriter out;
  out.bytes().reserve(kModelHeaderSize + floats * sizeof(float) + 64 * modules_.size() + 64);
  out.raw(kModelMagic, sizeof kModelMagic);
  out.u32(kModelFormatVersion);
  out.u32(0);
  out.u64(0);  // the payload's length, below
  out.u32(static_cast<uint32_t>(modules_.size()));
  for (const auto& m : modules_) {
    write_module(out, *m);
    out.u32(static_cast<uint32_t>(m->param_specs().size()));
    for (size_t i = 0; i < m->param_specs().size(); ++i) {
      size_t cnt = numel(m->param_specs()[i].shape);
      out.u64(cnt);
      out.floats(m->param(i), cnt);
    }
    auto bufs = m->buffers();
    out.u32(static_cast<uint32_t>(bufs.size()));
    for (auto* b : bufs) {
      out.u64(b->size());
      out.floats(b->data(), b->size());
    }
  }
  ByteWriter length;
  length.u64(out.bytes().size() - kModelHeaderSize);
  out.bytes().replace(kModelHeaderSize - 8, 8, length.bytes());
  out.u64(fnv1a64(out.bytes().data(), out.bytes().size()));
  return std::move(out.bytes());
}

void SequentialModel::save(const std::string& path) const { atomic_write_file(path, serialize()); }

std::shared_ptr<SequentialModel> SequentialModel::deserialize(const std::string& bytes, const std::string& what) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  auto fail = [&](const std::string& why) { CX_THROW(IoError, what, ": ", why); };
  size_t cmp = std::min(n, sizeof kModelMagic);
  if (std::memcmp(p, kModelMagic, cmp) != 0 || n == 0)
    fail("not a pycyxwiz model file (bad magic bytes; expected a .cyxmodel written by SequentialModel.save)");
  if (n < kModelHeaderSize + 8)
    fail("file is truncated (" + std::to_string(n) + " bytes, shorter than the header)");
  ByteReader head(p, kModelHeaderSize, what);
  uint8_t magic[8];
  head.raw(magic, 8);
  uint32_t version = head.u32();
  uint32_t flags = head.u32();
  uint64_t len = head.u64();
  if (version != kModelFormatVersion)
    fail("unsupported format version " + std::to_string(version) + " (this pycyxwiz reads version " +
         std::to_string(kModelFormatVersion) + ")");
  if (flags != 0) fail("unsupported header flags " + std::to_string(flags));
  if (len > n || n - kModelHeaderSize - 8 < len)
    fail("file is truncated (" + std::to_string(n) + " bytes, the header promises " +
         std::to_string(kModelHeaderSize + len + 8) + ")");
  if (n != kModelHeaderSize + len + 8)
    fail("file has " + std::to_string(n - (kModelHeaderSize + len + 8)) + " unexpected trailing bytes");
  ByteReader tail(p + kModelHeaderSize + len, 8, what);
  uint64_t stored = tail.u64();
  if (stored != fnv1a64(p, kModelHeaderSize + len))
    fail("file is corrupted (checksum mismatch)");

  ByteReader r(p + kModelHeaderSize, len, what);
  auto model = std::make_shared<SequentialModel>();
  uint32_t count = r.u32();
  if (count > len) r.fail("malformed architecture (module count " + std::to_string(count) + ")");
  std::vector<std::shared_ptr<Module>> mods;
  std::vector<std::vector<std::vector<float>>> weights, buffers;
  for (uint32_t i = 0; i < count; ++i) {
    auto m = read_module(r);
    uint32_t np = r.u32();
    if (np != m->param_specs().size()) r.fail("layer " + std::to_string(i) + " (" + m->repr() + "): wrong number of parameter tensors");
    std::vector<std::vector<float>> w;
    for (uint32_t j = 0; j < np; ++j) {
      uint64_t cnt = r.u64();
      if (cnt != numel(m->param_specs()[j].shape))
        r.fail("layer " + std::to_string(i) + " (" + m->repr() + "): parameter size mismatch");
      std::vector<float> v(cnt);
      r.floats(v.data(), cnt);
      w.push_back(std::move(v));
    }
    auto bufs = m->buffers();
    uint32_t nb = r.u32();
    if (nb != bufs.size()) r.fail("layer " + std::to_string(i) + " (" + m->repr() + "): wrong number of buffers");
    std::vector<std::vector<float>> bv;
    for (uint32_t j = 0; j < nb; ++j) {
      uint64_t cnt = r.u64();
      if (cnt != bufs[j]->size()) r.fail("layer " + std::to_string(i) + " (" + m->repr() + "): buffer size mismatch");
      std::vector<float> v(cnt);
      r.floats(v.data(), cnt);
      bv.push_back(std::move(v));
    }
    mods.push_back(std::move(m));
    weights.push_back(std::move(w));
    buffers.push_back(std::move(bv));
  }
  if (r.remaining() != 0) r.fail("malformed payload (" + std::to_string(r.remaining()) + " unparsed bytes)");
  // Everything parsed: now build (cannot fail half-way on file contents).
  for (size_t i = 0; i < mods.size(); ++i) {
    for (size_t j = 0; j < weights[i].size(); ++j)
      std::memcpy(mods[i]->param(j), weights[i][j].data(), weights[i][j].size() * sizeof(float));
    auto bufs = mods[i]->buffers();
    for (size_t j = 0; j < bufs.size(); ++j) *bufs[j] = buffers[i][j];
    model->add(mods[i]);
  }
  return model;
}

std::shared_ptr<SequentialModel> SequentialModel::load(const std::string& path) {
  return deserialize(read_whole_file(path), "cannot load model from '" + path + "'");
}

}  // namespace cx::nn
