#include "nn/layers/residual.h"

#include "common/error.h"
#include "nn/kernels.h"
#include "nn/registry.h"
#include "nn/serialize.h"

namespace cx::nn {

namespace {

// "block.0.weight", ...: the model's tensors named as its layers hold them.
void append_specs(const SequentialModel& m, const std::string& prefix, std::vector<ParamSpec>& out) {
  for (size_t i = 0; i < m.size(); ++i)
    for (const auto& s : m.module(i)->param_specs()) out.push_back({prefix + std::to_string(i) + "." + s.name, s.shape});
}

void check_inner(const std::shared_ptr<SequentialModel>& m, const char* what) {
  CX_CHECK(m->size() > 0, InvalidArgument, "ResidualModule: the ", what, " has no modules; add() them first",
           std::string(what) == "shortcut" ? " (or pass shortcut=None for the identity)" : "");
  for (size_t i = 0; i < m->size(); ++i)
    CX_CHECK(!m->module(i)->has_rng_state(), InvalidArgument, "ResidualModule: layer ", i, " of the ", what, " (",
             m->module(i)->repr(), ") draws random numbers, whose generator state a checkpoint would not hold "
             "inside a ResidualModule; put it before or after the ResidualModule");
}

std::string layers(const SequentialModel& m) {
  std::string s = "[";
  for (size_t i = 0; i < m.size(); ++i) s += (i ? ", " : "") + m.module(i)->repr();
  return s + "]";
}

// Clears a model's gradient-ready hook however backward leaves.
struct HookGuard {
  SequentialModel& m;
  const void* owner;
  ~HookGuard() { m.clear_grad_ready_hook(owner); }
};

}  // namespace

ResidualModule::ResidualModule(std::shared_ptr<SequentialModel> block, std::shared_ptr<SequentialModel> shortcut)
    : block_(std::move(block)), shortcut_(std::move(shortcut)) {
  CX_CHECK(block_ != nullptr, InvalidArgument, "ResidualModule: block is None; give it a SequentialModel");
  CX_CHECK(block_ != shortcut_, InvalidArgument, "ResidualModule: block and shortcut are the same model; give the "
           "shortcut its own (or None for the identity)");
  check_inner(block_, "block");
  if (shortcut_) check_inner(shortcut_, "shortcut");
  // Both checked before either is held: a refused container leaves the models free.
  CX_CHECK(!block_->holder() && !(shortcut_ && shortcut_->holder()), InvalidArgument, "ResidualModule: the ",
           block_->holder() ? "block" : "shortcut", " already belongs to a ResidualModule; build a new model for each");
  block_->hold(this);
  if (shortcut_) shortcut_->hold(this);
  std::vector<ParamSpec> specs;
  append_specs(*block_, "block.", specs);
  if (shortcut_) append_specs(*shortcut_, "shortcut.", specs);
  block_tensors_ = block_->param_slices().size();
  declare_params(std::move(specs));
  storage_moved();  // the models' values move into this module's storage
}

ResidualModule::~ResidualModule() {
  for (SequentialModel* m : submodels()) m->hold(nullptr);
}

void ResidualModule::storage_moved() {
  const size_t base = param_specs().empty() ? 0 : param_offset(0);
  block_->adopt_storage(param_storage(), grad_storage(), base);
  if (shortcut_) shortcut_->adopt_storage(param_storage(), grad_storage(), base + block_->num_parameters());
}

std::string ResidualModule::repr() const {
  return "Residual(" + layers(*block_) + (shortcut_ ? ", shortcut=" + layers(*shortcut_) : "") + ")";
}

Shape ResidualModule::output_shape(const Shape& in) const {
  Shape out, side = in;
  try {
    out = block_->layer_shapes(in).back();
  } catch (const InvalidArgument& e) {
    CX_THROW(InvalidArgument, "Residual block, ", e.what());
  }
  if (shortcut_) {
    try {
      side = shortcut_->layer_shapes(in).back();
    } catch (const InvalidArgument& e) {
      CX_THROW(InvalidArgument, "Residual shortcut, ", e.what());
    }
    CX_CHECK(side == out, InvalidArgument, "Residual: for input ", shape_str(in), " the block gives ", shape_str(out),
             " but the shortcut gives ", shape_str(side), "; they must match (a block that changes the channels or "
             "the size needs a shortcut that does the same, e.g. a 1x1 Conv2dModule with the block's stride, then "
             "a BatchNorm2dModule)");
  } else {
    CX_CHECK(out == in, InvalidArgument, "Residual: for input ", shape_str(in), " the block gives ", shape_str(out),
             ", to which the identity shortcut cannot add its input; give a shortcut that maps ", shape_str(in),
             " to ", shape_str(out), " (e.g. a 1x1 Conv2dModule with the block's stride, then a BatchNorm2dModule)");
  }
  return out;
}

void ResidualModule::forward(const float* x, const Shape& in, float* y, bool training) {
  block_->train(training);
  const Tensor& yb = block_->forward(x, in);
  out_ = yb.shape();
  const float* side = x;
  if (shortcut_) {
    shortcut_->train(training);
    side = shortcut_->forward(x, in).data();
  }
  kernels::add(yb.data(), side, yb.numel(), y);
}

void ResidualModule::backward(const float*, const float*, const Shape& in, const float* gy, float* gx,
                              const ParamDone& done) {
  const bool want_gx = gx != nullptr;
  const float* side = gy;  // the identity's dL/dx
  if (shortcut_) {         // first: its parameters come after the block's
    HookGuard guard{*shortcut_, this};
    const size_t first = block_tensors_;
    shortcut_->set_grad_ready_hook([&done, first](size_t i) { done(first + i); }, this);
    const Tensor* g = shortcut_->backward(gy, out_, want_gx);
    if (g) side = g->data();
  }
  HookGuard guard{*block_, this};
  block_->set_grad_ready_hook([&done](size_t i) { done(i); }, this);
  const Tensor* g = block_->backward(gy, out_, want_gx);
  if (gx) kernels::add(g->data(), side, numel(in), gx);
}

std::vector<std::vector<float>*> ResidualModule::buffers() {
  std::vector<std::vector<float>*> out;
  for (SequentialModel* m : submodels())
    for (size_t i = 0; i < m->size(); ++i)
      for (auto* b : m->module(i)->buffers()) out.push_back(b);
  return out;
}

std::vector<SequentialModel*> ResidualModule::submodels() {
  std::vector<SequentialModel*> out{block_.get()};
  if (shortcut_) out.push_back(shortcut_.get());
  return out;
}

void ResidualModule::set_replica_sum(ReplicaSum sum, const void* owner) {
  for (SequentialModel* m : submodels())
    for (size_t i = 0; i < m->size(); ++i) m->module(i)->set_replica_sum(sum, owner);
}

void ResidualModule::clear_replica_sum(const void* owner) {
  for (SequentialModel* m : submodels())
    for (size_t i = 0; i < m->size(); ++i) m->module(i)->clear_replica_sum(owner);
}

// ---------------------------------------------------------------- files

void ResidualModule::write_config(ByteWriter& w) const {
  auto write_model = [&w](const SequentialModel& m) {
    w.u32(static_cast<uint32_t>(m.size()));
    for (size_t i = 0; i < m.size(); ++i) write_module(w, *m.module(i));
  };
  write_model(*block_);
  w.u8(shortcut_ ? 1 : 0);
  if (shortcut_) write_model(*shortcut_);
}

namespace {

std::shared_ptr<SequentialModel> read_model(ByteReader& r) {
  const uint32_t n = r.u32();
  if (n == 0 || n > r.remaining() / 2) r.fail("bad Residual layer count " + std::to_string(n));
  auto m = std::make_shared<SequentialModel>();
  for (uint32_t i = 0; i < n; ++i) m->add(read_module(r));
  return m;
}

std::shared_ptr<Module> read_residual(ByteReader& r) {
  auto block = read_model(r);
  const uint8_t has_shortcut = r.u8();
  if (has_shortcut > 1) r.fail("bad Residual shortcut flag");
  return std::make_shared<ResidualModule>(block, has_shortcut ? read_model(r) : nullptr);
}

// Note [Layer ids] in registry.h.
const LayerRegistration kResidualRegistration{17, "Residual", read_residual};

}  // namespace

}  // namespace cx::nn
