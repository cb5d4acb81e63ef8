#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/lambda.hpp>

#include "support.hpp"

using diffattn::TensorView;

TEST_CASE("lambda_init follows 0.8 - 0.6 exp(-0.3 depth)", "[lambda]") {
  double prev = -1;
  for (int depth = 0; depth < 32; ++depth) {
    const double want = 0.8 - 0.6 * std::exp(-0.3 * depth);
    REQUIRE(diffattn::lambda_init(depth) == Approx(want).epsilon(1e-15));
    REQUIRE(diffattn::lambda_init(depth) > prev);  // monotone
    prev = diffattn::lambda_init(depth);
  }
  CHECK(diffattn::lambda_init(0) == Approx(0.2).epsilon(1e-15));
  CHECK(diffattn::lambda_init(1) == Approx(0.8 - 0.6 * 0.7408182206817179).epsilon(1e-12));
  CHECK(std::abs(diffattn::lambda_init(200) - 0.8) < 1e-12);
  CHECK(diffattn::lambda_init(31) < 0.8);
  test::require_error([] { diffattn::lambda_init(-1); }, {"lambda_init", "depth", "-1"});
}

TEST_CASE("lambda_full = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init", "[lambda]") {
  const int d = 16;
  diffattn::detail::Rng rng(7);
  std::vector<float> lq1(d), lk1(d), lq2(d), lk2(d);
  double dot1 = 0, dot2 = 0;
  for (int i = 0; i < d; ++i) {
    lq1[i] = static_cast<float>(0.1 * rng.normal());
    lk1[i] = static_cast<float>(0.1 * rng.normal());
    lq2[i] = static_cast<float>(0.1 * rng.normal());
    lk2[i] = static_cast<float>(0.1 * rng.normal());
    dot1 += double(lq1[i]) * lk1[i];
    dot2 += double(lq2[i]) * lk2[i];
  }
  TensorView<const float, 1> q1(lq1.data(), {d}), k1(lk1.data(), {d}), q2(lq2.data(), {d}),
      k2(lk2.data(), {d});
  const double init = diffattn::lambda_init(5);
  const double want = std::exp(dot1) - std::exp(dot2) + init;
  const auto terms = diffattn::lambda_terms<float>(q1, k1, q2, k2, init);
  CHECK(terms.e1 == Approx(std::exp(dot1)).epsilon(1e-14));
  CHECK(terms.e2 == Approx(std::exp(dot2)).epsilon(1e-14));
  CHECK(terms.value() == Approx(want).epsilon(1e-14));
  CHECK(diffattn::lambda_full<float>(q1, k1, q2, k2, init) == Approx(want).epsilon(1e-6));
  // Zero vectors give exactly lambda_init.
  std::vector<float> z(d, 0.0f);
  TensorView<const float, 1> zv(z.data(), {d});
  CHECK(diffattn::lambda_full<float>(zv, zv, zv, zv, init) == Approx(init).epsilon(1e-7));
  // Strided vectors: every other element.
  std::vector<float> wide(2 * d, 0.0f);
  for (int i = 0; i < d; ++i) wide[2 * i] = lq1[i];
  TensorView<const float, 1> strided(wide.data(), {d}, {2});
  CHECK(diffattn::lambda_full<float>(strided, k1, q2, k2, init) ==
        Approx(diffattn::lambda_full<float>(q1, k1, q2, k2, init)));
}

TEST_CASE("lambda_full rejects mismatched lengths and non-finite values", "[lambda]") {
  std::vector<double> a(8, 0.0), b(7, 0.0), big(8, 30.0);
  TensorView<const double, 1> va(a.data(), {8}), vb(b.data(), {7}), vbig(big.data(), {8});
  test::require_error([&] { diffattn::lambda_full<double>(va, va, vb, va, 0.2); },
                      {"lambda_full", "lambda_q2", "(7)", "(8)"});
  test::require_error([&] { diffattn::lambda_full<double>(va, vb, va, va, 0.2); },
                      {"lambda_full", "lambda_k1", "(7)"});
  test::require_error([&] { diffattn::lambda_full<double>(va, va, va, va, std::nan("")); },
                      {"lambda_full", "lambda_init", "finite"});
  // exp(8 * 900) overflows double.
  test::require_error([&] { diffattn::lambda_full<double>(vbig, vbig, va, va, 0.2); },
                      {"lambda_full", "not finite"});
}

TEMPLATE_TEST_CASE("lambda_sigmoid is the logistic function without overflow", "[lambda]", float,
                   double) {
  using T = TestType;
  for (double x : {-30.0, -3.0, -0.5, 0.0, 0.25, 2.0, 40.0}) {
    const double want = 1.0 / (1.0 + std::exp(-x));
    CHECK(diffattn::lambda_sigmoid<T>(static_cast<T>(x)) == Approx(want).epsilon(1e-6));
  }
  const T inf = std::numeric_limits<T>::infinity();
  CHECK(diffattn::lambda_sigmoid<T>(-inf) == T(0));
  CHECK(diffattn::lambda_sigmoid<T>(inf) == T(1));
  CHECK(diffattn::lambda_sigmoid<T>(T(-1e4)) == T(0));
  CHECK(diffattn::lambda_sigmoid<T>(T(1e4)) == T(1));
  CHECK(std::isnan(diffattn::lambda_sigmoid<T>(std::numeric_limits<T>::quiet_NaN())));
}
