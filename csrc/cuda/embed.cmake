# cmake -DIN=kernels.fatbin -DOUT=kernels_fatbin.cpp -P embed.cmake
# Writes the fatbin as a byte array _core links in (see csrc/dist/transport/nccl/kernels.cpp).
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
file(WRITE "${OUT}" "// generated from ${IN} by csrc/cuda/embed.cmake\n#include <cstddef>\n"
     "namespace cx::dist::cuda {\nalignas(8) extern const unsigned char kFatbin[] = {\n${body}0};\n"
     "extern const size_t kFatbinBytes = ${bytes};\n}  // namespace cx::dist::cuda\n")
