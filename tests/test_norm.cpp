#include <catch2/catch.hpp>
#include <cmath>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/norm.hpp>

#include "support.hpp"

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;

namespace {
template <class T, std::size_t R>
Tensor<T, R> random_tensor(std::array<index_t, R> shape, std::uint64_t seed, double sigma = 1) {
  Tensor<T, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(sigma * rng.normal());
  return t;
}
}  // namespace

TEMPLATE_TEST_CASE("rms_norm matches the formula, with and without weight", "[norm]", float,
                   double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 2e-6 : 1e-14;
  const index_t B = 2, N = 3, H = 4, D = 10;
  const Tensor<T, 4> x = random_tensor<T, 4>({B, N, H, D}, 1, 3.0);
  const Tensor<T, 1> w = random_tensor<T, 1>({D}, 2);
  for (bool affine : {false, true}) {
    for (double scale : {1.0, 0.35}) {
      Tensor<T, 4> y({B, N, H, D});
      Tensor<T, 3> inv({B, N, H});
      diffattn::rms_norm<T>(x, affine ? w.view() : TensorView<const T, 1>(), y.view(), 1e-5, scale,
                            inv.view());
      double err = 0;
      for (index_t b = 0; b < B; ++b)
        for (index_t n = 0; n < N; ++n)
          for (index_t h = 0; h < H; ++h) {
            double ms = 0;
            for (index_t j = 0; j < D; ++j) ms += double(x(b, n, h, j)) * double(x(b, n, h, j));
            ms /= D;
            const double r = 1.0 / std::sqrt(ms + 1e-5);
            CHECK(std::abs(double(inv(b, n, h)) - r) <= tol * r);
            for (index_t j = 0; j < D; ++j) {
              const double ref = scale * double(x(b, n, h, j)) * r * (affine ? double(w(j)) : 1.0);
              err = std::max(err, std::abs(ref - double(y(b, n, h, j))));
            }
          }
      INFO("affine=" << affine << " scale=" << scale);
      CHECK(err < 10 * tol);
    }
  }
}

TEST_CASE("rms_norm output has unit root mean square; works in place and strided", "[norm]") {
  const Tensor<double, 3> x = random_tensor<double, 3>({4, 5, 12}, 3, 7.0);
  Tensor<double, 3> y = x;
  diffattn::rms_norm<double>(y.view(), {}, y.view(), 0.0);
  for (index_t a = 0; a < 4; ++a)
    for (index_t b = 0; b < 5; ++b) {
      double ms = 0;
      for (index_t j = 0; j < 12; ++j) ms += y(a, b, j) * y(a, b, j);
      CHECK(std::abs(ms / 12 - 1.0) < 1e-13);
    }
  // A strided (transposed rows) input and output give the same numbers.
  Tensor<double, 3> xt({5, 4, 12});
  for (index_t a = 0; a < 4; ++a)
    for (index_t b = 0; b < 5; ++b)
      for (index_t j = 0; j < 12; ++j) xt(b, a, j) = x(a, b, j);
  TensorView<const double, 3> xv(xt.data(), {4, 5, 12}, {12, 48, 1});
  Tensor<double, 3> z({4, 5, 12});
  diffattn::rms_norm<double>(xv, {}, z.view(), 0.0);
  for (index_t i = 0; i < z.size(); ++i) CHECK(z.data()[i] == y.data()[i]);
}

TEST_CASE("rms_norm of a zero row is zero (eps keeps it finite)", "[norm]") {
  Tensor<float, 2> x({2, 4});
  Tensor<float, 2> y({2, 4});
  diffattn::rms_norm<float>(x, {}, y.view());
  for (index_t i = 0; i < y.size(); ++i) CHECK(y.data()[i] == 0.0f);
}

TEST_CASE("rms_norm refuses mismatched shapes and bad eps", "[norm]") {
  Tensor<float, 3> x({2, 3, 4});
  Tensor<float, 3> bad({2, 3, 5});
  Tensor<float, 1> w({5});
  test::require_error([&] { diffattn::rms_norm<float>(x, {}, bad.view()); },
                      {"rms_norm", "out has shape (2, 3, 5)", "(2, 3, 4)"});
  Tensor<float, 3> y({2, 3, 4});
  test::require_error([&] { diffattn::rms_norm<float>(x, w, y.view()); },
                      {"rms_norm", "weight has shape (5)", "(4)"});
  test::require_error([&] { diffattn::rms_norm<float>(x, {}, y.view(), -1.0); }, {"eps"});
  Tensor<float, 2> inv({3, 2});
  test::require_error([&] { diffattn::rms_norm<float>(x, {}, y.view(), 1e-5, 1.0, inv.view()); },
                      {"inv_rms has shape (3, 2)", "expected (2, 3)"});
}
