/// \file
/// Fused multi-head attention kernels: differential V1 and V2, and plain softmax
/// attention. None of them forms an N x M matrix.
#pragma once

#include "config.hpp"
#include "detail/core/validate.hpp"
#include "detail/kernel/attention_kernel.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \defgroup kernels Fused attention kernels
///
/// Common contract of every kernel below.
///
/// - Views: every tensor is a strided view; only the last (head) dimension must
///   be contiguous (stride 1). (B, N, H, D) tensors, (B, H, N, D) memory seen
///   through strides, and slices of a larger KV cache all pass without a copy.
/// - Causal alignment is bottom-right: query i of N sees key j of M iff
///   j <= i + (M - N). For N = 3, M = 5 (1 keep, 0 mask):
///       1 1 1 0 0
///       1 1 1 1 0
///       1 1 1 1 1
///   so decoding one new token (N = 1) against a cache of M keys sees them all.
///   A query row with no visible key (N > M, causal) gives zeros and lse -inf.
/// - Scale: options.scale, or 1/sqrt(d) when it is 0, d the query/key width.
/// - Extra memory is O(kBlockM x M) per thread (one block of queries against the
///   keys it sees), never O(N x M).
/// - Zero-sized B, N or M are allowed: nothing to compute, or (M = 0) zero
///   output rows. Head counts and widths must be >= 1.
/// - lse (optional, pass an empty view to skip): (B, Hq, N) log-sum-exp of the
///   scaled, masked scores of each query head's softmax map, Hq the number of
///   query heads (2H for the differential kernels: map 1 of DIFF head h is query
///   head 2h, map 2 is 2h + 1). The backward pass needs it.
/// - Threads over (batch, head, query block); options.num_threads sets the
///   count. Each output element is computed by one thread in a fixed order, so
///   results are bitwise identical for any thread count. Safe to call from
///   several caller threads at once.
/// - Every argument is checked once, here; bad input throws diffattn::error
///   naming the function, the argument and the shapes. out and lse must not
///   overlap any input (their address ranges must be disjoint).
/// - Storage T: float, double, bfloat16 or half. 16-bit storage computes and
///   accumulates in float (compute_t<T>): lambda, the scale and lse are float
///   then, inputs are widened once where they are packed and the output is
///   rounded once to T.
/// @{

/// Differential attention, V1 split-head layout (Ye et al., ICLR 2025).
///
///   q (B, N, 2H, d)    heads 2h and 2h+1 are the two halves of DIFF head h
///   k (B, M, 2Hkv, d)  paired the same way
///   v (B, M, Hkv, 2d)  values twice as wide
///   out (B, N, H, 2d)
///
/// DIFF head h reads kv pair g = h / (H / Hkv) (H % Hkv == 0): map 1 uses key
/// head 2g, map 2 key head 2g+1, both the value head g:
///   out[b, :, h] = (softmax(s q_2h k_2g^T) - lambda softmax(s q_2h+1 k_2g+1^T)) v_g
/// Each V tile is read once for both maps.
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_t<compute_t<T>> lambda, detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options = {}) {
  const detail::AttentionProblem<T> p =
      detail::validate_v1<T>(q, k, v, &lambda, nullptr, out, lse, options);
  detail::run_attention(p, options);
}

/// V1 with one lambda for the layer, without the lse output.
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_t<compute_t<T>> lambda, detail::nondeduced_view<T, 4> out,
                       const AttentionOptions& options = {}) {
  diff_attention_v1<T>(q, k, v, lambda, out, TensorView<compute_t<T>, 3>(), options);
}

/// V1 with one lambda per DIFF head: lambda (H).
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const compute_t<T>, 1> lambda,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options = {}) {
  const detail::AttentionProblem<T> p =
      detail::validate_v1<T>(q, k, v, nullptr, &lambda, out, lse, options);
  detail::run_attention(p, options);
}

/// V1 with one lambda per DIFF head, without the lse output.
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const compute_t<T>, 1> lambda,
                       detail::nondeduced_view<T, 4> out, const AttentionOptions& options = {}) {
  diff_attention_v1<T>(q, k, v, lambda, out, TensorView<compute_t<T>, 3>(), options);
}

/// Differential attention, V2 layout (doubled query heads).
///
///   q (B, N, 2H, d)       heads 2h and 2h+1 form DIFF head h
///   k, v (B, M, Hkv, d)   the baseline's head width
///   lambda_logit (B, N, H) lambda = sigmoid(lambda_logit), per token and head
///   out (B, N, H, d)
///
/// Query head j reads kv head j / (2H / Hkv); 2H % Hkv == 0 and the group size
/// 2H / Hkv must be even so that a pair never straddles two groups. Both maps
/// of a DIFF head read the same k and v, loaded once:
///   out[b, i, h] = (A_2h - sigmoid(lambda_logit[b, i, h]) A_2h+1)[i] v_g
template <class T>
void diff_attention_v2(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options = {}) {
  const detail::AttentionProblem<T> p =
      detail::validate_v2<T>(q, k, v, lambda_logit, out, lse, options);
  detail::run_attention(p, options);
}

/// V2 without the lse output.
template <class T>
void diff_attention_v2(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out, const AttentionOptions& options = {}) {
  diff_attention_v2<T>(q, k, v, lambda_logit, out, TensorView<compute_t<T>, 3>(), options);
}

/// Plain softmax attention with GQA, the baseline:
///
///   q (B, N, Hq, d), k (B, M, Hkv, d), v (B, M, Hkv, dv), out (B, N, Hq, dv)
///
/// Query head j reads kv head j / (Hq / Hkv), Hq % Hkv == 0.
template <class T>
void attention(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
               detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<T, 4> out,
               detail::nondeduced_view<compute_t<T>, 3> lse, const AttentionOptions& options = {}) {
  const detail::AttentionProblem<T> p = detail::validate_plain<T>(q, k, v, out, lse, options);
  detail::run_attention(p, options);
}

/// Plain attention without the lse output.
template <class T>
void attention(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
               detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<T, 4> out,
               const AttentionOptions& options = {}) {
  attention<T>(q, k, v, out, TensorView<compute_t<T>, 3>(), options);
}

/// \name With a user score functor
/// The kernels above with a functor `mod` (NoScoreMod in options.hpp lists its
/// optional members): score(s, b, h, i, j) replaces each score after the
/// softcap and ALiBi, visible(b, h, i, j) = false masks a pair, h the query
/// head (2h and 2h + 1 for the maps of DIFF head h), i and j the query and key
/// within the sequence. The functor is inlined into the kernel, compiled in the
/// caller's translation unit (also under diffattn::dispatch, which cannot run
/// a user's type). Each query block's keys are narrowed to those `visible`
/// leaves it (score_mods.hpp, clamp_rows): whole key ranges that no row of
/// the block sees cost only the functor's evaluations; with visible_range
/// each row is narrowed to its range and visible is never called (one call
/// per row instead of one per pair). Decoding steps (fewer than 6 queries)
/// call it in the decoding kernel, on each row's keys of each split-KV chunk.
/// A NaN from score makes its row NaN, as a NaN input does.
/// @{

/// diff_attention_v1 (one lambda) with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_t<compute_t<T>> lambda, detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options, const Mod& mod) {
  const detail::AttentionProblem<T> p =
      detail::validate_v1<T>(q, k, v, &lambda, nullptr, out, lse, options);
  detail::run_attention(p, options, mod);
}
/// diff_attention_v1 (lambda per DIFF head, (H)) with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const compute_t<T>, 1> lambda,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options, const Mod& mod) {
  const detail::AttentionProblem<T> p =
      detail::validate_v1<T>(q, k, v, nullptr, &lambda, out, lse, options);
  detail::run_attention(p, options, mod);
}
/// diff_attention_v2 with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v2(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse,
                       const AttentionOptions& options, const Mod& mod) {
  const detail::AttentionProblem<T> p =
      detail::validate_v2<T>(q, k, v, lambda_logit, out, lse, options);
  detail::run_attention(p, options, mod);
}
/// attention (plain softmax) with a user score functor `mod`.
template <class T, class Mod>
void attention(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
               detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<T, 4> out,
               detail::nondeduced_view<compute_t<T>, 3> lse, const AttentionOptions& options,
               const Mod& mod) {
  const detail::AttentionProblem<T> p = detail::validate_plain<T>(q, k, v, out, lse, options);
  detail::run_attention(p, options, mod);
}
/// @}

/// @}

DIFFATTN_END_NAMESPACE
