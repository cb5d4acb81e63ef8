// Masks for real batches: a sliding window and a packed batch, beside the
// full causal kernel and separate calls, in one binary so that ratios come
// from one run.
//
//   BM_Fused_V1Causal/{N}/{threads}          the full causal square
//   BM_Fused_V1Window/{N}/{W-1}/{threads}    causal, window_left = W - 1
//   BM_Fused_V1Packed/{threads}              8 sequences of random lengths
//                                            summing to 8192, one call
//   BM_Fused_V1Separate/{threads}            the same sequences, one call each
//
// V1 with 8 DIFF heads of d = 64 (values 128 wide). GFLOPS counts useful work
// on visible pairs only (8 d multiply-adds per pair and DIFF head, as in
// bench_attention), so a kernel whose cost follows the band keeps its rate.
#include <benchmark/benchmark.h>

#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/packed.hpp>

#include "bench_common.hpp"

namespace {

using namespace bench;
constexpr index_t kHeads = 8;

/// Visible pairs of a causal square of n with a window of w keys per query.
double window_pairs(index_t n, index_t w) {
  double p = 0;
  for (index_t i = 0; i < n; ++i) p += static_cast<double>(std::min(i + 1, w));
  return p;
}

double v1_flops(double pairs) { return kHeads * 8.0 * pairs * kHeadDim; }

void run_v1(benchmark::State& state, index_t n, index_t window_left, int threads) {
  const index_t H = kHeads, d = kHeadDim;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, 2 * H, d}, 2),
             v = random4({1, n, H, 2 * d}, 3);
  Tensor<float, 4> out({1, n, H, 2 * d});
  diffattn::AttentionOptions o;
  o.causal = true;
  o.window_left = window_left;
  o.num_threads = threads;
  for (auto _ : state) {
    diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  const double pairs = window_left < 0 ? visible_pairs(n) : window_pairs(n, window_left + 1);
  set_counters(state, v1_flops(pairs),
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

void BM_Fused_V1Causal(benchmark::State& state) {
  run_v1(state, state.range(0), -1, static_cast<int>(state.range(1)));
}

void BM_Fused_V1Window(benchmark::State& state) {
  run_v1(state, state.range(0), state.range(1), static_cast<int>(state.range(2)));
}

/// 8 lengths in [256, 2048) summing to 8192, fixed by the seed.
std::vector<index_t> packed_lengths() {
  diffattn::detail::Rng rng(42);
  std::vector<double> w(8);
  double sum = 0;
  for (double& x : w) sum += (x = 0.25 + rng.uniform());
  std::vector<index_t> l(8);
  index_t total = 0;
  for (std::size_t i = 0; i + 1 < l.size(); ++i)
    total += (l[i] = static_cast<index_t>(8192 * w[i] / sum));
  l.back() = 8192 - total;
  return l;
}

template <bool Packed>
void packed(benchmark::State& state) {
  const index_t H = kHeads, d = kHeadDim, T = 8192;
  const auto lengths = packed_lengths();
  const auto seqs = diffattn::PackedSequences::from_lengths(lengths);
  const auto q = random4<3>({T, 2 * H, d}, 1), k = random4<3>({T, 2 * H, d}, 2),
             v = random4<3>({T, H, 2 * d}, 3);
  Tensor<float, 3> out({T, H, 2 * d});
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = static_cast<int>(state.range(0));
  using View4 = diffattn::TensorView<const float, 4>;
  for (auto _ : state) {
    if (Packed) {
      diffattn::diff_attention_v1_varlen<float>(q, k, v, 0.8f, out, {}, seqs, o);
    } else {
      for (std::size_t s = 0; s < lengths.size(); ++s) {
        const index_t r0 = seqs.cu_seqlens_q[s], n = lengths[s];
        diffattn::diff_attention_v1<float>(
            View4(q.data() + r0 * 2 * H * d, {1, n, 2 * H, d}),
            View4(k.data() + r0 * 2 * H * d, {1, n, 2 * H, d}),
            View4(v.data() + r0 * H * 2 * d, {1, n, H, 2 * d}), 0.8f,
            diffattn::TensorView<float, 4>(out.data() + r0 * H * 2 * d, {1, n, H, 2 * d}), o);
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  double pairs = 0;
  for (index_t n : lengths) pairs += visible_pairs(n);
  set_counters(state, v1_flops(pairs),
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

void BM_Fused_V1Packed(benchmark::State& s) { packed<true>(s); }
void BM_Fused_V1Separate(benchmark::State& s) { packed<false>(s); }

}  // namespace

BENCHMARK(bench::BM_FmaPeak)->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_Fused_V1Causal)
    ->Args({4096, 1})
    ->Args({4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Fused_V1Window)
    ->Args({4096, 511, 2})
    ->Args({16384, 511, 1})
    ->Args({16384, 511, 2})
    ->Args({16384, 127, 2})
    ->Args({16384, 2047, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Fused_V1Packed)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Fused_V1Separate)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
