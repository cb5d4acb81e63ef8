/// \file
/// Row-wise softmax with masking and log-sum-exp.
#pragma once

#include <cmath>

#include "config.hpp"
#include "detail/kernel/softmax.hpp"
#include "matrix.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup materialised
/// @{

/// Row-wise softmax of `logits` (rows x cols), numerically stable for any
/// finite logits (the row max is subtracted before exp, so 1e4 cannot overflow).
///
/// - an entry of -inf is masked: its weight is exactly 0;
/// - a row whose entries are all -inf (or a row of width 0) gives zeros, not NaN,
///   and its log-sum-exp is -inf;
/// - +inf entries share the row's mass equally;
/// - a NaN makes its own row NaN and touches no other row.
///
/// If `lse` is given it receives each row's log-sum-exp, log(sum_j exp(x_ij)),
/// the quantity the backward pass of attention needs.
template <class Derived>
Matrix<typename Derived::Scalar> softmax(const Eigen::MatrixBase<Derived>& logits,
                                         Vector<typename Derived::Scalar>* lse = nullptr) {
  using T = typename Derived::Scalar;
  Matrix<T> p = logits;
  if (lse) lse->resize(p.rows());
  for (index_t i = 0; i < p.rows(); ++i) {
    T* row = p.row(i).data();
    const detail::RowStats<T> st = detail::exp_row(row, p.cols(), /*has_masked=*/true);
    if (st.sum > T(0)) {
      const T inv = T(1) / st.sum;
      for (index_t j = 0; j < p.cols(); ++j) row[j] *= inv;
    }
    if (lse) (*lse)(i) = detail::row_lse(st);
  }
  return p;
}

/// @}

DIFFATTN_END_NAMESPACE
