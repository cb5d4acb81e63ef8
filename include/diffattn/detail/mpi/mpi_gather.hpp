// DIFF V1 and V2 over MPI with the keys and values gathered: every rank
// gathers the key/value shards of all ranks (one MPI_Allgather) into the
// global sequence, then runs the fused single-process kernel on each run of
// its own queries against the keys that run sees; the backward runs the fused
// backward the same way and sends each rank the dK and dV of its tokens (one
// MPI_Alltoall), added in rank order.
//
// Why not the ring for the differential kinds: the ring keeps one (o, lse)
// state per softmax map and merges them across ranks, so it multiplies each
// map's probabilities by the values apart, where the fused kernel forms
// W = A1 - lambda A2 over whole score rows and does one W V. Per query and
// key that is 2d + 2 x 2d multiply-adds against 2d + 2d for V1 (2d-wide
// values: 1.5x), 2d + 2d against 2d + d for V2 (1.33x). Settling the
// statistics first (a pass over the keys for each row's lse per map, then
// W V once per pair with the final ones) computes the scores twice, the same
// cost. The fused kernel does 1x because it holds a block's whole score rows
// at once; across ranks that means holding all keys. The backward is worse on
// the ring: the pair calls need D_m = dO_m . o_m over all keys, so the ring
// first recomputes map 2's output, and each map's backward re-reads the
// values and dO. With the keys gathered the work is exactly the fused
// kernels' on each rank's rows, and zigzag sharding still balances it under a
// causal mask. The price is memory: every rank holds the whole sequence's K
// and V (and in the backward their gradients) during the call, where the ring
// holds two shards. So the differential kinds gather only while the whole
// sequence's K and V take at most gather_limit() bytes (256 MiB: the forward
// then holds about twice that, the backward five times); beyond, they run the
// ring with per-map states. Plain attention always runs the ring (one map:
// its per-map state is the fused kernel's own).
#pragma once

#include <algorithm>
#include <array>
#include <utility>
#include <cstdint>
#include <vector>

#include "../../attention.hpp"
#include "../../attention_backward.hpp"
#include "../../config.hpp"
#include "../../options.hpp"
#include "../../tensor.hpp"
#include "../backward/attention_backward.hpp"
#include "../core/workspace.hpp"
#include "../core/validate.hpp"
#include "../kernel/attention_kernel.hpp"
#include "mpi_comm.hpp"
#include "mpi_ring.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The largest gathered K and V (bytes per rank) for which V1 and V2 gather
/// instead of running the ring; the same on every rank (tests lower it to
/// run the ring).
inline std::uint64_t& gather_limit() {
  static std::uint64_t limit = std::uint64_t(256) << 20;
  return limit;
}

/// Whether a call over `world` ranks gathers its keys and values (V1 and V2
/// within gather_limit()): a decision from agreed shapes alone, so every rank
/// takes the same.
template <class T>
bool gathers(const RingProblem<T>& rp, int world) {
  const double bytes = static_cast<double>(rp.block_elems()) * world * sizeof(T);
  return rp.kind != AttnKind::plain && bytes <= static_cast<double>(gather_limit());
}

/// Token rows [r0, r0 + len) of a (B, N, H) view (V2's lambda_logit).
template <class U>
TensorView<U, 3> token_rows(const TensorView<U, 3>& t, index_t r0, index_t len) {
  return TensorView<U, 3>(t.data() + r0 * t.stride(1), {t.shape(0), len, t.shape(2)}, t.strides());
}

/// The whole sequence's keys (B, N, Hk, d) and values (B, N, Hkv, dv), in
/// global token order: views of the buffers held.
template <class T>
struct GatheredKV {
  ScratchBuffer<T> kbuf, vbuf;
  TensorView<const T, 4> k, v;
};

/// Elements of one token's keys and of its values in a block.
template <class T>
index_t token_k_elems(const RingProblem<T>& rp) {
  return rp.Hk * rp.d;
}
template <class T>
index_t token_v_elems(const RingProblem<T>& rp) {
  return rp.Hkv * rp.dv;
}

/// Calls f(src, dst, len) for every run of tokens of rank r's block: src the
/// run's keys (then values) at offsets into a block, dst into a (B, N, ...)
/// global tensor; len tokens. The two directions of gather and scatter.
template <class T, class F>
void for_each_block_run(const RingProblem<T>& rp, int r, int world, F&& f) {
  const index_t N = rp.n * world, kr = token_k_elems(rp), vr = token_v_elems(rp);
  for (const ShardRun& s : shard_runs(rp.n, r, world, rp.zigzag))
    for (index_t b = 0; b < rp.B; ++b) {
      f((b * rp.n + s.local) * kr, (b * N + s.global) * kr, s.len * kr, true);
      f(rp.k_elems() + (b * rp.n + s.local) * vr, (b * N + s.global) * vr, s.len * vr, false);
    }
}

/// Every rank's k and v, in global order (one MPI_Allgather of the blocks).
template <class T>
GatheredKV<T> gather_kv(const RingProblem<T>& rp, RingComm& rc) {
  const int W = rc.size();
  const index_t be = rp.block_elems(), N = rp.n * W;
  // Uninitialised: every element is written before it is read (the ranks'
  // runs cover every token once), so no zero fill.
  ScratchBuffer<T> all;
  T* const everyone = all.get(be * W);
  {
    ScratchBuffer<T> mine;
    T* const block = mine.get(be);
    pack_block(rp, block);
    rc.allgather(block, everyone, be);
  }
  const std::array<index_t, 4> ks = {rp.B, N, rp.Hk, rp.d}, vs = {rp.B, N, rp.Hkv, rp.dv};
  ScratchBuffer<T> kbuf, vbuf;
  T* const kp = kbuf.get(rp.B * N * rp.Hk * rp.d);
  T* const vp = vbuf.get(rp.B * N * rp.Hkv * rp.dv);
  for (int r = 0; r < W; ++r) {
    const T* blk = everyone + r * be;
    for_each_block_run(rp, r, W, [&](index_t src, index_t dst, index_t len, bool key) {
      std::copy(blk + src, blk + src + len, (key ? kp : vp) + dst);
    });
  }
  return GatheredKV<T>{std::move(kbuf), std::move(vbuf),
                       TensorView<const T, 4>(kp, ks, row_major_strides(ks)),
                       TensorView<const T, 4>(vp, vs, row_major_strides(vs))};
}

/// The fused kernel's options for a run of queries against the whole
/// sequence: the band as pair_window gives it; ALiBi goes through RingMod
/// (global positions), the rest (softcap, sinks) to the kernel as given.
inline AttentionOptions gathered_options(const AttentionOptions& o, const PairWindow& w) {
  AttentionOptions r = o;
  r.causal = false;
  r.window_left = w.left;
  r.window_right = w.right;
  r.alibi_slopes = {};
  return r;
}

/// lse rows [r0, r0 + len), or the empty view when there is no lse.
template <class U>
TensorView<U, 3> lse_rows(const TensorView<U, 3>& t, index_t r0, index_t len) {
  if (t.data() == nullptr && t.size() == 0) return t;
  return rows_of(t, r0, len);
}

/// Calls f(qr, w, opt, pm) for each run qr of the rank's queries: w its
/// window against the whole sequence (every row sees at least itself, so
/// no row drops), opt its options, pm its functor.
template <class T, class Mod, class F>
void for_each_gathered_run(const RingProblem<T>& rp, const RingComm& rc,
                           const AttentionOptions& options, const Mod& mod, F&& f) {
  const ShardRun all{0, 0, rp.n * rc.size()};
  for (const ShardRun& qr : shard_runs(rp.n, rc.rank(), rc.size(), rp.zigzag)) {
    if (qr.len == 0) continue;
    const PairWindow w = pair_window(qr, all, rp.left, rp.right);
    DIFFATTN_ASSERT(!w.empty() && w.q0 == qr.local && w.n == qr.len);
    const AttentionOptions opt = gathered_options(options, w);
    with_pair_mod(rp, mod, -1, qr, all, [&](const auto& pm) { f(qr, w, opt, pm); });
  }
}

/// Forward of V1 or V2 (W > 1 ranks): out and lse of the rank's rows.
template <class T, class Mod>
void gathered_forward(RingComm& rc, const RingProblem<T>& rp, const AttentionProblem<T>& p,
                      const AttentionOptions& options, const Mod& mod) {
  const GatheredKV<T> g = gather_kv(rp, rc);
  const T lambda = p.lambda_scalar;
  const bool per_head = !p.lambda_heads.empty();
  for_each_gathered_run(
      rp, rc, options, mod,
      [&](const ShardRun&, const PairWindow& w, const AttentionOptions& opt, const auto& pm) {
        const auto q = rows_of(p.q, w.q0, w.n);
        const auto k = rows_of(g.k, w.k0, w.m), v = rows_of(g.v, w.k0, w.m);
        const auto out = rows_of(p.out, w.q0, w.n);
        const auto lse = lse_rows(p.lse, w.q0, w.n);
        const AttentionProblem<T> sub =
            rp.kind == AttnKind::v1
                ? validate_v1<T>(q, k, v, per_head ? nullptr : &lambda,
                                 per_head ? &p.lambda_heads : nullptr, out, lse, opt, rc.fn())
                : validate_v2<T>(q, k, v, token_rows(p.lambda_logit, w.q0, w.n), out, lse, opt,
                                 rc.fn());
        run_attention(sub, opt, pm);
      });
}

/// Backward of V1 or V2 (W > 1 ranks): dq (and V2's dlambda_logit) of the
/// rank's rows, dk and dv of its tokens (the sum over every rank's rows,
/// added in rank order), dsinks (the sum over every rank, the same bits on
/// each). Returns V1's local sums of dlambda (one per DIFF head with per-head
/// lambda, else one; empty for V2) for the caller's allreduce.
template <class T, class Mod>
std::vector<double> gathered_backward(RingComm& rc, const RingProblem<T>& rp,
                                      const BackwardProblem<T>& bp,
                                      const AttentionOptions& options, const Mod& mod) {
  const AttentionProblem<T>& p = bp.fwd;
  const int W = rc.size();
  const index_t N = rp.n * W;
  const GatheredKV<T> g = gather_kv(rp, rc);
  Tensor<T, 4> dk_all({rp.B, N, rp.Hk, rp.d}), dv_all({rp.B, N, rp.Hkv, rp.dv});
  dk_all.fill(T(0));
  dv_all.fill(T(0));
  const T lambda = p.lambda_scalar;
  const bool per_head = !p.lambda_heads.empty();
  const bool v1 = rp.kind == AttnKind::v1;
  const index_t nl = !v1 ? 0 : per_head ? rp.H : 1, Hq = p.q.shape(2);
  std::vector<double> dlambda(static_cast<std::size_t>(nl), 0.0);
  std::vector<double> dsinks(static_cast<std::size_t>(bp.dsinks.empty() ? 0 : Hq), 0.0);
  Tensor<T, 1> dl({nl}), ds({bp.dsinks.empty() ? 0 : Hq});
  for_each_gathered_run(
      rp, rc, options, mod,
      [&](const ShardRun&, const PairWindow& w, const AttentionOptions& opt, const auto& pm) {
        Tensor<T, 4> dk_t({rp.B, w.m, rp.Hk, rp.d}), dv_t({rp.B, w.m, rp.Hkv, rp.dv});
        const auto q = rows_of(p.q, w.q0, w.n);
        const auto k = rows_of(g.k, w.k0, w.m), v = rows_of(g.v, w.k0, w.m);
        const auto out = rows_of(p.out, w.q0, w.n), dout = rows_of(bp.dout, w.q0, w.n);
        const auto lse = rows_of(p.lse, w.q0, w.n);
        const auto dq = rows_of(bp.dq, w.q0, w.n);
        BackwardProblem<T> sub =
            v1 ? backward_v1<T>(q, k, v, per_head ? nullptr : &lambda,
                                per_head ? &p.lambda_heads : nullptr, out, lse, dout, dq,
                                dk_t.view(), dv_t.view(), dl.view(), opt, rc.fn())
               : backward_v2<T>(q, k, v, token_rows(p.lambda_logit, w.q0, w.n), out, lse, dout, dq,
                                dk_t.view(), dv_t.view(),
                                token_rows(bp.dlambda_logit, w.q0, w.n), opt, rc.fn());
        attach_dsinks(rc.fn(), sub, ds.view());
        run_attention_backward(sub, opt, pm);
        const index_t kr = token_k_elems(rp), vr = token_v_elems(rp);
        for (index_t b = 0; b < rp.B; ++b) {
          const T* sk = dk_t.data() + b * w.m * kr;
          T* dk = dk_all.data() + (b * N + w.k0) * kr;
          for (index_t e = 0; e < w.m * kr; ++e) dk[e] += sk[e];
          const T* sv = dv_t.data() + b * w.m * vr;
          T* dv = dv_all.data() + (b * N + w.k0) * vr;
          for (index_t e = 0; e < w.m * vr; ++e) dv[e] += sv[e];
        }
        for (index_t h = 0; h < nl; ++h) dlambda[static_cast<std::size_t>(h)] += dl(h);
        for (index_t h = 0; h < ds.size(); ++h) dsinks[static_cast<std::size_t>(h)] += ds(h);
      });
  // Rank r's tokens of every rank's dk and dv (block layout), then their sum
  // in rank order: the rank's gradients.
  const index_t be = rp.block_elems();
  ScratchBuffer<T> send_buf, recv_buf;  // written in full before read
  T* const send = send_buf.get(be * W);
  T* const recv = recv_buf.get(be * W);
  for (int r = 0; r < W; ++r) {
    T* blk = send + r * be;
    for_each_block_run(rp, r, W, [&](index_t dst, index_t src, index_t len, bool key) {
      const T* from = (key ? dk_all.data() : dv_all.data()) + src;
      std::copy(from, from + len, blk + dst);
    });
  }
  rc.alltoall(send, recv, be);
  Tensor<T, 1> grad({be});
  std::copy(recv, recv + be, grad.data());
  for (int r = 1; r < W; ++r) {
    const T* in = recv + r * be;
    for (index_t e = 0; e < be; ++e) grad.data()[e] += in[e];
  }
  write_kv_grads(rp, grad, bp);
  if (!bp.dsinks.empty()) {
    const std::vector<double> sum = rc.allgather_sum(dsinks);
    for (index_t h = 0; h < Hq; ++h)
      bp.dsinks(h) = static_cast<T>(sum[static_cast<std::size_t>(h)]);
  }
  return dlambda;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
