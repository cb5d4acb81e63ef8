// What one task of the fused kernels works on: the heads it reads and writes,
// the lambda of a row, and the band of keys each of its query rows sees.
#pragma once

#include <algorithm>

#include "../../config.hpp"
#include "../../lambda.hpp"
#include "../core/validate.hpp"
#include "mask.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Head indices of one output head.
struct HeadMap {
  index_t q[2];   // query head of each map
  index_t k[2];   // key head of each map
  index_t v;      // value head
  index_t group;  // kv group, the cache key of the packed keys
};

template <class T, class KV>
HeadMap head_map(const AttentionProblem<T, KV>& p, index_t oh) {
  const index_t g = oh / p.group;
  switch (p.kind) {
    case AttnKind::v1:
      return {{2 * oh, 2 * oh + 1}, {2 * g, 2 * g + 1}, g, g};
    case AttnKind::v2:
      return {{2 * oh, 2 * oh + 1}, {g, g}, g, g};
    default:
      return {{oh, oh}, {g, g}, g, g};
  }
}

/// The lambda of row i of output head oh, in the compute type (V2's logit is
/// stored as the queries are and widened before the sigmoid).
template <class T, class KV>
compute_t<T> row_lambda(const AttentionProblem<T, KV>& p, index_t b, index_t i, index_t oh) {
  using C = compute_t<T>;
  if (p.kind == AttnKind::v2) return lambda_sigmoid<C>(static_cast<C>(p.lambda_logit(b, i, oh)));
  if (!p.lambda_heads.empty()) return p.lambda_heads(oh);
  return p.lambda_scalar;
}

/// The rows of one task: a block of queries of one sequence and the band of
/// keys they see. Row ii (query i0 + ii of the sequence) sees keys
/// [begin(ii), end(ii)); both are non-decreasing in ii.
struct BlockRows {
  KeyBand band;
  index_t n, m;  // the sequence's query and key counts
  index_t i0;    // first query of the block
  index_t rows;  // queries in the block
  index_t begin(index_t ii) const { return band.begin(i0 + ii, n, m); }
  index_t end(index_t ii) const { return band.end(i0 + ii, n, m); }
  /// Number of keys row ii sees.
  index_t count(index_t ii) const { return std::max<index_t>(0, end(ii) - begin(ii)); }
};

}  // namespace detail
DIFFATTN_END_NAMESPACE
