/// \file
/// Per-map softmax states of the differential kernels: each map of V1 and V2 is
/// a plain softmax map whose (o, lse) state the plain kernel gives on head-
/// strided views, so split-KV and context parallelism merge them with
/// merge_states and subtract lambda once, after the last merge.
#pragma once

#include <cmath>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/parallel.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "lambda.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \defgroup diff_states Per-map states of the differential kernels
///
/// The state of map m (0 or 1) of every DIFF head over a slice [a, b) of the
/// keys is the plain kernel's (out, lse) on map m's heads:
///
///   V1: attention(map_heads(q, m), map_heads(k[a:b], m), v[a:b], o_m, lse_m, opt)
///       q (B, N, 2H, d) -> (B, N, H, d), k (B, M, 2Hkv, d) -> (B, M, Hkv, d),
///       v (B, M, Hkv, 2d) as is; o_m (B, N, H, 2d), lse_m (B, H, N)
///   V2: attention(map_heads(q, m), k[a:b], v[a:b], o_m, lse_m, opt)
///       q (B, N, 2H, d) -> (B, N, H, d); o_m (B, N, H, dv), lse_m (B, H, N)
///
/// Plain GQA sends query head h of H to kv head h / (H / Hkv), which is the
/// differential kernels' rule for DIFF head h, so the heads match. A causal
/// mask over all M keys becomes window_right = M - b on the slice [a, b) (key
/// j of the slice is visible iff a + j <= i + M - N). States of one map over disjoint slices merge
/// with merge_states; diff_combine_v1 / _v2 then give the kernel's output.
/// lse_m of DIFF head h is the kernel's lse row 2h + m.
/// @{

/// Heads m, m + 2, m + 4, ... of a tensor whose heads come in pairs (V1's q
/// and k, V2's q): t (B, L, 2H, D) -> (B, L, H, D), no copy. m is 0 or 1.
template <class T>
TensorView<T, 4> map_heads(detail::nondeduced_view<T, 4> t, int m) {
  if (m != 0 && m != 1) detail::fail("map_heads", "map must be 0 or 1, got ", m);
  if (t.shape(2) % 2 != 0)
    detail::fail("map_heads", "t has shape ", detail::shape_str(t.shape()),
                 ": expected an even number of heads (pairs 2h, 2h + 1)");
  const index_t H = t.shape(2) / 2;
  T* base = H > 0 && t.shape(0) > 0 && t.shape(1) > 0 ? t.data() + m * t.stride(2) : t.data();
  return TensorView<T, 4>(base, {t.shape(0), t.shape(1), H, t.shape(3)},
                          {t.stride(0), t.stride(1), 2 * t.stride(2), t.stride(3)});
}

namespace detail {

template <class T, class Lambda>
void combine_states(const char* fn, TensorView<const T, 4> o1, TensorView<const T, 4> o2,
                    TensorView<T, 4> out, int num_threads, Lambda&& lambda) {
  check_head_contiguous(fn, "o1", o1);
  check_head_contiguous(fn, "o2", o2);
  check_head_contiguous(fn, "out", out);
  check_shape(fn, "o2", o2, o1.shape(), "o1's shape");
  check_shape(fn, "out", out, o1.shape(), "o1's shape");
  if (num_threads < 0) fail(fn, "num_threads must be >= 0, got ", num_threads);
  if (ranges_overlap(out, o1) && out.data() != o1.data())
    fail(fn, "out ", shape_str(out.shape()), " partly overlaps o1 in memory");
  if (ranges_overlap(out, o2)) fail(fn, "out ", shape_str(out.shape()), " overlaps o2 in memory");
  const index_t B = o1.shape(0), N = o1.shape(1), H = o1.shape(2), dv = o1.shape(3);
  const index_t tasks = B * H;
  parallel_tasks(
      tasks, resolve_threads(num_threads, tasks),
      [&](index_t t) {
        const index_t b = t / H, h = t % H;
        for (index_t i = 0; i < N; ++i) {
          const T l = lambda(b, i, h);
          for (index_t c = 0; c < dv; ++c) out(b, i, h, c) = o1(b, i, h, c) - l * o2(b, i, h, c);
        }
      },
      [] {});
}

}  // namespace detail

/// V1 output from merged per-map states: out = o1 - lambda o2.
///   o1, o2, out (B, N, H, 2d); out may be o1 itself.
template <class T>
void diff_combine_v1(detail::nondeduced_view<const T, 4> o1, detail::nondeduced_view<const T, 4> o2,
                     detail::nondeduced_t<T> lambda, detail::nondeduced_view<T, 4> out,
                     int num_threads = 0) {
  if (!std::isfinite(static_cast<double>(lambda)))
    detail::fail("diff_combine_v1", "lambda must be finite, got ", lambda);
  detail::combine_states<T>("diff_combine_v1", o1, o2, out, num_threads,
                            [&](index_t, index_t, index_t) { return lambda; });
}

/// V2 output from merged per-map states: out = o1 - sigmoid(lambda_logit) o2.
///   o1, o2, out (B, N, H, dv), lambda_logit (B, N, H); out may be o1 itself.
template <class T>
void diff_combine_v2(detail::nondeduced_view<const T, 4> o1, detail::nondeduced_view<const T, 4> o2,
                     detail::nondeduced_view<const T, 3> lambda_logit,
                     detail::nondeduced_view<T, 4> out, int num_threads = 0) {
  detail::check_shape("diff_combine_v2", "lambda_logit", lambda_logit,
                      {o1.shape(0), o1.shape(1), o1.shape(2)}, "(B, N, H) of o1");
  detail::combine_states<T>(
      "diff_combine_v2", o1, o2, out, num_threads,
      [&](index_t b, index_t i, index_t h) { return lambda_sigmoid<T>(lambda_logit(b, i, h)); });
}

/// @}

DIFFATTN_END_NAMESPACE
