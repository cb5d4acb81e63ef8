/// \file
/// Options shared by every attention entry point.
#pragma once

#include <cmath>
#include <vector>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/kernel/mask.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup masks
/// Options of every attention function.
struct AttentionOptions {
  /// Causal mask aligned bottom-right: query i of N sees key j of M iff
  /// j <= i + (M - N). For N = 3, M = 5 the kept (1) / masked (0) pattern is
  ///     1 1 1 0 0
  ///     1 1 1 1 0
  ///     1 1 1 1 1
  bool causal = false;
  /// Sliding window, FlashAttention's window_size = (left, right), aligned
  /// bottom-right like the causal mask: with c = i + (M - N), query i sees key
  /// j iff c - window_left <= j <= c + window_right; -1 drops that limit.
  /// causal means window_right = 0 (causal with window_right > 0 is refused).
  /// A model whose window holds W tokens including the current one uses
  /// causal = true, window_left = W - 1. For N = 3, M = 5, window_left = 1,
  /// causal:
  ///     0 1 1 0 0
  ///     0 0 1 1 0
  ///     0 0 0 1 1
  /// Cost follows the visible pairs: tiles outside the band are never computed.
  index_t window_left = -1;
  /// Keys visible after the aligned diagonal (see window_left); -1: no limit.
  index_t window_right = -1;
  /// Score scale s in softmax(s * q k^T); 0 means 1 / sqrt(d), d the width of
  /// one query/key head. Must be finite and >= 0.
  double scale = 0;
  /// Threads for the fused kernels; 0 means the OpenMP default (1 without OpenMP).
  int num_threads = 0;

  /// Score modifiers, applied to s = scale * q.k in this order: softcap, then
  /// ALiBi, then (functor overloads) the functor's score, then the masks.
  /// h below is the query head: the two maps of DIFF head h are query heads
  /// 2h and 2h + 1, each with its own slope and sink.
  ///
  /// Soft-capping (Gemma 2, FlashAttention's softcap): > 0 replaces s by
  /// softcap * tanh(s / softcap); 0 leaves the scores alone. Finite, >= 0.
  float softcap = 0;
  /// ALiBi (Hq), FlashAttention's convention: s -= slope_h * |i + M - N - j|
  /// (i, j the query and key within the sequence), after the softcap. Empty:
  /// none. Finite.
  TensorView<const float, 1> alibi_slopes;
  /// Attention sinks (Hq), GPT-OSS: one more logit sink_h in each row's
  /// denominator and nothing in its output, so a row's weights sum to less
  /// than 1 and lse = log(exp(sink_h) + sum_j exp(s_j)); a row that sees no
  /// key gives zeros and lse = sink_h. Empty: none. Finite.
  TensorView<const float, 1> sinks;
};

/// The default score functor of the kernels: no member, so nothing is added
/// to them. A user functor may define any of (S the compute type: float, or
/// double)
///   template \<class S\> S score(S s, index_t b, index_t h, index_t i, index_t j) const;
///   bool visible(index_t b, index_t h, index_t i, index_t j) const;
///   template \<class S\> S dscore(S s, index_t b, index_t h, index_t i, index_t j) const;
///   int visible_block(index_t b, index_t h, index_t i0, index_t i1, index_t j0, index_t j1) const;
///   std::pair\<index_t, index_t\> visible_range(index_t b, index_t h, index_t i) const;
/// score replaces the (capped, biased) score s of query i and key j of query
/// head h in batch entry b; visible false masks the pair; dscore is
/// d score / d s, which a backward call needs when score is defined. In a
/// packed batch b is the sequence and i, j count within it; over KV caches j
/// is the key's index in sequence b's cache and i the query's position there
/// (its row + cache_seqlens(b) - n).
///
/// visible_block and visible_range only speed up `visible`, which must be
/// defined with them. visible_block classifies the pairs [i0, i1) x [j0, j1):
/// 0 none visible, 2 all, 1 some (or unknown). visible_range gives the keys
/// [first, second) query i sees, exactly those for which visible is true
/// (first >= second: none; the ends may lie outside the keys): the kernels
/// then mask each row by its range, one call per row, and never call visible
/// (document masks, prefix-LM, windows: any mask whose rows see one run of
/// keys). With both, visible_range is used.
struct NoScoreMod {};

/// The standard ALiBi slopes (Press et al., BLOOM) of n heads: for n a power
/// of two, 2^(-8 i / n) for heads i = 1 .. n; otherwise those of the largest
/// power of two m < n, then the odd-numbered slopes of 2m for the n - m
/// heads left. A differential layer passes its 2H query heads, so the two
/// maps of a DIFF head get slopes of their own.
inline std::vector<float> standard_alibi_slopes(index_t n) {
  std::vector<float> out;
  if (n <= 0) return out;
  index_t m = 1;
  while (2 * m <= n) m *= 2;
  for (index_t i = 1; i <= m; ++i)
    out.push_back(static_cast<float>(std::pow(2.0, -8.0 * static_cast<double>(i) / m)));
  for (index_t i = 1; static_cast<index_t>(out.size()) < n; i += 2)
    out.push_back(static_cast<float>(std::pow(2.0, -8.0 * static_cast<double>(i) / (2 * m))));
  return out;
}

namespace detail {

inline void validate_options(const char* fn, const AttentionOptions& o) {
  if (!std::isfinite(o.scale) || o.scale < 0)
    fail(fn, "options.scale must be finite and >= 0 (0 means 1/sqrt(d)), got ", o.scale);
  if (o.num_threads < 0)
    fail(fn, "options.num_threads must be >= 0 (0 means the default), got ", o.num_threads);
  if (o.window_left < -1)
    fail(fn, "options.window_left must be >= 0, or -1 for no limit, got ", o.window_left);
  if (o.window_right < -1)
    fail(fn, "options.window_right must be >= 0, or -1 for no limit, got ", o.window_right);
  if (o.causal && o.window_right > 0)
    fail(fn, "options.causal means window_right = 0, got window_right = ", o.window_right,
         " with causal = true");
}

/// True when the options set a score modifier (softcap, ALiBi or sinks).
inline bool has_score_mods(const AttentionOptions& o) noexcept {
  return o.softcap > 0 || !o.alibi_slopes.empty() || !o.sinks.empty();
}

/// Checks the score modifiers against the problem's query_heads (Hq).
inline void validate_score_mods(const char* fn, const AttentionOptions& o, index_t query_heads) {
  if (!std::isfinite(o.softcap) || o.softcap < 0)
    fail(fn, "options.softcap must be finite and >= 0 (0: no soft-capping), got ", o.softcap);
  auto check = [&](const char* name, const TensorView<const float, 1>& t) {
    if (t.data() == nullptr && t.size() == 0) return;
    if (t.shape(0) != query_heads)
      fail(fn, "options.", name, " has shape ", shape_str(t.shape()), ", expected (Hq) = (",
           query_heads, "), one per query head (q has ", query_heads, " heads)");
    for (index_t h = 0; h < query_heads; ++h)
      if (!std::isfinite(t(h)))
        fail(fn, "options.", name, " must be finite, got ", name, "[", h, "] = ", t(h), " (shape ",
             shape_str(t.shape()), ")");
  };
  check("alibi_slopes", o.alibi_slopes);
  check("sinks", o.sinks);
}

/// Refuses score modifiers where they are not implemented.
inline void refuse_score_mods(const char* fn, const AttentionOptions& o) {
  if (has_score_mods(o)) fail(fn, "options.softcap, alibi_slopes and sinks are not supported here");
}

/// The visible band the options describe.
inline KeyBand band_of(const AttentionOptions& o) noexcept {
  return make_band(o.causal, o.window_left, o.window_right);
}

/// True when the options mask anything (causal or a window).
inline bool has_mask(const AttentionOptions& o) noexcept {
  return o.causal || o.window_left >= 0 || o.window_right >= 0;
}

/// The score scale for head width d (d >= 1).
inline double effective_scale(const AttentionOptions& o, index_t d) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d));
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
