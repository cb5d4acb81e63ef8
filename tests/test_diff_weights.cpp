#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/kernel/mask.hpp>
#include <diffattn/diff_weights.hpp>

#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Matrix;

namespace {
// Independent float64 oracle: scalar loops, std::exp, no shared helper.
Matrix<double> oracle(const Matrix<double>& q1, const Matrix<double>& k1, const Matrix<double>& q2,
                      const Matrix<double>& k2, double lambda, bool causal) {
  const index_t n = q1.rows(), m = k1.rows(), d = q1.cols();
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  Matrix<double> w = Matrix<double>::Zero(n, m);
  for (int map = 0; map < 2; ++map) {
    const Matrix<double>& q = map == 0 ? q1 : q2;
    const Matrix<double>& k = map == 0 ? k1 : k2;
    const double coef = map == 0 ? 1.0 : -lambda;
    for (index_t i = 0; i < n; ++i) {
      std::vector<double> logit(m);
      std::vector<bool> keep(m);
      double mx = -std::numeric_limits<double>::infinity();
      for (index_t j = 0; j < m; ++j) {
        keep[j] = !causal || j <= i + (m - n);
        double dot = 0;
        for (index_t t = 0; t < d; ++t) dot += q(i, t) * k(j, t);
        logit[j] = s * dot;
        if (keep[j]) mx = std::max(mx, logit[j]);
      }
      double sum = 0;
      for (index_t j = 0; j < m; ++j) sum += keep[j] ? std::exp(logit[j] - mx) : 0.0;
      for (index_t j = 0; j < m; ++j)
        if (keep[j]) w(i, j) += coef * std::exp(logit[j] - mx) / sum;
    }
  }
  return w;
}

struct Case {
  index_t n, m, d;
  bool causal;
};
}  // namespace

TEST_CASE("diff_weights<double> matches the scalar float64 oracle", "[diff_weights]") {
  const Case cases[] = {{6, 6, 8, false},  {6, 6, 8, true},   {3, 5, 4, true},  {5, 3, 4, true},
                        {1, 37, 16, true}, {13, 7, 5, false}, {17, 29, 3, true}};
  std::uint64_t seed = 1;
  for (const Case& c : cases) {
    for (double lambda : {-0.3, 0.0, 0.8, 1.25}) {
      const Matrix<double> q1 = test::random_matrix<double>(c.n, c.d, seed++, 2.0);
      const Matrix<double> k1 = test::random_matrix<double>(c.m, c.d, seed++, 2.0);
      const Matrix<double> q2 = test::random_matrix<double>(c.n, c.d, seed++, 2.0);
      const Matrix<double> k2 = test::random_matrix<double>(c.m, c.d, seed++, 2.0);
      AttentionOptions opt;
      opt.causal = c.causal;
      const Matrix<double> w = diffattn::diff_weights(q1, k1, q2, k2, lambda, opt);
      INFO("n=" << c.n << " m=" << c.m << " d=" << c.d << " causal=" << c.causal
                << " lambda=" << lambda);
      REQUIRE(test::max_abs_diff(w, oracle(q1, k1, q2, k2, lambda, c.causal)) < 1e-13);
    }
  }
}

TEMPLATE_TEST_CASE("rows of W sum to 1 - lambda", "[diff_weights]", float, double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 1e-6 : 1e-12;
  const Case cases[] = {{6, 6, 8, false}, {6, 6, 8, true}, {4, 11, 8, true}, {9, 9, 16, false}};
  std::uint64_t seed = 50;
  for (const Case& c : cases) {
    for (double lambda : {-0.3, 0.0, 0.2, 0.8, 1.25}) {
      const Matrix<T> q1 = test::random_matrix<T>(c.n, c.d, seed++);
      const Matrix<T> k1 = test::random_matrix<T>(c.m, c.d, seed++);
      const Matrix<T> q2 = test::random_matrix<T>(c.n, c.d, seed++);
      const Matrix<T> k2 = test::random_matrix<T>(c.m, c.d, seed++);
      AttentionOptions opt;
      opt.causal = c.causal;
      const Matrix<T> w = diffattn::diff_weights(q1, k1, q2, k2, static_cast<T>(lambda), opt);
      for (index_t i = 0; i < c.n; ++i) {
        double sum = 0;
        for (index_t j = 0; j < c.m; ++j) sum += static_cast<double>(w(i, j));
        INFO("row " << i << " causal " << c.causal << " lambda " << lambda);
        REQUIRE(std::abs(sum - (1.0 - static_cast<T>(lambda))) <= tol);
      }
    }
  }
}

TEST_CASE("W has negative weights; lambda = 0 gives plain softmax", "[diff_weights]") {
  const Matrix<double> q1 = test::random_matrix<double>(6, 8, 11, 2.0);
  const Matrix<double> k1 = test::random_matrix<double>(6, 8, 12, 2.0);
  const Matrix<double> q2 = test::random_matrix<double>(6, 8, 13, 2.0);
  const Matrix<double> k2 = test::random_matrix<double>(6, 8, 14, 2.0);
  const Matrix<double> w = diffattn::diff_weights(q1, k1, q2, k2, 0.8);
  CHECK((w.array() < 0).count() > 0);

  const Matrix<double> w0 = diffattn::diff_weights(q1, k1, q2, k2, 0.0);
  CHECK((w0.array() < 0).count() == 0);
  const Matrix<double> plain =
      diffattn::softmax(Matrix<double>(q1 * k1.transpose() / std::sqrt(8.0)));
  CHECK(test::max_abs_diff(w0, plain) < 1e-15);
}

TEST_CASE("causal keep/mask pattern for N = 3, M = 5 follows j <= i + (M - N)",
          "[diff_weights][mask]") {
  const int pattern[3][5] = {{1, 1, 1, 0, 0}, {1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}};
  const Matrix<double> q = test::random_matrix<double>(3, 4, 21);
  const Matrix<double> k = test::random_matrix<double>(5, 4, 22);
  AttentionOptions opt;
  opt.causal = true;
  // lambda = 0: W = A1, strictly positive exactly where a key is kept.
  const Matrix<double> w = diffattn::diff_weights(q, k, q, k, 0.0, opt);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) {
      INFO("i=" << i << " j=" << j);
      CHECK((w(i, j) > 0) == (pattern[i][j] == 1));
      CHECK((w(i, j) == 0) == (pattern[i][j] == 0));
      CHECK(diffattn::detail::causal_visible(i, j, 3, 5) == (pattern[i][j] == 1));
    }
  CHECK(diffattn::detail::causal_key_end(0, 3, 5) == 3);
  CHECK(diffattn::detail::causal_key_end(2, 3, 5) == 5);
  CHECK(diffattn::detail::causal_key_end(0, 5, 3) == 0);
}

TEST_CASE("fully masked rows give zeros, not NaN", "[diff_weights]") {
  // N > M causal: the first N - M queries see no key.
  const Matrix<float> q = test::random_matrix<float>(5, 4, 31);
  const Matrix<float> k = test::random_matrix<float>(3, 4, 32);
  AttentionOptions opt;
  opt.causal = true;
  diffattn::Vector<float> l1, l2;
  const Matrix<float> w = diffattn::diff_weights(q, k, q, k, 0.5f, opt, &l1, &l2);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 3; ++j) CHECK(w(i, j) == 0.0f);
    CHECK(l1(i) == -std::numeric_limits<float>::infinity());
  }
  CHECK(w.allFinite());
  CHECK(w.row(4).sum() == Approx(0.5f));
  CHECK(std::isfinite(l2(4)));
}

TEST_CASE("diff_weights: float stays close to the float64 map with large logits",
          "[diff_weights]") {
  // sigma 20 gives logits in the hundreds: a naive exp would overflow float.
  const Matrix<double> q1 = test::random_matrix<double>(7, 8, 41, 20.0);
  const Matrix<double> k1 = test::random_matrix<double>(9, 8, 42, 20.0);
  const Matrix<double> q2 = test::random_matrix<double>(7, 8, 43, 20.0);
  const Matrix<double> k2 = test::random_matrix<double>(9, 8, 44, 20.0);
  const Matrix<double> wd = diffattn::diff_weights(q1, k1, q2, k2, 0.8);
  const Matrix<float> wf = diffattn::diff_weights<float>(q1.cast<float>(), k1.cast<float>(),
                                                         q2.cast<float>(), k2.cast<float>(), 0.8f);
  CHECK(wf.allFinite());
  CHECK(test::max_abs_diff(wf, wd) < 1e-3);
}

TEST_CASE("diff_weights: bad input throws diffattn::error naming the shapes", "[diff_weights]") {
  const Matrix<float> q = test::random_matrix<float>(3, 8, 1);
  const Matrix<float> k = test::random_matrix<float>(5, 8, 2);
  const Matrix<float> k7 = test::random_matrix<float>(5, 7, 3);
  const Matrix<float> q4 = test::random_matrix<float>(4, 8, 4);
  const Matrix<float> k6 = test::random_matrix<float>(6, 8, 5);
  const Matrix<float> empty_d(3, 0), empty_k(5, 0);
  test::require_error([&] { diffattn::diff_weights(q, k7, q, k7, 0.5f); },
                      {"diff_weights", "k1", "(5, 7)", "d = 8", "(3, 8)"});
  test::require_error([&] { diffattn::diff_weights(q, k, q4, k, 0.5f); },
                      {"diff_weights", "q2", "(4, 8)", "(3, 8)"});
  test::require_error([&] { diffattn::diff_weights(q, k, q, k6, 0.5f); },
                      {"diff_weights", "k2", "(6, 8)", "(5, 8)"});
  test::require_error([&] { diffattn::diff_weights(empty_d, empty_k, empty_d, empty_k, 0.5f); },
                      {"diff_weights", "q1", "(3, 0)", "d must be >= 1"});
  test::require_error(
      [&] { diffattn::diff_weights(q, k, q, k, std::numeric_limits<float>::quiet_NaN()); },
      {"diff_weights", "lambda", "finite"});
  test::require_error(
      [&] { diffattn::diff_weights(q, k, q, k, std::numeric_limits<float>::infinity()); },
      {"diff_weights", "lambda", "finite"});
  AttentionOptions bad;
  bad.scale = -1;
  test::require_error([&] { diffattn::diff_weights(q, k, q, k, 0.5f, bad); },
                      {"diff_weights", "scale"});
  // Zero queries or keys are fine: an empty result, or rows of zeros.
  const Matrix<float> q0(0, 8), k0(0, 8);
  CHECK(diffattn::diff_weights(q0, k, q0, k, 0.5f).rows() == 0);
  const Matrix<float> none = diffattn::diff_weights(q, k0, q, k0, 0.5f);
  CHECK(none.rows() == 3);
  CHECK(none.cols() == 0);
}
