#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/detail/core/fp_mode.hpp>
#include <diffattn/detail/core/random.hpp>
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

struct Shape {
  index_t B, N, M, H, Hkv, d;
};

constexpr double kFloatFloor = 2e-5;
constexpr double kDoubleTol = 1e-12;

AttentionOptions opts(bool causal, int threads = 0) {
  AttentionOptions o;
  o.causal = causal;
  o.num_threads = threads;
  return o;
}

// Runs V1 fused (float, double) and reference (float, double); checks the
// contract's error bounds and the lse output.
void check_v1(const Shape& s, bool causal, double lambda, std::uint64_t seed, double sigma = 1.0) {
  INFO("V1 B=" << s.B << " N=" << s.N << " M=" << s.M << " H=" << s.H << " Hkv=" << s.Hkv << " d="
               << s.d << " causal=" << causal << " lambda=" << lambda << " sigma=" << sigma);
  const auto qf = random_tensor<float, 4>({s.B, s.N, 2 * s.H, s.d}, seed, sigma);
  const auto kf = random_tensor<float, 4>({s.B, s.M, 2 * s.Hkv, s.d}, seed + 1, sigma);
  const auto vf = random_tensor<float, 4>({s.B, s.M, s.Hkv, 2 * s.d}, seed + 2);
  const auto qd = cast<double>(qf), kd = cast<double>(kf), vd = cast<double>(vf);
  Tensor<double, 4> ref({s.B, s.N, s.H, 2 * s.d}), fused_d(ref.shape());
  Tensor<float, 4> naive_f(ref.shape()), fused_f(ref.shape());
  Tensor<double, 3> lse_ref({s.B, 2 * s.H, s.N}), lse_d(lse_ref.shape());
  Tensor<float, 3> lse_f(lse_ref.shape());
  const auto o = opts(causal);
  diffattn::reference::diff_attention_v1<double>(qd, kd, vd, lambda, ref, lse_ref, o);
  diffattn::reference::diff_attention_v1<float>(qf, kf, vf, static_cast<float>(lambda), naive_f, o);
  diffattn::diff_attention_v1<double>(qd, kd, vd, lambda, fused_d, lse_d, o);
  diffattn::diff_attention_v1<float>(qf, kf, vf, static_cast<float>(lambda), fused_f, lse_f, o);
  REQUIRE(rel_error(fused_d, ref) < kDoubleTol);
  const double naive_err = rel_error(naive_f, ref);
  const double fused_err = rel_error(fused_f, ref);
  INFO("float errors: fused " << fused_err << ", naive " << naive_err);
  REQUIRE(fused_err <= std::max(2 * naive_err, kFloatFloor));
  REQUIRE(test::all_finite(fused_f));
  for (index_t i = 0; i < lse_ref.size(); ++i) {
    const double want = lse_ref.data()[i];
    if (std::isinf(want)) {
      REQUIRE(lse_d.data()[i] == want);
      REQUIRE(lse_f.data()[i] == static_cast<float>(want));
    } else {
      REQUIRE(std::abs(lse_d.data()[i] - want) <= 1e-12 * (1 + std::abs(want)));
      REQUIRE(std::abs(lse_f.data()[i] - want) <= 1e-5 * (1 + std::abs(want)));
    }
  }
}

void check_v2(const Shape& s, bool causal, std::uint64_t seed, double lambda_shift = 0) {
  INFO("V2 B=" << s.B << " N=" << s.N << " M=" << s.M << " H=" << s.H << " Hkv=" << s.Hkv
               << " d=" << s.d << " causal=" << causal << " lambda_shift=" << lambda_shift);
  const auto qf = random_tensor<float, 4>({s.B, s.N, 2 * s.H, s.d}, seed);
  const auto kf = random_tensor<float, 4>({s.B, s.M, s.Hkv, s.d}, seed + 1);
  const auto vf = random_tensor<float, 4>({s.B, s.M, s.Hkv, s.d}, seed + 2);
  auto lf = random_tensor<float, 3>({s.B, s.N, s.H}, seed + 3, 2.0);
  for (index_t i = 0; i < lf.size(); ++i) lf.data()[i] += static_cast<float>(lambda_shift);
  const auto qd = cast<double>(qf), kd = cast<double>(kf), vd = cast<double>(vf);
  const auto ld = cast<double>(lf);
  Tensor<double, 4> ref({s.B, s.N, s.H, s.d}), fused_d(ref.shape());
  Tensor<float, 4> naive_f(ref.shape()), fused_f(ref.shape());
  Tensor<double, 3> lse_ref({s.B, 2 * s.H, s.N}), lse_d(lse_ref.shape());
  const auto o = opts(causal);
  diffattn::reference::diff_attention_v2<double>(qd, kd, vd, ld, ref, lse_ref, o);
  diffattn::reference::diff_attention_v2<float>(qf, kf, vf, lf, naive_f, o);
  diffattn::diff_attention_v2<double>(qd, kd, vd, ld, fused_d, lse_d, o);
  diffattn::diff_attention_v2<float>(qf, kf, vf, lf, fused_f, o);
  REQUIRE(rel_error(fused_d, ref) < kDoubleTol);
  for (index_t i = 0; i < lse_ref.size(); ++i) {
    const double want = lse_ref.data()[i];
    if (std::isinf(want))
      REQUIRE(lse_d.data()[i] == want);
    else
      REQUIRE(std::abs(lse_d.data()[i] - want) <= 1e-12 * (1 + std::abs(want)));
  }
  const double naive_err = rel_error(naive_f, ref), fused_err = rel_error(fused_f, ref);
  INFO("float errors: fused " << fused_err << ", naive " << naive_err);
  REQUIRE(fused_err <= std::max(2 * naive_err, kFloatFloor));
}

void check_plain(const Shape& s, bool causal, std::uint64_t seed) {
  INFO("plain B=" << s.B << " N=" << s.N << " M=" << s.M << " Hq=" << s.H << " Hkv=" << s.Hkv
                  << " d=" << s.d << " causal=" << causal);
  const index_t dv = s.d + 3;  // value width independent of d
  const auto qf = random_tensor<float, 4>({s.B, s.N, s.H, s.d}, seed);
  const auto kf = random_tensor<float, 4>({s.B, s.M, s.Hkv, s.d}, seed + 1);
  const auto vf = random_tensor<float, 4>({s.B, s.M, s.Hkv, dv}, seed + 2);
  const auto qd = cast<double>(qf), kd = cast<double>(kf), vd = cast<double>(vf);
  Tensor<double, 4> ref({s.B, s.N, s.H, dv}), fused_d(ref.shape());
  Tensor<float, 4> naive_f(ref.shape()), fused_f(ref.shape());
  const auto o = opts(causal);
  diffattn::reference::attention<double>(qd, kd, vd, ref, o);
  diffattn::reference::attention<float>(qf, kf, vf, naive_f, o);
  diffattn::attention<double>(qd, kd, vd, fused_d, o);
  diffattn::attention<float>(qf, kf, vf, fused_f, o);
  REQUIRE(rel_error(fused_d, ref) < kDoubleTol);
  const double naive_err = rel_error(naive_f, ref), fused_err = rel_error(fused_f, ref);
  INFO("float errors: fused " << fused_err << ", naive " << naive_err);
  REQUIRE(fused_err <= std::max(2 * naive_err, kFloatFloor));
}

}  // namespace

TEST_CASE("diff_attention_v1 matches the float64 reference", "[attention][v1]") {
  std::uint64_t seed = 1000;
  // Sizes that are not tile multiples (tiles are 6 rows, 16 keys, blocks of 60).
  for (index_t n : {1, 7, 113, 129}) {
    for (bool causal : {false, true}) {
      check_v1({1, n, n, 2, 1, 8}, causal, 0.8, seed += 10);
    }
  }
  for (double lambda : {-0.3, 0.0, 0.8, 1.25})
    check_v1({2, 19, 23, 2, 2, 5}, true, lambda, seed += 10);
  // GQA ratios 1, 2, 4.
  for (index_t hkv : {4, 2, 1}) check_v1({1, 31, 31, 4, hkv, 16}, true, 0.5, seed += 10);
}

TEST_CASE("diff_attention_v1: decoding, N > M and large logits", "[attention][v1]") {
  std::uint64_t seed = 2000;
  for (index_t n : {1, 5}) {
    check_v1({2, n, 37, 2, 1, 8}, true, 0.8, seed += 10);
    check_v1({1, n, 37, 2, 2, 8}, false, 0.8, seed += 10);
  }
  // N > M with the causal mask: the first N - M rows see nothing and give zeros.
  check_v1({1, 40, 9, 1, 1, 4}, true, 0.6, seed += 10);
  check_v1({1, 4, 2, 2, 1, 4}, true, 0.6, seed += 10);    // a block of < 6 rows, two masked
  check_v1({1, 65, 65, 1, 1, 8}, true, 0.8, seed += 10);  // last block of 5 rows
  // Logits in the hundreds: exp would overflow without the max shift.
  check_v1({1, 17, 21, 1, 1, 8}, true, 0.8, seed += 10, 12.0);
}

TEST_CASE("diff_attention_v1: long sequence of 1000", "[attention][v1][long]") {
  check_v1({1, 1000, 1000, 1, 1, 16}, true, 0.8, 3000);
}

TEST_CASE("diff_attention_v2 matches the float64 reference", "[attention][v2]") {
  std::uint64_t seed = 4000;
  for (index_t n : {1, 7, 113}) {
    for (bool causal : {false, true}) check_v2({1, n, n + 3, 2, 2, 8}, causal, seed += 10);
  }
  // GQA: 2H / Hkv in {2, 4, 8}.
  for (index_t hkv : {4, 2, 1}) check_v2({2, 29, 29, 4, hkv, 12}, true, seed += 10);
  check_v2({1, 1, 37, 2, 1, 8}, true, seed += 10);
  check_v2({1, 5, 37, 2, 1, 8}, true, seed += 10);
  check_v2({1, 30, 11, 1, 1, 8}, true, seed += 10);  // fully masked rows
  check_v2({1, 1000, 1000, 1, 1, 16}, true, seed += 10);
}

TEST_CASE("attention (plain) matches the float64 reference", "[attention][plain]") {
  std::uint64_t seed = 5000;
  for (index_t n : {1, 7, 113, 129}) {
    for (bool causal : {false, true}) check_plain({1, n, n, 2, 1, 8}, causal, seed += 10);
  }
  for (index_t hkv : {4, 2, 1}) check_plain({2, 17, 33, 4, hkv, 16}, true, seed += 10);
  check_plain({1, 1, 37, 2, 2, 8}, true, seed += 10);
  check_plain({1, 20, 7, 1, 1, 8}, true, seed += 10);
}

TEST_CASE("V1 equals attention(q1, k1, v) - lambda attention(q2, k2, v)", "[attention][v1]") {
  const index_t B = 2, N = 23, M = 31, H = 4, Hkv = 2, d = 8;
  const auto q = random_tensor<double, 4>({B, N, 2 * H, d}, 61);
  const auto k = random_tensor<double, 4>({B, M, 2 * Hkv, d}, 62);
  const auto v = random_tensor<double, 4>({B, M, Hkv, 2 * d}, 63);
  const double lambda = 0.7;
  Tensor<double, 4> out({B, N, H, 2 * d});
  const auto o = opts(true);
  diffattn::diff_attention_v1<double>(q, k, v, lambda, out, o);
  // Even query heads are map 1, odd map 2; even key heads map 1, odd map 2.
  auto heads = [](const Tensor<double, 4>& t, index_t parity) {
    const auto& s = t.shape();
    return TensorView<const double, 4>(t.data() + parity * s[3], {s[0], s[1], s[2] / 2, s[3]},
                                       {s[1] * s[2] * s[3], s[2] * s[3], 2 * s[3], 1});
  };
  Tensor<double, 4> a1({B, N, H, 2 * d}), a2({B, N, H, 2 * d});
  diffattn::attention<double>(heads(q, 0), heads(k, 0), v, a1, o);
  diffattn::attention<double>(heads(q, 1), heads(k, 1), v, a2, o);
  double err = 0;
  for (index_t i = 0; i < out.size(); ++i)
    err = std::max(err, std::abs(out.data()[i] - (a1.data()[i] - lambda * a2.data()[i])));
  CHECK(err < 1e-13);
}

TEST_CASE("V1 with one lambda per head", "[attention][v1]") {
  const index_t N = 13, M = 13, H = 3, d = 4;
  const auto q = random_tensor<double, 4>({1, N, 2 * H, d}, 71);
  const auto k = random_tensor<double, 4>({1, M, 2 * H, d}, 72);
  const auto v = random_tensor<double, 4>({1, M, H, 2 * d}, 73);
  std::vector<double> lambdas = {-0.3, 0.4, 1.25};
  TensorView<const double, 1> lv(lambdas.data(), {H});
  Tensor<double, 4> out({1, N, H, 2 * d}), ref({1, N, H, 2 * d}), one({1, N, H, 2 * d});
  diffattn::diff_attention_v1<double>(q, k, v, lv, out, opts(true));
  diffattn::reference::diff_attention_v1<double>(q, k, v, lv, ref, opts(true));
  CHECK(rel_error(out, ref) < kDoubleTol);
  for (index_t h = 0; h < H; ++h) {
    diffattn::diff_attention_v1<double>(q, k, v, lambdas[h], one, opts(true));
    for (index_t i = 0; i < N; ++i)
      for (index_t c = 0; c < 2 * d; ++c)
        REQUIRE(std::abs(one(0, i, h, c) - out(0, i, h, c)) < 1e-14);
  }
}

TEST_CASE("V2 with lambda_logit -> -inf is plain attention of the first head of each pair",
          "[attention][v2]") {
  const index_t B = 1, N = 17, M = 17, H = 2, Hkv = 2, d = 8;
  const auto q = random_tensor<double, 4>({B, N, 2 * H, d}, 81);
  const auto k = random_tensor<double, 4>({B, M, Hkv, d}, 82);
  const auto v = random_tensor<double, 4>({B, M, Hkv, d}, 83);
  Tensor<double, 3> logit({B, N, H});
  logit.fill(-std::numeric_limits<double>::infinity());
  Tensor<double, 4> out({B, N, H, d}), plain({B, N, 2 * H, d});
  diffattn::diff_attention_v2<double>(q, k, v, logit, out, opts(true));
  diffattn::attention<double>(q, k, v, plain, opts(true));
  for (index_t i = 0; i < N; ++i)
    for (index_t h = 0; h < H; ++h)
      for (index_t c = 0; c < d; ++c)
        REQUIRE(out(0, i, h, c) == Approx(plain(0, i, 2 * h, c)).margin(1e-14));
}

TEST_CASE("strided (B, H, N, D) inputs and outputs need no copy", "[attention]") {
  const index_t B = 2, N = 21, M = 26, H = 2, d = 8;
  // Memory laid out (B, 2H, N, d) etc., viewed as (B, N, heads, d).
  auto bhnd = [](const Tensor<double, 4>& t) {  // t is (B, heads, S, D)
    const auto& s = t.shape();
    return TensorView<const double, 4>(t.data(), {s[0], s[2], s[1], s[3]},
                                       {s[1] * s[2] * s[3], s[3], s[2] * s[3], 1});
  };
  const auto q = random_tensor<double, 4>({B, 2 * H, N, d}, 91);
  const auto k = random_tensor<double, 4>({B, 2 * H, M, d}, 92);
  const auto v = random_tensor<double, 4>({B, H, M, 2 * d}, 93);
  Tensor<double, 4> out_mem({B, H, N, 2 * d});
  TensorView<double, 4> out(out_mem.data(), {B, N, H, 2 * d}, {H * N * 2 * d, 2 * d, N * 2 * d, 1});
  diffattn::diff_attention_v1<double>(bhnd(q), bhnd(k), bhnd(v), 0.8, out, opts(true));
  // Same data copied to contiguous (B, N, H, D).
  using test::contiguous;
  Tensor<double, 4> ref({B, N, H, 2 * d});
  diffattn::reference::diff_attention_v1<double>(contiguous(bhnd(q)), contiguous(bhnd(k)),
                                                 contiguous(bhnd(v)), 0.8, ref, opts(true));
  CHECK(rel_error(contiguous(out), ref) < kDoubleTol);

  // A slice of a larger KV cache: the first M of 40 cached positions.
  const auto cache_k = random_tensor<double, 4>({B, 40, 2 * H, d}, 94);
  TensorView<const double, 4> k_slice(cache_k.data(), {B, M, 2 * H, d},
                                      {40 * 2 * H * d, 2 * H * d, d, 1});
  Tensor<double, 4> o1({B, N, H, 2 * d}), o2({B, N, H, 2 * d});
  diffattn::diff_attention_v1<double>(bhnd(q), k_slice, bhnd(v), 0.8, o1, opts(true));
  diffattn::reference::diff_attention_v1<double>(bhnd(q), contiguous(k_slice), bhnd(v), 0.8, o2,
                                                 opts(true));
  CHECK(rel_error(o1, o2) < kDoubleTol);
}

TEST_CASE("results are bitwise identical for 1 and 2 threads", "[attention][threads]") {
  const index_t B = 2, N = 150, M = 150, H = 3, d = 16;
  const auto q = random_tensor<float, 4>({B, N, 2 * H, d}, 101);
  const auto k = random_tensor<float, 4>({B, M, 2 * H, d}, 102);
  const auto v = random_tensor<float, 4>({B, M, H, 2 * d}, 103);
  Tensor<float, 4> o1({B, N, H, 2 * d}), o2({B, N, H, 2 * d});
  Tensor<float, 3> l1({B, 2 * H, N}), l2({B, 2 * H, N});
  for (bool causal : {false, true}) {
    diffattn::diff_attention_v1<float>(q, k, v, 0.8f, o1, l1, opts(causal, 1));
    diffattn::diff_attention_v1<float>(q, k, v, 0.8f, o2, l2, opts(causal, 2));
    CHECK(test::bitwise_equal(o1, o2));
    CHECK(test::bitwise_equal(l1, l2));
  }
}

#if DIFFATTN_DETAIL_FLUSH_MXCSR
TEST_CASE("the kernels read denormal inputs as zero (DIFFATTN_FLUSH_DENORMALS)",
          "[attention][denormals]") {
  // q below 2^-128 in magnitude (every element a denormal), k up to 2^126:
  // in IEEE arithmetic the scores are O(0.1) and the weights uneven; with DAZ
  // q reads as 0, every score is 0 and each row is the mean of v over its keys
  // (lse = log of their count). So the output tells whether the call ran
  // flushed, here and through every diffattn::dispatch variant.
  const index_t M = 41, H = 2, d = 16;
  for (index_t N : {3, 37}) {  // the decoding step (< 6 queries) and the block kernel
    INFO("N = " << N);
    diffattn::detail::Rng rng(9000 + static_cast<std::uint64_t>(N));
    Tensor<float, 4> q({1, N, H, d}), k({1, M, 1, d});
    for (index_t i = 0; i < q.size(); ++i)
      q.data()[i] = std::ldexp(static_cast<float>(rng.uniform(-1, 1)), -128);
    for (index_t i = 0; i < k.size(); ++i)
      k.data()[i] = std::ldexp(static_cast<float>(rng.uniform(-1, 1)), 126);
    const auto v = random_tensor<float, 4>({1, M, 1, d}, 9100);
    Tensor<float, 4> out({1, N, H, d});
    Tensor<float, 3> lse({1, H, N});
    Tensor<double, 4> ieee({1, N, H, d});
    for (bool causal : {false, true}) {
      INFO("causal " << causal);
      diffattn::attention<float>(q, k, v, out, lse, opts(causal));
      diffattn::reference::attention<double>(cast<double>(q), cast<double>(k), cast<double>(v),
                                             ieee, opts(causal));
      double flushed_err = 0, ieee_diff = 0;
      for (index_t i = 0; i < N; ++i) {
        const index_t keys = causal ? i + M - N + 1 : M;
        for (index_t h = 0; h < H; ++h) {
          CHECK(lse(0, h, i) == Approx(std::log(static_cast<double>(keys))).epsilon(1e-6));
          for (index_t c = 0; c < d; ++c) {
            double mean = 0;
            for (index_t j = 0; j < keys; ++j) mean += v(0, j, 0, c);
            mean /= static_cast<double>(keys);
            flushed_err = std::max(flushed_err, std::abs(out(0, i, h, c) - mean));
            ieee_diff = std::max(ieee_diff, std::abs(ieee(0, i, h, c) - mean));
          }
        }
      }
      CHECK(flushed_err < 1e-5);
      CHECK(ieee_diff > 1e-2);  // unflushed, the same inputs give another answer
    }
  }
}
#endif

TEST_CASE("zero-sized batch, queries or keys", "[attention]") {
  const auto q = random_tensor<float, 4>({1, 4, 2, 8}, 111);
  const auto k0 = random_tensor<float, 4>({1, 0, 2, 8}, 112);
  const auto v0 = random_tensor<float, 4>({1, 0, 1, 16}, 113);
  Tensor<float, 4> out({1, 4, 1, 16});
  out.fill(7.0f);
  Tensor<float, 3> lse({1, 2, 4});
  diffattn::diff_attention_v1<float>(q, k0, v0, 0.5f, out, lse);
  for (index_t i = 0; i < out.size(); ++i) REQUIRE(out.data()[i] == 0.0f);
  for (index_t i = 0; i < lse.size(); ++i)
    REQUIRE(lse.data()[i] == -std::numeric_limits<float>::infinity());
  const auto q0 = random_tensor<float, 4>({0, 4, 2, 8}, 114);
  const auto k = random_tensor<float, 4>({0, 5, 2, 8}, 115);
  const auto v = random_tensor<float, 4>({0, 5, 1, 16}, 116);
  Tensor<float, 4> out0({0, 4, 1, 16});
  diffattn::diff_attention_v1<float>(q0, k, v, 0.5f, out0);
  CHECK(out0.size() == 0);
}

TEST_CASE("kernels reject bad input with diffattn::error", "[attention][errors]") {
  const auto q = random_tensor<float, 4>({1, 5, 4, 8}, 121);
  const auto k = random_tensor<float, 4>({1, 6, 4, 8}, 122);
  const auto v = random_tensor<float, 4>({1, 6, 2, 16}, 123);
  Tensor<float, 4> out({1, 5, 2, 16});
  const auto k3 = random_tensor<float, 4>({1, 6, 3, 8}, 124);
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k3, v, 0.5f, out); },
                      {"diff_attention_v1", "k has 3 heads", "2*Hkv", "(1, 5, 4, 8)"});
  const auto v_narrow = random_tensor<float, 4>({1, 6, 2, 8}, 125);
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v_narrow, 0.5f, out); },
                      {"diff_attention_v1", "v has shape (1, 6, 2, 8)", "(1, 6, 2, 16)"});
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, std::nanf(""), out); },
                      {"diff_attention_v1", "lambda", "finite"});
  TensorView<const float, 4> q_strided(q.data(), {1, 5, 2, 4}, {160, 32, 8, 2});
  test::require_error([&] { diffattn::attention<float>(q_strided, k, v, out); },
                      {"attention", "q", "contiguous", "(160, 32, 8, 2)"});
  TensorView<float, 4> alias(const_cast<float*>(q.data()), {1, 5, 2, 16});
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, alias); },
                      {"diff_attention_v1", "out", "overlaps", "q"});
  // V2: a pair split across two GQA groups (2H / Hkv odd).
  const auto q6 = random_tensor<float, 4>({1, 5, 6, 8}, 126);
  const auto k2 = random_tensor<float, 4>({1, 6, 2, 8}, 127);
  const auto v2 = random_tensor<float, 4>({1, 6, 2, 8}, 128);
  Tensor<float, 3> logit({1, 5, 3});
  Tensor<float, 4> out2({1, 5, 3, 8});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q6, k2, v2, logit, out2); },
                      {"diff_attention_v2", "straddle", "2H / Hkv = 6 / 2 = 3"});
  const auto q4 = random_tensor<float, 4>({1, 5, 4, 8}, 129);
  Tensor<float, 4> out4({1, 5, 2, 8});
  test::require_error([&] { diffattn::diff_attention_v2<float>(q4, k2, v2, logit, out4); },
                      {"diff_attention_v2", "lambda_logit", "(1, 5, 3)", "(1, 5, 2)"});
  const auto k_wide = random_tensor<float, 4>({1, 6, 2, 9}, 130);
  test::require_error([&] { diffattn::attention<float>(q, k_wide, v, out); },
                      {"attention", "k has shape (1, 6, 2, 9)", "d = 8"});
  Tensor<float, 3> lse_bad({1, 3, 5});
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, lse_bad); },
                      {"diff_attention_v1", "lse", "(1, 3, 5)", "(1, 4, 5)"});
  AttentionOptions neg;
  neg.num_threads = -2;
  test::require_error([&] { diffattn::diff_attention_v1<float>(q, k, v, 0.5f, out, neg); },
                      {"diff_attention_v1", "num_threads"});
}
