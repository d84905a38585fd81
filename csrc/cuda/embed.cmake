# cmake -DIN=nn.fatbin -DOUT=nn_fatbin.cpp -DNAME=nn -P embed.cmake
# Writes the fatbin as the byte array kFatbin_<NAME> that _core links in (used by
# csrc/cuda/module.cpp).
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
string(CONCAT text "// generated from ${IN} by csrc/cuda/embed.cmake\n#include <cstddef>\n"
       "namespace cx::cuda {\nalignas(8) extern const unsigned char kFatbin_${NAME}[] = {\n${body}0};\n"
       "extern const size_t kFatbinBytes_${NAME} = ${bytes};\n}  // namespace cx::cuda\n")
# Rewritten only when the bytes change, so that a new cmake path (a new build environment) does not
# recompile it: Note [The build directory outlives the build environment] in CMakeLists.txt.
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
  if(old STREQUAL text)
    return()
  endif()
endif()
file(WRITE "${OUT}" "${text}")
