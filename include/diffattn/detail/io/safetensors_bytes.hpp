// Little-endian scalar encoding of safetensors data, independent of the host's
// byte order, and the 16-bit float formats.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

inline std::uint64_t safetensors_load_le(const unsigned char* p, int bytes) noexcept {
  std::uint64_t v = 0;
  for (int i = bytes; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

inline void safetensors_store_le(unsigned char* p, std::uint64_t v, int bytes) noexcept {
  for (int i = 0; i < bytes; ++i) {
    p[i] = static_cast<unsigned char>(v & 0xFF);
    v >>= 8;
  }
}

/// Bytes of a tensor of `shape` with `elem`-byte elements; false when an extent is
/// negative or the count overflows index_t.
inline bool safetensors_byte_size(const std::vector<index_t>& shape, index_t elem, index_t& bytes) {
  const index_t max = std::numeric_limits<index_t>::max();
  index_t n = 1;
  for (const index_t e : shape) {
    if (e < 0 || (e != 0 && n > max / e)) return false;
    n *= e;
  }
  if (elem != 0 && n > max / elem) return false;
  bytes = n * elem;
  return true;
}

inline float safetensors_bits_to_f32(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline double safetensors_bits_to_f64(std::uint64_t u) noexcept {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

/// IEEE binary16 to float, exact for every value (subnormals, inf, NaN included).
inline float safetensors_f16_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf or NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {
    // Subnormal: value = mant * 2^-24; normalise the mantissa.
    std::uint32_t e = 113;  // exponent of 2^-14 in float bias, before shifting
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
  }
  return safetensors_bits_to_f32(bits);
}

/// bfloat16 (the high half of a float) to float, exact.
inline float safetensors_bf16_to_f32(std::uint16_t b) noexcept {
  return safetensors_bits_to_f32(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
