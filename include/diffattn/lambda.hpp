/// \file
/// The differential weight lambda: depth schedule, V1 re-parameterisation, V2 sigmoid.
#pragma once

#include <cmath>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup layers
/// @{

/// Initial lambda of the layer at 0-based `depth` (the paper's layer l, counted
/// from 1, has depth l - 1): 0.8 - 0.6 * exp(-0.3 * depth). Starts at 0.2 for
/// the first layer and rises monotonically towards 0.8. Throws for depth < 0.
inline double lambda_init(int depth) {
  if (depth < 0)
    detail::fail("lambda_init", "depth must be >= 0 (0-based layer index), got ", depth);
  return 0.8 - 0.6 * std::exp(-0.3 * static_cast<double>(depth));
}

namespace detail {
template <class T>
inline double dot1(const TensorView<const T, 1>& a, const TensorView<const T, 1>& b) {
  double s = 0;
  for (index_t i = 0; i < a.shape(0); ++i)
    s += static_cast<double>(a(i)) * static_cast<double>(b(i));
  return s;
}
}  // namespace detail

/// The two exponentials of V1's lambda, kept for the backward pass:
/// lambda_full = e1 - e2 + lambda_init.
struct LambdaTerms {
  /// exp(lambda_q1 . lambda_k1).
  double e1 = 0;  // exp(lambda_q1 . lambda_k1)
  /// exp(lambda_q2 . lambda_k2).
  double e2 = 0;  // exp(lambda_q2 . lambda_k2)
  /// lambda_init of the layer.
  double init = 0;
  /// lambda_full = e1 - e2 + init.
  double value() const { return e1 - e2 + init; }
};

/// V1's re-parameterised lambda with its parts:
///   lambda_full = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init.
/// The four vectors have one length (the head width d; any strides). Dot
/// products are taken in double. Throws diffattn::error for mismatched lengths
/// or a non-finite result.
template <class T>
LambdaTerms lambda_terms(TensorView<const T, 1> lambda_q1, TensorView<const T, 1> lambda_k1,
                         TensorView<const T, 1> lambda_q2, TensorView<const T, 1> lambda_k2,
                         double lambda_init_value) {
  const index_t d = lambda_q1.shape(0);
  const char* names[] = {"lambda_k1", "lambda_q2", "lambda_k2"};
  const TensorView<const T, 1>* others[] = {&lambda_k1, &lambda_q2, &lambda_k2};
  for (int i = 0; i < 3; ++i) {
    if (others[i]->shape(0) != d)
      detail::fail("lambda_full", names[i], " has shape ", detail::shape_str(others[i]->shape()),
                   ", expected ", detail::shape_str(lambda_q1.shape()), " like lambda_q1");
  }
  if (!std::isfinite(lambda_init_value))
    detail::fail("lambda_full", "lambda_init must be finite, got ", lambda_init_value);
  LambdaTerms t;
  t.e1 = std::exp(detail::dot1(lambda_q1, lambda_k1));
  t.e2 = std::exp(detail::dot1(lambda_q2, lambda_k2));
  t.init = lambda_init_value;
  if (!std::isfinite(t.value()))
    detail::fail("lambda_full", "lambda is not finite (exp(lambda_q1 . lambda_k1) = ", t.e1,
                 ", exp(lambda_q2 . lambda_k2) = ", t.e2, ")");
  return t;
}

/// V1's lambda_full as a value of T; see lambda_terms. Call as
/// `lambda_full<float>(lq1, lk1, lq2, lk2, lambda_init(depth))`.
template <class T>
T lambda_full(TensorView<const T, 1> lambda_q1, TensorView<const T, 1> lambda_k1,
              TensorView<const T, 1> lambda_q2, TensorView<const T, 1> lambda_k2,
              double lambda_init_value) {
  return static_cast<T>(
      lambda_terms<T>(lambda_q1, lambda_k1, lambda_q2, lambda_k2, lambda_init_value).value());
}

/// V2's per-token lambda: sigmoid(logit) = 1 / (1 + exp(-logit)), in (0, 1),
/// computed without overflow for any logit (-inf gives 0, +inf gives 1).
template <class T>
inline T lambda_sigmoid(T logit) {
  if (logit >= T(0)) return T(1) / (T(1) + std::exp(-logit));
  const T e = std::exp(logit);
  return e / (T(1) + e);
}

/// @}

DIFFATTN_END_NAMESPACE
