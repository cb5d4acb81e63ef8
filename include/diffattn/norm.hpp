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
  if (out.shape() != x.shape())
    detail::fail(fn, "out has shape ", detail::shape_str(out.shape()), ", expected ",
                 detail::shape_str(x.shape()), " like x");
  if (!weight.empty() && weight.shape(0) != dim)
    detail::fail(fn, "weight has shape ", detail::shape_str(weight.shape()), ", expected (", dim,
                 ") (the last extent of x ", detail::shape_str(x.shape()), ") or empty");
  if (!std::isfinite(eps) || eps < 0) detail::fail(fn, "eps must be finite and >= 0, got ", eps);
  if (!std::isfinite(scale)) detail::fail(fn, "scale must be finite, got ", scale);
  std::array<index_t, R - 1> row_shape{};
  for (std::size_t r = 0; r + 1 < R; ++r) row_shape[r] = x.shape(r);
  const bool want_inv = inv_rms.data() != nullptr || !inv_rms.empty();
  if (want_inv && inv_rms.shape() != row_shape)
    detail::fail(fn, "inv_rms has shape ", detail::shape_str(inv_rms.shape()), ", expected ",
                 detail::shape_str(row_shape), " (x ", detail::shape_str(x.shape()),
                 " without its last dimension)");

  index_t rows = 1;
  for (index_t e : row_shape) rows *= e;
  const index_t xs = x.stride(R - 1), os = out.stride(R - 1);
  std::array<index_t, R - 1> idx{};
  for (index_t r = 0; r < rows; ++r) {
    // Row r in row-major order of row_shape.
    index_t rem = r, xoff = 0, ooff = 0, ioff = 0;
    for (std::size_t a = R - 1; a-- > 0;) {
      idx[a] = rem % row_shape[a];
      rem /= row_shape[a];
      xoff += idx[a] * x.stride(a);
      ooff += idx[a] * out.stride(a);
      if (want_inv) ioff += idx[a] * inv_rms.stride(a);
    }
    const T* xr = x.data() + xoff;
    T* orow = out.data() + ooff;
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
    if (want_inv) inv_rms.data()[ioff] = static_cast<T>(inv);
  }
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
  if (dout.shape() != x.shape())
    detail::fail(fn, "dout has shape ", detail::shape_str(dout.shape()), ", expected ",
                 detail::shape_str(x.shape()), " like x");
  if (dx.shape() != x.shape())
    detail::fail(fn, "dx has shape ", detail::shape_str(dx.shape()), ", expected ",
                 detail::shape_str(x.shape()), " like x");
  if (!weight.empty() && weight.shape(0) != dim)
    detail::fail(fn, "weight has shape ", detail::shape_str(weight.shape()), ", expected (", dim,
                 ") (the last extent of x ", detail::shape_str(x.shape()), ") or empty");
  if (!dweight.empty() && (weight.empty() || dweight.shape(0) != dim))
    detail::fail(fn, "dweight has shape ", detail::shape_str(dweight.shape()), ", expected ",
                 weight.empty() ? std::string("empty (weight is empty)")
                                : detail::cat("(", dim, ") like weight or empty"));
  if (!std::isfinite(scale)) detail::fail(fn, "scale must be finite, got ", scale);
  std::array<index_t, R - 1> row_shape{};
  for (std::size_t r = 0; r + 1 < R; ++r) row_shape[r] = x.shape(r);
  if (inv_rms.shape() != row_shape)
    detail::fail(fn, "inv_rms has shape ", detail::shape_str(inv_rms.shape()), ", expected ",
                 detail::shape_str(row_shape), " (x ", detail::shape_str(x.shape()),
                 " without its last dimension)");

  index_t rows = 1;
  for (index_t e : row_shape) rows *= e;
  const bool want_dw = !dweight.empty();
  std::vector<double> dw(want_dw ? static_cast<std::size_t>(dim) : 0, 0.0);
  std::vector<double> g(static_cast<std::size_t>(dim));
  const index_t xs = x.stride(R - 1), gs = dout.stride(R - 1), ds = dx.stride(R - 1);
  std::array<index_t, R - 1> idx{};
  for (index_t r = 0; r < rows; ++r) {
    index_t rem = r, xoff = 0, goff = 0, doff = 0, ioff = 0;
    for (std::size_t a = R - 1; a-- > 0;) {
      idx[a] = rem % row_shape[a];
      rem /= row_shape[a];
      xoff += idx[a] * x.stride(a);
      goff += idx[a] * dout.stride(a);
      doff += idx[a] * dx.stride(a);
      ioff += idx[a] * inv_rms.stride(a);
    }
    const T* xr = x.data() + xoff;
    const T* gr = dout.data() + goff;
    T* dr = dx.data() + doff;
    const double inv = static_cast<double>(inv_rms.data()[ioff]);
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
  }
  for (index_t j = 0; want_dw && j < dim; ++j) dweight(j) = static_cast<T>(dw[j]);
}

/// @}

DIFFATTN_END_NAMESPACE
