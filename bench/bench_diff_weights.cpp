// The materialised single-head map: the reference path's cost.
#include <benchmark/benchmark.h>

#include <diffattn/diffattn.hpp>

static void BM_Reference_DiffWeights(benchmark::State& state) {
  const auto n = static_cast<int>(state.range(0));
  const int d = 64;
  using M = diffattn::Matrix<float>;
  const M q1 = M::Random(n, d), k1 = M::Random(n, d), q2 = M::Random(n, d), k2 = M::Random(n, d);
  diffattn::AttentionOptions opt;
  opt.causal = true;
  for (auto _ : state) {
    M w = diffattn::diff_weights(q1, k1, q2, k2, 0.8f, opt);
    benchmark::DoNotOptimize(w.data());
  }
  // Two score products of n*n*d multiply-adds each.
  state.counters["GFLOPS"] = benchmark::Counter(
      4.0 * n * n * d, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_Reference_DiffWeights)->Arg(128)->Arg(512)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
