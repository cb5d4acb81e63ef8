// The causal mask, aligned bottom-right.
//
// Query i of seqlen_q sees key j of seqlen_k iff j <= i + (seqlen_k - seqlen_q):
// the last query always sees every key, which is what decoding against a KV
// cache (seqlen_q < seqlen_k) needs. For seqlen_q = 3, seqlen_k = 5
// (1 = keep, 0 = masked):
//     1 1 1 0 0
//     1 1 1 1 0
//     1 1 1 1 1
// When seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see no key at all
// and give zeros.
#pragma once

#include <algorithm>

#include "../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// True when query i may attend to key j under the causal rule.
constexpr bool causal_visible(index_t i, index_t j, index_t seqlen_q, index_t seqlen_k) noexcept {
  return j <= i + (seqlen_k - seqlen_q);
}

/// Number of keys row i sees: the visible keys are always the prefix [0, end).
inline index_t causal_key_end(index_t i, index_t seqlen_q, index_t seqlen_k) noexcept {
  return std::min(seqlen_k, std::max<index_t>(0, i + (seqlen_k - seqlen_q) + 1));
}

/// Keys visible to row i, with or without the causal mask.
inline index_t key_end(bool causal, index_t i, index_t seqlen_q, index_t seqlen_k) noexcept {
  return causal ? causal_key_end(i, seqlen_q, seqlen_k) : seqlen_k;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
