#include <cmath>
#include <limits>

#include <catch2/catch.hpp>
#include <diffattn/softmax.hpp>

#include "support.hpp"

using diffattn::Matrix;
using diffattn::Vector;

namespace {
// Plain float64 softmax of one row with long double sums: the oracle.
std::vector<double> oracle_row(const std::vector<double>& x, double* lse) {
  double m = -std::numeric_limits<double>::infinity();
  for (double v : x) m = std::max(m, v);
  long double s = 0;
  for (double v : x) s += std::exp(static_cast<long double>(v - m));
  std::vector<double> p(x.size());
  for (std::size_t j = 0; j < x.size(); ++j)
    p[j] = static_cast<double>(std::exp(static_cast<long double>(x[j] - m)) / s);
  *lse = m + static_cast<double>(std::log(s));
  return p;
}
}  // namespace

TEMPLATE_TEST_CASE("softmax matches the float64 oracle and keeps log-sum-exp", "[softmax]", float,
                   double) {
  const double tol = std::is_same<TestType, float>::value ? 2e-6 : 1e-14;
  for (int cols : {1, 2, 7, 33, 113}) {
    Matrix<TestType> x = test::random_matrix<TestType>(5, cols, 100 + cols, 3.0);
    Vector<TestType> lse;
    const Matrix<TestType> p = diffattn::softmax(x, &lse);
    REQUIRE(lse.size() == 5);
    for (int i = 0; i < 5; ++i) {
      std::vector<double> row(cols);
      for (int j = 0; j < cols; ++j) row[j] = static_cast<double>(x(i, j));
      double ref_lse = 0;
      const std::vector<double> ref = oracle_row(row, &ref_lse);
      double sum = 0;
      for (int j = 0; j < cols; ++j) {
        REQUIRE(std::abs(p(i, j) - ref[j]) <= tol);
        sum += p(i, j);
      }
      CHECK(std::abs(sum - 1.0) <= tol * cols);
      CHECK(std::abs(static_cast<double>(lse(i)) - ref_lse) <= tol * (1 + std::abs(ref_lse)));
    }
  }
}

TEST_CASE("softmax: logits of 1e4 do not overflow in float", "[softmax]") {
  Matrix<float> x(1, 3);
  x << 1e4f, 1e4f - 1.0f, -1e4f;
  Vector<float> lse;
  const Matrix<float> p = diffattn::softmax(x, &lse);
  const double e = std::exp(-1.0);
  CHECK(p(0, 0) == Approx(1 / (1 + e)).epsilon(1e-6));
  CHECK(p(0, 1) == Approx(e / (1 + e)).epsilon(1e-6));
  CHECK(p(0, 2) == 0.0f);
  CHECK(std::isfinite(lse(0)));
  CHECK(lse(0) == Approx(1e4 + std::log1p(e)).epsilon(1e-6));
}

TEST_CASE("softmax: -inf is masked, fully masked rows give zeros", "[softmax]") {
  const float inf = std::numeric_limits<float>::infinity();
  Matrix<float> x(3, 4);
  x << 0.5f, -inf, 1.5f, -inf,  //
      -inf, -inf, -inf, -inf,   //
      2.0f, 2.0f, 2.0f, 2.0f;
  Vector<float> lse;
  const Matrix<float> p = diffattn::softmax(x, &lse);
  CHECK(p(0, 1) == 0.0f);
  CHECK(p(0, 3) == 0.0f);
  CHECK(p(0, 0) == Approx(1 / (1 + std::exp(1.0))));
  CHECK(p(0, 0) + p(0, 2) == Approx(1.0f));
  for (int j = 0; j < 4; ++j) {
    CHECK(p(1, j) == 0.0f);
    CHECK(p(2, j) == Approx(0.25f));
  }
  CHECK(lse(1) == -inf);
  CHECK(lse(2) == Approx(2.0 + std::log(4.0)));
}

TEST_CASE("softmax: +inf shares the mass, NaN stays in its row", "[softmax]") {
  const double inf = std::numeric_limits<double>::infinity();
  Matrix<double> x(3, 3);
  x << inf, 1.0, inf,          //
      0.0, std::nan(""), 1.0,  //
      0.0, 0.0, 0.0;
  const Matrix<double> p = diffattn::softmax(x);
  CHECK(p(0, 0) == 0.5);
  CHECK(p(0, 1) == 0.0);
  CHECK(p(0, 2) == 0.5);
  for (int j = 0; j < 3; ++j) {
    CHECK(std::isnan(p(1, j)));
    CHECK(p(2, j) == Approx(1.0 / 3));
  }
}

TEST_CASE("softmax: empty rows and columns", "[softmax]") {
  Matrix<float> none(0, 4);
  CHECK(diffattn::softmax(none).rows() == 0);
  Matrix<float> width0(2, 0);
  Vector<float> lse;
  const Matrix<float> p = diffattn::softmax(width0, &lse);
  CHECK(p.rows() == 2);
  CHECK(p.cols() == 0);
  CHECK(lse(0) == -std::numeric_limits<float>::infinity());
}
