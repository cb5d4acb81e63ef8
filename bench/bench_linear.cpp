// The layers' projection product y = x W^T (detail/layers/linear.hpp) beside Eigen's
// GEMM on the same data, in float and with bfloat16 x, W and y. Arguments:
// {rows, threads}; in = out = 1024.
#include <benchmark/benchmark.h>

#include <diffattn/detail/layers/linear.hpp>
#include <diffattn/matrix.hpp>

namespace {

constexpr long kWidth = 1024;

void counters(benchmark::State& state, long rows) {
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * rows * kWidth * kWidth,
                                                benchmark::Counter::kIsIterationInvariantRate,
                                                benchmark::Counter::kIs1000);
}

template <class S>
void BM_Fused_Linear(benchmark::State& state) {
  const long rows = state.range(0);
  const diffattn::Matrix<float> xf = diffattn::Matrix<float>::Random(rows, kWidth);
  const diffattn::Matrix<float> wf = diffattn::Matrix<float>::Random(kWidth, kWidth);
  const diffattn::Matrix<S> x = xf.cast<S>(), w = wf.cast<S>();
  diffattn::Matrix<S> y(rows, kWidth);
  for (auto _ : state) {
    diffattn::detail::linear(x.data(), rows, kWidth, w.data(), kWidth, y.data(),
                             static_cast<int>(state.range(1)));
    benchmark::DoNotOptimize(y.data());
  }
  counters(state, rows);
}

void BM_Eigen_Linear(benchmark::State& state) {
  const long rows = state.range(0);
  Eigen::setNbThreads(static_cast<int>(state.range(1)));
  const diffattn::Matrix<float> x = diffattn::Matrix<float>::Random(rows, kWidth);
  const diffattn::Matrix<float> w = diffattn::Matrix<float>::Random(kWidth, kWidth);
  diffattn::Matrix<float> y(rows, kWidth);
  for (auto _ : state) {
    y.noalias() = x * w.transpose();
    benchmark::DoNotOptimize(y.data());
  }
  counters(state, rows);
}

}  // namespace

static void linear_args(benchmark::internal::Benchmark* b) {
  b->Args({4096, 1})
      ->Args({4096, 2})
      ->Args({1, 2})
      ->Args({16, 2})
      ->Args({64, 2})
      ->Args({128, 2})
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}
BENCHMARK_TEMPLATE(BM_Fused_Linear, float)->Apply(linear_args);
// bfloat16 x, W and y: bf16 dot products under AVX512-BF16, float products of
// the widened values elsewhere.
BENCHMARK_TEMPLATE(BM_Fused_Linear, diffattn::bfloat16)->Apply(linear_args);
BENCHMARK(BM_Eigen_Linear)->Apply(linear_args);

BENCHMARK_MAIN();
