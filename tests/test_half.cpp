// 16-bit storage (types.hpp): bfloat16 and half through the fused kernels
// (tiled and decoding paths, varlen, KV caches: per-sequence lengths, paged,
// split-KV), a float or double queries' kernel over a 16-bit cache, against
// the float64 reference on the same rounded inputs.
//
// Error bound. The inputs are the 16-bit values themselves (exact in float
// and double), so the float64 reference y is the exact result up to 1e-15. A
// 16-bit kernel widens every input once (exactly) and runs the float kernel's
// arithmetic, then rounds each output once to the storage type:
//   out_S = round_S(out_f),  |round_S(x) - x| <= u_S |x|,
// u_S = 2^-8 for bfloat16 (8 significand bits), 2^-11 for half (11 bits),
// with out_f what the float kernel gives on the widened inputs. Hence, with
// e_f = max|out_f - y| / max|y| the float accumulation error (itself bounded
// as in test_attention.cpp: at most max(2 x the naive float error, 2e-5)),
//   max|out_S - y| / max|y| <= u_S (1 + e_f) + e_f.
// The tests check that bound, and, on the tiled path (6 or more queries per
// sequence), the stronger statement it rests on: out_S is bitwise
// round_S(out_f), and lse (kept in float, never rounded to S) is bitwise the
// float kernel's. A decoding step (fewer than 6 queries) over a 16-bit cache
// takes its dot products four query rows at a time (decode_kernel.hpp), in
// another order than the float cache's path: there e_f is replaced by the
// float kernel's bound itself, max(2 x naive float error, 2e-5).
//
// bfloat16 q and k in a build for AVX512-BF16 (detail::use_bf16_dot): the
// tiled path computes S = Q K^T with bf16 dot products on the unscaled
// queries and scales the scores (detail/kernel/bf16_dot.hpp), a float sum of the
// same exact products in another order. out_S is then no longer bitwise
// round_S(out_f); like the decoding step it is held to the bound with e_f the
// float kernel's bound, and lse to the float tolerance.
//
// There O = W V runs on bf16 dot products as well (detail/kernel/bf16_wv.hpp): each
// weight is rounded once to bf16 before the product, which adds at most
// 2^-8 sum_j |w_ij| |v_jc| =: 2^-8 m_ic to output element (i, c), a sum that
// can exceed max |y| where the two maps cancel. The bound is then elementwise,
// with delta_ic = e_f max |y| + 2^-8 (1 + 2^-6) m_ic (the 2^-6 covers the
// float W's own error next to W), for the float kernel's arithmetic, the
// weights' rounding and the output's:
//   |out_S - y|_ic <= u_S (|y_ic| + delta_ic) + delta_ic,
// with m computed in float64 from the reference's W on the same inputs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/isa.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/detail/kernel/bf16_dot.hpp>
#include <diffattn/detail/kernel/bf16_wv.hpp>
#include <diffattn/detail/kernel/softmax.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
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
using diffattn::KVCacheBatch;
using diffattn::Tensor;
using diffattn::TensorView;
using test::bf16_dot;
using test::cast;
using test::random_tensor;
using test::rel_error;
using test::type_name;
using test::unit_roundoff;

namespace {

enum class Kind { plain, v1, v2 };
const char* name(Kind k) { return k == Kind::v1 ? "v1" : k == Kind::v2 ? "v2" : "plain"; }

struct Shape {
  index_t B, N, M, H, Hkv, d;  // H: DIFF heads (v1, v2) or query heads (plain)
};

struct Dims {
  index_t qh, kh, vh, dv, oh;
};
Dims dims(Kind kind, index_t H, index_t Hkv, index_t d) {
  switch (kind) {
    case Kind::v1:
      return {2 * H, 2 * Hkv, Hkv, 2 * d, H};
    case Kind::v2:
      return {2 * H, Hkv, Hkv, d, H};
    default:
      return {H, Hkv, Hkv, d + 3, H};
  }
}

/// Inputs of one case in T (all from the same 16-bit values).
template <class T>
struct Inputs {
  Tensor<T, 4> q, k, v;
  Tensor<T, 3> logit;  // v2 (B, N, H)
};

template <class U, class T>
Inputs<U> cast_inputs(const Inputs<T>& in) {
  return {cast<U>(in.q), cast<U>(in.k), cast<U>(in.v), cast<U>(in.logit)};
}

template <class S>
Inputs<S> make_inputs(Kind kind, const Shape& s, std::uint64_t seed, double sigma = 1.0) {
  const Dims dm = dims(kind, s.H, s.Hkv, s.d);
  Inputs<S> in;
  in.q = cast<S>(random_tensor<float, 4>({s.B, s.N, dm.qh, s.d}, seed, sigma));
  in.k = cast<S>(random_tensor<float, 4>({s.B, s.M, dm.kh, s.d}, seed + 1, sigma));
  in.v = cast<S>(random_tensor<float, 4>({s.B, s.M, dm.vh, dm.dv}, seed + 2));
  in.logit = cast<S>(random_tensor<float, 3>({s.B, s.N, s.H}, seed + 3, 2.0));
  return in;
}

constexpr float kLambda = 0.7f;

/// The fused kernel (Reference = false) or the reference of a kind, with
/// storage T; q and out may be strided views.
template <class T, bool Reference>
void run(Kind kind, TensorView<const T, 4> q, TensorView<const T, 4> k, TensorView<const T, 4> v,
         TensorView<const T, 3> logit, TensorView<T, 4> out,
         TensorView<diffattn::compute_t<T>, 3> lse, const AttentionOptions& o) {
  using C = diffattn::compute_t<T>;
  switch (kind) {
    case Kind::v1:
      if constexpr (Reference)
        diffattn::reference::diff_attention_v1<T>(q, k, v, static_cast<C>(kLambda), out, lse, o);
      else
        diffattn::diff_attention_v1<T>(q, k, v, static_cast<C>(kLambda), out, lse, o);
      break;
    case Kind::v2:
      if constexpr (Reference)
        diffattn::reference::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
      else
        diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
      break;
    default:
      if constexpr (Reference)
        diffattn::reference::attention<T>(q, k, v, out, lse, o);
      else
        diffattn::attention<T>(q, k, v, out, lse, o);
  }
}

/// m_ic = sum_j |w_ij| |v_jc| in float64 for every output element (see the
/// top), written to mag: the reference's W of the same problem (masks, GQA,
/// V2's lambda per row), in absolute value, times |v| over each row's keys.
/// q, k, v and logit are what run<double, true> takes.
void abs_wv(Kind kind, TensorView<const double, 4> q, TensorView<const double, 4> k,
            TensorView<const double, 4> v, TensorView<const double, 3> logit,
            TensorView<double, 4> mag, const AttentionOptions& o) {
  namespace dt = diffattn::detail;
  using Mat = diffattn::Matrix<double>;
  const TensorView<double, 3> no_lse;
  const double lambda = kLambda;
  const dt::AttentionProblem<double> p =
      kind == Kind::v1   ? dt::validate_v1<double>(q, k, v, &lambda, nullptr, mag, no_lse, o)
      : kind == Kind::v2 ? dt::validate_v2<double>(q, k, v, logit, mag, no_lse, o)
                         : dt::validate_plain<double>(q, k, v, mag, no_lse, o);
  for (index_t seq = 0; seq < p.num_seqs(); ++seq)
    for (index_t oh = 0; oh < p.heads; ++oh) {
      const dt::SeqSpan sq = p.seq(seq);
      const dt::HeadMap hm = dt::head_map(p, oh);
      auto map = [&](int m) {
        return diffattn::softmax(dt::masked_scores<double>(
            dt::gather_head(p.q, sq.b, hm.q[m], sq.q0, sq.n),
            dt::gather_head(p.k, sq.b, hm.k[m], sq.k0, sq.m), p.scale, p.band));
      };
      Mat w = map(0);  // (n, m)
      if (p.kind != dt::AttnKind::plain) {
        const Mat a2 = map(1);
        for (index_t i = 0; i < sq.n; ++i)
          w.row(i) -= dt::row_lambda(p, sq.b, sq.q0 + i, oh) * a2.row(i);
      }
      const Mat va = dt::gather_head(p.v, sq.b, hm.v, sq.k0, sq.m).cwiseAbs();  // (m, dv)
      for (index_t i = 0; i < sq.n; ++i) {
        const index_t j0 = p.band.begin(i, sq.n, sq.m), n = p.band.count(i, sq.n, sq.m);
        for (index_t c = 0; c < p.value_dim; ++c)
          p.out(sq.b, sq.q0 + i, oh, c) =
              n > 0 ? w.row(i).segment(j0, n).cwiseAbs().dot(va.col(c).segment(j0, n)) : 0.0;
      }
    }
}

/// Over the checks of bf16 W V so far, for the report at the end of a run
/// (DIFFATTN_TEST_REPORT): the largest |out - y| / bound, and the largest
/// max |out - y| / max |y|.
double g_worst_wv = 0, g_worst_rel = 0;

/// A (B, N, H, D) tensor held in (B, H, N, D) memory: the strided view the
/// kernels see, and a contiguous copy of what it holds.
template <class T>
struct Bhnd {
  Tensor<T, 4> mem;  // (B, H, N, D)
  explicit Bhnd(const std::array<index_t, 4>& s) : mem({s[0], s[2], s[1], s[3]}) {}
  TensorView<T, 4> view() {
    const auto& m = mem.shape();
    return TensorView<T, 4>(mem.data(), {m[0], m[2], m[1], m[3]},
                            {m[1] * m[2] * m[3], m[3], m[2] * m[3], 1});
  }
  void load(const Tensor<T, 4>& t) {
    auto w = view();
    for (index_t b = 0; b < t.shape(0); ++b)
      for (index_t i = 0; i < t.shape(1); ++i)
        for (index_t h = 0; h < t.shape(2); ++h)
          for (index_t c = 0; c < t.shape(3); ++c) w(b, i, h, c) = t(b, i, h, c);
  }
  Tensor<T, 4> contiguous() {
    auto w = view();
    Tensor<T, 4> t(w.shape());
    for (index_t b = 0; b < t.shape(0); ++b)
      for (index_t i = 0; i < t.shape(1); ++i)
        for (index_t h = 0; h < t.shape(2); ++h)
          for (index_t c = 0; c < t.shape(3); ++c) t(b, i, h, c) = w(b, i, h, c);
    return t;
  }
};

/// out_S against the float kernel and the float64 reference (see the header
/// comment); lse against both.
template <class S>
void check_results(const Tensor<S, 4>& out_s, const Tensor<float, 3>& lse_s,
                   const Tensor<float, 4>& out_f, const Tensor<float, 3>& lse_f,
                   const Tensor<float, 4>& naive_f, const Tensor<double, 4>& ref,
                   const Tensor<double, 3>& lse_ref, bool bitwise,
                   const Tensor<double, 4>* mag = nullptr) {
  if (bitwise) {
    REQUIRE(test::bitwise_equal(out_s, cast<S>(out_f)));
    REQUIRE(test::bitwise_equal(lse_s, lse_f));
  }
  const double naive = rel_error(naive_f, ref), float_bound = std::max(2 * naive, 2e-5);
  const double e_f = bitwise ? rel_error(out_f, ref) : float_bound;
  const double e_s = rel_error(out_s, ref), u = unit_roundoff<S>();
  INFO(type_name<S>() << " error " << e_s << ", float " << e_f << ", naive float " << naive);
  REQUIRE(rel_error(out_f, ref) <= float_bound);
  if (mag) {
    // W rounded to bf16 for W V: the elementwise bound of the top, asserted
    // at the element nearest to (or furthest past) its bound.
    double ymax = 0;
    for (index_t i = 0; i < ref.size(); ++i) ymax = std::max(ymax, std::abs(ref.data()[i]));
    index_t worst = 0;
    double worst_ratio = -1, worst_err = 0, worst_bound = 0;
    for (index_t i = 0; i < ref.size(); ++i) {
      const double y = ref.data()[i];
      const double delta = e_f * ymax + std::ldexp(1.0 + 1.0 / 64, -8) * mag->data()[i];
      const double bound = u * (std::abs(y) + delta) + delta;
      const double err = std::abs(static_cast<double>(out_s.data()[i]) - y);
      const double ratio = std::isnan(err) ? HUGE_VAL
                           : bound > 0     ? err / bound
                           : err > 0       ? HUGE_VAL
                                           : 0;
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = i;
        worst_err = err;
        worst_bound = bound;
      }
    }
    INFO("worst element " << worst << ": " << double(out_s.data()[worst]) << " against "
                          << ref.data()[worst] << ", m " << mag->data()[worst] << ", max |y| "
                          << ymax << ", error " << worst_err << ", bound " << worst_bound);
    REQUIRE(worst_err <= worst_bound);
    g_worst_wv = std::max(g_worst_wv, worst_ratio);
    g_worst_rel = std::max(g_worst_rel, e_s);
  } else {
    REQUIRE(e_s <= u * (1 + e_f) + e_f);
  }
  for (index_t i = 0; i < lse_ref.size(); ++i) {
    const double want = lse_ref.data()[i];
    if (std::isinf(want))
      REQUIRE(lse_s.data()[i] == static_cast<float>(want));
    else
      REQUIRE(std::abs(lse_s.data()[i] - want) <= 1e-5 * (1 + std::abs(want)));
  }
}

/// One forward case in storage S: fused<S> (optionally through (B, H, N, D)
/// views of q and out), fused<float> and reference<float> on the widened
/// inputs, reference<double>.
template <class S>
void check_forward(Kind kind, const Shape& s, AttentionOptions o, std::uint64_t seed,
                   bool strided = false, double sigma = 1.0) {
  INFO(type_name<S>() << " " << name(kind) << " B=" << s.B << " N=" << s.N << " M=" << s.M
                      << " H=" << s.H << " Hkv=" << s.Hkv << " d=" << s.d << " causal=" << o.causal
                      << " window_left=" << o.window_left << " strided=" << strided);
  const Dims dm = dims(kind, s.H, s.Hkv, s.d);
  const Inputs<S> xs = make_inputs<S>(kind, s, seed, sigma);
  const Inputs<float> xf = cast_inputs<float>(xs);
  const Inputs<double> xd = cast_inputs<double>(xs);
  const std::array<index_t, 4> os = {s.B, s.N, dm.oh, dm.dv};
  const std::array<index_t, 3> ls = {s.B, dm.qh, s.N};
  Tensor<S, 4> out_s(os);
  Tensor<float, 4> out_f(os), naive_f(os);
  Tensor<double, 4> ref(os);
  Tensor<float, 3> lse_s(ls), lse_f(ls), lse_naive(ls);
  Tensor<double, 3> lse_ref(ls);
  if (strided) {
    Bhnd<S> q(xs.q.shape()), out(os);
    q.load(xs.q);
    run<S, false>(kind, q.view(), xs.k, xs.v, xs.logit, out.view(), lse_s, o);
    out_s = out.contiguous();
  } else {
    run<S, false>(kind, xs.q, xs.k, xs.v, xs.logit, out_s, lse_s, o);
  }
  run<float, false>(kind, xf.q, xf.k, xf.v, xf.logit, out_f, lse_f, o);
  run<float, true>(kind, xf.q, xf.k, xf.v, xf.logit, naive_f, lse_naive, o);
  run<double, true>(kind, xd.q, xd.k, xd.v, xd.logit, ref, lse_ref, o);
  Tensor<double, 4> mag(os);
  if (bf16_dot<S>()) abs_wv(kind, xd.q, xd.k, xd.v, xd.logit, mag, o);
  check_results(out_s, lse_s, out_f, lse_f, naive_f, ref, lse_ref, s.N >= 6 && !bf16_dot<S>(),
                bf16_dot<S>() ? &mag : nullptr);
}

AttentionOptions opts(bool causal, index_t window_left = -1) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = window_left;
  return o;
}

/// Every shape family of test_attention.cpp for storage S.
template <class S>
void forward_families(std::uint64_t seed) {
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const index_t pair = kind == Kind::v2 ? 2 : 1;  // V2: a pair shares its kv head
    // Sizes that are not tile multiples, with and without the causal mask.
    for (index_t n : {1, 7, 113, 129})
      for (bool causal : {false, true})
        check_forward<S>(kind, {1, n, n, 2, 1, 8}, opts(causal), seed += 10);
    // N != M: causal with an offset (N < M, decoding and tiled), masked rows (N > M).
    check_forward<S>(kind, {2, 19, 23, 2, 2 / pair, 5}, opts(true), seed += 10);
    check_forward<S>(kind, {2, 5, 37, 2, 1, 8}, opts(true), seed += 10);
    check_forward<S>(kind, {1, 40, 9, 1, 1, 4}, opts(true), seed += 10);
    check_forward<S>(kind, {1, 17, 29, 2, 2 / pair, 8}, opts(false), seed += 10);
    // GQA ratios 1, 2, 4 (query heads per kv head; V2 counts query heads too).
    for (index_t ratio : {1, 2, 4}) {
      if (kind == Kind::v2 && ratio == 1) continue;
      const index_t Hkv = 2, H = kind == Kind::v2 ? Hkv * ratio / 2 : Hkv * ratio;
      check_forward<S>(kind, {1, 31, 31, H, Hkv, 16}, opts(true), seed += 10);
    }
    // Strided (B, H, N, D) q and out.
    check_forward<S>(kind, {2, 23, 23, 2, 2 / pair, 8}, opts(true), seed += 10, true);
    check_forward<S>(kind, {2, 3, 23, 2, 2 / pair, 8}, opts(false), seed += 10, true);
    // Sliding windows, tiled and decoding.
    check_forward<S>(kind, {1, 129, 129, 2, 1, 8}, opts(true, 16), seed += 10);
    check_forward<S>(kind, {1, 3, 70, 2, 1, 8}, opts(true, 20), seed += 10);
    // Large logits: the max shift in float.
    check_forward<S>(kind, {1, 17, 21, 1, 1, 8}, opts(true), seed += 10, false, 6.0);
  }
}

}  // namespace

TEST_CASE("bfloat16 storage: every shape family against the float64 reference", "[half]") {
  forward_families<bfloat16>(71000);
  if (bf16_dot<bfloat16>() && std::getenv("DIFFATTN_TEST_REPORT"))
    std::printf("bf16 W V: largest |out - y| / bound %.3f, largest max |out - y| / max |y| %.3g\n",
                g_worst_wv, g_worst_rel);
}

TEST_CASE("half storage: every shape family against the float64 reference", "[half]") {
  forward_families<half>(72000);
}

TEST_CASE("16-bit varlen batches equal the float kernel rounded once", "[half][varlen]") {
  const auto seqs = diffattn::PackedSequences::from_lengths({5, 0, 70, 1, 13});
  const index_t T = 89, H = 2, d = 8;
  const auto q = cast<bfloat16>(random_tensor<float, 3>({T, 2 * H, d}, 73001));
  const auto k = cast<bfloat16>(random_tensor<float, 3>({T, H, d}, 73002));
  const auto v = cast<bfloat16>(random_tensor<float, 3>({T, H, d}, 73003));
  const auto logit = cast<bfloat16>(random_tensor<float, 2>({T, H}, 73004));
  Tensor<bfloat16, 3> out({T, H, d});
  Tensor<float, 3> out_f({T, H, d});
  Tensor<float, 2> lse({2 * H, T}), lse_f({2 * H, T});
  const auto o = opts(true);
  diffattn::diff_attention_v2_varlen<bfloat16>(q, k, v, logit, out, lse, seqs, o);
  diffattn::diff_attention_v2_varlen<float>(cast<float>(q), cast<float>(k), cast<float>(v),
                                            cast<float>(logit), out_f, lse_f, seqs, o);
  if (!bf16_dot<bfloat16>()) {
    REQUIRE(test::bitwise_equal(out, cast<bfloat16>(out_f)));
    REQUIRE(test::bitwise_equal(lse, lse_f));
    return;
  }
  // bf16 dot products: both kernels within e_f <= 2e-5 of the exact result
  // (d = 8: the naive float error is near 1e-7), W rounded to bf16 for W V
  // (m from each packed sequence's own float64 W), out rounded once more:
  // |out - out_f| <= u (|out_f| + delta) + delta, delta = 2 e_f max |out_f| + 2^-8 (1 + 2^-6) m.
  const double u = unit_roundoff<bfloat16>(), e_f = 2e-5;
  const auto qd = cast<double>(q), kd = cast<double>(k), vd = cast<double>(v);
  const auto logitd = cast<double>(logit);
  Tensor<double, 3> mag({T, H, d});
  const std::vector<index_t>& cu = seqs.cu_seqlens_q;
  for (std::size_t sidx = 0; sidx + 1 < cu.size(); ++sidx) {
    const index_t a = cu[sidx], len = cu[sidx + 1] - a;
    if (len == 0) continue;
    auto seq4 = [&](auto& t) {  // rows [a, a + len) of a (T, heads, D) tensor as (1, len, heads, D)
      using E = std::remove_reference_t<decltype(*t.data())>;
      const auto st = t.view();
      return TensorView<E, 4>(t.data() + a * st.stride(0), {1, len, t.shape(1), t.shape(2)},
                              {len * st.stride(0), st.stride(0), st.stride(1), 1});
    };
    const index_t ls0 = logitd.view().stride(0);
    abs_wv(Kind::v2, seq4(qd), seq4(kd), seq4(vd),
           TensorView<const double, 3>(logitd.data() + a * ls0, {1, len, H}, {len * ls0, ls0, 1}),
           seq4(mag), o);
  }
  double fmax = 0;
  for (index_t i = 0; i < out_f.size(); ++i)
    fmax = std::max(fmax, double(std::abs(out_f.data()[i])));
  double worst_excess = -HUGE_VAL;  // largest error - bound
  index_t worst = 0;
  for (index_t i = 0; i < out.size(); ++i) {
    const double want = out_f.data()[i];
    const double delta = 2 * e_f * fmax + std::ldexp(1.0 + 1.0 / 64, -8) * mag.data()[i];
    const double err = std::abs(double(out.data()[i]) - want);
    const double excess = std::isnan(err) ? HUGE_VAL : err - (u * (std::abs(want) + delta) + delta);
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  INFO("element " << worst << ": " << double(out.data()[worst]) << " against "
                  << out_f.data()[worst] << ", error beyond the bound " << worst_excess);
  REQUIRE(worst_excess <= 0);
  for (index_t i = 0; i < lse.size(); ++i) {
    const double want = lse_f.data()[i];
    if (std::isinf(want))
      REQUIRE(lse.data()[i] == lse_f.data()[i]);
    else
      REQUIRE(std::abs(lse.data()[i] - want) <= 2e-5 * (1 + std::abs(want)));
  }
}

TEST_CASE("16-bit tiled results do not depend on the thread count", "[half][threads]") {
  std::uint64_t seed = 73100;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const Shape s{2, 131, 140, 2, 1, 9};
    const Inputs<bfloat16> xs = make_inputs<bfloat16>(kind, s, seed += 10);
    const Dims dm = dims(kind, s.H, s.Hkv, s.d);
    Tensor<bfloat16, 4> first({s.B, s.N, dm.oh, dm.dv});
    Tensor<float, 3> lse_first({s.B, dm.qh, s.N});
    for (int threads : {1, 2, 3, 5}) {
      INFO(name(kind) << " threads " << threads);
      AttentionOptions o = opts(true);
      o.num_threads = threads;
      Tensor<bfloat16, 4> out({s.B, s.N, dm.oh, dm.dv});
      Tensor<float, 3> lse({s.B, dm.qh, s.N});
      run<bfloat16, false>(kind, xs.q, xs.k, xs.v, xs.logit, out, lse, o);
      if (threads == 1) {
        first = out;
        lse_first = lse;
      }
      REQUIRE(test::bitwise_equal(out, first));
      REQUIRE(test::bitwise_equal(lse, lse_first));
    }
  }
}

TEST_CASE("bf16 pairs: packing layout, and the dot-product micro-kernel's bound",
          "[half][bf16dot]") {
  namespace dt = diffattn::detail;
  constexpr index_t NR = dt::TileConfig<float>::kNR;
  for (index_t d : {1, 2, 5, 8, 64, 127}) {
    INFO("d = " << d);
    const index_t rows = 6, keys = NR + 3, dk = dt::bf16_pairs(d);
    const auto q = cast<bfloat16>(random_tensor<float, 2>({rows, d}, 73200 + d));
    const auto k = cast<bfloat16>(random_tensor<float, 2>({keys, d}, 73300 + d));
    std::vector<std::uint32_t> qp(static_cast<std::size_t>(rows * dk));
    for (index_t r = 0; r < rows; ++r) dt::pack_query_pairs(&q(r, 0), d, qp.data() + r * dk);
    dt::ScratchBuffer<std::uint32_t> kp;  // 64-byte aligned, as the kernel's
    std::uint32_t* panels = kp.get(dt::round_up(keys, NR) * dk);
    dt::pack_pairs_transposed_from([&](index_t j) { return &k(j, 0); }, keys, d, panels);
    // Layout: element t of key j in half t % 2 of word t / 2 of its panel; zero padding.
    auto half_of = [](std::uint32_t w, index_t h) { return (w >> (16 * h)) & 0xffffu; };
    for (index_t j = 0; j < dt::round_up(keys, NR); ++j)
      for (index_t t = 0; t < 2 * dk; ++t) {
        const std::uint32_t w = panels[(j / NR) * NR * dk + (t / 2) * NR + j % NR];
        const std::uint32_t want = j < keys && t < d ? k(j, t).value : 0u;
        REQUIRE(half_of(w, t % 2) == want);
      }
    for (index_t r = 0; r < rows; ++r)
      for (index_t t = 0; t < 2 * dk; ++t)
        REQUIRE(half_of(qp[static_cast<std::size_t>(r * dk + t / 2)], t % 2) ==
                (t < d ? q(r, t).value : 0u));
#if defined(__AVX512BF16__)
    // Scores: s q.k with exact products summed in float, then scaled once:
    // |s^ - s q.k| <= (gamma_d + u_f) s sum_t |q_t k_t|, u_f = 2^-24.
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const double uf = std::ldexp(1.0, -24), bound = d * uf / (1 - d * uf) + uf;
    std::vector<float> sc(static_cast<std::size_t>(rows * NR * 2));
    for (index_t p0 = 0; p0 < dt::round_up(keys, NR); p0 += NR) {
      dt::micro_kernel_bf16(dk, qp.data(), dk, panels + p0 * dk, sc.data(), NR, scale);
      for (index_t r = 0; r < rows; ++r)
        for (index_t c = 0; c < NR; ++c) {
          double exact = 0, abs_sum = 0;
          for (index_t t = 0; t < d && p0 + c < keys; ++t) {
            exact += double(q(r, t)) * double(k(p0 + c, t));
            abs_sum += std::abs(double(q(r, t)) * double(k(p0 + c, t)));
          }
          const double got = sc[static_cast<std::size_t>(r * NR + c)];
          REQUIRE(std::abs(got - scale * exact) <= bound * scale * abs_sum + 1e-30);
        }
    }
#endif
  }
}

TEST_CASE("bf16 W V: value pairs, rounded weights and the accumulating micro-kernel",
          "[half][bf16wv]") {
  namespace dt = diffattn::detail;
  constexpr index_t NR = dt::TileConfig<float>::kNR;
  // Value pairs: keys 2t (low half) and 2t + 1 of feature column c in word t of
  // panel c / NR; zero for the key after an odd count and beyond the width.
  for (index_t rows : {1, 2, 7, 64}) {
    for (index_t width : {3, 32, 45}) {
      INFO("rows " << rows << " width " << width);
      const auto v = cast<bfloat16>(random_tensor<float, 2>({rows, width}, 73400 + rows + width));
      const index_t pairs = dt::bf16_pairs(rows), wp = dt::round_up(width, NR);
      std::vector<std::uint32_t> panels(static_cast<std::size_t>(pairs * wp), 0xdeadbeefu);
      dt::pack_value_pairs_from([&](index_t j) { return &v(j, 0); }, rows, width, panels.data());
      for (index_t j = 0; j < 2 * pairs; ++j)
        for (index_t c = 0; c < wp; ++c) {
          const std::uint32_t w =
              panels[static_cast<std::size_t>((c / NR) * pairs * NR + (j / 2) * NR + c % NR)];
          const std::uint32_t want = j < rows && c < width ? v(j, c).value : 0u;
          REQUIRE(((w >> (16 * (j % 2))) & 0xffffu) == want);
          const float widened = dt::value_from_pairs(panels.data(), pairs, j, c);
          REQUIRE(widened == (j < rows && c < width ? static_cast<float>(v(j, c)) : 0.0f));
        }
      // One key's values added to a row, as at the band's edges: out += w v_j exactly
      // (w = 0.5, an exact float product).
      for (index_t j = 0; j < rows; ++j)
        for (index_t c0 = 0; c0 < wp; c0 += NR) {
          std::vector<float> out(static_cast<std::size_t>(NR), 1.0f);
          dt::add_value_pair_row(panels.data() + c0 * pairs, j, 0.5f, out.data());
          for (index_t c = 0; c < NR; ++c)
            REQUIRE(out[static_cast<std::size_t>(c)] ==
                    1.0f + 0.5f * (c0 + c < width ? static_cast<float>(v(j, c0 + c)) : 0.0f));
        }
    }
  }
#if defined(__AVX512BF16__)
  // Rounded weights: to nearest, ties to even (1 + 2^-8 -> 1, 1 + 3 2^-8 ->
  // 1 + 2^-6), as Eigen's conversion rounds normal floats; words outside
  // [t0, t1) untouched.
  {
    std::vector<float> w(80);
    diffattn::detail::Rng rng(73500);
    for (auto& x : w) x = static_cast<float>(rng.normal());
    w[10] = 1.0f + std::ldexp(1.0f, -8);
    w[11] = -(1.0f + 3 * std::ldexp(1.0f, -8));
    w[12] = 0.0f;
    w[13] = -0.0f;
    for (index_t t0 : {0, 3, 5})
      for (index_t t1 : {5, 6, 21, 37, 40}) {
        if (t1 < t0) continue;
        INFO("t0 " << t0 << " t1 " << t1);
        std::vector<std::uint32_t> out(40, 0x12345678u);
        dt::round_weight_pairs(w.data(), t0, t1, out.data());
        for (index_t t = 0; t < 40; ++t) {
          const std::uint32_t got = out[static_cast<std::size_t>(t)];
          if (t < t0 || t >= t1) {
            REQUIRE(got == 0x12345678u);
            continue;
          }
          const std::uint32_t lo = bfloat16(w[static_cast<std::size_t>(2 * t)]).value;
          const std::uint32_t hi = bfloat16(w[static_cast<std::size_t>(2 * t + 1)]).value;
          REQUIRE(got == (lo | hi << 16));
        }
      }
    REQUIRE(bfloat16(w[10]) == bfloat16(1.0f));
    REQUIRE(static_cast<float>(bfloat16(w[11])) == -(1.0f + std::ldexp(1.0f, -6)));
  }
  // C += W^ V over pairs of keys: a float sum of exact products, added to C,
  // |got - (C0 + sum_j w^_j v_j)| <= gamma_{keys + 1} (|C0| + sum_j |w^_j v_j|).
  for (index_t keys : {2, 6, 64, 250}) {
    INFO("keys " << keys);
    const index_t pairs = keys / 2, width = NR;
    const auto wv = cast<bfloat16>(random_tensor<float, 2>({6, keys}, 73600 + keys));
    const auto v = cast<bfloat16>(random_tensor<float, 2>({keys, width}, 73700 + keys));
    std::vector<float> wf(static_cast<std::size_t>(6 * keys));
    for (index_t r = 0; r < 6; ++r)
      for (index_t j = 0; j < keys; ++j)
        wf[static_cast<std::size_t>(r * keys + j)] = float(wv(r, j));
    std::vector<std::uint32_t> a(static_cast<std::size_t>(6 * pairs));
    for (index_t r = 0; r < 6; ++r)
      dt::round_weight_pairs(wf.data() + r * keys, 0, pairs, a.data() + r * pairs);
    dt::ScratchBuffer<std::uint32_t> vb;  // 64-byte aligned, as the kernel's
    std::uint32_t* panels = vb.get(pairs * NR);
    dt::pack_value_pairs_from([&](index_t j) { return &v(j, 0); }, keys, width, panels);
    const index_t ldc = NR + 5;
    std::vector<float> c(static_cast<std::size_t>(6 * ldc));
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    const std::vector<float> c0 = c;
    dt::micro_kernel_bf16_add(pairs, a.data(), pairs, panels, c.data(), ldc);
    const double uf = std::ldexp(1.0, -24), g = (keys + 1) * uf / (1 - (keys + 1) * uf);
    for (index_t r = 0; r < 6; ++r)
      for (index_t col = 0; col < ldc; ++col) {
        const std::size_t at = static_cast<std::size_t>(r * ldc + col);
        if (col >= NR) {  // beyond the tile: untouched
          REQUIRE(c[at] == c0[at]);
          continue;
        }
        double exact = c0[at], abs_sum = std::abs(c0[at]);
        for (index_t j = 0; j < keys; ++j) {
          const double pr = double(wv(r, j)) * double(v(j, col));
          exact += pr;
          abs_sum += std::abs(pr);
        }
        REQUIRE(std::abs(c[at] - exact) <= g * abs_sum);
      }
  }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/// The points the exp tests check: a grid over [-110, 0], random points in
/// [-20, 0], -inf, -0 and NaN, padded with zeros to a multiple of 16.
std::vector<float> exp_test_points() {
  std::vector<float> x;
  for (int i = 0; i <= 22000; ++i) x.push_back(-110.0f + 0.005f * static_cast<float>(i));
  diffattn::detail::Rng rng(73600);
  for (int i = 0; i < 4000; ++i) x.push_back(static_cast<float>(-20 * rng.uniform()));
  x.push_back(-std::numeric_limits<float>::infinity());
  x.push_back(-0.0f);
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  while (x.size() % 16) x.push_back(0.0f);
  return x;
}

/// e = exp(x) as a kernel's exp computed it: within 2^-bits of exp relative
/// where exp(x) is a normal float; below, that and `below` (half the smallest
/// denormal, 2^-150, for a denormal result rounded; 2^-126 where the
/// function flushes to 0), and never negative; 1 for -0 and 0, 0 for -inf,
/// NaN for NaN.
void check_exp_values(const std::vector<float>& x, const std::vector<float>& e, int bits,
                      double below, const char* name) {
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO(name << ": x = " << x[i] << " exp " << e[i]);
    if (std::isnan(x[i])) {
      REQUIRE(std::isnan(e[i]));
      continue;
    }
    const double want = std::exp(static_cast<double>(x[i]));
    if (want >= std::numeric_limits<float>::min()) {
      worst = std::max(worst, std::abs(e[i] - want) / want);
      REQUIRE(std::abs(e[i] - want) <= std::ldexp(want, -bits));
    } else {
      REQUIRE(e[i] >= 0.0f);
      REQUIRE(std::abs(e[i] - want) <= std::ldexp(want, -bits) + below);
    }
    if (x[i] == 0.0f) REQUIRE(e[i] == 1.0f);
    if (std::isinf(x[i])) REQUIRE(e[i] == 0.0f);
  }
  if (std::getenv("DIFFATTN_TEST_REPORT"))
    std::printf("%s: largest relative error %.3g (2^-%d = %.3g)\n", name, worst, bits,
                std::ldexp(1.0, -bits));
}
#endif

#if defined(__AVX512F__)
/// exp_scalef<Degree> against std::exp (check_exp_values), 0 under -104. Then
/// exp_shift_sum<float, Scalef> (the rows of the kernels using that degree):
/// every length's tail under a mask, the sum of the row's exponentials
/// (positive terms: within n 2^-24 of the exact sum), and the entries past
/// the row untouched; and for degree 6, exp_shift_sum_masked, whose -inf
/// entries become exactly 0.
template <int Degree, bool Scalef>
void check_exp_scalef(int bits) {
  namespace dt = diffattn::detail;
  const std::vector<float> x = exp_test_points();
  std::vector<float> e(x.size());
  for (std::size_t i = 0; i < x.size(); i += 16)
    _mm512_storeu_ps(e.data() + i, dt::exp_scalef<Degree>(_mm512_loadu_ps(x.data() + i)));
  check_exp_values(x, e, bits, std::ldexp(1.0, -150),
                   Degree == 5 ? "exp_scalef<5>" : "exp_scalef<6>");
  for (std::size_t i = 0; i < x.size(); ++i)
    if (x[i] < -104.0f) REQUIRE(e[i] == 0.0f);
  for (int masked = 0; masked < (Degree == 6 ? 2 : 1); ++masked)
    for (index_t n = 0; n <= 70; ++n) {
      std::vector<float> row(static_cast<std::size_t>(n) + 1, 123.0f), ref(row.size());
      for (index_t j = 0; j < n; ++j)
        row[static_cast<std::size_t>(j)] =
            masked && j % 3 == 1 ? -std::numeric_limits<float>::infinity()
                                 : x[static_cast<std::size_t>(j * 7 % 4000) + 22001];
      ref = row;
      const float sum = masked ? dt::exp_shift_sum_masked(row.data(), n, -1.5f)
                               : dt::exp_shift_sum<float, Scalef>(row.data(), n, -1.5f);
      double exact = 0;
      for (index_t j = 0; j < n; ++j) {
        const std::size_t u = static_cast<std::size_t>(j);
        const double want = std::exp(static_cast<double>(ref[u]) + 1.5);
        INFO("masked " << masked << ", n = " << n << ", j = " << j);
        if (std::isinf(ref[u])) REQUIRE(row[u] == 0.0f);
        REQUIRE(std::abs(row[u] - want) <= std::ldexp(want, -bits));
        exact += static_cast<double>(row[u]);
      }
      REQUIRE(row[static_cast<std::size_t>(n)] == 123.0f);  // past the row: untouched
      REQUIRE(std::abs(sum - exact) <= (n + 1) * std::ldexp(exact, -24));
    }
}
#endif

TEST_CASE("exp_scalef, exp_fma256: the kernels' exp against std::exp", "[half][bf16wv][softmax]") {
#if defined(__AVX512F__)
  // Degree 5: the bf16 dot-product kernels and 8-bit caches, 2^-21 relative.
  check_exp_scalef<5, true>(21);
  // Degree 6: the float kernels (and 16-bit storage widened to float), within
  // 2^-23 relative: 1 ulp of the result where its significand is at least
  // 1 (checked over every float in [-87, 0]: 1.18 ulp, 2^-23.27 relative).
  check_exp_scalef<6, false>(23);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  // exp_fma256: the float kernels' exp under AVX2 + FMA, the same reduction
  // and polynomial as degree 6, 2^n by the exponent field: within 2^-23
  // relative where exp is normal, 0 from about -87.7 down (a flush of at most
  // 2^-126) and under -88.
  {
    const std::vector<float> x = exp_test_points();
    std::vector<float> e(x.size());
    for (std::size_t i = 0; i < x.size(); i += 8)
      _mm256_storeu_ps(e.data() + i, diffattn::detail::exp_fma256(_mm256_loadu_ps(x.data() + i)));
    check_exp_values(x, e, 23, std::ldexp(1.0, -126), "exp_fma256");
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i] <= -88.0f) REQUIRE(e[i] == 0.0f);
  }
#else
  WARN("exp_scalef and exp_fma256 are defined for AVX-512 and AVX2 + FMA builds only (this "
       "build targets neither): skipped");
#endif
}

TEST_CASE("bfloat16 storage: a non-finite value row stays in the rows that see it",
          "[half][bf16wv]") {
  // The band's edges go row by row: a masked (zero) weight never meets the
  // NaN row, rounded to bf16 or not.
  for (Kind kind : {Kind::plain, Kind::v2}) {
    for (index_t window : {index_t(-1), index_t(9)}) {
      INFO(name(kind) << " window " << window);
      const Shape s{1, 97, 97, 1, 1, 8};
      Inputs<bfloat16> xs = make_inputs<bfloat16>(kind, s, 73800);
      const index_t bad = 41;
      for (index_t c = 0; c < xs.v.shape(3); ++c)
        xs.v(0, bad, 0, c) = bfloat16(std::numeric_limits<float>::quiet_NaN());
      const Dims dm = dims(kind, s.H, s.Hkv, s.d);
      Tensor<bfloat16, 4> out({1, s.N, dm.oh, dm.dv});
      Tensor<float, 3> lse({1, dm.qh, s.N});
      run<bfloat16, false>(kind, xs.q, xs.k, xs.v, xs.logit, out, lse, opts(true, window));
      for (index_t i = 0; i < s.N; ++i) {
        const bool sees = i >= bad && (window < 0 || i - bad <= window);
        for (index_t c = 0; c < dm.dv; ++c) {
          INFO("row " << i << " column " << c);
          REQUIRE(std::isnan(static_cast<float>(out(0, i, 0, c))) == sees);
        }
      }
    }
  }
}

namespace {

/// Contiguous caches (B, capacity, H, D) copied into a scrambled pool of
/// blocks of bs rows (as test_decode.cpp does).
template <class T>
struct Paged {
  Tensor<T, 4> k, v;
  Tensor<index_t, 2> table;
};
template <class T>
Paged<T> make_paged(const Tensor<T, 4>& k, const Tensor<T, 4>& v, index_t bs) {
  const index_t B = k.shape(0), cap = k.shape(1), per = (cap + bs - 1) / bs;
  const index_t blocks = B * per + 3;
  Paged<T> p{Tensor<T, 4>({blocks, bs, k.shape(2), k.shape(3)}),
             Tensor<T, 4>({blocks, bs, v.shape(2), v.shape(3)}), Tensor<index_t, 2>({B, per})};
  std::vector<index_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = 0; i < ids.size(); ++i) std::swap(ids[i], ids[(i * 7919 + 13) % ids.size()]);
  std::size_t next = 0;
  for (index_t b = 0; b < B; ++b) {
    for (index_t blk = 0; blk < per; ++blk) p.table(b, blk) = ids[next++];
    for (index_t j = 0; j < cap; ++j) {
      const index_t id = p.table(b, j / bs);
      for (index_t h = 0; h < k.shape(2); ++h)
        for (index_t t = 0; t < k.shape(3); ++t) p.k(id, j % bs, h, t) = k(b, j, h, t);
      for (index_t h = 0; h < v.shape(2); ++h)
        for (index_t t = 0; t < v.shape(3); ++t) p.v(id, j % bs, h, t) = v(b, j, h, t);
    }
  }
  return p;
}

/// The kvcache kernel of a kind: queries T, caches KV.
template <class T, class KV>
void run_kvcache(Kind kind, const Inputs<T>& in, TensorView<const KV, 4> k,
                 TensorView<const KV, 4> v, const KVCacheBatch& cache, Tensor<T, 4>& out,
                 Tensor<diffattn::compute_t<T>, 3>& lse, const AttentionOptions& o) {
  using C = diffattn::compute_t<T>;
  switch (kind) {
    case Kind::v1:
      diffattn::diff_attention_v1_kvcache<T, KV>(in.q, k, v, static_cast<C>(kLambda), out, lse,
                                                 cache, o);
      break;
    case Kind::v2:
      diffattn::diff_attention_v2_kvcache<T, KV>(in.q, k, v, in.logit, out, lse, cache, o);
      break;
    default:
      diffattn::attention_kvcache<T, KV>(in.q, k, v, out, lse, cache, o);
  }
}

/// Batch entry b, rows [0, len) of a (B, L, H, D) tensor as (1, len, H, D).
template <class T>
TensorView<T, 4> entry(const Tensor<T, 4>& t, index_t b, index_t len) {
  return TensorView<T, 4>(const_cast<T*>(t.data()) + b * t.view().stride(0),
                          {1, len, t.shape(2), t.shape(3)},
                          {t.view().stride(0), t.view().stride(1), t.view().stride(2), 1});
}
template <class T>
TensorView<T, 3> entry(const Tensor<T, 3>& t, index_t b) {
  return TensorView<T, 3>(const_cast<T*>(t.data()) + b * t.view().stride(0),
                          {1, t.shape(1), t.shape(2)}, {t.view().stride(0), t.view().stride(1), 1});
}

/// A batch of caches in storage S with per-sequence lengths: S queries and
/// S caches (contiguous, paged, split-KV) against the float64 reference on
/// each sequence's slice; float and double queries over the S cache equal
/// their own kernel on the widened cache, bitwise.
template <class S>
void check_kvcache(Kind kind, index_t n, index_t H, index_t Hkv, index_t d, index_t capacity,
                   const std::vector<index_t>& lengths, AttentionOptions o, std::uint64_t seed) {
  const index_t B = static_cast<index_t>(lengths.size());
  INFO(type_name<S>() << " kvcache " << name(kind) << " n=" << n << " H=" << H << " Hkv=" << Hkv
                      << " cap=" << capacity << " causal=" << o.causal
                      << " window_left=" << o.window_left);
  const Dims dm = dims(kind, H, Hkv, d);
  const Inputs<S> xs = make_inputs<S>(kind, {B, n, capacity, H, Hkv, d}, seed);
  const Inputs<float> xf = cast_inputs<float>(xs);
  const Inputs<double> xd = cast_inputs<double>(xs);
  Tensor<index_t, 1> seqlens({B});
  std::copy(lengths.begin(), lengths.end(), seqlens.data());
  KVCacheBatch cache;
  cache.cache_seqlens = seqlens;
  const std::array<index_t, 4> os = {B, n, dm.oh, dm.dv};
  const std::array<index_t, 3> ls = {B, dm.qh, n};

  // Reference and naive float, each sequence on its own slice.
  Tensor<double, 4> ref(os);
  Tensor<double, 3> lse_ref(ls);
  Tensor<float, 4> naive_f(os);
  Tensor<float, 3> lse_naive(ls);
  Tensor<double, 4> mag(os);  // bf16 W V: sum_j |w_ij| |v_jc|
  const Tensor<double, 4>* wv = bf16_dot<S>() ? &mag : nullptr;
  for (index_t b = 0; b < B; ++b) {
    const index_t m = lengths[static_cast<std::size_t>(b)];
    run<double, true>(kind, entry(xd.q, b, n), entry(xd.k, b, m), entry(xd.v, b, m),
                      entry(xd.logit, b), entry(ref, b, n), entry(lse_ref, b), o);
    if (wv)
      abs_wv(kind, entry(xd.q, b, n), entry(xd.k, b, m), entry(xd.v, b, m), entry(xd.logit, b),
             entry(mag, b, n), o);
    run<float, true>(kind, entry(xf.q, b, n), entry(xf.k, b, m), entry(xf.v, b, m),
                     entry(xf.logit, b), entry(naive_f, b, n), entry(lse_naive, b), o);
  }
  Tensor<float, 4> out_f(os);
  Tensor<float, 3> lse_f(ls);
  run_kvcache<float, float>(kind, xf, xf.k, xf.v, cache, out_f, lse_f, o);
  Tensor<S, 4> out_s(os);
  Tensor<float, 3> lse_s(ls);
  run_kvcache<S, S>(kind, xs, xs.k, xs.v, cache, out_s, lse_s, o);
  // Decoding steps and bf16 dot products order their sums differently (see the top).
  const bool tiled = n >= 6 && !bf16_dot<S>();
  check_results(out_s, lse_s, out_f, lse_f, naive_f, ref, lse_ref, tiled, wv);

  // Paged S caches: bitwise the contiguous result.
  for (index_t bs : {index_t(1), index_t(5), index_t(16)}) {
    INFO("block_size " << bs);
    const Paged<S> pg = make_paged(xs.k, xs.v, bs);
    KVCacheBatch paged = cache;
    paged.block_table = pg.table;
    Tensor<S, 4> out_p(os);
    Tensor<float, 3> lse_p(ls);
    run_kvcache<S, S>(kind, xs, pg.k, pg.v, paged, out_p, lse_p, o);
    REQUIRE(test::bitwise_equal(out_p, out_s));
    REQUIRE(test::bitwise_equal(lse_p, lse_s));
  }

  // Split-KV in small chunks: the float kernel's split result rounded once.
  {
    KVCacheBatch split = cache;
    split.split_keys = 7;
    Tensor<S, 4> out_sp(os);
    Tensor<float, 4> out_fp(os);
    Tensor<float, 3> lse_sp(ls), lse_fp(ls);
    run_kvcache<S, S>(kind, xs, xs.k, xs.v, split, out_sp, lse_sp, o);
    run_kvcache<float, float>(kind, xf, xf.k, xf.v, split, out_fp, lse_fp, o);
    check_results(out_sp, lse_sp, out_fp, lse_fp, naive_f, ref, lse_ref, tiled, wv);
  }

  // Float queries over the S cache: never rounded; the float kernel on the
  // widened cache, bitwise on the tiled path, within the float kernel's own
  // error bound of the float64 result when decoding. Double queries alike.
  {
    const Inputs<float> qf =
        cast_inputs<float>(make_inputs<float>(kind, {B, n, 1, H, Hkv, d}, seed + 7));
    Inputs<float> mixed = xf;
    mixed.q = qf.q;
    mixed.logit = qf.logit;
    Tensor<float, 4> out_m(os), out_w(os);
    Tensor<float, 3> lse_m(ls), lse_w(ls);
    run_kvcache<float, S>(kind, mixed, xs.k, xs.v, cache, out_m, lse_m, o);
    run_kvcache<float, float>(kind, mixed, xf.k, xf.v, cache, out_w, lse_w, o);
    const Inputs<double> md = cast_inputs<double>(mixed);
    Tensor<double, 4> out_md(os), out_wd(os);
    Tensor<double, 3> lse_md(ls), lse_wd(ls);
    run_kvcache<double, S>(kind, md, xs.k, xs.v, cache, out_md, lse_md, o);
    run_kvcache<double, double>(kind, md, xd.k, xd.v, cache, out_wd, lse_wd, o);
    if (tiled) {
      REQUIRE(test::bitwise_equal(out_m, out_w));
      REQUIRE(test::bitwise_equal(lse_m, lse_w));
      REQUIRE(test::bitwise_equal(out_md, out_wd));
      REQUIRE(test::bitwise_equal(lse_md, lse_wd));
    } else {
      REQUIRE(rel_error(out_md, out_wd) < 1e-12);
      const double e_w = rel_error(out_w, out_wd);
      INFO("float queries over the cache: " << rel_error(out_m, out_wd) << ", float cache " << e_w);
      REQUIRE(rel_error(out_m, out_wd) <= std::max(2 * e_w, 2e-5));
      for (index_t i = 0; i < lse_w.size(); ++i) {
        const double want = lse_wd.data()[i];
        if (std::isinf(want)) {
          REQUIRE(lse_m.data()[i] == static_cast<float>(want));
          REQUIRE(lse_md.data()[i] == want);
        } else {
          REQUIRE(std::abs(lse_m.data()[i] - want) <= 1e-5 * (1 + std::abs(want)));
          REQUIRE(std::abs(lse_md.data()[i] - want) <= 1e-12 * (1 + std::abs(want)));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("16-bit KV caches: decoding, prefill chunks, paged, split-KV", "[half][kvcache]") {
  std::uint64_t seed = 74000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const index_t H = kind == Kind::v2 ? 2 : 4;
    for (index_t n : {1, 3, 9}) {  // decoding path (< 6) and tiled path
      check_kvcache<bfloat16>(kind, n, H, 2, 8, 50, {50, 13, 0, 29}, opts(true), seed += 10);
      check_kvcache<bfloat16>(kind, n, H, 2, 8, 50, {50, 13, 9, 29}, opts(true, 6), seed += 10);
      check_kvcache<half>(kind, n, H, 2, 8, 50, {50, 13, 0, 29}, opts(false), seed += 10);
    }
  }
  // Longer than the default split (1024 keys).
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    check_kvcache<bfloat16>(kind, 1, 2, 1, 8, 3000, {3000, 1025}, opts(true), seed += 10);
  // Head widths of whole and partial packets (16 floats with AVX-512, 8 with
  // AVX2): the decoding step's blocks with their feature tails.
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t d : {40, 64, 128})
      for (index_t n : {1, 2}) {
        check_kvcache<bfloat16>(kind, n, 4, 2, d, 70, {70, 33, 17}, opts(true), seed += 10);
        check_kvcache<half>(kind, n, 4, 2, d, 70, {70, 33, 17}, opts(false), seed += 10);
      }
  // One query row (V2: two) per kv head: with AVX-512 the step reads 2 or 4
  // kv heads of a row together.
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t d : {64, 128}) {
      check_kvcache<bfloat16>(kind, 1, 4, 4, d, 70, {70, 33, 17}, opts(true), seed += 10);
      check_kvcache<half>(kind, 2, 6, 6, d, 70, {70, 33, 17}, opts(false), seed += 10);
    }
}

TEST_CASE("16-bit storage: bad input names the function and the argument", "[half][errors]") {
  const auto q = cast<bfloat16>(random_tensor<float, 4>({1, 4, 2, 8}, 75001));
  const auto k = cast<bfloat16>(random_tensor<float, 4>({1, 6, 2, 8}, 75002));
  const auto v = cast<bfloat16>(random_tensor<float, 4>({1, 6, 1, 16}, 75003));
  Tensor<bfloat16, 4> out({1, 4, 1, 8});  // should be (1, 4, 1, 16)
  test::require_error(
      [&] {
        diffattn::diff_attention_v1<bfloat16>(q, k, v, 0.5f, out, TensorView<float, 3>(), {});
      },
      {"diff_attention_v1", "out", "(1, 4, 1, 16)"});
  Tensor<bfloat16, 4> good({1, 4, 1, 16});
  Tensor<float, 3> lse({1, 2, 5});
  test::require_error([&] { diffattn::diff_attention_v1<bfloat16>(q, k, v, 0.5f, good, lse, {}); },
                      {"diff_attention_v1", "lse", "(1, 2, 4)"});
  test::require_error(
      [&] {
        diffattn::diff_attention_v1<bfloat16>(q, k, v, std::numeric_limits<float>::infinity(), good,
                                              TensorView<float, 3>(), {});
      },
      {"diff_attention_v1", "lambda"});
}

namespace {

/// Tokens [a, a + n) of x (B, N, E).
template <class T>
TensorView<const T, 3> tokens(const Tensor<T, 3>& x, index_t a, index_t n) {
  const auto& s = x.shape();
  return TensorView<const T, 3>(x.data() + a * s[2], {s[0], n, s[2]}, {s[1] * s[2], s[2], 1});
}

/// max |y - full| over the tokens [a, a + n) of full, and max |full| there.
template <class T>
std::pair<double, double> diff_max(const Tensor<T, 3>& y, const Tensor<T, 3>& full, index_t a) {
  double num = 0, den = 0;
  for (index_t b = 0; b < y.shape(0); ++b)
    for (index_t i = 0; i < y.shape(1); ++i)
      for (index_t e = 0; e < y.shape(2); ++e) {
        const double want = full(b, a + i, e);
        num = std::max(num, std::abs(double(y(b, i, e)) - want));
        den = std::max(den, std::abs(want));
      }
  return {num, den};
}

/// A float layer with a cache of S: prefill then decoding against forward on
/// the whole sequence (float, nothing rounded).
///
/// Bound. Only the cached keys and values are rounded, each once, relative
/// u = unit_roundoff<S>(). To first order a score s = scale q.k moves by at
/// most u scale sum_t |q_t k_t| <= u S (S: the largest such sum), a softmax
/// row by at most 2 u S in l1, so an attention output row by at most
/// (1 + |lambda|)(2 S + 1) u max|v|. RMSNorm per head and the output
/// projection are Lipschitz with constants of order 1 on these activations.
/// With inputs of sigma 0.5, the layers' initial weights and d = 8..16, S < 1
/// and |lambda| < 0.8, so (1 + |lambda|)(2 S + 1) < 5.4: the tolerance is
/// 8 u relative to max|y| (plus the float cache's own 1e-5). Measured: at
/// most 1.1 u (bfloat16 and half).
template <class S, class Layer>
void check_layer_cache(Layer& m, const std::vector<index_t>& chunks, std::uint64_t seed) {
  index_t total = 0;
  for (index_t c : chunks) total += c;
  const index_t B = 2, E = m.config().embed_dim;
  const Tensor<float, 3> x = random_tensor<float, 3>({B, total, E}, seed, 0.5);
  const Tensor<float, 3> full = m.forward(x);
  auto cache = m.template make_cache<S>(B, total + 3);
  static_assert(std::is_same<decltype(cache), diffattn::KVCache<S>>::value, "a cache of S");
  auto cache_f = m.make_cache(B, total + 3);
  REQUIRE(cache.bytes() * 2 == cache_f.bytes());
  const double tol = 8 * unit_roundoff<S>() + 1e-5;
  double worst = 0;
  index_t a = 0;
  for (index_t c : chunks) {
    INFO(type_name<S>() << " cache, chunk of " << c << " at " << a);
    const Tensor<float, 3> y = m.forward(tokens(x, a, c), cache);
    const auto dm = diff_max(y, full, a);
    worst = std::max(worst, dm.first / dm.second);
    CHECK(dm.first <= tol * dm.second);
    a += c;
    CHECK(cache.size() == a);
  }
  INFO("largest relative difference " << worst << " (tolerance " << tol << ")");
  CHECK(worst > 0);  // the cache is rounded: not the float result
}

std::vector<index_t> prefill_then_decode(index_t prefill, index_t decode) {
  std::vector<index_t> c = {prefill};
  for (index_t i = 0; i < decode; ++i) c.push_back(1);
  return c;
}

}  // namespace

TEST_CASE("layers keep 16-bit KV caches under float queries", "[half][layers]") {
  std::uint64_t seed = 76000;
  for (index_t hkv : {2, 1}) {
    diffattn::DiffAttnV1Config c1;
    c1.embed_dim = 32;
    c1.num_heads = 2;
    c1.num_kv_heads = hkv;
    c1.depth = 3;
    diffattn::MultiheadDiffAttnV1<float> m1(c1, seed++);
    check_layer_cache<bfloat16>(m1, prefill_then_decode(13, 12), seed++);
    check_layer_cache<half>(m1, {1, 1, 70, 5, 1, 2}, seed++);
    diffattn::DiffAttnV2Config c2;
    c2.embed_dim = 24;
    c2.num_heads = 2;
    c2.num_kv_heads = hkv;
    diffattn::MultiheadDiffAttnV2<float> m2(c2, seed++);
    check_layer_cache<bfloat16>(m2, prefill_then_decode(9, 15), seed++);
    check_layer_cache<bfloat16>(m2, {64, 3, 1}, seed++);
  }
  // A window: the 16-bit cache moves its kept rows like a float one.
  diffattn::DiffAttnV1Config cw;
  cw.embed_dim = 32;
  cw.num_heads = 2;
  cw.num_kv_heads = 1;
  cw.window_left = 3;
  diffattn::MultiheadDiffAttnV1<float> mw(cw, seed++);
  check_layer_cache<bfloat16>(mw, prefill_then_decode(7, 30), seed++);
}
