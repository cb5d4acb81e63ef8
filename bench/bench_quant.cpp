// Decoding steps from 8-bit KV caches (int8, float8_e4m3) against bfloat16 and
// float caches of the same shape, alternated in one process so that all four
// meet the same neighbours, with the read probe of bench_decode (stream_read
// over a cold float copy, the step's threads) between rounds.
//
//   BM_QuantDecode_<layer>  args {M, threads}, B = 1; the shapes of
//                           bench_decode (d = 64; MQA one kv head of 128).
//     ms_<type>       a step's time;  GBs_<type>  its bytes (values and
//     scales) per second;  of_probe_<type>  that over the probe's rate;
//     <type>_vs_bf16  bf16's time over the type's; bytes_<type> per step.
//     The iteration time is int8's.
//     args {M, threads, warm}: warm = 1 reads one copy (in cache) again and
//     again, for the instructions' cost alone.
//   BM_QuantError     V2 (16 query heads on 8 kv heads of 64), M = 32k,
//     N(0,1) q, k, v: max |o - o_ref| / max |o_ref| against the float64
//     reference on the unquantized cache, for float, int8 and e4m3 caches,
//     and the a-priori bound of the quantization error (README) likewise.
//   BM_QuantArgmax    a V2 layer (E = 512, 8 heads on 4 kv heads of 64) on
//     random weights, 1024 tokens decoded one by one: the fraction of steps
//     whose argmax over the output row agrees with the float cache's; mean,
//     min and max over 8 seeds of weights and inputs.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/quantize.hpp>
#include <diffattn/reference.hpp>

#include "bench_common.hpp"

namespace {

using namespace bench;
using diffattn::bfloat16;
using diffattn::float8_e4m3;
using diffattn::KVCacheBatch;

enum class Kind { v1, v2, plain };

struct Layer {
  Kind kind;
  index_t qh, kh, vh, d, dv;
};

/// Cold copies of one layer's caches stored as S (8-bit: with scales).
template <class S>
class Rig {
 public:
  static constexpr bool kQuant = diffattn::is_8bit_storage_v<S>;
  Rig(const Layer& L, index_t M, int threads, bool warm = false)
      : bytes(static_cast<std::size_t>(M) *
              (static_cast<std::size_t>(L.kh * L.d + L.vh * L.dv) * sizeof(S) +
               (kQuant ? static_cast<std::size_t>(L.kh + L.vh) * sizeof(float) : 0))),
        copies(warm ? 1 : cold_copies(bytes)),
        L_(L),
        lens_({1}),
        q_(random4({1, 1, L.qh, L.d}, 7)),
        logit_({1, 1, L.qh / 2}),
        out_({1, 1, L.kind == Kind::plain ? L.qh : L.qh / 2, L.kind == Kind::v1 ? 2 * L.d : L.dv}) {
    for (std::size_t c = 0; c < copies; ++c) {
      ks_.emplace_back(std::array<index_t, 4>{1, M, L.kh, L.d});
      vs_.emplace_back(std::array<index_t, 4>{1, M, L.vh, L.dv});
      if constexpr (kQuant) {
        kscale_.emplace_back(std::array<index_t, 3>{1, M, L.kh});
        vscale_.emplace_back(std::array<index_t, 3>{1, M, L.vh});
        Tensor<float, 4> k({1, M, L.kh, L.d}), v({1, M, L.vh, L.dv});
        fill_uniform(k, 2 * c + 1);
        fill_uniform(v, 2 * c + 2);
        diffattn::quantize_rows<float, S>(k, ks_.back(), kscale_.back());
        diffattn::quantize_rows<float, S>(v, vs_.back(), vscale_.back());
      } else {
        fill_uniform(ks_.back(), 2 * c + 1);
        fill_uniform(vs_.back(), 2 * c + 2);
      }
    }
    lens_(0) = M;
    cache_.cache_seqlens = lens_;
    options_.causal = true;
    options_.num_threads = threads;
  }

  const std::size_t bytes;  // values and scales one step reads
  const std::size_t copies;

  double step(std::size_t it) {
    const std::size_t c = it % copies;
    if constexpr (kQuant) {
      cache_.k_scale = kscale_[c];
      cache_.v_scale = vscale_[c];
    }
    const auto t0 = clock::now();
    switch (L_.kind) {
      case Kind::v1:
        diffattn::diff_attention_v1_kvcache<float, S>(q_, ks_[c], vs_[c], 0.8f, out_, {}, cache_,
                                                      options_);
        break;
      case Kind::v2:
        diffattn::diff_attention_v2_kvcache<float, S>(q_, ks_[c], vs_[c], logit_, out_, {}, cache_,
                                                      options_);
        break;
      default:
        diffattn::attention_kvcache<float, S>(q_, ks_[c], vs_[c], out_, {}, cache_, options_);
    }
    benchmark::DoNotOptimize(out_.data());
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

  /// Stream-reads copy (it + copies / 2) with `threads` (float caches only).
  double probe(std::size_t it, int threads) {
    const std::size_t pc = (it + copies / 2) % copies;
    const auto t0 = clock::now();
    if constexpr (std::is_same<S, float>::value)
      benchmark::DoNotOptimize(stream_read(ks_[pc].data(), ks_[pc].size(), threads) +
                               stream_read(vs_[pc].data(), vs_[pc].size(), threads));
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

 private:
  using clock = std::chrono::steady_clock;
  Layer L_;
  std::vector<Tensor<S, 4>> ks_, vs_;
  std::vector<Tensor<float, 3>> kscale_, vscale_;
  Tensor<index_t, 1> lens_;
  Tensor<float, 4> q_;
  Tensor<float, 3> logit_;
  Tensor<float, 4> out_;
  KVCacheBatch cache_;
  diffattn::AttentionOptions options_;
};

void quant_decode(benchmark::State& state, const Layer& L) {
  const index_t M = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const bool warm = state.range(2) != 0;
  Rig<float> rf(L, M, threads, warm);
  Rig<bfloat16> rb(L, M, threads, warm);
  Rig<std::int8_t> ri(L, M, threads, warm);
  Rig<float8_e4m3> re(L, M, threads, warm);
  double t[4] = {0, 0, 0, 0}, probe_s = 0;
  std::size_t it = 0;
  for (auto _ : state) {
    // Each in turn first.
    double s[4] = {0, 0, 0, 0};
    for (int k = 0; k < 4; ++k) {
      switch ((k + static_cast<int>(it)) % 4) {
        case 0:
          s[0] = rf.step(it);
          break;
        case 1:
          s[1] = rb.step(it);
          break;
        case 2:
          s[2] = ri.step(it);
          break;
        default:
          s[3] = re.step(it);
      }
    }
    probe_s += rf.probe(it, threads);
    state.SetIterationTime(s[2]);
    for (int k = 0; k < 4; ++k) t[k] += s[k];
    ++it;
  }
  const double n = static_cast<double>(it);
  const double probe_rate = n * static_cast<double>(rf.bytes) / probe_s;
  const char* names[4] = {"float", "bf16", "int8", "e4m3"};
  const std::size_t bytes[4] = {rf.bytes, rb.bytes, ri.bytes, re.bytes};
  for (int k = 0; k < 4; ++k) {
    const std::string nm = names[k];
    const double rate = n * static_cast<double>(bytes[k]) / t[k];
    state.counters["ms_" + nm] = 1e3 * t[k] / n;
    state.counters["GBs_" + nm] = rate / 1e9;
    state.counters["of_probe_" + nm] = rate / probe_rate;
    state.counters["bytes_" + nm] = static_cast<double>(bytes[k]);
  }
  state.counters["probe_GBs"] = probe_rate / 1e9;
  state.counters["int8_vs_bf16"] = t[1] / t[2];
  state.counters["e4m3_vs_bf16"] = t[1] / t[3];
  state.counters["int8_vs_float"] = t[0] / t[2];
}

void BM_QuantDecode_V1(benchmark::State& s) { quant_decode(s, {Kind::v1, 16, 16, 8, 64, 128}); }
void BM_QuantDecode_V2(benchmark::State& s) { quant_decode(s, {Kind::v2, 16, 8, 8, 64, 64}); }
void BM_QuantDecode_Plain8(benchmark::State& s) {
  quant_decode(s, {Kind::plain, 8, 8, 8, 64, 64});
}
void BM_QuantDecode_Plain16(benchmark::State& s) {
  quant_decode(s, {Kind::plain, 16, 8, 8, 64, 64});
}
void BM_QuantDecode_MQA(benchmark::State& s) { quant_decode(s, {Kind::plain, 8, 1, 1, 128, 128}); }

template <std::size_t R>
Tensor<double, R> to_double(const Tensor<float, R>& t) {
  Tensor<double, R> d(t.shape());
  for (index_t i = 0; i < t.size(); ++i) d.data()[i] = t.data()[i];
  return d;
}

/// max |a - ref| / max |ref|.
template <class A>
double rel_err(const Tensor<A, 4>& a, const Tensor<double, 4>& ref) {
  double num = 0, den = 0;
  for (index_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a.data()[i]) - ref.data()[i]));
    den = std::max(den, std::abs(ref.data()[i]));
  }
  return num / den;
}

template <class Q>
void quant_error(benchmark::State& state, const char* name, const Tensor<float, 4>& q,
                 const Tensor<float, 4>& k, const Tensor<float, 4>& v,
                 const Tensor<float, 3>& logit, const Tensor<double, 4>& ref) {
  const index_t M = k.shape(1);
  Tensor<Q, 4> kq(k.shape()), vq(v.shape());
  Tensor<float, 3> ks({1, M, k.shape(2)}), vs({1, M, v.shape(2)});
  diffattn::quantize_rows<float, Q>(k, kq, ks);
  diffattn::quantize_rows<float, Q>(v, vq, vs);
  Tensor<index_t, 1> lens({1});
  lens(0) = M;
  KVCacheBatch c;
  c.cache_seqlens = lens;
  c.k_scale = ks;
  c.v_scale = vs;
  Tensor<float, 4> out(ref.shape());
  diffattn::diff_attention_v2_kvcache<float, Q>(q, kq, vq, logit, out, {}, c, {});
  state.counters[std::string("err_") + name] = rel_err(out, ref);
  // The a-priori bound (README): eps = scale max_j sum_t |q_t| e_jt over the
  // rows and heads, each map (e^(2 eps) - 1) max|v| + max|v - v^|, a DIFF
  // head map 1's plus lambda's times map 2's (lambda < 1).
  const bool i8 = std::is_same<Q, std::int8_t>::value;
  auto e = [&](double x, double s) {
    return i8 ? s / 2 : std::max(std::ldexp(std::abs(x), -4), std::ldexp(s, -10));
  };
  double eps = 0, vmax = 0, verr = 0;
  for (index_t h = 0; h < q.shape(2); ++h)
    for (index_t j = 0; j < M; ++j) {
      const index_t g = h / (q.shape(2) / k.shape(2));
      double sum = 0;
      for (index_t t = 0; t < q.shape(3); ++t) sum += std::abs(q(0, 0, h, t)) * e(k(0, j, g, t), ks(0, j, g));
      eps = std::max(eps, sum / std::sqrt(static_cast<double>(q.shape(3))));
    }
  for (index_t j = 0; j < M; ++j)
    for (index_t g = 0; g < v.shape(2); ++g)
      for (index_t t = 0; t < v.shape(3); ++t) {
        vmax = std::max(vmax, static_cast<double>(std::abs(v(0, j, g, t))));
        verr = std::max(verr, e(v(0, j, g, t), vs(0, j, g)));
      }
  double omax = 0;
  for (index_t i = 0; i < ref.size(); ++i) omax = std::max(omax, std::abs(ref.data()[i]));
  state.counters[std::string("bound_") + name] = 2 * (std::expm1(2 * eps) * vmax + verr) / omax;
}

void BM_QuantError(benchmark::State& state) {
  const index_t M = 32768;
  const Tensor<float, 4> q = random4({1, 1, 16, 64}, 1), k = random4({1, M, 8, 64}, 2),
                         v = random4({1, M, 8, 64}, 3);
  const Tensor<float, 3> logit = random4<3>({1, 1, 8}, 4);
  Tensor<double, 4> ref({1, 1, 8, 64});
  diffattn::reference::diff_attention_v2<double>(to_double(q), to_double(k), to_double(v),
                                                 to_double(logit), ref, {}, {});
  for (auto _ : state) {
    Tensor<index_t, 1> lens({1});
    lens(0) = M;
    KVCacheBatch c;
    c.cache_seqlens = lens;
    Tensor<float, 4> out({1, 1, 8, 64});
    diffattn::diff_attention_v2_kvcache<float>(q, k, v, logit, out, {}, c, {});
    state.counters["err_float"] = rel_err(out, ref);
    quant_error<std::int8_t>(state, "int8", q, k, v, logit, ref);
    quant_error<float8_e4m3>(state, "e4m3", q, k, v, logit, ref);
  }
}

template <class Q>
double argmax_agreement(index_t steps, std::uint64_t seed) {
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = 512;
  cfg.num_heads = 8;
  cfg.num_kv_heads = 4;
  cfg.head_dim = 64;
  cfg.causal = true;
  diffattn::MultiheadDiffAttnV2<float> layer(cfg, 3 + 2 * seed);
  const Tensor<float, 3> x = random4<3>({1, steps, 512}, 5 + 2 * seed);
  auto cf = layer.make_cache<float>(1, steps);
  auto cq = layer.make_cache<Q>(1, steps);
  index_t agree = 0;
  for (index_t r = 0; r < steps; ++r) {
    const diffattn::TensorView<const float, 3> xr(x.data() + r * 512, {1, 1, 512},
                                                  {steps * 512, 512, 1});
    const Tensor<float, 3> a = layer.forward(xr, cf), b = layer.forward(xr, cq);
    agree += std::max_element(a.data(), a.data() + 512) - a.data() ==
             std::max_element(b.data(), b.data() + 512) - b.data();
  }
  return static_cast<double>(agree) / static_cast<double>(steps);
}

template <class Q>
void agreement_over_seeds(benchmark::State& state, const std::string& name) {
  constexpr int kSeeds = 8;
  double sum = 0, lo = 1, hi = 0;
  for (int s = 0; s < kSeeds; ++s) {
    const double a = argmax_agreement<Q>(1024, static_cast<std::uint64_t>(s));
    sum += a, lo = std::min(lo, a), hi = std::max(hi, a);
  }
  state.counters["agree_" + name] = sum / kSeeds;
  state.counters["agree_" + name + "_min"] = lo;
  state.counters["agree_" + name + "_max"] = hi;
}

void BM_QuantArgmax(benchmark::State& state) {
  for (auto _ : state) {
    agreement_over_seeds<std::int8_t>(state, "int8");
    agreement_over_seeds<float8_e4m3>(state, "e4m3");
  }
}

void quant_sizes(benchmark::internal::Benchmark* b) {
  b->Args({32768, 2, 0})->Args({131072, 2, 0})->Unit(benchmark::kMillisecond)->UseManualTime();
}

}  // namespace

BENCHMARK(BM_QuantDecode_V2)->Apply(quant_sizes);
BENCHMARK(BM_QuantDecode_V1)->Apply(quant_sizes);
BENCHMARK(BM_QuantDecode_Plain8)->Apply(quant_sizes);
BENCHMARK(BM_QuantDecode_Plain16)->Args({32768, 2, 0})->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_QuantDecode_MQA)
    ->Args({131072, 2, 0})
    ->Args({262144, 2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
// Warm (one copy, M = 1024 on one thread, 2048 on two: each thread's rows
// stay in its L2): the step's instructions alone.
BENCHMARK(BM_QuantDecode_V2)
    ->Name("BM_QuantDecodeWarm_V2")
    ->Args({1024, 1, 1})
    ->Args({2048, 2, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseManualTime();
BENCHMARK(BM_QuantError)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_QuantArgmax)->Iterations(1)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
