// 8-bit KV caches (float8.hpp, quantize.hpp, the *_kvcache kernels on int8
// and e4m3 caches, the layers' 8-bit caches): the e4m3 conversions bit by
// bit, quantize_rows against its contract, the kernels against the float64
// reference on the dequantized cache and against the unquantized cache with
// the propagated quantization bound, paged, threads, split-KV, bad input.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/float8.hpp>
#include <diffattn/isa.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/quantize.hpp>
#include <diffattn/reference.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::float8_e4m3;
using diffattn::index_t;
using diffattn::KVCacheBatch;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;
using test::rel_error;

namespace {

/// The e4m3 value nearest x (ties to even significand), saturating at 448,
/// by search over the 126 finite non-negative codes in double.
std::uint8_t e4m3_nearest(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFF : 0x7F;
  const double a = std::min(std::abs(static_cast<double>(x)), 448.0);
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    float8_e4m3 f;
    f.value = static_cast<std::uint8_t>(c);
    const double err = std::abs(static_cast<double>(static_cast<float>(f)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<std::uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

template <class Q>
double dequant(Q q) {
  if constexpr (std::is_same<Q, std::int8_t>::value)
    return q;
  else
    return static_cast<float>(q);
}

template <class Q>
const char* qname() {
  return std::is_same<Q, std::int8_t>::value ? "int8" : "e4m3";
}

}  // namespace

TEST_CASE("float8_e4m3 converts exactly and rounds to nearest even, saturating", "[quant]") {
  // Every code round-trips; NaN codes give NaN.
  for (int c = 0; c < 256; ++c) {
    float8_e4m3 f;
    f.value = static_cast<std::uint8_t>(c);
    const float x = static_cast<float>(f);
    if ((c & 0x7F) == 0x7F) {
      REQUIRE(std::isnan(x));
      continue;
    }
    REQUIRE(float8_e4m3(x).value == c);
    // The kernels' units: value 2^-8 on every path.
    REQUIRE(diffattn::detail::e4m3_units(static_cast<std::uint8_t>(c)) == x / 256);
  }
  REQUIRE(static_cast<float>(float8_e4m3(448.0f)) == 448.0f);
  REQUIRE(static_cast<float>(float8_e4m3(1e30f)) == 448.0f);
  REQUIRE(static_cast<float>(float8_e4m3(-std::numeric_limits<float>::infinity())) == -448.0f);
  REQUIRE(std::isnan(static_cast<float>(float8_e4m3(std::nanf("")))));
  REQUIRE(static_cast<float>(float8_e4m3(std::ldexp(1.0f, -9))) == std::ldexp(1.0f, -9));
  REQUIRE(static_cast<float>(float8_e4m3(std::ldexp(1.0f, -10))) == 0.0f);  // tie to even: 0
  REQUIRE(static_cast<float>(float8_e4m3(std::ldexp(3.0f, -10))) == std::ldexp(1.0f, -8));
  REQUIRE(static_cast<float>(float8_e4m3(1.0625f)) == 1.0f);   // tie between 1 and 1.125
  REQUIRE(static_cast<float>(float8_e4m3(1.1875f)) == 1.25f);  // tie between 1.125 and 1.25
  // A sweep of floats against the nearest code found by search.
  diffattn::detail::Rng rng(7);
  for (int i = 0; i < 20000; ++i) {
    const float x = static_cast<float>(std::ldexp(rng.normal(), static_cast<int>(i % 30) - 18));
    INFO("x = " << x);
    REQUIRE(float8_e4m3(x).value == e4m3_nearest(x));
  }
  // Every midpoint between neighbouring codes rounds to the even one.
  for (int c = 0; c < 0x7E; ++c) {
    float8_e4m3 lo, hi;
    lo.value = static_cast<std::uint8_t>(c);
    hi.value = static_cast<std::uint8_t>(c + 1);
    const float mid = (static_cast<float>(lo) + static_cast<float>(hi)) / 2;
    REQUIRE(float8_e4m3(mid).value == ((c & 1) ? c + 1 : c));
  }
}

TEMPLATE_TEST_CASE("quantize_rows follows its contract", "[quant]", std::int8_t, float8_e4m3) {
  using Q = TestType;
  INFO(qname<Q>());
  const float qmax = diffattn::quant_max<Q>();
  // d = 37: the vector path (AVX-512: 16 at a time) and the element tail.
  for (index_t d : {index_t(37), index_t(64), index_t(5)}) {
    Tensor<float, 3> x = random_tensor<float, 3>({3, 5, d}, 11 + d, 2.0);
    for (index_t t = 0; t < d; ++t) x(1, 2, t) = 0;                       // a zero row
    for (index_t t = 0; t < d; ++t) x(2, 1, t) *= std::ldexp(1.0f, -20);  // a tiny row
    x(0, 0, 3) = 1e6f;                                                    // a large value
    Tensor<Q, 3> q({3, 5, d});
    Tensor<float, 2> s({3, 5});
    diffattn::quantize_rows<float, Q>(x, q, s);
    for (index_t a = 0; a < 3; ++a)
      for (index_t h = 0; h < 5; ++h) {
        float amax = 0;
        for (index_t t = 0; t < d; ++t) amax = std::max(amax, std::abs(x(a, h, t)));
        REQUIRE(s(a, h) == amax / qmax);
        for (index_t t = 0; t < d; ++t) {
          const double xv = x(a, h, t), sc = s(a, h);
          const Q want = diffattn::detail::quantize_scalar<Q>(x(a, h, t) / s(a, h));
          if (sc == 0) {
            REQUIRE(dequant(q(a, h, t)) == 0);
            continue;
          }
          REQUIRE(std::memcmp(&want, &q(a, h, t), 1) == 0);  // vector path == element path
          const double err = std::abs(xv - sc * dequant(q(a, h, t)));
          if (std::is_same<Q, std::int8_t>::value) {
            REQUIRE(err <= sc * (0.5 + 1e-5));
          } else {
            const double y = std::abs(xv) / sc;
            REQUIRE(err <= (y >= 1.0 / 64 ? std::ldexp(std::abs(xv), -4) * (1 + 1e-6)
                                          : std::ldexp(sc, -10) * (1 + 1e-6)));
          }
        }
      }
  }
  // 16-bit sources and rank 4 / rank 2 views; strided source rows.
  Tensor<diffattn::bfloat16, 4> xb =
      test::cast<diffattn::bfloat16>(random_tensor<float, 4>({2, 3, 4, 20}, 5));
  Tensor<Q, 4> qb({2, 3, 4, 20});
  Tensor<float, 3> sb({2, 3, 4});
  diffattn::quantize_rows<diffattn::bfloat16, Q>(xb, qb, sb);
  Tensor<float, 4> xf = test::cast<float>(xb);
  Tensor<Q, 4> qf({2, 3, 4, 20});
  Tensor<float, 3> sf({2, 3, 4});
  diffattn::quantize_rows<float, Q>(xf, qf, sf);
  REQUIRE(test::bitwise_equal(sb, sf));
  REQUIRE(std::memcmp(qb.data(), qf.data(), static_cast<std::size_t>(qf.size())) == 0);
  Tensor<diffattn::half, 2> xh = test::cast<diffattn::half>(random_tensor<float, 2>({7, 33}, 6));
  Tensor<Q, 2> qh({7, 33});
  Tensor<float, 1> sh({7});
  diffattn::quantize_rows<diffattn::half, Q>(xh, qh, sh);
  for (index_t r = 0; r < 7; ++r) REQUIRE(sh(r) > 0);
  // Every other row of a (4, 2, 8) tensor: rows strided, not contiguous.
  Tensor<float, 3> big = random_tensor<float, 3>({4, 2, 8}, 8);
  const TensorView<const float, 2> every_other(big.data(), {4, 8}, {16, 1});
  Tensor<Q, 2> qs({4, 8});
  Tensor<float, 1> ss({4});
  diffattn::quantize_rows<float, Q>(every_other, qs, ss);
  Tensor<float, 2> rows({4, 8});
  for (index_t r = 0; r < 4; ++r)
    for (index_t t = 0; t < 8; ++t) rows(r, t) = big(r, 0, t);
  Tensor<Q, 2> qr({4, 8});
  Tensor<float, 1> sr({4});
  diffattn::quantize_rows<float, Q>(rows, qr, sr);
  REQUIRE(test::bitwise_equal(ss, sr));

  // Bad input: nothing written.
  Tensor<float, 3> bad = random_tensor<float, 3>({2, 2, 8}, 9);
  bad(1, 0, 5) = std::numeric_limits<float>::quiet_NaN();
  Tensor<Q, 3> qbad({2, 2, 8});
  Tensor<float, 2> sbad({2, 2});
  sbad.fill(-1.0f);
  test::require_error([&] { diffattn::quantize_rows<float, Q>(bad, qbad, sbad); },
                      {"quantize_rows", "src", "(1, 0, 5)", "finite"});
  REQUIRE(sbad(0, 0) == -1.0f);
  Tensor<float, 2> wrong({2, 3});
  test::require_error(
      [&] {
        diffattn::quantize_rows<float, Q>(random_tensor<float, 3>({2, 2, 8}, 1), qbad, wrong);
      },
      {"quantize_rows", "scale", "(2, 3)", "(2, 2)"});
  Tensor<Q, 3> qwrong({2, 2, 9});
  test::require_error(
      [&] {
        diffattn::quantize_rows<float, Q>(random_tensor<float, 3>({2, 2, 8}, 1), qwrong, sbad);
      },
      {"quantize_rows", "dst", "(2, 2, 9)", "(2, 2, 8)"});
}

namespace {

enum class Kind { plain, v1, v2 };

struct Case {
  Kind kind;
  index_t n, H, Hkv, d, capacity;  // H: DIFF heads (v1, v2) or query heads (plain)
  std::vector<index_t> seqlens;
  index_t window_left = -1;
};

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
      return {c.H, c.Hkv, c.Hkv, c.d + 3, c.H};
  }
}

/// An 8-bit cache of Q: values and scales, contiguous or paged (table).
template <class Q>
struct QCache {
  Tensor<Q, 4> k, v;
  Tensor<float, 3> ks, vs;
  Tensor<index_t, 2> table;  // empty: contiguous
};

/// Quantized k and v, and their dequantized values in double and float.
template <class Q>
struct Quantized {
  QCache<Q> c;
  Tensor<double, 4> kd, vd;
  Tensor<float, 4> kf, vf;
};

template <class Q>
Quantized<Q> quantize(const Tensor<float, 4>& k, const Tensor<float, 4>& v) {
  Quantized<Q> r;
  r.c.k = Tensor<Q, 4>(k.shape());
  r.c.v = Tensor<Q, 4>(v.shape());
  r.c.ks = Tensor<float, 3>({k.shape(0), k.shape(1), k.shape(2)});
  r.c.vs = Tensor<float, 3>({v.shape(0), v.shape(1), v.shape(2)});
  diffattn::quantize_rows<float, Q>(k, r.c.k, r.c.ks);
  diffattn::quantize_rows<float, Q>(v, r.c.v, r.c.vs);
  auto deq = [](const Tensor<Q, 4>& q, const Tensor<float, 3>& s, Tensor<double, 4>& out) {
    out = Tensor<double, 4>(q.shape());
    for (index_t i = 0; i < q.size(); ++i)
      out.data()[i] = static_cast<double>(s.data()[i / q.shape(3)]) * dequant(q.data()[i]);
  };
  deq(r.c.k, r.c.ks, r.kd);
  deq(r.c.v, r.c.vs, r.vd);
  r.kf = test::cast<float>(r.kd);  // exact: a float scale times an 8-bit value
  r.vf = test::cast<float>(r.vd);
  return r;
}

/// A paged copy: blocks of bs rows handed out in a scrambled order.
template <class Q>
QCache<Q> paged(const QCache<Q>& c, index_t bs) {
  const index_t B = c.k.shape(0), cap = c.k.shape(1), per = (cap + bs - 1) / bs;
  const index_t blocks = B * per + 2;
  QCache<Q> p{Tensor<Q, 4>({blocks, bs, c.k.shape(2), c.k.shape(3)}),
              Tensor<Q, 4>({blocks, bs, c.v.shape(2), c.v.shape(3)}),
              Tensor<float, 3>({blocks, bs, c.k.shape(2)}),
              Tensor<float, 3>({blocks, bs, c.v.shape(2)}), Tensor<index_t, 2>({B, per})};
  p.ks.fill(std::numeric_limits<float>::quiet_NaN());  // unused rows: never read
  p.vs.fill(-1.0f);
  std::vector<index_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = 0; i < ids.size(); ++i) std::swap(ids[i], ids[(i * 7919 + 13) % ids.size()]);
  std::size_t next = 0;
  for (index_t b = 0; b < B; ++b) {
    for (index_t blk = 0; blk < per; ++blk) p.table(b, blk) = ids[next++];
    for (index_t j = 0; j < cap; ++j) {
      const index_t id = p.table(b, j / bs), r = j % bs;
      for (index_t h = 0; h < c.k.shape(2); ++h) {
        p.ks(id, r, h) = c.ks(b, j, h);
        for (index_t t = 0; t < c.k.shape(3); ++t) p.k(id, r, h, t) = c.k(b, j, h, t);
      }
      for (index_t h = 0; h < c.v.shape(2); ++h) {
        p.vs(id, r, h) = c.vs(b, j, h);
        for (index_t t = 0; t < c.v.shape(3); ++t) p.v(id, r, h, t) = c.v(b, j, h, t);
      }
    }
  }
  return p;
}

struct Inputs {
  Tensor<float, 4> q, k, v;
  Tensor<float, 3> logit;
  float lambda = 0.7f;
  Tensor<index_t, 1> seqlens;
};

Inputs make_inputs(const Case& c, std::uint64_t seed) {
  const Dims dm = dims(c);
  const index_t B = static_cast<index_t>(c.seqlens.size());
  Inputs in;
  in.q = random_tensor<float, 4>({B, c.n, dm.qh, c.d}, seed);
  in.k = random_tensor<float, 4>({B, c.capacity, dm.kh, c.d}, seed + 1);
  in.v = random_tensor<float, 4>({B, c.capacity, dm.vh, dm.dv}, seed + 2);
  in.logit = random_tensor<float, 3>({B, c.n, c.H}, seed + 3, 2.0);
  in.seqlens = Tensor<index_t, 1>({B});
  for (index_t b = 0; b < B; ++b) in.seqlens.data()[b] = c.seqlens[static_cast<std::size_t>(b)];
  return in;
}

AttentionOptions options_of(const Case& c, int threads = 0) {
  AttentionOptions o;
  o.causal = true;
  o.window_left = c.window_left;
  o.num_threads = threads;
  return o;
}

/// The kvcache kernel of the case's kind, with queries T over caches KV.
template <class T, class KV, class Q4, class L3>
void run_kernel(const Case& c, const Inputs& in, const Tensor<KV, 4>& k, const Tensor<KV, 4>& v,
                const KVCacheBatch& cache, Tensor<T, 4>& out,
                Tensor<diffattn::compute_t<T>, 3>& lse, const Q4& q, const L3& logit,
                const AttentionOptions& o) {
  switch (c.kind) {
    case Kind::v1:
      diffattn::diff_attention_v1_kvcache<T, KV>(q, k, v, static_cast<T>(in.lambda), out, lse,
                                                 cache, o);
      break;
    case Kind::v2:
      diffattn::diff_attention_v2_kvcache<T, KV>(q, k, v, logit, out, lse, cache, o);
      break;
    default:
      diffattn::attention_kvcache<T, KV>(q, k, v, out, lse, cache, o);
  }
}

/// Each sequence through the float64 (or float) reference on its slice of k, v.
template <class T>
void reference(const Case& c, const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
               const Tensor<T, 3>& logit, T lambda, const Tensor<index_t, 1>& seqlens,
               Tensor<T, 4>& out, const AttentionOptions& o) {
  for (index_t b = 0; b < q.shape(0); ++b) {
    const index_t m = seqlens.data()[b];
    auto entry = [&](const auto& t, index_t len) {
      using U = std::remove_const_t<std::remove_pointer_t<decltype(t.data())>>;
      return TensorView<U, 4>(const_cast<U*>(t.data()) + b * t.view().stride(0),
                              {1, len, t.shape(2), t.shape(3)},
                              {t.view().stride(0), t.view().stride(1), t.view().stride(2), 1});
    };
    const TensorView<const T, 3> lg(logit.data() + b * logit.view().stride(0),
                                    {1, logit.shape(1), logit.shape(2)},
                                    {logit.view().stride(0), logit.view().stride(1), 1});
    const TensorView<T, 3> no_lse;
    switch (c.kind) {
      case Kind::v1:
        diffattn::reference::diff_attention_v1<T>(entry(q, c.n), entry(k, m), entry(v, m), lambda,
                                                  entry(out, c.n), no_lse, o);
        break;
      case Kind::v2:
        diffattn::reference::diff_attention_v2<T>(entry(q, c.n), entry(k, m), entry(v, m), lg,
                                                  entry(out, c.n), no_lse, o);
        break;
      default:
        diffattn::reference::attention<T>(entry(q, c.n), entry(k, m), entry(v, m), entry(out, c.n),
                                          no_lse, o);
    }
  }
}

/// The bound of the quantization error on the output, propagated: a key
/// error |k^ - k| <= e_t moves a score by at most eps = scale sum_t |q_t| e_t,
/// so every softmax weight by a factor within e^(+-2 eps): the weights move by
/// at most e^(2 eps) - 1 in total (L1), times max |v|; the values add their
/// own error max |v^ - v|. A DIFF head: map 1's bound plus |lambda| map 2's.
/// Here eps and the value error are the largest over all rows and heads.

/// Whether the step takes an int8 cache's key products on VNNI: decided by
/// this file's flags header-only; under diffattn::dispatch, by the variant in
/// use (avx512bf16 is the one built with AVX512-VNNI).
template <class Q>
bool vnni_keys(index_t d) {
#ifdef DIFFATTN_DISPATCH
  return std::is_same<Q, std::int8_t>::value && (d == 64 || d == 128) &&
         diffattn::isa() == "avx512bf16";
#else
  return diffattn::detail::decode_uses_vnni<float, Q>(d);
#endif
}
template <class Q>
double quant_bound(const Case& c, const Inputs& in, const Quantized<Q>& qz, bool vnni) {
  const bool i8 = std::is_same<Q, std::int8_t>::value;
  auto elem_err = [&](double x, double s) {
    return i8 ? s / 2 * (1 + 1e-5) : std::max(std::ldexp(std::abs(x), -4), std::ldexp(s, -10));
  };
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  double eps = 0;
  for (index_t b = 0; b < in.q.shape(0); ++b)
    for (index_t i = 0; i < c.n; ++i)
      for (index_t h = 0; h < in.q.shape(2); ++h)
        for (index_t j = 0; j < in.k.shape(1); ++j)
          for (index_t kh = 0; kh < in.k.shape(2); ++kh) {
            double e = 0, qmax = 0, k1 = 0;
            for (index_t t = 0; t < c.d; ++t) {
              e += std::abs(in.q(b, i, h, t)) * elem_err(in.k(b, j, kh, t), qz.c.ks(b, j, kh));
              qmax = std::max(qmax, std::abs(static_cast<double>(in.q(b, i, h, t))));
              k1 += std::abs(qz.kd(b, j, kh, t));
            }
            // VNNI: the scaled query's own quantization, max |qs| / 510 per feature.
            if (vnni) e += qmax / 510 * (1 + 1e-5) * k1;
            eps = std::max(eps, scale * e);
          }
  double vmax = 0, verr = 0;
  for (index_t b = 0; b < in.v.shape(0); ++b)
    for (index_t j = 0; j < in.v.shape(1); ++j)
      for (index_t h = 0; h < in.v.shape(2); ++h)
        for (index_t t = 0; t < in.v.shape(3); ++t) {
          vmax = std::max(vmax, std::abs(static_cast<double>(in.v(b, j, h, t))));
          verr = std::max(verr, elem_err(in.v(b, j, h, t), qz.c.vs(b, j, h)));
        }
  const double per_map = std::expm1(2 * eps) * vmax + verr + 1e-5 * vmax;  // + float rounding
  return c.kind == Kind::plain ? per_map : per_map * (1 + 1.0);            // lambda <= 1 here
}

template <class Q>
void check_case(const Case& c, std::uint64_t seed) {
  const Dims dm = dims(c);
  const index_t B = static_cast<index_t>(c.seqlens.size());
  INFO(qname<Q>() << " kind " << static_cast<int>(c.kind) << " n=" << c.n << " H=" << c.H
                  << " Hkv=" << c.Hkv << " d=" << c.d << " cap=" << c.capacity
                  << " window_left=" << c.window_left);
  const Inputs in = make_inputs(c, seed);
  const Quantized<Q> qz = quantize<Q>(in.k, in.v);
  const std::array<index_t, 4> os = {B, c.n, dm.oh, dm.dv};
  const std::array<index_t, 3> ls = {B, dm.qh, c.n};
  const AttentionOptions o = options_of(c);

  // The float64 reference on the dequantized cache, and float's naive error.
  // Where the step takes the key products in int8 (VNNI), it quantizes each
  // scaled query row (detail::quantize_query_u8): the reference then runs on
  // those queries (scale 1), so that the kernel's error is float rounding.
  const bool vnni = c.n < 6 && vnni_keys<Q>(c.d);
  const Tensor<double, 4> qd = test::cast<double>(in.q);
  const Tensor<double, 3> logit_d = test::cast<double>(in.logit);
  Tensor<double, 4> qref = qd;
  AttentionOptions oref = o;
  if (vnni) {
    const float tau = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    oref.scale = 1.0;
    std::vector<float> row(static_cast<std::size_t>(c.d));
    std::vector<std::uint8_t> qa(static_cast<std::size_t>(c.d));
    std::uint64_t masks[2] = {0, 0};
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < c.n; ++i)
        for (index_t h = 0; h < dm.qh; ++h) {
          for (index_t t = 0; t < c.d; ++t)
            row[static_cast<std::size_t>(t)] = tau * in.q(b, i, h, t);
          const double sq = diffattn::detail::quantize_query_u8(row.data(), c.d, qa.data(), masks);
          for (index_t t = 0; t < c.d; ++t) {
            const bool neg = (masks[t / 64] >> (t % 64)) & 1u;
            qref(b, i, h, t) = (neg ? -sq : sq) * qa[static_cast<std::size_t>(t)];
          }
        }
  }
  Tensor<double, 4> ref(os);
  reference<double>(c, qref, qz.kd, qz.vd, logit_d, in.lambda, in.seqlens, ref, oref);
  Tensor<float, 4> naive(os);
  reference<float>(c, test::cast<float>(qref), qz.kf, qz.vf, in.logit, in.lambda, in.seqlens, naive,
                   oref);
  const double naive_err = rel_error(naive, ref);

  KVCacheBatch cache;
  cache.cache_seqlens = in.seqlens;
  cache.k_scale = qz.c.ks;
  cache.v_scale = qz.c.vs;
  Tensor<float, 4> got(os);
  Tensor<float, 3> lse(ls);
  run_kernel<float, Q>(c, in, qz.c.k, qz.c.v, cache, got, lse, in.q, in.logit, o);
  const double err = rel_error(got, ref);
  INFO("error vs the dequantized float64 reference " << err << ", naive float " << naive_err);
  REQUIRE(err <= std::max(2 * naive_err, 2e-5));

  // The float kernel on the dequantized float cache: the same to rounding.
  KVCacheBatch plain_cache;
  plain_cache.cache_seqlens = in.seqlens;
  Tensor<float, 4> deq_out(os);
  Tensor<float, 3> deq_lse(ls);
  run_kernel<float, float>(c, in, qz.kf, qz.vf, plain_cache, deq_out, deq_lse, in.q, in.logit, o);
  if (!vnni) REQUIRE(rel_error(got, deq_out) <= std::max(4 * naive_err, 4e-5));

  // Against the unquantized cache: within the propagated quantization bound.
  Tensor<double, 4> exact(os);
  reference<double>(c, qd, test::cast<double>(in.k), test::cast<double>(in.v), logit_d, in.lambda,
                    in.seqlens, exact, o);
  double worst = 0;
  for (index_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got.data()[i] - exact.data()[i]));
  const double bound = quant_bound<Q>(c, in, qz, vnni);
  INFO("error vs the unquantized cache " << worst << ", bound " << bound);
  REQUIRE(worst <= bound);

  // bfloat16 queries over the same cache: as float queries rounded to bf16.
  {
    const Tensor<diffattn::bfloat16, 4> qb = test::cast<diffattn::bfloat16>(in.q);
    const Tensor<diffattn::bfloat16, 3> lb = test::cast<diffattn::bfloat16>(in.logit);
    Tensor<diffattn::bfloat16, 4> out_b(os);
    Tensor<float, 3> lse_b(ls);
    run_kernel<diffattn::bfloat16, Q>(c, in, qz.c.k, qz.c.v, cache, out_b, lse_b, qb, lb, o);
    Tensor<double, 4> ref_b(os);
    reference<double>(c, test::cast<double>(test::cast<float>(qb)), qz.kd, qz.vd,
                      test::cast<double>(test::cast<float>(lb)), in.lambda, in.seqlens, ref_b, o);
    REQUIRE(rel_error(out_b, ref_b) <=
            std::max(2 * naive_err, 2e-5) + (vnni ? 1.0 / 32 : 1.0 / 128));
  }

  // Paged: bitwise the contiguous result.
  for (index_t bs : {index_t(1), index_t(5), index_t(16)}) {
    INFO("block_size " << bs);
    const QCache<Q> pc = paged(qz.c, bs);
    KVCacheBatch pb = cache;
    pb.block_table = pc.table;
    pb.k_scale = pc.ks;
    pb.v_scale = pc.vs;
    Tensor<float, 4> out_p(os);
    Tensor<float, 3> lse_p(ls);
    run_kernel<float, Q>(c, in, pc.k, pc.v, pb, out_p, lse_p, in.q, in.logit, o);
    REQUIRE(test::bitwise_equal(out_p, got));
    REQUIRE(test::bitwise_equal(lse_p, lse));
  }

  // Threads 1 and 2 bitwise, split-KV in small chunks and off.
  for (index_t split : {index_t(0), index_t(7), index_t(1) << 40}) {
    INFO("split_keys " << split);
    KVCacheBatch cs = cache;
    cs.split_keys = split;
    Tensor<float, 4> o1(os), o2(os);
    Tensor<float, 3> l1(ls), l2(ls);
    run_kernel<float, Q>(c, in, qz.c.k, qz.c.v, cs, o1, l1, in.q, in.logit, options_of(c, 1));
    run_kernel<float, Q>(c, in, qz.c.k, qz.c.v, cs, o2, l2, in.q, in.logit, options_of(c, 2));
    REQUIRE(test::bitwise_equal(o1, o2));
    REQUIRE(test::bitwise_equal(l1, l2));
    REQUIRE(rel_error(o1, ref) <= std::max(2 * naive_err, 2e-5));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("8-bit caches: decoding steps and prefill chunks", "[quant][decode]",
                   std::int8_t, float8_e4m3) {
  using Q = TestType;
  std::uint64_t seed = 100;
  for (Kind kind : {Kind::plain, Kind::v1, Kind::v2}) {
    // Decoding (n = 1, 2), odd widths, GQA; a prefill chunk (n = 7); windows.
    check_case<Q>({kind, 1, 4, 2, 16, 45, {45, 3, 0, 30}}, seed++);
    check_case<Q>({kind, 2, 4, 4, 64, 70, {70, 2, 41}}, seed++);
    check_case<Q>({kind, 1, 8, 2, 13, 33, {33, 17}, 9}, seed++);
    check_case<Q>({kind, 7, 2, 1, 32, 50, {50, 7, 23}}, seed++);
    check_case<Q>({kind, 7, 4, 2, 20, 40, {40, 29}, 11}, seed++);
  }
  // Plain with d = 128 (two heads of 64 floats per pass with AVX-512) and MQA.
  check_case<Q>({Kind::plain, 1, 8, 1, 128, 90, {90, 64}}, seed++);
  check_case<Q>({Kind::v2, 1, 8, 4, 64, 90, {90}}, seed++);
  check_case<Q>({Kind::v2, 1, 16, 8, 64, 66, {66}}, seed++);
}

TEST_CASE("a decoding step's VNNI query rows round each feature to nearest", "[quant][decode]") {
  // detail::quantize_query_u8 (vectorised where the build has AVX-512)
  // against the contract written out here: sq = max |q| / 255, bytes
  // nearbyint(|q_t| / sq) in float, signs as masks; ties, zero and
  // non-finite rows included.
  for (index_t d : {index_t(64), index_t(128), index_t(48)}) {
    for (int kind = 0; kind < 5; ++kind) {
      INFO("d " << d << " kind " << kind);
      Tensor<float, 1> q = random_tensor<float, 1>({d}, 100 + static_cast<std::uint64_t>(kind), 3.0);
      if (kind == 1) {  // exact ties: (k + 1/2) sq
        q(0) = 255;
        for (index_t t = 1; t < d; ++t)
          q(t) = (t % 2 ? -1.0f : 1.0f) * (static_cast<float>(t % 200) + 0.5f);
      }
      if (kind == 2) std::fill(q.data(), q.data() + d, 0.0f), q(3) = -0.0f;
      if (kind == 3) q(d / 2) = std::numeric_limits<float>::infinity();
      if (kind == 4) q(d - 1) = std::numeric_limits<float>::quiet_NaN();
      std::vector<std::uint8_t> qa(static_cast<std::size_t>(d), 7);
      std::uint64_t masks[2] = {~0ull, ~0ull};
      const float sq = diffattn::detail::quantize_query_u8(q.data(), d, qa.data(), masks);
      float amax = 0;
      for (index_t t = 0; t < d; ++t) amax = std::max(amax, std::abs(q(t)));
      const float want_sq = amax / 255;
      REQUIRE(std::memcmp(&sq, &want_sq, sizeof(float)) == 0);
      for (index_t t = 0; t < d; ++t) {
        INFO("t " << t << " q " << q(t));
        const float y = std::nearbyint(std::abs(q(t)) / sq);
        const std::uint8_t want =
            sq > 0 ? static_cast<std::uint8_t>(std::min(255.0f, y)) : std::uint8_t(0);
        CHECK(qa[static_cast<std::size_t>(t)] == want);
        CHECK(((masks[t / 64] >> (t % 64)) & 1u) == (q(t) < 0 ? 1u : 0u));
      }
      for (index_t t = d; t < 64 * ((d + 63) / 64); ++t)
        CHECK(((masks[t / 64] >> (t % 64)) & 1u) == 0u);
    }
  }
}

TEST_CASE("8-bit caches refuse bad scales and scales where they do not belong", "[quant][errors]") {
  const Case c{Kind::v2, 1, 2, 1, 8, 6, {6, 4}};
  const Inputs in = make_inputs(c, 3);
  Quantized<std::int8_t> qz = quantize<std::int8_t>(in.k, in.v);
  Tensor<float, 4> out({2, 1, 2, 8});
  Tensor<float, 3> lse({2, 4, 1});
  KVCacheBatch cache;
  cache.cache_seqlens = in.seqlens;
  auto run = [&](const KVCacheBatch& cb) {
    diffattn::diff_attention_v2_kvcache<float, std::int8_t>(in.q, qz.c.k, qz.c.v, in.logit, out,
                                                            lse, cb, {});
  };
  test::require_error([&] { run(cache); },
                      {"diff_attention_v2_kvcache", "k_scale", "missing", "(2, 6, 1)"});
  cache.k_scale = qz.c.ks;
  test::require_error([&] { run(cache); }, {"v_scale", "missing"});
  Tensor<float, 3> wrong({2, 5, 1});
  cache.v_scale = wrong;
  test::require_error([&] { run(cache); }, {"v_scale", "(2, 5, 1)", "(2, 6, 1)"});
  cache.v_scale = qz.c.vs;
  run(cache);  // fine
  // A negative, NaN or infinite scale among the rows read; not among the rest.
  for (float bad :
       {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Tensor<float, 3> vs = qz.c.vs;
    vs(1, 2, 0) = bad;
    cache.v_scale = vs;
    test::require_error([&] { run(cache); }, {"v_scale", "key 2", "sequence 1", "finite"});
    vs(1, 2, 0) = 0.5f;
    vs(1, 5, 0) = bad;  // sequence 1 holds 4 keys: row 5 is never read
    run(cache);
  }
  cache.v_scale = qz.c.vs;
  {
    Tensor<float, 3> ks = qz.c.ks;
    ks(0, 5, 0) = -2.0f;
    cache.k_scale = ks;
    test::require_error([&] { run(cache); }, {"k_scale", "-2", "key 5", "sequence 0"});
    cache.k_scale = qz.c.ks;
  }
  // 8 kv heads, whole blocks of 16 keys: the scales read as 16 x 8 blocks
  // (AVX-512) are checked too.
  {
    const Case c8{Kind::v2, 1, 8, 8, 64, 40, {40}};
    const Inputs in8 = make_inputs(c8, 4);
    const Quantized<std::int8_t> q8 = quantize<std::int8_t>(in8.k, in8.v);
    Tensor<float, 4> out8({1, 1, 8, 64});
    for (int which = 0; which < 2; ++which) {
      Tensor<float, 3> ks = q8.c.ks, vs = q8.c.vs;
      (which ? vs : ks)(0, 21, 5) = std::numeric_limits<float>::quiet_NaN();
      KVCacheBatch cb;
      cb.cache_seqlens = in8.seqlens;
      cb.k_scale = ks;
      cb.v_scale = vs;
      test::require_error(
          [&] {
            diffattn::diff_attention_v2_kvcache<float, std::int8_t>(in8.q, q8.c.k, q8.c.v,
                                                                    in8.logit, out8, {}, cb, {});
          },
          {which ? "v_scale" : "k_scale", "key 21", "head 5"});
    }
  }
  // e4m3: a scale whose 2^8 multiple overflows.
  {
    Quantized<float8_e4m3> qe = quantize<float8_e4m3>(in.k, in.v);
    Tensor<float, 3> ks = qe.c.ks;
    ks(0, 1, 0) = 3e37f;
    KVCacheBatch ce = cache;
    ce.k_scale = ks;
    ce.v_scale = qe.c.vs;
    test::require_error(
        [&] {
          diffattn::diff_attention_v2_kvcache<float, float8_e4m3>(in.q, qe.c.k, qe.c.v, in.logit,
                                                                  out, lse, ce, {});
        },
        {"k_scale", "256"});
  }
  // Scales with a float cache.
  {
    KVCacheBatch cf;
    cf.cache_seqlens = in.seqlens;
    cf.k_scale = qz.c.ks;
    test::require_error(
        [&] {
          diffattn::diff_attention_v2_kvcache<float>(in.q, in.k, in.v, in.logit, out, lse, cf, {});
        },
        {"k_scale", "8-bit"});
    cf.k_scale = {};
    cf.v_scale = qz.c.vs;
    const Tensor<diffattn::bfloat16, 4> kb = test::cast<diffattn::bfloat16>(in.k),
                                        vb = test::cast<diffattn::bfloat16>(in.v);
    test::require_error(
        [&] {
          diffattn::attention_kvcache<float, diffattn::bfloat16>(
              in.q, kb, vb, Tensor<float, 4>({2, 1, 4, 8}), {}, cf, {});
        },
        {"attention_kvcache", "v_scale", "16-bit"});
  }
  // Paged: the scale pools must match the block pools.
  {
    const QCache<std::int8_t> pc = paged(qz.c, 4);
    KVCacheBatch pb = cache;
    pb.block_table = pc.table;
    pb.k_scale = pc.ks;
    pb.v_scale = qz.c.vs;  // the contiguous scales: not the pool's shape
    test::require_error(
        [&] {
          diffattn::diff_attention_v2_kvcache<float, std::int8_t>(in.q, pc.k, pc.v, in.logit, out,
                                                                  lse, pb, {});
        },
        {"v_scale", "(2, 6, 1)", "num_blocks, block_size", "(6, 4, 1)"});
  }
}

namespace {

/// Prefill then token by token through `layer` (any T) with a cache of Q:
/// the outputs, widened to float.
template <class Q, class Layer>
Tensor<float, 3> decoded(Layer& layer, const Tensor<typename Layer::value_type, 3>& x,
                         index_t prefill) {
  using T = typename Layer::value_type;
  const index_t B = x.shape(0), N = x.shape(1), E = x.shape(2);
  auto cache = layer.template make_cache<Q>(B, N);
  Tensor<float, 3> y({B, N, E});
  for (index_t r = 0; r < N;) {
    const index_t n = r == 0 ? prefill : 1;
    const TensorView<const T, 3> xr(x.data() + r * E, {B, n, E}, {N * E, E, 1});
    const Tensor<T, 3> yr = layer.forward(xr, cache);
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < n; ++i)
        for (index_t e = 0; e < E; ++e) y(b, r + i, e) = static_cast<float>(yr(b, i, e));
    r += n;
  }
  REQUIRE(cache.size() == N);
  return y;
}

/// The small layers both 8-bit layer tests decode through (E = 64): V2 with
/// 2 DIFF heads on 2 kv heads of 16, V1 with 2 DIFF heads on 1 kv pair.
diffattn::DiffAttnV2Config small_v2() {
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = 64;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 16;
  cfg.causal = true;
  return cfg;
}
diffattn::DiffAttnV1Config small_v1() {
  diffattn::DiffAttnV1Config cfg;
  cfg.embed_dim = 64;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  cfg.depth = 2;
  cfg.causal = true;
  return cfg;
}

/// Relative output errors measured through those layers: int8 ~3e-3, e4m3
/// ~2e-2 (its 2^-4 relative rounding against int8's scale / 2 =
/// max |x| / 254).
template <class Q>
double layer_tolerance() {
  return std::is_same<Q, std::int8_t>::value ? 1e-2 : 6e-2;
}

}  // namespace

TEMPLATE_TEST_CASE("layers decode from 8-bit caches within the bound of the float forward",
                   "[quant][kv_cache]", std::int8_t, float8_e4m3) {
  using Q = TestType;
  const double tol = layer_tolerance<Q>();
  const Tensor<float, 3> x = random_tensor<float, 3>({2, 40, 64}, 21);
  {
    diffattn::MultiheadDiffAttnV2<float> layer(small_v2(), 5);
    const double err = rel_error(decoded<Q>(layer, x, 9), layer.forward(x));
    INFO("V2 " << qname<Q>() << " relative error " << err);
    CHECK(err > 0);
    REQUIRE(err <= tol);
  }
  {
    diffattn::MultiheadDiffAttnV1<float> layer(small_v1(), 6);
    const double err = rel_error(decoded<Q>(layer, x, 6), layer.forward(x));
    INFO("V1 " << qname<Q>() << " relative error " << err);
    REQUIRE(err <= tol);
  }
}

namespace {

/// A bfloat16 twin of `layer` decoding from a cache of Q (its bfloat16
/// queries over the 8-bit rows: kvcache<bfloat16, Q>), against the float
/// layer's whole-sequence forward: within tol (the float layer's 8-bit
/// tolerance above) plus twice e_b, the bfloat16 layer's own error on the
/// whole sequence (test_layers_half bounds it): the cache's quantization and
/// the layer's roundings, each counted once, and e_b again for the decoding
/// kernels (float arithmetic on the widened rows) against the tiled bf16 one.
template <class Q, template <class> class Layer>
void check_bf16_layer(Layer<float>& layer, const Tensor<float, 3>& x, index_t prefill, double tol) {
  using diffattn::bfloat16;
  Layer<bfloat16> narrow(layer);
  const Tensor<bfloat16, 3> xb = test::cast<bfloat16>(x);
  const Tensor<float, 3> xf = test::cast<float>(xb);  // the same tokens, exactly
  const Tensor<float, 3> full = layer.forward(xf);
  const double e_b = rel_error(test::cast<float>(narrow.forward(xb)), full);
  const double err = rel_error(decoded<Q>(narrow, xb, prefill), full);
  INFO(qname<Q>() << ": bfloat16 layer decoding " << err << ", its whole-sequence error " << e_b
                  << ", bound " << tol + 2 * e_b);
  CHECK(e_b > 0);
  REQUIRE(err <= tol + 2 * e_b);
}

}  // namespace

TEMPLATE_TEST_CASE("bfloat16 layers decode from 8-bit caches", "[quant][kv_cache][half]",
                   std::int8_t, float8_e4m3) {
  using Q = TestType;
  const Tensor<float, 3> x = random_tensor<float, 3>({2, 40, 64}, 22);
  diffattn::MultiheadDiffAttnV2<float> v2(small_v2(), 5);
  check_bf16_layer<Q>(v2, x, 9, layer_tolerance<Q>());
  diffattn::MultiheadDiffAttnV1<float> v1(small_v1(), 6);
  check_bf16_layer<Q>(v1, x, 6, layer_tolerance<Q>());
}

TEST_CASE("an 8-bit layer cache holds scales, counts them and keeps its state on failure",
          "[quant][kv_cache]") {
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = 64;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  cfg.causal = true;
  diffattn::MultiheadDiffAttnV2<float> layer(cfg, 5);
  auto c8 = layer.make_cache<std::int8_t>(2, 100);
  auto cb = layer.make_cache<diffattn::bfloat16>(2, 100);
  const double ratio = static_cast<double>(c8.bytes()) / static_cast<double>(cb.bytes());
  INFO("int8 / bf16 bytes " << ratio);
  REQUIRE(ratio <= 0.55);
  REQUIRE(ratio == Approx((64 + 4.0) / 128));
  const Tensor<float, 3> x = random_tensor<float, 3>({2, 5, 64}, 4);
  layer.forward(x, c8);
  REQUIRE(c8.size() == 5);
  REQUIRE(c8.key_scales().shape() == std::array<index_t, 3>{2, 5, 2});
  for (index_t b = 0; b < 2; ++b)
    for (index_t j = 0; j < 5; ++j)
      for (index_t h = 0; h < 2; ++h) {
        REQUIRE(c8.key_scales()(b, j, h) > 0);
        REQUIRE(c8.value_scales()(b, j, h) > 0);
      }
  const Tensor<float, 3> keys_before = [&] {
    Tensor<float, 3> t({2, 5, 2});
    for (index_t b = 0; b < 2; ++b)
      for (index_t j = 0; j < 5; ++j)
        for (index_t h = 0; h < 2; ++h) t(b, j, h) = c8.key_scales()(b, j, h);
    return t;
  }();
  Tensor<float, 3> bad = random_tensor<float, 3>({2, 3, 64}, 5);
  bad(1, 2, 7) = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_AS(layer.forward(bad, c8), diffattn::error);
  REQUIRE(c8.size() == 5);
  for (index_t b = 0; b < 2; ++b)
    for (index_t j = 0; j < 5; ++j)
      for (index_t h = 0; h < 2; ++h) REQUIRE(c8.key_scales()(b, j, h) == keys_before(b, j, h));
  // Windowed: scales move with their rows.
  cfg.window_left = 3;
  diffattn::MultiheadDiffAttnV2<float> wl(cfg, 5);
  auto cw = wl.make_cache<float8_e4m3>(1, 50);
  auto cf = wl.make_cache<float>(1, 50);
  const Tensor<float, 3> xw = random_tensor<float, 3>({1, 20, 64}, 8);
  for (index_t r = 0; r < 20; ++r) {
    const TensorView<const float, 3> xr(xw.data() + r * 64, {1, 1, 64}, {20 * 64, 64, 1});
    const Tensor<float, 3> a = wl.forward(xr, cw), b = wl.forward(xr, cf);
    REQUIRE(rel_error(a, b) < 0.1);
  }
  REQUIRE(cw.stored() <= 8);
  REQUIRE(cw.key_scales().shape(1) == cw.stored());
}
