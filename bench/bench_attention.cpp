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
// BM_Bf16_V1Backward, BM_Bf16_V2Backward and BM_Bf16_PlainBackward: the
// backward of the same shapes with bfloat16 storage (lse float), beside
// BM_Fused_V1Backward, BM_Fused_V2Backward and BM_Fused_PlainBackward. The
// backward's GFLOPS count 2.5x the forward's useful work.
//
// Arguments: {N, threads}. B = 1, causal.
#include <benchmark/benchmark.h>

#include <diffattn/diffattn.hpp>
#include <diffattn/detail/core/random.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

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

/// The backward of v1_backward (Kind 0), of V2 (Kind 1: the shapes of v2,
/// lambda_logit stored as S) and of plain_backward (Kind 2) with q, k, v,
/// out, dout and the gradients stored as S (lse float): with S = bfloat16 the
/// pair of BM_Fused_V1Backward and BM_Fused_PlainBackward; with S = float,
/// BM_Fused_V2Backward.
template <class S, int Kind>
void backward16(benchmark::State& state) {
  const index_t n = state.range(0), d = kHeadDim;
  const index_t H = Kind == 2 ? 16 : 8, qh = 16, kh = Kind == 1 ? 8 : 16;
  const index_t vw = Kind == 0 ? 2 * d : d, vh = Kind == 1 ? 8 : H, lh = Kind == 2 ? H : 2 * H;
  const auto q = to<S>(random4({1, n, qh, d}, 1)), k = to<S>(random4({1, n, kh, d}, 2)),
             v = to<S>(random4({1, n, vh, vw}, 3)), dout = to<S>(random4({1, n, H, vw}, 4));
  Tensor<S, 4> out({1, n, H, vw}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse({1, lh, n});
  Tensor<S, 3> logit({1, n, Kind == 1 ? H : 0}), dlogit(logit.shape());
  const auto o = options(state, true);
  if constexpr (Kind == 0)
    diffattn::diff_attention_v1<S>(q, k, v, 0.8f, out, lse, o);
  else if constexpr (Kind == 1)
    diffattn::diff_attention_v2<S>(q, k, v, logit, out, lse, o);
  else
    diffattn::attention<S>(q, k, v, out, lse, o);
  float dlambda = 0;
  for (auto _ : state) {
    if constexpr (Kind == 0)
      diffattn::diff_attention_v1_backward<S>(q, k, v, 0.8f, out, lse, dout, dq, dk, dv, dlambda,
                                              o);
    else if constexpr (Kind == 1)
      diffattn::diff_attention_v2_backward<S>(q, k, v, logit, out, lse, dout, dq, dk, dv, dlogit,
                                              o);
    else
      diffattn::attention_backward<S>(q, k, v, out, lse, dout, dq, dk, dv, o);
    benchmark::DoNotOptimize(dq.data());
  }
  set_counters(state, 2.5 * (Kind == 0 ? 8.0 * 8 : 4.0 * 16) * visible_pairs(n) * d,
               static_cast<double>(sizeof(S)) * static_cast<double>(2 * q.size() + 2 * k.size() +
                                                                    2 * v.size() + 2 * out.size()));
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

// Score modifiers (issue 37) on the V1 (Kind 0) and V2 (Kind 1) shapes above,
// {N, threads, mode}: 0 none, 1 an empty functor, 2 softcap 30, 3 ALiBi, 4
// sinks, 5 a document mask of 8 equal sequences as a `visible` functor over
// the whole row, 7 the same functor with visible_block (chunks classified
// from the documents' ranges), 8 the same functor with visible_range (each
// row's document), 6 the packed varlen call on the same 8 sequences (the
// baseline of 5, 7 and 8); 9 a functor that lets every row see every key
// (visible and visible_range, no mask beyond causal: the cost of the functor
// path itself). Ratios against mode 0 (modes 1-4, 9) and 6 (modes 5, 7, 8)
// come from one run.
using diffattn::TensorView;
struct EmptyMod {};
struct DocumentMask {
  const index_t* doc;  // document of each token, non-decreasing
  bool visible(index_t, index_t, index_t i, index_t j) const { return doc[i] == doc[j]; }
};
struct DocumentBlocks : DocumentMask {
  int visible_block(index_t, index_t, index_t i0, index_t i1, index_t j0, index_t j1) const {
    const index_t qa = doc[i0], qb = doc[i1 - 1], ka = doc[j0], kb = doc[j1 - 1];
    if (qb < ka || kb < qa) return 0;
    return qa == qb && ka == kb && qa == ka ? 2 : 1;
  }
};
struct DocumentRanges : DocumentMask {
  index_t len;  // tokens per document
  std::pair<index_t, index_t> visible_range(index_t, index_t, index_t i) const {
    return {doc[i] * len, doc[i] * len + len};
  }
};
struct AllVisible {
  bool visible(index_t, index_t, index_t, index_t) const { return true; }
  std::pair<index_t, index_t> visible_range(index_t, index_t, index_t) const {
    return {0, std::numeric_limits<index_t>::max()};
  }
};

template <int Kind>
void modifiers(benchmark::State& state) {
  const index_t n = state.range(0), mode = state.range(2), d = kHeadDim, H = 8;
  const index_t kh = Kind == 0 ? 2 * H : 8, vw = Kind == 0 ? 2 * d : d;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, kh, d}, 2),
             v = random4({1, n, Kind == 0 ? H : 8, vw}, 3);
  Tensor<float, 3> logit({1, n, H});
  Tensor<float, 4> out({1, n, H, vw});
  Tensor<float, 3> lse({1, 2 * H, n});
  auto o = options(state, true);
  const std::vector<float> slopes = diffattn::standard_alibi_slopes(2 * H);
  std::vector<float> sinks(static_cast<std::size_t>(2 * H), 0.5f);
  if (mode == 2) o.softcap = 30.0f;
  if (mode == 3) o.alibi_slopes = TensorView<const float, 1>(slopes.data(), {2 * H});
  if (mode == 4) o.sinks = TensorView<const float, 1>(sinks.data(), {2 * H});
  const index_t doc = n / 8;
  std::vector<index_t> doc_of(static_cast<std::size_t>(n));
  for (index_t t = 0; t < n; ++t) doc_of[static_cast<std::size_t>(t)] = t / doc;
  const auto seqs = diffattn::PackedSequences::from_lengths(std::vector<index_t>(8, doc));
  auto drop = [](const auto& t) {
    using V = std::remove_const_t<std::remove_pointer_t<decltype(t.data())>>;
    return TensorView<const V, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)});
  };
  TensorView<float, 3> out3(out.data(), {n, H, vw});
  TensorView<float, 2> lse2(lse.data(), {2 * H, n});
  auto call = [&](const auto& mod) {
    if constexpr (Kind == 0)
      diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, lse, o, mod);
    else
      diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o, mod);
  };
  for (auto _ : state) {
    if (mode == 1) {
      call(EmptyMod{});
    } else if (mode == 5) {
      call(DocumentMask{doc_of.data()});
    } else if (mode == 7) {
      call(DocumentBlocks{{doc_of.data()}});
    } else if (mode == 8) {
      call(DocumentRanges{{doc_of.data()}, doc});
    } else if (mode == 9) {
      call(AllVisible{});
    } else if (mode == 6) {
      if constexpr (Kind == 0)
        diffattn::diff_attention_v1_varlen<float>(drop(q), drop(k), drop(v), 0.8f, out3, lse2, seqs,
                                                  o);
      else
        diffattn::diff_attention_v2_varlen<float>(drop(q), drop(k), drop(v),
                                                  TensorView<const float, 2>(logit.data(), {n, H}),
                                                  out3, lse2, seqs, o);
    } else if constexpr (Kind == 0) {
      diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, lse, o);
    } else {
      diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o);
    }
    benchmark::DoNotOptimize(out.data());
  }
  const double pairs = mode >= 5 && mode <= 8 ? 8 * visible_pairs(doc) : visible_pairs(n);
  set_counters(state, H * 8.0 * pairs * d,
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

// V1 backward with softcap 30 (mode 2) against none (mode 0), {N, threads, mode}.
void modifiers_backward(benchmark::State& state) {
  const index_t n = state.range(0), H = 8, d = kHeadDim;
  const auto q = random4({1, n, 2 * H, d}, 1), k = random4({1, n, 2 * H, d}, 2),
             v = random4({1, n, H, 2 * d}, 3), dout = random4({1, n, H, 2 * d}, 4);
  Tensor<float, 4> out({1, n, H, 2 * d}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse({1, 2 * H, n});
  auto o = options(state, true);
  if (state.range(2) == 2) o.softcap = 30.0f;
  diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, lse, o);
  float dlambda = 0;
  for (auto _ : state) {
    diffattn::diff_attention_v1_backward<float>(q, k, v, 0.8f, out, lse, dout, dq, dk, dv, dlambda,
                                                o);
    benchmark::DoNotOptimize(dq.data());
  }
  set_counters(state, 2.5 * H * 8.0 * visible_pairs(n) * d,
               4.0 * static_cast<double>(2 * q.size() + 2 * k.size() + 2 * v.size()));
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

// Peaked scores: the V2 shapes above with q drawn with standard deviation
// sigma (args {N or M, threads, sigma}), so that the scores' standard
// deviation is sigma (d = 64, scale 1/8) and, at sigma 30, many of each row's
// exps fall below 2^-126: the denormals that the kernels flush (config.hpp,
// DIFFATTN_FLUSH_DENORMALS). What = 0 forward, 1 backward, 2 a decoding
// step over M cached keys. Their time at sigma 30 over sigma 1, from one run,
// is what peaked attention costs; without the flush it was 13x (forward),
// 62x (backward) and 4.5x (decoding) on an Emerald Rapids Xeon.
template <int What>
void peaked(benchmark::State& state) {
  const index_t n = state.range(0), H = 8, d = kHeadDim;
  const double sigma = static_cast<double>(state.range(2));
  const index_t nq = What == 2 ? 1 : n;
  auto q = random4({1, nq, 2 * H, d}, 1);
  for (index_t i = 0; i < q.size(); ++i) q.data()[i] = static_cast<float>(sigma * q.data()[i]);
  const auto k = random4({1, n, H, d}, 2), v = random4({1, n, H, d}, 3),
             dout = random4({1, nq, H, d}, 4);
  Tensor<float, 3> logit({1, nq, H}), lse({1, 2 * H, nq}), dlogit(logit.shape());
  Tensor<float, 4> out({1, nq, H, d}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  const auto o = options(state, true);
  diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o);
  for (auto _ : state) {
    if constexpr (What == 1)
      diffattn::diff_attention_v2_backward<float>(q, k, v, logit, out, lse, dout, dq, dk, dv,
                                                  dlogit, o);
    else
      diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o);
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(dq.data());
  }
  const double pairs = What == 2 ? static_cast<double>(n) : visible_pairs(n);
  set_counters(state, (What == 1 ? 2.5 : 1.0) * 2 * H * 4.0 * pairs * d,
               4.0 * static_cast<double>(q.size() + k.size() + v.size() + out.size()));
}

void BM_Peaked_V2(benchmark::State& s) { peaked<0>(s); }
void BM_Peaked_V2Backward(benchmark::State& s) { peaked<1>(s); }
void BM_Peaked_V2Decode(benchmark::State& s) { peaked<2>(s); }

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

void BM_Mod_V1(benchmark::State& s) { modifiers<0>(s); }
void BM_Mod_V2(benchmark::State& s) { modifiers<1>(s); }
void BM_Mod_V1Backward(benchmark::State& s) { modifiers_backward(s); }

void BM_Bf16_V1(benchmark::State& s) { fused16<diffattn::bfloat16, 0>(s); }
void BM_Bf16_V2(benchmark::State& s) { fused16<diffattn::bfloat16, 1>(s); }
void BM_Bf16_Plain(benchmark::State& s) { fused16<diffattn::bfloat16, 2>(s); }
void BM_Bf16_V1Backward(benchmark::State& s) { backward16<diffattn::bfloat16, 0>(s); }
void BM_Bf16_PlainBackward(benchmark::State& s) { backward16<diffattn::bfloat16, 2>(s); }
void BM_Fused_V2Backward(benchmark::State& s) { backward16<float, 1>(s); }
void BM_Bf16_V2Backward(benchmark::State& s) { backward16<diffattn::bfloat16, 1>(s); }

void sizes(benchmark::internal::Benchmark* b, std::initializer_list<long> ns) {
  for (long threads : {1, 2})
    for (long n : ns) b->Args({n, threads});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

/// Every combination of `args`, timed in milliseconds of wall time.
void product(benchmark::internal::Benchmark* b, const std::vector<std::vector<int64_t>>& args) {
  b->ArgsProduct(args)->Unit(benchmark::kMillisecond)->UseRealTime();
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
BENCHMARK(BM_Fused_V2Backward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Bf16_V2Backward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Fused_PlainBackward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Bf16_V1Backward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Bf16_PlainBackward)->Apply([](auto* b) { sizes(b, {1024, 4096}); });
BENCHMARK(BM_Reference_V1Backward)->Apply([](auto* b) { sizes(b, {1024}); });
// Modifiers: N = 4096 causal, 2 threads (the document mask at 8192 = 8 x 1024).
BENCHMARK(BM_Mod_V1)->Apply([](auto* b) { product(b, {{4096}, {2}, {0, 1, 2, 3, 4, 9}}); });
BENCHMARK(BM_Mod_V2)->Apply([](auto* b) { product(b, {{4096}, {2}, {0, 1, 2, 3, 4, 9}}); });
BENCHMARK(BM_Mod_V1)->Apply([](auto* b) { product(b, {{8192}, {2}, {6, 5, 7, 8}}); });
BENCHMARK(BM_Mod_V2)->Apply([](auto* b) { product(b, {{8192}, {2}, {6, 5, 7, 8}}); });
BENCHMARK(BM_Mod_V1Backward)->Apply([](auto* b) { product(b, {{4096}, {2}, {0, 2}}); });

// Peaked scores: sigma 1 against 30, N = 2048 (decoding: M = 32k), 2 threads.
BENCHMARK(BM_Peaked_V2)->Apply([](auto* b) { product(b, {{2048}, {2}, {1, 30}}); });
BENCHMARK(BM_Peaked_V2Backward)->Apply([](auto* b) { product(b, {{2048}, {2}, {1, 30}}); });
BENCHMARK(BM_Peaked_V2Decode)->Apply([](auto* b) { product(b, {{32768}, {2}, {1, 30}}); });

BENCHMARK_MAIN();
