#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/diff_weights.hpp>
#include <diffattn/io/safetensors.hpp>
#include <diffattn/module.hpp>
#include <map>
#include <string>
#include <vector>

#include "support.hpp"

using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::index_t;
using diffattn::Matrix;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;

namespace {

// ---- float64 reference composed from the reference path ---------------------

/// A layer's parameters as double matrices (vectors are 1 x n).
template <class Layer>
std::map<std::string, Matrix<double>> params_of(Layer& m) {
  std::map<std::string, Matrix<double>> out;
  const auto shapes = m.parameter_shapes();
  for (auto& kv : m.parameters()) {
    const std::vector<index_t>& s = shapes.at(kv.first);
    const index_t rows = s.size() == 2 ? s[0] : 1, cols = s.back();
    Matrix<double> w(rows, cols);
    for (index_t i = 0; i < rows * cols; ++i) w.data()[i] = static_cast<double>(kv.second(i));
    out[kv.first] = w;
  }
  return out;
}

/// Fills every parameter with N(0, sigma^2) (vectors named lambda_* with 0.3,
/// subln.weight around 1), so that no parameter sits at a special value.
template <class Layer>
void randomize(Layer& m, std::uint64_t seed, double sigma) {
  diffattn::detail::Rng rng(seed);
  for (auto& kv : m.parameters()) {
    for (index_t i = 0; i < kv.second.size(); ++i) {
      double v = sigma * rng.normal();
      if (kv.first.rfind("lambda_", 0) == 0 && kv.first != "lambda_proj.weight")
        v = 0.3 * rng.normal();
      if (kv.first == "subln.weight") v = 1.0 + 0.5 * rng.normal();
      kv.second(i) = static_cast<typename decltype(kv.second)::value_type>(v);
    }
  }
}

template <class T>
Tensor<T, 3> random_x(index_t b, index_t n, index_t e, std::uint64_t seed) {
  Tensor<T, 3> x({b, n, e});
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(rng.normal());
  return x;
}

template <class T>
Matrix<double> batch_rows(const Tensor<T, 3>& x, index_t b) {
  Matrix<double> m(x.shape(1), x.shape(2));
  for (index_t i = 0; i < x.shape(1); ++i)
    for (index_t j = 0; j < x.shape(2); ++j) m(i, j) = static_cast<double>(x(b, i, j));
  return m;
}

/// Interleaved rotary embedding of each `width`-wide head of the rows of m
/// (row i at position offset + i): the direct formula.
void rope_interleaved(Matrix<double>& m, index_t width, index_t offset, double base) {
  for (index_t i = 0; i < m.rows(); ++i)
    for (index_t h = 0; h < m.cols() / width; ++h)
      for (index_t p = 0; p < width / 2; ++p) {
        const double ang = static_cast<double>(offset + i) * std::pow(base, -2.0 * p / width);
        double& a = m(i, h * width + 2 * p);
        double& b = m(i, h * width + 2 * p + 1);
        const double a0 = a, b0 = b;
        a = a0 * std::cos(ang) - b0 * std::sin(ang);
        b = a0 * std::sin(ang) + b0 * std::cos(ang);
      }
}

Matrix<double> head(const Matrix<double>& m, index_t h, index_t width) {
  return m.middleCols(h * width, width);
}

double lambda_init_formula(int depth) { return 0.8 - 0.6 * std::exp(-0.3 * depth); }

/// V1 on one batch row x (N, E), float64 throughout.
Matrix<double> reference_v1(const std::map<std::string, Matrix<double>>& p,
                            const DiffAttnV1Config& c, const Matrix<double>& x, index_t offset,
                            double* lambda_out = nullptr) {
  const index_t e = c.embed_dim, h = c.num_heads, hkv = c.num_kv_heads ? c.num_kv_heads : h;
  const index_t d = c.head_dim ? c.head_dim : e / (2 * h);
  Matrix<double> q = x * p.at("q_proj.weight").transpose();        // (N, 2H d)
  Matrix<double> k = x * p.at("k_proj.weight").transpose();        // (N, 2Hkv d)
  const Matrix<double> v = x * p.at("v_proj.weight").transpose();  // (N, Hkv 2d)
  if (c.rope) {
    rope_interleaved(q, d, offset, c.rope_base);
    rope_interleaved(k, d, offset, c.rope_base);
  }
  const double init = lambda_init_formula(c.depth);
  const double lambda = std::exp(p.at("lambda_q1").row(0).dot(p.at("lambda_k1").row(0))) -
                        std::exp(p.at("lambda_q2").row(0).dot(p.at("lambda_k2").row(0))) + init;
  if (lambda_out) *lambda_out = lambda;
  diffattn::AttentionOptions opt;
  opt.causal = c.causal;
  Matrix<double> cat(x.rows(), 2 * h * d);
  for (index_t hh = 0; hh < h; ++hh) {
    const index_t g = hh / (h / hkv);
    const Matrix<double> w =
        diffattn::diff_weights<double>(head(q, 2 * hh, d), head(k, 2 * g, d),
                                       head(q, 2 * hh + 1, d), head(k, 2 * g + 1, d), lambda, opt);
    for (index_t i = 0; i < w.rows(); ++i) REQUIRE(std::abs(w.row(i).sum() - (1 - lambda)) < 1e-12);
    Matrix<double> o = w * head(v, g, 2 * d);  // (N, 2d)
    for (index_t i = 0; i < o.rows(); ++i) {
      const double rms = std::sqrt(o.row(i).squaredNorm() / (2 * d) + c.norm_eps);
      for (index_t j = 0; j < 2 * d; ++j) {
        const double w_j = c.norm_affine ? p.at("subln.weight")(0, j) : 1.0;
        cat(i, hh * 2 * d + j) = (1 - init) * o(i, j) / rms * w_j;
      }
    }
  }
  return cat * p.at("out_proj.weight").transpose();
}

/// V2 on one batch row x (N, E), float64 throughout.
Matrix<double> reference_v2(const std::map<std::string, Matrix<double>>& p,
                            const DiffAttnV2Config& c, const Matrix<double>& x, index_t offset) {
  const index_t e = c.embed_dim, h = c.num_heads, hkv = c.num_kv_heads ? c.num_kv_heads : h;
  const index_t hd = c.head_dim ? c.head_dim : e / h;
  Matrix<double> q = x * p.at("q_proj.weight").transpose();  // (N, 2H hd)
  Matrix<double> k = x * p.at("k_proj.weight").transpose();  // (N, Hkv hd)
  const Matrix<double> v = x * p.at("v_proj.weight").transpose();
  const Matrix<double> logit = x * p.at("lambda_proj.weight").transpose();  // (N, H)
  if (c.rope) {
    rope_interleaved(q, hd, offset, c.rope_base);
    rope_interleaved(k, hd, offset, c.rope_base);
  }
  diffattn::AttentionOptions opt;
  opt.causal = c.causal;
  Matrix<double> cat(x.rows(), h * hd);
  for (index_t hh = 0; hh < h; ++hh) {
    const index_t g = (2 * hh) / (2 * h / hkv);
    REQUIRE(g == (2 * hh + 1) / (2 * h / hkv));  // the pair shares one kv group
    const Matrix<double> kg = head(k, g, hd);
    // lambda 0 gives the plain softmax map of the first pair of arguments
    const Matrix<double> a1 = diffattn::diff_weights<double>(head(q, 2 * hh, hd), kg,
                                                             head(q, 2 * hh + 1, hd), kg, 0.0, opt);
    const Matrix<double> a2 = diffattn::diff_weights<double>(head(q, 2 * hh + 1, hd), kg,
                                                             head(q, 2 * hh, hd), kg, 0.0, opt);
    for (index_t i = 0; i < x.rows(); ++i) {
      const double lambda = 1.0 / (1.0 + std::exp(-logit(i, hh)));
      const Eigen::RowVectorXd row = (a1.row(i) - lambda * a2.row(i)) * head(v, g, hd);
      cat.block(i, hh * hd, 1, hd) = row;
    }
  }
  return cat * p.at("o_proj.weight").transpose();
}

/// max |y - ref| / max |ref| over the batch.
template <class T, class Ref>
double rel_error(const Tensor<T, 3>& y, Ref&& ref_of_batch) {
  double err = 0, scale = 0;
  for (index_t b = 0; b < y.shape(0); ++b) {
    const Matrix<double> ref = ref_of_batch(b);
    REQUIRE(ref.rows() == y.shape(1));
    REQUIRE(ref.cols() == y.shape(2));
    for (index_t i = 0; i < ref.rows(); ++i)
      for (index_t j = 0; j < ref.cols(); ++j) {
        err = std::max(err, std::abs(static_cast<double>(y(b, i, j)) - ref(i, j)));
        scale = std::max(scale, std::abs(ref(i, j)));
      }
  }
  REQUIRE(scale > 0);
  return err / scale;
}

std::string temp_path(const std::string& name) {
  return "diffattn_test_module_" + name + ".safetensors";
}

template <class Layer>
std::map<std::string, std::vector<double>> snapshot(Layer& m) {
  std::map<std::string, std::vector<double>> s;
  for (auto& kv : m.parameters())
    for (index_t i = 0; i < kv.second.size(); ++i) s[kv.first].push_back(kv.second(i));
  return s;
}

struct V1Case {
  index_t e, h, hkv;
  int depth;
  bool rope, causal, affine;
};

}  // namespace

// ---- forward against the float64 reference -----------------------------------

TEMPLATE_TEST_CASE("MultiheadDiffAttnV1 matches the float64 reference", "[module]", float, double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 1e-4 : 1e-10;
  const V1Case cases[] = {{32, 2, 0, 0, true, true, true},   {48, 4, 2, 3, true, false, true},
                          {64, 4, 1, 11, false, true, true}, {24, 3, 3, 5, true, true, false},
                          {40, 2, 1, 1, true, true, true},   {36, 3, 1, 2, false, false, true}};
  std::uint64_t seed = 100;
  for (const V1Case& c : cases) {
    DiffAttnV1Config cfg;
    cfg.embed_dim = c.e;
    cfg.num_heads = c.h;
    cfg.num_kv_heads = c.hkv;
    cfg.depth = c.depth;
    cfg.rope = c.rope;
    cfg.causal = c.causal;
    cfg.norm_affine = c.affine;
    MultiheadDiffAttnV1<T> m(cfg, seed++);
    randomize(m, seed++, 0.3);
    const auto p = params_of(m);
    const Tensor<T, 3> x = random_x<T>(2, 9, c.e, seed++);
    for (index_t offset : {index_t(0), index_t(5)}) {
      const Tensor<T, 3> y = m.forward(x, offset);
      INFO("E=" << c.e << " H=" << c.h << " Hkv=" << c.hkv << " depth=" << c.depth
                << " rope=" << c.rope << " causal=" << c.causal << " affine=" << c.affine
                << " offset=" << offset);
      double lambda = 0;
      const double err = rel_error(
          y, [&](index_t b) { return reference_v1(p, cfg, batch_rows(x, b), offset, &lambda); });
      CHECK(err < tol);
      CHECK(std::abs(static_cast<double>(m.lambda_full()) - lambda) < tol);
    }
  }
}

TEMPLATE_TEST_CASE("V1 with head_dim != E / (2H) and another norm eps (DiffLlama configs)",
                   "[module]", float, double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 1e-4 : 1e-10;
  DiffAttnV1Config cfg;
  cfg.embed_dim = 40;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  cfg.head_dim = 6;  // q_proj 40 -> 24, out_proj 24 -> 40
  cfg.norm_eps = 1e-6;
  cfg.depth = 1;
  MultiheadDiffAttnV1<T> m(cfg, 77);
  randomize(m, 78, 0.3);
  CHECK(m.head_dim() == 6);
  const auto shapes = m.parameter_shapes();
  CHECK(shapes.at("q_proj.weight") == std::vector<index_t>{24, 40});
  CHECK(shapes.at("k_proj.weight") == std::vector<index_t>{12, 40});
  CHECK(shapes.at("v_proj.weight") == std::vector<index_t>{12, 40});
  CHECK(shapes.at("out_proj.weight") == std::vector<index_t>{40, 24});
  CHECK(shapes.at("subln.weight") == std::vector<index_t>{12});
  const auto p = params_of(m);
  const Tensor<T, 3> x = random_x<T>(2, 7, 40, 79);
  const Tensor<T, 3> y = m.forward(x, 2);
  CHECK(rel_error(y, [&](index_t b) { return reference_v1(p, cfg, batch_rows(x, b), 2); }) < tol);
  // The eps matters: the reference with the default eps differs.
  DiffAttnV1Config other = cfg;
  other.norm_eps = 1e-5;
  CHECK(rel_error(y, [&](index_t b) { return reference_v1(p, other, batch_rows(x, b), 2); }) >
        (std::is_same<T, float>::value ? 0.0 : 1e-9));
}

TEMPLATE_TEST_CASE("MultiheadDiffAttnV2 matches the float64 reference", "[module]", float, double) {
  using T = TestType;
  const double tol = std::is_same<T, float>::value ? 1e-4 : 1e-10;
  struct Case {
    index_t e, h, hkv, hd;
    bool rope, causal;
  };
  const Case cases[] = {{32, 4, 0, 0, true, true},   {32, 4, 2, 0, true, false},
                        {24, 4, 1, 6, false, true},  {20, 2, 2, 12, true, true},
                        {30, 6, 3, 0, false, false}, {16, 4, 4, 8, true, true}};
  std::uint64_t seed = 200;
  for (const Case& c : cases) {
    DiffAttnV2Config cfg;
    cfg.embed_dim = c.e;
    cfg.num_heads = c.h;
    cfg.num_kv_heads = c.hkv;
    cfg.head_dim = c.hd;
    cfg.rope = c.rope;
    cfg.causal = c.causal;
    MultiheadDiffAttnV2<T> m(cfg, seed++);
    randomize(m, seed++, 0.4);
    const auto p = params_of(m);
    const Tensor<T, 3> x = random_x<T>(2, 9, c.e, seed++);
    for (index_t offset : {index_t(0), index_t(3)}) {
      const Tensor<T, 3> y = m.forward(x, offset);
      INFO("E=" << c.e << " H=" << c.h << " Hkv=" << c.hkv << " hd=" << c.hd << " rope=" << c.rope
                << " causal=" << c.causal << " offset=" << offset);
      CHECK(rel_error(y, [&](index_t b) {
              return reference_v2(p, cfg, batch_rows(x, b), offset);
            }) < tol);
    }
  }
}

TEST_CASE("forward accepts strided x and empty batches", "[module]") {
  DiffAttnV1Config cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  MultiheadDiffAttnV1<double> m(cfg, 3);
  // x stored as (N, B, E), seen as (B, N, E)
  const Tensor<double, 3> nbe = random_x<double>(9, 2, 16, 4);
  diffattn::TensorView<const double, 3> xs(nbe.data(), {2, 9, 16}, {16, 32, 1});
  Tensor<double, 3> xc({2, 9, 16});
  for (index_t b = 0; b < 2; ++b)
    for (index_t n = 0; n < 9; ++n)
      for (index_t j = 0; j < 16; ++j) xc(b, n, j) = nbe(n, b, j);
  const Tensor<double, 3> y1 = m.forward(xs);
  const Tensor<double, 3> y2 = m.forward(xc);
  for (index_t i = 0; i < y1.size(); ++i) CHECK(y1.data()[i] == y2.data()[i]);
  const Tensor<double, 3> y0 = m.forward(Tensor<double, 3>({0, 9, 16}));
  CHECK(y0.shape() == std::array<index_t, 3>{0, 9, 16});
  const Tensor<double, 3> yn = m.forward(Tensor<double, 3>({2, 0, 16}));
  CHECK(yn.shape() == std::array<index_t, 3>{2, 0, 16});
}

// ---- properties ---------------------------------------------------------------

TEST_CASE("initialisation follows the reference and is deterministic", "[module]") {
  DiffAttnV1Config cfg;
  cfg.embed_dim = 64;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  MultiheadDiffAttnV1<double> a(cfg, 7), b(cfg, 7), c(cfg, 8);
  CHECK(snapshot(a) == snapshot(b));
  CHECK(snapshot(a) != snapshot(c));
  auto p = a.parameters();
  const double bound = 1.0 / std::sqrt(64.0);
  for (const char* name : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}) {
    double mx = 0, sum = 0, sq = 0;
    const auto w = p.at(name);
    for (index_t i = 0; i < w.size(); ++i) {
      mx = std::max(mx, std::abs(w(i)));
      sum += w(i);
      sq += w(i) * w(i);
    }
    INFO(name);
    CHECK(mx <= bound);
    CHECK(mx > 0.95 * bound);
    // U(-b, b): mean 0, variance b^2 / 3
    CHECK(std::abs(sum / w.size()) < 0.1 * bound);
    CHECK(std::abs(sq / w.size() - bound * bound / 3) < 0.1 * bound * bound / 3);
  }
  std::vector<double> lam;
  for (const char* name : {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"})
    for (index_t i = 0; i < p.at(name).size(); ++i) lam.push_back(p.at(name)(i));
  double sq = 0;
  for (double v : lam) sq += v * v;
  CHECK(std::sqrt(sq / lam.size()) > 0.05);  // N(0, 0.1): 32 samples
  CHECK(std::sqrt(sq / lam.size()) < 0.15);
  for (index_t i = 0; i < p.at("subln.weight").size(); ++i) CHECK(p.at("subln.weight")(i) == 1.0);

  DiffAttnV2Config c2;
  c2.embed_dim = 32;
  c2.num_heads = 4;
  c2.head_dim = 16;
  MultiheadDiffAttnV2<float> v2a(c2, 1), v2b(c2, 1);
  CHECK(snapshot(v2a) == snapshot(v2b));
  auto p2 = v2a.parameters();
  double mo = 0;
  for (index_t i = 0; i < p2.at("o_proj.weight").size(); ++i)
    mo = std::max(mo, std::abs(static_cast<double>(p2.at("o_proj.weight")(i))));
  CHECK(mo <= 1.0 / std::sqrt(64.0));  // fan_in of o_proj is H * head_dim = 64
  CHECK(mo > 0.9 / std::sqrt(64.0));
}

TEST_CASE("the layer uses lambda_init(depth) and lambda_full from its four vectors", "[module]") {
  for (int depth : {0, 1, 5, 23}) {
    DiffAttnV1Config cfg;
    cfg.embed_dim = 16;
    cfg.num_heads = 2;
    cfg.depth = depth;
    MultiheadDiffAttnV1<double> m(cfg, 1);
    CHECK(m.lambda_init() == Approx(lambda_init_formula(depth)).epsilon(1e-15));
    auto p = m.parameters();
    double d1 = 0, d2 = 0;
    for (index_t i = 0; i < 4; ++i) {
      d1 += p.at("lambda_q1")(i) * p.at("lambda_k1")(i);
      d2 += p.at("lambda_q2")(i) * p.at("lambda_k2")(i);
    }
    CHECK(m.lambda_full() == Approx(std::exp(d1) - std::exp(d2) + lambda_init_formula(depth)));
    // zero vectors: lambda_full = lambda_init exactly
    for (const char* n : {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"})
      for (index_t i = 0; i < 4; ++i) p.at(n)(i) = 0;
    CHECK(m.lambda_full() == Approx(lambda_init_formula(depth)).epsilon(1e-15));
  }
  CHECK(lambda_init_formula(0) == Approx(0.2));
}

TEST_CASE("V1 has the parameter count of a baseline layer with 2H heads", "[module]") {
  for (index_t hkv : {index_t(0), index_t(2), index_t(1)}) {
    DiffAttnV1Config cfg;
    cfg.embed_dim = 64;
    cfg.num_heads = 4;
    cfg.num_kv_heads = hkv;
    for (bool affine : {true, false}) {
      cfg.norm_affine = affine;
      MultiheadDiffAttnV1<float> m(cfg);
      const auto s = m.parameter_shapes();
      const index_t e = 64, d = 8, base_heads = 8, base_kv = 2 * (hkv ? hkv : 4),
                    head = e / base_heads;
      // baseline: q E x E, k and v (kv heads * head) x E, o E x E
      const index_t baseline = 2 * e * e + 2 * base_kv * head * e;
      index_t proj = 0;
      for (const char* n : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"})
        proj += s.at(n)[0] * s.at(n)[1];
      CHECK(proj == baseline);
      if (hkv == 0) CHECK(proj == 4 * e * e);
      CHECK(m.num_parameters() == baseline + 4 * d + (affine ? 2 * d : 0));
      CHECK(s.count("subln.weight") == (affine ? 1u : 0u));
      CHECK(s.at("lambda_q1") == std::vector<index_t>{d});
      CHECK(s.at("k_proj.weight") == std::vector<index_t>{base_kv * head, e});
      CHECK(m.parameters().size() == s.size());
      CHECK(MultiheadDiffAttnV1<double>::parameter_shapes(cfg) == s);
    }
  }
}

TEST_CASE("V2's parameters: a baseline with H heads plus H*hd*E queries and H*E for lambda",
          "[module]") {
  DiffAttnV2Config cfg;
  cfg.embed_dim = 48;
  cfg.num_heads = 6;
  cfg.num_kv_heads = 2;
  MultiheadDiffAttnV2<float> m(cfg);
  const index_t e = 48, h = 6, hkv = 2, hd = 8;
  CHECK(m.head_dim() == hd);
  const auto s = m.parameter_shapes();
  CHECK(s.at("q_proj.weight") == std::vector<index_t>{2 * h * hd, e});
  CHECK(s.at("k_proj.weight") == std::vector<index_t>{hkv * hd, e});
  CHECK(s.at("v_proj.weight") == std::vector<index_t>{hkv * hd, e});
  CHECK(s.at("o_proj.weight") == std::vector<index_t>{e, h * hd});
  CHECK(s.at("lambda_proj.weight") == std::vector<index_t>{h, e});
  const index_t baseline = 2 * h * hd * e + 2 * hkv * hd * e;
  CHECK(m.num_parameters() == baseline + h * hd * e + h * e);
  CHECK(MultiheadDiffAttnV2<double>::parameter_shapes(cfg) == s);
  // KV cache per token: 2 * Hkv * hd values, the same as the baseline's
  CHECK(s.at("k_proj.weight")[0] + s.at("v_proj.weight")[0] == 2 * hkv * hd);
}

TEST_CASE("V2 pairs query heads 2h, 2h+1 inside one GQA group", "[module]") {
  // o_proj = identity (E = H * hd), so y is the concatenated DIFF heads. Changing
  // the values of kv head g' may change DIFF heads h with h / (H / Hkv) == g' only.
  DiffAttnV2Config cfg;
  cfg.embed_dim = 32;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 8;
  MultiheadDiffAttnV2<double> m(cfg, 5);
  auto p = m.parameters();
  for (index_t i = 0; i < 32; ++i)
    for (index_t j = 0; j < 32; ++j) p.at("o_proj.weight")(i * 32 + j) = i == j ? 1.0 : 0.0;
  const Tensor<double, 3> x = random_x<double>(2, 9, 32, 6);
  const Tensor<double, 3> y0 = m.forward(x);
  for (index_t gp = 0; gp < 2; ++gp) {
    MultiheadDiffAttnV2<double> m2 = m;
    auto v = m2.parameters().at("v_proj.weight");
    for (index_t r = gp * 8; r < (gp + 1) * 8; ++r)
      for (index_t c = 0; c < 32; ++c) v(r * 32 + c) += 0.5;
    const Tensor<double, 3> y1 = m2.forward(x);
    for (index_t hh = 0; hh < 4; ++hh) {
      double diff = 0;
      for (index_t b = 0; b < 2; ++b)
        for (index_t n = 0; n < 9; ++n)
          for (index_t t = 0; t < 8; ++t)
            diff = std::max(diff, std::abs(y1(b, n, hh * 8 + t) - y0(b, n, hh * 8 + t)));
      INFO("kv head " << gp << " DIFF head " << hh);
      if (hh / 2 == gp)
        CHECK(diff > 1e-3);
      else
        CHECK(diff == 0.0);
    }
  }
}

// ---- errors -------------------------------------------------------------------

TEST_CASE("bad input and bad configurations throw diffattn::error", "[module]") {
  DiffAttnV1Config cfg;
  cfg.embed_dim = 32;
  cfg.num_heads = 2;
  MultiheadDiffAttnV1<float> m(cfg);
  test::require_error(
      [&] {
        m.forward(Tensor<float, 3>({2, 9, 30}));
      },
      {"MultiheadDiffAttnV1::forward: x has shape (2, 9, 30), expected (B, N, 32)"});
  test::require_error(
      [&] {
        m.forward(Tensor<float, 3>({2, 9, 32}), -1);
      },
      {"MultiheadDiffAttnV1::forward", "position_offset", "-1"});

  auto bad1 = [](index_t e, index_t h, index_t hkv, int depth, bool rope = true) {
    DiffAttnV1Config c;
    c.embed_dim = e;
    c.num_heads = h;
    c.num_kv_heads = hkv;
    c.depth = depth;
    c.rope = rope;
    return [c] { MultiheadDiffAttnV1<float> layer(c); };
  };
  test::require_error(bad1(30, 4, 0, 0),
                      {"MultiheadDiffAttnV1", "embed_dim 30", "2 * num_heads = 8"});
  test::require_error(bad1(48, 6, 4, 0), {"num_heads 6", "num_kv_heads 4"});
  test::require_error(bad1(32, 2, 0, -1), {"depth", "-1"});
  test::require_error(bad1(0, 2, 0, 0), {"embed_dim must be >= 1"});
  test::require_error(bad1(32, 0, 0, 0), {"num_heads must be >= 1"});
  test::require_error(bad1(36, 6, 0, 0), {"rope", "even", "d = E / (2H) = 3"});
  bad1(36, 6, 0, 0, false)();  // odd d is fine without rope
  DiffAttnV1Config cb = cfg;
  cb.rope_base = -1;
  test::require_error([&] { MultiheadDiffAttnV1<double> l(cb); }, {"rope_base"});

  auto bad2 = [](index_t e, index_t h, index_t hkv, index_t hd) {
    DiffAttnV2Config c;
    c.embed_dim = e;
    c.num_heads = h;
    c.num_kv_heads = hkv;
    c.head_dim = hd;
    return [c] { MultiheadDiffAttnV2<float> layer(c); };
  };
  test::require_error(bad2(30, 4, 0, 0), {"MultiheadDiffAttnV2", "embed_dim 30", "num_heads 4"});
  test::require_error(bad2(32, 4, 3, 0), {"num_heads 4", "num_kv_heads 3"});
  test::require_error(bad2(32, 4, 0, 5), {"even head_dim", "5"});
  test::require_error(bad2(32, 4, 0, -2), {"head_dim must be >= 0"});
  DiffAttnV2Config c2;
  c2.embed_dim = 32;
  c2.num_heads = 4;
  MultiheadDiffAttnV2<double> m2(c2);
  test::require_error(
      [&] {
        m2.forward(Tensor<double, 3>({1, 3, 16}));
      },
      {"MultiheadDiffAttnV2::forward: x has shape (1, 3, 16), expected (B, N, 32)"});

  // The members both layers share (detail::ModuleBase) name the layer's class.
  test::require_error([&] { m.set_num_threads(-1); },
                      {"MultiheadDiffAttnV1::set_num_threads: n must be >= 0, got -1"});
  test::require_error([&] { m2.set_num_threads(-2); },
                      {"MultiheadDiffAttnV2::set_num_threads: n must be >= 0, got -2"});
  test::require_error([&] { m2.attention_maps(Tensor<double, 3>({1, 3, 31})); },
                      {"MultiheadDiffAttnV2::attention_maps: x has shape (1, 3, 31)"});
  test::require_error([&] { m.attention_maps(Tensor<float, 3>({1, 3, 32}), -3); },
                      {"MultiheadDiffAttnV1::attention_maps", "position_offset", "-3"});
  test::require_error([&] { m2.backward(Tensor<double, 3>({1, 3, 32})); },
                      {"MultiheadDiffAttnV2::backward: backward called before forward"});
  m2.forward(Tensor<double, 3>({1, 3, 32}));
  test::require_error([&] { m2.backward(Tensor<double, 3>({1, 4, 32})); },
                      {"MultiheadDiffAttnV2::backward: dy has shape (1, 4, 32), expected (1, 3, 32)"});
  diffattn::PackedSequences two;
  two.cu_seqlens_q = {0, 2, 5};
  test::require_error([&] { m.forward(Tensor<float, 3>({1, 4, 32}), two); },
                      {"MultiheadDiffAttnV1::forward", "cu_seqlens_q"});
  DiffAttnV2Config bidir = c2;
  bidir.causal = false;
  MultiheadDiffAttnV2<double> m3(bidir);
  test::require_error([&] { m3.make_cache(1, 4); },
                      {"MultiheadDiffAttnV2::make_cache: a KV cache needs a causal layer"});
  auto cache = m2.make_cache(1, 2);
  test::require_error([&] { m2.forward(Tensor<double, 3>({1, 3, 32}), cache); },
                      {"MultiheadDiffAttnV2::forward", "cannot append 3 tokens", "capacity 2"});
  REQUIRE(cache.size() == 0);
}

// ---- safetensors ----------------------------------------------------------------

TEMPLATE_TEST_CASE("save then load reproduces every parameter bit for bit", "[module][safetensors]",
                   float, double) {
  using T = TestType;
  const std::string path = temp_path("roundtrip");
  DiffAttnV1Config cfg;
  cfg.embed_dim = 32;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  MultiheadDiffAttnV1<T> a(cfg, 1), b(cfg, 2);
  randomize(a, 3, 0.2);
  REQUIRE(snapshot(a) != snapshot(b));
  a.save_safetensors(path, "model.layers.3.self_attn.");
  b.load_safetensors(path, "model.layers.3.self_attn.");
  CHECK(snapshot(a) == snapshot(b));
  const Tensor<T, 3> x = random_x<T>(2, 9, 32, 4);
  const Tensor<T, 3> ya = a.forward(x), yb = b.forward(x);
  CHECK(std::memcmp(ya.data(), yb.data(), sizeof(T) * ya.size()) == 0);

  // the file holds exactly the reference's names with the prefix, in T's dtype
  const diffattn::safetensors::Reader r(path);
  CHECK(r.tensors().size() == 9);
  CHECK(r.info("model.layers.3.self_attn.q_proj.weight").dtype ==
        (std::is_same<T, float>::value ? "F32" : "F64"));
  CHECK(r.info("model.layers.3.self_attn.k_proj.weight").shape == std::vector<index_t>{16, 32});
  CHECK(r.metadata().at("format") == "pt");

  // without the prefix nothing matches: every missing name is listed, nothing changes
  MultiheadDiffAttnV1<T> c(cfg, 5);
  const auto before = snapshot(c);
  test::require_error(
      [&] { c.load_safetensors(path); },
      {"MultiheadDiffAttnV1::load_safetensors", path.c_str(), "missing tensors",
       "'q_proj.weight' (32, 32)", "'subln.weight' (16)", "no parameter was changed"});
  CHECK(snapshot(c) == before);

  // V2 too
  DiffAttnV2Config c2;
  c2.embed_dim = 24;
  c2.num_heads = 4;
  c2.num_kv_heads = 2;
  MultiheadDiffAttnV2<T> v2a(c2, 1), v2b(c2, 2);
  v2a.save_safetensors(path, "blk.");
  v2b.load_safetensors(path, "blk.");
  CHECK(snapshot(v2a) == snapshot(v2b));
  std::remove(path.c_str());
}

TEST_CASE("load converts F64, F16 and BF16 and ignores extra tensors", "[module][safetensors]") {
  namespace st = diffattn::safetensors;
  const std::string path = temp_path("dtypes");
  DiffAttnV2Config cfg;
  cfg.embed_dim = 8;
  cfg.num_heads = 2;
  MultiheadDiffAttnV2<float> m(cfg);
  const auto shapes = m.parameter_shapes();
  // Each tensor in another dtype, values chosen exactly representable in it.
  std::map<std::string, st::TensorData> file;
  std::map<std::string, std::vector<float>> expected;
  int which = 0;
  for (const auto& kv : shapes) {
    index_t n = 1;
    for (index_t e : kv.second) n *= e;
    st::TensorData t;
    t.shape = kv.second;
    std::vector<float>& exp = expected[kv.first];
    const int kind = which++ % 3;
    t.dtype = kind == 0 ? "F64" : kind == 1 ? "F16" : "BF16";
    for (index_t i = 0; i < n; ++i) {
      const float v = static_cast<float>((i % 7) - 3) * 0.25f;  // -0.75 .. 0.75
      exp.push_back(v);
      if (kind == 0) {
        double dv = v;
        std::uint64_t u;
        std::memcpy(&u, &dv, 8);
        for (int b = 0; b < 8; ++b) t.bytes.push_back(static_cast<unsigned char>(u >> (8 * b)));
      } else {
        std::uint32_t u;
        std::memcpy(&u, &v, 4);
        std::uint16_t h;
        if (kind == 2) {
          h = static_cast<std::uint16_t>(u >> 16);  // exact: low bits are zero
        } else {
          // float -> half for these small multiples of 1/4 (normal, exact)
          const int exp2 = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
          h = static_cast<std::uint16_t>(((u >> 16) & 0x8000) |
                                         (v == 0 ? 0 : (exp2 << 10) | ((u >> 13) & 0x3FF)));
        }
        t.bytes.push_back(static_cast<unsigned char>(h & 0xFF));
        t.bytes.push_back(static_cast<unsigned char>(h >> 8));
      }
    }
    file["p." + kv.first] = t;
  }
  const std::vector<float> extra = {1, 2, 3};
  file["p.mlp.up_proj.weight"] = st::make_tensor<float>({3}, extra.data());
  file["other"] = st::make_tensor<float>({1}, extra.data());
  diffattn::write_safetensors(path, file);
  m.load_safetensors(path, "p.");
  auto p = m.parameters();
  for (const auto& kv : expected) {
    INFO(kv.first);
    for (std::size_t i = 0; i < kv.second.size(); ++i)
      CHECK(p.at(kv.first)(static_cast<index_t>(i)) == kv.second[i]);
  }
  std::remove(path.c_str());
}

TEST_CASE("a wrong shape, a missing tensor or a corrupt file changes nothing",
          "[module][safetensors]") {
  namespace st = diffattn::safetensors;
  const std::string path = temp_path("bad");
  DiffAttnV1Config cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  MultiheadDiffAttnV1<float> src(cfg, 1), m(cfg, 2);
  src.save_safetensors(path);
  auto file = diffattn::read_safetensors(path);
  const auto before = snapshot(m);

  // k_proj with a wrong shape; q_proj valid (and would be loaded first)
  auto wrong = file;
  const std::vector<float> z(16 * 8, 0.f);
  wrong["k_proj.weight"] = st::make_tensor<float>({8, 16}, z.data());
  diffattn::write_safetensors(path, wrong);
  test::require_error([&] { m.load_safetensors(path); },
                      {path.c_str(), "'k_proj.weight' has shape (8, 16), expected (16, 16)",
                       "no parameter was changed"});
  CHECK(snapshot(m) == before);

  auto missing = file;
  missing.erase("lambda_k2");
  diffattn::write_safetensors(path, missing);
  test::require_error([&] { m.load_safetensors(path); },
                      {path.c_str(), "missing tensor 'lambda_k2' (4)"});
  CHECK(snapshot(m) == before);

  auto ints = file;
  ints["lambda_q1"] = st::TensorData{"I32", {4}, std::vector<unsigned char>(16)};
  diffattn::write_safetensors(path, ints);
  test::require_error([&] { m.load_safetensors(path); }, {"'lambda_q1' has dtype I32"});
  CHECK(snapshot(m) == before);

  // truncated file
  diffattn::write_safetensors(path, file);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << bytes.substr(0, bytes.size() - 10);
  }
  test::require_error([&] { m.load_safetensors(path); },
                      {"MultiheadDiffAttnV1::load_safetensors", path.c_str(), "out of range"});
  CHECK(snapshot(m) == before);
  auto biased = file;
  const std::vector<float> bias(16, 0.f);
  biased["q_proj.bias"] = st::make_tensor<float>({16}, bias.data());
  diffattn::write_safetensors(path, biased);
  test::require_error([&] { m.load_safetensors(path); },
                      {"'q_proj.bias'", "no bias", "no parameter was changed"});
  CHECK(snapshot(m) == before);
  test::require_error([&] { m.load_safetensors("/nonexistent/file.safetensors"); },
                      {"cannot open"});
  std::remove(path.c_str());
}

// ---- DiffLlama layout ------------------------------------------------------------

namespace {

/// Rotate-half rotary embedding (Llama / DiffLlama) on each `width`-wide head.
void rope_half(Matrix<double>& m, index_t width, double base) {
  const index_t half = width / 2;
  for (index_t i = 0; i < m.rows(); ++i)
    for (index_t h = 0; h < m.cols() / width; ++h)
      for (index_t p = 0; p < half; ++p) {
        const double ang = static_cast<double>(i) * std::pow(base, -2.0 * p / width);
        double& a = m(i, h * width + p);
        double& b = m(i, h * width + p + half);
        const double a0 = a, b0 = b;
        a = a0 * std::cos(ang) - b0 * std::sin(ang);
        b = b0 * std::cos(ang) + a0 * std::sin(ang);
      }
}

/// DiffLlamaAttention's eager forward in float64, from its own weights:
/// nh = 2H query heads of width d, nkv = 2Hkv kv heads, map pairs (j, j + nh/2).
Matrix<double> reference_diffllama(const std::map<std::string, Matrix<double>>& w, index_t nh,
                                   index_t nkv, index_t d, int depth, const Matrix<double>& x,
                                   double eps = 1e-5) {
  Matrix<double> q = x * w.at("q_proj.weight").transpose();
  Matrix<double> k = x * w.at("k_proj.weight").transpose();
  const Matrix<double> v = x * w.at("v_proj.weight").transpose();
  rope_half(q, d, 10000);
  rope_half(k, d, 10000);
  const index_t n_rep = nh / nkv, n = x.rows();
  const double init = lambda_init_formula(depth);
  const double lambda = std::exp(w.at("lambda_q1").row(0).dot(w.at("lambda_k1").row(0))) -
                        std::exp(w.at("lambda_q2").row(0).dot(w.at("lambda_k2").row(0))) + init;
  // attn_output of query head j: softmax(q_j k_{j / n_rep}^T / sqrt(d) + causal) times the
  // value cat(v_rep[j mod nh/2], v_rep[j mod nh/2 + nh/2]), v_rep[t] = v[t / n_rep].
  std::vector<Matrix<double>> outs;
  for (index_t j = 0; j < nh; ++j) {
    const Matrix<double> s =
        head(q, j, d) * head(k, j / n_rep, d).transpose() / std::sqrt(double(d));
    Matrix<double> a = Matrix<double>::Zero(n, n);
    for (index_t i = 0; i < n; ++i) {
      const double mx = s.row(i).head(i + 1).maxCoeff();
      double sum = 0;
      for (index_t t = 0; t <= i; ++t) sum += std::exp(s(i, t) - mx);
      for (index_t t = 0; t <= i; ++t) a(i, t) = std::exp(s(i, t) - mx) / sum;
    }
    const index_t t = j % (nh / 2);
    Matrix<double> val(n, 2 * d);
    val << head(v, t / n_rep, d), head(v, (t + nh / 2) / n_rep, d);
    outs.push_back(a * val);
  }
  Matrix<double> cat(n, nh / 2 * 2 * d);
  for (index_t hh = 0; hh < nh / 2; ++hh) {
    const Matrix<double> o = outs[hh] - lambda * outs[hh + nh / 2];
    for (index_t i = 0; i < n; ++i) {
      const double rms = std::sqrt(o.row(i).squaredNorm() / (2 * d) + eps);
      cat.block(i, hh * 2 * d, 1, 2 * d) = (1 - init) * o.row(i) / rms;
    }
  }
  return cat * w.at("o_proj.weight").transpose();
}

}  // namespace

TEST_CASE("a DiffLlama-layout checkpoint loads into the same layer", "[module][safetensors]") {
  namespace st = diffattn::safetensors;
  const std::string path = temp_path("diffllama");
  struct Case {
    index_t e, h, hkv, hd;
    double eps;
  };
  // The last: DiffLlama's head_dim independent of E / (2H), and its rms_norm_eps.
  for (const Case& c : {Case{32, 2, 2, 0, 1e-5}, Case{48, 4, 2, 0, 1e-5}, Case{64, 4, 1, 0, 1e-5},
                        Case{40, 2, 1, 6, 1e-6}}) {
    DiffAttnV1Config cfg;
    cfg.embed_dim = c.e;
    cfg.num_heads = c.h;
    cfg.num_kv_heads = c.hkv;
    cfg.head_dim = c.hd;
    cfg.norm_eps = c.eps;
    cfg.depth = 2;
    MultiheadDiffAttnV1<double> native(cfg, 11);
    randomize(native, 12, 0.3);
    for (index_t i = 0; i < native.parameters().at("subln.weight").size(); ++i)
      native.parameters().at("subln.weight")(i) = 1.0;  // DiffLlama's groupnorm has no weight
    const auto p = params_of(native);
    const index_t d = c.hd ? c.hd : c.e / (2 * c.h), nh = 2 * c.h, nkv = 2 * c.hkv;

    // DiffLlama weights from the native ones, by the inverse of the documented
    // permutation: native q row (2j + m, 2i + r) is DiffLlama row (j + m nh/2, i + r d/2).
    auto to_hf_qk = [&](const Matrix<double>& wn, index_t heads) {
      Matrix<double> hf(wn.rows(), wn.cols());
      for (index_t j = 0; j < heads / 2; ++j)
        for (index_t m = 0; m < 2; ++m)
          for (index_t i = 0; i < d / 2; ++i)
            for (index_t r = 0; r < 2; ++r)
              hf.row((j + m * heads / 2) * d + i + r * d / 2) = wn.row((2 * j + m) * d + 2 * i + r);
      return hf;
    };
    std::map<std::string, Matrix<double>> hf;
    hf["q_proj.weight"] = to_hf_qk(p.at("q_proj.weight"), nh);
    hf["k_proj.weight"] = to_hf_qk(p.at("k_proj.weight"), nkv);
    Matrix<double> hv(p.at("v_proj.weight").rows(), c.e);
    for (index_t g = 0; g < c.hkv; ++g)
      for (index_t m = 0; m < 2; ++m)
        hv.middleRows((g + m * c.hkv) * d, d) =
            p.at("v_proj.weight").middleRows(g * 2 * d + m * d, d);
    hf["v_proj.weight"] = hv;
    hf["o_proj.weight"] = p.at("out_proj.weight");
    for (const char* n : {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"}) hf[n] = p.at(n);

    std::map<std::string, st::TensorData> file;
    const std::string prefix = "model.layers.2.self_attn.";
    for (const auto& kv : hf) {
      std::vector<index_t> shape = {kv.second.rows(), kv.second.cols()};
      if (kv.first.rfind("lambda_", 0) == 0) shape = {kv.second.cols()};
      file[prefix + kv.first] = st::make_tensor<double>(shape, kv.second.data());
    }
    const std::vector<double> other(4, 1.0);
    file["model.layers.2.mlp.down_proj.weight"] = st::make_tensor<double>({2, 2}, other.data());
    diffattn::write_safetensors(path, file);

    MultiheadDiffAttnV1<double> loaded(cfg, 99);
    randomize(loaded, 98, 0.3);  // subln.weight far from ones: loading must reset it
    loaded.load_safetensors(path, prefix, diffattn::WeightLayout::diffllama);
    const Tensor<double, 3> x = random_x<double>(2, 9, c.e, 13);
    const Tensor<double, 3> y_native = native.forward(x);
    const Tensor<double, 3> y_loaded = loaded.forward(x);
    INFO("E=" << c.e << " H=" << c.h << " Hkv=" << c.hkv);
    double diff = 0;
    for (index_t i = 0; i < y_native.size(); ++i)
      diff = std::max(diff, std::abs(y_native.data()[i] - y_loaded.data()[i]));
    CHECK(diff < 1e-12);
    // and both are DiffLlama's own computation on its own weights
    CHECK(rel_error(y_loaded, [&](index_t b) {
            return reference_diffllama(hf, nh, nkv, d, cfg.depth, batch_rows(x, b), c.eps);
          }) < 1e-12);
    // the native loader refuses this file (no out_proj.weight)
    MultiheadDiffAttnV1<double> other_layer(cfg);
    test::require_error([&] { other_layer.load_safetensors(path, prefix); },
                        {"missing tensor", "out_proj.weight", "subln.weight"});
  }
  std::remove(path.c_str());
}
