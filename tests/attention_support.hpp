// Helpers of the kernel tests: random 4-D tensors, float/double copies, errors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/tensor.hpp>

namespace test {

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;

template <class T, std::size_t R>
Tensor<T, R> random_tensor(const std::array<index_t, R>& shape, std::uint64_t seed,
                           double sigma = 1.0) {
  Tensor<T, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(sigma * rng.normal());
  return t;
}

template <class U, class T, std::size_t R>
Tensor<U, R> cast(const Tensor<T, R>& t) {
  Tensor<U, R> u(t.shape());
  for (index_t i = 0; i < t.size(); ++i) u.data()[i] = static_cast<U>(t.data()[i]);
  return u;
}

/// max |a - b| / max |b| over all entries (b is the float64 reference);
/// absolute when b is all zeros.
template <class A, class B, std::size_t R>
double rel_error(const Tensor<A, R>& a, const Tensor<B, R>& b) {
  double num = 0, den = 0;
  for (index_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a.data()[i]), y = static_cast<double>(b.data()[i]);
    num = std::max(num, std::abs(x - y));
    den = std::max(den, std::abs(y));
  }
  return den > 0 ? num / den : num;
}

/// A contiguous copy of a rank-4 view of any strides.
template <class T>
Tensor<std::remove_const_t<T>, 4> contiguous(TensorView<T, 4> view) {
  Tensor<std::remove_const_t<T>, 4> c(view.shape());
  for (index_t a = 0; a < view.shape(0); ++a)
    for (index_t b = 0; b < view.shape(1); ++b)
      for (index_t h = 0; h < view.shape(2); ++h)
        for (index_t x = 0; x < view.shape(3); ++x) c(a, b, h, x) = view(a, b, h, x);
  return c;
}

template <class T, std::size_t R>
bool bitwise_equal(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  if (a.shape() != b.shape()) return false;
  return std::equal(a.data(), a.data() + a.size(), b.data(),
                    [](T x, T y) { return std::memcmp(&x, &y, sizeof(T)) == 0; });
}

template <class T, std::size_t R>
bool all_finite(const Tensor<T, R>& t) {
  return std::all_of(t.data(), t.data() + t.size(), [](T x) { return std::isfinite(x); });
}

}  // namespace test
