#!/bin/sh
# Doxygen's INPUT_FILTER (docs/Doxyfile.in): prints the header $1 as Doxygen
# should read it. Lines are neither added nor removed, so warnings keep the
# header's line numbers. The headers themselves are unchanged.
#  1. The deduction blockers of detail/core/traits.hpp are spelled as the types they
#     stand for: the reference shows TensorView<const T, 4> q where the code
#     says detail::nondeduced_view<const T, 4> q (the same type; see the main
#     page).
#  2. docs/doxygen_filter.awk keeps the comments' indented blocks (shape
#     lists, formulas, mask diagrams) preformatted.
dir=$(dirname "$0")
sed -E \
  -e 's/detail::nondeduced_view</TensorView</g' \
  -e 's/detail::nondeduced_t<(T|compute_t<T>)>/\1/g' \
  -e 's/detail::nondeduced_t<detail::MatrixRef<T>>/Eigen::Ref<const Matrix<T>>/g' \
  -e 's/detail::MatrixRef<T>/Eigen::Ref<const Matrix<T>>/g' \
  "$1" | awk -f "$dir/doxygen_filter.awk"
