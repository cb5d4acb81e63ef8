/// \file
/// Mergeable softmax states: the (o, lse) summary of one softmax map over a
/// subset of the keys, and their exact merge. Split-KV decoding and context
/// parallelism (ring attention) are built from them.
#pragma once

#include <cmath>
#include <limits>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/parallel.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

namespace detail {

/// Weight of a state with log-sum-exp l against the running maximum m (l <= m):
/// exp(l - m), exactly 1 when l == m (so that two +inf states do not make
/// NaN) and 0 for an empty state (l = -inf).
template <class T>
inline T state_weight(T l, T m) {
  return l == m ? T(1) : std::exp(l - m);
}

/// Merges state b into state a for one row: a's output o (dv values) and
/// log-sum-exp la. Returns the merged lse; o is rewritten in place.
template <class T>
inline T merge_row(T* o, T la, const T* ob, T lb, index_t dv) {
  constexpr T ninf = -std::numeric_limits<T>::infinity();
  if (std::isnan(la) || std::isnan(lb)) {
    for (index_t c = 0; c < dv; ++c) o[c] = std::numeric_limits<T>::quiet_NaN();
    return std::numeric_limits<T>::quiet_NaN();
  }
  if (lb == ninf) return la;  // b holds no visible key: a as it is
  if (la == ninf) {           // a holds none: b
    for (index_t c = 0; c < dv; ++c) o[c] = ob[c];
    return lb;
  }
  const T m = la > lb ? la : lb;
  const T wa = state_weight(la, m), wb = state_weight(lb, m), s = wa + wb;
  const T ca = wa / s, cb = wb / s;
  for (index_t c = 0; c < dv; ++c) o[c] = ca * o[c] + cb * ob[c];
  return m + std::log(s);
}

}  // namespace detail

/// \defgroup states Mergeable softmax states
///
/// A softmax map over a subset of the keys is summarised by (o, lse): o the
/// output normalised over those keys, lse = log sum exp of the scaled, masked
/// scores over them (natural log, -inf when the subset holds no visible key).
/// The plain `attention` kernel's (out, lse) over a slice of the keys is such
/// a state; for the differential kernels, each map's state is the plain
/// kernel's on that map's query and key heads (see DESIGN: the subtraction of
/// lambda comes after the last merge). Two states of one map over disjoint
/// subsets merge exactly:
///   lse = logaddexp(lse_a, lse_b),
///   o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b,
/// computed against the larger lse, so it never overflows, and two empty
/// states (-inf) give an empty state (o unchanged, lse -inf), never NaN.
/// @{

/// a <- merge(a, b) in place, row by row.
///
///   o_a, o_b (B, N, Hq, dv), lse_a, lse_b (B, Hq, N)
///
/// The result does not depend on the thread count (each row is merged by one
/// thread, the same way). Merging is commutative up to rounding and exact in
/// exact arithmetic; merge in a fixed order for reproducible results. Throws
/// diffattn::error for mismatched shapes, a non-contiguous last dimension, or
/// b overlapping a.
template <class T>
void merge_states(detail::nondeduced_view<T, 4> o_a, detail::nondeduced_view<T, 3> lse_a,
                  detail::nondeduced_view<const T, 4> o_b,
                  detail::nondeduced_view<const T, 3> lse_b, int num_threads = 0) {
  constexpr const char* fn = "merge_states";
  detail::check_head_contiguous(fn, "o_a", o_a);
  detail::check_head_contiguous(fn, "o_b", o_b);
  if (o_b.shape() != o_a.shape())
    detail::fail(fn, "o_b has shape ", detail::shape_str(o_b.shape()), ", expected o_a's ",
                 detail::shape_str(o_a.shape()));
  const std::array<index_t, 3> ls = {o_a.shape(0), o_a.shape(2), o_a.shape(1)};
  detail::check_shape(fn, "lse_a", lse_a, ls, "(B, Hq, N) of o_a");
  detail::check_shape(fn, "lse_b", lse_b, ls, "(B, Hq, N) of o_a");
  if (num_threads < 0) detail::fail(fn, "num_threads must be >= 0, got ", num_threads);
  if (detail::ranges_overlap(o_a, o_b) || detail::ranges_overlap(o_a, lse_b) ||
      detail::ranges_overlap(lse_a, o_b) || detail::ranges_overlap(lse_a, lse_b) ||
      detail::ranges_overlap(o_a, lse_a))
    detail::fail(fn, "the states overlap in memory: o_a ", detail::shape_str(o_a.shape()),
                 ", lse_a ", detail::shape_str(lse_a.shape()));
  const index_t B = o_a.shape(0), N = o_a.shape(1), H = o_a.shape(2), dv = o_a.shape(3);
  const index_t tasks = B * H;
  detail::parallel_tasks(
      tasks, detail::resolve_threads(num_threads, tasks),
      [&](index_t t) {
        const index_t b = t / H, h = t % H;
        for (index_t i = 0; i < N; ++i)
          lse_a(b, h, i) =
              detail::merge_row<T>(dv > 0 ? &o_a(b, i, h, 0) : nullptr, lse_a(b, h, i),
                                   dv > 0 ? &o_b(b, i, h, 0) : nullptr, lse_b(b, h, i), dv);
      },
      [] {});
}

/// @}

DIFFATTN_END_NAMESPACE
