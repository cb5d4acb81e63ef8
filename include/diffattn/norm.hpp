/// \file
/// RMSNorm over the last dimension: the per-head normalisation of DIFF V1 ("subln").
#pragma once

#include <cmath>
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

namespace detail {

/// Throws unless t, the argument `name` of fn, has x's shape.
template <class V, class X>
void norm_check_like(const char* fn, const char* name, const V& t, const X& x) {
  if (t.shape() != x.shape())
    fail(fn, name, " has shape ", shape_str(t.shape()), ", expected ", shape_str(x.shape()),
         " like x");
}

/// Throws unless weight is empty or (D), D the last extent of x.
template <class W, class X>
void norm_check_weight(const char* fn, const W& weight, const X& x) {
  const index_t dim = x.shape(X::rank() - 1);
  if (!weight.empty() && weight.shape(0) != dim)
    fail(fn, "weight has shape ", shape_str(weight.shape()), ", expected (", dim,
         ") (the last extent of x ", shape_str(x.shape()), ") or empty");
}

/// The rows of x, its shape without the last dimension; throws when check is
/// set and inv_rms does not have that shape.
template <class X, class I>
std::array<index_t, X::rank() - 1> norm_rows(const char* fn, const X& x, const I& inv_rms,
                                             bool check) {
  std::array<index_t, X::rank() - 1> row_shape{};
  for (std::size_t r = 0; r + 1 < X::rank(); ++r) row_shape[r] = x.shape(r);
  if (check && inv_rms.shape() != row_shape)
    fail(fn, "inv_rms has shape ", shape_str(inv_rms.shape()), ", expected ", shape_str(row_shape),
         " (x ", shape_str(x.shape()), " without its last dimension)");
  return row_shape;
}

/// Calls f(off) for every row of row_shape in row-major order, off[i] the
/// offset of that row in views[i] (from their leading strides).
template <std::size_t R1, class F, class... V>
void norm_for_each_row(const std::array<index_t, R1>& row_shape, F&& f, const V&... views) {
  index_t rows = 1;
  for (index_t e : row_shape) rows *= e;
  std::array<index_t, R1> idx{};
  for (index_t r = 0; r < rows; ++r) {
    // Row r in row-major order of row_shape.
    index_t rem = r;
    std::array<index_t, sizeof...(V)> off{};
    for (std::size_t a = R1; a-- > 0;) {
      idx[a] = rem % row_shape[a];
      rem /= row_shape[a];
      std::size_t i = 0;
      ((off[i++] += idx[a] * views.stride(a)), ...);
    }
    f(off);
  }
}

}  // namespace detail

/// \addtogroup layers
/// @{

/// Root-mean-square normalisation of every row along the last dimension:
///
///   x (..., D)  ->  out[..., j] = scale * x[..., j] / sqrt(mean_j(x^2) + eps) * weight[j]
///
/// - weight (D), or an empty view for no learnable weight (elementwise_affine=False);
/// - scale folds a constant factor in: V1 multiplies by (1 - lambda_init) here;
/// - inv_rms (optional, the shape of x without its last dimension) receives
///   1 / sqrt(mean(x^2) + eps) of every row, which the backward pass needs.
///
/// The mean of squares is accumulated in double. x and out may be the same view
/// (in place); any strides. T and R come from out. V1 applies it to each head of (B, N, H, 2d) with
/// eps 1e-5. Throws diffattn::error for mismatched shapes or a non-finite or
/// negative eps.
template <class T, std::size_t R>
void rms_norm(detail::nondeduced_view<const T, R> x, detail::nondeduced_view<const T, 1> weight,
              TensorView<T, R> out, double eps = 1e-5, double scale = 1.0,
              detail::nondeduced_view<T, R - 1> inv_rms = {}) {
  constexpr const char* fn = "rms_norm";
  static_assert(R >= 2, "rms_norm: x needs rank >= 2 (rows, features)");
  const index_t dim = x.shape(R - 1);
  detail::norm_check_like(fn, "out", out, x);
  detail::norm_check_weight(fn, weight, x);
  if (!std::isfinite(eps) || eps < 0) detail::fail(fn, "eps must be finite and >= 0, got ", eps);
  if (!std::isfinite(scale)) detail::fail(fn, "scale must be finite, got ", scale);
  const bool want_inv = inv_rms.data() != nullptr || !inv_rms.empty();
  const auto row_shape = detail::norm_rows(fn, x, inv_rms, want_inv);

  const index_t xs = x.stride(R - 1), os = out.stride(R - 1);
  auto row = [&](const std::array<index_t, 3>& off) {
    const T* xr = x.data() + off[0];
    T* orow = out.data() + off[1];
    double ss = 0;
    for (index_t j = 0; j < dim; ++j) {
      const double v = static_cast<double>(xr[j * xs]);
      ss += v * v;
    }
    const double inv = dim > 0 ? 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps) : 0.0;
    const T f = static_cast<T>(inv * scale);
    if (weight.empty()) {
      for (index_t j = 0; j < dim; ++j) orow[j * os] = xr[j * xs] * f;
    } else {
      for (index_t j = 0; j < dim; ++j) orow[j * os] = xr[j * xs] * f * weight(j);
    }
    if (want_inv) inv_rms.data()[off[2]] = static_cast<T>(inv);
  };
  detail::norm_for_each_row(row_shape, row, x, out, inv_rms);
}

/// Backward of rms_norm, from the inv_rms that the forward kept:
///
///   x (..., D)         rms_norm's input
///   weight (D)         as passed to rms_norm, or empty
///   inv_rms (...)      rms_norm's inv_rms output (x's shape without its last dimension)
///   dout (..., D)      dL/dout
///   dx (..., D)        receives dL/dx
///   dweight (D)        receives dL/dweight summed over all rows; may be an empty
///                      view (not wanted); must be empty when weight is
///   scale              rms_norm's scale
///
/// With xhat = x * inv_rms and g = scale * weight * dout (weight 1 when empty):
/// dx = inv_rms * (g - xhat * mean(g * xhat)), dweight = sum over rows of
/// scale * dout * xhat. eps enters through inv_rms only. Gradients are
/// overwritten, not accumulated; row sums are taken in double. Any strides;
/// T and R come from dx. Throws diffattn::error for mismatched shapes or a
/// non-finite scale.
template <class T, std::size_t R>
void rms_norm_backward(detail::nondeduced_view<const T, R> x,
                       detail::nondeduced_view<const T, 1> weight,
                       detail::nondeduced_view<const T, R - 1> inv_rms,
                       detail::nondeduced_view<const T, R> dout, TensorView<T, R> dx,
                       detail::nondeduced_view<T, 1> dweight = {}, double scale = 1.0) {
  constexpr const char* fn = "rms_norm_backward";
  static_assert(R >= 2, "rms_norm_backward: x needs rank >= 2 (rows, features)");
  const index_t dim = x.shape(R - 1);
  detail::norm_check_like(fn, "dout", dout, x);
  detail::norm_check_like(fn, "dx", dx, x);
  detail::norm_check_weight(fn, weight, x);
  if (!dweight.empty() && (weight.empty() || dweight.shape(0) != dim))
    detail::fail(fn, "dweight has shape ", detail::shape_str(dweight.shape()), ", expected ",
                 weight.empty() ? std::string("empty (weight is empty)")
                                : detail::cat("(", dim, ") like weight or empty"));
  if (!std::isfinite(scale)) detail::fail(fn, "scale must be finite, got ", scale);
  const auto row_shape = detail::norm_rows(fn, x, inv_rms, true);

  const bool want_dw = !dweight.empty();
  std::vector<double> dw(want_dw ? static_cast<std::size_t>(dim) : 0, 0.0);
  std::vector<double> g(static_cast<std::size_t>(dim));
  const index_t xs = x.stride(R - 1), gs = dout.stride(R - 1), ds = dx.stride(R - 1);
  auto row = [&](const std::array<index_t, 4>& off) {
    const T* xr = x.data() + off[0];
    const T* gr = dout.data() + off[1];
    T* dr = dx.data() + off[2];
    const double inv = static_cast<double>(inv_rms.data()[off[3]]);
    double dot = 0;  // sum_j g_j xhat_j
    for (index_t j = 0; j < dim; ++j) {
      const double go = static_cast<double>(gr[j * gs]);
      const double xhat = static_cast<double>(xr[j * xs]) * inv;
      const double w = weight.empty() ? 1.0 : static_cast<double>(weight(j));
      g[j] = scale * w * go;
      dot += g[j] * xhat;
      if (want_dw) dw[j] += scale * go * xhat;
    }
    const double mean = dim > 0 ? dot / static_cast<double>(dim) : 0.0;
    for (index_t j = 0; j < dim; ++j) {
      const double xhat = static_cast<double>(xr[j * xs]) * inv;
      dr[j * ds] = static_cast<T>(inv * (g[j] - xhat * mean));
    }
  };
  detail::norm_for_each_row(row_shape, row, x, dout, dx, inv_rms);
  for (index_t j = 0; want_dw && j < dim; ++j) dweight(j) = static_cast<T>(dw[j]);
}

/// @}

DIFFATTN_END_NAMESPACE
