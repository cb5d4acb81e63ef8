// Options shared by every attention entry point.
#pragma once

#include <cmath>

#include "config.hpp"
#include "detail/format.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// Options of every attention function.
struct AttentionOptions {
  /// Causal mask aligned bottom-right: query i of N sees key j of M iff
  /// j <= i + (M - N). For N = 3, M = 5 the kept (1) / masked (0) pattern is
  ///     1 1 1 0 0
  ///     1 1 1 1 0
  ///     1 1 1 1 1
  bool causal = false;
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
}

/// The score scale for head width d (d >= 1).
inline double effective_scale(const AttentionOptions& o, index_t d) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d));
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
