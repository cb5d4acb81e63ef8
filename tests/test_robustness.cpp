// Defined numerics on hostile values, and safety under concurrent callers.
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/reference.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using test::random_tensor;

namespace {
AttentionOptions causal_options(int threads = 0) {
  AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  return o;
}

bool row_finite(const Tensor<float, 4>& t, index_t b, index_t i, index_t h) {
  for (index_t c = 0; c < t.shape(3); ++c)
    if (!std::isfinite(t(b, i, h, c))) return false;
  return true;
}
bool row_nan(const Tensor<float, 4>& t, index_t b, index_t i, index_t h) {
  for (index_t c = 0; c < t.shape(3); ++c)
    if (!std::isnan(t(b, i, h, c))) return false;
  return true;
}
}  // namespace

TEST_CASE("NaN in an input reaches only the output rows that read it", "[robustness][nan]") {
  // N = M = 70 spans two query blocks and many register tiles.
  const index_t N = 70, H = 2, d = 8;
  const auto q0 = random_tensor<float, 4>({1, N, 2 * H, d}, 1);
  const auto k0 = random_tensor<float, 4>({1, N, 2 * H, d}, 2);
  const auto v0 = random_tensor<float, 4>({1, N, H, 2 * d}, 3);
  Tensor<float, 4> clean({1, N, H, 2 * d}), out({1, N, H, 2 * d});
  diffattn::diff_attention_v1<float>(q0, k0, v0, 0.8f, clean, causal_options());
  const float nan = std::numeric_limits<float>::quiet_NaN();

  SECTION("a query row") {
    auto q = q0;
    q(0, 33, 1, 4) = nan;  // map 2 of DIFF head 0, query 33
    diffattn::diff_attention_v1<float>(q, k0, v0, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      CHECK(row_finite(out, 0, i, 1));
      if (i == 33)
        CHECK(row_nan(out, 0, i, 0));
      else
        CHECK(row_finite(out, 0, i, 0));
    }
  }
  SECTION("a key row: causal rows before it are untouched") {
    auto k = k0;
    k(0, 40, 0, 2) = nan;  // map 1 key of kv pair 0
    diffattn::diff_attention_v1<float>(q0, k, v0, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      if (i >= 40)
        CHECK(row_nan(out, 0, i, 0));
      else
        CHECK(row_finite(out, 0, i, 0));
    }
  }
  SECTION("a value row: causal rows before it are untouched") {
    auto v = v0;
    for (index_t j : {41, 42, 43}) v(0, j, 0, 5) = nan;  // inside one register tile of queries
    diffattn::diff_attention_v1<float>(q0, k0, v, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      INFO("row " << i);
      if (i >= 41)
        CHECK(std::isnan(out(0, i, 0, 5)));
      else {
        CHECK(row_finite(out, 0, i, 0));
        CHECK(out(0, i, 0, 5) == clean(0, i, 0, 5));
      }
      CHECK(row_finite(out, 0, i, 1));
    }
  }
}

TEST_CASE("logits of 1e4 in float do not overflow", "[robustness]") {
  const index_t N = 9, M = 13, d = 4;
  // Scores s q.k reach about 1e4.
  auto qf = random_tensor<float, 4>({1, N, 2, d}, 11, 70.0);
  auto kf = random_tensor<float, 4>({1, M, 2, d}, 12, 70.0);
  const auto vf = random_tensor<float, 4>({1, M, 1, 2 * d}, 13);
  Tensor<float, 4> out({1, N, 1, 2 * d});
  Tensor<float, 3> lse({1, 2, N});
  diffattn::diff_attention_v1<float>(qf, kf, vf, 0.5f, out, lse);
  CHECK(test::all_finite(out));
  CHECK(test::all_finite(lse));
  float max_lse = 0;
  for (index_t i = 0; i < lse.size(); ++i) max_lse = std::max(max_lse, std::abs(lse.data()[i]));
  CHECK(max_lse > 1000.0f);  // the logits really are large
  Tensor<double, 4> ref({1, N, 1, 2 * d});
  diffattn::reference::diff_attention_v1<double>(test::cast<double>(qf), test::cast<double>(kf),
                                                 test::cast<double>(vf), 0.5, ref);
  CHECK(test::rel_error(out, ref) < 1e-3);
}

TEST_CASE("lambda far outside [0, 1] still gives rows summing to 1 - lambda", "[robustness]") {
  const index_t N = 17, M = 23, H = 1, d = 8;
  const auto q = random_tensor<double, 4>({1, N, 2 * H, d}, 21);
  const auto k = random_tensor<double, 4>({1, M, 2 * H, d}, 22);
  Tensor<double, 4> ones({1, M, H, 2 * d});
  ones.fill(1.0);  // the output then reads out each row's sum of weights
  Tensor<double, 4> out({1, N, H, 2 * d});
  for (double lambda : {-50.0, -3.0, 7.5, 1e3}) {
    diffattn::diff_attention_v1<double>(q, k, ones, lambda, out, causal_options());
    for (index_t i = 0; i < N; ++i) REQUIRE(out(0, i, 0, 3) == Approx(1.0 - lambda).epsilon(1e-12));
  }
}

TEST_CASE("kernels are safe to call from several threads at once", "[robustness][threads]") {
  const index_t N = 97, H = 2, d = 16;
  std::vector<Tensor<float, 4>> qs, ks, vs, expect;
  for (std::uint64_t s = 0; s < 4; ++s) {
    qs.push_back(random_tensor<float, 4>({1, N, 2 * H, d}, 100 + s));
    ks.push_back(random_tensor<float, 4>({1, N, 2 * H, d}, 200 + s));
    vs.push_back(random_tensor<float, 4>({1, N, H, 2 * d}, 300 + s));
    expect.emplace_back(std::array<index_t, 4>{1, N, H, 2 * d});
    diffattn::diff_attention_v1<float>(qs[s], ks[s], vs[s], 0.7f, expect[s], causal_options(1));
  }
  std::vector<Tensor<float, 4>> got(4, Tensor<float, 4>({1, N, H, 2 * d}));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep)
        diffattn::diff_attention_v1<float>(qs[t], ks[t], vs[t], 0.7f, got[t],
                                           causal_options(t % 2 + 1));
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) CHECK(test::bitwise_equal(got[t], expect[t]));
}

TEST_CASE("layers: forward and gradients bitwise identical for 1 and 2 threads",
          "[robustness][threads]") {
  diffattn::DiffAttnV1Config c;
  c.embed_dim = 64;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  const auto x = random_tensor<float, 3>({2, 130, 64}, 31);  // 260 rows: the packed product path
  const auto dy = random_tensor<float, 3>({2, 130, 64}, 32);
  diffattn::MultiheadDiffAttnV1<float> a(c, 5), b(c, 5);
  a.set_num_threads(1);
  b.set_num_threads(2);
  const Tensor<float, 3> ya = a.forward(x), yb = b.forward(x);
  CHECK(test::bitwise_equal(ya, yb));
  const Tensor<float, 3> dxa = a.backward(dy), dxb = b.backward(dy);
  CHECK(test::bitwise_equal(dxa, dxb));
  const auto ga = a.gradients(), gb = b.gradients();
  for (const auto& kv : ga) {
    const auto& other = gb.at(kv.first);
    bool same = true;
    for (index_t i = 0; i < kv.second.size(); ++i) same = same && kv.second(i) == other(i);
    INFO(kv.first);
    CHECK(same);
  }
}
