// SGD and AdamW against updates computed by hand from torch.optim's formulas,
// state per name, errors, and a layer that learns with them.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/module.hpp>
#include <diffattn/optim.hpp>

#include "support.hpp"

using diffattn::AdamW;
using diffattn::AdamWOptions;
using diffattn::index_t;
using diffattn::NamedViews;
using diffattn::SGD;
using diffattn::SGDOptions;
using diffattn::Tensor;
using diffattn::TensorView;

namespace {

template <class T>
TensorView<T, 1> view_of(std::vector<T>& v) {
  return TensorView<T, 1>(v.data(), {static_cast<index_t>(v.size())});
}

// Gradients of three steps for two parameters "a" (3) and "b" (2).
const std::vector<std::vector<double>> kGradA = {{0.5, -1.0, 2.0}, {0.1, 0.3, -0.7}, {-2, 0, 1e-3}};
const std::vector<std::vector<double>> kGradB = {{1.5, 0.25}, {-0.4, 0.0}, {0.2, -3.0}};

}  // namespace

TEMPLATE_TEST_CASE("AdamW matches torch.optim.AdamW's update for three steps", "[optim]", float,
                   double) {
  AdamWOptions o;
  o.lr = 0.05;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  AdamW<TestType> opt(o);

  std::vector<TestType> a = {1.0f, -0.5f, 0.25f}, b = {0.0f, 2.0f};
  // The expected values, in double, as torch.optim.AdamW (amsgrad off) writes
  // its single-tensor step:
  //   p *= 1 - lr * wd
  //   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
  //   bias_correction1 = 1 - beta1^t;  bias_correction2 = 1 - beta2^t
  //   denom = sqrt(v) / sqrt(bias_correction2) + eps
  //   p -= (lr / bias_correction1) * m / denom
  std::vector<double> ea(a.begin(), a.end()), eb(b.begin(), b.end());
  std::vector<double> ma(3, 0), va(3, 0), mb(2, 0), vb(2, 0);
  auto torch_step = [&](std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                        const std::vector<double>& g, int t) {
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g[i] * g[i];
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + o.eps;
      p[i] -= (o.lr / bc1) * m[i] / denom;
    }
  };

  for (int t = 1; t <= 3; ++t) {
    std::vector<TestType> ga(kGradA[t - 1].begin(), kGradA[t - 1].end());
    std::vector<TestType> gb(kGradB[t - 1].begin(), kGradB[t - 1].end());
    opt.step({{"a", view_of(a)}, {"b", view_of(b)}}, {{"a", view_of(ga)}, {"b", view_of(gb)}});
    torch_step(ea, ma, va, kGradA[t - 1], t);
    torch_step(eb, mb, vb, kGradB[t - 1], t);
    const double tol = std::is_same<TestType, float>::value ? 1e-6 : 1e-14;
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == Approx(ea[i]).margin(tol));
    for (std::size_t i = 0; i < b.size(); ++i) CHECK(b[i] == Approx(eb[i]).margin(tol));
    CHECK(opt.steps("a") == t);
  }
  // First step by hand, as a number: m/sqrt(v) after bias correction is
  // sign(g) (eps aside), so a[0] = 1 * (1 - 0.005) - 0.05 = 0.945 after step 1.
  AdamW<double> one(o);
  std::vector<double> p = {1.0}, g = {0.5};
  one.step({{"p", view_of(p)}}, {{"p", view_of(g)}});
  CHECK(p[0] == Approx(0.995 - 0.05 * 0.5 / (0.5 + 1e-6)).epsilon(1e-14));
}

TEMPLATE_TEST_CASE("SGD matches torch.optim.SGD with momentum and weight decay", "[optim]", float,
                   double) {
  SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  SGD<TestType> opt(o);
  std::vector<TestType> a = {1.0f, -0.5f, 0.25f};
  std::vector<double> ea(a.begin(), a.end()), buf(3, 0);
  for (int t = 1; t <= 3; ++t) {
    std::vector<TestType> ga(kGradA[t - 1].begin(), kGradA[t - 1].end());
    opt.step({{"a", view_of(a)}}, {{"a", view_of(ga)}});
    for (std::size_t i = 0; i < 3; ++i) {
      const double gi = kGradA[t - 1][i] + o.weight_decay * ea[i];
      buf[i] = t == 1 ? gi : o.momentum * buf[i] + gi;  // torch: buf = g on the first step
      ea[i] -= o.lr * buf[i];
    }
    const double tol = std::is_same<TestType, float>::value ? 1e-6 : 1e-14;
    for (std::size_t i = 0; i < 3; ++i) CHECK(a[i] == Approx(ea[i]).margin(tol));
  }
  // Plain SGD: p - lr g.
  SGD<double> plain(SGDOptions{0.5, 0, 0});
  std::vector<double> p = {2.0}, g = {3.0};
  plain.step({{"p", view_of(p)}}, {{"p", view_of(g)}});
  CHECK(p[0] == 0.5);
}

TEST_CASE("optimizer state is per name: separate calls equal one combined call", "[optim]") {
  AdamW<double> joint, split;
  std::vector<double> a1 = {1, 2}, b1 = {3}, a2 = a1, b2 = b1;
  for (int t = 0; t < 3; ++t) {
    std::vector<double> ga = {0.1 * t - 0.2, 0.3}, gb = {-0.5 + t};
    joint.step({{"a", view_of(a1)}, {"b", view_of(b1)}}, {{"a", view_of(ga)}, {"b", view_of(gb)}});
    split.step({{"a", view_of(a2)}}, {{"a", view_of(ga)}});
    split.step({{"b", view_of(b2)}}, {{"b", view_of(gb)}});
  }
  CHECK(a1 == a2);
  CHECK(b1 == b2);
}

TEST_CASE("optimizers update strided views in place", "[optim]") {
  std::vector<double> store = {1, 100, 2, 100, 3, 100};
  std::vector<double> g = {1, 1, 1};
  TensorView<double, 1> p(store.data(), {3}, {2});
  SGD<double>(SGDOptions{1.0, 0, 0}).step({{"p", p}}, {{"p", view_of(g)}});
  CHECK(store == std::vector<double>{0, 100, 1, 100, 2, 100});
}

TEST_CASE("optimizers refuse bad names, shapes and hyper-parameters", "[optim][errors]") {
  std::vector<double> a = {1, 2, 3}, g2 = {1, 2}, g3 = {1, 2, 3};
  AdamW<double> opt;
  test::require_error(
      [&] {
        opt.step({{"a", view_of(a)}}, {{"b", view_of(g3)}});
      },
      {"AdamW::step", "'a'", "no gradient"});
  test::require_error(
      [&] {
        opt.step({{"a", view_of(a)}}, {{"a", view_of(g2)}});
      },
      {"AdamW::step", "'a'", "(2)", "(3)"});
  test::require_error(
      [&] {
        opt.step({{"a", view_of(a)}}, {{"a", view_of(g3)}, {"c", view_of(g2)}});
      },
      {"AdamW::step", "'c'", "no parameter"});
  CHECK(a == std::vector<double>{1, 2, 3});  // nothing changed
  opt.step({{"a", view_of(a)}}, {{"a", view_of(g3)}});
  test::require_error(
      [&] {
        opt.step({{"a", view_of(g2)}}, {{"a", view_of(g2)}});
      },
      {"AdamW::step", "'a'", "reset()"});

  AdamWOptions bad;
  bad.lr = 0;
  test::require_error([&] { AdamW<float> x(bad); }, {"AdamW", "lr"});
  bad = AdamWOptions{};
  bad.beta2 = 1;
  test::require_error([&] { AdamW<float> x(bad); }, {"AdamW", "beta2"});
  bad = AdamWOptions{};
  bad.weight_decay = -1;
  test::require_error([&] { AdamW<float> x(bad); }, {"AdamW", "weight_decay"});
  test::require_error([&] { SGD<float> x(SGDOptions{0.1, 1.0, 0}); }, {"SGD", "momentum"});
  test::require_error([&] { SGD<float> x(SGDOptions{-1, 0, 0}); }, {"SGD", "lr"});
  SGD<float> sgd;
  test::require_error([&] { sgd.set_lr(std::nan("")); }, {"SGD::set_lr", "lr"});
}

TEST_CASE("a V1 layer fits a target with AdamW over parameters() and gradients()", "[optim]") {
  diffattn::DiffAttnV1Config c;
  c.embed_dim = 16;
  c.num_heads = 2;
  diffattn::MultiheadDiffAttnV1<double> teacher(c, 1), student(c, 2);
  Tensor<double, 3> x({4, 6, 16});
  diffattn::detail::Rng rng(3);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = rng.normal();
  const Tensor<double, 3> target = teacher.forward(x);
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0;
  AdamW<double> opt(o);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const Tensor<double, 3> y = student.forward(x);
    Tensor<double, 3> dy(y.shape());
    double loss = 0;
    for (index_t i = 0; i < y.size(); ++i) {
      const double r = y.data()[i] - target.data()[i];
      loss += r * r / static_cast<double>(y.size());
      dy.data()[i] = 2 * r / static_cast<double>(y.size());
    }
    if (step == 0) first = loss;
    last = loss;
    student.zero_grad();
    student.backward(dy);
    opt.step(student.parameters(), student.gradients());
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.3 * first);
}
