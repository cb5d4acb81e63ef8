// Sliding windows (AttentionOptions::window_left / window_right) in the fused
// kernels, the reference path and diff_weights, against an oracle written here
// from the definition, with an explicit mask.
#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/diff_weights.hpp>
#include <diffattn/reference.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using test::cast;
using test::random_tensor;
using test::rel_error;

namespace {

enum class Kind { v1, v2, plain };

struct Case {
  index_t B, N, M, H, Hkv, d;
  bool causal;
  index_t left, right;
};

/// The definition: with c = i + (M - N), key j is visible iff
/// c - left <= j (unless left = -1) and j <= c + right (unless right = -1),
/// causal meaning right = 0.
bool visible(const Case& c, index_t i, index_t j) {
  const index_t diag = i + (c.M - c.N);
  const index_t right = c.causal ? 0 : c.right;
  if (c.left >= 0 && j < diag - c.left) return false;
  if (right >= 0 && j > diag + right) return false;
  return true;
}

AttentionOptions options_of(const Case& c, int threads = 0) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.left;
  o.window_right = c.right;
  o.num_threads = threads;
  return o;
}

/// Masked attention of one map in float64 over an explicit mask: returns the
/// weights (N, M) (zero where masked) and each row's log-sum-exp.
std::vector<double> oracle_map(const Case& c, const Tensor<double, 4>& q, index_t qh,
                               const Tensor<double, 4>& k, index_t kh, index_t b, double scale,
                               std::vector<double>& lse) {
  std::vector<double> a(static_cast<std::size_t>(c.N * c.M), 0.0);
  lse.assign(static_cast<std::size_t>(c.N), -std::numeric_limits<double>::infinity());
  for (index_t i = 0; i < c.N; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    std::vector<double> s(static_cast<std::size_t>(c.M), 0.0);
    for (index_t j = 0; j < c.M; ++j) {
      if (!visible(c, i, j)) continue;
      double dot = 0;
      for (index_t t = 0; t < c.d; ++t) dot += q(b, i, qh, t) * k(b, j, kh, t);
      s[static_cast<std::size_t>(j)] = scale * dot;
      mx = std::max(mx, scale * dot);
    }
    if (mx == -std::numeric_limits<double>::infinity()) continue;  // no visible key
    double sum = 0;
    for (index_t j = 0; j < c.M; ++j)
      if (visible(c, i, j)) sum += std::exp(s[static_cast<std::size_t>(j)] - mx);
    for (index_t j = 0; j < c.M; ++j)
      if (visible(c, i, j))
        a[static_cast<std::size_t>(i * c.M + j)] =
            std::exp(s[static_cast<std::size_t>(j)] - mx) / sum;
    lse[static_cast<std::size_t>(i)] = mx + std::log(sum);
  }
  return a;
}

struct Inputs {
  Tensor<double, 4> q, k, v;
  Tensor<double, 3> logit;
  index_t qheads, kheads, dv, oheads;
};

Inputs make_inputs(Kind kind, const Case& c, std::uint64_t seed) {
  Inputs in;
  in.oheads = c.H;
  in.qheads = kind == Kind::plain ? c.H : 2 * c.H;
  in.kheads = kind == Kind::v1 ? 2 * c.Hkv : c.Hkv;
  in.dv = kind == Kind::v1 ? 2 * c.d : (kind == Kind::v2 ? c.d : c.d + 3);
  in.q = random_tensor<double, 4>({c.B, c.N, in.qheads, c.d}, seed);
  in.k = random_tensor<double, 4>({c.B, c.M, in.kheads, c.d}, seed + 1);
  in.v = random_tensor<double, 4>({c.B, c.M, c.Hkv, in.dv}, seed + 2);
  in.logit = random_tensor<double, 3>({c.B, c.N, c.H}, seed + 3, 2.0);
  return in;
}

/// Output and lse of the oracle.
void oracle(Kind kind, const Case& c, const Inputs& in, double lambda, Tensor<double, 4>& out,
            Tensor<double, 3>& lse) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  out.fill(0.0);
  for (index_t b = 0; b < c.B; ++b)
    for (index_t h = 0; h < c.H; ++h) {
      const index_t qpg = in.qheads / (kind == Kind::v1 ? 2 * c.Hkv : c.Hkv);  // q heads per kv
      std::vector<double> l1, l2;
      std::vector<double> w;
      index_t g = 0;
      if (kind == Kind::plain) {
        g = h / qpg;
        w = oracle_map(c, in.q, h, in.k, g, b, scale, l1);
        for (index_t i = 0; i < c.N; ++i) lse(b, h, i) = l1[static_cast<std::size_t>(i)];
      } else {
        g = kind == Kind::v1 ? h / (c.H / c.Hkv) : 2 * h / qpg;
        const index_t k1 = kind == Kind::v1 ? 2 * g : g, k2 = kind == Kind::v1 ? 2 * g + 1 : g;
        w = oracle_map(c, in.q, 2 * h, in.k, k1, b, scale, l1);
        const auto a2 = oracle_map(c, in.q, 2 * h + 1, in.k, k2, b, scale, l2);
        for (index_t i = 0; i < c.N; ++i) {
          const double lam = kind == Kind::v2 ? 1.0 / (1.0 + std::exp(-in.logit(b, i, h))) : lambda;
          for (index_t j = 0; j < c.M; ++j)
            w[static_cast<std::size_t>(i * c.M + j)] -=
                lam * a2[static_cast<std::size_t>(i * c.M + j)];
          lse(b, 2 * h, i) = l1[static_cast<std::size_t>(i)];
          lse(b, 2 * h + 1, i) = l2[static_cast<std::size_t>(i)];
        }
      }
      for (index_t i = 0; i < c.N; ++i)
        for (index_t j = 0; j < c.M; ++j) {
          if (!visible(c, i, j)) continue;
          for (index_t t = 0; t < in.dv; ++t)
            out(b, i, h, t) += w[static_cast<std::size_t>(i * c.M + j)] * in.v(b, j, g, t);
        }
    }
}

template <class T>
void run(Kind kind, bool reference, const Case& c, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
         const Tensor<T, 4>& v, const Tensor<T, 3>& logit, T lambda, Tensor<T, 4>& out,
         Tensor<T, 3>& lse, int threads = 0) {
  const AttentionOptions o = options_of(c, threads);
  if (kind == Kind::v1) {
    if (reference)
      diffattn::reference::diff_attention_v1<T>(q, k, v, lambda, out, lse, o);
    else
      diffattn::diff_attention_v1<T>(q, k, v, lambda, out, lse, o);
  } else if (kind == Kind::v2) {
    if (reference)
      diffattn::reference::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
    else
      diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
  } else {
    if (reference)
      diffattn::reference::attention<T>(q, k, v, out, lse, o);
    else
      diffattn::attention<T>(q, k, v, out, lse, o);
  }
}

void check(Kind kind, const Case& c, std::uint64_t seed) {
  INFO("kind " << int(kind) << " B=" << c.B << " N=" << c.N << " M=" << c.M << " H=" << c.H
               << " Hkv=" << c.Hkv << " d=" << c.d << " causal=" << c.causal << " window=("
               << c.left << ", " << c.right << ")");
  const Inputs in = make_inputs(kind, c, seed);
  const double lambda = 0.7;
  const index_t lse_heads = kind == Kind::plain ? c.H : 2 * c.H;
  Tensor<double, 4> want({c.B, c.N, c.H, in.dv}), fused_d(want.shape()), ref_d(want.shape());
  Tensor<double, 3> lse_want({c.B, lse_heads, c.N}), lse_d(lse_want.shape()),
      lse_r(lse_want.shape());
  oracle(kind, c, in, lambda, want, lse_want);
  run<double>(kind, false, c, in.q, in.k, in.v, in.logit, lambda, fused_d, lse_d);
  run<double>(kind, true, c, in.q, in.k, in.v, in.logit, lambda, ref_d, lse_r);
  CHECK(rel_error(fused_d, want) < 1e-12);
  CHECK(rel_error(ref_d, want) < 1e-12);
  for (index_t i = 0; i < lse_want.size(); ++i) {
    const double w = lse_want.data()[i];
    if (std::isinf(w)) {
      REQUIRE(lse_d.data()[i] == w);
      REQUIRE(lse_r.data()[i] == w);
    } else {
      REQUIRE(std::abs(lse_d.data()[i] - w) <= 1e-12 * (1 + std::abs(w)));
    }
  }
  // Float: within twice the materialised float path's error (or a floor).
  const auto qf = cast<float>(in.q), kf = cast<float>(in.k), vf = cast<float>(in.v);
  const auto lf = cast<float>(in.logit);
  Tensor<float, 4> fused_f(want.shape()), naive_f(want.shape());
  Tensor<float, 3> lse_f(lse_want.shape()), lse_nf(lse_want.shape());
  run<float>(kind, false, c, qf, kf, vf, lf, 0.7f, fused_f, lse_f);
  run<float>(kind, true, c, qf, kf, vf, lf, 0.7f, naive_f, lse_nf);
  const double fe = rel_error(fused_f, want), ne = rel_error(naive_f, want);
  INFO("float errors: fused " << fe << ", naive " << ne);
  CHECK(fe <= std::max(2 * ne, 2e-5));
  CHECK(test::all_finite(fused_f));
  // Threads never change the result.
  Tensor<float, 4> one(want.shape());
  Tensor<float, 3> lse_one(lse_want.shape());
  run<float>(kind, false, c, qf, kf, vf, lf, 0.7f, one, lse_one, 1);
  Tensor<float, 4> two(want.shape());
  Tensor<float, 3> lse_two(lse_want.shape());
  run<float>(kind, false, c, qf, kf, vf, lf, 0.7f, two, lse_two, 2);
  CHECK(test::bitwise_equal(one, two));
  CHECK(test::bitwise_equal(lse_one, lse_two));
}

}  // namespace

TEST_CASE("the window picture of the documentation", "[masks]") {
  // N = 3, M = 5, window_left = 1, causal.
  const int pattern[3][5] = {{0, 1, 1, 0, 0}, {0, 0, 1, 1, 0}, {0, 0, 0, 1, 1}};
  const auto band = diffattn::detail::make_band(true, 1, -1);
  const Case c{1, 3, 5, 1, 1, 1, true, 1, -1};
  for (index_t i = 0; i < 3; ++i)
    for (index_t j = 0; j < 5; ++j) {
      CHECK(band.visible(i, j, 3, 5) == (pattern[i][j] == 1));
      CHECK(visible(c, i, j) == (pattern[i][j] == 1));
    }
}

TEST_CASE("windows in all three kernels match the explicit-mask oracle", "[masks]") {
  std::uint64_t seed = 7000;
  const std::vector<Case> cases = {
      // causal + left window: 0, 1, a few, larger than M; odd sizes, N != M.
      {1, 113, 113, 2, 1, 8, true, 0, -1},
      {1, 113, 113, 2, 1, 8, true, 1, -1},
      {2, 129, 140, 2, 2, 8, true, 17, -1},
      {1, 70, 50, 2, 1, 8, true, 9, -1},    // N > M: leading rows see nothing
      {1, 61, 61, 2, 1, 8, true, 500, -1},  // window larger than M: plain causal
      // non-causal windows: both sides, one side only.
      {1, 97, 103, 2, 1, 8, false, 5, 3},
      {1, 97, 80, 2, 2, 8, false, -1, 2},
      {1, 66, 66, 2, 1, 8, false, 0, 0},  // the diagonal only
      {1, 67, 90, 2, 1, 8, false, 31, -1},
      {1, 45, 45, 2, 1, 8, false, 100, 100},
      // decoding (blocks of < 6 queries) inside a window.
      {2, 1, 37, 2, 1, 8, true, 7, -1},
      {1, 5, 37, 2, 2, 8, true, 3, -1},
      {1, 3, 40, 2, 1, 8, false, 4, 10},
      // GQA 4.
      {1, 31, 31, 4, 1, 16, true, 6, -1},
  };
  for (const Case& c : cases) {
    check(Kind::v1, c, seed += 10);
    check(Kind::v2, c, seed += 10);
    check(Kind::plain, c, seed += 10);
  }
}

TEST_CASE("a window of the whole sequence equals no window", "[masks]") {
  const Case c{1, 75, 75, 2, 1, 8, true, 74, -1};
  const Inputs in = make_inputs(Kind::v1, c, 7700);
  Tensor<double, 4> a({1, 75, 2, 16}), b({1, 75, 2, 16});
  Tensor<double, 3> la({1, 4, 75}), lb({1, 4, 75});
  run<double>(Kind::v1, false, c, in.q, in.k, in.v, in.logit, 0.6, a, la);
  Case nowin = c;
  nowin.left = -1;
  run<double>(Kind::v1, false, nowin, in.q, in.k, in.v, in.logit, 0.6, b, lb);
  CHECK(test::bitwise_equal(a, b));
  CHECK(test::bitwise_equal(la, lb));
}

TEST_CASE("diff_weights honours the window", "[masks][diff_weights]") {
  const index_t N = 9, M = 12, d = 4;
  const auto q1 = test::random_matrix<double>(N, d, 7801),
             q2 = test::random_matrix<double>(N, d, 7802);
  const auto k1 = test::random_matrix<double>(M, d, 7803),
             k2 = test::random_matrix<double>(M, d, 7804);
  for (const Case& c : {Case{1, N, M, 1, 1, d, true, 2, -1}, Case{1, N, M, 1, 1, d, false, 1, 3}}) {
    AttentionOptions o = options_of(c);
    const auto w = diffattn::diff_weights<double>(q1, k1, q2, k2, 0.8, o);
    for (index_t i = 0; i < N; ++i) {
      double sum = 0;
      bool any = false;
      for (index_t j = 0; j < M; ++j) {
        if (!visible(c, i, j)) {
          CHECK(w(i, j) == 0.0);
        } else {
          any = true;
        }
        sum += w(i, j);
      }
      CHECK(sum == Approx(any ? 0.2 : 0.0).margin(1e-12));
    }
  }
}

TEST_CASE("bad windows are refused", "[masks][errors]") {
  const auto q = random_tensor<float, 4>({1, 5, 4, 8}, 7901);
  const auto k = random_tensor<float, 4>({1, 6, 4, 8}, 7902);
  const auto v = random_tensor<float, 4>({1, 6, 2, 16}, 7903);
  Tensor<float, 4> out({1, 5, 2, 16});
  AttentionOptions o;
  o.window_left = -2;
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, o); },
                      {"diff_attention_v1", "window_left", "-2"});
  o.window_left = 3;
  o.window_right = -7;
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, o); },
                      {"diff_attention_v1", "window_right", "-7"});
  o.window_right = 2;
  o.causal = true;
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, o); },
                      {"diff_attention_v1", "causal", "window_right = 2"});
  o.window_right = 0;  // causal with window_right 0 is the same thing: accepted
  diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, o);
  o.window_right = 2;
  const auto m = test::random_matrix<float>(3, 4, 7904);
  test::require_error([&] { diffattn::diff_weights<float>(m, m, m, m, 0.5f, o); },
                      {"diff_weights", "causal", "window_right"});
}
