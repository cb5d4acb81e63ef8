// The backward kernels with 16-bit storage (bfloat16, half): q, k, v, out and
// dout stored as S, lse and lambda float; dq, dk, dv (and V2's dlambda_logit)
// written as S, dlambda and dsinks float. Checked against the float64
// reference backward on the same 16-bit inputs.
//
// Error bound. The inputs are the 16-bit values themselves (exact in float
// and double), so the float64 reference y is the exact gradient up to 1e-15.
// The 16-bit kernel widens every input once (exactly) where it packs it, runs
// the float kernel's arithmetic and rounds each gradient once to S:
//   g_S = round_S(g_f),  |round_S(x) - x| <= u_S |x|,
// u_S = 2^-8 for bfloat16, 2^-11 for half, g_f the float kernel's gradient on
// the widened inputs. With e_f the float accumulation error of the backward
// (bounded as in test_attention_backward.cpp: max(2 x the naive float
// reference's error, 5e-5), relative to max |y|),
//   max |g_S - y| / max |y| <= u_S (1 + e_f) + e_f.
// dlambda and dsinks stay float (no rounding): e_f alone.
//
// Where the kernel runs on the float path (every build but bfloat16 under
// AVX512-BF16), the test checks the statement the bound rests on: g_S is
// bitwise round_S(g_f) of the float kernel on the widened inputs, and dlambda
// bitwise the float kernel's. With bfloat16 under AVX512-BF16 the scores
// S = Q K^T and dW = dO V^T run on bf16 dot products (bf16_dot.hpp): float sums
// of the same exact products in another order, inside e_f. So do dQ, dK and dV
// (detail/backward/bf16_backward.hpp), with each element of dS_m and W rounded
// once to bf16, which adds at most 2^-8 m to a gradient element, m the sum of
// |dS| |k| (dq), |dS| |q| (dk, both times the scale) or |w| |do| (dv) over the
// terms of its product (grad_magnitudes, in float64 from the widened inputs).
// dS's rows sum to zero, so m can be far above the gradient itself, and the
// bound is elementwise, as for the forward's rounded W (test_half.cpp):
//   |g_S - y|_e <= u_S (|y_e| + delta_e) + delta_e,
//   delta_e = e_f max |y| + 2^-8 (1 + 2^-6) m_e
// (the 2^-6 covers the float dS's own error next to dS). dlambda and
// dlambda_logit come from the float maps and dW, not rounded: the first bound.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/detail/kernel/bf16_dot.hpp>
#include <diffattn/isa.hpp>
#include <diffattn/packed.hpp>
#include <diffattn/reference.hpp>
#include <diffattn/types.hpp>

#include "attention_support.hpp"
#include "half_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::bfloat16;
using diffattn::half;
using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using test::bf16_dot;
using test::cast;
using test::random_tensor;
using test::rel_error;
using test::type_name;
using test::unit_roundoff;

namespace {

enum class Kind { v1, v1_heads, v2, plain };
const char* name(Kind k) {
  switch (k) {
    case Kind::v1:
      return "v1";
    case Kind::v1_heads:
      return "v1 (lambda per head)";
    case Kind::v2:
      return "v2";
    default:
      return "plain";
  }
}

struct Shape {
  index_t B, N, M, H, Hkv, d;  // H: DIFF heads (v1, v2) or query heads (plain)
};

struct Case {
  Case() = default;
  Case(Kind kind_, Shape s_, bool causal_, index_t left = -1, index_t right = -1)
      : kind(kind_), s(s_), causal(causal_), window_left(left), window_right(right) {}
  Kind kind = Kind::plain;
  Shape s{};
  bool causal = false;
  index_t window_left = -1, window_right = -1;
  float softcap = 0;
  std::vector<float> slopes, sinks;  // ALiBi slopes, sinks (Hq), or empty
};

/// One problem in storage T: inputs, the forward's out and lse, and the
/// gradients of one backward call.
template <class T>
struct Problem {
  using C = diffattn::compute_t<T>;
  Case c;
  Tensor<T, 4> q, k, v, dout, out;
  Tensor<T, 3> logit;  // v2 (B, N, H)
  Tensor<C, 3> lse;
  Tensor<C, 1> lambda_heads;  // v1_heads (H)
  C lambda = C(0.6);

  bool v1() const { return c.kind == Kind::v1 || c.kind == Kind::v1_heads; }
  std::array<index_t, 4> out_shape() const {
    const Shape& s = c.s;
    if (v1()) return {s.B, s.N, s.H, 2 * s.d};
    if (c.kind == Kind::v2) return {s.B, s.N, s.H, s.d};
    return {s.B, s.N, s.H, s.d + 3};
  }
  index_t lse_heads() const { return c.kind == Kind::plain ? c.s.H : 2 * c.s.H; }
  AttentionOptions options() const {
    AttentionOptions o;
    o.causal = c.causal;
    o.window_left = c.window_left;
    o.window_right = c.window_right;
    o.softcap = c.softcap;
    if (!c.slopes.empty())
      o.alibi_slopes = TensorView<const float, 1>(c.slopes.data(), {lse_heads()});
    if (!c.sinks.empty()) o.sinks = TensorView<const float, 1>(c.sinks.data(), {lse_heads()});
    return o;
  }

  void forward() {
    out = Tensor<T, 4>(out_shape());
    lse = Tensor<C, 3>({c.s.B, lse_heads(), c.s.N});
    const AttentionOptions o = options();
    if (c.kind == Kind::v1)
      diffattn::diff_attention_v1<T>(q, k, v, lambda, out, lse, o);
    else if (c.kind == Kind::v1_heads)
      diffattn::diff_attention_v1<T>(q, k, v, lambda_heads, out, lse, o);
    else if (c.kind == Kind::v2)
      diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
    else
      diffattn::attention<T>(q, k, v, out, lse, o);
  }

  struct Grads {
    Tensor<T, 4> dq, dk, dv;
    Tensor<T, 3> dlogit;
    Tensor<C, 1> dlambda;  // (1) or (H)
    Tensor<C, 1> dsinks;   // (Hq) with sinks, else (0)
  };

  Grads backward(bool reference) const {
    Grads g{Tensor<T, 4>(q.shape()),
            Tensor<T, 4>(k.shape()),
            Tensor<T, 4>(v.shape()),
            Tensor<T, 3>(logit.shape()),
            Tensor<C, 1>({c.kind == Kind::v1_heads ? c.s.H : index_t(1)}),
            Tensor<C, 1>({c.sinks.empty() ? index_t(0) : lse_heads()})};
    const AttentionOptions o = options();
    const TensorView<C, 1> ds = c.sinks.empty() ? TensorView<C, 1>() : g.dsinks.view();
    namespace ref = diffattn::reference;
    if (c.kind == Kind::v1) {
      if constexpr (std::is_same<T, C>::value) {
        if (reference) {
          ref::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, g.dq, g.dk, g.dv,
                                             g.dlambda(0), o);
          return g;
        }
      }
      diffattn::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, g.dq, g.dk, g.dv,
                                              g.dlambda(0), o, ds);
    } else if (c.kind == Kind::v1_heads) {
      if constexpr (std::is_same<T, C>::value) {
        if (reference) {
          ref::diff_attention_v1_backward<T>(q, k, v, lambda_heads, out, lse, dout, g.dq, g.dk,
                                             g.dv, g.dlambda, o);
          return g;
        }
      }
      diffattn::diff_attention_v1_backward<T>(q, k, v, lambda_heads, out, lse, dout, g.dq, g.dk,
                                              g.dv, g.dlambda, o, ds);
    } else if (c.kind == Kind::v2) {
      if constexpr (std::is_same<T, C>::value) {
        if (reference) {
          ref::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, g.dq, g.dk, g.dv,
                                             g.dlogit, o);
          return g;
        }
      }
      diffattn::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, g.dq, g.dk, g.dv,
                                              g.dlogit, o, ds);
    } else {
      if constexpr (std::is_same<T, C>::value) {
        if (reference) {
          ref::attention_backward<T>(q, k, v, out, lse, dout, g.dq, g.dk, g.dv, o);
          return g;
        }
      }
      diffattn::attention_backward<T>(q, k, v, out, lse, dout, g.dq, g.dk, g.dv, o, ds);
    }
    return g;
  }
};

/// The 16-bit problem of a case: random inputs rounded to S, its forward run.
template <class S>
Problem<S> make_problem(const Case& c, std::uint64_t seed) {
  Problem<S> p;
  p.c = c;
  const Shape& s = c.s;
  const index_t qh = c.kind == Kind::plain ? s.H : 2 * s.H;
  const index_t kh = (c.kind == Kind::v1 || c.kind == Kind::v1_heads) ? 2 * s.Hkv : s.Hkv;
  const index_t dv = p.out_shape()[3];
  p.q = cast<S>(random_tensor<float, 4>({s.B, s.N, qh, s.d}, seed));
  p.k = cast<S>(random_tensor<float, 4>({s.B, s.M, kh, s.d}, seed + 1));
  p.v = cast<S>(random_tensor<float, 4>({s.B, s.M, s.Hkv, dv}, seed + 2));
  p.dout = cast<S>(random_tensor<float, 4>(p.out_shape(), seed + 3));
  p.logit = cast<S>(random_tensor<float, 3>({s.B, s.N, s.H}, seed + 4, 2.0));
  p.lambda_heads = Tensor<float, 1>({s.H});
  for (index_t h = 0; h < s.H; ++h) p.lambda_heads(h) = 0.3f + 0.1f * static_cast<float>(h);
  p.forward();
  return p;
}

/// The same problem in U: inputs, out and lse converted exactly (no forward run).
template <class U, class S>
Problem<U> convert(const Problem<S>& p) {
  Problem<U> u;
  u.c = p.c;
  u.q = cast<U>(p.q);
  u.k = cast<U>(p.k);
  u.v = cast<U>(p.v);
  u.dout = cast<U>(p.dout);
  u.out = cast<U>(p.out);
  u.logit = cast<U>(p.logit);
  u.lse = cast<diffattn::compute_t<U>>(p.lse);
  u.lambda_heads = cast<diffattn::compute_t<U>>(p.lambda_heads);
  u.lambda = static_cast<diffattn::compute_t<U>>(p.lambda);
  return u;
}

/// For each element of dq, dk and dv, the sum m of the magnitudes of the
/// terms whose factor dS_m or W the bf16 gradient products round (see the
/// top), in float64 from the widened inputs: the maps A_m from the scores as
/// the kernels form them (scale, softcap, ALiBi bias, causal and window
/// masks, the sink in the normaliser), dW = dO V^T, D_m = sum_j A_m dW,
/// dS_1 = A_1 o (dW - D_1), dS_2 = -lambda_i A_2 o (dW - D_2) (each times the
/// softcap's derivative 1 - tanh^2), W = A_1 - lambda_i A_2 (plain: A, dS).
struct Magnitudes {
  Tensor<double, 4> q, k, v;
};

Magnitudes grad_magnitudes(const Problem<double>& p) {
  const Case& c = p.c;
  const Shape& s = c.s;
  const bool v1 = p.v1();
  const int maps = c.kind == Kind::plain ? 1 : 2;
  const index_t group = s.H / s.Hkv, dv = p.v.shape(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  const double inf = std::numeric_limits<double>::infinity();
  const index_t wr = c.causal ? 0 : c.window_right;
  Magnitudes g{Tensor<double, 4>(p.q.shape()), Tensor<double, 4>(p.k.shape()),
               Tensor<double, 4>(p.v.shape())};
  std::vector<double> dw(static_cast<std::size_t>(s.M)), w(dw.size());
  std::vector<std::vector<double>> a(2, dw), deriv(2, dw);
  for (index_t b = 0; b < s.B; ++b)
    for (index_t oh = 0; oh < s.H; ++oh)
      for (index_t i = 0; i < s.N; ++i) {
        const index_t diag = i + s.M - s.N, hv = oh / group;
        for (index_t j = 0; j < s.M; ++j) {
          double x = 0;
          for (index_t t = 0; t < dv; ++t) x += p.dout(b, i, oh, t) * p.v(b, j, hv, t);
          dw[j] = x;
        }
        double lambda = 1;
        if (c.kind == Kind::v1) lambda = p.lambda;
        if (c.kind == Kind::v1_heads) lambda = p.lambda_heads(oh);
        if (c.kind == Kind::v2) lambda = 1.0 / (1.0 + std::exp(-p.logit(b, i, oh)));
        std::fill(w.begin(), w.end(), 0.0);
        for (int m = 0; m < maps; ++m) {
          const index_t qh = maps == 1 ? oh : 2 * oh + m, kh = v1 ? 2 * hv + m : hv;
          double mx = c.sinks.empty() ? -inf : static_cast<double>(c.sinks[qh]);
          for (index_t j = 0; j < s.M; ++j) {
            const bool visible =
                (c.window_left < 0 || j >= diag - c.window_left) && (wr < 0 || j <= diag + wr);
            double x = 0;
            for (index_t t = 0; t < s.d; ++t) x += p.q(b, i, qh, t) * p.k(b, j, kh, t);
            x *= scale;
            deriv[m][j] = 1;
            if (c.softcap > 0) {
              const double th = std::tanh(x / c.softcap);
              x = c.softcap * th;
              deriv[m][j] = 1 - th * th;
            }
            if (!c.slopes.empty()) x -= c.slopes[qh] * std::abs(static_cast<double>(diag - j));
            a[m][j] = visible ? x : -inf;
            mx = std::max(mx, a[m][j]);
          }
          double sum = c.sinks.empty() ? 0.0 : std::exp(c.sinks[qh] - mx);
          for (index_t j = 0; j < s.M; ++j) sum += std::exp(a[m][j] - mx);  // exp(-inf) = 0
          double dsum = 0;
          for (index_t j = 0; j < s.M; ++j) {
            a[m][j] = mx > -inf ? std::exp(a[m][j] - mx) / sum : 0.0;
            dsum += a[m][j] * dw[j];
          }
          const double coef = m == 0 ? 1.0 : -lambda;
          for (index_t j = 0; j < s.M; ++j) {
            const double ds = std::abs(coef * a[m][j] * (dw[j] - dsum) * deriv[m][j]);
            w[j] += coef * a[m][j];
            for (index_t t = 0; t < s.d; ++t) {
              g.q(b, i, qh, t) += scale * ds * std::abs(p.k(b, j, kh, t));
              g.k(b, j, kh, t) += scale * ds * std::abs(p.q(b, i, qh, t));
            }
          }
        }
        for (index_t j = 0; j < s.M; ++j)
          for (index_t t = 0; t < dv; ++t)
            g.v(b, j, hv, t) += std::abs(w[j]) * std::abs(p.dout(b, i, oh, t));
      }
  return g;
}

/// Over the checks of the bf16 gradient products so far, for the report at
/// the end of a run (DIFFATTN_TEST_REPORT): the largest |g - y| / bound and
/// the largest max |g - y| / max |y|.
double g_worst_ratio = 0, g_worst_rel = 0;

/// The elementwise bound of the top for one gradient of the bf16 dot-product
/// path: e_f the float error (relative to max |y|), m its magnitudes.
template <class S>
void check_elementwise(const char* what, const Tensor<S, 4>& g, const Tensor<double, 4>& y,
                       const Tensor<double, 4>& m, double e_f) {
  const double u = unit_roundoff<S>();
  double ymax = 0, worst = 0, err = 0;
  for (index_t e = 0; e < y.size(); ++e) ymax = std::max(ymax, std::abs(y.data()[e]));
  index_t bad = 0;
  for (index_t e = 0; e < y.size(); ++e) {
    const double ye = y.data()[e], diff = std::abs(static_cast<double>(g.data()[e]) - ye);
    const double delta = e_f * ymax + std::ldexp(1.0 + 1.0 / 64, -8) * m.data()[e];
    const double bound = u * (std::abs(ye) + delta) + delta;
    worst = std::max(worst, diff / bound);
    err = std::max(err, diff);
    if (diff > bound) ++bad;
  }
  const double rel = ymax > 0 ? err / ymax : err;
  g_worst_ratio = std::max(g_worst_ratio, worst);
  g_worst_rel = std::max(g_worst_rel, rel);
  INFO(what << ": largest |g - y| / bound " << worst << ", max |g - y| / max |y| " << rel);
  CHECK(bad == 0);
}

/// check_elementwise for dq, dk and dv of g16 against y, each with e_f
/// twice the error of `base` (the naive float reference, or the float
/// kernel) against y, at least 5e-5, and the magnitudes of pd.
template <class G16, class G, class GB>
void check_grads_elementwise(const G16& g16, const G& y, const GB& base,
                             const Problem<double>& pd) {
  const Magnitudes mag = grad_magnitudes(pd);
  auto e_f = [&](const auto& b, const auto& r) { return std::max(2 * rel_error(b, r), 5e-5); };
  check_elementwise("dq", g16.dq, y.dq, mag.q, e_f(base.dq, y.dq));
  check_elementwise("dk", g16.dk, y.dk, mag.k, e_f(base.dk, y.dk));
  check_elementwise("dv", g16.dv, y.dv, mag.v, e_f(base.dv, y.dv));
}

template <class A, class B, std::size_t R>
bool bitwise_rounded(const Tensor<A, R>& a, const Tensor<B, R>& b) {
  // a == round_A(b), element by element (bit patterns).
  for (index_t i = 0; i < a.size(); ++i) {
    const A r = static_cast<A>(b.data()[i]);
    if (std::memcmp(&r, a.data() + i, sizeof(A)) != 0) return false;
  }
  return true;
}

/// On the float path: dq, dk, dv (and V2's dlambda_logit) are the float
/// kernel's, each rounded once.
template <class G16, class GF>
void check_rounded_inputs(const G16& g16, const GF& gf, Kind kind) {
  CHECK(bitwise_rounded(g16.dq, gf.dq));
  CHECK(bitwise_rounded(g16.dk, gf.dk));
  CHECK(bitwise_rounded(g16.dv, gf.dv));
  if (kind == Kind::v2) CHECK(bitwise_rounded(g16.dlogit, gf.dlogit));
}

template <class S>
void check_case(const Case& c, std::uint64_t seed) {
  const Shape& s = c.s;
  INFO(type_name<S>() << " " << name(c.kind) << " B=" << s.B << " N=" << s.N << " M=" << s.M
                      << " H=" << s.H << " Hkv=" << s.Hkv << " d=" << s.d << " causal=" << c.causal
                      << " window=(" << c.window_left << ", " << c.window_right << ")"
                      << " bf16 dot products: " << bf16_dot<S>());
  const Problem<S> p16 = make_problem<S>(c, seed);
  const Problem<float> pf = convert<float>(p16);    // the 16-bit inputs widened, exactly
  const Problem<double> pd = convert<double>(p16);  // and in float64
  const auto g16 = p16.backward(false);
  const auto gf = pf.backward(false);
  const auto naive = pf.backward(true);
  const auto ref = pd.backward(true);
  const double u = unit_roundoff<S>();
  auto check = [&](const char* what, double err16, double errf, double naive_err, bool rounded) {
    const double e_f = std::max(2 * naive_err, 5e-5);
    const double bound = rounded ? u * (1 + e_f) + e_f : e_f;
    INFO(what << ": 16-bit " << err16 << ", float kernel " << errf << ", naive float " << naive_err
              << ", bound " << bound);
    CHECK(errf <= e_f);
    CHECK(err16 <= bound);
  };
  if (bf16_dot<S>()) {  // dS and W rounded: the elementwise bound
    check_grads_elementwise(g16, ref, naive, pd);
  } else {
    check("dq", rel_error(g16.dq, ref.dq), rel_error(gf.dq, ref.dq), rel_error(naive.dq, ref.dq),
          true);
    check("dk", rel_error(g16.dk, ref.dk), rel_error(gf.dk, ref.dk), rel_error(naive.dk, ref.dk),
          true);
    check("dv", rel_error(g16.dv, ref.dv), rel_error(gf.dv, ref.dv), rel_error(naive.dv, ref.dv),
          true);
  }
  if (c.kind == Kind::v2)
    check("dlambda_logit", rel_error(g16.dlogit, ref.dlogit), rel_error(gf.dlogit, ref.dlogit),
          rel_error(naive.dlogit, ref.dlogit), true);
  if (c.kind == Kind::v1 || c.kind == Kind::v1_heads) {
    double scale = 1;
    for (index_t h = 0; h < ref.dlambda.size(); ++h)
      scale = std::max(scale, std::abs(ref.dlambda(h)));
    double e16 = 0, ef = 0, en = 0;
    for (index_t h = 0; h < ref.dlambda.size(); ++h) {
      e16 = std::max(e16, std::abs(g16.dlambda(h) - ref.dlambda(h)) / scale);
      ef = std::max(ef, std::abs(gf.dlambda(h) - ref.dlambda(h)) / scale);
      en = std::max(en, std::abs(naive.dlambda(h) - ref.dlambda(h)) / scale);
    }
    check("dlambda", e16, ef, en, false);
  }
  if (!bf16_dot<S>()) {
    // The float kernel's arithmetic, each gradient rounded once.
    check_rounded_inputs(g16, gf, c.kind);
    CHECK(bitwise_rounded(g16.dlambda, gf.dlambda));
  }
}

/// Score modifiers (softcap, ALiBi, sinks and dsinks): the float64 reference
/// does not take them, so y is the double kernel (tested against finite
/// differences in test_modifiers.cpp) and e_f twice the float kernel's error
/// against it (at least 5e-5); the same bound, and on the float path the same
/// bitwise statement, as check_case.
template <class S>
void check_modified_case(const Case& c, std::uint64_t seed) {
  const Shape& s = c.s;
  INFO(type_name<S>() << " " << name(c.kind) << " N=" << s.N << " M=" << s.M << " H=" << s.H
                      << " Hkv=" << s.Hkv << " causal=" << c.causal << " softcap=" << c.softcap
                      << " alibi=" << !c.slopes.empty() << " sinks=" << !c.sinks.empty()
                      << " bf16 dot products: " << bf16_dot<S>());
  const Problem<S> p16 = make_problem<S>(c, seed);
  const Problem<float> pf = convert<float>(p16);
  const Problem<double> pd = convert<double>(p16);
  const auto g16 = p16.backward(false);
  const auto gf = pf.backward(false);
  const auto y = pd.backward(false);
  const double u = unit_roundoff<S>();
  auto check = [&](const char* what, double err16, double errf, bool rounded) {
    const double e_f = std::max(2 * errf, 5e-5);
    const double bound = rounded ? u * (1 + e_f) + e_f : e_f;
    INFO(what << ": 16-bit " << err16 << ", float kernel " << errf << ", bound " << bound);
    CHECK(err16 <= bound);
  };
  if (bf16_dot<S>()) {  // dS and W rounded: the elementwise bound
    check_grads_elementwise(g16, y, gf, pd);
  } else {
    check("dq", rel_error(g16.dq, y.dq), rel_error(gf.dq, y.dq), true);
    check("dk", rel_error(g16.dk, y.dk), rel_error(gf.dk, y.dk), true);
    check("dv", rel_error(g16.dv, y.dv), rel_error(gf.dv, y.dv), true);
  }
  if (c.kind == Kind::v2)
    check("dlambda_logit", rel_error(g16.dlogit, y.dlogit), rel_error(gf.dlogit, y.dlogit), true);
  if (!c.sinks.empty())
    check("dsinks", rel_error(g16.dsinks, y.dsinks), rel_error(gf.dsinks, y.dsinks), false);
  if (!bf16_dot<S>()) {
    check_rounded_inputs(g16, gf, c.kind);
    CHECK(bitwise_rounded(g16.dsinks, gf.dsinks));
  }
}

template <class S>
void check_all_families() {
  std::uint64_t seed = 700;
  const Shape shapes[] = {
      {2, 7, 7, 2, 1, 5},     // odd sizes, GQA 2
      {1, 9, 23, 2, 2, 8},    // N < M: causal with offset 14
      {1, 13, 6, 4, 1, 3},    // N > M: causal rows that see no key, GQA 4
      {1, 67, 83, 2, 1, 16},  // several query blocks and key panels
  };
  for (Kind kind : {Kind::v1, Kind::v1_heads, Kind::v2, Kind::plain})
    for (const Shape& s : shapes)
      for (bool causal : {false, true}) check_case<S>({kind, s, causal}, seed += 10);
  // Windows: left, right and both, causal or not.
  for (Kind kind : {Kind::v1, Kind::v2, Kind::plain}) {
    check_case<S>({kind, {1, 67, 71, 2, 1, 8}, true, 9, -1}, seed += 10);
    check_case<S>({kind, {2, 19, 19, 2, 2, 4}, false, 4, 3}, seed += 10);
    check_case<S>({kind, {1, 11, 31, 2, 1, 6}, false, -1, 2}, seed += 10);
  }
  // Score modifiers: softcap, ALiBi and sinks together, causal with an offset.
  for (Kind kind : {Kind::v1, Kind::v1_heads, Kind::v2, Kind::plain}) {
    Case c{kind, {1, 13, 29, 2, 1, 8}, true};
    const index_t hq = kind == Kind::plain ? 2 : 4;
    c.softcap = 5.0f;
    for (index_t h = 0; h < hq; ++h) {
      c.slopes.push_back(std::pow(2.0f, -0.5f * static_cast<float>(h + 1)));
      c.sinks.push_back(0.5f - 0.4f * static_cast<float>(h));
    }
    check_modified_case<S>(c, seed += 10);
  }
}

}  // namespace

TEST_CASE("bfloat16 backward: every shape family against the float64 reference",
          "[half][backward]") {
  check_all_families<bfloat16>();
  if (bf16_dot<bfloat16>() && std::getenv("DIFFATTN_TEST_REPORT"))
    std::printf(
        "bf16 gradient products: largest |g - y| / bound %.3f, largest max |g - y| / "
        "max |y| %.3g\n",
        g_worst_ratio, g_worst_rel);
}

TEST_CASE("half backward: every shape family against the float64 reference", "[half][backward]") {
  check_all_families<half>();
}

TEST_CASE("16-bit varlen backward equals the batch backward of each sequence",
          "[half][backward][varlen]") {
  // Two sequences packed back to back (3 and 8 queries, 5 and 11 keys),
  // causal: every gradient bitwise the one of a batch call on that sequence.
  using S = bfloat16;
  const std::vector<index_t> nq = {3, 8}, nk = {5, 11};
  const index_t H = 2, d = 6, Tq = 11, Tk = 16;
  const auto seqs = diffattn::PackedSequences::from_lengths(nq, nk);
  const Tensor<S, 3> q = cast<S>(random_tensor<float, 3>({Tq, 2 * H, d}, 41));
  const Tensor<S, 3> k = cast<S>(random_tensor<float, 3>({Tk, 1, d}, 42));
  const Tensor<S, 3> v = cast<S>(random_tensor<float, 3>({Tk, 1, d}, 43));
  const Tensor<S, 2> logit = cast<S>(random_tensor<float, 2>({Tq, H}, 44));
  const Tensor<S, 3> dout = cast<S>(random_tensor<float, 3>({Tq, H, d}, 45));
  AttentionOptions o;
  o.causal = true;
  Tensor<S, 3> out({Tq, H, d});
  Tensor<float, 2> lse({2 * H, Tq});
  diffattn::diff_attention_v2_varlen<S>(q, k, v, logit, out, lse, seqs, o);
  Tensor<S, 3> dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<S, 2> dlogit(logit.shape());
  diffattn::diff_attention_v2_varlen_backward<S>(q, k, v, logit, out, lse, dout, dq, dk, dv, dlogit,
                                                 seqs, o);
  index_t q0 = 0, k0 = 0;
  for (std::size_t sidx = 0; sidx < nq.size(); ++sidx) {
    const index_t n = nq[sidx], m = nk[sidx];
    INFO("sequence " << sidx);
    auto rows4 = [](const Tensor<S, 3>& t, index_t r0, index_t r) {
      Tensor<S, 4> x({1, r, t.shape(1), t.shape(2)});
      for (index_t i = 0; i < r; ++i)
        for (index_t h = 0; h < t.shape(1); ++h)
          for (index_t c = 0; c < t.shape(2); ++c) x(0, i, h, c) = t(r0 + i, h, c);
      return x;
    };
    const Tensor<S, 4> qs = rows4(q, q0, n), ks = rows4(k, k0, m), vs = rows4(v, k0, m),
                       ds = rows4(dout, q0, n);
    Tensor<S, 3> ls({1, n, H});
    for (index_t i = 0; i < n; ++i)
      for (index_t h = 0; h < H; ++h) ls(0, i, h) = logit(q0 + i, h);
    Tensor<S, 4> os({1, n, H, d});
    Tensor<float, 3> lses({1, 2 * H, n});
    diffattn::diff_attention_v2<S>(qs, ks, vs, ls, os, lses, o);
    Tensor<S, 4> gq(qs.shape()), gk(ks.shape()), gv(vs.shape());
    Tensor<S, 3> gl(ls.shape());
    diffattn::diff_attention_v2_backward<S>(qs, ks, vs, ls, os, lses, ds, gq, gk, gv, gl, o);
    bool same = true;
    auto eq = [&](S a, S b) { same = same && a.value == b.value; };
    for (index_t i = 0; i < n; ++i)
      for (index_t h = 0; h < 2 * H; ++h)
        for (index_t c = 0; c < d; ++c) eq(dq(q0 + i, h, c), gq(0, i, h, c));
    for (index_t j = 0; j < m; ++j)
      for (index_t c = 0; c < d; ++c) {
        eq(dk(k0 + j, 0, c), gk(0, j, 0, c));
        eq(dv(k0 + j, 0, c), gv(0, j, 0, c));
      }
    for (index_t i = 0; i < n; ++i)
      for (index_t h = 0; h < H; ++h) eq(dlogit(q0 + i, h), gl(0, i, h));
    CHECK(same);
    q0 += n;
    k0 += m;
  }
}

TEST_CASE("16-bit backward: bad input names the function and the argument",
          "[half][backward][errors]") {
  using S = half;
  const Tensor<S, 4> q({1, 5, 2, 4}), k({1, 6, 2, 4}), v({1, 6, 1, 8}), out({1, 5, 1, 8}),
      dout({1, 5, 1, 8});
  Tensor<float, 3> lse({1, 2, 5});
  Tensor<S, 4> dq({1, 5, 2, 4}), dk({1, 6, 2, 4}), dv({1, 6, 1, 7});  // dv too narrow
  float dlambda = 0;
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_backward<S>(q, k, v, 0.5f, out, lse, dout, dq, dk, dv, dlambda);
      },
      {"diff_attention_v1_backward", "dv", "(1, 6, 1, 7)"});
}
