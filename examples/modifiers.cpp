// Score modifiers (issue 37), each checked against a float64 computation
// that materialises the scores, the cap, the bias, the mask and the sink:
//   1. a soft-capped V2 layer (DiffAttnV2Config::softcap = 5), recomputed by
//      hand from its own projection weights;
//   2. ALiBi without rotary: a V2 layer with alibi = true and rope = false
//      (the standard slopes over its 2H query heads);
//   3. sinks that absorb the weight of rows that see no key (N > M, causal);
//   4. a document mask over a packed row written as a functor, equal to the
//      packed varlen call on the same documents.
// The program exits with 1 when a check fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/diffattn.hpp>

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;

namespace {

template <std::size_t R>
Tensor<double, R> randn(std::array<index_t, R> shape, std::uint64_t seed) {
  Tensor<double, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = rng.normal();
  return t;
}

// One softmax map, materialised: the weights of query i (of N) over M keys
// from every score s = q.k / sqrt(d), soft-capped, minus the ALiBi bias, with
// masked keys at -inf and the sink as one more logit that takes weight and
// gives no output.
struct Map {
  double cap = 0, slope = 0, sink = -INFINITY;
  bool causal = true;
  const std::vector<index_t>* doc = nullptr;  // a document mask (N = M)

  std::vector<double> weights(const double* q, const double* k0, index_t kstride, index_t i,
                              index_t N, index_t M, index_t d) const {
    std::vector<double> l(static_cast<std::size_t>(M + 1), -INFINITY);
    for (index_t j = 0; j < M; ++j) {
      if (causal && j > i + M - N) continue;
      if (doc && (*doc)[static_cast<std::size_t>(i)] != (*doc)[static_cast<std::size_t>(j)])
        continue;
      double s = 0;
      for (index_t t = 0; t < d; ++t) s += q[t] * k0[j * kstride + t];
      s /= std::sqrt(static_cast<double>(d));
      if (cap > 0) s = cap * std::tanh(s / cap);
      s -= slope * std::abs(static_cast<double>(i + M - N - j));
      l[static_cast<std::size_t>(j)] = s;
    }
    l[static_cast<std::size_t>(M)] = sink;
    double mx = -INFINITY, sum = 0;
    for (double x : l) mx = std::max(mx, x);
    for (double x : l) sum += mx == -INFINITY ? 0 : std::exp(x - mx);
    std::vector<double> w(static_cast<std::size_t>(M), 0.0);
    for (index_t j = 0; j < M; ++j)
      if (sum > 0)
        w[static_cast<std::size_t>(j)] = std::exp(l[static_cast<std::size_t>(j)] - mx) / sum;
    return w;
  }
};

// max |out - materialised| for plain attention, head h reading kv head h:
// q (1, N, H, d), k, v (1, M, H, d), out (1, N, H, d).
double check_plain(const Map& map, const Tensor<double, 4>& q, const Tensor<double, 4>& k,
                   const Tensor<double, 4>& v, const Tensor<double, 4>& out, index_t h) {
  const index_t N = q.shape(1), M = k.shape(1), d = q.shape(3);
  double err = 0;
  for (index_t i = 0; i < N; ++i) {
    const auto w = map.weights(&q(0, i, h, 0), &k(0, 0, h, 0), k.shape(2) * k.shape(3), i, N, M, d);
    for (index_t t = 0; t < d; ++t) {
      double o = 0;
      for (index_t j = 0; j < M; ++j) o += w[static_cast<std::size_t>(j)] * v(0, j, h, t);
      err = std::max(err, std::abs(o - out(0, i, h, t)));
    }
  }
  return err;
}

// x (N, E) W^T for a weight W (rows, E) stored row-major.
std::vector<double> project(const Tensor<double, 3>& x, const TensorView<double, 1>& w,
                            index_t rows) {
  const index_t N = x.shape(1), E = x.shape(2);
  std::vector<double> y(static_cast<std::size_t>(N * rows), 0.0);
  for (index_t i = 0; i < N; ++i)
    for (index_t r = 0; r < rows; ++r) {
      double s = 0;
      for (index_t e = 0; e < E; ++e) s += x(0, i, e) * w(r * E + e);
      y[static_cast<std::size_t>(i * rows + r)] = s;
    }
  return y;
}

// A V2 layer (rope off) recomputed from its weights: q = x Wq^T (N, 2H, hd),
// k = x Wk^T, v = x Wv^T (N, Hkv, hd), lambda = sigmoid(x Wlambda^T) (N, H),
// a_h = (A_2h - lambda_h A_2h+1) v_g, y = a Wo^T. `slopes` (2H) or empty.
// Returns max |y - layer output|.
double check_v2_layer(diffattn::MultiheadDiffAttnV2<double>& layer, const Tensor<double, 3>& x,
                      const Tensor<double, 3>& y, double cap, const std::vector<float>& slopes) {
  const diffattn::DiffAttnV2Config& c = layer.config();
  const index_t N = x.shape(1), E = c.embed_dim, H = c.num_heads, Hkv = c.num_kv_heads,
                hd = c.head_dim;
  auto params = layer.parameters();
  const auto q = project(x, params.at("q_proj.weight"), 2 * H * hd);
  const auto k = project(x, params.at("k_proj.weight"), Hkv * hd);
  const auto v = project(x, params.at("v_proj.weight"), Hkv * hd);
  const auto logit = project(x, params.at("lambda_proj.weight"), H);
  std::vector<double> a(static_cast<std::size_t>(N * H * hd), 0.0);
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < N; ++i) {
      const double lambda = 1 / (1 + std::exp(-logit[static_cast<std::size_t>(i * H + h)]));
      for (int m = 0; m < 2; ++m) {
        const index_t qh = 2 * h + m, g = qh / (2 * H / Hkv);
        Map map;
        map.cap = cap;
        if (!slopes.empty()) map.slope = slopes[static_cast<std::size_t>(qh)];
        const auto w = map.weights(&q[static_cast<std::size_t>((i * 2 * H + qh) * hd)],
                                   &k[static_cast<std::size_t>(g * hd)], Hkv * hd, i, N, N, hd);
        const double coef = m == 0 ? 1.0 : -lambda;
        for (index_t j = 0; j < N; ++j)
          for (index_t t = 0; t < hd; ++t)
            a[static_cast<std::size_t>((i * H + h) * hd + t)] +=
                coef * w[static_cast<std::size_t>(j)] *
                v[static_cast<std::size_t>((j * Hkv + g) * hd + t)];
      }
    }
  const TensorView<double, 1> wo = params.at("o_proj.weight");  // (E, H hd)
  double err = 0;
  for (index_t i = 0; i < N; ++i)
    for (index_t e = 0; e < E; ++e) {
      double s = 0;
      for (index_t r = 0; r < H * hd; ++r)
        s += a[static_cast<std::size_t>(i * H * hd + r)] * wo(e * H * hd + r);
      err = std::max(err, std::abs(s - y(0, i, e)));
    }
  return err;
}

// A document mask over a packed row: token t belongs to document doc[t]
// (non-decreasing). visible is all a mask needs; visible_block lets the
// kernel skip or take whole chunks of keys at once (0 none, 1 some, 2 all).
struct Documents {
  const index_t* doc;
  bool visible(index_t, index_t, index_t i, index_t j) const { return doc[i] == doc[j]; }
  int visible_block(index_t, index_t, index_t i0, index_t i1, index_t j0, index_t j1) const {
    if (doc[i1 - 1] < doc[j0] || doc[j1 - 1] < doc[i0]) return 0;
    return doc[i0] == doc[i1 - 1] && doc[j0] == doc[j1 - 1] && doc[i0] == doc[j0] ? 2 : 1;
  }
};

}  // namespace

int main() {
  bool ok = true;
  auto report = [&](const char* what, double err) {
    std::printf("%-56s max |error| vs float64 = %.2e\n", what, err);
    ok = ok && err < 1e-12;
  };

  // 1. A soft-capped V2 layer (Gemma 2's cap), rotary off so that the
  //    materialised computation stays short.
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = 32;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  cfg.causal = true;
  cfg.rope = false;
  cfg.softcap = 5.0f;
  diffattn::MultiheadDiffAttnV2<double> capped(cfg, 7);
  const auto x = randn<3>({1, 24, 32}, 1);
  report("1. V2 layer, softcap 5", check_v2_layer(capped, x, capped.forward(x), 5.0, {}));

  // 2. ALiBi without rotary: the layer's standard slopes over its 2H = 4
  //    query heads, each map of a DIFF head with its own slope.
  cfg.softcap = 0;
  cfg.alibi = true;
  diffattn::MultiheadDiffAttnV2<double> alibi(cfg, 8);
  report("2. V2 layer, ALiBi (standard slopes), no rotary",
         check_v2_layer(alibi, x, alibi.forward(x), 0.0, diffattn::standard_alibi_slopes(4)));

  // 3. Sinks: 40 queries against 25 keys, causal: rows 0-14 see no key, so
  //    their sink takes all the weight: zero output and lse = the sink.
  const index_t N = 40, d = 16;
  const auto q = randn<4>({1, N, 4, d}, 2), v = randn<4>({1, N, 4, d}, 3);
  const auto k3 = randn<4>({1, 25, 4, d}, 4), v3 = randn<4>({1, 25, 4, d}, 5);
  const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};
  Tensor<double, 4> out({1, N, 4, d});
  Tensor<double, 3> lse({1, 4, N});
  diffattn::AttentionOptions o;
  o.causal = true;
  o.sinks = TensorView<const float, 1>(sinks.data(), {4});
  diffattn::attention<double>(q, k3, v3, out, lse, o);
  double e3 = 0;
  for (index_t h = 0; h < 4; ++h) {
    Map map;
    map.sink = sinks[static_cast<std::size_t>(h)];
    e3 = std::max(e3, check_plain(map, q, k3, v3, out, h));
  }
  report("3. sinks (rows 0-14 see no key: zeros)", e3);
  std::printf("   lse of row 0, head 2 = %.3f = sink_2\n", lse(0, 2, 0));
  ok = ok && lse(0, 2, 0) == 2.0;

  // 4. A document mask over a packed row, as a functor, against the packed call.
  const std::vector<index_t> lens = {9, 14, 17};
  std::vector<index_t> doc;
  for (std::size_t s = 0; s < lens.size(); ++s)
    doc.insert(doc.end(), static_cast<std::size_t>(lens[s]), static_cast<index_t>(s));
  o = {};
  o.causal = true;
  o.softcap = 5.0f;
  diffattn::attention<double>(q, q, v, out, Tensor<double, 3>({1, 4, N}), o, Documents{doc.data()});
  double e4 = 0;
  for (index_t h = 0; h < 4; ++h) {
    Map map;  // causal over the row is causal within each document (N = M)
    map.cap = 5;
    map.doc = &doc;
    e4 = std::max(e4, check_plain(map, q, q, v, out, h));
  }
  report("4. document mask functor (3 documents, 40 tokens)", e4);
  auto d3 = [](const Tensor<double, 4>& t) {
    return TensorView<const double, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
  };
  Tensor<double, 4> packed({1, N, 4, d});
  diffattn::attention_varlen<double>(d3(q), d3(q), d3(v),
                                     TensorView<double, 3>(packed.data(), {N, 4, d}), {},
                                     diffattn::PackedSequences::from_lengths(lens), o);
  double e4p = 0;
  for (index_t i = 0; i < out.size(); ++i)
    e4p = std::max(e4p, std::abs(out.data()[i] - packed.data()[i]));
  report("   ... against attention_varlen on the documents", e4p);

  std::printf(ok ? "all checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
