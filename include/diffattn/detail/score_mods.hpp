// Run-time score modifiers (AttentionOptions::softcap, alibi_slopes, sinks)
// on one row of scores, shared by the fused forward, the decoding step and
// the backward.
//
// The kernels keep a block's score rows in memory between the products and
// the softmax, so the modifiers are applied there, row by row, in one pass over
// the row: no kernel is instantiated once per modifier, and a call without
// modifiers never reaches this code (the kernels test
// AttentionProblem::modified once per row, before the softmax).
#pragma once

#include <cmath>
#include <cstdlib>
#include <limits>

#include <Eigen/Core>

#include "../config.hpp"
#include "validate.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The modifiers of one query head in the compute type C.
template <class C>
struct RowMods {
  C cap = C(0);                                    // softcap, 0: none
  C slope = C(0);                                  // ALiBi slope, 0: none
  C sink = -std::numeric_limits<C>::infinity();    // sink logit
  bool has_sink = false;
};

template <class T, class KV>
RowMods<compute_t<T>> row_mods(const AttentionProblem<T, KV>& p, index_t qh) {
  using C = compute_t<T>;
  RowMods<C> r;
  r.cap = p.softcap;
  if (!p.alibi_slopes.empty()) r.slope = static_cast<C>(p.alibi_slopes(qh));
  if (!p.sinks.empty()) {
    r.sink = static_cast<C>(p.sinks(qh));
    r.has_sink = true;
  }
  return r;
}

/// Soft-capping then ALiBi on the n scores w of keys kb .. kb + n - 1 of a
/// query whose diagonal (i + M - N) is `diag`: w_t = cap tanh(w_t / cap) -
/// slope |diag - (kb + t)|. When `tanh_out` is given it receives
/// tanh(w_t / cap) (the backward's derivative 1 - tanh^2).
template <class C>
void modify_scores(C* w, index_t n, const RowMods<C>& rm, index_t diag, index_t kb,
                   C* tanh_out = nullptr) {
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  if (n <= 0) return;
  if (rm.cap > C(0)) {
    ArrayMap a(w, n);
    if (tanh_out) {
      ArrayMap t(tanh_out, n);
      t = (a / rm.cap).tanh();
      a = rm.cap * t;
    } else {
      a = rm.cap * (a / rm.cap).tanh();
    }
  }
  if (rm.slope != C(0)) {
    const index_t c = diag - kb;
    for (index_t t = 0; t < n; ++t) w[t] -= rm.slope * static_cast<C>(std::abs(c - t));
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
