// The backward's three gradient products on bf16 dot products (bfloat16
// storage under AVX512-BF16), next to S = Q K^T and dW = dO V^T, which run on
// them as in the forward (bf16_dot.hpp).
//
// Why: dQ = dS K, dK = dS^T Q and dV = W^T dO take the float dS and W; on the
// float micro-kernel they are three of the backward's five products at float
// speed, so bfloat16 gradients cost nearly what float ones do. As
// FlashAttention rounds dS and P to the input type before these products,
// dS_m and W are rounded to bf16 once per element here, and one vdpbf16ps adds
// two terms of the sum to a float accumulator.
//
// Layouts (a word is a pair of bf16, element 2t in the low half):
//  - dQ = dS K: A = a row of dS rounded to bf16 (pairs of keys along the row,
//    round_weight_pairs of bf16_wv.hpp), B = K packed as W V packs values
//    (pack_value_pairs_from: column panels of 32 features, a pair of keys per
//    step). The depth, keys, starts at an even key.
//  - dK^T = Q^T dS and dV^T = dO^T W: the depth is the block's query rows, in
//    pairs. A = Q^T (or dO^T) with pairs of rows along each feature row
//    (pack_row_pairs_transposed), B = dS (or W) rounded to bf16 into panels
//    of 32 keys with a pair of rows per step (round_row_pair_panels).
//  The queries stay unscaled (exact bf16); dK takes the scale s once, on the
//  float accumulator, as dQ does.
//
// Accuracy. Products of two bf16 are exact in float and the instruction adds
// them rounding to nearest even: every product is a float sum of exact terms,
// as on the float path, except that each element of dS_m and W is rounded
// once, relative 2^-8 (nearest even to 8 significand bits; denormals, below
// 2^-126, to zero). That adds at most
//   dQ_ic: 2^-8 s sum_j |dS_ij| |k_jc|,   dK_jc: 2^-8 s sum_i |dS_ij| |q_ic|,
//   dV_jc: 2^-8 sum_i |w_ij| |do_ic|
// (summed over the maps and the query heads a key or value head serves) to
// each gradient element before its own rounding to bfloat16. dS's rows sum to
// about zero (sum_j A_ij (dW_ij - D_i) = 0), so these sums can be far above
// |dQ_ic|: the bound is elementwise (tests/test_half_backward.cpp).
// dlambda and V2's dlambda_logit come from the float W, A and dW, unchanged.
#pragma once

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "../../config.hpp"
#include "../../types.hpp"
#include "../kernel/bf16_dot.hpp"
#include "../kernel/tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// dst[t * ld + p] for t < width_pad and p < ld: the pair (row 2p, row 2p + 1)
/// of feature t, rows from row_of(r) for r < rows (bf16, copied bit for bit),
/// zero for rows >= rows and for t >= width. ld >= bf16_pairs(rows).
template <class Rows>
inline void pack_row_pairs_transposed(const Rows& row_of, index_t rows, index_t width,
                                      index_t width_pad, index_t ld, std::uint32_t* dst) {
  for (index_t t = 0; t < width_pad * ld; ++t) dst[t] = 0u;
  for (index_t p = 0; 2 * p < rows; ++p) {
    const bfloat16* lo = row_of(2 * p);
    const bfloat16* hi = 2 * p + 1 < rows ? row_of(2 * p + 1) : nullptr;
    std::uint32_t* col = dst + p;
    if (hi) {
      for (index_t t = 0; t < width; ++t)
        col[t * ld] = std::uint32_t(lo[t].value) | std::uint32_t(hi[t].value) << 16;
    } else {
      for (index_t t = 0; t < width; ++t) col[t * ld] = std::uint32_t(lo[t].value);
    }
  }
}

/// Rounds the float block s (row r at s + r * lds, rows 2 pairs rows, the
/// rows past the caller's zero) to bf16 into panels of kNR columns with a pair
/// of rows per step: panel c at dst + c * pairs * kNR holds
///   dst[c * pairs * kNR + p * kNR + cc] = (s[2p][c kNR + cc], s[2p + 1][c kNR + cc]),
/// for the `cols` columns (a multiple of kNR). Row 2 pairs - 1 must be
/// readable (the caller pads the block to an even row count). Defined only
/// for AVX512-BF16 targets, called only where use_bf16_dot holds.
inline void round_row_pair_panels(const float* s, index_t lds, index_t pairs, index_t cols,
                                  std::uint32_t* dst);

#if defined(__AVX512BF16__)
inline void round_row_pair_panels(const float* s, index_t lds, index_t pairs, index_t cols,
                                  std::uint32_t* dst) {
  constexpr index_t nr = TileConfig<float>::kNR;
  static_assert(nr == 32, "two 16-float halves per panel row");
  // _mm512_cvtne2ps_pbh(b, a): bf16 elements 0-15 from a (row 2p), 16-31 from
  // b (row 2p + 1); the permutation interleaves them into 16 words.
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (index_t c0 = 0; c0 < cols; c0 += nr) {
    std::uint32_t* panel = dst + c0 * pairs;
    for (index_t p = 0; p < pairs; ++p) {
      const float* lo = s + 2 * p * lds + c0;
      const float* hi = lo + lds;
      for (index_t h = 0; h < nr; h += 16) {
        const __m512i x =
            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi + h), _mm512_loadu_ps(lo + h));
        _mm512_storeu_si512(panel + p * nr + h, _mm512_permutexvar_epi16(interleave, x));
      }
    }
  }
}
#endif

}  // namespace detail
DIFFATTN_END_NAMESPACE
