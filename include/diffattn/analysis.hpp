/// \file
/// The Differential Transformer paper's attention measurements as functions:
/// attention mass on a key span (the needle) versus the rest, the largest
/// attention logits, row entropy, the attention output's RMS per head ("context
/// RMS", DIFF V2), and the output under k-bit quantised logits.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "config.hpp"
#include "detail/analysis/analysis_impl.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "error.hpp"
#include "options.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup analysis
/// What to measure. Every statistic is a mean over the measured query rows:
/// rows [query_begin, query_end) of every batch entry that see at least one key.
struct AnalysisOptions {
  /// The needle: keys [needle_begin, needle_end), 0 <= begin <= end <= M. Each
  /// row counts the part of the span it sees. An empty span (the default) puts
  /// all of a row's mass into context_mass.
  index_t needle_begin = 0;
  /// One past the needle's last key (see needle_begin).
  index_t needle_end = 0;
  /// Query rows measured; query_end = -1 means N. 0 <= begin <= end <= N.
  index_t query_begin = 0;
  /// One past the last measured query row; -1 means N (see query_begin).
  index_t query_end = -1;
  /// 0: exact logits. 2..16: before each softmax, the scaled logits x of a row
  /// (its visible keys) are quantised symmetrically per row,
  ///   step = max|x| / (2^(bits-1) - 1),  x <- round(x / step) * step
  /// (round half away from zero), as a k-bit integer attention would see them.
  /// Statistics and the output then describe the quantised attention, except
  /// max_abs_logit, which is always measured before quantisation.
  int logit_bits = 0;
};

/// \ingroup analysis
/// Results per head, from diff_attention_v1_stats, diff_attention_v2_stats or
/// attention_stats. "Per map" vectors hold heads * maps entries, map m of head
/// h at index h * maps + m (differential: query head 2h + m; plain: head h).
/// Means are over the `rows` measured rows; all zeros when rows == 0.
struct AttentionStats {
  index_t heads = 0;  ///< output heads: H for the differential kernels, Hq for plain
  int maps = 1;       ///< softmax maps per head: 2 differential, 1 plain
  index_t rows = 0;   ///< measured (batch, query) rows that see at least one key

  /// Per map: the largest |s q.k| over the measured rows' visible keys (the
  /// paper's "top attention logit"), before quantisation.
  std::vector<double> max_abs_logit;
  /// Per map: mean entropy of the softmax rows, in nats (log of the visible
  /// key count for a uniform row, 0 for a one-hot row).
  std::vector<double> entropy;
  /// Per map: mean softmax mass on the needle.
  std::vector<double> map_needle_mass;

  /// Per head, of the weights the head applies to the values, W = A1 - lambda A2
  /// (plain: W = A): mean sum of w over the needle ...
  std::vector<double> needle_mass;
  /// ... and over the other visible keys (signed; needle + context is the row
  /// sum, 1 - lambda for a differential head, 1 for plain attention) ...
  std::vector<double> context_mass;
  /// ... mean sum of |w| over the other visible keys ...
  std::vector<double> context_abs_mass;
  /// ... mean sum of the negative weights over all visible keys (<= 0; 0 for
  /// plain attention).
  std::vector<double> negative_mass;
  /// Per head: sqrt(mean of out^2) over the measured rows and the value
  /// features: the "context RMS" of the attention output.
  std::vector<double> context_rms;

  /// Mean of a per-head (or per-map) vector.
  static double mean(const std::vector<double>& x) {
    double s = 0;
    for (double v : x) s += v;
    return x.empty() ? 0.0 : s / static_cast<double>(x.size());
  }
  /// Largest entry of a per-head (or per-map) vector (0 when empty).
  static double max(const std::vector<double>& x) {
    return x.empty() ? 0.0 : *std::max_element(x.begin(), x.end());
  }
};

namespace detail {

/// Runs the kernel's validation, naming `fn` (not the kernel) in its errors.
template <class F>
auto analysis_validate(const char* fn, const char* kernel, F&& validate) -> decltype(validate()) {
  try {
    return validate();
  } catch (const error& e) {
    std::string m = e.what();
    const std::string prefix = std::string(kernel) + ": ";
    if (m.compare(0, prefix.size(), prefix) == 0)
      m = std::string(fn) + ": " + m.substr(prefix.size());
    throw error(m);
  }
}

/// Checks the analysis options against a validated problem.
template <class T>
AnalysisSpec analysis_spec(const char* fn, const AttentionProblem<T>& p, const AnalysisOptions& a) {
  const index_t N = p.seqlen_q, M = p.seqlen_k;
  if (a.needle_begin < 0 || a.needle_end < a.needle_begin || a.needle_end > M)
    fail(fn, "analysis needle [", a.needle_begin, ", ", a.needle_end,
         ") must satisfy 0 <= needle_begin <= needle_end <= M = ", M, " (k ",
         shape_str(p.k.shape()), ")");
  const index_t qe = a.query_end == -1 ? N : a.query_end;
  if (a.query_begin < 0 || qe < a.query_begin || qe > N)
    fail(fn, "analysis query rows [", a.query_begin, ", ", a.query_end,
         ") must satisfy 0 <= query_begin <= query_end <= N = ", N, " (query_end -1 means N; q ",
         shape_str(p.q.shape()), ")");
  if (a.logit_bits != 0 && (a.logit_bits < 2 || a.logit_bits > 16))
    fail(fn, "analysis logit_bits must be 0 (exact) or 2..16, got ", a.logit_bits);
  return {a.needle_begin, a.needle_end, a.query_begin, qe, a.logit_bits};
}

/// A placeholder output of the expected shape for the validation when the
/// caller wants no output: one row of `width` elements seen through zero strides.
template <class T>
TensorView<T, 4> analysis_no_out(std::vector<T>& storage, index_t b, index_t n, index_t h,
                                 index_t width) {
  storage.assign(static_cast<std::size_t>(std::max<index_t>(width, 1)), T(0));
  return TensorView<T, 4>(storage.data(), {b, n, h, width}, {0, 0, 0, 1});
}

/// Validates (naming fn), checks the analysis options and runs. want_out false:
/// `out` is a placeholder of the right shape, dropped after the checks.
template <class T>
AttentionStats analysis_run_checked(const char* fn, AttentionProblem<T> p, bool want_out,
                                    const AttentionOptions& options,
                                    const AnalysisOptions& analysis) {
  refuse_score_mods(fn, options);  // the measuring rows know no modifiers
  const AnalysisSpec spec = analysis_spec(fn, p, analysis);
  if (!want_out) p.out = TensorView<T, 4>();
#ifdef DIFFATTN_DISPATCH
  // In diffattn::dispatch's variant for T, the one that runs the fused
  // kernel: the output stays the kernel's, bit for bit.
  if constexpr (analysis_dispatched<T>()) {
    std::vector<double> flat(AnalysisLayout(p.heads, p.maps()).size());
    dispatch_analysis(p, spec, options, flat.data());
    return analysis_stats_from<AttentionStats>(flat.data(), p.heads, p.maps());
  }
#endif
  return run_analysis<AttentionStats>(p, spec, options);
}

template <class T>
AttentionStats analysis_v1(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, T lambda, TensorView<T, 4> out, bool want_out,
                           const AttentionOptions& options, const AnalysisOptions& analysis) {
  constexpr const char* fn = "diff_attention_v1_stats";
  return analysis_run_checked<T>(fn,
                                 analysis_validate(fn, "diff_attention_v1",
                                                   [&] {
                                                     return validate_v1<T>(
                                                         q, k, v, &lambda, nullptr, out,
                                                         TensorView<T, 3>(), options);
                                                   }),
                                 want_out, options, analysis);
}

template <class T>
AttentionStats analysis_v2(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<const T, 3> lambda_logit,
                           TensorView<T, 4> out, bool want_out, const AttentionOptions& options,
                           const AnalysisOptions& analysis) {
  constexpr const char* fn = "diff_attention_v2_stats";
  return analysis_run_checked<T>(
      fn,
      analysis_validate(
          fn, "diff_attention_v2",
          [&] { return validate_v2<T>(q, k, v, lambda_logit, out, TensorView<T, 3>(), options); }),
      want_out, options, analysis);
}

template <class T>
AttentionStats analysis_plain(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> v, TensorView<T, 4> out, bool want_out,
                              const AttentionOptions& options, const AnalysisOptions& analysis) {
  constexpr const char* fn = "attention_stats";
  return analysis_run_checked<T>(
      fn,
      analysis_validate(
          fn, "attention",
          [&] { return validate_plain<T>(q, k, v, out, TensorView<T, 3>(), options); }),
      want_out, options, analysis);
}

}  // namespace detail

/// \defgroup analysis Attention measurements
///
/// Each function takes the arguments of its kernel (same shapes, GQA rules,
/// causal alignment and checks; see \ref kernels) plus AnalysisOptions, runs
/// the attention block by block as the fused kernel does (O(block x M) scratch
/// per thread, never an N x M map; threads over (batch, head, query block),
/// results bitwise identical for any thread count) and returns AttentionStats.
/// `out`, when given, receives the attention output, computed with the
/// quantised logits when analysis.logit_bits is set (exact logits: the
/// kernel's output up to rounding). Without `out` only the blocks holding
/// measured rows are computed. Bad input throws diffattn::error naming the
/// function, the argument and the shapes.
/// @{

/// Differential attention V1: q (B, N, 2H, d), k (B, M, 2Hkv, d), v (B, M, Hkv, 2d),
/// out (B, N, H, 2d) or omitted. Two maps per head.
template <class T>
AttentionStats diff_attention_v1_stats(detail::nondeduced_view<const T, 4> q,
                                       detail::nondeduced_view<const T, 4> k,
                                       detail::nondeduced_view<const T, 4> v,
                                       detail::nondeduced_t<T> lambda,
                                       detail::nondeduced_view<T, 4> out,
                                       const AttentionOptions& options = {},
                                       const AnalysisOptions& analysis = {}) {
  return detail::analysis_v1<T>(q, k, v, lambda, out, true, options, analysis);
}

/// V1 without the output.
template <class T>
AttentionStats diff_attention_v1_stats(detail::nondeduced_view<const T, 4> q,
                                       detail::nondeduced_view<const T, 4> k,
                                       detail::nondeduced_view<const T, 4> v,
                                       detail::nondeduced_t<T> lambda,
                                       const AttentionOptions& options = {},
                                       const AnalysisOptions& analysis = {}) {
  std::vector<T> storage;
  const auto out =
      detail::analysis_no_out<T>(storage, q.shape(0), q.shape(1), q.shape(2) / 2, 2 * q.shape(3));
  return detail::analysis_v1<T>(q, k, v, lambda, out, false, options, analysis);
}

/// Differential attention V2: q (B, N, 2H, d), k, v (B, M, Hkv, d),
/// lambda_logit (B, N, H), out (B, N, H, d) or omitted. Two maps per head.
template <class T>
AttentionStats diff_attention_v2_stats(detail::nondeduced_view<const T, 4> q,
                                       detail::nondeduced_view<const T, 4> k,
                                       detail::nondeduced_view<const T, 4> v,
                                       detail::nondeduced_view<const T, 3> lambda_logit,
                                       detail::nondeduced_view<T, 4> out,
                                       const AttentionOptions& options = {},
                                       const AnalysisOptions& analysis = {}) {
  return detail::analysis_v2<T>(q, k, v, lambda_logit, out, true, options, analysis);
}

/// V2 without the output.
template <class T>
AttentionStats diff_attention_v2_stats(detail::nondeduced_view<const T, 4> q,
                                       detail::nondeduced_view<const T, 4> k,
                                       detail::nondeduced_view<const T, 4> v,
                                       detail::nondeduced_view<const T, 3> lambda_logit,
                                       const AttentionOptions& options = {},
                                       const AnalysisOptions& analysis = {}) {
  std::vector<T> storage;
  const auto out =
      detail::analysis_no_out<T>(storage, q.shape(0), q.shape(1), q.shape(2) / 2, v.shape(3));
  return detail::analysis_v2<T>(q, k, v, lambda_logit, out, false, options, analysis);
}

/// Plain softmax attention: q (B, N, Hq, d), k (B, M, Hkv, d), v (B, M, Hkv, dv),
/// out (B, N, Hq, dv) or omitted. One map per head; W = A, so negative_mass is 0.
template <class T>
AttentionStats attention_stats(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const T, 4> k,
                               detail::nondeduced_view<const T, 4> v,
                               detail::nondeduced_view<T, 4> out,
                               const AttentionOptions& options = {},
                               const AnalysisOptions& analysis = {}) {
  return detail::analysis_plain<T>(q, k, v, out, true, options, analysis);
}

/// Plain attention without the output.
template <class T>
AttentionStats attention_stats(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const T, 4> k,
                               detail::nondeduced_view<const T, 4> v,
                               const AttentionOptions& options = {},
                               const AnalysisOptions& analysis = {}) {
  std::vector<T> storage;
  const auto out =
      detail::analysis_no_out<T>(storage, q.shape(0), q.shape(1), q.shape(2), v.shape(3));
  return detail::analysis_plain<T>(q, k, v, out, false, options, analysis);
}

/// @}

DIFFATTN_END_NAMESPACE
