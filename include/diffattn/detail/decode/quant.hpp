// 8-bit rows (std::int8_t, float8_e4m3): widening to float as the kernels read
// them, and quantizing rows as caches are written.
//
// Widening. A kernel reads a stored row as "units": int8 as its integer,
// float8_e4m3 as its value times 2^-8, and multiplies by the row's scale times
// kv_unit<S>() (1, or 2^8) where it already multiplies (a score, a weight).
// The 2^-8 is what makes e4m3 cheap to widen: its bits shifted left by 7
// (sign kept) are the bits of a half holding value 2^-8 (half's exponent bias
// is 15, e4m3's 7), and F16C widens halves to floats, subnormals included, in
// one instruction: 4 instructions per 16 values with AVX-512. All paths
// (AVX-512, AVX2, SSE2, scalar) give the same units, so a row reads the same
// in every block. The NaN codes 0x7F / 0xFF, which quantize_rows never writes
// (it refuses non-finite input), read as +-480 2^-8 there.
//
// Quantizing. scale = max |x| / qmax (0 for a zero row), stored value =
// round(x / scale): int8 to nearest (ties to even, the default rounding mode),
// e4m3 to nearest even, saturating. Both are exact functions of x and scale,
// vectorised with AVX-512 and element by element elsewhere, with the same
// results.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../float8.hpp"
#include "../../types.hpp"
#include "../kernel/gemm.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// What a widened unit of S is worth: 1 (int8, and every other type), 2^8
/// (float8_e4m3, read as value 2^-8).
template <class S>
constexpr float kv_unit() noexcept {
  return std::is_same<std::remove_cv_t<S>, float8_e4m3>::value ? 256.0f : 1.0f;
}

/// e4m3 bits as value 2^-8, exactly (0x7F / 0xFF: +-480 2^-8, as the packet paths).
inline float e4m3_units(std::uint8_t b) noexcept {
  const std::uint32_t mag = b & 0x7Fu;
  float f;
  if (mag < 8u) {
    f = static_cast<float>(mag) * (1.0f / 131072);  // mag 2^-9 2^-8
  } else {
    const std::uint32_t bits = (mag << 20) + (std::uint32_t(112) << 23);
    std::memcpy(&f, &bits, sizeof f);
  }
  return (b & 0x80u) ? -f : f;
}

/// One stored element as compute type C in the kernels' units: static_cast
/// for float, double and the 16-bit types, the integer for int8, value 2^-8
/// for e4m3.
template <class C, class S>
EIGEN_ALWAYS_INLINE C widen_scalar(const S& x) {
  if constexpr (std::is_same<std::remove_cv_t<S>, float8_e4m3>::value)
    return static_cast<C>(e4m3_units(x.value));
  else
    return static_cast<C>(x);
}

/// The packet of P floats at p (unaligned) from P 8-bit values, in units.
template <class Packet, class S>
EIGEN_ALWAYS_INLINE Packet pload_widened_8bit(const S* p) {
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  using C = typename Eigen::internal::unpacket_traits<Packet>::type;
  static_assert(std::is_same<C, float>::value, "8-bit rows widen to float");
  constexpr bool i8 = std::is_same<std::remove_cv_t<S>, std::int8_t>::value;
  if constexpr (false) {
#if defined(EIGEN_VECTORIZE_AVX512)
  } else if constexpr (P == 16 && i8) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (P == 16 && !i8) {
    // Sign-extended to 16 bits and shifted by 7: the sign lands on bit 15,
    // exponent and significand on bits 13..7; bit 14 (the sign's copy) cleared.
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(
        _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
  } else if constexpr (P == 8 && i8) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#if defined(__F16C__)
  } else if constexpr (P == 8 && !i8) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(
        _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
#endif
#endif
#if defined(EIGEN_VECTORIZE_SSE2) && !defined(EIGEN_VECTORIZE_AVX)
  } else if constexpr (P == 4 && i8) {
    // Four bytes to the top of four lanes, shifted down with their sign.
    int word;
    std::memcpy(&word, p, sizeof word);
    __m128i x = _mm_cvtsi32_si128(word);
    x = _mm_unpacklo_epi8(x, x);
    x = _mm_unpacklo_epi16(x, x);
    return _mm_cvtepi32_ps(_mm_srai_epi32(x, 24));
#endif
  } else {
    alignas(64) float tmp[P];
    for (int i = 0; i < P; ++i) tmp[i] = widen_scalar<float>(p[i]);
    return Eigen::internal::pload<Packet>(tmp);
  }
}

/// Whether pload_widened_pair widens two packets of S at p in fewer
/// instructions than two pload_widened: float8_e4m3 with AVX512-BW, whose 32
/// bytes are sign-extended, shifted and masked as one vector before the two
/// F16C conversions.
template <int P, class S>
constexpr bool widen_pairs_v =
#if defined(EIGEN_VECTORIZE_AVX512) && defined(__AVX512BW__)
    P == 16 && std::is_same<std::remove_cv_t<S>, float8_e4m3>::value;
#else
    false;
#endif

/// The packets of p[0, P) and p[P, 2 P), in units, as two pload_widened_8bit
/// (widen_pairs_v only).
template <class Packet, class S>
EIGEN_ALWAYS_INLINE void pload_widened_pair(const S* p, Packet& lo, Packet& hi) {
  static_assert(widen_pairs_v<Eigen::internal::unpacket_traits<Packet>::size, S>,
                "pload_widened_pair: use pload_widened");
#if defined(EIGEN_VECTORIZE_AVX512) && defined(__AVX512BW__)
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h =
      _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#else
  (void)p, (void)lo, (void)hi;
#endif
}

/// An 8-bit row as the packing functions (gemm.hpp) read it: element t is
/// factor * units(p[t]), factor = the row's scale times kv_unit<S>().
template <class S>
struct QuantRow {
  const S* p;
  float factor;
  float operator[](index_t t) const { return factor * widen_scalar<float>(p[t]); }
  QuantRow operator+(index_t off) const { return {p + off, factor}; }
};

template <int Locality = 3, class S>
EIGEN_ALWAYS_INLINE void prefetch_row(const QuantRow<S>& row, index_t width) {
  prefetch_row<Locality>(row.p, width);
}

/// Stored value of y = x / scale, |y| <= qmax up to rounding: int8 rounded to
/// nearest (ties to even) and clamped to [-127, 127]; e4m3 rounded to nearest
/// even, saturating.
template <class Q>
EIGEN_ALWAYS_INLINE Q quantize_scalar(float y) {
  if constexpr (std::is_same<Q, std::int8_t>::value) {
    const float r = std::nearbyint(std::min(127.0f, std::max(-127.0f, y)));
    return static_cast<std::int8_t>(r);
  } else {
    float8_e4m3 f;
    f.value = float8_e4m3::from_float(y);
    return f;
  }
}

#if defined(EIGEN_VECTORIZE_AVX512)
/// 16 e4m3 codes (in the low byte of each lane) of y, |y| finite, as
/// float8_e4m3::from_float: normal results by rounding 20 significand bits
/// off, subnormal ones (|y| < 2^-6) as the integer nearest |y| 2^9.
EIGEN_ALWAYS_INLINE __m512i e4m3_codes(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i normal = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), odd), 20);
  normal = _mm512_min_epi32(_mm512_sub_epi32(normal, _mm512_set1_epi32(960)),
                            _mm512_set1_epi32(0x7E));
  const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512)));
  const __mmask16 small = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x3C800000));
  const __mmask16 big = _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(0x43E00000));
  __m512i m = _mm512_mask_blend_epi32(small, normal, sub);
  m = _mm512_mask_blend_epi32(big, m, _mm512_set1_epi32(0x7E));
  return _mm512_or_si512(m, sign);
}
#endif

/// Quantizes one row of d floats x to dst and returns its scale: max |x| /
/// quant_max<Q>(), 0 for a zero row (then every value is 0). x must be finite.
template <class Q>
float quantize_row(const float* x, index_t d, Q* dst) {
  using ConstMap = Eigen::Map<const Eigen::Array<float, Eigen::Dynamic, 1>>;
  const float amax = d > 0 ? ConstMap(x, d).abs().maxCoeff() : 0.0f;
  const float scale = amax / quant_max<Q>();
  if (scale == 0.0f) {  // a zero row (or one below qmax times the smallest float)
    std::memset(static_cast<void*>(dst), 0, static_cast<std::size_t>(d));
    return 0.0f;
  }
  index_t t = 0;
#if defined(EIGEN_VECTORIZE_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  for (; t + 16 <= d; t += 16) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + t), s);
    __m512i codes;
    if constexpr (std::is_same<Q, std::int8_t>::value) {
      const __m512 c = _mm512_min_ps(_mm512_set1_ps(127), _mm512_max_ps(_mm512_set1_ps(-127), y));
      codes = _mm512_cvtps_epi32(c);  // to nearest even (the default mode)
    } else {
      codes = e4m3_codes(y);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + t), _mm512_cvtepi32_epi8(codes));
  }
#endif
  for (; t < d; ++t) dst[t] = quantize_scalar<Q>(x[t] / scale);
  return scale;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
