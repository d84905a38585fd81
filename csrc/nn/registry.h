// defines: the layer registry — LayerRegistration, which each layer's .cpp
// makes once (its file id, its name, its reader), and read_module() /
// write_module(), which rebuild and write a module through it. No other list of
// the layers exists in nn/: a new layer is its own file pair plus one
// registration, and model files, checkpoints and containers (ResidualModule)
// know it from then on.
//
//   // in csrc/nn/layers/conv2d.cpp
//   std::shared_ptr<Module> read_conv2d(ByteReader& r) { ... read what write_config wrote ... }
//   const LayerRegistration kRegistration{12, "Conv2d", read_conv2d};
//
// Note [Layer ids]
// The id is the u16 written before a module's hyper-parameters in a .cyxmodel
// file (Note [.cyxmodel format, version 1] in serialize.h); the name is the
// module's type_name(), which write_module() looks up. An id is never
// renumbered or reused: files in the wild carry it. 1 to 11 are the first
// layers' (modules.cpp); a new layer takes the next free one, which
// `python -c "import pycyxwiz; print(pycyxwiz._core._layer_ids())"` shows. Two
// registrations of one id or one name stop the program as it loads, naming both,
// so a clash cannot reach a file.
//
// Registration runs when the .cpp's object is linked into _core: it is, because
// the layer's binding (csrc/bindings/) calls its constructor. A layer nothing
// refers to is not in the library, and so cannot be read either.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cx::nn {

class ByteReader;
class ByteWriter;
class Module;

// Reads what the layer's write_config() wrote and returns the module (its
// parameters and buffers are read by the caller). Throws IoError through `r`
// (r.fail) on bad values, or InvalidArgument from the module's constructor.
using LayerReader = std::shared_ptr<Module> (*)(ByteReader& r);

struct LayerInfo {
  uint16_t id;
  std::string name;  // the module's type_name()
  LayerReader read;
};

class LayerRegistration {
 public:
  LayerRegistration(uint16_t id, const char* name, LayerReader read);
};

// Every registered layer, by id.
std::vector<LayerInfo> registered_layers();

// One module's id and hyper-parameters (write_config), not its weights.
// InvalidArgument if its layer is not registered.
void write_module(ByteWriter& w, const Module& m);
// Reads a module written by write_module(). Throws IoError through `r` on an
// unknown id, bad hyper-parameters, or containers nested deeper than
// kMaxModuleNesting.
std::shared_ptr<Module> read_module(ByteReader& r);
constexpr int kMaxModuleNesting = 64;

}  // namespace cx::nn
