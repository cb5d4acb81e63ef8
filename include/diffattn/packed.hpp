/// \file
/// Packed variable-length batches: several sequences concatenated along the
/// token axis, each attending only to itself (FlashAttention's varlen layout).
#pragma once

#include <vector>

#include "attention.hpp"
#include "attention_backward.hpp"
#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup packed
/// The sequences of a packed batch, by cumulative offsets (FlashAttention's
/// cu_seqlens_q / cu_seqlens_k): sequence s owns query rows
/// [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and key/value rows
/// [cu_seqlens_k[s], cu_seqlens_k[s + 1]). Offsets start at 0, never
/// decrease, and end at the tensors' token counts. An empty cu_seqlens_k
/// means the same as cu_seqlens_q (self-attention, the usual case). Sequences
/// may be empty.
struct PackedSequences {
  std::vector<index_t> cu_seqlens_q;  ///< (S + 1)
  std::vector<index_t> cu_seqlens_k;  ///< (S + 1), or empty: cu_seqlens_q

  /// Offsets of sequences of the given lengths, packed back to back; the key
  /// lengths default to the query lengths.
  static PackedSequences from_lengths(const std::vector<index_t>& q_lengths,
                                      const std::vector<index_t>& k_lengths = {}) {
    PackedSequences p;
    p.cu_seqlens_q = offsets("q_lengths", q_lengths);
    if (!k_lengths.empty()) p.cu_seqlens_k = offsets("k_lengths", k_lengths);
    return p;
  }
  /// Number of sequences S.
  index_t size() const noexcept {
    return cu_seqlens_q.empty() ? 0 : static_cast<index_t>(cu_seqlens_q.size()) - 1;
  }

 private:
  static std::vector<index_t> offsets(const char* name, const std::vector<index_t>& lengths) {
    std::vector<index_t> cu(lengths.size() + 1, 0);
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      if (lengths[s] < 0)
        detail::fail("PackedSequences::from_lengths", name, "[", s, "] = ", lengths[s],
                     " is negative");
      cu[s + 1] = cu[s] + lengths[s];
    }
    return cu;
  }
};

namespace detail {
/// The packed forward entry points' one prologue: `validate(q, k, v, out,
/// lse)` checks the (1, T, H, D) views and gives the problem, the offsets are
/// attached, and the problem runs with `mod` (NoScoreMod: run_attention's
/// dispatched way).
template <class T, class Mod, class Validate>
void run_varlen(const char* fn, const TensorView<const T, 3>& q, const TensorView<const T, 3>& k,
                const TensorView<const T, 3>& v, const TensorView<T, 3>& out,
                const TensorView<compute_t<T>, 2>& lse, const PackedSequences& seqs,
                const AttentionOptions& options, const Mod& mod, const Validate& validate) {
  AttentionProblem<T> p =
      validate(as_batch1(q), as_batch1(k), as_batch1(v), as_batch1(out), as_batch1(lse));
  attach_packed(fn, p, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  run_attention(p, options, mod);
}
}  // namespace detail

/// \defgroup packed Packed (variable-length) batches
///
/// The kernels of attention.hpp and attention_backward.hpp over a packed
/// batch. Tensors drop the batch axis and put every sequence's tokens on one
/// axis: with T_q = cu_seqlens_q[S] and T_k = cu_seqlens_k[S] tokens,
///   q (T_q, Hq, d), k (T_k, Hk, d), v (T_k, Hkv, dv), out (T_q, H, dv),
///   lse (Hq, T_q) (FlashAttention's varlen layout; pass {} to skip),
///   V2's lambda_logit (T_q, H).
/// Head layouts, GQA and lambda are those of the unpacked kernels. Each
/// sequence attends only to its own keys; the causal mask and the window are
/// applied per sequence (bottom-right aligned to its own n_s and m_s). The
/// result equals a separate call per sequence, bitwise, and the cost is the
/// sum of those calls'. Argument checks are those of the unpacked kernels on
/// the (1, T, H, D) views, plus the offsets (starting at 0, non-decreasing,
/// ending at T_q and T_k), all reported as diffattn::error.
/// @{

/// diff_attention_v1 over a packed batch; one lambda for every head.
template <class T>
void diff_attention_v1_varlen(detail::nondeduced_view<const T, 3> q,
                              detail::nondeduced_view<const T, 3> k,
                              detail::nondeduced_view<const T, 3> v,
                              detail::nondeduced_t<compute_t<T>> lambda,
                              detail::nondeduced_view<T, 3> out,
                              detail::nondeduced_view<compute_t<T>, 2> lse,
                              const PackedSequences& seqs, const AttentionOptions& options = {}) {
  diff_attention_v1_varlen<T>(q, k, v, lambda, out, lse, seqs, options, NoScoreMod{});
}

/// diff_attention_v1 over a packed batch; one lambda per DIFF head, lambda (H).
template <class T>
void diff_attention_v1_varlen(detail::nondeduced_view<const T, 3> q,
                              detail::nondeduced_view<const T, 3> k,
                              detail::nondeduced_view<const T, 3> v,
                              detail::nondeduced_view<const compute_t<T>, 1> lambda,
                              detail::nondeduced_view<T, 3> out,
                              detail::nondeduced_view<compute_t<T>, 2> lse,
                              const PackedSequences& seqs, const AttentionOptions& options = {}) {
  diff_attention_v1_varlen<T>(q, k, v, lambda, out, lse, seqs, options, NoScoreMod{});
}

/// diff_attention_v2 over a packed batch; lambda_logit (T_q, H).
template <class T>
void diff_attention_v2_varlen(detail::nondeduced_view<const T, 3> q,
                              detail::nondeduced_view<const T, 3> k,
                              detail::nondeduced_view<const T, 3> v,
                              detail::nondeduced_view<const T, 2> lambda_logit,
                              detail::nondeduced_view<T, 3> out,
                              detail::nondeduced_view<compute_t<T>, 2> lse,
                              const PackedSequences& seqs, const AttentionOptions& options = {}) {
  diff_attention_v2_varlen<T>(q, k, v, lambda_logit, out, lse, seqs, options, NoScoreMod{});
}

/// Plain attention over a packed batch.
template <class T>
void attention_varlen(detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
                      detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<T, 3> out,
                      detail::nondeduced_view<compute_t<T>, 2> lse, const PackedSequences& seqs,
                      const AttentionOptions& options = {}) {
  attention_varlen<T>(q, k, v, out, lse, seqs, options, NoScoreMod{});
}

/// Backward of diff_attention_v1_varlen with one lambda: dq, dk, dv shaped as
/// q, k, v; dlambda summed over every sequence, head and row. lse is required.
template <class T>
void diff_attention_v1_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv, compute_t<T>& dlambda,
    const PackedSequences& seqs, const AttentionOptions& options = {},
    detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  constexpr const char* fn = "diff_attention_v1_varlen_backward";
  detail::BackwardProblem<T> bp = detail::backward_v1<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v), &lambda, nullptr,
      detail::as_batch1(out), detail::as_batch1(lse), detail::as_batch1(dout),
      detail::as_batch1(dq), detail::as_batch1(dk), detail::as_batch1(dv),
      TensorView<compute_t<T>, 1>(&dlambda, {1}), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of diff_attention_v1_varlen with one lambda per head: dlambda (H).
template <class T>
void diff_attention_v1_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const compute_t<T>, 1> lambda,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv,
    detail::nondeduced_view<compute_t<T>, 1> dlambda, const PackedSequences& seqs,
    const AttentionOptions& options = {}, detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  constexpr const char* fn = "diff_attention_v1_varlen_backward";
  detail::BackwardProblem<T> bp = detail::backward_v1<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v), nullptr, &lambda,
      detail::as_batch1(out), detail::as_batch1(lse), detail::as_batch1(dout),
      detail::as_batch1(dq), detail::as_batch1(dk), detail::as_batch1(dv), dlambda, options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of diff_attention_v2_varlen; dlambda_logit (T_q, H).
template <class T>
void diff_attention_v2_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const T, 2> lambda_logit,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv,
    detail::nondeduced_view<T, 2> dlambda_logit, const PackedSequences& seqs,
    const AttentionOptions& options = {}, detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  constexpr const char* fn = "diff_attention_v2_varlen_backward";
  detail::BackwardProblem<T> bp = detail::backward_v2<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v),
      detail::as_batch1(lambda_logit), detail::as_batch1(out), detail::as_batch1(lse),
      detail::as_batch1(dout), detail::as_batch1(dq), detail::as_batch1(dk), detail::as_batch1(dv),
      detail::as_batch1(dlambda_logit), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// Backward of attention_varlen.
template <class T>
void attention_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const T, 3> out,
    detail::nondeduced_view<const compute_t<T>, 2> lse, detail::nondeduced_view<const T, 3> dout,
    detail::nondeduced_view<T, 3> dq, detail::nondeduced_view<T, 3> dk,
    detail::nondeduced_view<T, 3> dv, const PackedSequences& seqs,
    const AttentionOptions& options = {}, detail::nondeduced_view<compute_t<T>, 1> dsinks = {}) {
  constexpr const char* fn = "attention_varlen_backward";
  detail::BackwardProblem<T> bp = detail::backward_plain<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v), detail::as_batch1(out),
      detail::as_batch1(lse), detail::as_batch1(dout), detail::as_batch1(dq), detail::as_batch1(dk),
      detail::as_batch1(dv), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options);
}

/// \name With a user score functor
/// The kernels above with a functor `mod`, as in attention.hpp and
/// attention_backward.hpp (NoScoreMod in options.hpp lists its optional
/// members), inlined into the kernel and run header-only. The functor's b is
/// the sequence's index s in the packed batch, h the query head, and i, j the
/// query and key within the sequence (0 at cu_seqlens_q[s] and
/// cu_seqlens_k[s]). A backward needs `dscore` when `score` is defined.
/// @{

/// diff_attention_v1_varlen (one lambda) with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v1_varlen(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<T, 3> out, detail::nondeduced_view<compute_t<T>, 2> lse,
    const PackedSequences& seqs, const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_varlen";
  detail::run_varlen<T>(fn, q, k, v, out, lse, seqs, options, mod,
                        [&](auto q4, auto k4, auto v4, auto out4, auto lse4) {
                          return detail::validate_v1<T>(q4, k4, v4, &lambda, nullptr, out4, lse4,
                                                        options, fn);
                        });
}

/// diff_attention_v1_varlen (lambda per DIFF head, (H)) with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v1_varlen(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const compute_t<T>, 1> lambda,
    detail::nondeduced_view<T, 3> out, detail::nondeduced_view<compute_t<T>, 2> lse,
    const PackedSequences& seqs, const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_varlen";
  detail::run_varlen<T>(fn, q, k, v, out, lse, seqs, options, mod,
                        [&](auto q4, auto k4, auto v4, auto out4, auto lse4) {
                          return detail::validate_v1<T>(q4, k4, v4, nullptr, &lambda, out4, lse4,
                                                        options, fn);
                        });
}

/// diff_attention_v2_varlen with a user score functor `mod`.
template <class T, class Mod>
void diff_attention_v2_varlen(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const T, 2> lambda_logit,
    detail::nondeduced_view<T, 3> out, detail::nondeduced_view<compute_t<T>, 2> lse,
    const PackedSequences& seqs, const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v2_varlen";
  detail::run_varlen<T>(fn, q, k, v, out, lse, seqs, options, mod,
                        [&](auto q4, auto k4, auto v4, auto out4, auto lse4) {
                          return detail::validate_v2<T>(q4, k4, v4, detail::as_batch1(lambda_logit),
                                                        out4, lse4, options, fn);
                        });
}

/// attention_varlen (plain softmax) with a user score functor `mod`.
template <class T, class Mod>
void attention_varlen(detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
                      detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<T, 3> out,
                      detail::nondeduced_view<compute_t<T>, 2> lse, const PackedSequences& seqs,
                      const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "attention_varlen";
  detail::run_varlen<T>(fn, q, k, v, out, lse, seqs, options, mod,
                        [&](auto q4, auto k4, auto v4, auto out4, auto lse4) {
                          return detail::validate_plain<T>(q4, k4, v4, out4, lse4, options, fn);
                        });
}

/// diff_attention_v1_varlen_backward (one lambda) with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v1_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv, T& dlambda,
    const PackedSequences& seqs, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_varlen_backward";
  static_assert(!is_half_storage_v<T>, "diff_attention_v1_varlen_backward: no 16-bit storage");
  detail::BackwardProblem<T> bp =
      detail::backward_v1<T>(detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v),
                             &lambda, nullptr, detail::as_batch1(out), detail::as_batch1(lse),
                             detail::as_batch1(dout), detail::as_batch1(dq), detail::as_batch1(dk),
                             detail::as_batch1(dv), TensorView<T, 1>(&dlambda, {1}), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}

/// diff_attention_v1_varlen_backward (lambda per DIFF head) with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v1_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const compute_t<T>, 1> lambda,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv,
    detail::nondeduced_view<T, 1> dlambda, const PackedSequences& seqs,
    const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_varlen_backward";
  static_assert(!is_half_storage_v<T>, "diff_attention_v1_varlen_backward: no 16-bit storage");
  detail::BackwardProblem<T> bp = detail::backward_v1<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v), nullptr, &lambda,
      detail::as_batch1(out), detail::as_batch1(lse), detail::as_batch1(dout),
      detail::as_batch1(dq), detail::as_batch1(dk), detail::as_batch1(dv), dlambda, options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}

/// diff_attention_v2_varlen_backward with the forward's functor `mod`.
template <class T, class Mod>
void diff_attention_v2_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const T, 2> lambda_logit,
    detail::nondeduced_view<const T, 3> out, detail::nondeduced_view<const compute_t<T>, 2> lse,
    detail::nondeduced_view<const T, 3> dout, detail::nondeduced_view<T, 3> dq,
    detail::nondeduced_view<T, 3> dk, detail::nondeduced_view<T, 3> dv,
    detail::nondeduced_view<T, 2> dlambda_logit, const PackedSequences& seqs,
    const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v2_varlen_backward";
  static_assert(!is_half_storage_v<T>, "diff_attention_v2_varlen_backward: no 16-bit storage");
  detail::BackwardProblem<T> bp = detail::backward_v2<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v),
      detail::as_batch1(lambda_logit), detail::as_batch1(out), detail::as_batch1(lse),
      detail::as_batch1(dout), detail::as_batch1(dq), detail::as_batch1(dk), detail::as_batch1(dv),
      detail::as_batch1(dlambda_logit), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}

/// attention_varlen_backward with the forward's functor `mod`.
template <class T, class Mod>
void attention_varlen_backward(
    detail::nondeduced_view<const T, 3> q, detail::nondeduced_view<const T, 3> k,
    detail::nondeduced_view<const T, 3> v, detail::nondeduced_view<const T, 3> out,
    detail::nondeduced_view<const compute_t<T>, 2> lse, detail::nondeduced_view<const T, 3> dout,
    detail::nondeduced_view<T, 3> dq, detail::nondeduced_view<T, 3> dk,
    detail::nondeduced_view<T, 3> dv, const PackedSequences& seqs, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, const Mod& mod) {
  constexpr const char* fn = "attention_varlen_backward";
  static_assert(!is_half_storage_v<T>, "attention_varlen_backward: no 16-bit storage");
  detail::BackwardProblem<T> bp = detail::backward_plain<T>(
      detail::as_batch1(q), detail::as_batch1(k), detail::as_batch1(v), detail::as_batch1(out),
      detail::as_batch1(lse), detail::as_batch1(dout), detail::as_batch1(dq), detail::as_batch1(dk),
      detail::as_batch1(dv), options, fn);
  detail::attach_packed(fn, bp.fwd, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
  detail::attach_dsinks(fn, bp, dsinks);
  detail::run_attention_backward(bp, options, mod);
}
/// @}

/// @}

DIFFATTN_END_NAMESPACE
