// KV caches of the layers: prefill then token-by-token decoding equals forward
// on the whole sequence; windowed caches stay bounded; a full cache refuses an
// append and changes nothing.
#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/module.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::index_t;
using diffattn::KVCache;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;

namespace {

/// Tokens [a, a + n) of x (B, N, E).
template <class T>
TensorView<const T, 3> tokens(const Tensor<T, 3>& x, index_t a, index_t n) {
  const auto& s = x.shape();
  return TensorView<const T, 3>(x.data() + a * s[2], {s[0], n, s[2]}, {s[1] * s[2], s[2], 1});
}

/// max |y_cached - y_full| / max |y_full| over the tokens [a, a + n) of y_full.
template <class T>
double rel_diff(const Tensor<T, 3>& part, const Tensor<T, 3>& full, index_t a) {
  double num = 0, den = 0;
  for (index_t b = 0; b < part.shape(0); ++b)
    for (index_t i = 0; i < part.shape(1); ++i)
      for (index_t e = 0; e < part.shape(2); ++e) {
        const double want = full(b, a + i, e);
        num = std::max(num, std::abs(double(part(b, i, e)) - want));
        den = std::max(den, std::abs(want));
      }
  return den > 0 ? num / den : num;
}

/// Feeds x through the cache in the given chunk sizes (prefill, then decoding)
/// and compares every chunk's output with forward on the whole sequence.
template <class Layer, class T = typename Layer::value_type>
void check_incremental(Layer& m, const std::vector<index_t>& chunks, std::uint64_t seed) {
  index_t total = 0;
  for (index_t c : chunks) total += c;
  const index_t B = 2, E = m.config().embed_dim;
  const Tensor<T, 3> x = random_tensor<T, 3>({B, total, E}, seed, 0.5);
  const Tensor<T, 3> full = m.forward(x);
  auto cache = m.make_cache(B, total + 3);
  const double tol = std::is_same<T, float>::value ? 1e-5 : 1e-12;
  index_t a = 0;
  for (index_t c : chunks) {
    INFO("chunk of " << c << " at " << a);
    const Tensor<T, 3> y = m.forward(tokens(x, a, c), cache);
    CHECK(rel_diff(y, full, a) < tol);
    a += c;
    CHECK(cache.size() == a);
  }
}

std::vector<index_t> prefill_then_decode(index_t prefill, index_t decode) {
  std::vector<index_t> c = {prefill};
  for (index_t i = 0; i < decode; ++i) c.push_back(1);
  return c;
}

}  // namespace

TEMPLATE_TEST_CASE("V1: prefill and decoding equal forward on the whole sequence", "[kv_cache]",
                   float, double) {
  std::uint64_t seed = 9600;
  for (index_t hkv : {2, 1})
    for (bool rope : {true, false}) {
      DiffAttnV1Config cfg;
      cfg.embed_dim = 32;
      cfg.num_heads = 2;
      cfg.num_kv_heads = hkv;
      cfg.rope = rope;
      cfg.depth = 3;
      MultiheadDiffAttnV1<TestType> m(cfg, seed++);
      INFO("Hkv " << hkv << " rope " << rope);
      check_incremental(m, prefill_then_decode(13, 12), seed++);
      check_incremental(m, {1, 1, 70, 5, 1, 2}, seed++);  // chunks across a block boundary
    }
}

TEMPLATE_TEST_CASE("V2: prefill and decoding equal forward on the whole sequence", "[kv_cache]",
                   float, double) {
  std::uint64_t seed = 9700;
  for (index_t hkv : {2, 1})
    for (bool rope : {true, false}) {
      DiffAttnV2Config cfg;
      cfg.embed_dim = 24;
      cfg.num_heads = 2;
      cfg.num_kv_heads = hkv;
      cfg.rope = rope;
      MultiheadDiffAttnV2<TestType> m(cfg, seed++);
      INFO("Hkv " << hkv << " rope " << rope);
      check_incremental(m, prefill_then_decode(9, 15), seed++);
      check_incremental(m, {64, 3, 1}, seed++);
    }
}

TEST_CASE("a windowed layer's cache holds at most 2W rows and decodes exactly", "[kv_cache]") {
  for (index_t W : {1, 4, 9}) {
    INFO("window of " << W << " tokens");
    DiffAttnV1Config c1;
    c1.embed_dim = 32;
    c1.num_heads = 2;
    c1.num_kv_heads = 1;
    c1.window_left = W - 1;
    MultiheadDiffAttnV1<double> m1(c1, 41);
    check_incremental(m1, prefill_then_decode(7, 30), 9801);
    check_incremental(m1, {20, 1, 13, 2, 1, 25, 1}, 9802);  // chunks longer than the buffer
    DiffAttnV2Config c2;
    c2.embed_dim = 24;
    c2.num_heads = 2;
    c2.window_left = W - 1;
    MultiheadDiffAttnV2<double> m2(c2, 42);
    check_incremental(m2, prefill_then_decode(3, 40), 9803);
    // Memory bounded by the window, not the sequence.
    auto cache = m2.make_cache(1, 100000);
    const auto x = random_tensor<double, 3>({1, 1, 24}, 9804);
    for (int t = 0; t < 50; ++t) m2.forward(x, cache);
    CHECK(cache.size() == 50);
    CHECK(cache.stored() <= W - 1);
    CHECK(cache.bytes() <= static_cast<std::size_t>(2 * W * 2 * 2 * 12) * sizeof(double));
  }
}

TEST_CASE("a failed append in several pieces leaves a windowed cache as it was", "[kv_cache]") {
  // keep 3: 8 rows of storage, so 12 new tokens go in pieces, and the second
  // piece's reserve overwrites rows the cache held before the append.
  using diffattn::detail::module_cache_append;
  auto fill = [](index_t n, std::uint64_t seed) {
    return std::make_pair(random_tensor<double, 4>({2, n, 1, 3}, seed),
                          random_tensor<double, 4>({2, n, 2, 2}, seed + 1));
  };
  auto none = [](index_t, index_t, auto, auto) {};
  using test::contiguous;
  auto first = fill(5, 9871), more = fill(12, 9873);
  KVCache<double> cache(2, 100, 1, 3, 2, 2, 3), twin = cache;
  module_cache_append(cache, first.first, first.second, none);
  module_cache_append(twin, first.first, first.second, none);
  REQUIRE(more.first.shape(1) > cache.max_append());
  const Tensor<double, 4> k0 = contiguous(cache.keys()), v0 = contiguous(cache.values());
  int calls = 0;
  auto fail_second = [&](index_t, index_t, auto, auto) {
    if (++calls == 2) throw std::runtime_error("attend failed");
  };
  REQUIRE_THROWS_WITH(module_cache_append(cache, more.first, more.second, fail_second),
                      "attend failed");
  CHECK(calls == 2);
  CHECK(cache.size() == 5);
  REQUIRE(cache.stored() == k0.shape(1));
  CHECK(test::bitwise_equal(contiguous(cache.keys()), k0));
  CHECK(test::bitwise_equal(contiguous(cache.values()), v0));
  // And it goes on as a cache that never saw the failed append.
  module_cache_append(cache, more.first, more.second, none);
  module_cache_append(twin, more.first, more.second, none);
  CHECK(cache.size() == 17);
  CHECK(test::bitwise_equal(contiguous(cache.keys()), contiguous(twin.keys())));
  CHECK(test::bitwise_equal(contiguous(cache.values()), contiguous(twin.values())));
}

TEST_CASE("a full cache refuses an append and changes nothing", "[kv_cache]") {
  DiffAttnV2Config cfg;
  cfg.embed_dim = 24;
  cfg.num_heads = 2;
  MultiheadDiffAttnV2<double> m(cfg, 5);
  const auto x = random_tensor<double, 3>({1, 10, 24}, 9901);
  const Tensor<double, 3> full = m.forward(x);
  auto cache = m.make_cache(1, 8);
  m.forward(tokens(x, 0, 6), cache);
  test::require_error(
      [&] { m.forward(tokens(x, 6, 3), cache); },
      {"MultiheadDiffAttnV2::forward", "cannot append 3 tokens", "holding 6", "capacity 8"});
  CHECK(cache.size() == 6);
  CHECK(cache.stored() == 6);
  // Still usable: the next two tokens match the full forward.
  const Tensor<double, 3> y = m.forward(tokens(x, 6, 2), cache);
  CHECK(rel_diff(y, full, 6) < 1e-12);
  CHECK(cache.size() == 8);
  cache.clear();
  CHECK(cache.size() == 0);
  const Tensor<double, 3> y0 = m.forward(tokens(x, 0, 3), cache);
  CHECK(rel_diff(y0, full, 0) < 1e-12);
}

TEST_CASE("caches refuse another layer, batch or a non-causal layer", "[kv_cache][errors]") {
  DiffAttnV1Config c1;
  c1.embed_dim = 32;
  c1.num_heads = 2;
  MultiheadDiffAttnV1<float> m1(c1, 1);
  c1.num_kv_heads = 1;
  MultiheadDiffAttnV1<float> gqa(c1, 1);
  auto cache = m1.make_cache(2, 16);
  const auto x = random_tensor<float, 3>({2, 3, 32}, 9951);
  test::require_error([&] { gqa.forward(x, cache); },
                      {"MultiheadDiffAttnV1::forward", "make_cache"});
  const auto x1 = random_tensor<float, 3>({1, 3, 32}, 9952);
  test::require_error([&] { m1.forward(x1, cache); }, {"batch 2", "(1, 3, 32)"});
  c1.causal = false;
  MultiheadDiffAttnV1<float> bidir(c1, 1);
  test::require_error([&] { bidir.make_cache(1, 4); }, {"make_cache", "causal"});
  // A cached forward keeps nothing for backward.
  m1.forward(x);
  m1.forward(x, cache);
  test::require_error([&] { m1.backward(x); }, {"backward called before forward"});
  test::require_error([&] { KVCache<float>(1, -1, 1, 1, 1, 1); }, {"KVCache", "capacity"});
}

TEST_CASE("the row-level calls refuse rows outside the storage or the reservation",
          "[kv_cache][errors]") {
  using test::contiguous;
  // 2 sequences, capacity 6, keys 2 x 3, values 1 x 4; a window of 3 tokens
  // (keep 2) gives 6 rows of storage too.
  for (const index_t keep : {index_t(-1), index_t(2)}) {
    KVCache<float> cache(2, 6, 2, 3, 1, 4, keep);
    auto fill = [&](index_t row, index_t n, float base) {
      auto k = cache.key_rows(row, n);
      auto v = cache.value_rows(row, n);
      for (index_t b = 0; b < 2; ++b)
        for (index_t i = 0; i < n; ++i) {
          for (index_t h = 0; h < 2; ++h)
            for (index_t c = 0; c < 3; ++c) k(b, i, h, c) = base + static_cast<float>(i);
          for (index_t c = 0; c < 4; ++c) v(b, i, 0, c) = -base - static_cast<float>(i);
        }
    };
    fill(cache.reserve(2), 2, 10.f);
    cache.commit(2);
    const index_t held = cache.stored();
    const Tensor<float, 4> keys_before = contiguous(cache.keys());
    test::require_error([&] { cache.key_rows(-1, 1); },
                        {"KVCache::key_rows", "rows [-1, -1 + 1)", "6 rows", "(2, 6, 2, 3)"});
    test::require_error([&] { cache.value_rows(5, 2); }, {"KVCache::value_rows", "[5, 5 + 2)"});
    test::require_error([&] { cache.key_rows(0, -1); }, {"KVCache::key_rows"});
    // Nothing reserved since the last commit.
    test::require_error([&] { cache.commit(1); },
                        {"KVCache::commit", "n = 1", "made room for 0", "holding 2"});
    test::require_error([&] { cache.keys_with(1); }, {"KVCache::keys_with", "made room for 0"});
    const index_t row = cache.reserve(1);
    test::require_error([&] { cache.values_with(2); },
                        {"KVCache::values_with", "n = 2", "made room for 1"});
    test::require_error([&] { cache.commit(2); }, {"KVCache::commit", "made room for 1"});
    test::require_error([&] { cache.commit(-1); }, {"KVCache::commit", "n = -1"});
    // The refusals changed nothing: the held rows and the counts are as before.
    CHECK(cache.size() == 2);
    CHECK(cache.stored() == held);
    CHECK(test::bitwise_equal(contiguous(cache.keys()), keys_before));
    // And the reservation still stands.
    fill(row, 1, 20.f);
    CHECK(cache.keys_with(1).shape(1) == held + 1);
    cache.commit(1);
    CHECK(cache.size() == 3);
    CHECK(cache.keys()(1, cache.stored() - 1, 1, 2) == 20.f);
    CHECK(cache.values()(0, cache.stored() - 1, 0, 3) == -20.f);
    // A commit uses the reservation up; clear() drops one.
    test::require_error([&] { cache.commit(1); }, {"KVCache::commit", "made room for 0"});
    cache.reserve(1);
    cache.clear();
    test::require_error([&] { cache.commit(1); }, {"KVCache::commit", "made room for 0"});
    CHECK(cache.size() == 0);
  }
}

TEST_CASE("a cache of batch 0 appends and decodes nothing", "[kv_cache]") {
  // No storage at all: its row views must not offset a null pointer, past the
  // first rows too (clang's UBSan reports that, GCC's does not; fuzz_kvcache's
  // corpus holds the same case).
  KVCache<float> cache(0, 4, 1, 2, 1, 2);
  for (index_t step = 0; step < 2; ++step) {
    const index_t row = cache.reserve(2);
    CHECK(row == 2 * step);
    CHECK(cache.key_rows(row, 2).size() == 0);
    CHECK(cache.value_rows(row, 2).size() == 0);
    CHECK(cache.keys_with(2).shape(1) == row + 2);
    cache.commit(2);
  }
  CHECK(cache.size() == 4);
  DiffAttnV2Config cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 2;
  MultiheadDiffAttnV2<float> m(cfg, 3);
  auto layer_cache = m.make_cache(0, 6);
  const Tensor<float, 3> x({0, 3, 16});
  CHECK(m.forward(x, layer_cache).size() == 0);
  CHECK(m.forward(x, layer_cache).size() == 0);
  CHECK(layer_cache.size() == 6);
  // With window_left = 0 (a window of W = 1 token) the cache has 2W = 2 rows,
  // so 5 tokens go in three pieces; the layer's views of the pieces after the
  // first must not offset a null pointer either (found by fuzz_layers; its
  // corpus holds the case).
  const Tensor<float, 3> x5({0, 5, 16});
  const auto appends_in_pieces = [&](auto& layer) {
    auto windowed = layer.make_cache(0, 8);
    CHECK(layer.forward(x5, windowed).size() == 0);
    CHECK(windowed.size() == 5);
    CHECK(windowed.stored() == 0);  // window_left = 0: no token is read again
  };
  cfg.window_left = 0;
  MultiheadDiffAttnV2<float> m2(cfg, 3);
  appends_in_pieces(m2);
  DiffAttnV1Config c1;
  c1.embed_dim = 16;
  c1.num_heads = 2;
  c1.window_left = 0;
  MultiheadDiffAttnV1<float> m1(c1, 3);
  appends_in_pieces(m1);
}
