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
// BM_DecodeThreads_MQA runs MQA's step on 2 threads and on 1 alternately, each
// on its own cold copies: `speedup` is the 1-thread time over the 2-thread one
// under the same neighbours (the ">= 1.7x on 2 threads").
//
// BM_DecodeVsBaseline_* run a layer's steps and the 8-query baseline's
// (Plain8) alternately, each on its own cold copies: `vs_baseline` is the
// layer's time over the baseline's under the same neighbours, which separate
// benchmarks minutes apart do not measure (V2 against Plain8 is the issue's
// "decodes as fast as a baseline Transformer").
//
// BM_ReadWithWork/{X, threads} reads like the probe with X packet FMAs
// after each packet it loads, alternated with the probe: `of_probe` is how
// much of the probe a stream with that much arithmetic per byte reads here,
// `warm_GBs` the same loop's rate with its buffer in L2 (its instructions
// alone). Set against a step's own warm rate (BM_DecodeWarm_*, bench_quant's
// BM_QuantDecodeWarm_V2), it says what of the probe that step can reach on
// this machine, whatever its read order.
//
// BM_DecodeReadOrder_* run a step at M = 32k and read the same bytes twice
// more, each over its own cold copy: in the step's order without its
// arithmetic, and in address order. `of_pattern` says what the arithmetic
// costs, `pattern_of_order` what the order of the reads costs (argument:
// threads).
//
// Arguments: {M, B, threads, warm} (Paged: and the block size; VsBaseline:
// {M, B, threads}). warm = 1 (the
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

/// Reads `rows` rows of row_floats floats at p, with `threads` threads taking
/// chunks of kSplitKeys rows one at a time, in a decoding step's order and
/// with none of its arithmetic: blocks of one packet's worth of rows, each
/// block in passes of pass_floats floats of every row (V2's key pass reads
/// two heads of 64, 512 bytes, per pass), asking for the same part of the
/// row decode_ahead_rows on with the non-temporal hint as it loads it, as
/// the step does (prefetch). pass_floats = row_floats without prefetch reads
/// in address order.
float pattern_read(const float* p, index_t rows, index_t row_floats, index_t pass_floats,
                   bool prefetch, int threads) {
  using Packet = diffattn::detail::TileConfig<float>::Packet;
  constexpr index_t P = diffattn::detail::TileConfig<float>::kPacket;
  constexpr index_t chunk = diffattn::detail::kSplitKeys;
  const index_t ahead =
      diffattn::detail::decode_ahead_rows(row_floats * static_cast<index_t>(sizeof(float)));
  float sink = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : sink)
#endif
  for (index_t c = 0; c < rows / chunk; ++c) {
    using namespace Eigen::internal;
    Packet a[4];
    for (auto& x : a) x = pset1<Packet>(0.f);
    const index_t end = (c + 1) * chunk;
    for (index_t j0 = c * chunk; j0 < end; j0 += P)
      for (index_t h = 0; h < row_floats; h += pass_floats)
        for (index_t j = j0; j < j0 + P; ++j) {
          const float* r = p + j * row_floats + h;
          if (prefetch && j + ahead < end)
            diffattn::detail::prefetch_row<0>(r + ahead * row_floats, pass_floats);
          for (index_t t = 0; t < pass_floats; t += 4 * P)
            for (int u = 0; u < 4; ++u) a[u] = padd(a[u], ploadu<Packet>(r + t + u * P));
        }
    sink += predux(padd(padd(a[0], a[1]), padd(a[2], a[3])));
  }
  return sink;
}

/// stream_read with X packet FMAs after each packet it loads (X = 0:
/// stream_read itself), on 12 accumulators so that the FMAs run at their
/// throughput: how much arithmetic per byte a stream on this machine carries
/// before it reads slower than the probe.
template <int X>
float work_read(const float* p, index_t n, int threads) {
  if constexpr (X == 0) return stream_read(p, n, threads);
  using Packet = diffattn::detail::TileConfig<float>::Packet;
  constexpr int P = diffattn::detail::TileConfig<float>::kPacket;
  constexpr int kAcc = 12;
  float sink = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
#endif
  for (index_t c = 0; c < n / 4096; ++c) {
    using namespace Eigen::internal;
    const float* b = p + c * 4096;
    const Packet k = pset1<Packet>(0.5f);
    Packet a[kAcc];
    for (auto& x : a) x = pset1<Packet>(0.f);
    for (index_t i = 0; i < 4096; i += 8 * P) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const Packet x = ploadu<Packet>(b + i + u * P);
#pragma GCC unroll 48
        for (int f = 0; f < X; ++f) a[(u * X + f) % kAcc] = pmadd(x, k, a[(u * X + f) % kAcc]);
      }
    }
    for (int u = 1; u < kAcc; ++u) a[0] = padd(a[0], a[u]);
    sink += predux(a[0]);
  }
  return sink;
}

/// work_read<X> from memory alternated with the probe (stream_read) over
/// another cold part of the buffer, and once over a buffer that stays in L2
/// (256 KiB a thread): `of_probe` is the loaded stream's rate over the
/// probe's, `warm_GBs` the rate of its instructions alone. A decoding step
/// whose instructions alone run at about this warm rate should not expect to
/// read more of the probe than this stream; where `warm_GBs` is above the
/// probe and `of_probe` still below 1, memory and arithmetic overlap only in
/// part. X = 0, 4, 12, 24, 48 (multiples of the 12 accumulators or below
/// them, so that each packet's FMAs spread evenly; with 8, 16 or 32 the loop
/// ran slower than its FMA count, warm and from memory alike). Arguments:
/// {X, threads}.
template <int X>
void read_with_work(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(1));
  const index_t half =
      static_cast<index_t>(2 * last_level_cache_bytes() / sizeof(float)) / 4096 * 4096;
  Tensor<float, 1> buf({2 * half});
  fill_uniform(buf, 5);
  const index_t wn = static_cast<index_t>(threads) * (index_t(256) << 10) / 4;
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  double warm_s = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock::now();
    for (int r = 0; r < 64; ++r) benchmark::DoNotOptimize(work_read<X>(buf.data(), wn, threads));
    warm_s = std::min(warm_s, seconds(t0) / 64);
  }
  double work_s = 0, probe_s = 0;
  std::size_t it = 0;
  for (auto _ : state) {
    const float* a = buf.data() + (it % 2) * half;
    const float* b = buf.data() + ((it + 1) % 2) * half;
    auto t0 = clock::now();
    benchmark::DoNotOptimize(work_read<X>(a, half, threads));
    const double s = seconds(t0);
    state.SetIterationTime(s);
    work_s += s;
    t0 = clock::now();
    benchmark::DoNotOptimize(stream_read(b, half, threads));
    probe_s += seconds(t0);
    ++it;
  }
  const double bytes = static_cast<double>(half) * sizeof(float);
  set_counters(state, 0, bytes);
  state.counters["of_probe"] = probe_s / work_s;
  state.counters["probe_GBs"] = bytes * static_cast<double>(it) / probe_s / 1e9;
  state.counters["warm_GBs"] = static_cast<double>(wn) * sizeof(float) / warm_s / 1e9;
}

void BM_ReadWithWork(benchmark::State& state) {
  switch (state.range(0)) {
    case 0: return read_with_work<0>(state);
    case 4: return read_with_work<4>(state);
    case 12: return read_with_work<12>(state);
    case 24: return read_with_work<24>(state);
    case 48: return read_with_work<48>(state);
    default: state.SkipWithError("X must be 0, 4, 12, 24 or 48");
  }
}

enum class Kind { v1, v2, plain };

struct Layer {
  Kind kind;
  index_t qh, kh, vh, d, dv;  // query, key and value heads; widths
};

/// Rotated copies of one layer's caches and a step's inputs, run through the
/// layer's kvcache kernel. block_size > 0: each copy is a pool of blocks of
/// that many rows, (B M / block_size, block_size, H, D), and the block table
/// gives each sequence's blocks in a random order, as a paged cache that has
/// been filled and freed for a while would. warm: one copy, never rotated.
class DecodeRig {
 public:
  DecodeRig(const Layer& L, index_t M, index_t B, int threads, bool warm, index_t block_size = 0)
      : kv_bytes(static_cast<std::size_t>(B * M) *
                 static_cast<std::size_t>(L.kh * L.d + L.vh * L.dv) * 4),
        copies(warm ? 1 : cold_copies(kv_bytes)),
        L_(L),
        threads_(threads),
        table_({block_size > 0 ? B : 0, block_size > 0 ? M / block_size : 0}),
        lens_({B}),
        q_(random4({B, 1, L.qh, L.d}, 7)),
        logit_({B, 1, L.qh / 2}),
        out_({B, 1, L.kind == Kind::plain ? L.qh : L.qh / 2, L.kind == Kind::v1 ? 2 * L.d : L.dv}) {
    const index_t blocks = block_size > 0 ? B * M / block_size : 0;
    for (std::size_t c = 0; c < copies; ++c) {
      if (block_size > 0) {
        ks_.emplace_back(std::array<index_t, 4>{blocks, block_size, L.kh, L.d});
        vs_.emplace_back(std::array<index_t, 4>{blocks, block_size, L.vh, L.dv});
      } else {
        ks_.emplace_back(std::array<index_t, 4>{B, M, L.kh, L.d});
        vs_.emplace_back(std::array<index_t, 4>{B, M, L.vh, L.dv});
      }
      fill_uniform(ks_.back(), 2 * c + 1);
      fill_uniform(vs_.back(), 2 * c + 2);
    }
    if (block_size > 0) {
      std::vector<index_t> order(static_cast<std::size_t>(blocks));
      for (index_t i = 0; i < blocks; ++i) order[static_cast<std::size_t>(i)] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937_64(11));
      std::copy(order.begin(), order.end(), table_.data());
    }
    for (index_t b = 0; b < B; ++b) lens_(b) = M;
    cache_.cache_seqlens = lens_;
    if (block_size > 0) cache_.block_table = table_;
    options_.causal = true;
    options_.num_threads = threads;
  }

  const std::size_t kv_bytes;  // K/V bytes one step reads
  const std::size_t copies;

  /// One step on copy it % copies; its seconds.
  double step(std::size_t it) {
    const Tensor<float, 4>& k = ks_[it % copies];
    const Tensor<float, 4>& v = vs_[it % copies];
    const auto t0 = clock::now();
    switch (L_.kind) {
      case Kind::v1:
        diffattn::diff_attention_v1_kvcache<float>(q_, k, v, 0.8f, out_, {}, cache_, options_);
        break;
      case Kind::v2:
        diffattn::diff_attention_v2_kvcache<float>(q_, k, v, logit_, out_, {}, cache_, options_);
        break;
      default:
        diffattn::attention_kvcache<float>(q_, k, v, out_, {}, cache_, options_);
    }
    benchmark::DoNotOptimize(out_.data());
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

  /// The probe after step `it`: stream-reads the copy read copies / 2 steps
  /// ago with the step's threads, so that at least 2 x the last-level cache
  /// has been read since (with one copy, its start is long evicted when the
  /// probe gets there); its seconds.
  double probe(std::size_t it) {
    const std::size_t pc = (it + copies / 2) % copies;
    const auto t0 = clock::now();
    benchmark::DoNotOptimize(stream_read(ks_[pc].data(), ks_[pc].size(), threads_) +
                             stream_read(vs_[pc].data(), vs_[pc].size(), threads_));
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

 private:
  using clock = std::chrono::steady_clock;
  Layer L_;
  int threads_;
  std::vector<Tensor<float, 4>> ks_, vs_;
  Tensor<index_t, 2> table_;
  Tensor<index_t, 1> lens_;
  Tensor<float, 4> q_;
  Tensor<float, 3> logit_;
  Tensor<float, 4> out_;
  KVCacheBatch cache_;
  diffattn::AttentionOptions options_;
};

/// Steps of one layer; cold runs read the probe between steps. The step's
/// time and the probe's are kept apart.
void decode(benchmark::State& state, const Layer& L, index_t block_size = 0) {
  const index_t M = state.range(0), B = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  const bool warm = state.range(3) != 0;
  DecodeRig rig(L, M, B, threads, warm, block_size);
  double step_s = 0, probe_s = 0;
  std::size_t it = 0;
  for (auto _ : state) {
    const double s = rig.step(it);
    state.SetIterationTime(s);
    step_s += s;
    if (!warm) probe_s += rig.probe(it);
    ++it;
  }
  state.counters["copies"] = static_cast<double>(rig.copies);
  set_counters(state, 0, static_cast<double>(rig.kv_bytes));
  if (probe_s > 0) {
    // The probe's rate over the same bytes, and the step's as a fraction of it.
    const double n = static_cast<double>(it) * static_cast<double>(rig.kv_bytes);
    state.counters["probe"] =
        benchmark::Counter(n / probe_s, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
    state.counters["of_probe"] = probe_s / step_s;
  }
}

/// Steps of rigs a and b alternately, each on its own cold copies, in turn
/// first, so that both meet the same neighbours; a's step times the
/// iteration. Their total seconds and the steps each ran.
struct Alternated {
  double a_s = 0, b_s = 0;
  double steps = 0;
};
Alternated alternate(benchmark::State& state, DecodeRig& a, DecodeRig& b) {
  Alternated r;
  std::size_t it = 0;
  for (auto _ : state) {
    double ta, tb;
    if (it % 2 == 0) {
      ta = a.step(it);
      tb = b.step(it);
    } else {
      tb = b.step(it);
      ta = a.step(it);
    }
    state.SetIterationTime(ta);
    r.a_s += ta;
    r.b_s += tb;
    ++it;
  }
  r.steps = static_cast<double>(it);
  set_counters(state, 0, static_cast<double>(a.kv_bytes));
  return r;
}

/// A layer's steps and the 8-query baseline's (Plain8: the same 8 kv heads of
/// 64 as V2), alternated: the time ratio measured under the same neighbours
/// (`vs_baseline`, the layer's time over the baseline's; `baseline_ms`). The
/// layer's time is reported.
void decode_vs_baseline(benchmark::State& state, const Layer& L) {
  const index_t M = state.range(0), B = state.range(1);
  const int threads = static_cast<int>(state.range(2));
  DecodeRig rig(L, M, B, threads, false),
      base({Kind::plain, 8, 8, 8, 64, 64}, M, B, threads, false);
  const Alternated r = alternate(state, rig, base);
  state.counters["baseline_ms"] = 1e3 * r.b_s / r.steps;
  state.counters["vs_baseline"] = r.a_s / r.b_s;
}

/// A layer's step on 2 threads and on 1, alternated: `speedup`, the 1-thread
/// time over the 2-thread one, measured under the same neighbours
/// (`one_thread_ms`). The 2-thread time is reported. A decoding step of one
/// sequence gets its parallelism from the split of its keys into chunks
/// (KVCacheBatch::split_keys).
void decode_thread_scaling(benchmark::State& state, const Layer& L) {
  const index_t M = state.range(0), B = state.range(1);
  DecodeRig two(L, M, B, 2, false), one(L, M, B, 1, false);
  const Alternated r = alternate(state, two, one);
  state.counters["one_thread_ms"] = 1e3 * r.b_s / r.steps;
  state.counters["speedup"] = r.b_s / r.a_s;
}

/// What the step's read order costs, apart from its arithmetic: a layer's
/// step at M = 32k (B = 1, `threads`) alternated with two reads of the same
/// bytes (its K and V rows, each of the layer's kv heads), each over its own
/// cold copy: pattern_read in the step's order (blocks of a packet's rows,
/// pass_bytes of each row per pass, the step's prefetch) with none of its
/// arithmetic, and pattern_read in address order. `of_pattern` is the step's
/// rate over the pattern's (what its arithmetic costs), `pattern_of_order`
/// the pattern's over address order's (what the order costs), `of_order`
/// the step's over address order's. The pattern's passes are as wide as the
/// step's key passes (heads_together for the layer's query rows per kv
/// head: with AVX-512, two heads of 64 floats for V2 and the 8-query
/// baseline); its blocks are a packet's rows, as the step's.
void decode_read_order(benchmark::State& state, const Layer& L) {
  using diffattn::detail::TileConfig;
  const index_t M = 32768;
  const int threads = static_cast<int>(state.range(0));
  DecodeRig rig(L, M, 1, threads, false);
  const index_t row = L.kh * L.d, rows = 2 * M;  // K rows, then V rows (L.vh * L.dv = row)
  const index_t rows_per_head = L.qh / L.kh;     // V2's qh counts both maps' query heads
  const index_t pass =
      L.d * diffattn::detail::heads_together<float>(rows_per_head, L.d / TileConfig<float>::kPacket,
                                                    L.d * static_cast<index_t>(sizeof(float)));
  std::vector<Tensor<float, 1>> copies;
  for (std::size_t c = 0; c < cold_copies(rig.kv_bytes) + 1; ++c) {
    copies.emplace_back(std::array<index_t, 1>{rows * row});
    fill_uniform(copies.back(), c + 3);
  }
  using clock = std::chrono::steady_clock;
  const auto seconds = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  double step_s = 0, pattern_s = 0, order_s = 0;
  std::size_t it = 0;
  for (auto _ : state) {
    const double s = rig.step(it);
    state.SetIterationTime(s);
    step_s += s;
    const std::size_t c = it % copies.size();
    auto t0 = clock::now();
    benchmark::DoNotOptimize(pattern_read(copies[c].data(), rows, row, pass, true, threads));
    pattern_s += seconds(t0);
    t0 = clock::now();
    const float* y = copies[(c + copies.size() / 2) % copies.size()].data();
    benchmark::DoNotOptimize(pattern_read(y, rows, row, row, false, threads));
    order_s += seconds(t0);
    ++it;
  }
  set_counters(state, 0, static_cast<double>(rig.kv_bytes));
  state.counters["of_pattern"] = pattern_s / step_s;
  state.counters["pattern_of_order"] = order_s / pattern_s;
  state.counters["of_order"] = order_s / step_s;
}

void BM_Decode_V1(benchmark::State& s) { decode(s, {Kind::v1, 16, 16, 8, 64, 128}); }
void BM_Decode_V2(benchmark::State& s) { decode(s, {Kind::v2, 16, 8, 8, 64, 64}); }
void BM_Decode_Plain8(benchmark::State& s) { decode(s, {Kind::plain, 8, 8, 8, 64, 64}); }
void BM_Decode_Plain16(benchmark::State& s) { decode(s, {Kind::plain, 16, 8, 8, 64, 64}); }
void BM_Decode_MQA(benchmark::State& s) { decode(s, {Kind::plain, 8, 1, 1, 128, 128}); }
// Llama-style GQA: 32 query heads on 8 kv heads of 128, 4 query rows per kv head.
void BM_Decode_GQA4_D128(benchmark::State& s) { decode(s, {Kind::plain, 32, 8, 8, 128, 128}); }
void BM_DecodePaged_V2(benchmark::State& s) { decode(s, {Kind::v2, 16, 8, 8, 64, 64}, s.range(4)); }
void BM_DecodeVsBaseline_V1(benchmark::State& s) {
  decode_vs_baseline(s, {Kind::v1, 16, 16, 8, 64, 128});
}
void BM_DecodeVsBaseline_V2(benchmark::State& s) {
  decode_vs_baseline(s, {Kind::v2, 16, 8, 8, 64, 64});
}
void BM_DecodeVsBaseline_Plain16(benchmark::State& s) {
  decode_vs_baseline(s, {Kind::plain, 16, 8, 8, 64, 64});
}
void BM_DecodeThreads_MQA(benchmark::State& s) {
  decode_thread_scaling(s, {Kind::plain, 8, 1, 1, 128, 128});
}
void BM_DecodeReadOrder_V2(benchmark::State& s) {
  decode_read_order(s, {Kind::v2, 16, 8, 8, 64, 64});
}
void BM_DecodeReadOrder_Plain8(benchmark::State& s) {
  decode_read_order(s, {Kind::plain, 8, 8, 8, 64, 64});
}
void BM_DecodeWarm_V2(benchmark::State& s) { BM_Decode_V2(s); }
void BM_DecodeWarm_Plain8(benchmark::State& s) { BM_Decode_Plain8(s); }

void decode_sizes(benchmark::internal::Benchmark* b) {
  for (long m : {4096, 32768, 131072}) b->Args({m, 1, 2, 0});
  b->Args({4096, 8, 2, 0});
  b->Args({4096, 1, 1, 0});
  b->Args({32768, 1, 1, 0});
  b->Unit(benchmark::kMillisecond)->UseManualTime();
}

void vs_baseline_sizes(benchmark::internal::Benchmark* b) {
  b->Args({32768, 1, 2})->Args({131072, 1, 2})->Args({4096, 8, 2});
  b->Unit(benchmark::kMillisecond)->UseManualTime();
}

}  // namespace

BENCHMARK(BM_ReadBandwidth)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReadWithWork)
    ->ArgsProduct({{0, 4, 12, 24, 48}, {2}})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodeReadOrder_V2)->Arg(2)->Arg(1)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_DecodeReadOrder_Plain8)
    ->Arg(2)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_Decode_V1)->Apply(decode_sizes);
BENCHMARK(BM_Decode_V2)->Apply(decode_sizes);
BENCHMARK(BM_Decode_Plain8)->Apply(decode_sizes);
BENCHMARK(BM_Decode_Plain16)->Apply(decode_sizes);
BENCHMARK(BM_Decode_MQA)
    ->Args({262144, 1, 1, 0})
    ->Args({262144, 1, 2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_Decode_GQA4_D128)
    ->Args({32768, 1, 1, 0})
    ->Args({32768, 1, 2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodePaged_V2)
    ->Args({32768, 1, 2, 0, 16})
    ->Args({32768, 1, 2, 0, 256})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodeVsBaseline_V1)->Apply(vs_baseline_sizes);
BENCHMARK(BM_DecodeVsBaseline_V2)->Apply(vs_baseline_sizes);
BENCHMARK(BM_DecodeVsBaseline_Plain16)->Apply(vs_baseline_sizes);
BENCHMARK(BM_DecodeThreads_MQA)
    ->Args({262144, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(BM_DecodeWarm_V2)->Args({128, 1, 1, 1})->Unit(benchmark::kMicrosecond)->UseManualTime();
BENCHMARK(BM_DecodeWarm_Plain8)
    ->Args({128, 1, 1, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();

BENCHMARK_MAIN();
