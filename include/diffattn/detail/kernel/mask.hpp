// The visible band of a query row: causal and sliding-window masks, aligned
// bottom-right.
//
// With c = i + (seqlen_k - seqlen_q), the diagonal of query i, key j is visible
// iff c - left <= j <= c + right, where a limit of -1 drops that side (and
// causal is right = 0). The visible keys of a row are therefore one interval
// [begin(i), end(i)), and both ends are non-decreasing in i: a block of
// consecutive rows sees a band, and tiles outside it are skipped. For
// seqlen_q = 3, seqlen_k = 5, left = 1, right = 0 (1 = keep, 0 = masked):
//     0 1 1 0 0
//     0 0 1 1 0
//     0 0 0 1 1
// Plain causal (left = -1, right = 0) keeps the lower-left triangle:
//     1 1 1 0 0
//     1 1 1 1 0
//     1 1 1 1 1
// When seqlen_q > seqlen_k the first seqlen_q - seqlen_k causal rows see no key
// at all and give zeros.
#pragma once

#include <algorithm>

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// A resolved mask: window limits, -1 for no limit on that side.
struct KeyBand {
  index_t left = -1;   // keys at most `left` before the diagonal
  index_t right = -1;  // keys at most `right` after the diagonal (0: causal)

  /// First visible key of row i (0 <= begin <= seqlen_k).
  index_t begin(index_t i, index_t seqlen_q, index_t seqlen_k) const noexcept {
    if (left < 0) return 0;
    return std::min(seqlen_k, std::max<index_t>(0, i + (seqlen_k - seqlen_q) - left));
  }
  /// One past the last visible key of row i (0 <= end <= seqlen_k); the row
  /// sees nothing when end <= begin.
  index_t end(index_t i, index_t seqlen_q, index_t seqlen_k) const noexcept {
    if (right < 0) return seqlen_k;
    return std::min(seqlen_k, std::max<index_t>(0, i + (seqlen_k - seqlen_q) + right + 1));
  }
  /// Number of keys row i sees.
  index_t count(index_t i, index_t seqlen_q, index_t seqlen_k) const noexcept {
    return std::max<index_t>(0, end(i, seqlen_q, seqlen_k) - begin(i, seqlen_q, seqlen_k));
  }
  bool visible(index_t i, index_t j, index_t seqlen_q, index_t seqlen_k) const noexcept {
    return j >= begin(i, seqlen_q, seqlen_k) && j < end(i, seqlen_q, seqlen_k);
  }
};

/// The band of the options' fields: causal means right = 0.
inline KeyBand make_band(bool causal, index_t window_left, index_t window_right) noexcept {
  return KeyBand{window_left, causal ? 0 : window_right};
}

/// True when query i may attend to key j under the causal rule.
constexpr bool causal_visible(index_t i, index_t j, index_t seqlen_q, index_t seqlen_k) noexcept {
  return j <= i + (seqlen_k - seqlen_q);
}

/// Number of keys row i sees under the causal mask: the prefix [0, end).
inline index_t causal_key_end(index_t i, index_t seqlen_q, index_t seqlen_k) noexcept {
  return KeyBand{-1, 0}.end(i, seqlen_q, seqlen_k);
}

/// End of the keys visible to row i, with or without the causal mask.
inline index_t key_end(bool causal, index_t i, index_t seqlen_q, index_t seqlen_k) noexcept {
  return causal ? causal_key_end(i, seqlen_q, seqlen_k) : seqlen_k;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
