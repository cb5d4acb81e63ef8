#!/bin/sh
# Doxygen's INPUT_FILTER (docs/Doxyfile.in): prints the header $1 with the
# deduction blockers of detail/traits.hpp spelled as the types they stand for,
# so that the reference shows TensorView<const T, 4> q where the code says
# detail::nondeduced_view<const T, 4> q (the same type; see the main page).
# Lines are neither added nor removed: warnings keep the header's line numbers.
exec sed -E \
  -e 's/detail::nondeduced_view</TensorView</g' \
  -e 's/detail::nondeduced_t<(T|compute_t<T>)>/\1/g' \
  -e 's/detail::nondeduced_t<detail::MatrixRef<T>>/Eigen::Ref<const Matrix<T>>/g' \
  -e 's/detail::MatrixRef<T>/Eigen::Ref<const Matrix<T>>/g' \
  "$1"
