#include "nn/registry.h"

#include <cstdio>
#include <cstdlib>
#include <map>

#include "common/error.h"
#include "nn/module.h"
#include "nn/serialize.h"

namespace cx::nn {

namespace {

struct Registry {
  std::map<uint16_t, LayerInfo> by_id;
  std::map<std::string, uint16_t> id_of;
};

// A function-local static: registrations run during static initialisation, in
// an order between files that nothing fixes.
Registry& registry() {
  static Registry r;
  return r;
}

thread_local int nesting = 0;  // read_module's depth (containers read their modules through it)

}  // namespace

LayerRegistration::LayerRegistration(uint16_t id, const char* name, LayerReader read) {
  Registry& r = registry();
  // Note [Layer ids]: a clash is a bug in the library, found at the first import.
  auto same_id = r.by_id.find(id);
  auto same_name = r.id_of.find(name);
  if (same_id != r.by_id.end() || same_name != r.id_of.end()) {
    std::fprintf(stderr, "pycyxwiz: layer '%s' is registered with file id %u, which clashes with layer '%s' (id %u); "
                 "give each layer its own id and name (Note [Layer ids] in csrc/nn/registry.h)\n", name, id,
                 same_id != r.by_id.end() ? same_id->second.name.c_str() : name,
                 same_id != r.by_id.end() ? id : same_name->second);
    std::abort();
  }
  r.by_id.emplace(id, LayerInfo{id, name, read});
  r.id_of.emplace(name, id);
}

std::vector<LayerInfo> registered_layers() {
  std::vector<LayerInfo> out;
  for (const auto& [id, info] : registry().by_id) out.push_back(info);
  return out;
}

void write_module(ByteWriter& w, const Module& m) {
  const auto& ids = registry().id_of;
  auto it = ids.find(m.type_name());
  CX_CHECK(it != ids.end(), InvalidArgument, "cannot save ", m.repr(), ": its layer '", m.type_name(),
           "' is not registered (a LayerRegistration in its .cpp; Note [Layer ids] in csrc/nn/registry.h)");
  w.u16(it->second);
  m.write_config(w);
}

std::shared_ptr<Module> read_module(ByteReader& r) {
  const uint16_t id = r.u16();
  const auto& layers = registry().by_id;
  auto it = layers.find(id);
  if (it == layers.end()) r.fail("unknown module kind " + std::to_string(id) + " (written by a newer pycyxwiz?)");
  if (nesting >= kMaxModuleNesting)
    r.fail("modules nested more than " + std::to_string(kMaxModuleNesting) + " deep (file is malformed)");
  struct Depth {
    Depth() { ++nesting; }
    ~Depth() { --nesting; }
  } depth;
  std::shared_ptr<Module> m;
  try {
    m = it->second.read(r);
  } catch (const InvalidArgument& e) {
    r.fail(std::string("bad module hyper-parameters: ") + e.what());
  }
  CX_CHECK(m && m->type_name() == it->second.name, InvalidArgument, "the reader of layer id ", id, " ('",
           it->second.name, "') made ", m ? "'" + m->type_name() + "'" : std::string("nothing"));
  return m;
}

}  // namespace cx::nn
