/// \file
/// Rotary position embedding (RoPE), interleaved pairs, as the Diff Transformer reference.
#pragma once

#include <cmath>
#include <vector>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup layers
/// @{

/// Frequency of rotary pair i for head width `dim`: base^(-2i / dim), i < dim / 2.
inline double rope_inv_freq(index_t i, index_t dim, double base) {
  return std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
}

namespace detail {

inline void rope_validate(const char* fn, index_t dim, index_t position_offset, double base) {
  if (dim % 2 != 0) fail(fn, "head width ", dim, " must be even (features are rotated in pairs)");
  if (position_offset < 0) fail(fn, "position_offset must be >= 0, got ", position_offset);
  if (!std::isfinite(base) || base <= 0) fail(fn, "base must be finite and > 0, got ", base);
}

/// Rotates x (B, N, H, D) in place by +angle (sign 1) or -angle (sign -1).
template <class T>
void rope_apply(TensorView<T, 4> x, index_t position_offset, double base, int sign) {
  const index_t batch = x.shape(0), seqlen = x.shape(1), heads = x.shape(2), dim = x.shape(3);
  const index_t half = dim / 2;
  if (x.empty()) return;
  // Angles in double (positions reach 1e5 and more; float would lose the phase),
  // one table per call: (seqlen, half).
  std::vector<T> cos_t(static_cast<std::size_t>(seqlen * half));
  std::vector<T> sin_t(static_cast<std::size_t>(seqlen * half));
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (index_t i = 0; i < half; ++i) inv_freq[i] = rope_inv_freq(i, dim, base);
  for (index_t n = 0; n < seqlen; ++n) {
    const double pos = static_cast<double>(position_offset + n);
    for (index_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq[i];
      cos_t[n * half + i] = static_cast<T>(std::cos(angle));
      sin_t[n * half + i] = static_cast<T>(sign * std::sin(angle));
    }
  }
  const index_t sd = x.stride(3);
  for (index_t b = 0; b < batch; ++b)
    for (index_t n = 0; n < seqlen; ++n) {
      const T* c = cos_t.data() + n * half;
      const T* s = sin_t.data() + n * half;
      for (index_t h = 0; h < heads; ++h) {
        T* row = &x(b, n, h, 0);
        for (index_t i = 0; i < half; ++i) {
          T& x0 = row[(2 * i) * sd];
          T& x1 = row[(2 * i + 1) * sd];
          const T a = x0, bb = x1;
          x0 = a * c[i] - bb * s[i];
          x1 = a * s[i] + bb * c[i];
        }
      }
    }
}

}  // namespace detail

/// Rotary embedding, in place, with interleaved pairs (the reference's
/// `apply_rotary_emb(..., interleaved=True)`):
///
///   x (B, N, H, D), D even; token n sits at position p = position_offset + n.
///   For each pair i < D/2, with theta_i = base^(-2i/D):
///     x[2i]   <- x[2i] cos(p theta_i) - x[2i+1] sin(p theta_i)
///     x[2i+1] <- x[2i] sin(p theta_i) + x[2i+1] cos(p theta_i)
///
/// Rotations keep norms, and the dot product of a query at position m with a
/// key at position n depends on m - n only. position_offset places a block of
/// new tokens after a cached prefix when decoding. Any strides; angles are
/// computed in double. Throws diffattn::error for odd D, a negative offset or a
/// base that is not finite and positive.
template <class T>
void apply_rope(TensorView<T, 4> x, index_t position_offset = 0, double base = 10000) {
  detail::rope_validate("apply_rope", x.shape(3), position_offset, base);
  detail::rope_apply<T>(x, position_offset, base, 1);
}

/// The inverse rotation of apply_rope (by -angle), for gradients: applying
/// both gives back x up to rounding. Same arguments and errors.
template <class T>
void apply_rope_inverse(TensorView<T, 4> x, index_t position_offset = 0, double base = 10000) {
  detail::rope_validate("apply_rope_inverse", x.shape(3), position_offset, base);
  detail::rope_apply<T>(x, position_offset, base, -1);
}

/// @}

DIFFATTN_END_NAMESPACE
