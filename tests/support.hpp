// Shared helpers of the tests: random data, float64 oracles, error checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include <catch2/catch.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/error.hpp>
#include <diffattn/matrix.hpp>

namespace test {

using diffattn::index_t;
using diffattn::Matrix;

/// N(0, sigma^2) matrix, deterministic from the seed.
template <class T>
Matrix<T> random_matrix(index_t rows, index_t cols, std::uint64_t seed, double sigma = 1.0) {
  diffattn::detail::Rng rng(seed);
  Matrix<T> m(rows, cols);
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) m(i, j) = static_cast<T>(sigma * rng.normal());
  return m;
}

/// Runs f and requires a diffattn::error whose message holds every word.
template <class F>
void require_error(F&& f, std::initializer_list<const char*> words) {
  bool thrown = false;
  std::string msg;
  try {
    f();
  } catch (const diffattn::error& e) {
    thrown = true;
    msg = e.what();
  }
  INFO("message: " << msg);
  REQUIRE(thrown);
  for (const char* w : words) {
    INFO("expected word: " << w);
    CHECK(msg.find(w) != std::string::npos);
  }
}

/// Largest |a - b| over all entries.
template <class A, class B>
double max_abs_diff(const A& a, const B& b) {
  REQUIRE(a.rows() == b.rows());
  REQUIRE(a.cols() == b.cols());
  double m = 0;
  for (index_t i = 0; i < a.rows(); ++i)
    for (index_t j = 0; j < a.cols(); ++j)
      m = std::max(m, std::abs(static_cast<double>(a(i, j)) - static_cast<double>(b(i, j))));
  return m;
}

}  // namespace test
