// O = W V from bfloat16 storage with the CPU's bf16 dot products
// (AVX512-BF16's vdpbf16ps), the second product of the fused prefill kernel
// (attention_kernel.hpp, step 5), next to Q K^T in bf16_dot.hpp.
//
// Why: with Q K^T on bf16 dot products, the float W V product (values widened
// to float panels, one FMA per weight and value) is half of a bf16 prefill's
// multiply-adds at float speed. Here W is rounded to bf16 once per element,
// as FlashAttention rounds P to the input type before P V, and one vdpbf16ps
// adds the contributions of two keys to a float accumulator. Used only where
// Q K^T runs on bf16 dot products (use_bf16_dot: q, k and v stored as
// bfloat16, a build for AVX512-BF16); every other storage type and target
// keeps the float product, bit for bit.
//
// Layout. The key axis is taken in pairs, one pair per 32-bit word (key 2t
// in the low half, 2t + 1 in the high half), counted from an even key (the
// packed range starts at a multiple of kNR). Values are packed in column
// panels of kNR features like the float ones (gemm.hpp, pack_cols_from), with
// a pair of keys as the row: panel c holds
//   dst[c * pairs * kNR + t * kNR + cc] = (v[2t][c kNR + cc], v[2t + 1][c kNR + cc]),
// zero beyond the features and for the key after an odd count. A row of W is
// rounded into words the same way (a bf16 array of the row, read as words),
// so micro_kernel_bf16's 6 x 32 tile and loop serve W V unchanged: A = W pairs
// (one broadcast word per row and step), B = a value panel (32 words per
// step), C the float output block, accumulated.
//
// Accuracy. Products of two bf16 are exact in float and vdpbf16ps adds them
// to the float accumulator with rounding to nearest even, so the product is a
// float sum of exact products (the float bound on the accumulation holds as
// for the float kernel's sum of rounded products), of the weights
// w^_ij = bf16(w_ij), |w^_ij - w_ij| <= 2^-8 |w_ij| (rounding to nearest even
// to 8 significand bits). The rounding of the weights adds at most
//   |sum_j (w^_ij - w_ij) v_jc| <= 2^-8 sum_j |w_ij| |v_jc|
// to output element (i, c), on top of the float kernel's error and before the
// output's own rounding to bfloat16. For plain attention sum_j |w_ij| |v_jc|
// <= max_j |v_jc|; for W = A1 - lambda A2 it is at most (1 + |lambda|)
// max_j |v_jc|, which can be well above |o_ic| where the maps cancel. The
// conversion and the instruction treat denormal weights (|w| < 2^-126) and
// products as zero: each such weight moves an output by less than 2^-126 |v|.
//
// Keys a row sees only in part of a register tile (the band's edges) and a
// single key left over at an odd edge are added row by row in float, with the
// unrounded weight and the exactly widened value, as the float path does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "../../config.hpp"
#include "../../types.hpp"
#include "bf16_dot.hpp"
#include "gemm.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// True when O = W V over values stored as KV (queries as T) runs on bf16
/// dot products: exactly where Q K^T does.
template <class T, class KV>
constexpr bool use_bf16_wv = use_bf16_dot<T, KV>;

/// Packs the values of keys [0, rows), row r at row_of(r), of `width`
/// features into column panels of kNR features with pairs of keys as rows
/// (see the top): panel c at dst + c * bf16_pairs(rows) * kNR. Each element
/// is copied bit for bit.
template <class Rows>
inline void pack_value_pairs_from(const Rows& row_of, index_t rows, index_t width,
                                  std::uint32_t* dst) {
  constexpr index_t nr = TileConfig<float>::kNR;
  const index_t pairs = bf16_pairs(rows), panels = round_up(width, nr) / nr;
  for (index_t c = 0; c < panels; ++c) {
    std::uint32_t* panel = dst + c * pairs * nr;
    const index_t c0 = c * nr, n = std::min(nr, width - c0);
    for (index_t t = 0; t < pairs; ++t) {
      const index_t r = 2 * t;
      const bfloat16* lo = row_of(r) + c0;
      const bfloat16* hi = r + 1 < rows ? row_of(r + 1) + c0 : nullptr;
      if (r + 2 + kPrefetchRows < rows) {
        prefetch_row(row_of(r + kPrefetchRows) + c0, n);
        prefetch_row(row_of(r + 1 + kPrefetchRows) + c0, n);
      }
      std::uint32_t* out = panel + t * nr;
      if (n == nr && hi) {  // a whole panel row of two keys: a fixed-size loop
        for (index_t cc = 0; cc < nr; ++cc)
          out[cc] = std::uint32_t(lo[cc].value) | std::uint32_t(hi[cc].value) << 16;
      } else {
        for (index_t cc = 0; cc < nr; ++cc) {
          const std::uint32_t l = cc < n ? lo[cc].value : 0u;
          const std::uint32_t h = cc < n && hi ? hi[cc].value : 0u;
          out[cc] = l | h << 16;
        }
      }
    }
  }
}

/// The value of key j (within the packed pairs, j >= 0) and feature col
/// (< the panels' width) of pack_value_pairs_from's output, widened exactly
/// to float.
inline float value_from_pairs(const std::uint32_t* panels, index_t pairs, index_t j, index_t col) {
  constexpr index_t nr = TileConfig<float>::kNR;
  const std::uint32_t w = panels[(col / nr) * pairs * nr + (j / 2) * nr + col % nr];
  const std::uint32_t bits = (j % 2 == 0 ? w << 16 : w) & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// out[0:kNR] += w * (key j of a panel of pack_value_pairs_from's output,
/// widened exactly to float): one key's values, added row by row at the band's
/// edges. A fixed-size loop the compiler vectorises.
inline void add_value_pair_row(const std::uint32_t* panel, index_t j, float w, float* out) {
  constexpr index_t nr = TileConfig<float>::kNR;
  const std::uint32_t* words = panel + (j / 2) * nr;
  const int shift = j % 2 == 0 ? 16 : 0;  // key 2t in the low half
  for (index_t c = 0; c < nr; ++c) {
    const std::uint32_t bits = (words[c] << shift) & 0xffff0000u;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    out[c] += w * f;
  }
}

/// dst[t] for t in [t0, t1): the weights w[2t] and w[2t + 1] rounded to bf16
/// (nearest even; denormals to zero) as one word, key 2t in the low half.
/// Defined only for AVX512-BF16 targets, called only where use_bf16_wv holds.
inline void round_weight_pairs(const float* w, index_t t0, index_t t1, std::uint32_t* dst);

/// C[r, 0:32] += sum_t A[r, t] . B[t, 0:32] for r < 6 over `pairs` words:
/// micro_kernel_bf16's tile and loop, added to C (an output block).
/// Defined only for AVX512-BF16 targets, called only where use_bf16_wv holds.
inline void micro_kernel_bf16_add(index_t pairs, const std::uint32_t* a, index_t lda,
                                  const std::uint32_t* b, float* c, index_t ldc);

#if defined(__AVX512BF16__)
inline void round_weight_pairs(const float* w, index_t t0, index_t t1, std::uint32_t* dst) {
  index_t t = t0;
  // _mm512_cvtne2ps_pbh(a, b): elements 0-15 from b, 16-31 from a, so the 32
  // bf16 are the floats in order, and word t holds keys 2t (low), 2t + 1.
  for (; t + 16 <= t1; t += 16) {
    const __m512 lo = _mm512_loadu_ps(w + 2 * t), hi = _mm512_loadu_ps(w + 2 * t + 16);
    _mm512_storeu_si512(dst + t, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  if (t < t1) {
    const int n = static_cast<int>(2 * (t1 - t));  // floats left, 2 to 30
    const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::min(n, 16)) - 1),
                                            w + 2 * t);
    const __m512 hi =
        n > 16 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - 16)) - 1), w + 2 * t + 16)
               : _mm512_setzero_ps();
    _mm512_mask_storeu_epi32(dst + t, static_cast<__mmask16>((1u << (n / 2)) - 1),
                             (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

inline void micro_kernel_bf16_add(index_t pairs, const std::uint32_t* a, index_t lda,
                                  const std::uint32_t* b, float* c, index_t ldc) {
  micro_kernel_bf16_tile<true>(pairs, a, lda, b, c, ldc, 1.0f);
}
#endif

}  // namespace detail
DIFFATTN_END_NAMESPACE
