/// \file
/// Backward pass of the fused kernels: gradients of q, k, v and lambda from the
/// forward's saved log-sum-exp, with no N x M buffer.
#pragma once

#include "config.hpp"
#include "detail/backward/attention_backward.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \defgroup backward Backward kernels
///
/// Each takes the forward's arguments, its output `out` and its `lse`
/// (B, Hq, N) (both as the forward wrote them), and dout (the shape of out),
/// and writes the gradients: dq, dk, dv have the shapes of q, k, v. Gradients
/// are overwritten, not accumulated. Scores are recomputed tile by tile from
/// lse; memory is O(kBlockM x M) per thread plus O(M d) per kv group.
/// Under GQA the gradient of a kv head sums over every query head that reads
/// it. Threads run over (batch, kv group), so results are bitwise identical
/// for any thread count. Checks and errors as in the forward kernels; no
/// gradient may overlap an input or another gradient.
///
/// Storage T: float, double, bfloat16 or half, as in the forward. 16-bit
/// storage computes and accumulates in float (compute_t<T>): q, k, v and dout
/// are widened where they are packed, dq, dk, dv (and V2's dlambda_logit) are
/// written as T, rounded once each; lse, lambda, dlambda and dsinks are float
/// (docs/storage.md).
///
/// Score modifiers (options.softcap, alibi_slopes, sinks) must be those of the
/// forward call. The last argument, dsinks (Hq), optional, receives the
/// gradient of options.sinks summed over batch and rows (an empty view, the
/// default: not computed; a non-empty one needs options.sinks).
/// @{

/// Backward of diff_attention_v1 with one lambda for the layer; dlambda is
/// dL/dlambda summed over batch, heads and rows.
template <class T>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, compute_t<T>& dlambda,
    const AttentionOptions& options = {}, detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  detail::BackwardProblem<T> bp =
      detail::backward_v1<T>(q, k, v, &lambda, nullptr, out, lse, dout, dq, dk, dv,
                             TensorView<compute_t<T>, 1>(&dlambda, {1}), options);
  detail::attach_dsinks("diff_attention_v1_backward", bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of diff_attention_v1 with one lambda per DIFF head: dlambda (H).
template <class T>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const compute_t<T>, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<compute_t<T>, 1> dlambda, const AttentionOptions& options = {},
    detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  detail::BackwardProblem<T> bp = detail::backward_v1<T>(q, k, v, nullptr, &lambda, out, lse, dout,
                                                         dq, dk, dv, dlambda, options);
  detail::attach_dsinks("diff_attention_v1_backward", bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of diff_attention_v2; dlambda_logit (B, N, H) is the gradient of
/// the logit (through the sigmoid).
template <class T>
void diff_attention_v2_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options = {},
    detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  detail::BackwardProblem<T> bp = detail::backward_v2<T>(q, k, v, lambda_logit, out, lse, dout, dq,
                                                         dk, dv, dlambda_logit, options);
  detail::attach_dsinks("diff_attention_v2_backward", bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of the plain attention.
template <class T>
void attention_backward(detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const compute_t<T>, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options = {},
                        detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  detail::BackwardProblem<T> bp =
      detail::backward_plain<T>(q, k, v, out, lse, dout, dq, dk, dv, options);
  detail::attach_dsinks("attention_backward", bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// \name With a user score functor
/// The backward kernels above with the forward's functor `mod`; one with
/// `score` must define `dscore` (d score / d s, s the score it was given),
/// else the call does not compile. Each query block's keys are narrowed to
/// those `visible` leaves it, as in the forward (clamp_rows); inside that
/// range the functor is evaluated on every pair, or (visible_range) each row
/// is masked by its range.
/// @{

/// diff_attention_v1_backward (one lambda) with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, compute_t<T>& dlambda,
    const AttentionOptions& options, detail::nondeduced_view<compute_t<T>, 1> dsinks,
    const Mod& mod) {
  detail::BackwardProblem<T> bp =
      detail::backward_v1<T>(q, k, v, &lambda, nullptr, out, lse, dout, dq, dk, dv,
                             TensorView<compute_t<T>, 1>(&dlambda, {1}), options);
  detail::attach_dsinks("diff_attention_v1_backward", bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}
/// diff_attention_v1_backward (lambda per DIFF head) with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const compute_t<T>, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<compute_t<T>, 1> dlambda, const AttentionOptions& options,
    detail::nondeduced_view<compute_t<T>, 1> dsinks, const Mod& mod) {
  detail::BackwardProblem<T> bp = detail::backward_v1<T>(q, k, v, nullptr, &lambda, out, lse, dout,
                                                         dq, dk, dv, dlambda, options);
  detail::attach_dsinks("diff_attention_v1_backward", bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}
/// diff_attention_v2_backward with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v2_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const compute_t<T>, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options,
    detail::nondeduced_view<compute_t<T>, 1> dsinks, const Mod& mod) {
  detail::BackwardProblem<T> bp = detail::backward_v2<T>(q, k, v, lambda_logit, out, lse, dout, dq,
                                                         dk, dv, dlambda_logit, options);
  detail::attach_dsinks("diff_attention_v2_backward", bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}
/// attention_backward with the forward's functor `mod`.
template <class T, class Mod>
void attention_backward(detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const compute_t<T>, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options,
                        detail::nondeduced_view<compute_t<T>, 1> dsinks, const Mod& mod) {
  detail::BackwardProblem<T> bp =
      detail::backward_plain<T>(q, k, v, out, lse, dout, dq, dk, dv, options);
  detail::attach_dsinks("attention_backward", bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}
/// @}

/// @}

DIFFATTN_END_NAMESPACE
