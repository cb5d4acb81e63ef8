// 16-bit layers: MultiheadDiffAttnV1 and MultiheadDiffAttnV2 with bfloat16 or
// half parameters, input and output (module_v1.hpp, module_v2.hpp), against
// the float64 layer built from the same rounded parameters on the same rounded
// input; cached and packed forwards; safetensors; parameter bytes.
//
// Error bound, half. A half layer widens its parameters and x exactly to
// float (where the projections pack them), computes every intermediate (q, k,
// v, lambda, the attention output, the norm) in float as the float layer
// does, and rounds once: each element of y, relative u = 2^-11. Its twins
// MultiheadDiffAttnV1<float>(m) and <double>(m) hold the same values
// exactly. So with y_f the float twin's output on the widened x, y the
// float64 twin's and e_f = max|y_f - y| / max|y| (the float layer's own
// error, held to 1e-4 as in test_module.cpp),
//   y_S = round_S(y_f)   (bitwise: the statement the bound rests on)
//   max|y_S - y| / max|y| <= u (1 + e_f) + e_f,
// since |round_S(a) - a| <= u |a| and max|y_f| <= (1 + e_f) max|y|.
//
// Error bound, bfloat16 (u = 2^-8). A bfloat16 layer keeps its activations
// in bfloat16, each computed in float and rounded once (relative u): q and k
// after rotary, v, V2's lambda logits, the attention output o, V1's normed
// output, and y; the kernel also rounds each weight w = A1 - lambda A2 to
// bf16 before W V (bf16_wv.hpp). bf16_bound below propagates these
// roundings through the float64 twin's own intermediates (q, k after
// rotary, v, the logits, both softmax maps A1, A2 and o, computed in double
// from the same widened values; its maps checked against attention_maps),
// per token i of DIFF head h (kv group g, query width d, s = 1/sqrt(d)):
//   scores: |ds_ij| <= (2u + u^2) s sum_t |q_it k_jt|; D_m = the max over
//           the visible j of map m;
//   maps:   each softmax entry moves by a factor within [e^-2D, e^2D]:
//           |dA_m,ij| <= a_m A_m,ij, a_m = e^(2 D_m) - 1;
//   lambda: V2 |dlambda| <= u |logit| / 4 (sigmoid' <= 1/4); V1's float
//           lambda_full is not rounded: 0;
//   w:      |dw_ij| <= a_1 A1_ij + |lambda| a_2 A2_ij + |dlambda| (1 + a_2) A2_ij,
//           sum_j: the bound of each map row (attention_maps' test);
//   o:      o' = sum_j round(w'_ij) v'_jc with v' and the weights rounded
//           (u each): |o' - o| <= P + (2u + u^2)(Q + P), P = sum_j |dw_ij| |v_jc|,
//           Q = sum_j |w_ij| |v_jc|; rounded: Eo_c = (1 + u) |o' - o| + u |o_c|;
//   V1 norm (row of 2d, r = sqrt(mean o^2 + eps), sigma = 1 - lambda_init,
//           weight w_c): |r'' - r| <= Er = rms of Eo (checked < r), so
//           |d(normed)_c| <= sigma |w_c| (Eo_c / (r - Er) + |o_c| Er / (r (r - Er))),
//           rounded: (1 + u) that + u |normed_c|;
//   y:      |dy_e| <= (1 + u) sum_c Ein_c |Wo_ec| + u |y_e|, Ein the bound of
//           the output projection's input above (o for V2, normed for V1);
// plus the float computations' own error, as the float layer's: 2 e_f max|y|
// (e_f measured as above). The check is per element of y. Measured (Zen 5,
// the _native build on bf16 dot products): the largest |y - y64| is 0.064 of
// its bound for forward, 0.14 for the cached and packed forwards, and a
// map row's difference 0.056 of its bound: worst-case bounds, each term
// taken at its maximum, sit one to two orders above the typical error (the
// relative error of y itself is 1.1-1.3 u).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/io/safetensors.hpp>
#include <diffattn/module.hpp>
#include <diffattn/types.hpp>

#include "attention_support.hpp"
#include "half_support.hpp"
#include "support.hpp"

using diffattn::bfloat16;
using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::half;
using diffattn::index_t;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;
using diffattn::TensorView;
using test::bitwise_equal;
using test::cast;
using test::random_tensor;
using test::rel_error;
using test::type_name;
using test::unit_roundoff;

namespace {

/// The float layer's error against float64 (test_module.cpp's tolerance).
constexpr double kFloatLayerTol = 1e-4;

/// Moves every parameter of a float layer off its initial values: lambda
/// vectors N(0, 0.3^2), subln.weight 1 + N(0, 0.3^2), projections kept.
template <class Layer>
void randomize_small(Layer& m, std::uint64_t seed) {
  diffattn::detail::Rng rng(seed);
  for (auto& kv : m.parameters()) {
    const bool vec = kv.first.rfind("lambda_", 0) == 0 && kv.first != "lambda_proj.weight";
    if (!vec && kv.first != "subln.weight") continue;
    for (index_t i = 0; i < kv.second.size(); ++i)
      kv.second(i) =
          static_cast<float>((kv.first == "subln.weight" ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
}

/// Every parameter's bits, by name.
template <class Layer>
std::map<std::string, std::vector<unsigned char>> bits(Layer&& m) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (auto& kv : m.parameters()) {
    const auto* p = reinterpret_cast<const unsigned char*>(kv.second.data());
    out[kv.first].assign(p, p + kv.second.size() * sizeof(*kv.second.data()));
  }
  return out;
}

/// Bytes of all parameters.
template <class Layer>
std::size_t parameter_bytes(Layer&& m) {
  std::size_t n = 0;
  for (auto& kv : m.parameters())
    n += static_cast<std::size_t>(kv.second.size()) * sizeof(*kv.second.data());
  return n;
}

/// Tokens [a, a + n) of x (B, N, E), a strided view.
template <class T>
TensorView<const T, 3> tokens(const Tensor<T, 3>& x, index_t a, index_t n) {
  const index_t len = x.shape(1), e = x.shape(2);
  return TensorView<const T, 3>(x.data() + a * e, {x.shape(0), n, e}, {len * e, e, 1});
}

/// A contiguous copy of tokens [a, a + n) of x (B, N, E).
template <class T>
Tensor<T, 3> slice_copy(const Tensor<T, 3>& x, index_t a, index_t n) {
  Tensor<T, 3> out({x.shape(0), n, x.shape(2)});
  const TensorView<const T, 3> t = tokens(x, a, n);
  for (index_t b = 0; b < x.shape(0); ++b)
    for (index_t i = 0; i < n; ++i)
      for (index_t e = 0; e < x.shape(2); ++e) out(b, i, e) = t(b, i, e);
  return out;
}

/// max |y - full[:, a : a + n, :]| and max |full[:, a : a + n, :]|.
template <class T>
std::pair<double, double> diff_max(const Tensor<T, 3>& y, const Tensor<T, 3>& full, index_t a) {
  double num = 0, den = 0;
  for (index_t b = 0; b < y.shape(0); ++b)
    for (index_t i = 0; i < y.shape(1); ++i)
      for (index_t e = 0; e < y.shape(2); ++e) {
        const double want = static_cast<double>(full(b, a + i, e));
        num = std::max(num, std::abs(static_cast<double>(y(b, i, e)) - want));
        den = std::max(den, std::abs(want));
      }
  return {num, den};
}

/// x w^T for x (rows, in) and w (out, in), row-major, in double.
std::vector<double> matmul_t(const double* x, index_t rows, index_t in, const double* w,
                             index_t out) {
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) {
      double acc = 0;
      for (index_t t = 0; t < in; ++t) acc += x[r * in + t] * w[o * in + t];
      y[r * out + o] = acc;
    }
  return y;
}

/// max |t|.
template <class T, std::size_t R>
double max_abs(const Tensor<T, R>& t) {
  double m = 0;
  for (index_t i = 0; i < t.size(); ++i)
    m = std::max(m, std::abs(static_cast<double>(t.data()[i])));
  return m;
}

/// A bfloat16 layer's bound against its float64 twin md on x (see the top):
/// y, md's output (B, N, E); dy, the bound of |y_bf16 - y| per element; dmap
/// (B, H, N), the bound of sum_j |W_bf16 - W| of each row of each map
/// (attention_maps). `slack` is the float computations' own error (absolute).
struct Bf16Bound {
  Tensor<double, 3> y, dy, dmap;
};

template <class Layer>
Bf16Bound bf16_bound(Layer& md, const Tensor<double, 3>& x, double slack) {
  constexpr bool v1 = std::is_same<Layer, MultiheadDiffAttnV1<double>>::value;
  const auto& cfg = md.config();
  const index_t B = x.shape(0), N = x.shape(1), E = cfg.embed_dim, H = cfg.num_heads;
  const index_t hkv = cfg.num_kv_heads, d = md.head_dim(), rows = B * N;
  const index_t kheads = v1 ? 2 * hkv : hkv, vw = v1 ? 2 * d : d, ow = H * vw;
  const double u = unit_roundoff<bfloat16>(), scale = 1 / std::sqrt(static_cast<double>(d));
  auto p = md.parameters();
  auto project = [&](const char* name, index_t heads, index_t width) {
    Tensor<double, 4> t({B, N, heads, width});
    const std::vector<double> y = matmul_t(x.data(), rows, E, p.at(name).data(), heads * width);
    std::copy(y.begin(), y.end(), t.data());
    return t;
  };
  Tensor<double, 4> q = project("q_proj.weight", 2 * H, d), k = project("k_proj.weight", kheads, d);
  const Tensor<double, 4> v = project("v_proj.weight", hkv, vw);
  if (cfg.rope) {
    diffattn::apply_rope<double>(q.view(), 0, cfg.rope_base);
    diffattn::apply_rope<double>(k.view(), 0, cfg.rope_base);
  }
  std::vector<double> logit;
  if constexpr (!v1) logit = matmul_t(x.data(), rows, E, p.at("lambda_proj.weight").data(), H);
  const double* wo = p.at(v1 ? "out_proj.weight" : "o_proj.weight").data();
  const Tensor<double, 4> maps = md.attention_maps(x);  // checks this reference's maps
  auto visible = [&](index_t i, index_t j) {
    return (!cfg.causal || j <= i) && (cfg.window_left < 0 || j >= i - cfg.window_left) &&
           (cfg.window_right < 0 || j <= i + cfg.window_right);
  };
  Bf16Bound out{md.forward(x), Tensor<double, 3>({B, N, E}), Tensor<double, 3>({B, H, N})};
  std::vector<double> ein(static_cast<std::size_t>(ow)), o(static_cast<std::size_t>(vw));
  std::vector<double> eo(static_cast<std::size_t>(vw));
  std::vector<double> amap[2] = {std::vector<double>(N), std::vector<double>(N)};
  double map_err = 0;
  for (index_t b = 0; b < B; ++b)
    for (index_t i = 0; i < N; ++i) {
      for (index_t h = 0; h < H; ++h) {
        const index_t g = h / (H / hkv);
        double lambda = 0, dlambda = 0;
        if constexpr (v1) {
          lambda = md.lambda_full();
        } else {
          const double l = logit[(b * N + i) * H + h];
          lambda = 1 / (1 + std::exp(-l));
          dlambda = u * std::abs(l) / 4;
        }
        double a[2];
        for (index_t m = 0; m < 2; ++m) {  // map m: its softmax row and a_m
          const index_t kh = v1 ? 2 * g + m : g;
          double mx = -INFINITY, sum = 0, ds = 0;
          for (index_t j = 0; j < N; ++j) {
            if (!visible(i, j)) continue;
            double s = 0, sa = 0;
            for (index_t t = 0; t < d; ++t) {
              s += q(b, i, 2 * h + m, t) * k(b, j, kh, t);
              sa += std::abs(q(b, i, 2 * h + m, t) * k(b, j, kh, t));
            }
            amap[m][j] = s * scale;
            mx = std::max(mx, s * scale);
            ds = std::max(ds, (2 * u + u * u) * sa * scale);
          }
          for (index_t j = 0; j < N; ++j)
            if (visible(i, j)) sum += std::exp(amap[m][j] - mx);
          for (index_t j = 0; j < N; ++j)
            amap[m][j] = visible(i, j) ? std::exp(amap[m][j] - mx) / sum : 0.0;
          a[m] = std::expm1(2 * ds);
        }
        double sw = 0;
        for (index_t j = 0; j < N; ++j) {
          map_err =
              std::max(map_err, std::abs(amap[0][j] - lambda * amap[1][j] - maps(b, h, i, j)));
          sw += a[0] * amap[0][j] + std::abs(lambda) * a[1] * amap[1][j] +
                dlambda * (1 + a[1]) * amap[1][j];
        }
        out.dmap(b, h, i) = sw;
        for (index_t c = 0; c < vw; ++c) {
          double oc = 0, pc = 0, qc = 0;  // o, sum |dw| |v|, sum |w| |v|
          for (index_t j = 0; j < N; ++j) {
            const double vj = std::abs(v(b, j, g, c));
            const double w = amap[0][j] - lambda * amap[1][j];
            oc += w * v(b, j, g, c);
            qc += std::abs(w) * vj;
            pc += (a[0] * amap[0][j] + std::abs(lambda) * a[1] * amap[1][j] +
                   dlambda * (1 + a[1]) * amap[1][j]) *
                  vj;
          }
          o[c] = oc;
          eo[c] = (pc + (2 * u + u * u) * (qc + pc)) * (1 + u) + u * std::abs(oc);
        }
        if constexpr (v1) {
          double ss = 0, se = 0;
          for (index_t c = 0; c < vw; ++c) {
            ss += o[c] * o[c];
            se += eo[c] * eo[c];
          }
          const double r = std::sqrt(ss / static_cast<double>(vw) + cfg.norm_eps);
          const double er = std::sqrt(se / static_cast<double>(vw));  // bounds |r'' - r|
          REQUIRE(r > er);
          const double sigma = 1 - md.lambda_init();
          for (index_t c = 0; c < vw; ++c) {
            const double w = cfg.norm_affine ? p.at("subln.weight")(c) : 1.0;
            const double dn =
                sigma * std::abs(w) * (eo[c] / (r - er) + std::abs(o[c]) * er / (r * (r - er)));
            ein[h * vw + c] = dn * (1 + u) + u * std::abs(sigma * w * o[c] / r);
          }
        } else {
          for (index_t c = 0; c < vw; ++c) ein[h * vw + c] = eo[c];
        }
      }
      for (index_t e = 0; e < E; ++e) {
        double acc = 0;
        for (index_t c = 0; c < ow; ++c) acc += ein[c] * std::abs(wo[e * ow + c]);
        out.dy(b, i, e) = (1 + u) * acc + u * std::abs(out.y(b, i, e)) + slack;
      }
    }
  CHECK(map_err < 1e-12);  // this reference's maps are the layer's
  return out;
}

/// max over y's elements of |y - bound.y[:, a : a + n]| / bound.dy[...]:
/// <= 1 when y is within the bound.
template <class S>
double bound_ratio(const Tensor<S, 3>& y, const Bf16Bound& bound, index_t a) {
  double worst = 0;
  for (index_t b = 0; b < y.shape(0); ++b)
    for (index_t i = 0; i < y.shape(1); ++i)
      for (index_t e = 0; e < y.shape(2); ++e)
        worst = std::max(worst, std::abs(static_cast<double>(y(b, i, e)) - bound.y(b, a + i, e)) /
                                    bound.dy(b, a + i, e));
  return worst;
}

/// The 16-bit layer made from a randomised float one against its float64
/// twin, on x of S (B, N, E); see the bounds at the top.
template <class S, template <class> class Layer, class Config>
double check_forward(const Config& cfg, index_t b, index_t n, std::uint64_t seed) {
  Layer<float> trained(cfg, seed);
  randomize_small(trained, seed + 1);
  Layer<S> m(trained);
  Layer<float> mf(m);
  Layer<double> md(m);
  const index_t e = cfg.embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({b, n, e}, seed + 2));
  const Tensor<S, 3> y = m.forward(x);
  const Tensor<float, 3> yf = mf.forward(cast<float>(x));
  const Tensor<double, 3> yd = md.forward(cast<double>(x));
  const double u = unit_roundoff<S>(), e_f = rel_error(yf, yd), err = rel_error(y, yd);
  INFO(type_name<S>() << " B=" << b << " N=" << n << " E=" << e << ": e_f = " << e_f
                      << ", error = " << err << " = " << err / u << " u");
  CHECK(e_f < kFloatLayerTol);
  double ratio = err / u;
  if constexpr (std::is_same<S, bfloat16>::value) {
    const Bf16Bound bound = bf16_bound(md, cast<double>(x), 2 * e_f * max_abs(yd));
    ratio = bound_ratio(y, bound, 0);
    INFO("largest |y - y64| / bound " << ratio);
    CHECK(ratio <= 1);
  } else {
    CHECK(bitwise_equal(y, cast<S>(yf)));
    CHECK(err <= u * (1 + e_f) + e_f);
  }
  CHECK(err > 0);  // y is rounded: not the float64 result
  // one thread or two: the same bits
  m.set_num_threads(1);
  const Tensor<S, 3> y1 = m.forward(x);
  m.set_num_threads(2);
  CHECK(bitwise_equal(y1, m.forward(x)));
  return ratio;
}

DiffAttnV1Config v1(index_t e, index_t h, index_t hkv) {
  DiffAttnV1Config c;
  c.embed_dim = e;
  c.num_heads = h;
  c.num_kv_heads = hkv;
  c.depth = 2;
  return c;
}

DiffAttnV2Config v2(index_t e, index_t h, index_t hkv, index_t hd = 0) {
  DiffAttnV2Config c;
  c.embed_dim = e;
  c.num_heads = h;
  c.num_kv_heads = hkv;
  c.head_dim = hd;
  return c;
}

template <class S>
void forward_cases() {
  constexpr bool is_bf16 = std::is_same<S, bfloat16>::value;
  double worst = 0;
  std::uint64_t seed = 91000;
  // V1: MHA with rope; GQA without rope and with a window; non-causal; a
  // head width of 10; 106 rows (the projections' packed path; fewer rows
  // take dot products).
  DiffAttnV1Config c = v1(32, 2, 2);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 13, seed += 10));
  c = v1(48, 4, 2);
  c.rope = false;
  c.window_left = 4;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 3, 7, seed += 10));
  c = v1(32, 2, 1);
  c.causal = false;
  c.norm_affine = false;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 11, seed += 10));
  c = v1(40, 2, 1);
  c.depth = 5;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 53, seed += 10));
  // V2: MHA with rope; GQA 4 / 2 with a window; head_dim 7 without rope,
  // non-causal; 106 rows.
  DiffAttnV2Config d = v2(24, 2, 2);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 2, 9, seed += 10));
  d = v2(32, 4, 2);
  d.window_left = 3;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 3, 17, seed += 10));
  d = v2(30, 3, 1, 7);
  d.rope = false;
  d.causal = false;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 1, 5, seed += 10));
  d = v2(24, 4, 1);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 2, 53, seed += 10));
  // half: the largest error in u, u (1 + e_f) + e_f with e_f < 1e-4: at most
  // 1.03 u; bfloat16: the largest ratio to the derived bound (each case
  // checked <= 1 above).
  INFO(type_name<S>() << ": largest error " << worst << (is_bf16 ? " of the bound" : " u"));
  CHECK(worst <= (is_bf16 ? 1.0 : 1.1));
}

/// Prefill then decoding of a 16-bit layer against its forward on the whole
/// sequence.
///
/// Bound. Both outputs are rounded once to S. Before that rounding they
/// differ only by the cache: each cached key and value is rounded once to S,
/// which moves the float output by at most 8 u max|y| (the first-order bound
/// of test_half.cpp for layers with default weights, inputs of sigma 0.5 and
/// d = 8..16), plus the float kernels' own 1e-5. Hence, a and b the float
/// outputs, |round(b) - round(a)| <= u |b| + |b - a| + u |a|, and relative to
/// max|y| >= (1 - u) max|a|:
///   (u (2 + 8 u + 1e-5) + 8 u + 1e-5) / (1 - u),  about 10 u.
/// A float cache (make_cache<float>) keeps the keys and values exact: the
/// float outputs differ by 1e-5 at most, (2 u + 1e-5 (1 + u)) / (1 - u).
/// And as for forward, each cached call is bitwise the float twin's with a
/// cache of the same type, rounded to S.
///
/// bfloat16: the cached forward rounds what the whole forward rounds (q, k
/// and v after rotary, the logits, the attention output, the norm's output,
/// y; the cache holds the rounded keys and values, exactly), the bf16 kernel
/// rounding the weights as well for chunks of 6 or more queries, so each
/// chunk's y is held to the derived bound of the forward (bf16_bound) against
/// the float64 twin on the whole sequence, element by element; so is the
/// forward over a float cache (make_cache<float>: the bfloat16 keys widened,
/// the float kernel on the queries widened), and over a half cache
/// (make_cache<half>: a bfloat16 key or value is a half exactly, but for
/// magnitudes below half's normal range, 2^-14, where half keeps it to within
/// 2^-25: far inside the bound's float terms).
template <template <class> class Layer, class S>
Layer<float> float_twin(const Layer<S>& m) {
  return Layer<float>(m);
}
template <template <class> class Layer, class S>
Layer<double> double_twin(const Layer<S>& m) {
  return Layer<double>(m);
}

template <class Layer>
double check_cached_bf16(Layer& m, const std::vector<index_t>& chunks, std::uint64_t seed) {
  using S = bfloat16;
  index_t total = 0;
  for (index_t c : chunks) total += c;
  const index_t b = 2, e = m.config().embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({b, total, e}, seed, 0.5));
  auto cache = m.make_cache(b, total + 3);
  static_assert(std::is_same<decltype(cache), diffattn::KVCache<S>>::value, "a cache of S");
  auto cache_f = m.template make_cache<float>(b, total + 3);
  auto cache_h = m.template make_cache<half>(b, total + 3);
  REQUIRE(cache.bytes() * 2 == cache_f.bytes());
  REQUIRE(cache.bytes() == cache_h.bytes());
  auto md = double_twin(m);
  const Tensor<double, 3> xd = cast<double>(x);
  const double e_f = rel_error(float_twin(m).forward(cast<float>(x)), md.forward(xd));
  CHECK(e_f < kFloatLayerTol);
  const Bf16Bound bound = bf16_bound(md, xd, 2 * e_f * max_abs(md.forward(xd)));
  double worst = 0;
  index_t a = 0;
  for (index_t c : chunks) {
    INFO("bfloat16 layer, chunk of " << c << " at " << a);
    const double r = bound_ratio(m.forward(tokens(x, a, c), cache), bound, a);
    const double rf = bound_ratio(m.forward(tokens(x, a, c), cache_f), bound, a);
    const double rh = bound_ratio(m.forward(tokens(x, a, c), cache_h), bound, a);
    INFO("ratio to the bound " << r << ", float cache " << rf << ", half cache " << rh);
    CHECK(r <= 1);
    CHECK(rf <= 1);
    CHECK(rh <= 1);
    worst = std::max({worst, r, rf, rh});
    a += c;
    CHECK(cache.size() == a);
    CHECK(cache_f.size() == a);
    CHECK(cache_h.size() == a);
  }
  CHECK(worst > 0);
  return worst;
}

template <class S, class Layer>
double check_cached(Layer& m, const std::vector<index_t>& chunks, std::uint64_t seed) {
  if constexpr (std::is_same<S, bfloat16>::value) return check_cached_bf16(m, chunks, seed);
  index_t total = 0;
  for (index_t c : chunks) total += c;
  const index_t b = 2, e = m.config().embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({b, total, e}, seed, 0.5));
  const Tensor<S, 3> full = m.forward(x);
  auto cache = m.make_cache(b, total + 3);
  static_assert(std::is_same<decltype(cache), diffattn::KVCache<S>>::value, "a cache of S");
  auto cache_f = m.template make_cache<float>(b, total + 3);
  REQUIRE(cache.bytes() * 2 == cache_f.bytes());
  auto mf = float_twin(m);
  auto twin_cache = mf.template make_cache<S>(b, total + 3);
  const Tensor<float, 3> xf = cast<float>(x);
  const double u = unit_roundoff<S>();
  const double tol = (u * (2 + 8 * u + 1e-5) + 8 * u + 1e-5) / (1 - u);
  const double tol_f = (2 * u + 1e-5 * (1 + u)) / (1 - u);
  double worst = 0;
  index_t a = 0;
  for (index_t c : chunks) {
    INFO(type_name<S>() << " layer, chunk of " << c << " at " << a);
    const Tensor<S, 3> y = m.forward(tokens(x, a, c), cache);
    CHECK(bitwise_equal(y, cast<S>(mf.forward(tokens(xf, a, c), twin_cache))));
    const auto dm = diff_max(y, full, a);
    worst = std::max(worst, dm.first / dm.second);
    CHECK(dm.first <= tol * dm.second);
    const auto df = diff_max(m.forward(tokens(x, a, c), cache_f), full, a);
    CHECK(df.first <= tol_f * df.second);
    a += c;
    CHECK(cache.size() == a);
  }
  INFO("largest relative difference " << worst / u << " u (tolerance " << tol / u << " u)");
  CHECK(worst > 0);
  return worst / u;
}

std::vector<index_t> prefill_then_decode(index_t prefill, index_t decode) {
  std::vector<index_t> c = {prefill};
  for (index_t i = 0; i < decode; ++i) c.push_back(1);
  return c;
}

/// The packed forward of a 16-bit layer against one forward per sequence.
/// Each is the float computation rounded once; the float values differ only
/// by the float kernels' order of sums (the packed batch may take the
/// projections' packed path where a short sequence takes dot products),
/// 1e-5 at most: (2 u + 1e-5 (1 + u)) / (1 - u) relative to max|y|. And the
/// packed forward is bitwise the float twin's packed forward, rounded.
/// bfloat16 (activations rounded): each sequence's rows of the packed y are
/// held to the derived bound (bf16_bound) of the float64 twin's forward on
/// that sequence alone.
template <class S, template <class> class Layer, class Config>
void check_packed(const Config& cfg, const std::vector<index_t>& lengths, std::uint64_t seed) {
  Layer<S> m(Layer<float>(cfg, seed));
  diffattn::PackedSequences seqs;
  seqs.cu_seqlens_q = {0};
  for (index_t l : lengths) seqs.cu_seqlens_q.push_back(seqs.cu_seqlens_q.back() + l);
  const index_t total = seqs.cu_seqlens_q.back(), e = cfg.embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({1, total, e}, seed + 1));
  const Tensor<S, 3> y = m.forward(x, seqs);
  if constexpr (std::is_same<S, bfloat16>::value) {
    Layer<double> md(m);
    Layer<float> mf(m);
    double worst = 0;
    for (std::size_t s = 0; s < lengths.size(); ++s) {
      const index_t a = seqs.cu_seqlens_q[s], n = lengths[s];
      if (n == 0) continue;
      INFO("bfloat16 sequence " << s << " of " << n << " tokens");
      const Tensor<double, 3> xs = cast<double>(slice_copy(x, a, n));
      const Tensor<double, 3> ys = md.forward(xs);
      const double e_f = rel_error(mf.forward(cast<float>(slice_copy(x, a, n))), ys);
      const Bf16Bound bound = bf16_bound(md, xs, 2 * e_f * max_abs(ys));
      Tensor<S, 3> rows({1, n, e});
      std::copy_n(y.data() + a * e, n * e, rows.data());
      const double r = bound_ratio(rows, bound, 0);
      INFO("ratio to the bound " << r);
      CHECK(r <= 1);
      worst = std::max(worst, r);
    }
    CHECK(worst > 0);
    return;
  }
  Layer<float> mf(m);
  CHECK(bitwise_equal(y, cast<S>(mf.forward(cast<float>(x), seqs))));
  const double u = unit_roundoff<S>(), tol = (2 * u + 1e-5 * (1 + u)) / (1 - u);
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    const index_t a = seqs.cu_seqlens_q[s], n = lengths[s];
    if (n == 0) continue;
    INFO(type_name<S>() << " sequence " << s << " of " << n << " tokens");
    const Tensor<S, 3> ys = m.forward(tokens(x, a, n));
    const auto dm = diff_max(ys, y, a);
    CHECK(dm.first <= tol * dm.second);
  }
}

std::string temp_path(const std::string& name) {
  return "diffattn_test_layers_half_" + name + ".safetensors";
}

/// A V1 layer's parameters in DiffLlama's layout (the inverse of the
/// documented permutation: native q row (2j + m, 2i + r) is DiffLlama row
/// (j + m heads/2, i + r d/2); the value of pair g is heads g and g + Hkv),
/// written as S tensors under `prefix`.
template <class S>
void write_diffllama(MultiheadDiffAttnV1<S>& m, const std::string& path,
                     const std::string& prefix) {
  namespace st = diffattn::safetensors;
  const index_t d = m.head_dim(), e = m.config().embed_dim, hkv = m.config().num_kv_heads;
  auto params = m.parameters();
  auto qk = [&](const std::string& name, index_t heads) {
    const S* w = params.at(name).data();
    std::vector<S> hf(static_cast<std::size_t>(heads * d * e));
    for (index_t j = 0; j < heads / 2; ++j)
      for (index_t mm = 0; mm < 2; ++mm)
        for (index_t i = 0; i < d / 2; ++i)
          for (index_t r = 0; r < 2; ++r)
            std::copy_n(w + ((2 * j + mm) * d + 2 * i + r) * e, e,
                        hf.begin() + ((j + mm * heads / 2) * d + i + r * d / 2) * e);
    return st::make_tensor<S>({heads * d, e}, hf.data());
  };
  std::map<std::string, st::TensorData> file;
  file[prefix + "q_proj.weight"] = qk("q_proj.weight", 2 * m.config().num_heads);
  file[prefix + "k_proj.weight"] = qk("k_proj.weight", 2 * hkv);
  const S* wv = params.at("v_proj.weight").data();
  std::vector<S> hv(static_cast<std::size_t>(2 * hkv * d * e));
  for (index_t g = 0; g < hkv; ++g)
    for (index_t mm = 0; mm < 2; ++mm)
      std::copy_n(wv + (g * 2 * d + mm * d) * e, d * e, hv.begin() + (g + mm * hkv) * d * e);
  file[prefix + "v_proj.weight"] = st::make_tensor<S>({2 * hkv * d, e}, hv.data());
  file[prefix + "o_proj.weight"] =
      st::make_tensor<S>({e, 2 * m.config().num_heads * d}, params.at("out_proj.weight").data());
  for (const char* n : {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"})
    file[prefix + n] = st::make_tensor<S>({d}, params.at(n).data());
  diffattn::write_safetensors(path, file);
}

template <class S>
void check_safetensors() {
  namespace st = diffattn::safetensors;
  const std::string path = temp_path(type_name<S>());
  const char* dtype = std::is_same<S, bfloat16>::value ? "BF16" : "F16";
  DiffAttnV1Config c = v1(32, 2, 1);
  MultiheadDiffAttnV1<float> trained(c, 5);
  randomize_small(trained, 6);
  MultiheadDiffAttnV1<S> a(trained), b(c, 7);
  REQUIRE(bits(a) != bits(b));

  // native layout: S's dtype written and read back bit for bit
  a.save_safetensors(path, "model.layers.2.self_attn.");
  {
    const st::Reader r(path);
    CHECK(r.tensors().size() == 9);
    for (auto& kv : a.parameters()) {
      INFO(kv.first);
      const st::TensorData t = r.read("model.layers.2.self_attn." + kv.first);
      CHECK(t.dtype == dtype);
      REQUIRE(t.bytes.size() == static_cast<std::size_t>(2 * kv.second.size()));
      // little-endian bytes of the parameter's own bits
      for (index_t i = 0; i < kv.second.size(); ++i) {
        std::uint16_t u16;
        std::memcpy(&u16, static_cast<const void*>(kv.second.data() + i), 2);
        CHECK(t.bytes[2 * i] + 256 * t.bytes[2 * i + 1] == u16);
      }
    }
  }
  b.load_safetensors(path, "model.layers.2.self_attn.");
  CHECK(bits(a) == bits(b));
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({2, 9, 32}, 8));
  CHECK(bitwise_equal(a.forward(x), b.forward(x)));

  // DiffLlama layout (subln.weight is ones there: the layer's default)
  MultiheadDiffAttnV1<S> native(c, 9), loaded(trained);
  write_diffllama(native, path, "model.layers.2.self_attn.");
  loaded.load_safetensors(path, "model.layers.2.self_attn.", diffattn::WeightLayout::diffllama);
  CHECK(bits(loaded) == bits(native));

  // F32 into the 16-bit layer: each value rounded to nearest even, once
  trained.save_safetensors(path);
  MultiheadDiffAttnV1<S> from_f32(c, 10);
  from_f32.load_safetensors(path);
  CHECK(bits(from_f32) == bits(a));
  auto pf = trained.parameters();
  index_t rounded = 0;
  for (auto& kv : from_f32.parameters())
    for (index_t i = 0; i < kv.second.size(); ++i) {
      const float want = pf.at(kv.first)(i);
      REQUIRE(std::memcmp(&kv.second(i), &static_cast<const S&>(S(want)), 2) == 0);
      rounded += static_cast<float>(kv.second(i)) != want;
    }
  CHECK(rounded > 1000);  // most of the 4096 + 72 values were not exact in S

  // V2: own dtype bit for bit, F32 rounded
  DiffAttnV2Config d = v2(24, 4, 2);
  MultiheadDiffAttnV2<float> t2(d, 11);
  MultiheadDiffAttnV2<S> a2(t2), b2(d, 12), c2(d, 13);
  a2.save_safetensors(path, "blk.");
  CHECK(st::Reader(path).info("blk.lambda_proj.weight").dtype == dtype);
  b2.load_safetensors(path, "blk.");
  CHECK(bits(a2) == bits(b2));
  t2.save_safetensors(path);
  c2.load_safetensors(path);
  CHECK(bits(c2) == bits(a2));
  std::remove(path.c_str());
}

}  // namespace

TEST_CASE("16-bit layers against the float64 layer on the same rounded values", "[layers][half]") {
  forward_cases<bfloat16>();
  forward_cases<half>();
}

TEST_CASE("16-bit layers decode against a cache of their type", "[layers][half][kvcache]") {
  std::uint64_t seed = 92000;
  double worst = 0;
  for (index_t hkv : {2, 1}) {
    DiffAttnV1Config c1 = v1(32, 2, hkv);
    c1.depth = 3;
    MultiheadDiffAttnV1<bfloat16> m1(c1, seed++);
    worst = std::max(worst, check_cached<bfloat16>(m1, prefill_then_decode(13, 12), seed++));
    MultiheadDiffAttnV1<half> h1(c1, seed++);
    worst = std::max(worst, check_cached<half>(h1, {1, 1, 70, 5, 1, 2}, seed++));
    MultiheadDiffAttnV2<bfloat16> m2(v2(24, 2, hkv), seed++);
    worst = std::max(worst, check_cached<bfloat16>(m2, prefill_then_decode(9, 15), seed++));
    // bfloat16 prefill chunks of 6 and more after cached tokens (the bf16
    // kernel over the cache)
    worst = std::max(worst, check_cached<bfloat16>(m1, {7, 1, 9, 1, 6}, seed++));
    worst = std::max(worst, check_cached<bfloat16>(m2, {6, 2, 11, 1}, seed++));
    MultiheadDiffAttnV2<half> h2(v2(24, 2, hkv), seed++);
    worst = std::max(worst, check_cached<half>(h2, {64, 3, 1}, seed++));
  }
  DiffAttnV1Config cw = v1(32, 2, 1);
  cw.window_left = 3;
  MultiheadDiffAttnV1<bfloat16> mw(cw, seed++);
  worst = std::max(worst, check_cached<bfloat16>(mw, prefill_then_decode(7, 30), seed++));
  INFO("largest difference " << worst << " (u for half, the ratio to the bound for bfloat16)");
  CHECK(worst < 3);  // half: measured near 1 u, the bound is about 10 u; bfloat16: <= 1
}

TEST_CASE("16-bit layers: a packed batch equals one forward per sequence",
          "[layers][half][varlen]") {
  DiffAttnV1Config c1 = v1(32, 2, 1);
  check_packed<bfloat16, MultiheadDiffAttnV1>(c1, {5, 1, 0, 9}, 93000);
  check_packed<half, MultiheadDiffAttnV1>(c1, {40, 1, 59}, 93010);  // 100 rows: packed path
  DiffAttnV2Config c2 = v2(24, 4, 2);
  c2.window_left = 2;
  check_packed<bfloat16, MultiheadDiffAttnV2>(c2, {40, 1, 59}, 93020);
  check_packed<half, MultiheadDiffAttnV2>(c2, {3, 8}, 93030);
}

TEST_CASE("16-bit layers save and load their own dtype bit for bit, round F32",
          "[layers][half][safetensors]") {
  check_safetensors<bfloat16>();
  check_safetensors<half>();
}

TEST_CASE("16-bit layers convert to and from float, and hold half the bytes", "[layers][half]") {
  // E = 64, 4 DIFF heads on 2 kv pairs: q and out 64 x 64, k and v 32 x 64
  const DiffAttnV1Config c = v1(64, 4, 2);
  MultiheadDiffAttnV1<float> f(c, 21);
  MultiheadDiffAttnV1<bfloat16> b(f), seeded(c, 21);
  MultiheadDiffAttnV1<half> h(f);
  // the seed draws the float layer's values, rounded
  CHECK(bits(b) == bits(seeded));
  // widening is exact, and rounding it again gives the same bits
  MultiheadDiffAttnV1<double> wide(b);
  CHECK(bits(MultiheadDiffAttnV1<bfloat16>(wide)) == bits(b));
  CHECK(bits(MultiheadDiffAttnV1<bfloat16>(MultiheadDiffAttnV1<float>(b))) == bits(b));
  auto pb = b.parameters();
  for (auto& kv : wide.parameters())
    for (index_t i = 0; i < kv.second.size(); ++i)
      REQUIRE(kv.second(i) == static_cast<double>(static_cast<float>(pb.at(kv.first)(i))));
  CHECK(b.num_parameters() == f.num_parameters());
  CHECK(b.num_parameters() == 4 * 64 * 64 - 2 * 32 * 64 + 4 * 8 + 16);
  CHECK(parameter_bytes(b) * 2 == parameter_bytes(f));
  CHECK(parameter_bytes(h) * 2 == parameter_bytes(f));
  CHECK(parameter_bytes(b) == static_cast<std::size_t>(2 * b.num_parameters()));
  CHECK(b.lambda_full() == Approx(static_cast<double>(f.lambda_full())).epsilon(0.05));
  static_assert(std::is_same<decltype(b.lambda_full()), float>::value, "lambda in float");
  static_assert(std::is_same<MultiheadDiffAttnV1<half>::compute_type, float>::value, "");
  static_assert(std::is_same<MultiheadDiffAttnV1<double>::compute_type, double>::value, "");

  const DiffAttnV2Config c2 = v2(64, 4, 2);
  MultiheadDiffAttnV2<float> f2(c2, 22);
  MultiheadDiffAttnV2<bfloat16> b2(f2), seeded2(c2, 22);
  CHECK(bits(b2) == bits(seeded2));
  CHECK(parameter_bytes(b2) * 2 == parameter_bytes(f2));
  CHECK(parameter_bytes(MultiheadDiffAttnV2<half>(f2)) * 2 == parameter_bytes(f2));
  // the attention maps come in float
  const Tensor<bfloat16, 3> x = cast<bfloat16>(random_tensor<float, 3>({1, 6, 64}, 23));
  const Tensor<float, 4> w = b2.attention_maps(x);
  CHECK(w.shape() == std::array<index_t, 4>{1, 4, 6, 6});
  // From the layer's bfloat16 q, k and logits: each row within the derived
  // bound of the maps (bf16_bound's dmap: the roundings of q, k and the
  // logits) of the float64 twin's, plus twice the float twin's own error on
  // that row.
  const Tensor<float, 4> wf = MultiheadDiffAttnV2<float>(b2).attention_maps(cast<float>(x));
  MultiheadDiffAttnV2<double> d2(b2);
  const Tensor<double, 3> xd = cast<double>(x);
  const Tensor<double, 4> wd = d2.attention_maps(xd);
  const Bf16Bound bound = bf16_bound(d2, xd, 0);
  double worst = 0;
  for (index_t hi = 0; hi < 4; ++hi)
    for (index_t i = 0; i < 6; ++i) {
      double dw = 0, df = 0;
      for (index_t j = 0; j < 6; ++j) {
        dw += std::abs(w(0, hi, i, j) - wd(0, hi, i, j));
        df += std::abs(wf(0, hi, i, j) - wd(0, hi, i, j));
      }
      worst = std::max(worst, dw / (bound.dmap(0, hi, i) + 2 * df));
    }
  INFO("largest row difference / bound " << worst);
  CHECK(worst <= 1);
  CHECK(worst > 0);
}

TEST_CASE("16-bit layers: bad input names the argument and the shapes", "[layers][half][errors]") {
  MultiheadDiffAttnV1<bfloat16> m(v1(32, 2, 1), 1);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 31}));
      },
      {"MultiheadDiffAttnV1::forward", "x has shape (2, 5, 31)", "(B, N, 32)"});
  diffattn::PackedSequences seqs;
  seqs.cu_seqlens_q = {0, 3, 5};
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 32}), seqs);
      },
      {"MultiheadDiffAttnV1::forward", "(1, T, E)", "(2, 5, 32)"});
  auto cache = m.make_cache(2, 4);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 32}), cache);
      },
      {"MultiheadDiffAttnV1::forward", "cannot append 5 tokens", "capacity 4"});
  CHECK(cache.size() == 0);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({3, 1, 32}), cache);
      },
      {"x has shape (3, 1, 32)", "batch 2"});
  MultiheadDiffAttnV2<half> m2(v2(24, 2, 2), 1);
  auto other = MultiheadDiffAttnV2<half>(v2(24, 2, 1), 1).make_cache(1, 8);
  test::require_error(
      [&] {
        m2.forward(Tensor<half, 3>({1, 1, 24}), other);
      },
      {"MultiheadDiffAttnV2::forward", "make_cache"});

  // a BF16 file of the wrong shape changes nothing
  namespace st = diffattn::safetensors;
  const std::string path = temp_path("errors");
  MultiheadDiffAttnV1<bfloat16> small(v1(16, 2, 1), 2);
  small.save_safetensors(path);
  const auto before = bits(m);
  test::require_error(
      [&] { m.load_safetensors(path); },
      {"MultiheadDiffAttnV1::load_safetensors", "'q_proj.weight' has shape (16, 16)",
       "expected (32, 32)", "no parameter was changed"});
  CHECK(bits(m) == before);
  std::remove(path.c_str());
}
