// Pieces shared by the benchmarks: data, counters and the FMA peak probe, so
// that every binary reports its figures against the machine's peak measured
// in the same run.
#pragma once

#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>

#include <diffattn/detail/random.hpp>
#include <diffattn/detail/tile.hpp>
#include <diffattn/tensor.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace bench {

using diffattn::index_t;
using diffattn::Tensor;

constexpr index_t kHeadDim = 64;

template <std::size_t R = 4>
Tensor<float, R> random4(std::array<index_t, R> shape, std::uint64_t seed) {
  Tensor<float, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

/// Visible (query, key) pairs of a causal square of n.
inline double visible_pairs(index_t n) {
  return 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
}

/// GFLOPS (useful floating-point operations per second) and bytes per second.
inline void set_counters(benchmark::State& state, double flops, double bytes) {
  state.counters["GFLOPS"] = benchmark::Counter(
      flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  state.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                               benchmark::Counter::kIs1024);
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

}  // namespace bench
