// defines: Module (one of our kernel files, csrc/cuda/<name>.cu, loaded into the
// current context, its kernels looked up by name) and kernels_built().
//
// Each .cu file is compiled by nvcc at build time into a fatbin embedded in _core
// (embed.cmake), and only where nvcc was found (CX_WITH_CUDA). Kernels are
// extern "C", so their names are looked up as written, and take plain pointers.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cuda/driver.h"

namespace cx::cuda {

// True where this build embeds the kernels (nvcc was found when it was built).
bool kernels_built();

class Module {
 public:
  // Loads csrc/cuda/<name>.cu's fatbin ("nn", "scale") into the current context.
  // Throws Error where this build has no kernels ("... " + without_them says what
  // to do instead) or where the driver cannot load them (an older GPU or driver).
  Module(const char* name, const char* without_them);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The kernel `kernel` (cached after the first lookup).
  CUfunction fn(const char* kernel);

 private:
  CUmodule mod_ = nullptr;
  std::vector<std::pair<std::string, CUfunction>> fns_;
};

}  // namespace cx::cuda
