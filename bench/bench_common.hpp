// Pieces shared by the benchmarks: data, counters and the FMA peak probe, so
// that every binary reports its figures against the machine's peak measured
// in the same run.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#define DIFFATTN_BENCH_CPUID 1
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <diffattn/detail/core/random.hpp>
#include <diffattn/detail/kernel/tile.hpp>
#include <diffattn/tensor.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace bench {

using diffattn::index_t;
using diffattn::Tensor;

/// Reads n floats at p (n a multiple of 4096) with `threads` threads, each a
/// contiguous share, through eight packet accumulators: the read-bandwidth
/// probe of the decoding benchmarks.
inline float stream_read(const float* p, index_t n, int threads) {
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

constexpr index_t kHeadDim = 64;

template <std::size_t R = 4>
Tensor<float, R> random4(std::array<index_t, R> shape, std::uint64_t seed) {
  Tensor<float, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

/// The L3 one core sees on an AMD processor: its core complex's, from CPUID
/// 0x8000001D; 32 MiB (a Zen 2-5 core complex's, at least) when the leaf is
/// missing, as on virtual machines whose CPUID 0x80000006 (what sysconf
/// reads) reports the whole socket's L3 (508 MiB on the Zen 5 used here,
/// against 32 MiB per core complex; rotating 2 GiB instead of 128 MiB there
/// halved the read probe, presumably through address translation). 0
/// elsewhere.
inline std::size_t amd_core_complex_l3() {
#ifdef DIFFATTN_BENCH_CPUID
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!amd) return 0;
  for (unsigned i = 0; i < 8 && __get_cpuid_count(0x8000001D, i, &a, &b, &c, &d); ++i) {
    if ((a & 31) == 0) break;
    if (((a >> 5) & 7) == 3)
      return std::size_t((b >> 22) + 1) * (((b >> 12) & 0x3ff) + 1) * ((b & 0xfff) + 1) * (c + 1);
  }
  return std::size_t(32) << 20;
#else
  return 0;
#endif
}

/// The last-level cache the memory-bound benchmarks must not fit in, in
/// bytes: DIFFATTN_BENCH_LLC_MIB if set; else on AMD the core complex's L3
/// (amd_core_complex_l3), elsewhere the L3 the system reports (480 MiB on
/// some Intel parts); at least 32 MiB.
inline std::size_t last_level_cache_bytes() {
  static const std::size_t bytes = [] {
    constexpr std::size_t kMiB = std::size_t(1) << 20;
    if (const char* env = std::getenv("DIFFATTN_BENCH_LLC_MIB")) {
      const long mib = std::atol(env);
      if (mib > 0) return static_cast<std::size_t>(mib) * kMiB;
    }
    std::size_t l3 = amd_core_complex_l3();
#if defined(_SC_LEVEL3_CACHE_SIZE)
    if (l3 == 0) {
      const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
      if (v > 0) l3 = static_cast<std::size_t>(v);
    }
#endif
    return std::max(l3, 32 * kMiB);
  }();
  return bytes;
}

/// The size in every benchmark binary's context (printed before the runs).
inline const bool kLastLevelCacheReported = [] {
  benchmark::AddCustomContext("last_level_cache_MiB",
                              std::to_string(last_level_cache_bytes() >> 20));
  return true;
}();

/// Copies of a cache of `bytes` to rotate through so that one pass over them
/// covers at least 4 x last_level_cache_bytes(): every step then reads its
/// cache from memory.
inline std::size_t cold_copies(std::size_t bytes) {
  const std::size_t set = 4 * last_level_cache_bytes();
  return std::max<std::size_t>(1, (set + bytes - 1) / std::max<std::size_t>(bytes, 1));
}

/// Fills t with uniform values in [-1, 1), stored as S: cheap enough for
/// GiB-sized caches.
template <class S, std::size_t R>
void fill_uniform(Tensor<S, R>& t, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (index_t i = 0; i < t.size(); ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t.data()[i] = static_cast<S>(static_cast<float>(static_cast<std::int32_t>(x >> 32)) *
                                 (1.0f / 2147483648.0f));
  }
}

/// Visible (query, key) pairs of a causal square of n.
inline double visible_pairs(index_t n) {
  return 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
}

/// GFLOPS (useful floating-point operations per second) and bytes per second,
/// both in powers of 1000: the "G/s" Google Benchmark prints for bytes is GB/s.
inline void set_counters(benchmark::State& state, double flops, double bytes) {
  state.counters["GFLOPS"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::kIs1000);
}

/// What the FMA units can do: 12 independent packet FMA chains per thread.
inline void BM_FmaPeak(benchmark::State& state) {
  using Packet = diffattn::detail::TileConfig<float>::Packet;
  constexpr int P = diffattn::detail::TileConfig<float>::kPacket;
  const int threads = static_cast<int>(state.range(0));
  const long iters = 20'000'000;
  for (auto _ : state) {
    float sink = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#endif
    {
      using namespace Eigen::internal;
      const Packet a = pset1<Packet>(1.0000001f), b = pset1<Packet>(1e-7f);
      Packet c[12];
      for (auto& x : c) x = pset1<Packet>(0.5f);
      for (long i = 0; i < iters; ++i)
        for (auto& x : c) x = pmadd(x, a, b);
      Packet s = c[0];
      for (int j = 1; j < 12; ++j) s = padd(s, c[j]);
      sink += predux(s);
    }
    benchmark::DoNotOptimize(sink);
  }
  set_counters(state, 2.0 * P * 12.0 * static_cast<double>(iters) * threads, 0);
}

/// What the bf16 dot products can do (AVX512-BF16's vdpbf16ps on zmm: 16
/// lanes x 2 products, 64 flops each): 12 independent accumulator chains per
/// thread, as BM_FmaPeak and as the bf16 micro-kernels' 6 x 2 tile (on Zen 5,
/// 12 chains reach two instructions a cycle, twice BM_FmaPeak's flops).
/// Skipped, with the reason, where the build does not target AVX512-BF16.
inline void BM_Bf16Peak(benchmark::State& state) {
#if defined(__AVX512BF16__)
  constexpr int kChains = 12;
  const int threads = static_cast<int>(state.range(0));
  const long iters = 10'000'000;
  for (auto _ : state) {
    float sink = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#endif
    {
      // 1.0 and 2^-20 as bf16 pairs: the sums grow by 2^-19 a step, far from
      // denormals and overflow.
      const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(0x35803580);
      __m512 c[kChains];
      for (auto& x : c) x = _mm512_set1_ps(0.5f);
      for (long i = 0; i < iters; ++i)
        for (auto& x : c) x = _mm512_dpbf16_ps(x, a, b);
      __m512 s = c[0];
      for (int j = 1; j < kChains; ++j) s = _mm512_add_ps(s, c[j]);
      sink += _mm512_reduce_add_ps(s);
    }
    benchmark::DoNotOptimize(sink);
  }
  set_counters(state, 64.0 * kChains * static_cast<double>(iters) * threads, 0);
#else
  state.SkipWithError("no bf16 dot products: the build does not target AVX512-BF16");
  for (auto _ : state) {
  }
#endif
}

}  // namespace bench
