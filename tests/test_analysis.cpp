// diffattn/analysis.hpp: every statistic against a materialised float64
// computation written here (full N x M maps, an explicit mask).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <diffattn/analysis.hpp>
#include <diffattn/attention.hpp>

using diffattn::AnalysisOptions;
using diffattn::AttentionOptions;
using diffattn::AttentionStats;
using diffattn::index_t;
using diffattn::Tensor;

namespace {

enum class Kind { plain, v1, v2 };

template <class T>
Tensor<T, 4> random4(std::array<index_t, 4> shape, std::mt19937& rng, double sd = 1.0) {
  Tensor<T, 4> t(shape);
  std::normal_distribution<double> dist(0.0, sd);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(dist(rng));
  return t;
}

/// One problem: inputs for `kind`, H output heads, Hkv kv heads (V1: pairs).
template <class T>
struct Problem {
  Kind kind;
  index_t B, N, M, H, Hkv, d;
  Tensor<T, 4> q, k, v;
  Tensor<T, 3> lambda_logit;  // V2
  T lambda = T(0.6);          // V1

  Problem(Kind kd, index_t b, index_t n, index_t m, index_t h, index_t hkv, index_t dd,
          unsigned seed, double sd = 1.0)
      : kind(kd), B(b), N(n), M(m), H(h), Hkv(hkv), d(dd) {
    std::mt19937 rng(seed);
    const index_t qh = kind == Kind::plain ? H : 2 * H;
    const index_t kh = kind == Kind::v1 ? 2 * Hkv : Hkv;
    const index_t dv = kind == Kind::v1 ? 2 * d : d + 3;  // dv != d for V2 and plain
    q = random4<T>({B, N, qh, d}, rng, sd);
    k = random4<T>({B, M, kh, d}, rng, sd);
    v = random4<T>({B, M, Hkv, dv}, rng);
    lambda_logit = Tensor<T, 3>({B, N, H});
    std::normal_distribution<double> dist(0.0, 1.0);
    for (index_t i = 0; i < lambda_logit.size(); ++i)
      lambda_logit.data()[i] = static_cast<T>(dist(rng));
  }
  index_t dv() const { return v.shape(3); }
  Tensor<T, 4> make_out() const { return Tensor<T, 4>({B, N, H, dv()}); }

  AttentionStats run(Tensor<T, 4>* out, const AttentionOptions& o, const AnalysisOptions& a) const {
    switch (kind) {
      case Kind::v1:
        return out ? diffattn::diff_attention_v1_stats<T>(q, k, v, lambda, out->view(), o, a)
                   : diffattn::diff_attention_v1_stats<T>(q, k, v, lambda, o, a);
      case Kind::v2:
        return out ? diffattn::diff_attention_v2_stats<T>(q, k, v, lambda_logit, out->view(), o, a)
                   : diffattn::diff_attention_v2_stats<T>(q, k, v, lambda_logit, o, a);
      default:
        return out ? diffattn::attention_stats<T>(q, k, v, out->view(), o, a)
                   : diffattn::attention_stats<T>(q, k, v, o, a);
    }
  }
};

/// The oracle's results, laid out as AttentionStats, plus the output.
struct Expected {
  AttentionStats st;
  std::vector<double> out;  // (B, N, H, dv) row-major
};

double quantised(double x, double step) { return std::round(x / step) * step; }

template <class T>
Expected oracle(const Problem<T>& p, const AttentionOptions& o, const AnalysisOptions& a) {
  const index_t B = p.B, N = p.N, M = p.M, H = p.H, d = p.d, dv = p.dv();
  const int maps = p.kind == Kind::plain ? 1 : 2;
  const double s = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d));
  const index_t qe = a.query_end < 0 ? N : a.query_end;
  Expected e;
  e.st.heads = H;
  e.st.maps = maps;
  e.st.max_abs_logit.assign(static_cast<std::size_t>(H * maps), 0.0);
  e.st.entropy = e.st.map_needle_mass = e.st.max_abs_logit;
  e.st.needle_mass.assign(static_cast<std::size_t>(H), 0.0);
  e.st.context_mass = e.st.context_abs_mass = e.st.negative_mass = e.st.context_rms =
      e.st.needle_mass;
  e.out.assign(static_cast<std::size_t>(B * N * H * dv), 0.0);
  std::vector<double> out_sq(static_cast<std::size_t>(H), 0.0);
  double rows = 0;
  const index_t group = H / p.Hkv;
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const index_t g = h / group;
      index_t qh[2] = {h, h}, kh[2] = {g, g};
      if (p.kind != Kind::plain) qh[0] = 2 * h, qh[1] = 2 * h + 1;
      if (p.kind == Kind::v1) kh[0] = 2 * g, kh[1] = 2 * g + 1;
      // Full maps (N, M) with an explicit mask.
      std::vector<std::vector<double>> A(2, std::vector<double>(static_cast<std::size_t>(N * M)));
      std::vector<char> visible(static_cast<std::size_t>(N * M));
      for (index_t i = 0; i < N; ++i)
        for (index_t j = 0; j < M; ++j) {
          // c - left <= j <= c + right with c = i + (M - N); causal: right = 0.
          const index_t c = i + (M - N), right = o.causal ? 0 : o.window_right;
          visible[i * M + j] =
              (o.window_left < 0 || j >= c - o.window_left) && (right < 0 || j <= c + right);
        }
      for (index_t i = 0; i < N; ++i) {
        const bool measured = i >= a.query_begin && i < qe;
        bool any = false;
        for (index_t j = 0; j < M; ++j) any = any || visible[i * M + j];
        for (int m = 0; m < maps; ++m) {
          std::vector<double> x(static_cast<std::size_t>(M), 0.0);
          double amax = 0;
          for (index_t j = 0; j < M; ++j) {
            if (!visible[i * M + j]) continue;
            double dot = 0;
            for (index_t t = 0; t < d; ++t)
              dot += static_cast<double>(p.q(b, i, qh[m], t)) *
                     static_cast<double>(p.k(b, j, kh[m], t));
            x[j] = s * dot;
            amax = std::max(amax, std::abs(x[j]));
          }
          if (a.logit_bits > 0 && amax > 0) {
            const double step = amax / static_cast<double>((1 << (a.logit_bits - 1)) - 1);
            for (index_t j = 0; j < M; ++j) x[j] = quantised(x[j], step);
          }
          double mx = -INFINITY, sum = 0;
          for (index_t j = 0; j < M; ++j)
            if (visible[i * M + j]) mx = std::max(mx, x[j]);
          for (index_t j = 0; j < M; ++j)
            if (visible[i * M + j]) sum += std::exp(x[j] - mx);
          double ent = 0, needle = 0;
          for (index_t j = 0; j < M; ++j) {
            double pj = visible[i * M + j] ? std::exp(x[j] - mx) / sum : 0.0;
            A[m][i * M + j] = pj;
            if (pj > 0) ent -= pj * std::log(pj);
            if (j >= a.needle_begin && j < a.needle_end) needle += pj;
          }
          if (measured && any) {
            const std::size_t k = static_cast<std::size_t>(h * maps + m);
            e.st.max_abs_logit[k] = std::max(e.st.max_abs_logit[k], amax);
            e.st.entropy[k] += ent;
            e.st.map_needle_mass[k] += needle;
          }
        }
        double lam = 0;
        if (p.kind == Kind::v1) lam = static_cast<double>(p.lambda);
        if (p.kind == Kind::v2)
          lam = 1.0 / (1.0 + std::exp(-static_cast<double>(p.lambda_logit(b, i, h))));
        double needle = 0, context = 0, cabs = 0, neg = 0;
        std::vector<double> orow(static_cast<std::size_t>(dv), 0.0);
        for (index_t j = 0; j < M; ++j) {
          if (!visible[i * M + j]) continue;
          const double w = A[0][i * M + j] - (maps == 2 ? lam * A[1][i * M + j] : 0.0);
          if (j >= a.needle_begin && j < a.needle_end) {
            needle += w;
          } else {
            context += w;
            cabs += std::abs(w);
          }
          neg += std::min(w, 0.0);
          for (index_t c = 0; c < dv; ++c) orow[c] += w * static_cast<double>(p.v(b, j, g, c));
        }
        for (index_t c = 0; c < dv; ++c) e.out[((b * N + i) * H + h) * dv + c] = orow[c];
        if (measured && any) {
          e.st.needle_mass[h] += needle;
          e.st.context_mass[h] += context;
          e.st.context_abs_mass[h] += cabs;
          e.st.negative_mass[h] += neg;
          for (double c : orow) out_sq[h] += c * c;
          if (h == 0) rows += 1;
        }
      }
    }
  e.st.rows = static_cast<index_t>(rows);
  if (rows > 0) {
    for (auto* vec : {&e.st.entropy, &e.st.map_needle_mass, &e.st.needle_mass, &e.st.context_mass,
                      &e.st.context_abs_mass, &e.st.negative_mass})
      for (double& x : *vec) x /= rows;
    for (index_t h = 0; h < H; ++h)
      e.st.context_rms[h] = std::sqrt(out_sq[h] / (rows * static_cast<double>(dv)));
  }
  return e;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const char* what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("entry " << i << ": got " << got[i] << ", want " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= tol * (1.0 + std::abs(want[i])));
  }
}

void check_stats(const AttentionStats& got, const AttentionStats& want, double tol) {
  CHECK(got.heads == want.heads);
  CHECK(got.maps == want.maps);
  CHECK(got.rows == want.rows);
  check_close(got.max_abs_logit, want.max_abs_logit, tol, "max_abs_logit");
  check_close(got.entropy, want.entropy, tol, "entropy");
  check_close(got.map_needle_mass, want.map_needle_mass, tol, "map_needle_mass");
  check_close(got.needle_mass, want.needle_mass, tol, "needle_mass");
  check_close(got.context_mass, want.context_mass, tol, "context_mass");
  check_close(got.context_abs_mass, want.context_abs_mass, tol, "context_abs_mass");
  check_close(got.negative_mass, want.negative_mass, tol, "negative_mass");
  check_close(got.context_rms, want.context_rms, tol, "context_rms");
}

template <class T>
std::vector<double> to_vector(const Tensor<T, 4>& t) {
  std::vector<double> out(static_cast<std::size_t>(t.size()));
  for (index_t i = 0; i < t.size(); ++i) out[i] = static_cast<double>(t.data()[i]);
  return out;
}

const char* kind_name(Kind k) { return k == Kind::v1 ? "v1" : k == Kind::v2 ? "v2" : "plain"; }

}  // namespace

TEST_CASE("analysis: every statistic matches a float64 oracle (double)", "[analysis]") {
  struct Size {
    index_t n, m;
  };
  const Size sizes[] = {{1, 1}, {7, 7}, {113, 113}, {7, 19}, {113, 75}, {19, 7}, {1, 64}};
  unsigned seed = 1;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (const Size& sz : sizes)
      for (bool causal : {false, true}) {
        // GQA: 4 output heads on 2 kv groups.
        const Problem<double> p(kind, 2, sz.n, sz.m, 4, 2, 8, seed++, 1.5);
        AttentionOptions o;
        o.causal = causal;
        o.num_threads = 1;
        AnalysisOptions a;
        a.needle_begin = sz.m / 3;
        a.needle_end = std::min(sz.m, sz.m / 3 + 2);
        for (int sel = 0; sel < 2; ++sel) {
          if (sel == 1) a.query_begin = sz.n / 2, a.query_end = sz.n;
          INFO(kind_name(kind) << " N " << sz.n << " M " << sz.m << " causal " << causal
                               << " rows [" << a.query_begin << ", " << a.query_end << ")");
          Tensor<double, 4> out = p.make_out();
          const AttentionStats got = p.run(&out, o, a);
          const Expected want = oracle(p, o, a);
          check_stats(got, want.st, 1e-11);
          check_close(to_vector(out), want.out, 1e-11, "out");
          // Without out: the same statistics.
          const AttentionStats got2 = p.run(nullptr, o, a);
          check_stats(got2, want.st, 1e-11);
        }
      }
}

TEST_CASE("analysis: sliding windows match the float64 oracle", "[analysis][masks]") {
  unsigned seed = 500;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t left : {0, 3, 40})
      for (bool causal : {true, false}) {
        const Problem<double> p(kind, 1, 113, 120, 4, 2, 8, seed++, 1.5);
        AttentionOptions o;
        o.causal = causal;
        o.window_left = left;
        o.window_right = causal ? -1 : 2;
        AnalysisOptions a;
        a.needle_begin = 50;
        a.needle_end = 60;
        INFO(kind_name(kind) << " window (" << o.window_left << ", " << o.window_right
                             << ") causal " << causal);
        Tensor<double, 4> out = p.make_out();
        const AttentionStats got = p.run(&out, o, a);
        const Expected want = oracle(p, o, a);
        check_stats(got, want.st, 1e-11);
        check_close(to_vector(out), want.out, 1e-11, "out");
      }
}

TEST_CASE("analysis: mass bookkeeping, plain and differential", "[analysis]") {
  for (Kind kind : {Kind::plain, Kind::v1}) {
    const Problem<double> p(kind, 1, 31, 31, 2, 1, 16, 77);
    AttentionOptions o;
    o.causal = true;
    AnalysisOptions a;
    a.needle_begin = 3;
    a.needle_end = 5;
    const AttentionStats st = p.run(nullptr, o, a);
    for (index_t h = 0; h < st.heads; ++h) {
      const double row_sum = st.needle_mass[h] + st.context_mass[h];
      if (kind == Kind::plain) {
        CHECK(row_sum == Approx(1.0).epsilon(1e-12));
        CHECK(st.negative_mass[h] == 0.0);
        CHECK(st.context_abs_mass[h] == Approx(st.context_mass[h]).epsilon(1e-12));
      } else {
        CHECK(row_sum == Approx(1.0 - p.lambda).epsilon(1e-12));
        CHECK(st.negative_mass[h] < 0.0);
        CHECK(st.context_abs_mass[h] > std::abs(st.context_mass[h]));
      }
    }
  }
}

TEST_CASE("analysis: float statistics match the oracle within float rounding", "[analysis]") {
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const Problem<float> p(kind, 1, 113, 75, 4, 2, 16, 5);
    AttentionOptions o;
    o.causal = true;
    AnalysisOptions a;
    a.needle_begin = 10;
    a.needle_end = 20;
    Tensor<float, 4> out = p.make_out();
    const AttentionStats got = p.run(&out, o, a);
    const Expected want = oracle(p, o, a);
    INFO(kind_name(kind));
    check_stats(got, want.st, 2e-5);
    check_close(to_vector(out), want.out, 2e-5, "out");
  }
}

TEST_CASE("analysis: exact logits give the fused kernel's output", "[analysis]") {
  const Problem<float> p1(Kind::v1, 2, 77, 77, 4, 2, 16, 9);
  const Problem<float> p2(Kind::v2, 2, 77, 77, 4, 2, 16, 10);
  const Problem<float> p0(Kind::plain, 2, 77, 77, 4, 2, 16, 11);
  AttentionOptions o;
  o.causal = true;
  Tensor<float, 4> a1 = p1.make_out(), k1 = p1.make_out(), a2 = p2.make_out(), k2 = p2.make_out(),
                   a0 = p0.make_out(), k0 = p0.make_out();
  p1.run(&a1, o, {});
  p2.run(&a2, o, {});
  p0.run(&a0, o, {});
  diffattn::diff_attention_v1<float>(p1.q, p1.k, p1.v, p1.lambda, k1.view(), o);
  diffattn::diff_attention_v2<float>(p2.q, p2.k, p2.v, p2.lambda_logit, k2.view(), o);
  diffattn::attention<float>(p0.q, p0.k, p0.v, k0.view(), o);
  // The analysis runs the kernel's own block task: the same bits.
  CHECK(to_vector(a1) == to_vector(k1));
  CHECK(to_vector(a2) == to_vector(k2));
  CHECK(to_vector(a0) == to_vector(k0));
}

TEST_CASE("analysis: 1 and 2 threads give bitwise equal results", "[analysis]") {
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const Problem<float> p(kind, 2, 130, 130, 4, 2, 16, 21);
    AnalysisOptions a;
    a.needle_begin = 40;
    a.needle_end = 44;
    a.query_begin = 50;
    a.logit_bits = 6;
    AttentionOptions o;
    o.causal = true;
    o.num_threads = 1;
    Tensor<float, 4> out1 = p.make_out(), out2 = p.make_out();
    const AttentionStats s1 = p.run(&out1, o, a);
    o.num_threads = 2;
    const AttentionStats s2 = p.run(&out2, o, a);
    INFO(kind_name(kind));
    CHECK(s1.rows == s2.rows);
    CHECK(s1.max_abs_logit == s2.max_abs_logit);
    CHECK(s1.entropy == s2.entropy);
    CHECK(s1.map_needle_mass == s2.map_needle_mass);
    CHECK(s1.needle_mass == s2.needle_mass);
    CHECK(s1.context_mass == s2.context_mass);
    CHECK(s1.context_abs_mass == s2.context_abs_mass);
    CHECK(s1.negative_mass == s2.negative_mass);
    CHECK(s1.context_rms == s2.context_rms);
    CHECK(to_vector(out1) == to_vector(out2));
  }
}

TEST_CASE("analysis: quantised logits match naive quantise-then-softmax", "[analysis]") {
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (int bits : {2, 4, 6, 8}) {
      const Problem<double> p(kind, 1, 37, 53, 2, 1, 8, 100 + static_cast<unsigned>(bits), 2.0);
      AttentionOptions o;
      o.causal = true;
      AnalysisOptions a;
      a.needle_begin = 20;
      a.needle_end = 23;
      a.logit_bits = bits;
      Tensor<double, 4> out = p.make_out();
      const AttentionStats got = p.run(&out, o, a);
      const Expected want = oracle(p, o, a);
      INFO(kind_name(kind) << " bits " << bits);
      check_stats(got, want.st, 1e-10);
      check_close(to_vector(out), want.out, 1e-10, "out");
    }
}

TEST_CASE("analysis: 16-bit logits are close to exact, 4-bit ones are not", "[analysis]") {
  const Problem<double> p(Kind::v1, 1, 64, 64, 2, 1, 16, 303, 2.0);
  AttentionOptions o;
  o.causal = true;
  Tensor<double, 4> exact = p.make_out(), q16 = p.make_out(), q4 = p.make_out();
  AnalysisOptions a;
  p.run(&exact, o, a);
  a.logit_bits = 16;
  p.run(&q16, o, a);
  a.logit_bits = 4;
  p.run(&q4, o, a);
  double err16 = 0, err4 = 0;
  for (index_t i = 0; i < exact.size(); ++i) {
    err16 = std::max(err16, std::abs(q16.data()[i] - exact.data()[i]));
    err4 = std::max(err4, std::abs(q4.data()[i] - exact.data()[i]));
  }
  CHECK(err16 > 0.0);
  CHECK(err16 < 1e-3);
  CHECK(err4 > 100 * err16);
}

TEST_CASE("analysis: rows that see no key are not measured", "[analysis]") {
  // N > M, causal: the first N - M rows see no key.
  const Problem<double> p(Kind::v2, 1, 19, 7, 2, 1, 8, 31);
  AttentionOptions o;
  o.causal = true;
  AnalysisOptions a;
  const AttentionStats st = p.run(nullptr, o, a);
  CHECK(st.rows == 7);
  a.query_end = 12;  // rows 0 .. 11 hold none: nothing measured
  const AttentionStats none = p.run(nullptr, o, a);
  CHECK(none.rows == 0);
  CHECK(none.context_rms == std::vector<double>(2, 0.0));
}

TEST_CASE("analysis: bad input throws diffattn::error naming the function", "[analysis]") {
  const Problem<float> p(Kind::v1, 1, 8, 10, 2, 1, 4, 3);
  auto message = [&](const AnalysisOptions& a) -> std::string {
    try {
      diffattn::diff_attention_v1_stats<float>(p.q, p.k, p.v, p.lambda, AttentionOptions(), a);
    } catch (const diffattn::error& e) {
      return e.what();
    }
    return "";
  };
  auto has = [](const std::string& m, const char* w) { return m.find(w) != std::string::npos; };
  AnalysisOptions a;
  a.needle_end = 11;
  std::string m = message(a);
  CHECK(has(m, "diff_attention_v1_stats"));
  CHECK(has(m, "needle"));
  CHECK(has(m, "M = 10"));
  a = {};
  a.needle_begin = 5;
  a.needle_end = 4;
  CHECK(has(message(a), "needle"));
  a = {};
  a.needle_begin = -1;
  CHECK(has(message(a), "needle"));
  a = {};
  a.query_end = 9;
  m = message(a);
  CHECK(has(m, "query"));
  CHECK(has(m, "N = 8"));
  a = {};
  a.query_begin = 3;
  a.query_end = 2;
  CHECK(has(message(a), "query"));
  for (int bits : {1, 17, -2}) {
    a = {};
    a.logit_bits = bits;
    CHECK(has(message(a), "logit_bits"));
  }
  // Tensor checks come from the kernels' validation, under this function's name.
  Tensor<float, 4> bad_k({1, 10, 3, 4});
  try {
    diffattn::diff_attention_v1_stats<float>(p.q, bad_k, p.v, p.lambda);
    FAIL("no error");
  } catch (const diffattn::error& e) {
    m = e.what();
    CHECK(has(m, "diff_attention_v1_stats: k has 3 heads"));
    CHECK(has(m, "(1, 10, 3, 4)"));
  }
  Tensor<float, 4> bad_out({1, 8, 2, 5});
  CHECK_THROWS_WITH(
      diffattn::diff_attention_v1_stats<float>(p.q, p.k, p.v, p.lambda, bad_out.view()),
      Catch::Contains("diff_attention_v1_stats: out has shape (1, 8, 2, 5)"));
  const Problem<float> p2(Kind::v2, 1, 8, 10, 2, 1, 4, 3);
  Tensor<float, 3> bad_logit({1, 8, 3});
  CHECK_THROWS_WITH(diffattn::diff_attention_v2_stats<float>(p2.q, p2.k, p2.v, bad_logit),
                    Catch::Contains("diff_attention_v2_stats: lambda_logit has shape (1, 8, 3)"));
  const Problem<float> p0(Kind::plain, 1, 8, 10, 2, 1, 4, 3);
  Tensor<float, 4> bad_v({1, 9, 1, 7});
  CHECK_THROWS_WITH(diffattn::attention_stats<float>(p0.q, p0.k, bad_v),
                    Catch::Contains("attention_stats: k and v differ"));
  AttentionOptions bad_opt;
  bad_opt.scale = -1;
  CHECK_THROWS_AS(diffattn::attention_stats<float>(p0.q, p0.k, p0.v, bad_opt), diffattn::error);
}
