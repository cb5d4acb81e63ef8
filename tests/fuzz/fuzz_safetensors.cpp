// libFuzzer target: the safetensors reader on arbitrary bytes. Every input must
// either load or throw diffattn::error; AddressSanitizer checks that no byte
// outside the file's is ever read.
#include <cstdint>
#include <cstdio>
#include <string>

#include <unistd.h>

#include <diffattn/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = [] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/diffattn_fuzz_" + std::to_string(getpid()) + ".safetensors";
  }();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    const diffattn::safetensors::Reader reader(path);
    for (const auto& kv : reader.tensors()) {
      const auto& info = kv.second;
      if (diffattn::safetensors::is_float_dtype(info.dtype)) {
        const auto values = reader.read_as<float>(kv.first);
        if (static_cast<diffattn::index_t>(values.size()) != info.numel()) __builtin_trap();
      } else {
        (void)reader.read_bytes(kv.first);
      }
    }
  } catch (const diffattn::error&) {
  }
  return 0;
}
