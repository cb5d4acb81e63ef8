/// \file
/// The materialised single-head differential attention map W = A1 - lambda A2.
#pragma once

#include <cmath>
#include <limits>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "detail/kernel/mask.hpp"
#include "matrix.hpp"
#include "options.hpp"
#include "softmax.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup materialised
/// @{

namespace detail {
template <class T>
using MatrixRef = Eigen::Ref<const Matrix<T>>;

template <class T>
std::string mat_shape(const MatrixRef<T>& m) {
  return cat("(", m.rows(), ", ", m.cols(), ")");
}

/// Scaled, masked logits s * q k^T (N x M), entries outside the band -inf.
template <class T>
Matrix<T> masked_scores(const MatrixRef<T>& q, const MatrixRef<T>& k, T scale,
                        const KeyBand& band) {
  Matrix<T> s = (q * k.transpose()) * scale;
  const index_t n = s.rows(), m = s.cols();
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < m; ++j)
      if (!band.visible(i, j, n, m)) s(i, j) = -std::numeric_limits<T>::infinity();
  return s;
}
}  // namespace detail

/// Single-head differential attention map, materialised (N x M):
///
///     A1 = softmax(s q1 k1^T + mask),  A2 = softmax(s q2 k2^T + mask),
///     W  = A1 - lambda A2.
///
/// Shapes: q1, q2 (N, d); k1, k2 (M, d); the result (N, M). The mask is the
/// options' causal flag and window (AttentionOptions::window_left/right),
/// aligned bottom-right. Every row of W sums to 1 - lambda (a row with no
/// visible key is all zeros). The output of the
/// head is W V for values V (M, 2d in the V1 layout).
///
/// This is the plain, obviously correct path, for analysis, small problems and
/// as the oracle of the tests; it costs O(N M) memory. N or M may be 0 (an
/// empty result); d must be >= 1. Throws diffattn::error on mismatched shapes,
/// a non-finite lambda or bad options. T is deduced from lambda: pass 0.8f for
/// float matrices, or call diff_weights<float>(...).
///
/// If lse1 / lse2 are given they receive each row's log-sum-exp of the scaled,
/// masked scores of map 1 / map 2 (-inf for a fully masked row).
template <class T>
Matrix<T> diff_weights(const detail::nondeduced_t<detail::MatrixRef<T>>& q1,
                       const detail::nondeduced_t<detail::MatrixRef<T>>& k1,
                       const detail::nondeduced_t<detail::MatrixRef<T>>& q2,
                       const detail::nondeduced_t<detail::MatrixRef<T>>& k2, T lambda,
                       const AttentionOptions& options = {}, Vector<T>* lse1 = nullptr,
                       Vector<T>* lse2 = nullptr) {
  constexpr const char* fn = "diff_weights";
  using detail::mat_shape;
  detail::validate_options(fn, options);
  if (q1.cols() < 1)
    detail::fail(fn, "q1 has shape ", mat_shape<T>(q1), ": head width d must be >= 1");
  if (q2.rows() != q1.rows() || q2.cols() != q1.cols())
    detail::fail(fn, "q2 has shape ", mat_shape<T>(q2), ", expected (N, d) = ", mat_shape<T>(q1),
                 " like q1");
  if (k1.cols() != q1.cols())
    detail::fail(fn, "k1 has shape ", mat_shape<T>(k1), ", expected (M, d) with d = ", q1.cols(),
                 " from q1 ", mat_shape<T>(q1));
  if (k2.rows() != k1.rows() || k2.cols() != k1.cols())
    detail::fail(fn, "k2 has shape ", mat_shape<T>(k2), ", expected (M, d) = ", mat_shape<T>(k1),
                 " like k1");
  if (!std::isfinite(static_cast<double>(lambda)))
    detail::fail(fn, "lambda must be finite, got ", lambda);

  const T scale = static_cast<T>(detail::effective_scale(options, q1.cols()));
  const detail::KeyBand band = detail::band_of(options);
  const Matrix<T> a1 = softmax(detail::masked_scores<T>(q1, k1, scale, band), lse1);
  const Matrix<T> a2 = softmax(detail::masked_scores<T>(q2, k2, scale, band), lse2);
  return a1 - lambda * a2;
}

/// @}

DIFFATTN_END_NAMESPACE
