#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
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

struct Shape {
  index_t B, N, M, H, Hkv, d;
};

/// All tensors of one problem, in scalar T.
template <class T>
struct Problem {
  Kind kind;
  Shape s;
  bool causal;
  Tensor<T, 4> q, k, v, dout;
  Tensor<T, 3> logit;  // v2
  T lambda = T(0.6);
  index_t window_left = -1, window_right = -1;

  std::array<index_t, 4> out_shape() const {
    if (kind == Kind::v1) return {s.B, s.N, s.H, 2 * s.d};
    if (kind == Kind::v2) return {s.B, s.N, s.H, s.d};
    return {s.B, s.N, s.H, s.d + 1};
  }
  index_t lse_heads() const { return kind == Kind::plain ? s.H : 2 * s.H; }
  AttentionOptions options(int threads = 0) const {
    AttentionOptions o;
    o.causal = causal;
    o.window_left = window_left;
    o.window_right = window_right;
    o.num_threads = threads;
    return o;
  }

  void forward(Tensor<T, 4>& out, Tensor<T, 3>& lse, int threads = 0) const {
    const auto o = options(threads);
    if (kind == Kind::v1)
      diffattn::diff_attention_v1<T>(q, k, v, lambda, out, lse, o);
    else if (kind == Kind::v2)
      diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
    else
      diffattn::attention<T>(q, k, v, out, lse, o);
  }

  struct Grads {
    Tensor<T, 4> dq, dk, dv;
    Tensor<T, 3> dlogit;
    T dlambda = T(0);
  };

  Grads backward(bool reference, int threads = 0) const {
    Tensor<T, 4> out(out_shape());
    Tensor<T, 3> lse({s.B, lse_heads(), s.N});
    forward(out, lse, threads);
    Grads g{Tensor<T, 4>(q.shape()), Tensor<T, 4>(k.shape()), Tensor<T, 4>(v.shape()),
            Tensor<T, 3>(logit.shape())};
    const auto o = options(threads);
    if (kind == Kind::v1) {
      if (reference)
        diffattn::reference::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, g.dq,
                                                           g.dk, g.dv, g.dlambda, o);
      else
        diffattn::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, g.dq, g.dk, g.dv,
                                                g.dlambda, o);
    } else if (kind == Kind::v2) {
      if (reference)
        diffattn::reference::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, g.dq,
                                                           g.dk, g.dv, g.dlogit, o);
      else
        diffattn::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, g.dq, g.dk, g.dv,
                                                g.dlogit, o);
    } else {
      if (reference)
        diffattn::reference::attention_backward<T>(q, k, v, out, lse, dout, g.dq, g.dk, g.dv, o);
      else
        diffattn::attention_backward<T>(q, k, v, out, lse, dout, g.dq, g.dk, g.dv, o);
    }
    return g;
  }

  /// L = sum(dout o out).
  double loss() const {
    Tensor<T, 4> out(out_shape());
    Tensor<T, 3> lse({s.B, lse_heads(), s.N});
    forward(out, lse);
    double l = 0;
    for (index_t i = 0; i < out.size(); ++i)
      l += static_cast<double>(out.data()[i]) * dout.data()[i];
    return l;
  }
};

template <class T>
Problem<T> make_problem(Kind kind, const Shape& s, bool causal, std::uint64_t seed) {
  Problem<T> p{kind, s, causal, {}, {}, {}, {}, {}};
  const index_t qh = kind == Kind::plain ? s.H : 2 * s.H;
  const index_t kh = kind == Kind::v1 ? 2 * s.Hkv : s.Hkv;
  const index_t dv = kind == Kind::v1 ? 2 * s.d : (kind == Kind::v2 ? s.d : s.d + 1);
  p.q = cast<T>(random_tensor<double, 4>({s.B, s.N, qh, s.d}, seed));
  p.k = cast<T>(random_tensor<double, 4>({s.B, s.M, kh, s.d}, seed + 1));
  p.v = cast<T>(random_tensor<double, 4>({s.B, s.M, s.Hkv, dv}, seed + 2));
  p.dout = cast<T>(random_tensor<double, 4>(p.out_shape(), seed + 3));
  p.logit = cast<T>(random_tensor<double, 3>({s.B, s.N, s.H}, seed + 4));
  return p;
}

template <class U, class T>
Problem<U> convert(const Problem<T>& p) {
  Problem<U> u{p.kind,       p.s,          p.causal,        cast<U>(p.q),
               cast<U>(p.k), cast<U>(p.v), cast<U>(p.dout), cast<U>(p.logit)};
  u.lambda = static_cast<U>(p.lambda);
  u.window_left = p.window_left;
  u.window_right = p.window_right;
  return u;
}

/// Central differences of the loss w.r.t. every element of `x`, against `grad`.
template <std::size_t R>
double fd_error(Problem<double>& p, Tensor<double, R>& x, const Tensor<double, R>& grad) {
  const double h = 1e-5;
  double num = 0, den = 0;
  for (index_t i = 0; i < x.size(); ++i) {
    const double keep = x.data()[i];
    x.data()[i] = keep + h;
    const double lp = p.loss();
    x.data()[i] = keep - h;
    const double lm = p.loss();
    x.data()[i] = keep;
    const double fd = (lp - lm) / (2 * h);
    num = std::max(num, std::abs(fd - grad.data()[i]));
    den = std::max(den, std::abs(fd));
  }
  return den > 0 ? num / den : num;
}

void check_finite_differences(Kind kind, const Shape& s, bool causal, std::uint64_t seed,
                              index_t window_left = -1, index_t window_right = -1) {
  INFO("kind=" << int(kind) << " B=" << s.B << " N=" << s.N << " M=" << s.M << " H=" << s.H
               << " Hkv=" << s.Hkv << " d=" << s.d << " causal=" << causal << " window=("
               << window_left << ", " << window_right << ")");
  Problem<double> p = make_problem<double>(kind, s, causal, seed);
  p.window_left = window_left;
  p.window_right = window_right;
  auto g = p.backward(false);
  CHECK(fd_error(p, p.q, g.dq) < 1e-6);
  CHECK(fd_error(p, p.k, g.dk) < 1e-6);
  CHECK(fd_error(p, p.v, g.dv) < 1e-6);
  if (kind == Kind::v2) CHECK(fd_error(p, p.logit, g.dlogit) < 1e-6);
  if (kind == Kind::v1) {
    const double h = 1e-5, keep = p.lambda;
    p.lambda = keep + h;
    const double lp = p.loss();
    p.lambda = keep - h;
    const double lm = p.loss();
    p.lambda = keep;
    const double fd = (lp - lm) / (2 * h);
    CHECK(std::abs(fd - g.dlambda) <= 1e-6 * std::max(1.0, std::abs(fd)));
  }
  // The reference path agrees with the fused kernel in double.
  auto r = p.backward(true);
  CHECK(rel_error(g.dq, r.dq) < 1e-12);
  CHECK(rel_error(g.dk, r.dk) < 1e-12);
  CHECK(rel_error(g.dv, r.dv) < 1e-12);
  if (kind == Kind::v2) CHECK(rel_error(g.dlogit, r.dlogit) < 1e-12);
  if (kind == Kind::v1)
    CHECK(std::abs(g.dlambda - r.dlambda) <= 1e-12 * std::max(1.0, std::abs(r.dlambda)));
}

void check_float(Kind kind, const Shape& s, bool causal, std::uint64_t seed,
                 index_t window_left = -1, index_t window_right = -1) {
  INFO("float kind=" << int(kind) << " N=" << s.N << " M=" << s.M << " H=" << s.H
                     << " Hkv=" << s.Hkv << " d=" << s.d << " causal=" << causal << " window=("
                     << window_left << ", " << window_right << ")");
  Problem<double> pd = make_problem<double>(kind, s, causal, seed);
  pd.window_left = window_left;
  pd.window_right = window_right;
  const Problem<float> pf = convert<float>(pd);
  const Problem<double> pd_rounded = convert<double>(pf);  // the float inputs, exactly
  const auto ref = pd_rounded.backward(true);
  const auto naive = pf.backward(true);
  const auto fused = pf.backward(false);
  const double floor = 5e-5;
  auto check = [&](const char* name, double fused_err, double naive_err) {
    INFO(name << ": fused " << fused_err << ", naive " << naive_err);
    CHECK(fused_err <= std::max(2 * naive_err, floor));
  };
  check("dq", rel_error(fused.dq, ref.dq), rel_error(naive.dq, ref.dq));
  check("dk", rel_error(fused.dk, ref.dk), rel_error(naive.dk, ref.dk));
  check("dv", rel_error(fused.dv, ref.dv), rel_error(naive.dv, ref.dv));
  if (kind == Kind::v2)
    check("dlogit", rel_error(fused.dlogit, ref.dlogit), rel_error(naive.dlogit, ref.dlogit));
  if (kind == Kind::v1) {
    const double scale = std::max(1.0, std::abs(ref.dlambda));
    check("dlambda", std::abs(fused.dlambda - ref.dlambda) / scale,
          std::abs(naive.dlambda - ref.dlambda) / scale);
  }
}

}  // namespace

TEST_CASE("V1 backward: gradients match central differences", "[backward][v1]") {
  std::uint64_t seed = 10;
  for (bool causal : {false, true}) {
    check_finite_differences(Kind::v1, {2, 5, 5, 2, 1, 3}, causal, seed += 10);
    check_finite_differences(Kind::v1, {1, 3, 7, 2, 2, 4}, causal, seed += 10);  // N < M
  }
  check_finite_differences(Kind::v1, {1, 7, 4, 4, 1, 2}, true,
                           seed += 10);  // N > M: masked rows, GQA 4
}

TEST_CASE("V2 backward: gradients match central differences", "[backward][v2]") {
  std::uint64_t seed = 100;
  for (bool causal : {false, true}) {
    check_finite_differences(Kind::v2, {2, 5, 5, 2, 2, 3}, causal, seed += 10);
    check_finite_differences(Kind::v2, {1, 3, 8, 2, 1, 4}, causal, seed += 10);
  }
}

TEST_CASE("plain attention backward: gradients match central differences", "[backward][plain]") {
  std::uint64_t seed = 200;
  for (bool causal : {false, true}) {
    check_finite_differences(Kind::plain, {2, 6, 6, 4, 2, 3}, causal, seed += 10);
    check_finite_differences(Kind::plain, {1, 2, 9, 2, 1, 5}, causal, seed += 10);
  }
  check_finite_differences(Kind::plain, {1, 8, 3, 1, 1, 2}, true, seed += 10);
}

TEST_CASE("float backward stays within 2x the naive float error", "[backward][float]") {
  std::uint64_t seed = 300;
  for (bool causal : {false, true}) {
    check_float(Kind::v1, {1, 113, 129, 2, 1, 16}, causal, seed += 10);
    check_float(Kind::v2, {2, 61, 61, 2, 1, 8}, causal, seed += 10);
    check_float(Kind::plain, {1, 67, 40, 4, 2, 8}, causal, seed += 10);
  }
  check_float(Kind::v1, {1, 1, 37, 2, 2, 8}, true, seed += 10);  // decoding
}

TEST_CASE("windowed backward: finite differences and the reference", "[backward][masks]") {
  std::uint64_t seed = 700;
  for (Kind kind : {Kind::v1, Kind::v2, Kind::plain}) {
    const index_t hkv = kind == Kind::plain ? 2 : 1;
    check_finite_differences(kind, {1, 7, 7, 2, hkv, 3}, true, seed += 10, 2);
    check_finite_differences(kind, {1, 6, 9, 2, hkv, 3}, false, seed += 10, 1, 2);
    check_finite_differences(kind, {1, 8, 5, 2, hkv, 2}, true, seed += 10, 0);  // diagonal, N > M
    check_finite_differences(kind, {2, 3, 8, 2, hkv, 3}, false, seed += 10, -1, 0);
  }
}

TEST_CASE("windowed float backward stays within 2x the naive float error",
          "[backward][masks][float]") {
  std::uint64_t seed = 800;
  check_float(Kind::v1, {1, 150, 150, 2, 1, 16}, true, seed += 10, 37);
  check_float(Kind::v2, {1, 131, 140, 2, 1, 8}, false, seed += 10, 20, 5);
  check_float(Kind::plain, {1, 97, 97, 4, 2, 8}, true, seed += 10, 0);
  check_float(Kind::v1, {1, 2, 60, 2, 2, 8}, true, seed += 10, 9);  // decoding
}

TEST_CASE("backward is bitwise identical for 1 and 2 threads", "[backward][threads]") {
  const Problem<float> p = make_problem<float>(Kind::v1, {2, 70, 70, 4, 2, 8}, true, 400);
  const auto a = p.backward(false, 1), b = p.backward(false, 2);
  CHECK(test::bitwise_equal(a.dq, b.dq));
  CHECK(test::bitwise_equal(a.dk, b.dk));
  CHECK(test::bitwise_equal(a.dv, b.dv));
  CHECK(a.dlambda == b.dlambda);
}

TEST_CASE("V1 backward with one lambda per head", "[backward][v1]") {
  const Problem<double> p = make_problem<double>(Kind::v1, {2, 9, 9, 3, 3, 4}, true, 500);
  std::vector<double> lambdas = {0.1, 0.6, 1.2};
  TensorView<const double, 1> lv(lambdas.data(), {3});
  Tensor<double, 4> out(p.out_shape());
  Tensor<double, 3> lse({2, 6, 9});
  diffattn::diff_attention_v1<double>(p.q, p.k, p.v, lv, out, lse, p.options());
  Tensor<double, 4> dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape());
  Tensor<double, 4> rq(p.q.shape()), rk(p.k.shape()), rv(p.v.shape());
  Tensor<double, 1> dl({3}), rl({3});
  diffattn::diff_attention_v1_backward<double>(p.q, p.k, p.v, lv, out, lse, p.dout, dq, dk, dv, dl,
                                               p.options());
  diffattn::reference::diff_attention_v1_backward<double>(p.q, p.k, p.v, lv, out, lse, p.dout, rq,
                                                          rk, rv, rl, p.options());
  CHECK(rel_error(dq, rq) < 1e-12);
  CHECK(rel_error(dk, rk) < 1e-12);
  CHECK(rel_error(dv, rv) < 1e-12);
  for (index_t h = 0; h < 3; ++h) CHECK(dl(h) == Approx(rl(h)).epsilon(1e-12));
}

TEST_CASE("backward kernels reject bad input", "[backward][errors]") {
  const Problem<float> p = make_problem<float>(Kind::v1, {1, 4, 5, 1, 1, 4}, false, 600);
  Tensor<float, 4> out(p.out_shape());
  Tensor<float, 3> lse({1, 2, 4});
  p.forward(out, lse);
  Tensor<float, 4> dq(p.q.shape()), dk(p.k.shape()), dv(p.v.shape());
  float dl = 0;
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<float>(
            p.q, p.k, p.v, 0.6f, out, TensorView<const float, 3>(), p.dout, dq, dk, dv, dl);
      },
      {"diff_attention_v1_backward", "lse is required"});
  Tensor<float, 4> dq_bad({1, 4, 2, 5});
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<float>(p.q, p.k, p.v, 0.6f, out, lse, p.dout, dq_bad,
                                                    dk, dv, dl);
      },
      {"diff_attention_v1_backward", "dq has shape (1, 4, 2, 5)", "(1, 4, 2, 4)"});
  TensorView<float, 4> dk_alias(dq.data(), dk.shape());
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<float>(p.q, p.k, p.v, 0.6f, out, lse, p.dout, dq,
                                                    dk_alias, dv, dl);
      },
      {"diff_attention_v1_backward", "dq", "dk", "overlap"});
  TensorView<float, 4> dv_on_v(const_cast<float*>(p.v.data()), p.v.shape());
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<float>(p.q, p.k, p.v, 0.6f, out, lse, p.dout, dq, dk,
                                                    dv_on_v, dl);
      },
      {"diff_attention_v1_backward", "dv overlaps input v"});
  Tensor<float, 4> k_bad({1, 5, 3, 4});
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<float>(p.q, k_bad, p.v, 0.6f, out, lse, p.dout, dq, dk,
                                                    dv, dl);
      },
      {"diff_attention_v1_backward (forward arguments)", "k has 3 heads"});
}
