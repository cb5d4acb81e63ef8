// Attention over KV caches (kvcache_attention.hpp) and per-map states
// (diff_states.hpp): per-sequence key lengths against the float64 reference
// on each sequence's slice, paged against contiguous caches (bitwise), GQA
// ratios, windows, prefill chunks, threads, split-KV on and off, bad input.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/diff_states.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/reference.hpp>
#include <diffattn/states.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::KVCacheBatch;
using diffattn::Tensor;
using diffattn::TensorView;
using test::cast;
using test::random_tensor;
using test::rel_error;

namespace {

enum class Kind { plain, v1, v2 };

struct Case {
  Kind kind;
  index_t n, H, Hkv, d, capacity;  // H: DIFF heads (v1, v2) or query heads (plain)
  std::vector<index_t> seqlens;
  bool causal = true;
  index_t window_left = -1;
  index_t plain_dv_extra = 3;  // plain attention: value width d + this
};

const char* name(Kind k) { return k == Kind::v1 ? "v1" : k == Kind::v2 ? "v2" : "plain"; }

/// Head counts and widths of q, k, v, out and lse for a case.
struct Dims {
  index_t qh, kh, vh, dv, oh;
};
Dims dims(const Case& c) {
  switch (c.kind) {
    case Kind::v1:
      return {2 * c.H, 2 * c.Hkv, c.Hkv, 2 * c.d, c.H};
    case Kind::v2:
      return {2 * c.H, c.Hkv, c.Hkv, c.d, c.H};
    default:
      return {c.H, c.Hkv, c.Hkv, c.d + c.plain_dv_extra, c.H};
  }
}

/// Batch entry b, rows [0, len) of a (B, L, H, D) tensor, as a (1, len, H, D) view.
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

/// The inputs of one case in T.
template <class T>
struct Inputs {
  Tensor<T, 4> q, k, v;
  Tensor<T, 3> logit;  // v2 (B, n, H)
  T lambda = T(0.7);
  Tensor<index_t, 1> seqlens;
};

template <class T>
Inputs<T> make_inputs(const Case& c, std::uint64_t seed) {
  const Dims dm = dims(c);
  const index_t B = static_cast<index_t>(c.seqlens.size());
  Inputs<T> in;
  in.q = cast<T>(random_tensor<float, 4>({B, c.n, dm.qh, c.d}, seed));
  in.k = cast<T>(random_tensor<float, 4>({B, c.capacity, dm.kh, c.d}, seed + 1));
  in.v = cast<T>(random_tensor<float, 4>({B, c.capacity, dm.vh, dm.dv}, seed + 2));
  in.logit = cast<T>(random_tensor<float, 3>({B, c.n, c.H}, seed + 3, 2.0));
  in.seqlens = Tensor<index_t, 1>({B});
  for (index_t b = 0; b < B; ++b) in.seqlens.data()[b] = c.seqlens[static_cast<std::size_t>(b)];
  return in;
}

AttentionOptions options_of(const Case& c, int threads = 0) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.num_threads = threads;
  return o;
}

/// The kvcache kernel of the case's kind.
template <class T>
void run_kvcache(const Case& c, const Inputs<T>& in, TensorView<const T, 4> k,
                 TensorView<const T, 4> v, const KVCacheBatch& cache, Tensor<T, 4>& out,
                 Tensor<T, 3>& lse, const AttentionOptions& o) {
  switch (c.kind) {
    case Kind::v1:
      diffattn::diff_attention_v1_kvcache<T>(in.q, k, v, in.lambda, out, lse, cache, o);
      break;
    case Kind::v2:
      diffattn::diff_attention_v2_kvcache<T>(in.q, k, v, in.logit, out, lse, cache, o);
      break;
    default:
      diffattn::attention_kvcache<T>(in.q, k, v, out, lse, cache, o);
  }
}

/// Each sequence on its own, through `Reference` (true) or the fused kernel.
template <class T, bool Reference>
void run_separately(const Case& c, const Inputs<T>& in, Tensor<T, 4>& out, Tensor<T, 3>& lse,
                    const AttentionOptions& o) {
  for (index_t b = 0; b < in.q.shape(0); ++b) {
    const index_t m = in.seqlens.data()[b];
    const TensorView<const T, 4> q = entry(in.q, b, c.n), k = entry(in.k, b, m),
                                 v = entry(in.v, b, m);
    const TensorView<T, 4> ob = entry(out, b, c.n);
    const TensorView<T, 3> lb = entry(lse, b);
    const TensorView<const T, 3> logit = entry(in.logit, b);
    switch (c.kind) {
      case Kind::v1:
        if (Reference)
          diffattn::reference::diff_attention_v1<T>(q, k, v, in.lambda, ob, lb, o);
        else
          diffattn::diff_attention_v1<T>(q, k, v, in.lambda, ob, lb, o);
        break;
      case Kind::v2:
        if (Reference)
          diffattn::reference::diff_attention_v2<T>(q, k, v, logit, ob, lb, o);
        else
          diffattn::diff_attention_v2<T>(q, k, v, logit, ob, lb, o);
        break;
      default:
        if (Reference)
          diffattn::reference::attention<T>(q, k, v, ob, lb, o);
        else
          diffattn::attention<T>(q, k, v, ob, lb, o);
    }
  }
}

/// A paged copy of contiguous caches: blocks of block_size rows, handed out
/// in a scrambled order from a pool with spare blocks.
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
             Tensor<T, 4>({blocks, bs, v.shape(2), v.shape(3)}), Tensor<index_t, 2>({B, per + 2})};
  std::vector<index_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = 0; i < ids.size(); ++i) std::swap(ids[i], ids[(i * 7919 + 13) % ids.size()]);
  std::fill(p.k.data(), p.k.data() + p.k.size(), std::numeric_limits<T>::quiet_NaN());
  std::fill(p.v.data(), p.v.data() + p.v.size(), std::numeric_limits<T>::quiet_NaN());
  std::size_t next = 0;
  for (index_t b = 0; b < B; ++b) {
    for (index_t blk = 0; blk < per + 2; ++blk)
      p.table(b, blk) = blk < per ? ids[next++] : index_t(-7);  // unused entries: garbage
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

/// Checks one case: float and double against the float64 reference per
/// sequence, paged against contiguous, threads and split-KV.
void check_case(const Case& c, std::uint64_t seed) {
  const Dims dm = dims(c);
  const index_t B = static_cast<index_t>(c.seqlens.size());
  INFO(name(c.kind) << " n=" << c.n << " H=" << c.H << " Hkv=" << c.Hkv << " d=" << c.d << " cap="
                    << c.capacity << " causal=" << c.causal << " window_left=" << c.window_left);
  const Inputs<float> xf = make_inputs<float>(c, seed);
  const Inputs<double> xd = make_inputs<double>(c, seed);
  const std::array<index_t, 4> os = {B, c.n, dm.oh, dm.dv};
  const std::array<index_t, 3> ls = {B, dm.qh, c.n};
  Tensor<double, 4> ref(os), got_d(os);
  Tensor<double, 3> lref(ls), lgot_d(ls);
  Tensor<float, 4> naive_f(os), got_f(os);
  Tensor<float, 3> lnaive_f(ls), lgot_f(ls);
  const AttentionOptions o = options_of(c);
  run_separately<double, true>(c, xd, ref, lref, o);
  run_separately<float, true>(c, xf, naive_f, lnaive_f, o);
  KVCacheBatch cache_d, cache_f;
  cache_d.cache_seqlens = xd.seqlens;
  cache_f.cache_seqlens = xf.seqlens;
  run_kvcache<double>(c, xd, xd.k, xd.v, cache_d, got_d, lgot_d, o);
  run_kvcache<float>(c, xf, xf.k, xf.v, cache_f, got_f, lgot_f, o);
  REQUIRE(rel_error(got_d, ref) < 1e-12);
  const double naive_err = rel_error(naive_f, ref), fused_err = rel_error(got_f, ref);
  INFO("float errors: fused " << fused_err << ", naive " << naive_err);
  REQUIRE(fused_err <= std::max(2 * naive_err, 2e-5));
  for (index_t i = 0; i < lref.size(); ++i) {
    const double want = lref.data()[i];
    if (std::isinf(want))
      REQUIRE(lgot_d.data()[i] == want);
    else
      REQUIRE(std::abs(lgot_d.data()[i] - want) <= 1e-12 * (1 + std::abs(want)));
  }

  // Separate fused calls on each sequence's slice agree to rounding.
  Tensor<double, 4> sep(os);
  Tensor<double, 3> lsep(ls);
  run_separately<double, false>(c, xd, sep, lsep, o);
  REQUIRE(rel_error(got_d, sep) < 1e-12);

  // Paged caches: bitwise the contiguous result, for several block sizes.
  for (index_t bs : {index_t(1), index_t(3), index_t(16)}) {
    INFO("block_size " << bs);
    const Paged<double> pd = make_paged(xd.k, xd.v, bs);
    KVCacheBatch paged = cache_d;
    paged.block_table = pd.table;
    Tensor<double, 4> out_p(os);
    Tensor<double, 3> lse_p(ls);
    run_kvcache<double>(c, xd, pd.k, pd.v, paged, out_p, lse_p, o);
    REQUIRE(test::bitwise_equal(out_p, got_d));
    REQUIRE(test::bitwise_equal(lse_p, lgot_d));
    const Paged<float> pf = make_paged(xf.k, xf.v, bs);
    KVCacheBatch paged_f = cache_f;
    paged_f.block_table = pf.table;
    Tensor<float, 4> out_pf(os);
    Tensor<float, 3> lse_pf(ls);
    run_kvcache<float>(c, xf, pf.k, pf.v, paged_f, out_pf, lse_pf, o);
    REQUIRE(test::bitwise_equal(out_pf, got_f));
  }

  // Threads 1 and 2 bitwise; split-KV in small chunks (and off) to rounding.
  for (index_t split : {index_t(0), index_t(5), index_t(1) << 40}) {
    INFO("split_keys " << split);
    KVCacheBatch cs = cache_f;
    cs.split_keys = split;
    Tensor<float, 4> o1(os), o2(os);
    Tensor<float, 3> l1(ls), l2(ls);
    run_kvcache<float>(c, xf, xf.k, xf.v, cs, o1, l1, options_of(c, 1));
    run_kvcache<float>(c, xf, xf.k, xf.v, cs, o2, l2, options_of(c, 2));
    REQUIRE(test::bitwise_equal(o1, o2));
    REQUIRE(test::bitwise_equal(l1, l2));
    REQUIRE(rel_error(o1, ref) <= std::max(2 * naive_err, 2e-5));
    KVCacheBatch csd = cache_d;
    csd.split_keys = split;
    Tensor<double, 4> od(os);
    Tensor<double, 3> ld(ls);
    run_kvcache<double>(c, xd, xd.k, xd.v, csd, od, ld, options_of(c, 2));
    REQUIRE(rel_error(od, ref) < 1e-12);
  }
}

}  // namespace

TEST_CASE("decoding with per-sequence key lengths", "[decode]") {
  std::uint64_t seed = 31000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    for (index_t ratio : {1, 2, 4}) {                // query heads per kv head
      if (kind == Kind::v2 && ratio == 1) continue;  // a V2 pair shares its kv head
      const index_t Hkv = 2, H = kind == Kind::v2 ? Hkv * ratio / 2 : Hkv * ratio;
      for (bool causal : {true, false})
        check_case(Case{kind, 1, H, Hkv, 8, 37, {37, 1, 0, 20, 13}, causal}, seed += 10);
    }
  }
}

TEST_CASE("prefill chunks against a cache, windows", "[decode]") {
  std::uint64_t seed = 32000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    const index_t H = kind == Kind::v2 ? 2 : 4;
    for (index_t n : {2, 5, 7, 13}) {  // decoding path (< 6) and tiled path
      check_case(Case{kind, n, H, 2, 8, 50, {50, 13, 0, 29}, true}, seed += 10);
      check_case(Case{kind, n, H, 2, 8, 50, {50, 13, 0, 29}, true, 6}, seed += 10);
      check_case(Case{kind, n, H, 2, 8, 50, {50, 13, 0, 29}, false, 4}, seed += 10);
    }
  }
}

TEST_CASE("decoding with head widths that are not whole packets", "[decode]") {
  // Scores are packets of partial sums over the whole packets of d (4, 8 or
  // 16 floats by instruction set) plus the remaining features one by one;
  // keys come in blocks of one packet, the last one partial.
  std::uint64_t seed = 32500;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t d : {3, 16, 21, 40})
      for (index_t n : {1, 3})
        check_case(Case{kind, n, kind == Kind::v2 ? 2 : 4, 1, d, 45, {45, 17, 3}, true},
                   seed += 10);
}

TEST_CASE("decoding with the usual head widths and many query rows per kv head", "[decode]") {
  // Head widths 64 and 128 keep a kv head's query rows in registers, as
  // many rows at a time as fit (by the width, the packet and the target's
  // registers); 3 to 8 rows per key head reach every row block and remainder.
  std::uint64_t seed = 32700;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t d : {64, 128})
      for (index_t h : {3, 5, 8})
        for (index_t n : {1, 2}) {
          const index_t H = kind == Kind::v2 ? (h + 1) / 2 : h;  // V2: 2 rows per pair
          check_case(Case{kind, n, H, 1, d, 70, {70, 33}, true}, seed += 10);
        }
}

TEST_CASE("decoding reads several kv heads of a row together", "[decode]") {
  // With AVX-512 the step reads 2 or 4 consecutive kv heads of a row at once
  // (at most 512 bytes of it: two heads of 64 floats, four of a 16-bit
  // cache) when each has one or two query rows of width 64 (or one of 128): plain
  // GQA with 1 or 2 query heads per kv head, V2, and V1 (its two key heads
  // per pair, across pairs when a pair has one DIFF head, within a pair when
  // it has two). 3 and 5 kv heads (V1: 6 and 10 key heads) leave heads over
  // for one at a time after groups of 2 and 4. Plain attention's values are
  // as wide as its keys here, so that they are read together too.
  std::uint64_t seed = 32800;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    for (index_t d : {64, 128})
      for (index_t Hkv : {3, 5})
        for (index_t ratio : {1, 2}) {
          if (kind == Kind::v2 && ratio == 1) continue;
          const index_t H = kind == Kind::v2 ? Hkv * ratio / 2 : Hkv * ratio;
          for (index_t n : {1, 2})
            check_case(Case{kind, n, H, Hkv, d, 53, {53, 20}, true, -1, 0}, seed += 10);
        }
}

TEST_CASE("the kernels of several kv heads at once work for any number of heads", "[decode]") {
  // partial_dots_heads / axpy_keys_heads have kernels for the (G heads, R
  // rows) that heads_together asks for; any other G, R (and every G without
  // AVX-512) goes one head at a time. Both are checked here against float64
  // sums, G heads of 64 features in rows of G + 1 heads, R query rows each.
  using C = float;
  constexpr index_t P = diffattn::detail::TileConfig<C>::kPacket;
  const index_t D = 64, U = P > 1 ? P - 1 : 1;
  std::uint64_t seed = 33100;
  for (index_t G = 1; G <= 4; ++G)
    for (index_t R = 1; R <= 3; ++R) {
      const index_t row = (G + 1) * D;  // one key (or value) row: G + 1 heads
      const Tensor<C, 2> K = random_tensor<C, 2>({U, row}, ++seed);
      const Tensor<C, 2> Q = random_tensor<C, 2>({G * R, D}, ++seed);
      const Tensor<C, 2> W = random_tensor<C, 2>({G * R, P}, ++seed);
      const C* rows[P];
      for (index_t u = 0; u < U; ++u) rows[u] = &K(u, 0) + D;  // from the second head on
      // Products: head gi, row i, key u at part + (gi R + i) P P + u P.
      std::vector<C> part(static_cast<std::size_t>(G * R * P * P), C(0));
      diffattn::detail::partial_dots_heads<C, C>(G, R, rows, nullptr, 0, D, U, D, Q.data(), D,
                                                 R * D, part.data(), P * P, R * P * P);
      // Sums: o row (gi, i) += sum over u of W(gi R + i, u) V(u, head gi + 1).
      Tensor<C, 2> O = random_tensor<C, 2>({G * R, D}, ++seed);
      const Tensor<C, 2> O0 = cast<C>(O);
      diffattn::detail::axpy_keys_heads<C, C>(G, R, rows, nullptr, 0, D, U, D, O.data(), D, R * D,
                                              W.data(), P, R * P);
      for (index_t gi = 0; gi < G; ++gi)
        for (index_t i = 0; i < R; ++i) {
          const index_t r = gi * R + i;
          for (index_t u = 0; u < U; ++u) {
            double want = 0, got = 0, mag = 0;
            for (index_t t = 0; t < D; ++t) {
              want += double(Q(r, t)) * K(u, (gi + 1) * D + t);
              mag += std::abs(double(Q(r, t)) * K(u, (gi + 1) * D + t));
            }
            for (index_t l = 0; l < P; ++l)
              got += part[static_cast<std::size_t>((r * P + u) * P + l)];
            CHECK(std::abs(got - want) <= 1e-5 * mag);
          }
          for (index_t t = 0; t < D; ++t) {
            double want = O0(r, t), mag = std::abs(want);
            for (index_t u = 0; u < U; ++u) {
              want += double(W(r, u)) * K(u, (gi + 1) * D + t);
              mag += std::abs(double(W(r, u)) * K(u, (gi + 1) * D + t));
            }
            CHECK(std::abs(O(r, t) - want) <= 1e-5 * mag);
          }
        }
    }
}

TEST_CASE("decoding splits long caches into chunks", "[decode]") {
  // Longer than kSplitKeys: the default split runs.
  std::uint64_t seed = 33000;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2})
    check_case(Case{kind, 1, 2, 1, 8, 9000, {9000, 4097, 4096}, true}, seed += 10);
  check_case(Case{Kind::v2, 3, 2, 1, 8, 8500, {8500}, true, 5000}, seed += 10);
}

TEST_CASE("attention with one query groups the heads of a kv group", "[decode]") {
  // The kernels without cache run decoding steps through the same path.
  std::uint64_t seed = 34000;
  for (index_t ratio : {1, 2, 4}) {
    const auto q = random_tensor<double, 4>({2, 1, 2 * ratio, 16}, seed += 10);
    const auto k = random_tensor<double, 4>({2, 300, 2, 16}, seed + 1);
    const auto v = random_tensor<double, 4>({2, 300, 2, 9}, seed + 2);
    Tensor<double, 4> ref({2, 1, 2 * ratio, 9}), got(ref.shape());
    AttentionOptions o;
    o.causal = true;
    diffattn::reference::attention<double>(q, k, v, ref, o);
    diffattn::attention<double>(q, k, v, got, o);
    REQUIRE(rel_error(got, ref) < 1e-12);
  }
}

TEST_CASE("per-map states split at arbitrary points merge to one call", "[decode][states]") {
  std::uint64_t seed = 35000;
  const index_t B = 2, N = 5, M = 41, H = 4, Hkv = 2, d = 8;
  const std::vector<std::vector<index_t>> cuts = {
      {0, 41}, {0, 13, 13, 29, 41}, {0, 1, 40, 41}, {0, 0, 20, 41, 41}};
  for (bool causal : {true, false}) {
    for (const auto& cut : cuts) {
      // V1
      const auto q = random_tensor<double, 4>({B, N, 2 * H, d}, seed += 10);
      const auto k = random_tensor<double, 4>({B, M, 2 * Hkv, d}, seed + 1);
      const auto v = random_tensor<double, 4>({B, M, Hkv, 2 * d}, seed + 2);
      const auto k2 = random_tensor<double, 4>({B, M, Hkv, d}, seed + 3);
      const auto v2 = random_tensor<double, 4>({B, M, Hkv, d}, seed + 4);
      const auto logit = random_tensor<double, 3>({B, N, H}, seed + 5);
      AttentionOptions o;
      o.causal = causal;
      Tensor<double, 4> want1({B, N, H, 2 * d}), want2({B, N, H, d});
      diffattn::diff_attention_v1<double>(q, k, v, 0.6, want1, o);
      diffattn::diff_attention_v2<double>(q, k2, v2, logit, want2, o);
      auto slice = [&](const Tensor<double, 4>& t, index_t a, index_t b) {
        return TensorView<const double, 4>(t.data() + a * t.view().stride(1),
                                           {B, b - a, t.shape(2), t.shape(3)}, t.view().strides());
      };
      Tensor<double, 4> o1[2] = {Tensor<double, 4>({B, N, H, 2 * d}),
                                 Tensor<double, 4>({B, N, H, 2 * d})};
      Tensor<double, 4> o2[2] = {Tensor<double, 4>({B, N, H, d}), Tensor<double, 4>({B, N, H, d})};
      Tensor<double, 3> l1[2] = {Tensor<double, 3>({B, H, N}), Tensor<double, 3>({B, H, N})};
      Tensor<double, 3> l2[2] = {Tensor<double, 3>({B, H, N}), Tensor<double, 3>({B, H, N})};
      for (int m = 0; m < 2; ++m) {
        l1[m].fill(-std::numeric_limits<double>::infinity());
        l2[m].fill(-std::numeric_limits<double>::infinity());
      }
      for (std::size_t ci = 0; ci + 1 < cut.size(); ++ci) {
        const index_t a = cut[ci], b = cut[ci + 1];
        AttentionOptions oc;
        if (causal) oc.window_right = M - b;
        for (int m = 0; m < 2; ++m) {
          Tensor<double, 4> c1({B, N, H, 2 * d}), c2({B, N, H, d});
          Tensor<double, 3> cl1({B, H, N}), cl2({B, H, N});
          const TensorView<const double, 4> qm = diffattn::map_heads<const double>(q, m);
          diffattn::attention<double>(qm, diffattn::map_heads<const double>(slice(k, a, b), m),
                                      slice(v, a, b), c1, cl1, oc);
          diffattn::attention<double>(qm, slice(k2, a, b), slice(v2, a, b), c2, cl2, oc);
          diffattn::merge_states<double>(o1[m], l1[m], c1, cl1);
          diffattn::merge_states<double>(o2[m], l2[m], c2, cl2);
        }
      }
      Tensor<double, 4> got1({B, N, H, 2 * d}), got2({B, N, H, d});
      diffattn::diff_combine_v1<double>(o1[0], o1[1], 0.6, got1);
      diffattn::diff_combine_v2<double>(o2[0], o2[1], logit, got2);
      CHECK(rel_error(got1, want1) < 1e-12);
      CHECK(rel_error(got2, want2) < 1e-12);
    }
  }
}

TEST_CASE("kvcache kernels refuse bad input", "[decode][errors]") {
  const auto q = random_tensor<float, 4>({2, 1, 4, 8}, 1);
  const auto k = random_tensor<float, 4>({2, 10, 2, 8}, 2);
  const auto v = random_tensor<float, 4>({2, 10, 2, 8}, 3);
  Tensor<float, 4> out({2, 1, 4, 8});
  Tensor<index_t, 1> lens({2});
  lens(0) = 10;
  lens(1) = 11;
  KVCacheBatch c;
  c.cache_seqlens = lens;
  AttentionOptions o;
  o.causal = true;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, k, v, out, {}, c, o); },
                      {"attention_kvcache", "cache_seqlens[1] = 11", "capacity = 10"});
  lens(1) = -1;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, k, v, out, {}, c, o); },
                      {"cache_seqlens[1] = -1"});
  Tensor<index_t, 1> short_lens({3});
  c.cache_seqlens = short_lens;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, k, v, out, {}, c, o); },
                      {"cache_seqlens", "(B)"});
  // Causal with fewer cached keys than new queries.
  const auto q3 = random_tensor<float, 4>({2, 3, 4, 8}, 4);
  Tensor<float, 4> out3({2, 3, 4, 8});
  lens(0) = 2;
  lens(1) = 5;
  c.cache_seqlens = lens;
  test::require_error([&] { diffattn::attention_kvcache<float>(q3, k, v, out3, {}, c, o); },
                      {"cache_seqlens[0] = 2", "3 new queries"});
  // Paged: block indices, pool shapes.
  lens(0) = 5;
  const auto kp = random_tensor<float, 4>({4, 3, 2, 8}, 5);
  const auto vp = random_tensor<float, 4>({4, 3, 2, 8}, 6);
  Tensor<index_t, 2> table({2, 2});
  table(0, 0) = 0;
  table(0, 1) = 4;  // out of range, and used (keys 3 and 4)
  table(1, 0) = 1;
  table(1, 1) = 2;
  c.block_table = table;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, kp, vp, out, {}, c, o); },
                      {"block_table[0, 1] = 4", "num_blocks = 4"});
  table(0, 1) = 3;
  const auto vbad = random_tensor<float, 4>({4, 2, 2, 8}, 7);
  test::require_error([&] { diffattn::attention_kvcache<float>(q, kp, vbad, out, {}, c, o); },
                      {"v_cache", "block_size"});
  lens(0) = 7;  // capacity 2 x 3 = 6
  test::require_error([&] { diffattn::attention_kvcache<float>(q, kp, vp, out, {}, c, o); },
                      {"cache_seqlens[0] = 7", "capacity = 6"});
  lens(0) = 5;
  c.split_keys = -1;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, kp, vp, out, {}, c, o); },
                      {"split_keys"});
  c.split_keys = 0;
  const auto kv1 = random_tensor<float, 4>({4, 3, 3, 8}, 8);
  test::require_error(
      [&] { diffattn::diff_attention_v1_kvcache<float>(q, kv1, vp, 0.5f, out, {}, c, o); },
      {"diff_attention_v1_kvcache", "k has 3 heads"});
  Tensor<float, 4> bad_out({2, 1, 4, 8});
  diffattn::attention_kvcache<float>(q, kp, vp, bad_out, {}, c, o);  // valid: no throw
  // A table of B rows and no column is paged with capacity 0, not a request
  // for contiguous caches (pools of B blocks could otherwise pass for them).
  const auto kb = random_tensor<float, 4>({2, 3, 2, 8}, 9);
  const auto vb = random_tensor<float, 4>({2, 3, 2, 8}, 10);
  Tensor<index_t, 2> no_blocks({2, 0});
  c.block_table = no_blocks;
  lens(0) = 1;
  lens(1) = 0;
  test::require_error([&] { diffattn::attention_kvcache<float>(q, kb, vb, out, {}, c, o); },
                      {"cache_seqlens[0] = 1", "capacity = 0", "block_table (2, 0)"});
  lens(0) = 0;
  Tensor<float, 3> lse({2, 4, 1});
  diffattn::attention_kvcache<float>(q, kb, vb, out, lse, c, o);  // empty caches: zero rows
  for (index_t i = 0; i < out.size(); ++i) CHECK(out.data()[i] == 0.0f);
  for (index_t i = 0; i < lse.size(); ++i)
    CHECK(lse.data()[i] == -std::numeric_limits<float>::infinity());
}
