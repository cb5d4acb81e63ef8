/// \file
/// Options shared by every attention entry point.
#pragma once

#include <cmath>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/kernel/mask.hpp"

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
};

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
