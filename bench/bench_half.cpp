// 16-bit storage against float: what bfloat16 buys where the kernels are
// memory-bound (a decoding step reads the whole cache) and where they are
// compute-bound (prefill: inputs widened once per tile and the products in
// float, except for bfloat16 storage under AVX512-BF16, where Q K^T and W V
// run on bf16 dot products: see detail/kernel/bf16_dot.hpp and detail/kernel/bf16_wv.hpp).
//
//   BM_HalfDecode_V2<S>   one decoding step of V2, 16 query heads (8 DIFF
//                         pairs) on 8 kv heads of d = 64, float queries over a
//                         cache of S (float, bfloat16 or half), M keys, B = 1.
//   BM_HalfDecode_V2<bfloat16, bfloat16>  the same with bfloat16 queries and
//                         output, as in a 16-bit layer's step.
//   BM_HalfLayerDecode_V2<S>  one token through a V2 layer (E = 512) whose
//                         parameters, x, y and cache are all S, after 32k
//                         cached tokens; bytes: weights and cache read.
//   BM_HalfLayerPrefill_V2<S>  a V2 layer's prefill (E = 1024, 16 DIFF heads
//                         on 8 kv heads of 64), N = 4096, causal, all in S.
//   BM_HalfLayerPrefill_V1<S>  its V1 twin: E = 1024, 16 DIFF heads on 8 kv
//                         pairs, d = 32 (values 64), N = 4096, causal, all in S.
//   BM_HalfPrefill_V1<S>  V1 prefill, 8 DIFF heads of d = 64 (q, k (N, 16, 64),
//                         v (N, 8, 128)), N = 2048, causal, everything in S.
//   BM_HalfPrefill_V2<S>  V2 prefill, 16 query heads (8 DIFF pairs) on 8 kv
//                         heads of d = 64, N = 2048, causal, everything in S.
//   BM_HalfPrefill_Plain<S>  plain attention, 16 query heads on 8 kv heads of
//                         d = 64, N = 2048, causal, everything in S.
//
// As in bench_decode.cpp, caches are rotated copies so that the working set
// is at least 4 x the last-level cache (bench::cold_copies): a step reads its
// cache from memory. The bytes counter is the cache bytes a step reads.
//
// Before the runs, the program prints the memory of a V2 layer of this shape
// (embedding 1024) and of its cache of 32k tokens in float and in bfloat16.
//
// Arguments: {M or N, threads}.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/types.hpp>

#include "bench_common.hpp"

namespace {

using namespace bench;
using diffattn::bfloat16;
using diffattn::KVCacheBatch;

constexpr index_t kKvHeads = 8, kQueryHeads = 16;

template <class S, class Q = float>
void BM_HalfDecode_V2(benchmark::State& state) {
  const index_t M = state.range(0), d = kHeadDim;
  const int threads = static_cast<int>(state.range(1));
  const std::size_t kv_bytes = static_cast<std::size_t>(M * 2 * kKvHeads * d) * sizeof(S);
  const std::size_t copies = cold_copies(kv_bytes);
  std::vector<Tensor<S, 4>> ks, vs;
  for (std::size_t c = 0; c < copies; ++c) {
    ks.emplace_back(std::array<index_t, 4>{1, M, kKvHeads, d});
    vs.emplace_back(std::array<index_t, 4>{1, M, kKvHeads, d});
    fill_uniform(ks.back(), 2 * c + 1);
    fill_uniform(vs.back(), 2 * c + 2);
  }
  Tensor<Q, 4> q({1, 1, kQueryHeads, d});  // float queries are never rounded
  fill_uniform(q, 7);
  Tensor<Q, 3> logit({1, 1, kQueryHeads / 2});
  Tensor<Q, 4> out({1, 1, kQueryHeads / 2, d});
  Tensor<index_t, 1> lens({1});
  lens(0) = M;
  KVCacheBatch cache;
  cache.cache_seqlens = lens;
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  std::size_t it = 0;
  for (auto _ : state) {
    const Tensor<S, 4>& k = ks[it % copies];
    const Tensor<S, 4>& v = vs[it % copies];
    ++it;
    diffattn::diff_attention_v2_kvcache<Q, S>(q, k, v, logit, out, {}, cache, o);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["copies"] = static_cast<double>(copies);
  set_counters(state, 0, static_cast<double>(kv_bytes));
}

template <class S>
void BM_HalfPrefill_V1(benchmark::State& state) {
  const index_t N = state.range(0), d = kHeadDim, H = 8;
  const int threads = static_cast<int>(state.range(1));
  Tensor<S, 4> q({1, N, 2 * H, d}), k({1, N, 2 * H, d}), v({1, N, H, 2 * d});
  fill_uniform(q, 1);
  fill_uniform(k, 2);
  fill_uniform(v, 3);
  Tensor<S, 4> out({1, N, H, 2 * d});
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  for (auto _ : state) {
    diffattn::diff_attention_v1<S>(q, k, v, 0.8f, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  // Useful work: two score maps (2d flops per pair each) and W V (2 x 2d).
  const double flops = visible_pairs(N) * static_cast<double>(H) * (2 * 2 * d + 2 * 2 * d);
  set_counters(state, flops, static_cast<double>((q.size() + k.size() + v.size()) * sizeof(S)));
}

/// V2 (V2 = true) or plain prefill: 16 query heads on 8 kv heads of d = 64.
template <class S, bool V2>
void half_prefill_gqa(benchmark::State& state) {
  const index_t N = state.range(0), d = kHeadDim;
  const int threads = static_cast<int>(state.range(1));
  Tensor<S, 4> q({1, N, kQueryHeads, d}), k({1, N, kKvHeads, d}), v({1, N, kKvHeads, d});
  Tensor<S, 3> logit({1, N, kQueryHeads / 2});
  fill_uniform(q, 1);
  fill_uniform(k, 2);
  fill_uniform(v, 3);
  fill_uniform(logit, 4);
  Tensor<S, 4> out({1, N, V2 ? kQueryHeads / 2 : kQueryHeads, d});
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  for (auto _ : state) {
    if constexpr (V2)
      diffattn::diff_attention_v2<S>(q, k, v, logit, out, o);
    else
      diffattn::attention<S>(q, k, v, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  // Useful work: 16 score rows per query (2d flops per pair); W V once per
  // output head (V2: 8, plain: 16).
  const double heads_out = V2 ? kQueryHeads / 2 : kQueryHeads;
  const double flops = visible_pairs(N) * (kQueryHeads * 2.0 * d + heads_out * 2.0 * d);
  set_counters(state, flops, static_cast<double>((q.size() + k.size() + v.size()) * sizeof(S)));
}
template <class S>
void BM_HalfPrefill_V2(benchmark::State& state) {
  half_prefill_gqa<S, true>(state);
}
template <class S>
void BM_HalfPrefill_Plain(benchmark::State& state) {
  half_prefill_gqa<S, false>(state);
}

/// The V2 layer of the benchmark's shape: E = 512, 8 DIFF heads (16 query
/// heads) on 8 kv heads of 64, causal.
diffattn::DiffAttnV2Config layer_config() {
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = kQueryHeads / 2 * kHeadDim;
  cfg.num_heads = kQueryHeads / 2;
  cfg.num_kv_heads = kKvHeads;
  cfg.causal = true;
  return cfg;
}

/// One token through a V2 layer of the benchmark's shape (E = 512, 8 DIFF
/// heads on 8 kv heads of 64) with parameters, x, y and cache all stored as
/// S, after M cached tokens: the step reads the layer's weights and its whole
/// cache (M rows of 8 kv heads). The cache is filled through KVCache's row
/// calls with random keys and values (a prefill of 32k tokens would take
/// seconds) and refilled, outside the timing, when its spare rows run out.
template <class S>
void BM_HalfLayerDecode_V2(benchmark::State& state) {
  const index_t M = state.range(0), spare = 256;
  const diffattn::DiffAttnV2Config cfg = layer_config();
  diffattn::MultiheadDiffAttnV2<float> reference_layer(cfg, 1);
  diffattn::MultiheadDiffAttnV2<S> layer(reference_layer);
  layer.set_num_threads(2);
  auto cache = layer.make_cache(1, M + spare);
  Tensor<S, 4> rows({1, M, kKvHeads, kHeadDim});
  fill_uniform(rows, 5);
  auto refill = [&] {
    cache.clear();
    const index_t at = cache.reserve(M);
    auto k = cache.key_rows(at, M);
    auto v = cache.value_rows(at, M);
    std::copy(rows.data(), rows.data() + rows.size(), k.data());
    std::copy(rows.data(), rows.data() + rows.size(), v.data());
    cache.commit(M);
  };
  refill();
  Tensor<S, 3> x({1, 1, cfg.embed_dim});
  fill_uniform(x, 6);
  for (auto _ : state) {
    if (cache.size() == cache.capacity()) {
      state.PauseTiming();
      refill();
      state.ResumeTiming();
    }
    auto y = layer.forward(x, cache);
    benchmark::DoNotOptimize(y.data());
  }
  std::size_t weight_bytes = 0;
  for (const auto& kv : layer.parameters())
    weight_bytes += static_cast<std::size_t>(kv.second.size()) * sizeof(S);
  set_counters(state, 0, static_cast<double>(weight_bytes + cache.bytes() * M / (M + spare)));
}

/// A layer's prefill, E = 1024, 16 DIFF heads on 8 kv heads, causal, N
/// tokens, B = 1: parameters, x and y all S (the projections and the
/// attention products of a bfloat16 layer on bf16 dot products where the
/// build targets AVX512-BF16). V2: 32 query heads of 64; V1: 32 query heads
/// of d = 32 on 8 kv pairs, values 2d = 64.
template <template <class> class Layer, class Config, class S>
void layer_prefill(benchmark::State& state) {
  const index_t N = state.range(0);
  Config cfg;
  cfg.embed_dim = 1024;
  cfg.num_heads = 16;
  cfg.num_kv_heads = 8;
  cfg.causal = true;
  Layer<float> reference_layer(cfg, 1);
  Layer<S> layer(reference_layer);
  layer.set_num_threads(static_cast<int>(state.range(1)));
  Tensor<S, 3> x({1, N, cfg.embed_dim});
  fill_uniform(x, 7);
  for (auto _ : state) {
    auto y = layer.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
  set_counters(state, 0, static_cast<double>(2 * x.size() * sizeof(S)));
}
template <class S>
void BM_HalfLayerPrefill_V2(benchmark::State& state) {
  layer_prefill<diffattn::MultiheadDiffAttnV2, diffattn::DiffAttnV2Config, S>(state);
}
template <class S>
void BM_HalfLayerPrefill_V1(benchmark::State& state) {
  layer_prefill<diffattn::MultiheadDiffAttnV1, diffattn::DiffAttnV1Config, S>(state);
}

/// Memory of a V2 layer of the benchmark's shape and of its cache of 32k
/// tokens, float against bfloat16.
void print_memory() {
  const diffattn::DiffAttnV2Config cfg = layer_config();
  diffattn::MultiheadDiffAttnV2<float> layer(cfg, 1);
  diffattn::MultiheadDiffAttnV2<bfloat16> small(layer);
  const double mib = 1.0 / (1 << 20);
  auto weights = [mib](auto& m) {
    std::size_t bytes = 0;
    for (const auto& kv : m.parameters())
      bytes += static_cast<std::size_t>(kv.second.size()) * sizeof(*kv.second.data());
    return static_cast<double>(bytes) * mib;
  };
  const auto cf = layer.make_cache(1, 32768);
  const auto cb = layer.make_cache<bfloat16>(1, 32768);
  std::printf("V2 layer, E = %ld, 8 DIFF heads on 8 kv heads of 64:\n",
              static_cast<long>(cfg.embed_dim));
  std::printf("  weights: float %.2f MiB, bfloat16 %.2f MiB\n", weights(layer), weights(small));
  std::printf("  KV cache of 32768 tokens: float %.2f MiB, bfloat16 %.2f MiB\n",
              static_cast<double>(cf.bytes()) * mib, static_cast<double>(cb.bytes()) * mib);
}

void decode_args(benchmark::internal::Benchmark* b) {
  b->Args({32768, 2})->Args({4096, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
}
void prefill_args(benchmark::internal::Benchmark* b) {
  b->Args({2048, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK_TEMPLATE(BM_HalfDecode_V2, float)->Apply(decode_args);
BENCHMARK_TEMPLATE(BM_HalfDecode_V2, bfloat16)->Apply(decode_args);
BENCHMARK_TEMPLATE(BM_HalfDecode_V2, diffattn::half)->Apply(decode_args);
BENCHMARK_TEMPLATE(BM_HalfDecode_V2, bfloat16, bfloat16)->Apply(decode_args);
BENCHMARK_TEMPLATE(BM_HalfLayerDecode_V2, float)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerDecode_V2, bfloat16)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerDecode_V2, diffattn::half)
    ->Arg(32768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerPrefill_V2, float)
    ->Args({4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerPrefill_V2, bfloat16)
    ->Args({4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerPrefill_V1, float)
    ->Args({4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfLayerPrefill_V1, bfloat16)
    ->Args({4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_TEMPLATE(BM_HalfPrefill_V1, float)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_V1, bfloat16)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_V1, diffattn::half)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_V2, float)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_V2, bfloat16)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_Plain, float)->Apply(prefill_args);
BENCHMARK_TEMPLATE(BM_HalfPrefill_Plain, bfloat16)->Apply(prefill_args);

int main(int argc, char** argv) {
  print_memory();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
