// The fuzz targets' reader of their input bytes: past the end every byte
// reads as 0, so that any input, however short, is a whole test.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fuzz {

struct Input {
  const std::uint8_t* p;
  std::size_t n;
  std::uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  std::int64_t i64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | u8();
    std::int64_t s;
    std::memcpy(&s, &v, sizeof s);
    return s;
  }
  float f32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    float f;
    std::memcpy(&f, &v, sizeof f);
    return f;
  }
};

}  // namespace fuzz
