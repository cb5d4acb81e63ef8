// Mergeable softmax states: keys split at arbitrary points, each chunk run by
// the plain kernel with its part of the causal mask, merged, equal one call.
#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/states.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;
using test::rel_error;

namespace {

/// Keys [a, b) of k (B, M, H, D) as a view.
template <class T>
TensorView<const T, 4> key_slice(const Tensor<T, 4>& k, index_t a, index_t b) {
  const auto& s = k.shape();
  return TensorView<const T, 4>(k.data() + a * s[2] * s[3], {s[0], b - a, s[2], s[3]},
                                {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1});
}

/// Plain attention of q over keys split at `cuts` (0 = cuts[0] <= ... <= cuts.back() = M),
/// merged chunk by chunk; a causal mask over all keys becomes, for chunk [a, b),
/// window_right = M - b (key j of the chunk is visible iff a + j <= i + M - N).
template <class T>
void split_and_merge(const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                     bool causal, const std::vector<index_t>& cuts, Tensor<T, 4>& out,
                     Tensor<T, 3>& lse, int threads) {
  const index_t M = k.shape(1);
  out.fill(T(0));
  lse.fill(-std::numeric_limits<T>::infinity());
  Tensor<T, 4> o_c(out.shape());
  Tensor<T, 3> l_c(lse.shape());
  for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
    const index_t a = cuts[c], b = cuts[c + 1];
    AttentionOptions o;
    o.num_threads = threads;
    if (causal) o.window_right = M - b;
    diffattn::attention<T>(q, key_slice(k, a, b), key_slice(v, a, b), o_c, l_c, o);
    diffattn::merge_states<T>(out, lse, o_c, l_c, threads);
  }
}

}  // namespace

TEST_CASE("split keys merged equal one call", "[states]") {
  std::uint64_t seed = 9500;
  struct Case {
    index_t B, N, M, H, Hkv, d;
    std::vector<index_t> cuts;
  };
  const std::vector<Case> cases = {
      {1, 7, 40, 2, 1, 8, {0, 13, 13, 29, 40}},      // an empty chunk
      {2, 1, 100, 4, 2, 16, {0, 1, 50, 99, 100}},    // decoding, chunks of 1 key
      {1, 30, 20, 2, 2, 8, {0, 5, 20}},              // N > M: rows with no visible key
      {1, 61, 61, 2, 1, 8, {0, 7, 30, 31, 60, 61}},  // odd cuts
      {1, 5, 3, 1, 1, 4, {0, 0, 0, 3}},              // empty first chunks
  };
  for (const Case& c : cases) {
    for (bool causal : {false, true}) {
      INFO("N=" << c.N << " M=" << c.M << " causal=" << causal);
      const auto q = random_tensor<double, 4>({c.B, c.N, c.H, c.d}, seed += 10);
      const auto k = random_tensor<double, 4>({c.B, c.M, c.Hkv, c.d}, seed + 1);
      const auto v = random_tensor<double, 4>({c.B, c.M, c.Hkv, c.d + 2}, seed + 2);
      Tensor<double, 4> whole({c.B, c.N, c.H, c.d + 2}), merged(whole.shape());
      Tensor<double, 3> lw({c.B, c.H, c.N}), lm(lw.shape());
      AttentionOptions o;
      o.causal = causal;
      diffattn::attention<double>(q, k, v, whole, lw, o);
      split_and_merge(q, k, v, causal, c.cuts, merged, lm, 0);
      CHECK(rel_error(merged, whole) < 1e-13);
      for (index_t i = 0; i < lw.size(); ++i) {
        const double want = lw.data()[i];
        if (std::isinf(want))
          REQUIRE(lm.data()[i] == want);
        else
          REQUIRE(std::abs(lm.data()[i] - want) <= 1e-13 * (1 + std::abs(want)));
      }
      CHECK(test::all_finite(merged));
      // Float, and the thread count changes nothing.
      const auto qf = test::cast<float>(q), kf = test::cast<float>(k), vf = test::cast<float>(v);
      Tensor<float, 4> m1(whole.shape()), m2(whole.shape());
      Tensor<float, 3> l1(lw.shape()), l2(lw.shape());
      split_and_merge(qf, kf, vf, causal, c.cuts, m1, l1, 1);
      split_and_merge(qf, kf, vf, causal, c.cuts, m2, l2, 2);
      CHECK(test::bitwise_equal(m1, m2));
      CHECK(test::bitwise_equal(l1, l2));
      CHECK(rel_error(m1, whole) < 1e-5);
    }
  }
}

TEST_CASE("merging special states", "[states]") {
  const double inf = std::numeric_limits<double>::infinity();
  Tensor<double, 4> oa({1, 4, 1, 2}), ob({1, 4, 1, 2});
  Tensor<double, 3> la({1, 1, 4}), lb({1, 1, 4});
  // Row 0: both empty. Row 1: a empty. Row 2: both +inf. Row 3: NaN in b.
  const double lav[4] = {-inf, -inf, inf, 0.5}, lbv[4] = {-inf, 1.0, inf, std::nan("")};
  for (index_t i = 0; i < 4; ++i) {
    la(0, 0, i) = lav[i];
    lb(0, 0, i) = lbv[i];
    for (index_t c = 0; c < 2; ++c) {
      oa(0, i, 0, c) = i == 0 ? 0.0 : 1.0 + c;
      ob(0, i, 0, c) = 3.0 + c;
    }
  }
  diffattn::merge_states<double>(oa, la, ob, lb);
  CHECK(la(0, 0, 0) == -inf);
  CHECK(oa(0, 0, 0, 0) == 0.0);
  CHECK(la(0, 0, 1) == 1.0);
  CHECK(oa(0, 1, 0, 1) == 4.0);
  CHECK(la(0, 0, 2) == inf);  // logaddexp(inf, inf) = inf, no NaN
  CHECK(oa(0, 2, 0, 0) == Approx(0.5 * 1.0 + 0.5 * 3.0));
  CHECK(std::isnan(la(0, 0, 3)));
  CHECK(std::isnan(oa(0, 3, 0, 0)));
  // Far-apart lse values: no overflow.
  Tensor<double, 3> lx({1, 1, 4}), ly({1, 1, 4});
  lx.fill(800.0);
  ly.fill(-800.0);
  Tensor<double, 4> ox({1, 4, 1, 2}), oy({1, 4, 1, 2});
  ox.fill(1.0);
  oy.fill(-1.0);
  diffattn::merge_states<double>(ox, lx, oy, ly);
  CHECK(lx(0, 0, 0) == Approx(800.0));
  CHECK(ox(0, 0, 0, 0) == Approx(1.0));
}

TEST_CASE("merge_states rejects bad input", "[states][errors]") {
  Tensor<float, 4> oa({1, 4, 2, 8}), ob({1, 4, 2, 9});
  Tensor<float, 3> la({1, 2, 4}), lb({1, 2, 4}), lbad({1, 4, 2});
  test::require_error([&] { diffattn::merge_states<float>(oa, la, ob, lb); },
                      {"merge_states", "o_b has shape (1, 4, 2, 9)", "(1, 4, 2, 8)"});
  Tensor<float, 4> ob2({1, 4, 2, 8});
  test::require_error([&] { diffattn::merge_states<float>(oa, la, ob2, lbad); },
                      {"merge_states", "lse_b", "(1, 4, 2)", "(1, 2, 4)"});
  test::require_error([&] { diffattn::merge_states<float>(oa, la, oa, lb); },
                      {"merge_states", "overlap"});
}
