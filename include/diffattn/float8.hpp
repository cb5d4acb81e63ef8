/// \file
/// float8_e4m3: the 8-bit floating-point storage type of the 8-bit KV caches
/// (OCP 8-bit floating point, E4M3FN), and the traits of 8-bit cache storage.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "config.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup storage
/// @{

/// OCP E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 significand bits.
/// Largest finite 448, smallest normal 2^-6, subnormals down to 2^-9; no
/// infinities; NaN is 0x7F / 0xFF. Relative rounding 2^-4 for normal values.
///
/// Converts to and from float explicitly, like Eigen::bfloat16:
/// float8_e4m3(x) rounds to nearest even and saturates: every |x| > 448
/// (infinities too) becomes +-448; NaN becomes NaN (0x7F, sign kept).
/// static_cast<float>(f) is exact. `value` holds the bits.
struct float8_e4m3 {
  /// The bits: sign, exponent, significand.
  std::uint8_t value = 0;

  /// Zero.
  float8_e4m3() = default;
  /// x rounded to nearest even, saturating at +-448 (NaN stays NaN).
  explicit float8_e4m3(float x) noexcept : value(from_float(x)) {}
  /// The value as a float, exactly.
  explicit operator float() const noexcept { return to_float(value); }

  /// The float of the bits b, exactly.
  static float to_float(std::uint8_t b) noexcept {
    const std::uint32_t mag = b & 0x7Fu;
    float f;
    if (mag == 0x7Fu) {
      f = std::numeric_limits<float>::quiet_NaN();
    } else if (mag < 8u) {  // subnormal: mag * 2^-9
      f = static_cast<float>(mag) * (1.0f / 512);
    } else {  // exponent e = mag >> 3 (bias 7) to float's bias 127
      const std::uint32_t bits = (mag << 20) + (std::uint32_t(120) << 23);
      std::memcpy(&f, &bits, sizeof f);
    }
    return (b & 0x80u) ? -f : f;
  }

  /// The bits of x rounded to nearest even, saturating at +-448.
  static std::uint8_t from_float(float x) noexcept {
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
    const std::uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | 0x7Fu);  // NaN
    if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | 0x7Eu);  // >= 448: saturate
    if (a >= 0x3C800000u) {  // normal in E4M3 (>= 2^-6): round 20 bits off
      const std::uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
      const std::uint32_t m = r - (std::uint32_t(120) << 3);
      return static_cast<std::uint8_t>(sign | (m > 0x7Eu ? 0x7Eu : m));
    }
    // Subnormal in E4M3: round |x| 2^9 to an integer in [0, 8] (8 is 2^-6).
    const std::uint32_t e = a >> 23;
    if (e == 0) return sign;  // float subnormals: far below 2^-10
    const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;  // |x| = mant 2^(e - 150)
    const std::uint32_t shift = 141 - e;                      // >= 21
    if (shift > 24) return sign;                              // |x| 2^9 < 1/2
    std::uint32_t m = mant >> shift;
    const std::uint32_t rem = mant & ((std::uint32_t(1) << shift) - 1);
    const std::uint32_t halfway = std::uint32_t(1) << (shift - 1);
    if (rem > halfway || (rem == halfway && (m & 1u))) ++m;
    return static_cast<std::uint8_t>(sign | m);
  }
};

static_assert(sizeof(float8_e4m3) == 1 && std::is_trivially_copyable<float8_e4m3>::value,
              "float8_e4m3 is one byte of plain data");

/// True for the 8-bit cache storage types (std::int8_t, float8_e4m3): values
/// with one float scale per (token, head) row, x = scale * stored value.
template <class T>
struct is_8bit_storage
    : std::integral_constant<bool, std::is_same<std::remove_cv_t<T>, std::int8_t>::value ||
                                       std::is_same<std::remove_cv_t<T>, float8_e4m3>::value> {};
/// is_8bit_storage<T>::value.
template <class T>
constexpr bool is_8bit_storage_v = is_8bit_storage<T>::value;

/// The largest stored magnitude of an 8-bit type: a row's scale is
/// max |x| / quant_max<S>() (127 for int8, 448 for float8_e4m3).
template <class S>
constexpr float quant_max() noexcept {
  static_assert(is_8bit_storage_v<S>, "quant_max: std::int8_t or float8_e4m3");
  return std::is_same<std::remove_cv_t<S>, std::int8_t>::value ? 127.0f : 448.0f;
}

/// @}

DIFFATTN_END_NAMESPACE
