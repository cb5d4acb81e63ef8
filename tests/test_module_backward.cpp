// Layer backward: every parameter gradient and dx against central finite
// differences in double, accumulation, zero_grad, errors; rms_norm_backward;
// the analysis maps.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/module.hpp>
#include <diffattn/norm.hpp>

#include "support.hpp"

using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::index_t;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;
using diffattn::TensorView;

namespace {

template <class T, std::size_t R>
Tensor<T, R> random_tensor(const std::array<index_t, R>& shape, std::uint64_t seed,
                           double sigma = 1.0) {
  Tensor<T, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(sigma * rng.normal());
  return t;
}

/// Every parameter drawn at random (projections N(0, sigma^2), lambda vectors
/// N(0, 0.3^2), subln.weight around 1), so that none sits at a special value.
template <class Layer>
void randomize(Layer& m, std::uint64_t seed, double sigma) {
  diffattn::detail::Rng rng(seed);
  for (auto& kv : m.parameters()) {
    const bool lambda_vec = kv.first.rfind("lambda_", 0) == 0 && kv.first != "lambda_proj.weight";
    for (index_t i = 0; i < kv.second.size(); ++i) {
      double v = (lambda_vec ? 0.3 : sigma) * rng.normal();
      if (kv.first == "subln.weight") v = 1.0 + 0.5 * rng.normal();
      kv.second(i) = static_cast<typename decltype(kv.second)::value_type>(v);
    }
  }
}

template <class T>
double dot(const Tensor<T, 3>& a, const Tensor<T, 3>& b) {
  double s = 0;
  for (index_t i = 0; i < a.size(); ++i)
    s += static_cast<double>(a.data()[i]) * static_cast<double>(b.data()[i]);
  return s;
}

/// max |a - b| / max |b|; b is the finite-difference estimate.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  REQUIRE(den > 0);  // a zero gradient would make the comparison vacuous
  return num / den;
}

/// Central difference of L(v) at every element of v (restored afterwards).
template <class F>
std::vector<double> finite_diff(double* v, index_t n, F&& loss, double h = 1e-5) {
  std::vector<double> g(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) {
    const double orig = v[i];
    v[i] = orig + h;
    const double lp = loss();
    v[i] = orig - h;
    const double lm = loss();
    v[i] = orig;
    g[static_cast<std::size_t>(i)] = (lp - lm) / (2 * h);
  }
  return g;
}

template <class Layer>
std::map<std::string, std::vector<double>> copy_grads(Layer& m) {
  std::map<std::string, std::vector<double>> g;
  for (auto& kv : m.gradients())
    for (index_t i = 0; i < kv.second.size(); ++i) g[kv.first].push_back(kv.second(i));
  return g;
}

/// Checks backward of loss = sum(dy o forward(x)) against finite differences
/// for every parameter and for x.
template <class Layer>
void check_against_finite_differences(Layer& m, const std::array<index_t, 3>& xshape,
                                      index_t offset, std::uint64_t seed) {
  Tensor<double, 3> x = random_tensor<double, 3>(xshape, seed);
  const Tensor<double, 3> dy = random_tensor<double, 3>(xshape, seed + 1);
  m.zero_grad();
  m.forward(x, offset);
  const Tensor<double, 3> dx = m.backward(dy);
  const auto grads = copy_grads(m);
  const auto loss = [&] { return dot(m.forward(x, offset), dy); };

  const auto params = m.parameters();
  REQUIRE(grads.size() == params.size());
  for (const auto& kv : params) {
    INFO("parameter " << kv.first);
    REQUIRE(kv.second.is_contiguous());
    const std::vector<double> fd = finite_diff(kv.second.data(), kv.second.size(), loss);
    CHECK(rel_err(grads.at(kv.first), fd) < 1e-6);
  }
  INFO("dx");
  const std::vector<double> fd = finite_diff(x.data(), x.size(), loss);
  CHECK(rel_err(std::vector<double>(dx.data(), dx.data() + dx.size()), fd) < 1e-6);
}

struct V1Case {
  index_t e, h, hkv;
  bool causal, rope, affine;
  index_t offset;
};

struct V2Case {
  index_t e, h, hkv, hd;
  bool causal, rope;
  index_t offset;
};

}  // namespace

TEST_CASE("V1 backward matches finite differences for every parameter and x", "[backward][v1]") {
  const V1Case c = GENERATE(V1Case{16, 2, 2, true, true, true, 0},    // MHA, causal, rope, affine
                            V1Case{16, 2, 2, false, true, true, 0},   // non-causal
                            V1Case{16, 2, 1, true, true, true, 3},    // GQA, position offset
                            V1Case{16, 2, 1, false, false, true, 0},  // GQA, no rope
                            V1Case{16, 2, 2, true, false, false, 0},  // no rope, no affine
                            V1Case{24, 3, 3, false, true, false, 0},  // no affine, 3 heads
                            V1Case{16, 4, 2, true, true, true, 0},    // d = 2, GQA 2
                            V1Case{16, 4, 1, false, true, true, 1});  // GQA 4
  INFO("E " << c.e << " H " << c.h << " Hkv " << c.hkv << " causal " << c.causal << " rope "
            << c.rope << " affine " << c.affine << " offset " << c.offset);
  DiffAttnV1Config cfg;
  cfg.embed_dim = c.e;
  cfg.num_heads = c.h;
  cfg.num_kv_heads = c.hkv;
  cfg.depth = 2;
  cfg.causal = c.causal;
  cfg.rope = c.rope;
  cfg.norm_affine = c.affine;
  MultiheadDiffAttnV1<double> m(cfg, 7);
  randomize(m, 11, 0.4);
  check_against_finite_differences(m, {2, 5, c.e}, c.offset, 101);
}

TEST_CASE("V2 backward matches finite differences for every parameter and x", "[backward][v2]") {
  const V2Case c = GENERATE(V2Case{12, 2, 2, 0, true, true, 0},    // MHA-like, causal, rope
                            V2Case{12, 2, 2, 0, false, true, 0},   // non-causal
                            V2Case{12, 2, 1, 0, true, true, 2},    // GQA (group 4), offset
                            V2Case{12, 2, 1, 0, false, false, 0},  // GQA, no rope
                            V2Case{8, 2, 2, 6, true, false, 0},    // head_dim != E / H
                            V2Case{16, 4, 2, 4, false, true, 0});  // 4 heads, GQA 2
  INFO("E " << c.e << " H " << c.h << " Hkv " << c.hkv << " hd " << c.hd << " causal " << c.causal
            << " rope " << c.rope << " offset " << c.offset);
  DiffAttnV2Config cfg;
  cfg.embed_dim = c.e;
  cfg.num_heads = c.h;
  cfg.num_kv_heads = c.hkv;
  cfg.head_dim = c.hd;
  cfg.causal = c.causal;
  cfg.rope = c.rope;
  MultiheadDiffAttnV2<double> m(cfg, 5);
  randomize(m, 13, 0.5);
  check_against_finite_differences(m, {2, 6, c.e}, c.offset, 202);
}

TEST_CASE("windowed layers' backward matches finite differences", "[backward][masks]") {
  DiffAttnV1Config c1;
  c1.embed_dim = 16;
  c1.num_heads = 2;
  c1.num_kv_heads = 1;
  c1.window_left = 2;
  MultiheadDiffAttnV1<double> m1(c1, 7);
  randomize(m1, 17, 0.4);
  check_against_finite_differences(m1, {2, 6, 16}, 1, 303);
  DiffAttnV2Config c2;
  c2.embed_dim = 12;
  c2.num_heads = 2;
  c2.causal = false;
  c2.window_left = 1;
  c2.window_right = 2;
  MultiheadDiffAttnV2<double> m2(c2, 5);
  randomize(m2, 19, 0.5);
  check_against_finite_differences(m2, {2, 6, 12}, 0, 404);
}

TEMPLATE_TEST_CASE("backward accumulates, zero_grad resets, the state is kept", "[backward]",
                   MultiheadDiffAttnV1<double>, MultiheadDiffAttnV2<double>) {
  typename TestType::config_type cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  TestType m(cfg, 3);
  const Tensor<double, 3> x = random_tensor<double, 3>({2, 4, 16}, 1);
  const Tensor<double, 3> dy = random_tensor<double, 3>({2, 4, 16}, 2);
  for (auto& kv : m.gradients())
    for (index_t i = 0; i < kv.second.size(); ++i) REQUIRE(kv.second(i) == 0);

  m.forward(x);
  const Tensor<double, 3> dx1 = m.backward(dy);
  const auto once = copy_grads(m);
  const Tensor<double, 3> dx2 = m.backward(dy);  // same forward state, added again
  const auto twice = copy_grads(m);
  for (index_t i = 0; i < dx1.size(); ++i) REQUIRE(dx1.data()[i] == dx2.data()[i]);
  for (const auto& kv : once) {
    INFO(kv.first);
    double norm = 0;
    for (std::size_t i = 0; i < kv.second.size(); ++i) {
      CHECK(twice.at(kv.first)[i] == Approx(2 * kv.second[i]).margin(1e-14));
      norm += std::abs(kv.second[i]);
    }
    CHECK(norm > 0);
  }

  m.zero_grad();
  for (auto& kv : m.gradients())
    for (index_t i = 0; i < kv.second.size(); ++i) REQUIRE(kv.second(i) == 0);
  m.backward(dy);
  const auto again = copy_grads(m);
  for (const auto& kv : once)
    for (std::size_t i = 0; i < kv.second.size(); ++i)
      CHECK(again.at(kv.first)[i] == Approx(kv.second[i]).margin(1e-14));

  // The views write through: an optimizer may scale or clear them in place.
  for (auto& kv : m.gradients()) kv.second(0) = 42;
  for (auto& kv : m.gradients()) CHECK(kv.second(0) == 42);
}

TEST_CASE("gradients() is keyed and sized as parameters()", "[backward]") {
  DiffAttnV1Config c1;
  c1.embed_dim = 16;
  c1.num_heads = 2;
  c1.num_kv_heads = 1;
  for (bool affine : {true, false}) {
    c1.norm_affine = affine;
    MultiheadDiffAttnV1<float> m(c1);
    auto p = m.parameters();
    auto g = m.gradients();
    REQUIRE(p.size() == g.size());
    CHECK(g.count("subln.weight") == (affine ? 1u : 0u));
    for (auto& kv : p) CHECK(g.at(kv.first).size() == kv.second.size());
  }
  DiffAttnV2Config c2;
  c2.embed_dim = 16;
  c2.num_heads = 2;
  c2.head_dim = 6;
  MultiheadDiffAttnV2<float> m2(c2);
  auto p = m2.parameters();
  auto g = m2.gradients();
  REQUIRE(p.size() == g.size());
  for (auto& kv : p) CHECK(g.at(kv.first).size() == kv.second.size());
}

TEMPLATE_TEST_CASE("backward refuses a missing forward and a wrong dy", "[backward][errors]",
                   MultiheadDiffAttnV1<float>, MultiheadDiffAttnV2<float>) {
  typename TestType::config_type cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  TestType m(cfg);
  const Tensor<float, 3> dy({1, 3, 16});
  test::require_error([&] { m.backward(dy); }, {"backward", "backward called before forward"});
  m.forward(Tensor<float, 3>({1, 3, 16}));
  const Tensor<float, 3> bad({1, 4, 16});
  test::require_error([&] { m.backward(bad); }, {"backward", "dy", "(1, 4, 16)", "(1, 3, 16)"});
  CHECK_NOTHROW(m.backward(dy));
}

TEMPLATE_TEST_CASE("backward of an empty batch or sequence adds nothing", "[backward]",
                   MultiheadDiffAttnV1<float>, MultiheadDiffAttnV2<float>) {
  typename TestType::config_type cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  TestType m(cfg);
  for (const std::array<index_t, 3> shape : {std::array<index_t, 3>{0, 3, 16}, {2, 0, 16}}) {
    const Tensor<float, 3> x(shape);
    const Tensor<float, 3> y = m.forward(x);
    const Tensor<float, 3> dx = m.backward(y);
    CHECK(dx.shape() == shape);
    for (auto& kv : m.gradients())
      for (index_t i = 0; i < kv.second.size(); ++i) REQUIRE(kv.second(i) == 0);
  }
}

TEMPLATE_TEST_CASE("backward takes a strided dy and float agrees with double", "[backward]",
                   MultiheadDiffAttnV1<float>, MultiheadDiffAttnV2<float>) {
  typename TestType::config_type cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  TestType mf(cfg, 9);
  using Double = std::conditional_t<std::is_same<TestType, MultiheadDiffAttnV1<float>>::value,
                                    MultiheadDiffAttnV1<double>, MultiheadDiffAttnV2<double>>;
  Double md(cfg, 9);
  const Tensor<double, 3> xd = random_tensor<double, 3>({2, 7, 16}, 4);
  const Tensor<double, 3> dyd = random_tensor<double, 3>({2, 7, 16}, 5);
  Tensor<float, 3> xf({2, 7, 16});
  // dy (B, N, E) stored as (N, B, E): a strided view.
  Tensor<float, 3> dy_store({7, 2, 16});
  for (index_t b = 0; b < 2; ++b)
    for (index_t n = 0; n < 7; ++n)
      for (index_t e = 0; e < 16; ++e) {
        xf(b, n, e) = static_cast<float>(xd(b, n, e));
        dy_store(n, b, e) = static_cast<float>(dyd(b, n, e));
      }
  const TensorView<const float, 3> dyf(dy_store.data(), {2, 7, 16}, {16, 32, 1});
  mf.forward(xf);
  const Tensor<float, 3> dxf = mf.backward(dyf);
  md.forward(xd);
  const Tensor<double, 3> dxd = md.backward(dyd);
  double num = 0, den = 0;
  for (index_t i = 0; i < dxd.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(dxf.data()[i]) - dxd.data()[i]));
    den = std::max(den, std::abs(dxd.data()[i]));
  }
  CHECK(num / den < 1e-4);
  auto gf = mf.gradients();
  for (auto& kv : md.gradients()) {
    INFO(kv.first);
    num = den = 0;
    for (index_t i = 0; i < kv.second.size(); ++i) {
      num = std::max(num, std::abs(static_cast<double>(gf.at(kv.first)(i)) - kv.second(i)));
      den = std::max(den, std::abs(kv.second(i)));
    }
    CHECK(num / den < 1e-4);
  }
}

TEST_CASE("rms_norm_backward matches finite differences", "[backward][norm]") {
  const bool with_weight = GENERATE(true, false);
  const double scale = GENERATE(1.0, 0.35);
  INFO("weight " << with_weight << " scale " << scale);
  Tensor<double, 3> x = random_tensor<double, 3>({3, 2, 6}, 21);
  Tensor<double, 1> w = random_tensor<double, 1>({with_weight ? 6 : 0}, 22, 0.5);
  for (index_t j = 0; j < w.size(); ++j) w(j) += 1.0;
  const Tensor<double, 3> dout = random_tensor<double, 3>({3, 2, 6}, 23);
  Tensor<double, 3> out({3, 2, 6});
  Tensor<double, 2> inv({3, 2});
  diffattn::rms_norm<double>(x, w, out.view(), 1e-5, scale, inv.view());
  Tensor<double, 3> dx({3, 2, 6});
  Tensor<double, 1> dw({with_weight ? 6 : 0});
  diffattn::rms_norm_backward<double>(x, w, inv, dout, dx.view(), dw.view(), scale);

  const auto loss = [&] {
    Tensor<double, 3> o({3, 2, 6});
    diffattn::rms_norm<double>(x, w, o.view(), 1e-5, scale);
    return dot(o, dout);
  };
  CHECK(rel_err(std::vector<double>(dx.data(), dx.data() + dx.size()),
                finite_diff(x.data(), x.size(), loss)) < 1e-7);
  if (with_weight)
    CHECK(rel_err(std::vector<double>(dw.data(), dw.data() + dw.size()),
                  finite_diff(w.data(), w.size(), loss)) < 1e-7);
}

TEST_CASE("rms_norm_backward refuses mismatched shapes", "[backward][norm][errors]") {
  const Tensor<float, 2> x({4, 6}), dout({4, 6});
  const Tensor<float, 1> w({6}), none;
  const Tensor<float, 1> inv({4});
  Tensor<float, 2> dx({4, 6}), dx_bad({4, 5});
  Tensor<float, 1> dw({6}), dw_bad({5});
  test::require_error(
      [&] { diffattn::rms_norm_backward<float>(x, w, inv, dout, dx_bad.view(), dw.view()); },
      {"rms_norm_backward", "dx", "(4, 5)", "(4, 6)"});
  test::require_error(
      [&] { diffattn::rms_norm_backward<float>(x, w, inv, dout, dx.view(), dw_bad.view()); },
      {"rms_norm_backward", "dweight", "(5)"});
  test::require_error(
      [&] { diffattn::rms_norm_backward<float>(x, none, inv, dout, dx.view(), dw.view()); },
      {"rms_norm_backward", "dweight", "weight is empty"});
  const Tensor<float, 1> inv_bad({3});
  test::require_error([&] { diffattn::rms_norm_backward<float>(x, w, inv_bad, dout, dx.view()); },
                      {"rms_norm_backward", "inv_rms", "(3)", "(4)"});
}

TEST_CASE("attention_maps: V1 rows sum to 1 - lambda, causal zeros; V2 reproduces forward",
          "[maps]") {
  DiffAttnV1Config c1;
  c1.embed_dim = 16;
  c1.num_heads = 2;
  c1.num_kv_heads = 1;
  MultiheadDiffAttnV1<double> m1(c1, 4);
  randomize(m1, 8, 0.4);
  const Tensor<double, 3> x = random_tensor<double, 3>({2, 5, 16}, 6);
  const Tensor<double, 4> w1 = m1.attention_maps(x, 2);
  REQUIRE(w1.shape() == std::array<index_t, 4>{2, 2, 5, 5});
  const double lambda = m1.lambda_full();
  for (index_t b = 0; b < 2; ++b)
    for (index_t h = 0; h < 2; ++h)
      for (index_t i = 0; i < 5; ++i) {
        double s = 0;
        for (index_t j = 0; j < 5; ++j) {
          s += w1(b, h, i, j);
          if (j > i) CHECK(w1(b, h, i, j) == 0);
        }
        CHECK(s == Approx(1 - lambda).margin(1e-12));
      }
  test::require_error(
      [&] {
        m1.attention_maps(Tensor<double, 3>({1, 2, 8}));
      },
      {"attention_maps", "x", "(1, 2, 8)"});

  // V2 without rope: y = (W v) Wo^T from the maps and the projections.
  DiffAttnV2Config c2;
  c2.embed_dim = 16;
  c2.num_heads = 2;
  c2.num_kv_heads = 1;
  c2.rope = false;
  c2.causal = false;
  MultiheadDiffAttnV2<double> m2(c2, 4);
  randomize(m2, 9, 0.4);
  const Tensor<double, 4> w2 = m2.attention_maps(x);
  const Tensor<double, 3> y = m2.forward(x);
  auto p = m2.parameters();
  const index_t hd = 8;
  double err = 0;
  for (index_t b = 0; b < 2; ++b)
    for (index_t i = 0; i < 5; ++i) {
      std::vector<double> cat(16, 0.0);  // (H * hd)
      for (index_t h = 0; h < 2; ++h)
        for (index_t j = 0; j < 5; ++j)
          for (index_t t = 0; t < hd; ++t) {
            double v = 0;  // v[b, j, 0, t]
            for (index_t e = 0; e < 16; ++e) v += x(b, j, e) * p.at("v_proj.weight")(t * 16 + e);
            cat[static_cast<std::size_t>(h * hd + t)] += w2(b, h, i, j) * v;
          }
      for (index_t o = 0; o < 16; ++o) {
        double yo = 0;
        for (index_t t = 0; t < 16; ++t)
          yo += cat[static_cast<std::size_t>(t)] * p.at("o_proj.weight")(o * 16 + t);
        err = std::max(err, std::abs(yo - y(b, i, o)));
      }
    }
  CHECK(err < 1e-12);
}
