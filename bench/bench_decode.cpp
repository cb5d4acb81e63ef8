// Decoding steps against KV caches: one new query per sequence, every K and V
// row of the cache read once per kv group. The step is memory-bound, so the
// figure of merit is K/V bytes read per second against what the machine can
// stream: BM_ReadBandwidth in the same binary (1 and 2 threads).
//
// The caches are NOT already in cache: several copies of K/V are rotated so
// that the working set is at least 4 x the last-level cache one core sees
// (bench::last_level_cache_bytes: an AMD core complex's L3, 32 MiB; the L3
// the system reports elsewhere, 480 MiB on some Intel parts;
// DIFFATTN_BENCH_LLC_MIB overrides it), printed in the context as
// last_level_cache_MiB.
//
// Shapes (embedding width 1024, d = 64):
//   V1      8 DIFF heads on 8 kv pairs: k (M, 16, 64), v (M, 8, 128)
//   V2      16 query heads (8 pairs) on 8 kv heads: k, v (M, 8, 64)
//   Plain8  8 query heads on 8 kv heads; Plain16 16 query heads on 8 kv heads
//   MQA     8 query heads on one kv head of d = 128, M = 256k, B = 1
//   Paged   V2 over a paged cache: blocks of 16 or 256 rows, each sequence's
//           blocks in a random order of the pool
// The bytes counter is the K/V bytes a step reads (B x M rows of every kv head).
// Cold runs also stream-read a cache copy between steps, with the step's
// threads (stream_read, the probe of BM_ReadBandwidth): `probe` is that
// read's rate and `of_probe` the step's rate over it. Measured step by step
// in the same process, the ratio holds when the neighbours' load on a shared
// host moves the memory bandwidth (by 25-84 GB/s on 2 threads between runs
// on the Zen 5 VM); the step's time alone is reported.
//
// Arguments: {M, B, threads, warm} (Paged: and the block size). warm = 1 (the
// BM_DecodeWarm_* runs): the caches are NOT rotated (M = 128: 512 KiB of K/V, which stays in L2),
// so the step runs at the speed of its instructions, the bound on what any memory could give it.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include <diffattn/kvcache_attention.hpp>

#include "bench_common.hpp"

namespace {

using namespace bench;
using diffattn::KVCacheBatch;

/// Reads n floats at p (n a multiple of 4096) with `threads` threads, each a
/// contiguous share, through eight packet accumulators: the probe.
float stream_read(const float* p, index_t n, int threads) {
  using Packet = diffattn::detail::TileConfig<float>::Packet;
  constexpr int P = diffattn::detail::TileConfig<float>::kPacket;
  float sink = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
#endif
  for (index_t c = 0; c < n / 4096; ++c) {
    using namespace Eigen::internal;
    const float* b = p + c * 4096;
    Packet a[8];
    for (auto& x : a) x = pset1<Packet>(0.f);
    for (index_t i = 0; i < 4096; i += 8 * P)
      for (int u = 0; u < 8; ++u) a[u] = padd(a[u], ploadu<Packet>(b + i + u * P));
    for (int u = 1; u < 8; ++u) a[0] = padd(a[0], a[u]);
    sink += predux(a[0]);
  }
  return sink;
}

/// Stream-reads a buffer of 8 x the last-level cache (at least 256 MiB): the
/// bandwidth a memory-bound kernel can reach with this many threads.
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::size_t bytes = 8 * last_level_cache_bytes();
  const index_t n = static_cast<index_t>(bytes / sizeof(float)) / 4096 * 4096;
  Tensor<float, 1> buf({n});
  fill_uniform(buf, 1);
  for (auto _ : state) benchmark::DoNotOptimize(stream_read(buf.data(), n, threads));
  set_counters(state, 0, static_cast<double>(n) * sizeof(float));
}

enum class Kind { v1, v2, plain };

struct Layer {
  Kind kind;
  index_t qh, kh, vh, d, dv;  // query, key and value heads; widths
};

/// Rotated copies of the caches and one step's inputs, run through the
/// layer's kvcache kernel. block_size > 0: each copy is a pool of blocks of
/// that many rows, (B M / block_size, block_size, H, D), and the block table
/// gives each sequence's blocks in a random order, as a paged cache that has
/// been filled and freed for a while would.
void decode(benchmark::State& state, const Layer& L, index_t block_size = 0) {
  const index_t M = state.range(0), B = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const std::size_t kv_bytes =
      static_cast<std::size_t>(B * M) * static_cast<std::size_t>(L.kh * L.d + L.vh * L.dv) * 4;
  const bool warm = state.range(3) != 0;
  const std::size_t copies = warm ? 1 : cold_copies(kv_bytes);
  const index_t blocks = block_size > 0 ? B * M / block_size : 0;
  std::vector<Tensor<float, 4>> ks, vs;
  for (std::size_t c = 0; c < copies; ++c) {
    if (block_size > 0) {
      ks.emplace_back(std::array<index_t, 4>{blocks, block_size, L.kh, L.d});
      vs.emplace_back(std::array<index_t, 4>{blocks, block_size, L.vh, L.dv});
    } else {
      ks.emplace_back(std::array<index_t, 4>{B, M, L.kh, L.d});
      vs.emplace_back(std::array<index_t, 4>{B, M, L.vh, L.dv});
    }
    fill_uniform(ks.back(), 2 * c + 1);
    fill_uniform(vs.back(), 2 * c + 2);
  }
  Tensor<index_t, 2> table({block_size > 0 ? B : 0, block_size > 0 ? M / block_size : 0});
  if (block_size > 0) {
    std::vector<index_t> order(static_cast<std::size_t>(blocks));
    for (index_t i = 0; i < blocks; ++i) order[static_cast<std::size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937_64(11));
    std::copy(order.begin(), order.end(), table.data());
  }
  auto q = random4({B, 1, L.qh, L.d}, 7);
  Tensor<float, 3> logit({B, 1, L.qh / 2});
  const index_t oh = L.kind == Kind::plain ? L.qh : L.qh / 2;
  Tensor<float, 4> out({B, 1, oh, L.kind == Kind::v1 ? 2 * L.d : L.dv});
  Tensor<index_t, 1> lens({B});
  for (index_t b = 0; b < B; ++b) lens(b) = M;
  KVCacheBatch cache;
  cache.cache_seqlens = lens;
  if (block_size > 0) cache.block_table = table;
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  // Between steps (cold runs), the probe reads the copy read copies / 2
  // steps ago with the step's threads: at least 2 x the last-level cache
  // has been read since (with one copy, its start is long evicted when the
  // probe gets there). The step's time and the probe's are kept apart.
  using clock = std::chrono::steady_clock;
  double step_s = 0, probe_s = 0;
  std::size_t it = 0;
  for (auto _ : state) {
    const Tensor<float, 4>& k = ks[it % copies];
    const Tensor<float, 4>& v = vs[it % copies];
    const std::size_t pc = (it + copies / 2) % copies;
    ++it;
    const auto t0 = clock::now();
    switch (L.kind) {
      case Kind::v1:
        diffattn::diff_attention_v1_kvcache<float>(q, k, v, 0.8f, out, {}, cache, o);
        break;
      case Kind::v2:
        diffattn::diff_attention_v2_kvcache<float>(q, k, v, logit, out, {}, cache, o);
        break;
      default:
        diffattn::attention_kvcache<float>(q, k, v, out, {}, cache, o);
    }
    benchmark::DoNotOptimize(out.data());
    const auto t1 = clock::now();
    const double s = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(s);
    step_s += s;
    if (!warm) {
      benchmark::DoNotOptimize(stream_read(ks[pc].data(), ks[pc].size(), threads) +
                               stream_read(vs[pc].data(), vs[pc].size(), threads));
      probe_s += std::chrono::duration<double>(clock::now() - t1).count();
    }
  }
  state.counters["copies"] = static_cast<double>(copies);
  set_counters(state, 0, static_cast<double>(kv_bytes));
  if (probe_s > 0) {
    // The probe's rate over the same bytes, and the step's as a fraction of it.
    const double n = static_cast<double>(it) * static_cast<double>(kv_bytes);
    state.counters["probe"] =
        benchmark::Counter(n / probe_s, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
    state.counters["of_probe"] = probe_s / step_s;
  }
}

void BM_Decode_V1(benchmark::State& s) { decode(s, {Kind::v1, 16, 16, 8, 64, 128}); }
void BM_Decode_V2(benchmark::State& s) { decode(s, {Kind::v2, 16, 8, 8, 64, 64}); }
void BM_Decode_Plain8(benchmark::State& s) { decode(s, {Kind::plain, 8, 8, 8, 64, 64}); }
void BM_Decode_Plain16(benchmark::State& s) { decode(s, {Kind::plain, 16, 8, 8, 64, 64}); }
void BM_Decode_MQA(benchmark::State& s) { decode(s, {Kind::plain, 8, 1, 1, 128, 128}); }
void BM_DecodePaged_V2(benchmark::State& s) { decode(s, {Kind::v2, 16, 8, 8, 64, 64}, s.range(4)); }
void BM_DecodeWarm_V2(benchmark::State& s) { BM_Decode_V2(s); }
void BM_DecodeWarm_Plain8(benchmark::State& s) { BM_Decode_Plain8(s); }

void decode_sizes(benchmark::internal::Benchmark* b) {
  for (long m : {4096, 32768, 131072}) b->Args({m, 1, 2, 0});
  b->Args({4096, 8, 2, 0});
  b->Args({4096, 1, 1, 0});
  b->Args({32768, 1, 1, 0});
  b->Unit(benchmark::kMillisecond)->UseManualTime();
}

}  // namespace

BENCHMARK(BM_ReadBandwidth)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Decode_V1)->Apply(decode_sizes);
BENCHMARK(BM_Decode_V2)->Apply(decode_sizes);
BENCHMARK(BM_Decode_Plain8)->Apply(decode_sizes);
BENCHMARK(BM_Decode_Plain16)->Apply(decode_sizes);
BENCHMARK(BM_Decode_MQA)
    ->Args({262144, 1, 1, 0})
    ->Args({262144, 1, 2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodePaged_V2)
    ->Args({32768, 1, 2, 0, 16})
    ->Args({32768, 1, 2, 0, 256})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodeWarm_V2)->Args({128, 1, 1, 1})->Unit(benchmark::kMicrosecond)->UseManualTime();
BENCHMARK(BM_DecodeWarm_Plain8)
    ->Args({128, 1, 1, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();

BENCHMARK_MAIN();
