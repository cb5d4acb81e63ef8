// S = Q K^T from bfloat16 storage with the CPU's bf16 dot products
// (AVX512-BF16's vdpbf16ps: Zen 4, Sapphire Rapids and later).
//
// Why: on the float path 16-bit queries and keys are widened when packed and
// the product runs on float FMAs, so bfloat16 prefill costs what float does.
// vdpbf16ps takes two bf16 per float lane and adds both products to a float
// accumulator: twice the multiply-adds per instruction, and key panels of half
// the bytes. It is used only when q and k are both stored as bfloat16 and the
// build targets AVX512-BF16 (-march=native on such a CPU); everything else
// (other types, decoding steps) keeps the float path; W V of bfloat16
// values runs on the same instruction (bf16_wv.hpp).
//
// Layout. Depth is taken in pairs of bf16, one pair per 32-bit word (element
// 2t in the low half, 2t + 1 in the high half); an odd depth is padded with a
// zero, exact on both sides. Queries are (rows, pairs) words, read one word
// (a broadcast of two bf16) per row and step; keys are packed like the float
// panels of gemm.hpp with the word as element: panel p holds
// dst[p * pairs * kNR + t * kNR + c] = pair t of key p kNR + c.
//
// Accuracy. The queries stay unscaled (exact bf16) and the scale s is applied
// once to each float score, so every input of the product is exact. Products
// of two bf16 (8-bit significands) are exact in float; vdpbf16ps adds them to
// the accumulator rounding to nearest even, so a score is a float sum of the d
// exact products in another order than the float path's, times s: the float
// accumulation bound |s^ - s| <= (gamma_d + u_f) s sum_t |q_t k_t| still
// holds. The instruction treats bf16 denormal inputs as zero and flushes
// denormal results: each moves a score by less than 2^-126 (about 1.2e-38)
// times s and the other factor, i.e. only scores (or terms) around 1e-38 and
// below, invisible after the softmax. q.k is formed before the scale, so it
// overflows float a factor 1/s (8 at d = 64) earlier than the float path's
// (s q).k, at |q.k| > 3.4e38.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "../../config.hpp"
#include "../../types.hpp"
#include "gemm.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The target has bf16 dot products, the float kernel's 6 x 32 register
/// tile of 16-float packets, and the build takes them (DIFFATTN_BF16_DOT,
/// config.hpp: not where the target has AMX, whose vdpbf16ps is slower than
/// float FMAs).
#if defined(__AVX512BF16__) && DIFFATTN_BF16_DOT
constexpr bool kHasBf16Dot = TileConfig<float>::kPacket == 16;
#else
constexpr bool kHasBf16Dot = false;
#endif
/// True when S = Q K^T of q stored as T over keys stored as KV runs on bf16
/// dot products.
template <class T, class KV>
constexpr bool use_bf16_dot = (kHasBf16Dot && std::is_same<std::remove_cv_t<T>, bfloat16>::value &&
                               std::is_same<std::remove_cv_t<KV>, bfloat16>::value);

/// Words of bf16 pairs holding a depth of d.
constexpr index_t bf16_pairs(index_t d) noexcept { return (d + 1) / 2; }

/// One word from elements 2t and 2t + 1 (zero beyond d) of a bf16 row.
inline std::uint32_t bf16_pair(const bfloat16* row, index_t t, index_t d) noexcept {
  const std::uint32_t lo = row[2 * t].value;
  const std::uint32_t hi = 2 * t + 1 < d ? row[2 * t + 1].value : 0u;
  return lo | hi << 16;
}

/// A query row of depth d as bf16_pairs(d) words, unscaled.
inline void pack_query_pairs(const bfloat16* row, index_t d, std::uint32_t* dst) {
  for (index_t t = 0; t < bf16_pairs(d); ++t) dst[t] = bf16_pair(row, t, d);
}

/// pack_rows_transposed_from for bf16 rows of depth d: panels of kNR keys, one
/// word (a pair along the depth) per key and step; keys from `rows` up to the
/// next multiple of kNR are zero. Same row sources (strided, paged) as the
/// float packing.
template <class Rows>
inline void pack_pairs_transposed_from(const Rows& row_of, index_t rows, index_t d,
                                       std::uint32_t* dst) {
  constexpr index_t nr = TileConfig<float>::kNR;
  const index_t pairs = bf16_pairs(d), padded = round_up(rows, nr);
  for (index_t p0 = 0; p0 < padded; p0 += nr) {
    std::uint32_t* panel = dst + p0 * pairs;
    for (index_t c = 0; c < nr; ++c) {
      const index_t j = p0 + c;
      if (j < rows) {
        const bfloat16* row = row_of(j);
        if (j + kPrefetchRows < rows) prefetch_row(row_of(j + kPrefetchRows), d);
        for (index_t t = 0; t < pairs; ++t) panel[t * nr + c] = bf16_pair(row, t, d);
      } else {
        for (index_t t = 0; t < pairs; ++t) panel[t * nr + c] = 0u;
      }
    }
  }
}

/// C[r, 0:32] = scale * (A B)[r, 0:32]: defined only for AVX512-BF16 targets,
/// called only where use_bf16_dot holds.
inline void micro_kernel_bf16(index_t pairs, const std::uint32_t* a, index_t lda,
                              const std::uint32_t* b, float* c, index_t ldc, float scale);

#if defined(__AVX512BF16__)
/// bfloat16 pair dot products (`vdpbf16ps`): the ops of micro_kernel_bf16's
/// register tile, over words that each hold two bf16.
struct Bf16PairDot {
  static constexpr int kPacket = 16;
  static EIGEN_ALWAYS_INLINE __m512 zero() { return _mm512_setzero_ps(); }
  static EIGEN_ALWAYS_INLINE __m512bh load(const std::uint32_t* p) {
    return (__m512bh)_mm512_load_si512(p);
  }
  static EIGEN_ALWAYS_INLINE __m512bh bcast(std::uint32_t e) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(e));
  }
  static EIGEN_ALWAYS_INLINE __m512 madd(__m512bh x, __m512bh y, __m512 c) {
    return _mm512_dpbf16_ps(c, x, y);
  }
};

/// C[r, 0:32] = scale * sum_t A[r, t] . B[t, 0:32] for r < 6 (Accumulate:
/// C[r, 0:32] += that sum, scale unused), over `pairs` words: a row r at
/// a + r * lda (words), b a packed panel (32 words per step), c row r at
/// c + r * ldc. The float micro-kernel's tile and loop. Q K^T stores scaled
/// scores; W V (bf16_wv.hpp) adds to its output block.
template <bool Accumulate>
inline void micro_kernel_bf16_tile(index_t pairs, const std::uint32_t* a, index_t lda,
                                   const std::uint32_t* b, float* c, index_t ldc, float scale) {
  static_assert(TileConfig<float>::kMR == 6 && TileConfig<float>::kNR == 32,
                "the bf16 micro-kernel's register tile has 6 rows of two 16-float packets");
  const __m512 s = _mm512_set1_ps(scale);
  register_tile<Bf16PairDot>(pairs, a, lda, b, 32, [&](int r, __m512 c0, __m512 c1) {
    float* cr = c + r * ldc;
    if constexpr (Accumulate) {
      c0 = _mm512_add_ps(_mm512_loadu_ps(cr), c0);
      c1 = _mm512_add_ps(_mm512_loadu_ps(cr + 16), c1);
    } else {
      c0 = _mm512_mul_ps(c0, s);
      c1 = _mm512_mul_ps(c1, s);
    }
    _mm512_storeu_ps(cr, c0);
    _mm512_storeu_ps(cr + 16, c1);
  });
}

inline void micro_kernel_bf16(index_t pairs, const std::uint32_t* a, index_t lda,
                              const std::uint32_t* b, float* c, index_t ldc, float scale) {
  micro_kernel_bf16_tile<false>(pairs, a, lda, b, c, ldc, scale);
}
#endif

}  // namespace detail
DIFFATTN_END_NAMESPACE
