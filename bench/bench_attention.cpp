// Fused kernels beside the materialised reference and plain attention, in one
// binary so that ratios come from one run. Shapes are parameter-matched at
// embedding width 1024:
//   V1     8 DIFF heads, d = 64, values 128 wide
//   V2     16 query heads, 8 kv heads, d = 64
//   Plain  16 heads of 64
// GFLOPS counts useful work on visible (query, key) pairs only, P of them:
// V1 8 P d per DIFF head (both maps' scores, one product of W with 2d-wide
// values); V2 and plain 4 P d per query head. The three layers then do the
// same work and the same number of exp() calls.
//
// BM_Bf16_<kind>: the same fused kernels with q, k, v and out stored as
// bfloat16 (V2's lambda_logit too): under AVX512-BF16 both products run on
// bf16 dot products (detail/kernel/bf16_dot.hpp, detail/kernel/bf16_wv.hpp). Their rates
// are compared with BM_Bf16Peak, the instruction's peak in the same run.
//
// Arguments: {N, threads}. B = 1, causal.
#include <benchmark/benchmark.h>

#include <diffattn/diffattn.hpp>
#include <diffattn/detail/core/random.hpp>

#include "bench_common.hpp"

namespace {

using namespace bench;

diffattn::AttentionOptions options(const benchmark::State& state, bool fused) {
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = static_cast<int>(state.range(1));
  // The reference is what a user writes with Eigen: its products use Eigen's
  // own threads when the heads are not spread over threads already.
  if (!fused) Eigen::setNbThreads(o.num_threads);
  return o;
}

template <bool Fused>
void v1(benchmark::State& state) {
  const index_t n = state.range(0), H = 8, d = kHeadDim;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, 2 * H, d}, 2),
             v = random4({1, n, H, 2 * d}, 3);
  Tensor<float, 4> out({1, n, H, 2 * d});
  const auto o = options(state, Fused);
  for (auto _ : state) {
    if (Fused)
      diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, o);
    else
      diffattn::reference::diff_attention_v1<float>(q, k, v, 0.8f, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, H * 8.0 * visible_pairs(n) * d,
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

template <bool Fused>
void v2(benchmark::State& state) {
  const index_t n = state.range(0), H = 8, Hkv = 8, d = kHeadDim;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, Hkv, d}, 2),
             v = random4({1, n, Hkv, d}, 3);
  Tensor<float, 3> logit({1, n, H});
  Tensor<float, 4> out({1, n, H, d});
  const auto o = options(state, Fused);
  for (auto _ : state) {
    if (Fused)
      diffattn::diff_attention_v2<float>(q, k, v, logit, out, o);
    else
      diffattn::reference::diff_attention_v2<float>(q, k, v, logit, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(
      state, 2 * H * 4.0 * visible_pairs(n) * d,
      4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size() + logit.size()));
}

template <bool Fused>
void plain(benchmark::State& state) {
  const index_t n = state.range(0), H = 16, d = kHeadDim;
  const auto q = random4({1, n, H, d}, 1), k = random4({1, n, H, d}, 2),
             v = random4({1, n, H, d}, 3);
  Tensor<float, 4> out({1, n, H, d});
  const auto o = options(state, Fused);
  for (auto _ : state) {
    if (Fused)
      diffattn::attention<float>(q, k, v, out, o);
    else
      diffattn::reference::attention<float>(q, k, v, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, H * 4.0 * visible_pairs(n) * d,
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

template <class S, std::size_t R>
Tensor<S, R> to(const Tensor<float, R>& t) {
  Tensor<S, R> r(t.shape());
  for (index_t i = 0; i < t.size(); ++i) r.data()[i] = static_cast<S>(t.data()[i]);
  return r;
}

/// The fused V1 (0), V2 (1) or plain (2) kernel of the shapes above, every
/// tensor stored as S.
template <class S, int Kind>
void fused16(benchmark::State& state) {
  const index_t n = state.range(0), d = kHeadDim;
  const index_t H = Kind == 2 ? 16 : 8, qh = 16, kh = Kind == 1 ? 8 : 16;
  const index_t vh = Kind == 2 ? 16 : 8, vw = Kind == 0 ? 2 * d : d;
  const auto q = to<S>(random4({1, n, qh, d}, 1)), k = to<S>(random4({1, n, kh, d}, 2)),
             v = to<S>(random4({1, n, vh, vw}, 3));
  const auto logit = to<S>(random4<3>({1, n, 8}, 4));
  Tensor<S, 4> out({1, n, H, vw});
  const auto o = options(state, true);
  for (auto _ : state) {
    if constexpr (Kind == 0)
      diffattn::diff_attention_v1<S>(q, k, v, 0.8f, out, o);
    else if constexpr (Kind == 1)
      diffattn::diff_attention_v2<S>(q, k, v, logit, out, o);
    else
      diffattn::attention<S>(q, k, v, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  // The float benchmarks' useful work (V1: 8 P d per DIFF head; V2, plain: 4 P d per query head).
  const double flops = (Kind == 0 ? 8.0 * 8 : 4.0 * 16) * visible_pairs(n) * d;
  set_counters(state, flops,
               static_cast<double>(sizeof(S)) *
                   static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

// Backward: GFLOPS counts 2.5x the forward's useful work (recomputed scores,
// dW, dQ, dK, dV: the flash-attention convention; V1 does exactly 10 P d
// multiply-adds per DIFF head, 2.5x its forward).
template <bool Fused>
void v1_backward(benchmark::State& state) {
  const index_t n = state.range(0), H = 8, d = kHeadDim;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, 2 * H, d}, 2),
             v = random4({1, n, H, 2 * d}, 3);
  const auto dout = random4({1, n, H, 2 * d}, 4);
  Tensor<float, 4> out({1, n, H, 2 * d}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse({1, 2 * H, n});
  const auto o = options(state, Fused);
  diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, lse, o);
  float dlambda = 0;
  for (auto _ : state) {
    if (Fused)
      diffattn::diff_attention_v1_backward<float>(q, k, v, 0.8f, out, lse, dout, dq, dk, dv,
                                                  dlambda, o);
    else
      diffattn::reference::diff_attention_v1_backward<float>(q, k, v, 0.8f, out, lse, dout, dq, dk,
                                                             dv, dlambda, o);
    benchmark::DoNotOptimize(dq.data());
  }
  set_counters(
      state, 2.5 * H * 8.0 * visible_pairs(n) * d,
      4.0 * static_cast<double>(2 * q.size() + 2 * k.size() + 2 * v.size() + 2 * out.size()));
}

void plain_backward(benchmark::State& state) {
  const index_t n = state.range(0), H = 16, d = kHeadDim;
  const auto q = random4({1, n, H, d}, 1), k = random4({1, n, H, d}, 2),
             v = random4({1, n, H, d}, 3);
  const auto dout = random4({1, n, H, d}, 4);
  Tensor<float, 4> out({1, n, H, d}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse({1, H, n});
  const auto o = options(state, true);
  diffattn::attention<float>(q, k, v, out, lse, o);
  for (auto _ : state) {
    diffattn::attention_backward<float>(q, k, v, out, lse, dout, dq, dk, dv, o);
    benchmark::DoNotOptimize(dq.data());
  }
  set_counters(
      state, 2.5 * H * 4.0 * visible_pairs(n) * d,
      4.0 * static_cast<double>(2 * q.size() + 2 * k.size() + 2 * v.size() + 2 * out.size()));
}

// Decoding: one new query against M cached keys; bytes counts the K and V read.
template <bool Diff>
void decode(benchmark::State& state) {
  const index_t m = state.range(0), H = 8, d = kHeadDim;
  const index_t qh = 2 * H, kh = Diff ? 2 * H : 2 * H, vh = Diff ? H : 2 * H, vw = Diff ? 2 * d : d;
  const auto q = random4({1, 1, qh, d}, 1), k = random4({1, m, kh, d}, 2),
             v = random4({1, m, vh, vw}, 3);
  Tensor<float, 4> out({1, 1, Diff ? H : qh, vw});
  const auto o = options(state, true);
  for (auto _ : state) {
    if (Diff)
      diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, o);
    else
      diffattn::attention<float>(q, k, v, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, H * 8.0 * static_cast<double>(m) * d,
               4.0 * static_cast<double>(k.size() + v.size()));
}

// V2 decoding: 16 query heads read 8 kv heads of 64, each pair one kv head.
void BM_Fused_V2Decode(benchmark::State& state) {
  const index_t m = state.range(0), H = 8, Hkv = 8, d = kHeadDim;
  const auto q = random4({1, 1, 2 * H, d}, 1), k = random4({1, m, Hkv, d}, 2),
             v = random4({1, m, Hkv, d}, 3);
  Tensor<float, 3> logit({1, 1, H});
  Tensor<float, 4> out({1, 1, H, d});
  const auto o = options(state, true);
  for (auto _ : state) {
    diffattn::diff_attention_v2<float>(q, k, v, logit, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, 2 * H * 4.0 * static_cast<double>(m) * d,
               4.0 * static_cast<double>(k.size() + v.size()));
}

void BM_Fused_V1Decode(benchmark::State& s) { decode<true>(s); }
void BM_Fused_PlainDecode(benchmark::State& s) { decode<false>(s); }

void BM_Fused_V1Backward(benchmark::State& s) { v1_backward<true>(s); }
void BM_Reference_V1Backward(benchmark::State& s) { v1_backward<false>(s); }
void BM_Fused_PlainBackward(benchmark::State& s) { plain_backward(s); }

void BM_Fused_V1(benchmark::State& s) { v1<true>(s); }
void BM_Reference_V1(benchmark::State& s) { v1<false>(s); }
void BM_Fused_V2(benchmark::State& s) { v2<true>(s); }
void BM_Reference_V2(benchmark::State& s) { v2<false>(s); }
void BM_Fused_Plain(benchmark::State& s) { plain<true>(s); }
void BM_Reference_Plain(benchmark::State& s) { plain<false>(s); }

void BM_Bf16_V1(benchmark::State& s) { fused16<diffattn::bfloat16, 0>(s); }
void BM_Bf16_V2(benchmark::State& s) { fused16<diffattn::bfloat16, 1>(s); }
void BM_Bf16_Plain(benchmark::State& s) { fused16<diffattn::bfloat16, 2>(s); }

void sizes(benchmark::internal::Benchmark* b, std::initializer_list<long> ns) {
  for (long threads : {1, 2})
    for (long n : ns) b->Args({n, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(bench::BM_FmaPeak)->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(bench::BM_Bf16Peak)->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_Fused_V1)->Apply([](auto* b) { sizes(b, {256, 1024, 2048, 4096, 16384}); });
BENCHMARK(BM_Fused_V2)->Apply([](auto* b) { sizes(b, {256, 1024, 2048, 4096, 16384}); });
BENCHMARK(BM_Fused_Plain)->Apply([](auto* b) { sizes(b, {256, 1024, 2048, 4096, 16384}); });
BENCHMARK(BM_Bf16_V1)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Bf16_V2)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Bf16_Plain)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Reference_V1)->Apply([](auto* b) { sizes(b, {256, 1024, 2048}); });
BENCHMARK(BM_Reference_V2)->Apply([](auto* b) { sizes(b, {256, 1024, 2048}); });
BENCHMARK(BM_Reference_Plain)->Apply([](auto* b) { sizes(b, {256, 1024, 2048}); });
BENCHMARK(BM_Fused_V1Decode)->Apply([](auto* b) { sizes(b, {4096, 16384}); });
BENCHMARK(BM_Fused_V2Decode)->Apply([](auto* b) { sizes(b, {4096, 16384}); });
BENCHMARK(BM_Fused_PlainDecode)->Apply([](auto* b) { sizes(b, {4096, 16384}); });
BENCHMARK(BM_Fused_V1Backward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Fused_PlainBackward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Reference_V1Backward)->Apply([](auto* b) { sizes(b, {1024}); });

BENCHMARK_MAIN();
