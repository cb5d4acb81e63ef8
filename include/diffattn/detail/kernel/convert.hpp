// Conversions between storage and compute types, row by row: where the kernels
// read 16-bit data (packing, query scaling, a decoding step's row reads) and
// where they write it (output rows). Identity copies for float and double.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../types.hpp"
#include "../decode/quant.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// dst[i] = D(src[i]) for i < n: float <-> bfloat16 / half through Eigen's
/// packet conversions where the target has them (AVX: 8 at a time), element
/// by element otherwise. float -> 16-bit rounds to nearest even.
template <class S, class D>
inline void convert_row(const S* src, index_t n, D* dst) {
  if constexpr (std::is_same<S, D>::value) {
    std::copy(src, src + n, dst);
  } else {
    index_t i = 0;
#if defined(__F16C__) && defined(EIGEN_VECTORIZE_AVX)
    if constexpr (std::is_same<D, float>::value && std::is_same<S, half>::value) {
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(
            dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    } else if constexpr (std::is_same<S, float>::value && std::is_same<D, half>::value) {
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
    using Eigen::internal::Packet8f;
    using Eigen::internal::pcast;
    using Eigen::internal::ploadu;
    using Eigen::internal::pstoreu;
    if constexpr (std::is_same<D, float>::value && std::is_same<S, bfloat16>::value) {
      for (; i + 8 <= n; i += 8)
        pstoreu(dst + i, pcast<Eigen::internal::Packet8bf, Packet8f>(
                             ploadu<Eigen::internal::Packet8bf>(src + i)));
    } else if constexpr (std::is_same<D, float>::value && std::is_same<S, half>::value) {
      for (; i + 8 <= n; i += 8)
        pstoreu(dst + i, pcast<Eigen::internal::Packet8h, Packet8f>(
                             ploadu<Eigen::internal::Packet8h>(src + i)));
    } else if constexpr (std::is_same<S, float>::value && std::is_same<D, bfloat16>::value) {
      for (; i + 8 <= n; i += 8)
        pstoreu(dst + i, pcast<Packet8f, Eigen::internal::Packet8bf>(ploadu<Packet8f>(src + i)));
    } else if constexpr (std::is_same<S, float>::value && std::is_same<D, half>::value) {
      for (; i + 8 <= n; i += 8)
        pstoreu(dst + i, pcast<Packet8f, Eigen::internal::Packet8h>(ploadu<Packet8f>(src + i)));
    }
#endif
    if constexpr (std::is_same<S, bfloat16>::value && std::is_same<D, float>::value) {
      // bfloat16 is the upper half of a float: a shift, which the compiler
      // vectorises on any target (Eigen's scalar conversion goes through memory).
      for (; i < n; ++i) {
        const std::uint32_t bits = static_cast<std::uint32_t>(src[i].value) << 16;
        std::memcpy(dst + i, &bits, sizeof bits);
      }
    }
    for (; i < n; ++i) dst[i] = static_cast<D>(src[i]);
  }
}

/// Eigen's packet of P bfloat16 or half values, which it converts to P
/// floats (AVX-512: 16 at a time, AVX: 8); void where the target has none.
template <class S, class Bf16Packet, class HalfPacket>
using narrow_packet_of =
    std::conditional_t<std::is_same<S, bfloat16>::value, Bf16Packet,
                       std::conditional_t<std::is_same<S, half>::value, HalfPacket, void>>;
template <class S, int P>
struct eigen_narrow_packet {
  using type = void;
};
#if defined(EIGEN_VECTORIZE_AVX512)
template <class S>
struct eigen_narrow_packet<S, 16> {
  using type = narrow_packet_of<S, Eigen::internal::Packet16bf, Eigen::internal::Packet16h>;
};
#endif
#if defined(EIGEN_VECTORIZE_AVX)
template <class S>
struct eigen_narrow_packet<S, 8> {
  using type = narrow_packet_of<S, Eigen::internal::Packet8bf, Eigen::internal::Packet8h>;
};
#endif

/// The packet of compute type at p (unaligned) from P values stored as S:
/// a plain load for S = C, Eigen's packet conversion from bfloat16 / half
/// where the target has one (AVX-512: 16 at a time, AVX: 8), element by
/// element otherwise. 8-bit rows (int8, float8_e4m3) widen in the units of
/// quant.hpp: their scale, times kv_unit<S>(), is the caller's to apply.
template <class Packet, class S>
inline Packet pload_widened(const S* p) {
  using C = typename Eigen::internal::unpacket_traits<Packet>::type;
  using Eigen::internal::pcast;
  using Eigen::internal::ploadu;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  if constexpr (std::is_same<S, C>::value) {
    return ploadu<Packet>(p);
  } else if constexpr (is_8bit_storage_v<S>) {
    return pload_widened_8bit<Packet>(p);  // in units (quant.hpp)
#if defined(__F16C__)
    // half: the F16C instructions, which Eigen 3.4 does not use under GCC
    // (EIGEN_HAS_FP16_C is left undefined there).
#if defined(EIGEN_VECTORIZE_AVX512)
  } else if constexpr (std::is_same<C, float>::value && P == 16 && std::is_same<S, half>::value) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(EIGEN_VECTORIZE_AVX)
  } else if constexpr (std::is_same<C, float>::value && P == 8 && std::is_same<S, half>::value) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  } else if constexpr (std::is_same<C, float>::value && P == 4 && std::is_same<S, half>::value) {
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
#if defined(EIGEN_VECTORIZE_SSE2) && !defined(EIGEN_VECTORIZE_AVX)
    // bfloat16 is the upper half of a float: interleave zeros below it.
  } else if constexpr (std::is_same<C, float>::value && P == 4 &&
                       std::is_same<S, bfloat16>::value) {
    return _mm_castsi128_ps(_mm_unpacklo_epi16(
        _mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  } else if constexpr (std::is_same<C, float>::value &&
                       !std::is_void<typename eigen_narrow_packet<S, P>::type>::value) {
    using Narrow = typename eigen_narrow_packet<S, P>::type;
    return pcast<Narrow, Packet>(ploadu<Narrow>(p));
  } else {
    alignas(64) C tmp[P];
    for (int i = 0; i < P; ++i) tmp[i] = static_cast<C>(p[i]);
    return Eigen::internal::pload<Packet>(tmp);
  }
}

/// A row of n values of S as compute type C: the row itself when S is C,
/// otherwise its conversion written to buf (n elements).
template <class C, class S>
inline const C* row_as(const S* row, index_t n, C* buf) {
  if constexpr (std::is_same<S, C>::value) {
    (void)n;
    (void)buf;
    return row;
  } else {
    convert_row(row, n, buf);
    return buf;
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
