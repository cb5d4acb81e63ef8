// The analysis kernel beside the forward kernel at the same shape, so that the
// cost of measuring can be read as a ratio (target: within 1.5x).
// V1, 8 DIFF heads, d = 64, values 128 wide, B = 1, causal; GFLOPS counts the
// forward's useful work (8 P d per DIFF head, P visible pairs) for both.
//
// Arguments: {N, threads}.
#include <benchmark/benchmark.h>

#include <diffattn/analysis.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/detail/core/random.hpp>

namespace {

using diffattn::index_t;
using diffattn::Tensor;

constexpr index_t kHeads = 8, kHeadDim = 64;

Tensor<float, 4> random4(std::array<index_t, 4> shape, std::uint64_t seed) {
  Tensor<float, 4> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

struct V1Inputs {
  Tensor<float, 4> q, k, v, out;
  explicit V1Inputs(index_t n)
      : q(random4({1, n, 2 * kHeads, kHeadDim}, 1)),
        k(random4({1, n, 2 * kHeads, kHeadDim}, 2)),
        v(random4({1, n, kHeads, 2 * kHeadDim}, 3)),
        out({1, n, kHeads, 2 * kHeadDim}) {}
};

diffattn::AttentionOptions options(const benchmark::State& state) {
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = static_cast<int>(state.range(1));
  return o;
}

void set_flops(benchmark::State& state, index_t n) {
  const double pairs = 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  state.counters["GFLOPS"] = benchmark::Counter(8.0 * pairs * kHeadDim * kHeads,
                                                benchmark::Counter::kIsIterationInvariantRate,
                                                benchmark::Counter::kIs1000);
}

void BM_Fused_V1Forward(benchmark::State& state) {
  const index_t n = state.range(0);
  V1Inputs in(n);
  const auto o = options(state);
  for (auto _ : state) {
    diffattn::diff_attention_v1<float>(in.q, in.k, in.v, 0.8f, in.out.view(), o);
    benchmark::DoNotOptimize(in.out.data());
  }
  set_flops(state, n);
}

// Every statistic over every query row, a needle of 16 keys, and the output.
void BM_Analysis_V1Stats(benchmark::State& state) {
  const index_t n = state.range(0);
  V1Inputs in(n);
  const auto o = options(state);
  diffattn::AnalysisOptions a;
  a.needle_begin = n / 2;
  a.needle_end = n / 2 + 16;
  for (auto _ : state) {
    const auto st =
        diffattn::diff_attention_v1_stats<float>(in.q, in.k, in.v, 0.8f, in.out.view(), o, a);
    benchmark::DoNotOptimize(st.needle_mass.data());
  }
  set_flops(state, n);
}

// The same with 4-bit logits.
void BM_Analysis_V1Stats4Bit(benchmark::State& state) {
  const index_t n = state.range(0);
  V1Inputs in(n);
  const auto o = options(state);
  diffattn::AnalysisOptions a;
  a.logit_bits = 4;
  for (auto _ : state) {
    const auto st =
        diffattn::diff_attention_v1_stats<float>(in.q, in.k, in.v, 0.8f, in.out.view(), o, a);
    benchmark::DoNotOptimize(st.needle_mass.data());
  }
  set_flops(state, n);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (long threads : {1, 2})
    for (long n : {1024, 4096}) b->Args({n, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_Fused_V1Forward)->Apply(sizes);
BENCHMARK(BM_Analysis_V1Stats)->Apply(sizes);
BENCHMARK(BM_Analysis_V1Stats4Bit)->Apply(sizes);

BENCHMARK_MAIN();
