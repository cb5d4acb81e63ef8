// Score modifiers (AttentionOptions::softcap, alibi_slopes, sinks) in the fused
// kernels, against a float64 computation that materialises every score with
// its cap, its ALiBi bias, the mask and the sink column explicitly.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/kv_cache.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/packed.hpp>
#include <diffattn/quantize.hpp>
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

constexpr double kInf = std::numeric_limits<double>::infinity();

enum class Kind { plain, v1, v1_heads, v2 };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::plain:
      return "plain";
    case Kind::v1:
      return "v1";
    case Kind::v1_heads:
      return "v1 per-head lambda";
    default:
      return "v2";
  }
}

struct Case {
  Kind kind;
  index_t B, N, M, H, Hkv, d;  // H: output heads (DIFF heads, or Hq for plain)
  bool causal = false;
  index_t wl = -1, wr = -1;
  float softcap = 0;
  bool alibi = false, sinks = false;
  // The user functor's score and visible, as the reference applies them.
  std::function<double(double, index_t, index_t, index_t, index_t)> fscore = nullptr;
  std::function<bool(index_t, index_t, index_t, index_t)> fvisible = nullptr;
};

// Inputs of one case in double; the float copies are their roundings (the
// double inputs are themselves float values, so both kernels see one problem).
struct Inputs {
  Tensor<double, 4> q, k, v;
  Tensor<double, 3> logit;    // v2 (B, N, H)
  std::vector<double> lam;    // v1: (1) or (H)
  std::vector<float> slopes;  // (Hq) or empty
  std::vector<float> sinks;   // (Hq) or empty
};

index_t query_heads(const Case& c) { return c.kind == Kind::plain ? c.H : 2 * c.H; }

Inputs make_inputs(const Case& c, std::uint64_t seed) {
  Inputs in;
  const index_t Hq = query_heads(c);
  const bool v1 = c.kind == Kind::v1 || c.kind == Kind::v1_heads;
  const index_t kh = v1 ? 2 * c.Hkv : c.Hkv, dv = v1 ? 2 * c.d : c.d;
  in.q = cast<double>(random_tensor<float, 4>({c.B, c.N, Hq, c.d}, seed, 1.5));
  in.k = cast<double>(random_tensor<float, 4>({c.B, c.M, kh, c.d}, seed + 1, 1.5));
  in.v = cast<double>(random_tensor<float, 4>({c.B, c.M, c.Hkv, dv}, seed + 2));
  in.logit = cast<double>(random_tensor<float, 3>({c.B, c.N, c.H}, seed + 3));
  diffattn::detail::Rng rng(seed + 4);
  for (index_t h = 0; h < c.H; ++h) in.lam.push_back(static_cast<float>(0.2 + 0.6 * rng.uniform()));
  if (c.alibi)
    for (index_t h = 0; h < Hq; ++h) in.slopes.push_back(std::pow(2.0f, -0.5f * float(h + 1)));
  if (c.sinks)
    for (index_t h = 0; h < Hq; ++h) in.sinks.push_back(static_cast<float>(2.0 * rng.normal()));
  return in;
}

AttentionOptions options_of(const Case& c, const Inputs& in) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.wl;
  o.window_right = c.wr;
  o.softcap = c.softcap;
  const index_t Hq = static_cast<index_t>(in.slopes.size());
  if (c.alibi) o.alibi_slopes = TensorView<const float, 1>(in.slopes.data(), {Hq});
  const index_t Hs = static_cast<index_t>(in.sinks.size());
  if (c.sinks) o.sinks = TensorView<const float, 1>(in.sinks.data(), {Hs});
  return o;
}

struct Reference {
  Tensor<double, 4> out;  // (B, N, H, dv)
  Tensor<double, 3> lse;  // (B, Hq, N)
};

// The float64 computation: for each row, the scores of every key (scale,
// then cap, then ALiBi bias, masked keys -inf) and the sink column form one
// vector of M + 1 logits; lse is their log-sum-exp and the weights of the M
// keys their softmax.
Reference reference(const Case& c, const Inputs& in) {
  const bool v1 = c.kind == Kind::v1 || c.kind == Kind::v1_heads;
  const index_t Hq = query_heads(c), dv = in.v.shape(3), maps = c.kind == Kind::plain ? 1 : 2;
  const index_t group = c.H / c.Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Reference r{Tensor<double, 4>({c.B, c.N, c.H, dv}), Tensor<double, 3>({c.B, Hq, c.N})};
  const index_t wr = c.causal ? 0 : c.wr;
  std::vector<double> logits(static_cast<std::size_t>(c.M + 1));
  std::vector<double> w(static_cast<std::size_t>(c.M));
  for (index_t b = 0; b < c.B; ++b)
    for (index_t oh = 0; oh < c.H; ++oh)
      for (index_t i = 0; i < c.N; ++i) {
        std::fill(w.begin(), w.end(), 0.0);
        for (index_t m = 0; m < maps; ++m) {
          const index_t qh = maps == 1 ? oh : 2 * oh + m;
          const index_t g = oh / group, kh = v1 ? 2 * g + m : g;
          const index_t diag = i + c.M - c.N;
          for (index_t j = 0; j < c.M; ++j) {
            const bool visible = (c.wl < 0 || j >= diag - c.wl) && (wr < 0 || j <= diag + wr);
            const double* qr = &in.q(b, i, qh, 0);
            const double* kr = &in.k(b, j, kh, 0);
            double s = 0;
            for (index_t t = 0; t < c.d; ++t) s += qr[t] * kr[t];
            s *= scale;
            if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
            if (c.alibi) s -= in.slopes[qh] * std::abs(static_cast<double>(diag - j));
            if (c.fscore) s = c.fscore(s, b, qh, i, j);
            const bool fvis = !c.fvisible || c.fvisible(b, qh, i, j);
            logits[j] = visible && fvis ? s : -kInf;
          }
          logits[c.M] = c.sinks ? static_cast<double>(in.sinks[qh]) : -kInf;
          double mx = -kInf;
          for (double x : logits) mx = std::max(mx, x);
          double lse = -kInf;
          if (mx > -kInf) {
            double sum = 0;
            for (double x : logits) sum += std::exp(x - mx);
            lse = mx + std::log(sum);
          }
          r.lse(b, qh, i) = lse;
          double coef = 1;
          if (m == 1) {
            if (c.kind == Kind::v2)
              coef = -1.0 / (1.0 + std::exp(-in.logit(b, i, oh)));
            else
              coef = -(c.kind == Kind::v1_heads ? in.lam[oh] : in.lam[0]);
          }
          for (index_t j = 0; j < c.M; ++j)
            if (lse > -kInf && logits[j] > -kInf) w[j] += coef * std::exp(logits[j] - lse);
        }
        double* orow = &r.out(b, i, oh, 0);
        std::fill(orow, orow + dv, 0.0);
        for (index_t j = 0; j < c.M; ++j) {
          if (w[j] == 0) continue;
          const double* vr = &in.v(b, j, oh / group, 0);
          for (index_t t = 0; t < dv; ++t) orow[t] += w[j] * vr[t];
        }
      }
  return r;
}

// The fused kernel of the case's kind on storage T (with the functor mod
// unless it is the default).
template <class T, class Mod = diffattn::NoScoreMod>
void run_fused(const Case& c, const Inputs& in, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
               const Tensor<T, 4>& v, Tensor<T, 4>& out, Tensor<diffattn::compute_t<T>, 3>& lse,
               const AttentionOptions& o, const Mod& mod = Mod()) {
  using C = diffattn::compute_t<T>;
  constexpr bool plain = std::is_same<Mod, diffattn::NoScoreMod>::value;
  switch (c.kind) {
    case Kind::plain:
      if constexpr (plain)
        diffattn::attention<T>(q, k, v, out, lse, o);
      else
        diffattn::attention<T>(q, k, v, out, lse, o, mod);
      break;
    case Kind::v1:
      if constexpr (plain)
        diffattn::diff_attention_v1<T>(q, k, v, static_cast<C>(in.lam[0]), out, lse, o);
      else
        diffattn::diff_attention_v1<T>(q, k, v, static_cast<C>(in.lam[0]), out, lse, o, mod);
      break;
    case Kind::v1_heads: {
      std::vector<C> lam(in.lam.begin(), in.lam.end());
      const TensorView<const C, 1> lv(lam.data(), {static_cast<index_t>(lam.size())});
      if constexpr (plain)
        diffattn::diff_attention_v1<T>(q, k, v, lv, out, lse, o);
      else
        diffattn::diff_attention_v1<T>(q, k, v, lv, out, lse, o, mod);
      break;
    }
    default: {
      const auto logit = cast<T>(in.logit);
      if constexpr (plain)
        diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
      else
        diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o, mod);
    }
  }
}

// max |a - b| over entries, -inf / +inf required to match exactly.
template <class A>
double lse_error(const Tensor<A, 3>& got, const Tensor<double, 3>& want) {
  double err = 0;
  for (index_t x = 0; x < want.size(); ++x) {
    const double a = static_cast<double>(got.data()[x]), b = want.data()[x];
    if (std::isinf(b)) {
      if (a != b) return kInf;
      continue;
    }
    err = std::max(err, std::abs(a - b) / (1 + std::abs(b)));
  }
  return err;
}

template <class T, class Mod = diffattn::NoScoreMod>
void check_storage(const Case& c, const Inputs& in, const Reference& ref, double tol,
                   double lse_tol, const Mod& mod = Mod()) {
  using C = diffattn::compute_t<T>;
  const auto q = cast<T>(in.q), k = cast<T>(in.k), v = cast<T>(in.v);
  Tensor<T, 4> out(ref.out.shape());
  Tensor<C, 3> lse(ref.lse.shape());
  run_fused<T>(c, in, q, k, v, out, lse, options_of(c, in), mod);
  const double err = rel_error(out, ref.out), lerr = lse_error(lse, ref.lse);
  INFO("storage " << sizeof(T) << " bytes: out error " << err << ", lse error " << lerr);
  CHECK(err <= tol);
  CHECK(lerr <= lse_tol);
}

template <class Mod = diffattn::NoScoreMod>
void check_case(const Case& c, std::uint64_t seed, bool half = false, const Mod& mod = Mod()) {
  INFO(kind_name(c.kind) << " B=" << c.B << " N=" << c.N << " M=" << c.M << " H=" << c.H
                         << " Hkv=" << c.Hkv << " d=" << c.d << " causal=" << c.causal
                         << " window=(" << c.wl << "," << c.wr << ") softcap=" << c.softcap
                         << " alibi=" << c.alibi << " sinks=" << c.sinks);
  const Inputs in = make_inputs(c, seed);
  const Reference ref = reference(c, in);
  check_storage<double>(c, in, ref, 1e-12, 1e-12, mod);
  check_storage<float>(c, in, ref, 1e-5, 1e-5, mod);
  if (half) check_storage<diffattn::bfloat16>(c, in, ref, 2e-2, 2e-2, mod);
}

// Each modifier alone, and all three.
std::vector<Case> modifier_mixes(Case base) {
  std::vector<Case> out;
  const int mixes[][3] = {{1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {1, 1, 1}};
  for (const auto& m : mixes) {
    Case c = base;
    c.softcap = m[0] ? 3.0f : 0.0f;
    c.alibi = m[1];
    c.sinks = m[2];
    out.push_back(c);
  }
  return out;
}

}  // namespace

TEST_CASE("modifiers: fused forward of every kind against the float64 reference", "[modifiers]") {
  const Kind kinds[] = {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2};
  std::uint64_t seed = 100;
  for (Kind kind : kinds) {
    // (B, N, M, H, Hkv, d): N != M both ways, GQA, sizes off the tiles.
    const Case shapes[] = {
        {kind, 2, 75, 113, 2, 1, 16},  // GQA 2, N < M
        {kind, 1, 97, 61, 4, 2, 8},    // N > M
        {kind, 1, 64, 64, 1, 1, 32},
    };
    for (Case s : shapes) {
      for (int mask = 0; mask < 3; ++mask) {
        Case base = s;
        base.causal = mask >= 1;
        if (mask == 2) base.wl = 17;
        for (const Case& c : modifier_mixes(base)) check_case(c, seed++);
      }
    }
  }
}

TEST_CASE("modifiers: windows on both sides, and 16-bit storage", "[modifiers]") {
  std::uint64_t seed = 900;
  for (Kind kind : {Kind::v1, Kind::v2, Kind::plain}) {
    Case c{kind, 1, 70, 90, 2, 2, 16};
    c.wl = 9;
    c.wr = 4;
    c.softcap = 2.5f;
    c.alibi = true;
    c.sinks = true;
    check_case(c, seed++, true);
    Case h{kind, 2, 40, 52, 2, 1, 32};
    h.causal = true;
    h.softcap = 5.0f;
    h.sinks = true;
    check_case(h, seed++, true);
  }
}

TEST_CASE("modifiers: decoding steps (fewer than kMR queries), split over key chunks",
          "[modifiers]") {
  std::uint64_t seed = 1300;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    for (index_t N : {1, 3}) {
      for (index_t M : {37, 2600}) {  // one chunk, and three of kSplitKeys keys
        Case base{kind, 2, N, M, 4, 2, 16};
        base.causal = true;
        for (const Case& c : modifier_mixes(base)) check_case(c, seed++);
        Case w = base;
        w.wl = 700;
        w.softcap = 4;
        w.alibi = w.sinks = true;
        check_case(w, seed++);
      }
    }
  }
}

TEST_CASE("modifiers: sinks take the weight of rows that see no key", "[modifiers]") {
  // N > M causal: the first N - M rows see nothing: zeros, lse = sink.
  Case c{Kind::v2, 1, 20, 8, 2, 1, 8};
  c.causal = true;
  c.sinks = true;
  const Inputs in = make_inputs(c, 7);
  const Reference ref = reference(c, in);
  for (index_t i = 0; i < 12; ++i)
    for (index_t h = 0; h < 4; ++h) REQUIRE(ref.lse(0, h, i) == static_cast<double>(in.sinks[h]));
  check_case(c, 7);
}

TEST_CASE("modifiers: no modifier set leaves the kernels bitwise unchanged", "[modifiers]") {
  // Zero slopes and a sink of -inf are not "no modifier" (they are refused or
  // take the modifier path); the default options are, and softcap = 0 is.
  Case c{Kind::v1, 1, 70, 90, 2, 1, 16};
  c.causal = true;
  const Inputs in = make_inputs(c, 11);
  const auto q = cast<float>(in.q), k = cast<float>(in.k), v = cast<float>(in.v);
  Tensor<float, 4> a({1, 70, 2, 32}), b(a.shape());
  Tensor<float, 3> la({1, 4, 70}), lb(la.shape());
  AttentionOptions o;
  o.causal = true;
  diffattn::diff_attention_v1<float>(q, k, v, 0.5f, a, la, o);
  o.softcap = 0.0f;
  diffattn::diff_attention_v1<float>(q, k, v, 0.5f, b, lb, o);
  REQUIRE(test::bitwise_equal(a, b));
  REQUIRE(test::bitwise_equal(la, lb));
}

TEST_CASE("modifiers: bad options are refused, naming the argument and shapes", "[modifiers]") {
  const auto q = random_tensor<float, 4>({1, 8, 4, 8}, 1);
  const auto k = random_tensor<float, 4>({1, 8, 2, 8}, 2);
  const auto v = random_tensor<float, 4>({1, 8, 2, 8}, 3);
  const auto logit = random_tensor<float, 3>({1, 8, 2}, 4);
  Tensor<float, 4> out({1, 8, 2, 8});
  std::vector<float> three(3, 0.5f), four(4, 0.5f);
  AttentionOptions o;
  o.alibi_slopes = TensorView<const float, 1>(three.data(), {3});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"diff_attention_v2", "alibi_slopes", "(3)", "(4)"});
  o = {};
  o.sinks = TensorView<const float, 1>(three.data(), {3});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"diff_attention_v2", "sinks", "(3)", "(4)"});
  o = {};
  four[2] = std::numeric_limits<float>::quiet_NaN();
  o.sinks = TensorView<const float, 1>(four.data(), {4});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"sinks", "finite", "sinks[2]"});
  o = {};
  four[2] = std::numeric_limits<float>::infinity();
  o.alibi_slopes = TensorView<const float, 1>(four.data(), {4});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"alibi_slopes", "finite", "alibi_slopes[2]"});
  o = {};
  o.softcap = -1.0f;
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"diff_attention_v2", "softcap", "-1"});
  o.softcap = std::numeric_limits<float>::infinity();
  test::require_error([&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out, o); },
                      {"softcap", "finite"});
  // The materialised reference path refuses modifiers rather than ignoring them.
  o.softcap = 2.0f;
  test::require_error(
      [&] { diffattn::reference::diff_attention_v2<float>(q, k, v, logit, out, {}, o); },
      {"reference", "softcap"});
}

namespace {

// L = sum(out * G): its gradients from the backward kernels, checked against
// central differences (Richardson-extrapolated) of the double forward.
struct Grads {
  Tensor<double, 4> dq, dk, dv;
  std::vector<double> dsinks;
};

template <class Mod>
double loss(const Case& c, const Inputs& in, const Tensor<double, 4>& g, const Mod& mod) {
  Tensor<double, 4> out(g.shape());
  Tensor<double, 3> lse({c.B, query_heads(c), c.N});
  run_fused<double>(c, in, in.q, in.k, in.v, out, lse, options_of(c, in), mod);
  double l = 0;
  for (index_t x = 0; x < out.size(); ++x) l += out.data()[x] * g.data()[x];
  return l;
}

template <class Mod>
Grads backward(const Case& c, const Inputs& in, const Tensor<double, 4>& g, const Mod& mod) {
  const index_t Hq = query_heads(c);
  Tensor<double, 4> out(g.shape());
  Tensor<double, 3> lse({c.B, Hq, c.N});
  const AttentionOptions o = options_of(c, in);
  run_fused<double>(c, in, in.q, in.k, in.v, out, lse, o, mod);
  Grads gr{Tensor<double, 4>(in.q.shape()), Tensor<double, 4>(in.k.shape()),
           Tensor<double, 4>(in.v.shape()), std::vector<double>(static_cast<std::size_t>(Hq))};
  TensorView<double, 1> ds;
  if (c.sinks) ds = TensorView<double, 1>(gr.dsinks.data(), {Hq});
  switch (c.kind) {
    case Kind::plain:
      diffattn::attention_backward<double>(in.q, in.k, in.v, out, lse, g, gr.dq, gr.dk, gr.dv, o,
                                           ds, mod);
      break;
    case Kind::v1: {
      double dl = 0;
      diffattn::diff_attention_v1_backward<double>(in.q, in.k, in.v, in.lam[0], out, lse, g, gr.dq,
                                                   gr.dk, gr.dv, dl, o, ds, mod);
      break;
    }
    case Kind::v1_heads: {
      std::vector<double> dl(in.lam.size());
      const index_t H = static_cast<index_t>(dl.size());
      diffattn::diff_attention_v1_backward<double>(
          in.q, in.k, in.v, TensorView<const double, 1>(in.lam.data(), {H}), out, lse, g, gr.dq,
          gr.dk, gr.dv, TensorView<double, 1>(dl.data(), {H}), o, ds, mod);
      break;
    }
    default: {
      Tensor<double, 3> dlogit(in.logit.shape());
      diffattn::diff_attention_v2_backward<double>(in.q, in.k, in.v, in.logit, out, lse, g, gr.dq,
                                                   gr.dk, gr.dv, dlogit, o, ds, mod);
    }
  }
  return gr;
}

// d loss / d x by central differences at steps h and h / 2, extrapolated.
template <class Set>
double numeric(const Set& set, double x0, double h, const std::function<double()>& f) {
  auto central = [&](double step) {
    const double xp = set(x0 + step), lp = f();
    const double xm = set(x0 - step), lm = f();
    return (lp - lm) / (xp - xm);
  };
  const double d1 = central(h), d2 = central(h / 2);
  set(x0);
  return (4 * d2 - d1) / 3;
}

template <class Mod = diffattn::NoScoreMod>
void check_gradients(Case c, std::uint64_t seed, const Mod& mod = Mod()) {
  INFO(kind_name(c.kind) << " B=" << c.B << " N=" << c.N << " M=" << c.M << " H=" << c.H
                         << " Hkv=" << c.Hkv << " causal=" << c.causal << " window=(" << c.wl << ","
                         << c.wr << ") softcap=" << c.softcap << " alibi=" << c.alibi
                         << " sinks=" << c.sinks);
  Inputs in = make_inputs(c, seed);
  const bool v1 = c.kind == Kind::v1 || c.kind == Kind::v1_heads;
  const auto g = random_tensor<double, 4>({c.B, c.N, c.H, v1 ? 2 * c.d : c.d}, seed + 9);
  const Grads gr = backward(c, in, g, mod);
  const std::function<double()> f = [&] { return loss(c, in, g, mod); };
  diffattn::detail::Rng rng(seed + 10);
  auto check_tensor = [&](const char* name, Tensor<double, 4>& x, const Tensor<double, 4>& dx) {
    double scale = 0;
    for (index_t t = 0; t < dx.size(); ++t) scale = std::max(scale, std::abs(dx.data()[t]));
    for (int s = 0; s < 12; ++s) {
      const index_t t = static_cast<index_t>(rng.uniform() * static_cast<double>(x.size()));
      double* p = x.data() + t;
      const double num = numeric([&](double y) { return *p = y; }, *p, 1e-3, f);
      INFO(name << "[" << t << "]: kernel " << dx.data()[t] << ", numeric " << num);
      CHECK(std::abs(dx.data()[t] - num) <= 1e-6 * (1 + scale));
    }
  };
  check_tensor("dq", in.q, gr.dq);
  check_tensor("dk", in.k, gr.dk);
  check_tensor("dv", in.v, gr.dv);
  if (c.sinks) {
    double scale = 0;
    for (double x : gr.dsinks) scale = std::max(scale, std::abs(x));
    for (std::size_t h = 0; h < in.sinks.size(); ++h) {
      float* p = &in.sinks[h];
      // Steps of 2^-8 and 2^-9: exact in float at these magnitudes.
      const double num = numeric([&](double y) { return *p = static_cast<float>(y); },
                                 static_cast<double>(*p), 0x1p-8, f);
      INFO("dsinks[" << h << "]: kernel " << gr.dsinks[h] << ", numeric " << num);
      CHECK(std::abs(gr.dsinks[h] - num) <= 1e-6 * (1 + scale));
    }
  }
}

}  // namespace

TEST_CASE("modifiers: backward against finite differences, dsinks included", "[modifiers]") {
  std::uint64_t seed = 2000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    Case all{kind, 2, 23, 31, 2, 1, 8};
    all.causal = true;
    all.softcap = 2.0f;
    all.alibi = true;
    all.sinks = true;
    check_gradients(all, seed++);
    Case cap{kind, 1, 19, 13, 2, 2, 8};  // N > M: rows that see nothing
    cap.causal = true;
    cap.softcap = 1.5f;
    check_gradients(cap, seed++);
    Case sink{kind, 1, 3, 70, 4, 2, 8};  // a decoding step's shape, windowed
    sink.wl = 40;
    sink.causal = true;
    sink.sinks = true;
    sink.alibi = true;
    check_gradients(sink, seed++);
  }
}

TEST_CASE("modifiers: dsinks is checked", "[modifiers]") {
  Case c{Kind::plain, 1, 8, 8, 2, 1, 8};
  const Inputs in = make_inputs(c, 3);
  Tensor<double, 4> out({1, 8, 2, 8}), g(out.shape()), dq(in.q.shape()), dk(in.k.shape()),
      dv(in.v.shape());
  Tensor<double, 3> lse({1, 2, 8});
  std::vector<double> ds(3);
  std::vector<float> sinks(2, 0.0f);
  AttentionOptions o;
  diffattn::attention<double>(in.q, in.k, in.v, out, lse, o);
  test::require_error(
      [&] {
        diffattn::attention_backward<double>(in.q, in.k, in.v, out, lse, g, dq, dk, dv, o,
                                             TensorView<double, 1>(ds.data(), {2}));
      },
      {"attention_backward", "dsinks", "options.sinks"});
  o.sinks = TensorView<const float, 1>(sinks.data(), {2});
  test::require_error(
      [&] {
        diffattn::attention_backward<double>(in.q, in.k, in.v, out, lse, g, dq, dk, dv, o,
                                             TensorView<double, 1>(ds.data(), {3}));
      },
      {"attention_backward", "dsinks", "(3)", "(Hq)", "(2)"});
}

namespace {

// The sub-problem of batch entry b: queries [q0, q0 + n), keys [k0, k0 + m)
// (a packed sequence, or the valid part of a cache), as a case of its own.
std::pair<Case, Inputs> slice(const Case& c, const Inputs& in, index_t b, index_t q0, index_t n,
                              index_t k0, index_t m) {
  Case s = c;
  s.B = 1;
  s.N = n;
  s.M = m;
  Inputs o = in;
  auto cut = [](const Tensor<double, 4>& t, index_t bb, index_t r0, index_t rows) {
    Tensor<double, 4> u({1, rows, t.shape(2), t.shape(3)});
    for (index_t r = 0; r < rows; ++r)
      for (index_t h = 0; h < t.shape(2); ++h)
        for (index_t x = 0; x < t.shape(3); ++x) u(0, r, h, x) = t(bb, r0 + r, h, x);
    return u;
  };
  o.q = cut(in.q, b, q0, n);
  o.k = cut(in.k, b, k0, m);
  o.v = cut(in.v, b, k0, m);
  o.logit = Tensor<double, 3>({1, n, c.H});
  for (index_t r = 0; r < n; ++r)
    for (index_t h = 0; h < c.H; ++h) o.logit(0, r, h) = in.logit(b, q0 + r, h);
  return {s, o};
}

template <class T>
void run_kvcache(const Case& c, const Inputs& in, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                 const Tensor<T, 4>& v, const diffattn::KVCacheBatch& cache, Tensor<T, 4>& out,
                 Tensor<diffattn::compute_t<T>, 3>& lse, const AttentionOptions& o) {
  switch (c.kind) {
    case Kind::plain:
      diffattn::attention_kvcache<T>(q, k, v, out, lse, cache, o);
      break;
    case Kind::v2: {
      const auto logit = cast<T>(in.logit);
      diffattn::diff_attention_v2_kvcache<T>(q, k, v, logit, out, lse, cache, o);
      break;
    }
    default:
      diffattn::diff_attention_v1_kvcache<T>(
          q, k, v, static_cast<diffattn::compute_t<T>>(in.lam[0]), out, lse, cache, o);
  }
}

// Pools of blocks of bs rows holding the caches, blocks handed out last to first.
struct Pool {
  Tensor<double, 4> k, v;
  Tensor<index_t, 2> table;
};
Pool make_pool(const Tensor<double, 4>& k, const Tensor<double, 4>& v, index_t bs) {
  const index_t B = k.shape(0), per = (k.shape(1) + bs - 1) / bs, blocks = B * per;
  Pool p{Tensor<double, 4>({blocks, bs, k.shape(2), k.shape(3)}),
         Tensor<double, 4>({blocks, bs, v.shape(2), v.shape(3)}), Tensor<index_t, 2>({B, per})};
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < per; ++t) {
      const index_t blk = blocks - 1 - (b * per + t);
      p.table(b, t) = blk;
      for (index_t r = 0; r < bs && t * bs + r < k.shape(1); ++r) {
        for (index_t h = 0; h < k.shape(2); ++h)
          for (index_t x = 0; x < k.shape(3); ++x) p.k(blk, r, h, x) = k(b, t * bs + r, h, x);
        for (index_t h = 0; h < v.shape(2); ++h)
          for (index_t x = 0; x < v.shape(3); ++x) p.v(blk, r, h, x) = v(b, t * bs + r, h, x);
      }
    }
  return p;
}

}  // namespace

TEST_CASE("modifiers: KV caches (contiguous, paged, split-KV) against the reference",
          "[modifiers]") {
  std::uint64_t seed = 3000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    for (index_t n : {1, 2, 8}) {
      Case c{kind, 2, n, 1300, 4, 2, 16};  // capacity 1300
      c.causal = true;
      c.softcap = 3.0f;
      c.alibi = true;
      c.sinks = true;
      INFO(kind_name(kind) << " n=" << n);
      const Inputs in = make_inputs(c, seed++);
      const std::vector<index_t> lens = {1250, 37};  // two split-KV chunks, one
      Tensor<index_t, 1> seqlens({2});
      seqlens(0) = lens[0];
      seqlens(1) = lens[1];
      diffattn::KVCacheBatch cache;
      cache.cache_seqlens = seqlens;
      const AttentionOptions o = options_of(c, in);
      const bool v1 = kind == Kind::v1;
      const index_t dv = v1 ? 2 * c.d : c.d;
      Tensor<double, 4> out({2, n, c.H, dv});
      Tensor<double, 3> lse({2, query_heads(c), n});
      run_kvcache<double>(c, in, in.q, in.k, in.v, cache, out, lse, o);
      for (index_t split : {index_t(0), index_t(100)}) {
        INFO("split_keys " << split);
        diffattn::KVCacheBatch cs = cache;
        cs.split_keys = split;
        for (index_t bs : {index_t(0), index_t(16)}) {
          INFO("block_size " << bs);
          Tensor<double, 4> o2(out.shape());
          Tensor<double, 3> l2(lse.shape());
          if (bs == 0) {
            run_kvcache<double>(c, in, in.q, in.k, in.v, cs, o2, l2, o);
          } else {
            const Pool pool = make_pool(in.k, in.v, bs);
            diffattn::KVCacheBatch cp = cs;
            cp.block_table = pool.table;
            run_kvcache<double>(c, in, in.q, pool.k, pool.v, cp, o2, l2, o);
          }
          for (index_t b = 0; b < 2; ++b) {
            const auto sub = slice(c, in, b, 0, n, 0, lens[static_cast<std::size_t>(b)]);
            const Reference ref = reference(sub.first, sub.second);
            for (index_t i = 0; i < n; ++i)
              for (index_t h = 0; h < c.H; ++h)
                for (index_t x = 0; x < dv; ++x)
                  REQUIRE(std::abs(o2(b, i, h, x) - ref.out(0, i, h, x)) <= 1e-12);
            for (index_t h = 0; h < query_heads(c); ++h)
              for (index_t i = 0; i < n; ++i)
                REQUIRE(std::abs(l2(b, h, i) - ref.lse(0, h, i)) <=
                        1e-12 * (1 + std::abs(ref.lse(0, h, i))));
          }
        }
      }
      // float storage, default chunks.
      const auto qf = cast<float>(in.q), kf = cast<float>(in.k), vf = cast<float>(in.v);
      Tensor<float, 4> of(out.shape());
      Tensor<float, 3> lf(lse.shape());
      run_kvcache<float>(c, in, qf, kf, vf, cache, of, lf, o);
      CHECK(rel_error(of, out) <= 1e-5);
    }
  }
}

TEST_CASE("modifiers: packed varlen, i and j within each sequence", "[modifiers]") {
  std::uint64_t seed = 4000;
  const std::vector<index_t> lq = {30, 0, 45, 3}, lk = {40, 5, 45, 20};
  index_t Tq = 0, Tk = 0;
  for (std::size_t s = 0; s < lq.size(); ++s) Tq += lq[s], Tk += lk[s];
  const diffattn::PackedSequences seqs = diffattn::PackedSequences::from_lengths(lq, lk);
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    for (int mask = 0; mask < 2; ++mask) {
      Case c{kind, 1, Tq, Tk, 2, 1, 16};
      c.causal = true;
      if (mask == 1) c.wl = 6;
      c.softcap = 2.5f;
      c.alibi = true;
      c.sinks = true;
      INFO(kind_name(kind) << " window_left " << c.wl);
      const Inputs in = make_inputs(c, seed++);
      const bool v1 = kind == Kind::v1 || kind == Kind::v1_heads;
      const index_t dv = v1 ? 2 * c.d : c.d, Hq = query_heads(c);
      auto d3 = [](const Tensor<double, 4>& t) {
        return TensorView<const double, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
      };
      Tensor<double, 4> out({1, Tq, c.H, dv});
      Tensor<double, 2> lse({Hq, Tq});
      TensorView<double, 3> out3(out.data(), {Tq, c.H, dv});
      const AttentionOptions o = options_of(c, in);
      switch (kind) {
        case Kind::plain:
          diffattn::attention_varlen<double>(d3(in.q), d3(in.k), d3(in.v), out3, lse, seqs, o);
          break;
        case Kind::v1:
          diffattn::diff_attention_v1_varlen<double>(d3(in.q), d3(in.k), d3(in.v), in.lam[0], out3,
                                                     lse, seqs, o);
          break;
        case Kind::v1_heads:
          diffattn::diff_attention_v1_varlen<double>(
              d3(in.q), d3(in.k), d3(in.v), TensorView<const double, 1>(in.lam.data(), {c.H}), out3,
              lse, seqs, o);
          break;
        default:
          diffattn::diff_attention_v2_varlen<double>(
              d3(in.q), d3(in.k), d3(in.v), TensorView<const double, 2>(in.logit.data(), {Tq, c.H}),
              out3, lse, seqs, o);
      }
      for (std::size_t s = 0; s < lq.size(); ++s) {
        const index_t q0 = seqs.cu_seqlens_q[s], k0 = seqs.cu_seqlens_k[s];
        const auto sub = slice(c, in, 0, q0, lq[s], k0, lk[s]);
        const Reference ref = reference(sub.first, sub.second);
        for (index_t i = 0; i < lq[s]; ++i) {
          for (index_t h = 0; h < c.H; ++h)
            for (index_t x = 0; x < dv; ++x)
              REQUIRE(std::abs(out(0, q0 + i, h, x) - ref.out(0, i, h, x)) <= 1e-12);
          for (index_t h = 0; h < Hq; ++h)
            REQUIRE(std::abs(lse(h, q0 + i) - ref.lse(0, h, i)) <=
                    1e-12 * (1 + std::abs(ref.lse(0, h, i))));
        }
      }
    }
  }
}

namespace {

// A score functor with its derivative: s + 0.3 tanh(s) k / 2, k = (b + h + i + j) % 3.
struct WarpScore {
  template <class S>
  S score(S s, index_t b, index_t h, index_t i, index_t j) const {
    return s + S(0.15) * std::tanh(s) * static_cast<S>((b + h + i + j) % 3);
  }
  template <class S>
  S dscore(S s, index_t b, index_t h, index_t i, index_t j) const {
    const S t = std::tanh(s);
    return S(1) + S(0.15) * (S(1) - t * t) * static_cast<S>((b + h + i + j) % 3);
  }
};
double warp_ref(double s, index_t b, index_t h, index_t i, index_t j) {
  return s + 0.15 * std::tanh(s) * static_cast<double>((b + h + i + j) % 3);
}

// Documents of a packed row: token t belongs to document doc[t].
struct DocumentMask {
  const index_t* doc;
  bool visible(index_t, index_t, index_t i, index_t j) const { return doc[i] == doc[j]; }
};

// The same with visible_block: whole chunks classified from the documents'
// ranges (doc is non-decreasing).
struct DocumentBlocks {
  const index_t* doc;
  bool visible(index_t, index_t, index_t i, index_t j) const { return doc[i] == doc[j]; }
  int visible_block(index_t, index_t, index_t i0, index_t i1, index_t j0, index_t j1) const {
    const index_t qa = doc[i0], qb = doc[i1 - 1], ka = doc[j0], kb = doc[j1 - 1];
    if (qb < ka || kb < qa) return 0;
    return qa == qb && ka == kb && qa == ka ? 2 : 1;
  }
};

// Prefix LM: the first `prefix` keys are seen by all, the rest causally, and
// query head 1 sees no key at all in rows 5 .. 9 (its sink takes their weight).
struct PrefixLM {
  index_t prefix;
  bool visible(index_t, index_t h, index_t i, index_t j) const {
    if (h == 1 && i >= 5 && i < 10) return false;
    return j < prefix || j <= i;
  }
};

struct Empty {};

struct Both {
  WarpScore w;
  PrefixLM v;
  template <class S>
  S score(S s, index_t b, index_t h, index_t i, index_t j) const {
    return w.score(s, b, h, i, j);
  }
  bool visible(index_t b, index_t h, index_t i, index_t j) const { return v.visible(b, h, i, j); }
};

}  // namespace

TEST_CASE("modifiers: user functors (score, visible) in the forward", "[modifiers][functor]") {
  std::uint64_t seed = 5000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    Case c{kind, 2, 75, 113, 2, 1, 16};
    c.causal = true;
    c.fscore = warp_ref;
    check_case(c, seed++, false, WarpScore{});
    c.softcap = 3.0f;
    c.alibi = c.sinks = true;
    check_case(c, seed++, true, WarpScore{});
    Case p{kind, 1, 90, 90, 2, 2, 16};
    p.sinks = true;
    const PrefixLM plm{17};
    p.fvisible = [plm](index_t b, index_t h, index_t i, index_t j) {
      return plm.visible(b, h, i, j);
    };
    check_case(p, seed++, false, plm);
    Case dn{kind, 1, 4, 50, 2, 1, 16};  // a decoding step's shape: block kernel
    dn.fscore = warp_ref;
    const PrefixLM plm2{30};
    dn.fvisible = [plm2](index_t b, index_t h, index_t i, index_t j) {
      return plm2.visible(b, h, i, j);
    };
    check_case(dn, seed++, false, Both{WarpScore{}, plm2});
  }
}

TEST_CASE("modifiers: an empty functor is the kernel without one, bitwise",
          "[modifiers][functor]") {
  Case c{Kind::v2, 1, 70, 90, 2, 1, 16};
  c.causal = true;
  const Inputs in = make_inputs(c, 21);
  const auto q = cast<float>(in.q), k = cast<float>(in.k), v = cast<float>(in.v);
  Tensor<float, 4> a({1, 70, 2, 16}), b(a.shape());
  Tensor<float, 3> la({1, 4, 70}), lb(la.shape());
  const AttentionOptions o = options_of(c, in);
  run_fused<float>(c, in, q, k, v, a, la, o);
  run_fused<float>(c, in, q, k, v, b, lb, o, Empty{});
  REQUIRE(test::bitwise_equal(a, b));
  REQUIRE(test::bitwise_equal(la, lb));
}

TEST_CASE("modifiers: a document mask functor equals the packed varlen call",
          "[modifiers][functor]") {
  const std::vector<index_t> lens = {70, 33, 130, 7, 60};
  std::vector<index_t> doc;
  for (std::size_t s = 0; s < lens.size(); ++s)
    doc.insert(doc.end(), static_cast<std::size_t>(lens[s]), static_cast<index_t>(s));
  const index_t T = static_cast<index_t>(doc.size());
  Case c{Kind::v1, 1, T, T, 2, 1, 16};
  c.causal = true;
  c.softcap = 4.0f;
  c.alibi = c.sinks = true;
  const index_t* dp = doc.data();
  c.fvisible = [dp](index_t, index_t, index_t i, index_t j) { return dp[i] == dp[j]; };
  check_case(c, 31, false, DocumentMask{dp});
  check_case(c, 31, false, DocumentBlocks{dp});
  Case n = c;  // not causal: the later documents' keys lie in every band
  n.causal = false;
  check_case(n, 32, false, DocumentBlocks{dp});
  // The packed call on the same sequences.
  const Inputs in = make_inputs(c, 31);
  Tensor<double, 4> out({1, T, 2, 32}), packed(out.shape());
  Tensor<double, 3> lse({1, 4, T});
  Tensor<double, 2> lse_p({4, T});
  const AttentionOptions o = options_of(c, in);
  run_fused<double>(c, in, in.q, in.k, in.v, out, lse, o, DocumentMask{dp});
  auto d3 = [](const Tensor<double, 4>& t) {
    return TensorView<const double, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
  };
  diffattn::diff_attention_v1_varlen<double>(
      d3(in.q), d3(in.k), d3(in.v), in.lam[0], TensorView<double, 3>(packed.data(), {T, 2, 32}),
      lse_p, diffattn::PackedSequences::from_lengths(lens), o);
  // ALiBi's distance is within the sequence in the packed call, across the
  // row for the functor: compare without it.
  (void)packed;
  AttentionOptions o2 = o;
  o2.alibi_slopes = {};
  run_fused<double>(c, in, in.q, in.k, in.v, out, lse, o2, DocumentMask{dp});
  diffattn::diff_attention_v1_varlen<double>(
      d3(in.q), d3(in.k), d3(in.v), in.lam[0], TensorView<double, 3>(packed.data(), {T, 2, 32}),
      lse_p, diffattn::PackedSequences::from_lengths(lens), o2);
  REQUIRE(rel_error(out, packed) <= 1e-12);
  Tensor<double, 4> blocks(out.shape());
  Tensor<double, 3> lse_b(lse.shape());
  run_fused<double>(c, in, in.q, in.k, in.v, blocks, lse_b, o2, DocumentBlocks{dp});
  REQUIRE(rel_error(blocks, packed) <= 1e-12);
  for (index_t h = 0; h < 4; ++h)
    for (index_t i = 0; i < T; ++i)
      REQUIRE(std::abs(lse(0, h, i) - lse_p(h, i)) <= 1e-12 * (1 + std::abs(lse_p(h, i))));
}

TEST_CASE("modifiers: user functors in the backward (finite differences)", "[modifiers][functor]") {
  std::uint64_t seed = 6000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    Case c{kind, 2, 23, 31, 2, 1, 8};
    c.causal = true;
    c.softcap = 2.0f;
    c.sinks = true;
    c.fscore = warp_ref;
    check_gradients(c, seed++, WarpScore{});
    Case p{kind, 1, 20, 20, 2, 1, 8};
    p.sinks = true;
    const PrefixLM plm{6};
    p.fvisible = [plm](index_t b, index_t h, index_t i, index_t j) {
      return plm.visible(b, h, i, j);
    };
    check_gradients(p, seed++, plm);
  }
}

namespace {

// visible_range: each row's keys as one run [lo, hi), next to the same mask
// pair by pair in visible (the reference reads visible).
//
// Runs that jump about from row to row (neither end monotone), differ by
// query head, reach past both ends of the keys, and are empty (lo == hi or
// lo > hi) in every 7th row.
struct JumpRanges {
  std::pair<index_t, index_t> visible_range(index_t b, index_t h, index_t i) const {
    if ((i + b) % 7 == 3) return {5, (i % 2) ? 5 : 2};
    const index_t lo = (i * 37 + h * 11 + b * 5) % 50 - 10;
    return {lo, lo + 4 + (i * 13 + h) % 40};
  }
  bool visible(index_t b, index_t h, index_t i, index_t j) const {
    const std::pair<index_t, index_t> r = visible_range(b, h, i);
    return j >= r.first && j < r.second;
  }
};

// PrefixLM (query head 1 sees no key in rows 5 .. 9) as ranges.
struct PrefixRanges : PrefixLM {
  std::pair<index_t, index_t> visible_range(index_t, index_t h, index_t i) const {
    if (h == 1 && i >= 5 && i < 10) return {i, i - 3};
    return {0, std::max(prefix, i + 1)};
  }
};

// The document mask as ranges: the keys of the query's document.
struct DocumentRanges {
  const index_t* doc;    // document of each token, non-decreasing
  const index_t* start;  // first token of each document, then the total
  bool visible(index_t, index_t, index_t i, index_t j) const { return doc[i] == doc[j]; }
  std::pair<index_t, index_t> visible_range(index_t, index_t, index_t i) const {
    return {start[doc[i]], start[doc[i] + 1]};
  }
};

// Counts its visible calls (the block kernel must make none).
struct CountedRanges : JumpRanges {
  std::atomic<long>* calls;
  bool visible(index_t b, index_t h, index_t i, index_t j) const {
    ++*calls;
    return JumpRanges::visible(b, h, i, j);
  }
};

template <class Mod>
void set_visible(Case& c, const Mod& mod) {
  c.fvisible = [mod](index_t b, index_t h, index_t i, index_t j) {
    return mod.visible(b, h, i, j);
  };
}

}  // namespace

TEST_CASE("modifiers: visible_range functors in the forward", "[modifiers][functor]") {
  std::uint64_t seed = 6500;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    for (int causal = 0; causal < 2; ++causal) {
      // N > M and N < M; the ranges reach past the M keys.
      for (index_t M : {37, 61}) {
        Case c{kind, 2, 50, M, 2, 1, 16};
        c.causal = causal;
        set_visible(c, JumpRanges{});
        check_case(c, seed++, false, JumpRanges{});
        c.sinks = true;  // the empty rows' weight goes to the sink
        c.softcap = 3.0f;
        c.alibi = true;
        check_case(c, seed++, true, JumpRanges{});
      }
    }
    Case w{kind, 1, 70, 80, 2, 1, 16};  // windows on both sides
    w.wl = 9;
    w.wr = 5;
    set_visible(w, JumpRanges{});
    check_case(w, seed++, false, JumpRanges{});
    Case p{kind, 1, 90, 90, 2, 2, 16};
    const PrefixRanges plm{{17}};
    set_visible(p, plm);
    check_case(p, seed++, false, plm);  // no sinks: the empty rows give zeros
    p.sinks = true;
    check_case(p, seed++, false, plm);
    Case dn{kind, 1, 4, 50, 2, 1, 16};  // a decoding step's shape
    set_visible(dn, JumpRanges{});
    check_case(dn, seed++, false, JumpRanges{});
    dn.sinks = true;
    check_case(dn, seed++, false, JumpRanges{});
  }
}

TEST_CASE("modifiers: the block kernel masks by visible_range, never calling visible",
          "[modifiers][functor]") {
  for (Kind kind : {Kind::v1, Kind::v2}) {
    Case c{kind, 2, 64, 64, 2, 1, 16};
    c.causal = true;
    set_visible(c, JumpRanges{});
    std::atomic<long> calls{0};
    CountedRanges mod;
    mod.calls = &calls;
    check_case(c, 6550, false, mod);
    // (the reference's own calls go through JumpRanges)
    REQUIRE(calls.load() == 0);
  }
}

TEST_CASE("modifiers: a document mask as visible_range equals the packed varlen call",
          "[modifiers][functor]") {
  const std::vector<index_t> lens = {70, 33, 130, 7, 60};
  std::vector<index_t> doc, start = {0};
  for (std::size_t s = 0; s < lens.size(); ++s) {
    doc.insert(doc.end(), static_cast<std::size_t>(lens[s]), static_cast<index_t>(s));
    start.push_back(start.back() + lens[s]);
  }
  const index_t T = static_cast<index_t>(doc.size());
  for (Kind kind : {Kind::v1, Kind::v2}) {
    Case c{kind, 1, T, T, 2, 1, 16};
    c.causal = true;
    c.softcap = 4.0f;
    c.sinks = true;
    const DocumentRanges mod{doc.data(), start.data()};
    set_visible(c, mod);
    check_case(c, 33, false, mod);
    const Inputs in = make_inputs(c, 33);
    const AttentionOptions o = options_of(c, in);
    const index_t dv = in.v.shape(3);
    Tensor<double, 4> out({1, T, 2, dv}), packed(out.shape());
    Tensor<double, 3> lse({1, 4, T});
    Tensor<double, 2> lse_p({4, T});
    run_fused<double>(c, in, in.q, in.k, in.v, out, lse, o, mod);
    auto d3 = [](const Tensor<double, 4>& t) {
      return TensorView<const double, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
    };
    const auto seqs = diffattn::PackedSequences::from_lengths(lens);
    TensorView<double, 3> p3(packed.data(), {T, 2, dv});
    if (kind == Kind::v1)
      diffattn::diff_attention_v1_varlen<double>(d3(in.q), d3(in.k), d3(in.v), in.lam[0], p3, lse_p,
                                                 seqs, o);
    else
      diffattn::diff_attention_v2_varlen<double>(
          d3(in.q), d3(in.k), d3(in.v), TensorView<const double, 2>(in.logit.data(), {T, 2}), p3,
          lse_p, seqs, o);
    REQUIRE(rel_error(out, packed) <= 1e-12);
    for (index_t h = 0; h < 4; ++h)
      for (index_t i = 0; i < T; ++i)
        REQUIRE(std::abs(lse(0, h, i) - lse_p(h, i)) <= 1e-12 * (1 + std::abs(lse_p(h, i))));
  }
}

TEST_CASE("modifiers: visible_range functors in the backward (finite differences)",
          "[modifiers][functor]") {
  std::uint64_t seed = 6600;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    Case c{kind, 2, 23, 31, 2, 1, 8};
    c.causal = true;
    c.softcap = 2.0f;
    c.sinks = true;
    set_visible(c, JumpRanges{});
    check_gradients(c, seed++, JumpRanges{});
    Case n{kind, 1, 19, 13, 2, 1, 8};  // N > M, no sinks: empty rows give zeros
    set_visible(n, JumpRanges{});
    check_gradients(n, seed++, JumpRanges{});
    Case p{kind, 1, 20, 20, 2, 1, 8};
    const PrefixRanges plm{{6}};
    set_visible(p, plm);
    check_gradients(p, seed++, plm);
    p.sinks = true;
    check_gradients(p, seed++, plm);
  }
}

TEST_CASE("modifiers: standard ALiBi slopes", "[modifiers][layer]") {
  const std::vector<float> s8 = diffattn::standard_alibi_slopes(8);
  REQUIRE(s8.size() == 8);
  for (int i = 0; i < 8; ++i)
    REQUIRE(s8[static_cast<std::size_t>(i)] == std::ldexp(1.0f, -(i + 1)));
  const std::vector<float> s6 = diffattn::standard_alibi_slopes(6);  // 4 of m = 4, then 2 of 8
  const float want6[] = {0.25f, 0.0625f, 0.015625f, 0.00390625f, 0.5f, 0.125f};
  for (int i = 0; i < 6; ++i) REQUIRE(s6[static_cast<std::size_t>(i)] == want6[i]);
}

namespace {

// A layer with softcap, ALiBi and learned sinks: `sinks` (2H) is a parameter
// with a gradient (finite differences through the layer) and survives a
// safetensors round trip.
template <class Layer, class Config>
void check_layer(Config cfg, const char* path) {
  cfg.rope = false;
  cfg.softcap = 4.0f;
  cfg.alibi = true;
  cfg.sinks = true;
  Layer layer(cfg, 5);
  const index_t Hq = 2 * cfg.num_heads;
  auto params = layer.parameters();
  REQUIRE(params.count("sinks") == 1);
  REQUIRE(params.at("sinks").shape(0) == Hq);
  REQUIRE(Layer::parameter_shapes(cfg).at("sinks") == std::vector<index_t>{Hq});
  for (index_t h = 0; h < Hq; ++h) params.at("sinks")(h) = 0.25 * static_cast<double>(h) - 0.5;
  const auto x = random_tensor<double, 3>({2, 9, cfg.embed_dim}, 40);
  const auto g = random_tensor<double, 3>({2, 9, cfg.embed_dim}, 41);
  auto loss_of = [&] {
    const Tensor<double, 3> y = layer.forward(x);
    double l = 0;
    for (index_t t = 0; t < y.size(); ++t) l += y.data()[t] * g.data()[t];
    return l;
  };
  const double l0 = loss_of();
  layer.zero_grad();
  layer.backward(g);
  const auto grads = layer.gradients();
  const TensorView<double, 1> ds = grads.at("sinks");
  double scale = 0;
  for (index_t h = 0; h < Hq; ++h) scale = std::max(scale, std::abs(ds(h)));
  REQUIRE(scale > 0);
  for (index_t h = 0; h < Hq; ++h) {
    double& p = params.at("sinks")(h);
    const double p0 = p, step = 0x1p-8;  // the kernel reads sinks as float: exact steps
    p = p0 + step;
    const double lp = loss_of();
    p = p0 - step;
    const double lm = loss_of();
    p = p0 + step / 2;
    const double lp2 = loss_of();
    p = p0 - step / 2;
    const double lm2 = loss_of();
    p = p0;
    const double num = (4 * (lp2 - lm2) / step - (lp - lm) / (2 * step)) / 3;
    INFO("sinks[" << h << "]: layer " << ds(h) << ", numeric " << num);
    CHECK(std::abs(ds(h) - num) <= 1e-6 * (1 + scale));
  }
  layer.save_safetensors(path);
  Layer loaded(cfg, 99);
  loaded.load_safetensors(path);
  REQUIRE(loaded.parameters().at("sinks")(1) == params.at("sinks")(1));
  const Tensor<double, 3> y0 = layer.forward(x), y1 = loaded.forward(x);
  REQUIRE(test::bitwise_equal(y0, y1));
  (void)l0;
  std::remove(path);
  // The softcap is checked.
  Config bad = cfg;
  bad.softcap = -1.0f;
  test::require_error([&] { Layer l(bad); }, {"softcap"});
}

}  // namespace

TEST_CASE("modifiers: V1 and V2 layers with softcap, ALiBi and learned sinks",
          "[modifiers][layer]") {
  diffattn::DiffAttnV1Config c1;
  c1.embed_dim = 32;
  c1.num_heads = 2;
  c1.num_kv_heads = 1;
  check_layer<diffattn::MultiheadDiffAttnV1<double>>(c1, "test_modifiers_v1.safetensors");
  diffattn::DiffAttnV2Config c2;
  c2.embed_dim = 32;
  c2.num_heads = 2;
  c2.num_kv_heads = 1;
  check_layer<diffattn::MultiheadDiffAttnV2<double>>(c2, "test_modifiers_v2.safetensors");
}

namespace {

// A functor with every member, reading b, h, i and j: WarpScore's score, and
// a mask hiding key i - 1, the keys with (j + b) % 11 == 4, and every key of
// query head 1 in the rows with i % 5 == 0 (a sink, when set, takes them).
struct PositionMod {
  template <class S>
  S score(S s, index_t b, index_t h, index_t i, index_t j) const {
    return WarpScore{}.score(s, b, h, i, j);
  }
  template <class S>
  S dscore(S s, index_t b, index_t h, index_t i, index_t j) const {
    return WarpScore{}.dscore(s, b, h, i, j);
  }
  bool visible(index_t b, index_t h, index_t i, index_t j) const {
    if (h == 1 && i % 5 == 0) return false;
    return j != i - 1 && (j + b) % 11 != 4;
  }
};

// PositionMod as the reference of a sub-problem (slice) applies it: batch
// entry b of the call, the sub-problem's row i at the functor's i + ioff.
void set_reference_functor(Case& sub, index_t b, index_t ioff) {
  sub.fscore = [b, ioff](double s, index_t, index_t h, index_t i, index_t j) {
    return warp_ref(s, b, h, i + ioff, j);
  };
  sub.fvisible = [b, ioff](index_t, index_t h, index_t i, index_t j) {
    return PositionMod{}.visible(b, h, i + ioff, j);
  };
}

// The case's *_kvcache kernel with the functor mod, caches of KV under queries of T.
template <class T, class KV, class Mod>
void run_kvcache_mod(const Case& c, const Inputs& in, const Tensor<T, 4>& q,
                     const TensorView<const KV, 4>& k, const TensorView<const KV, 4>& v,
                     const diffattn::KVCacheBatch& cache, Tensor<T, 4>& out,
                     Tensor<diffattn::compute_t<T>, 3>& lse, const AttentionOptions& o,
                     const Mod& mod) {
  using C = diffattn::compute_t<T>;
  switch (c.kind) {
    case Kind::plain:
      diffattn::attention_kvcache<T, KV>(q, k, v, out, lse, cache, o, mod);
      break;
    case Kind::v1:
      diffattn::diff_attention_v1_kvcache<T, KV>(q, k, v, static_cast<C>(in.lam[0]), out, lse,
                                                 cache, o, mod);
      break;
    case Kind::v1_heads: {
      std::vector<C> lam(in.lam.begin(), in.lam.end());
      const TensorView<const C, 1> lv(lam.data(), {static_cast<index_t>(lam.size())});
      diffattn::diff_attention_v1_kvcache<T, KV>(q, k, v, lv, out, lse, cache, o, mod);
      break;
    }
    default: {
      const auto logit = cast<T>(in.logit);
      diffattn::diff_attention_v2_kvcache<T, KV>(q, k, v, logit, out, lse, cache, o, mod);
    }
  }
}

// The float64 reference of a batch of caches (sequence b holding lens[b] keys
// of in.k, in.v) under PositionMod: the functor's i is the query's position
// row + lens[b] - n.
Reference cache_reference(const Case& c, const Inputs& in, const std::vector<index_t>& lens) {
  const index_t dv = in.v.shape(3), Hq = query_heads(c);
  Reference r{Tensor<double, 4>({c.B, c.N, c.H, dv}), Tensor<double, 3>({c.B, Hq, c.N})};
  for (index_t b = 0; b < c.B; ++b) {
    const index_t m = lens[static_cast<std::size_t>(b)];
    auto sub = slice(c, in, b, 0, c.N, 0, m);
    set_reference_functor(sub.first, b, m - c.N);
    const Reference rb = reference(sub.first, sub.second);
    for (index_t i = 0; i < c.N; ++i) {
      for (index_t h = 0; h < c.H; ++h)
        for (index_t x = 0; x < dv; ++x) r.out(b, i, h, x) = rb.out(0, i, h, x);
      for (index_t h = 0; h < Hq; ++h) r.lse(b, h, i) = rb.lse(0, h, i);
    }
  }
  return r;
}

Tensor<index_t, 1> lengths(const std::vector<index_t>& lens) {
  Tensor<index_t, 1> t({static_cast<index_t>(lens.size())});
  for (std::size_t b = 0; b < lens.size(); ++b) t(static_cast<index_t>(b)) = lens[b];
  return t;
}

}  // namespace

TEST_CASE("modifiers: functors over KV caches (contiguous, paged, split-KV, any thread count)",
          "[modifiers][functor]") {
  std::uint64_t seed = 7000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    for (index_t n : {1, 3, 8}) {         // decoding steps, and a prefill chunk (block kernel)
      Case c{kind, 2, n, 300, 2, 1, 16};  // capacity 300
      c.causal = true;
      c.softcap = 3.0f;
      c.alibi = c.sinks = true;
      INFO(kind_name(kind) << " n=" << n);
      const Inputs in = make_inputs(c, seed++);
      const std::vector<index_t> lens = {290, 41};
      const Tensor<index_t, 1> seqlens = lengths(lens);
      const Reference ref = cache_reference(c, in, lens);
      const AttentionOptions o = options_of(c, in);
      const Pool pool = make_pool(in.k, in.v, 16);
      Tensor<double, 4> first(ref.out.shape());
      Tensor<double, 3> first_lse(ref.lse.shape());
      for (index_t split : {index_t(0), index_t(64)}) {  // one chunk; five and one
        for (bool paged : {false, true}) {
          for (int threads : {1, 2, 3}) {
            INFO("split_keys " << split << " paged " << paged << " threads " << threads);
            diffattn::KVCacheBatch cache;
            cache.cache_seqlens = seqlens;
            cache.split_keys = split;
            AttentionOptions ot = o;
            ot.num_threads = threads;
            Tensor<double, 4> out(ref.out.shape());
            Tensor<double, 3> lse(ref.lse.shape());
            if (paged) {
              cache.block_table = pool.table;
              run_kvcache_mod<double, double>(c, in, in.q, pool.k, pool.v, cache, out, lse, ot,
                                              PositionMod{});
            } else {
              run_kvcache_mod<double, double>(c, in, in.q, in.k, in.v, cache, out, lse, ot,
                                              PositionMod{});
            }
            REQUIRE(rel_error(out, ref.out) <= 1e-12);
            REQUIRE(lse_error(lse, ref.lse) <= 1e-12);
            if (threads == 1) {
              first = out;
              first_lse = lse;
            } else {
              REQUIRE(test::bitwise_equal(out, first));
              REQUIRE(test::bitwise_equal(lse, first_lse));
            }
          }
        }
      }
      // float storage, split-KV.
      diffattn::KVCacheBatch cache;
      cache.cache_seqlens = seqlens;
      cache.split_keys = 64;
      const auto qf = cast<float>(in.q), kf = cast<float>(in.k), vf = cast<float>(in.v);
      Tensor<float, 4> of(ref.out.shape());
      Tensor<float, 3> lf(ref.lse.shape());
      run_kvcache_mod<float, float>(c, in, qf, kf, vf, cache, of, lf, o, PositionMod{});
      CHECK(rel_error(of, ref.out) <= 1e-5);
      CHECK(lse_error(lf, ref.lse) <= 1e-5);
    }
  }
}

TEST_CASE("modifiers: a document mask over a cache's positions, with visible_block",
          "[modifiers][functor]") {
  // Documents over the positions of each cache; the new queries are the last
  // tokens of the last document, so i must be their position to see it.
  std::vector<index_t> doc;
  for (index_t s = 0; s < 4; ++s) doc.insert(doc.end(), static_cast<std::size_t>(70 + 9 * s), s);
  const index_t cap = static_cast<index_t>(doc.size());
  for (index_t n : {1, 20}) {
    Case c{Kind::v2, 1, n, cap, 2, 1, 16};
    c.causal = true;
    c.sinks = true;
    INFO("n=" << n);
    const Inputs in = make_inputs(c, 7100 + static_cast<std::uint64_t>(n));
    const index_t* dp = doc.data();
    Case ref_case = c;
    ref_case.fvisible = [dp, n, cap](index_t, index_t, index_t i, index_t j) {
      return dp[i + cap - n] == dp[j];
    };
    const Reference ref = reference(ref_case, in);
    const Tensor<index_t, 1> seqlens = lengths({cap});
    diffattn::KVCacheBatch cache;
    cache.cache_seqlens = seqlens;
    cache.split_keys = 50;
    Tensor<double, 4> out(ref.out.shape()), out_b(ref.out.shape());
    Tensor<double, 3> lse(ref.lse.shape()), lse_b(ref.lse.shape());
    const AttentionOptions o = options_of(c, in);
    run_kvcache_mod<double, double>(c, in, in.q, in.k, in.v, cache, out, lse, o, DocumentMask{dp});
    run_kvcache_mod<double, double>(c, in, in.q, in.k, in.v, cache, out_b, lse_b, o,
                                    DocumentBlocks{dp});
    REQUIRE(rel_error(out, ref.out) <= 1e-12);
    REQUIRE(lse_error(lse, ref.lse) <= 1e-12);
    REQUIRE(rel_error(out_b, ref.out) <= 1e-12);
    REQUIRE(lse_error(lse_b, ref.lse) <= 1e-12);
  }
}

TEMPLATE_TEST_CASE("modifiers: 8-bit caches with softcap, ALiBi, sinks and a functor",
                   "[modifiers][functor]", std::int8_t, diffattn::float8_e4m3) {
  using Q = TestType;
  std::uint64_t seed = 7200;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    for (index_t n : {1, 8}) {
      for (int functor = 0; functor < 2; ++functor) {
        Case c{kind, 2, n, 200, 2, 1, 16};  // d = 16: key products in float (no VNNI)
        c.causal = true;
        c.softcap = 3.0f;
        c.alibi = c.sinks = true;
        INFO(kind_name(kind) << " n=" << n << " functor " << functor);
        Inputs in = make_inputs(c, seed++);
        // The cache quantized; the reference runs on its dequantized values.
        const auto kf = cast<float>(in.k), vf = cast<float>(in.v);
        Tensor<Q, 4> kq(kf.shape()), vq(vf.shape());
        Tensor<float, 3> ks({kf.shape(0), kf.shape(1), kf.shape(2)}),
            vs({vf.shape(0), vf.shape(1), vf.shape(2)});
        diffattn::quantize_rows<float, Q>(kf, kq, ks);
        diffattn::quantize_rows<float, Q>(vf, vq, vs);
        for (index_t x = 0; x < kq.size(); ++x)
          in.k.data()[x] = static_cast<double>(ks.data()[x / c.d]) *
                           static_cast<double>(static_cast<float>(kq.data()[x]));
        const index_t dv = vq.shape(3);
        for (index_t x = 0; x < vq.size(); ++x)
          in.v.data()[x] = static_cast<double>(vs.data()[x / dv]) *
                           static_cast<double>(static_cast<float>(vq.data()[x]));
        const std::vector<index_t> lens = {187, 23};
        const Tensor<index_t, 1> seqlens = lengths(lens);
        Reference ref;
        if (functor) {
          ref = cache_reference(c, in, lens);
        } else {
          ref = Reference{Tensor<double, 4>({c.B, n, c.H, dv}),
                          Tensor<double, 3>({c.B, query_heads(c), n})};
          for (index_t b = 0; b < c.B; ++b) {
            const auto sub = slice(c, in, b, 0, n, 0, lens[static_cast<std::size_t>(b)]);
            const Reference rb = reference(sub.first, sub.second);
            for (index_t i = 0; i < n; ++i) {
              for (index_t h = 0; h < c.H; ++h)
                for (index_t x = 0; x < dv; ++x) ref.out(b, i, h, x) = rb.out(0, i, h, x);
              for (index_t h = 0; h < query_heads(c); ++h) ref.lse(b, h, i) = rb.lse(0, h, i);
            }
          }
        }
        diffattn::KVCacheBatch cache;
        cache.cache_seqlens = seqlens;
        cache.split_keys = 64;
        cache.k_scale = ks;
        cache.v_scale = vs;
        const auto qf = cast<float>(in.q);
        Tensor<float, 4> out(ref.out.shape());
        Tensor<float, 3> lse(ref.lse.shape());
        const AttentionOptions o = options_of(c, in);
        if (functor)
          run_kvcache_mod<float, Q>(c, in, qf, kq, vq, cache, out, lse, o, PositionMod{});
        else
          run_kvcache_mod<float, Q>(c, in, qf, kq, vq, cache, out, lse, o, diffattn::NoScoreMod{});
        CHECK(rel_error(out, ref.out) <= 1e-5);
        CHECK(lse_error(lse, ref.lse) <= 1e-5);
      }
    }
  }
}

namespace {

// A packed batch of four sequences (one empty) under PositionMod, the
// functor's b the sequence and i, j within it.
const std::vector<index_t> kPackedQ = {30, 0, 45, 3}, kPackedK = {40, 5, 45, 20};

template <class T, class Mod>
void run_varlen_mod(const Case& c, const Inputs& in, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                    const Tensor<T, 4>& v, Tensor<T, 4>& out,
                    Tensor<diffattn::compute_t<T>, 2>& lse, const diffattn::PackedSequences& seqs,
                    const AttentionOptions& o, const Mod& mod) {
  using C = diffattn::compute_t<T>;
  auto d3 = [](const auto& t) {
    using E = std::remove_const_t<std::remove_reference_t<decltype(*t.data())>>;
    return TensorView<const E, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
  };
  TensorView<T, 3> out3(out.data(), {out.shape(1), out.shape(2), out.shape(3)});
  switch (c.kind) {
    case Kind::plain:
      diffattn::attention_varlen<T>(d3(q), d3(k), d3(v), out3, lse, seqs, o, mod);
      break;
    case Kind::v1:
      diffattn::diff_attention_v1_varlen<T>(d3(q), d3(k), d3(v), static_cast<C>(in.lam[0]), out3,
                                            lse, seqs, o, mod);
      break;
    case Kind::v1_heads: {
      std::vector<C> lam(in.lam.begin(), in.lam.end());
      diffattn::diff_attention_v1_varlen<T>(
          d3(q), d3(k), d3(v), TensorView<const C, 1>(lam.data(), {c.H}), out3, lse, seqs, o, mod);
      break;
    }
    default: {
      const auto logit = cast<T>(in.logit);
      diffattn::diff_attention_v2_varlen<T>(d3(q), d3(k), d3(v),
                                            TensorView<const T, 2>(logit.data(), {c.N, c.H}), out3,
                                            lse, seqs, o, mod);
    }
  }
}

Case packed_case(Kind kind) {
  index_t Tq = 0, Tk = 0;
  for (std::size_t s = 0; s < kPackedQ.size(); ++s) Tq += kPackedQ[s], Tk += kPackedK[s];
  Case c{kind, 1, Tq, Tk, 2, 1, 8};
  c.causal = true;
  c.softcap = 2.5f;
  c.alibi = c.sinks = true;
  return c;
}

}  // namespace

TEST_CASE("modifiers: functors over packed varlen batches, forward", "[modifiers][functor]") {
  std::uint64_t seed = 7300;
  const auto seqs = diffattn::PackedSequences::from_lengths(kPackedQ, kPackedK);
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    for (int window = 0; window < 2; ++window) {
      Case c = packed_case(kind);
      if (window) c.wl = 6;
      INFO(kind_name(kind) << " window_left " << c.wl);
      const Inputs in = make_inputs(c, seed++);
      const index_t Hq = query_heads(c), dv = in.v.shape(3);
      Reference ref{Tensor<double, 4>({1, c.N, c.H, dv}), Tensor<double, 3>({1, Hq, c.N})};
      for (std::size_t s = 0; s < kPackedQ.size(); ++s) {
        const index_t q0 = seqs.cu_seqlens_q[s], k0 = seqs.cu_seqlens_k[s];
        auto sub = slice(c, in, 0, q0, kPackedQ[s], k0, kPackedK[s]);
        set_reference_functor(sub.first, static_cast<index_t>(s), 0);
        const Reference rs = reference(sub.first, sub.second);
        for (index_t i = 0; i < kPackedQ[s]; ++i) {
          for (index_t h = 0; h < c.H; ++h)
            for (index_t x = 0; x < dv; ++x) ref.out(0, q0 + i, h, x) = rs.out(0, i, h, x);
          for (index_t h = 0; h < Hq; ++h) ref.lse(0, h, q0 + i) = rs.lse(0, h, i);
        }
      }
      const AttentionOptions o = options_of(c, in);
      Tensor<double, 4> out(ref.out.shape());
      Tensor<double, 2> lse({Hq, c.N});
      run_varlen_mod<double>(c, in, in.q, in.k, in.v, out, lse, seqs, o, PositionMod{});
      REQUIRE(rel_error(out, ref.out) <= 1e-12);
      const Tensor<double, 3> lse3 = [&] {
        Tensor<double, 3> t({1, Hq, c.N});
        std::copy(lse.data(), lse.data() + lse.size(), t.data());
        return t;
      }();
      REQUIRE(lse_error(lse3, ref.lse) <= 1e-12);
      const auto qf = cast<float>(in.q), kf = cast<float>(in.k), vf = cast<float>(in.v);
      Tensor<float, 4> of(ref.out.shape());
      Tensor<float, 2> lf({Hq, c.N});
      run_varlen_mod<float>(c, in, qf, kf, vf, of, lf, seqs, o, PositionMod{});
      CHECK(rel_error(of, ref.out) <= 1e-5);
    }
  }
}

TEST_CASE("modifiers: functors over packed varlen batches, backward (finite differences)",
          "[modifiers][functor]") {
  std::uint64_t seed = 7400;
  const auto seqs = diffattn::PackedSequences::from_lengths(kPackedQ, kPackedK);
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v1_heads, Kind::v2}) {
    const Case c = packed_case(kind);
    INFO(kind_name(kind));
    Inputs in = make_inputs(c, seed++);
    const index_t Hq = query_heads(c), dv = in.v.shape(3), Tq = c.N;
    const auto g = random_tensor<double, 4>({1, Tq, c.H, dv}, seed + 50);
    auto d3 = [](auto& t) {
      using E = std::remove_reference_t<decltype(*t.data())>;
      return TensorView<E, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
    };
    const std::function<double()> f = [&] {
      Tensor<double, 4> out(g.shape());
      Tensor<double, 2> lse({Hq, Tq});
      run_varlen_mod<double>(c, in, in.q, in.k, in.v, out, lse, seqs, options_of(c, in),
                             PositionMod{});
      double l = 0;
      for (index_t x = 0; x < out.size(); ++x) l += out.data()[x] * g.data()[x];
      return l;
    };
    // The kernel's gradients.
    Tensor<double, 4> out(g.shape()), dq(in.q.shape()), dk(in.k.shape()), dv_(in.v.shape());
    Tensor<double, 2> lse({Hq, Tq});
    const AttentionOptions o = options_of(c, in);
    run_varlen_mod<double>(c, in, in.q, in.k, in.v, out, lse, seqs, o, PositionMod{});
    std::vector<double> dsinks(static_cast<std::size_t>(Hq));
    const TensorView<double, 1> ds(dsinks.data(), {Hq});
    const auto q3 = d3(std::as_const(in.q)), k3 = d3(std::as_const(in.k)),
               v3 = d3(std::as_const(in.v)), o3 = d3(std::as_const(out)), g3 = d3(g);
    switch (kind) {
      case Kind::plain:
        diffattn::attention_varlen_backward<double>(q3, k3, v3, o3, lse, g3, d3(dq), d3(dk),
                                                    d3(dv_), seqs, o, ds, PositionMod{});
        break;
      case Kind::v1: {
        double dl = 0;
        diffattn::diff_attention_v1_varlen_backward<double>(q3, k3, v3, in.lam[0], o3, lse, g3,
                                                            d3(dq), d3(dk), d3(dv_), dl, seqs, o,
                                                            ds, PositionMod{});
        break;
      }
      case Kind::v1_heads: {
        std::vector<double> dl(in.lam.size());
        diffattn::diff_attention_v1_varlen_backward<double>(
            q3, k3, v3, TensorView<const double, 1>(in.lam.data(), {c.H}), o3, lse, g3, d3(dq),
            d3(dk), d3(dv_), TensorView<double, 1>(dl.data(), {c.H}), seqs, o, ds, PositionMod{});
        break;
      }
      default: {
        Tensor<double, 2> dlogit({Tq, c.H});
        diffattn::diff_attention_v2_varlen_backward<double>(
            q3, k3, v3, TensorView<const double, 2>(in.logit.data(), {Tq, c.H}), o3, lse, g3,
            d3(dq), d3(dk), d3(dv_), dlogit, seqs, o, ds, PositionMod{});
      }
    }
    diffattn::detail::Rng rng(seed + 60);
    auto check_tensor = [&](const char* name, Tensor<double, 4>& x, const Tensor<double, 4>& dx) {
      double scale = 0;
      for (index_t t = 0; t < dx.size(); ++t) scale = std::max(scale, std::abs(dx.data()[t]));
      REQUIRE(scale > 0);
      for (int s = 0; s < 12; ++s) {
        const index_t t = static_cast<index_t>(rng.uniform() * static_cast<double>(x.size()));
        double* p = x.data() + t;
        const double num = numeric([&](double y) { return *p = y; }, *p, 1e-3, f);
        INFO(name << "[" << t << "]: kernel " << dx.data()[t] << ", numeric " << num);
        CHECK(std::abs(dx.data()[t] - num) <= 1e-6 * (1 + scale));
      }
    };
    check_tensor("dq", in.q, dq);
    check_tensor("dk", in.k, dk);
    check_tensor("dv", in.v, dv_);
    double scale = 0;
    for (double x : dsinks) scale = std::max(scale, std::abs(x));
    for (std::size_t h = 0; h < in.sinks.size(); ++h) {
      float* p = &in.sinks[h];
      const double num = numeric([&](double y) { return *p = static_cast<float>(y); },
                                 static_cast<double>(*p), 0x1p-8, f);
      INFO("dsinks[" << h << "]: kernel " << dsinks[h] << ", numeric " << num);
      CHECK(std::abs(dsinks[h] - num) <= 1e-6 * (1 + scale));
    }
  }
}

TEST_CASE("modifiers: an empty functor over caches and packed batches is the call without one",
          "[modifiers][functor]") {
  Case c{Kind::v1, 2, 1, 300, 2, 1, 16};
  c.causal = true;
  c.sinks = true;
  const Inputs in = make_inputs(c, 7500);
  const auto q = cast<float>(in.q), k = cast<float>(in.k), v = cast<float>(in.v);
  const Tensor<index_t, 1> seqlens = lengths({290, 41});
  diffattn::KVCacheBatch cache;
  cache.cache_seqlens = seqlens;
  cache.split_keys = 64;
  const AttentionOptions o = options_of(c, in);
  Tensor<float, 4> a({2, 1, 2, 32}), b(a.shape());
  Tensor<float, 3> la({2, 4, 1}), lb(la.shape());
  diffattn::diff_attention_v1_kvcache<float>(q, k, v, static_cast<float>(in.lam[0]), a, la, cache,
                                             o);
  diffattn::diff_attention_v1_kvcache<float>(q, k, v, static_cast<float>(in.lam[0]), b, lb, cache,
                                             o, Empty{});
  REQUIRE(test::bitwise_equal(a, b));
  REQUIRE(test::bitwise_equal(la, lb));
  const Case p = packed_case(Kind::v2);
  const Inputs pin = make_inputs(p, 7501);
  const auto seqs = diffattn::PackedSequences::from_lengths(kPackedQ, kPackedK);
  const auto pq = cast<float>(pin.q), pk = cast<float>(pin.k), pv = cast<float>(pin.v);
  Tensor<float, 4> pa({1, p.N, p.H, p.d}), pb(pa.shape());
  Tensor<float, 2> pla({2 * p.H, p.N}), plb(pla.shape());
  const AttentionOptions po = options_of(p, pin);
  run_varlen_mod<float>(p, pin, pq, pk, pv, pa, pla, seqs, po, diffattn::NoScoreMod{});
  run_varlen_mod<float>(p, pin, pq, pk, pv, pb, plb, seqs, po, Empty{});
  REQUIRE(test::bitwise_equal(pa, pb));
  REQUIRE(test::bitwise_equal(pla, plb));
}
