#include <catch2/catch.hpp>
#include <cmath>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/rope.hpp>
#include <vector>

#include "support.hpp"

using diffattn::index_t;
using diffattn::Tensor;

namespace {
template <class T>
Tensor<T, 4> random_tensor(std::array<index_t, 4> shape, std::uint64_t seed) {
  Tensor<T, 4> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(rng.normal());
  return t;
}
}  // namespace

TEMPLATE_TEST_CASE("apply_rope matches the interleaved rotary formula", "[rope]", float, double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 2e-6 : 1e-14;
  for (double base : {10000.0, 500.0}) {
    for (index_t offset : {index_t(0), index_t(7), index_t(4000)}) {
      const Tensor<T, 4> x = random_tensor<T>({2, 5, 3, 8}, 11);
      Tensor<T, 4> y = x;
      diffattn::apply_rope<T>(y.view(), offset, base);
      double err = 0;
      for (index_t b = 0; b < 2; ++b)
        for (index_t n = 0; n < 5; ++n)
          for (index_t h = 0; h < 3; ++h)
            for (index_t i = 0; i < 4; ++i) {
              // theta_i = base^(-2i/D), angle = (offset + n) theta_i
              const long double theta = std::pow(static_cast<long double>(base), -2.0L * i / 8.0L);
              const long double ang = static_cast<long double>(offset + n) * theta;
              const long double a = x(b, n, h, 2 * i), c = x(b, n, h, 2 * i + 1);
              const long double y0 = a * std::cos(ang) - c * std::sin(ang);
              const long double y1 = a * std::sin(ang) + c * std::cos(ang);
              err = std::max(err, static_cast<double>(std::fabs(y0 - y(b, n, h, 2 * i))));
              err = std::max(err, static_cast<double>(std::fabs(y1 - y(b, n, h, 2 * i + 1))));
            }
      INFO("base=" << base << " offset=" << offset);
      // Positions of several thousand: the angle itself carries ~pos * eps.
      CHECK(err < tol * (1.0 + static_cast<double>(offset)));
    }
  }
}

TEST_CASE("position 0 is the identity; a zero-width head is a no-op", "[rope]") {
  const Tensor<double, 4> x = random_tensor<double>({1, 1, 2, 6}, 3);
  Tensor<double, 4> y = x;
  diffattn::apply_rope<double>(y.view(), 0);
  for (index_t i = 0; i < x.size(); ++i) CHECK(y.data()[i] == x.data()[i]);
  Tensor<double, 4> empty({2, 3, 4, 0});
  diffattn::apply_rope<double>(empty.view(), 5);
}

TEST_CASE("rotation preserves the norm of every head vector", "[rope]") {
  const Tensor<double, 4> x = random_tensor<double>({2, 9, 4, 16}, 5);
  Tensor<double, 4> y = x;
  diffattn::apply_rope<double>(y.view(), 3);
  for (index_t b = 0; b < 2; ++b)
    for (index_t n = 0; n < 9; ++n)
      for (index_t h = 0; h < 4; ++h) {
        double nx = 0, ny = 0;
        for (index_t j = 0; j < 16; ++j) {
          nx += x(b, n, h, j) * x(b, n, h, j);
          ny += y(b, n, h, j) * y(b, n, h, j);
        }
        CHECK(std::abs(nx - ny) < 1e-12 * nx);
      }
}

TEST_CASE("q_m . k_n depends on m - n only", "[rope]") {
  const Tensor<double, 4> q = random_tensor<double>({1, 1, 1, 32}, 21);
  const Tensor<double, 4> k = random_tensor<double>({1, 1, 1, 32}, 22);
  auto dot_at = [&](index_t m, index_t n) {
    Tensor<double, 4> qm = q, kn = k;
    diffattn::apply_rope<double>(qm.view(), m);
    diffattn::apply_rope<double>(kn.view(), n);
    double s = 0;
    for (index_t j = 0; j < 32; ++j) s += qm.data()[j] * kn.data()[j];
    return s;
  };
  for (index_t delta : {index_t(0), index_t(1), index_t(3), index_t(-4), index_t(17)}) {
    const double ref = dot_at(40 + delta, 40);
    for (index_t n : {index_t(20), index_t(100), index_t(1234)}) {
      INFO("delta=" << delta << " n=" << n);
      CHECK(std::abs(dot_at(n + delta, n) - ref) < 1e-10);
    }
  }
  // and it does depend on the distance
  CHECK(std::abs(dot_at(5, 0) - dot_at(6, 0)) > 1e-6);
}

TEST_CASE("apply_rope_inverse undoes apply_rope", "[rope]") {
  const Tensor<double, 4> x = random_tensor<double>({2, 7, 3, 10}, 8);
  Tensor<double, 4> y = x;
  diffattn::apply_rope<double>(y.view(), 12, 1000);
  diffattn::apply_rope_inverse<double>(y.view(), 12, 1000);
  for (index_t i = 0; i < x.size(); ++i) CHECK(std::abs(y.data()[i] - x.data()[i]) < 1e-14);
}

TEST_CASE("strided views rotate like contiguous ones", "[rope]") {
  // (B, H, N, D) memory seen as (B, N, H, D) through strides.
  const index_t B = 2, N = 5, H = 3, D = 6;
  const Tensor<double, 4> bhnd = random_tensor<double>({B, H, N, D}, 9);
  Tensor<double, 4> strided = bhnd;
  diffattn::TensorView<double, 4> v(strided.data(), {B, N, H, D}, {H * N * D, D, N * D, 1});
  diffattn::apply_rope<double>(v, 2);
  Tensor<double, 4> contiguous({B, N, H, D});
  for (index_t b = 0; b < B; ++b)
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < D; ++j) contiguous(b, n, h, j) = bhnd(b, h, n, j);
  diffattn::apply_rope<double>(contiguous.view(), 2);
  for (index_t b = 0; b < B; ++b)
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < H; ++h)
        for (index_t j = 0; j < D; ++j) CHECK(v(b, n, h, j) == contiguous(b, n, h, j));
}

TEST_CASE("apply_rope refuses bad arguments", "[rope]") {
  Tensor<float, 4> odd({1, 2, 1, 5});
  test::require_error([&] { diffattn::apply_rope<float>(odd.view()); },
                      {"apply_rope", "head width 5", "even"});
  Tensor<float, 4> x({1, 2, 1, 4});
  test::require_error([&] { diffattn::apply_rope<float>(x.view(), -1); },
                      {"apply_rope", "position_offset", "-1"});
  test::require_error([&] { diffattn::apply_rope<float>(x.view(), 0, 0.0); }, {"base", "> 0"});
  test::require_error([&] { diffattn::apply_rope_inverse<float>(x.view(), 0, NAN); },
                      {"apply_rope_inverse", "base"});
}
