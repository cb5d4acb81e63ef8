// Backward pass of the fused kernels, from the forward's saved log-sum-exp.
//
// With A_m = exp(S_m - lse_m) recomputed tile by tile, W = A1 - lambda A2 and
// dW = dO V^T (per row i, lambda_i):
//   dV     = W^T dO
//   dS1    = A1 o (dW - D1),           D1_i = sum_j A1_ij dW_ij
//   dS2    = -lambda_i A2 o (dW - E),  E_i  = sum_j A2_ij dW_ij
//   dlambda_i = -E_i
//   dQ_m   = s dS_m K_m,  dK_m = s dS_m^T Q_m
// Plain attention is the one-map case (dS = A o (dW - D)).
//
// Score modifiers (score_mods.hpp) change only the per-row step: the scores
// are modified as in the forward before A_m = exp(S'_m - lse_m) (lse holds the
// sink), dS_m is taken with respect to the modified scores and multiplied by
// the softcap's derivative 1 - tanh^2 (ALiBi's bias is a constant); a sink of
// weight P_m = exp(sink - lse_m) has dsink_m = -P_m D_m with D_m the row's
// sum_j A_m dL/dA_m: -P1 D1 for map 1, lambda P2 E for map 2.
//
// One task owns one (sequence, kv group): every output head of the group and all
// its query blocks run in the task, so dK and dV accumulate without sharing,
// and in a fixed order (results do not depend on the thread count). Per query
// block the kernel keeps score rows as the forward does: memory O(kBlockM x M)
// per thread, plus the group's packed K, V and dK, dV accumulators (O(M d)).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../lambda.hpp"
#include "../core/parallel.hpp"
#include "../core/validate.hpp"
#include "../core/workspace.hpp"
#include "../kernel/attention_kernel.hpp"
#include "../kernel/bf16_dot.hpp"
#include "../kernel/bf16_wv.hpp"
#include "../kernel/convert.hpp"
#include "../kernel/dispatch.hpp"
#include "../kernel/gemm.hpp"
#include "../kernel/mask.hpp"
#include "../kernel/score_mods.hpp"
#include "../kernel/tile.hpp"
#include "bf16_backward.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

// Storage T: float, double, bfloat16 or half. Everything is computed in
// C = compute_t<T> (float for 16-bit storage): q, k, v and dout are widened
// where they are packed, dq, dk, dv (stored as T) and dlambda_logit rounded
// once when written. dlambda, delta and dsinks are C, like lambda and lse.
template <class T>
struct BackwardProblem {
  using C = compute_t<T>;
  AttentionProblem<T> fwd;         // the forward's arguments, out and lse (both read only)
  TensorView<const T, 4> dout;     // like out
  TensorView<T, 4> dq, dk, dv;     // like q, k, v
  TensorView<C, 1> dlambda;        // v1: (1) for one lambda, (H) for one per head
  TensorView<T, 3> dlambda_logit;  // v2: (B, N, H)
  // Plain attention over a subset of the keys (ring attention, split KV):
  // (B, Hq, N) D_i = dO_i . O_i with O the output over ALL keys, which the
  // row's dS = A o (dW - D) needs; lse is then the lse over all keys too.
  // Empty: D is computed from the keys at hand (they are all the keys).
  TensorView<const C, 3> delta;
  // Gradients of the sinks (options.sinks), (Hq), summed over batch and rows;
  // empty: not wanted.
  TensorView<C, 1> dsinks;
};

template <class T>
struct BackwardWorkspace {
  ScratchBuffer<T> kt[2], kc[2], vt;  // packed keys (score and dQ layouts), values
  ScratchBuffer<T> dkt[2], dvt;       // accumulators, transposed  (d, M), (dv, M)
  ScratchBuffer<T> qs[2], qst[2];     // scaled queries and their transpose
  ScratchBuffer<T> dout, doutt;       // dO block and its transpose
  ScratchBuffer<T> s[3];              // dS1, dS2 (or dS), W rows
  ScratchBuffer<T> dq;                // dQ block
  ScratchBuffer<T> th[2];             // softcap: a row's tanh(s / cap) per map
  ScratchBuffer<T> sin[2];            // functor: a row's scores before its score
  // bf16 dot products (bfloat16 storage, bf16_dot.hpp): pairs of bf16 per
  // word, in place of kt and vt (keys and values, score layout) and as the
  // unscaled queries and dO of S = Q K^T and dW = dO V^T; for the gradient
  // products (bf16_backward.hpp) in place of kc (keys, dQ layout), qst and
  // doutt (row pairs), with dS or W rounded row by row (sp) and into panels
  // of row pairs (spt).
  ScratchBuffer<std::uint32_t> kp[2], vp, qp[2], dop;
  ScratchBuffer<std::uint32_t> kcp[2], qtp[2], dotp, sp, spt;

  void trim() {
    ScratchBuffer<T>* all[] = {&kt[0], &kt[1], &kc[0],  &kc[1],  &vt,     &dkt[0], &dkt[1], &dvt,
                               &qs[0], &qs[1], &qst[0], &qst[1], &dout,   &doutt,  &s[0],   &s[1],
                               &s[2],  &dq,    &th[0],  &th[1],  &sin[0], &sin[1]};
    ScratchBuffer<std::uint32_t>* words[] = {&kp[0], &kp[1],  &vp,     &qp[0],  &qp[1],
                                             &dop,   &kcp[0], &kcp[1], &qtp[0], &qtp[1],
                                             &dotp,  &sp,     &spt};
    std::size_t total = 0;
    for (auto* b : all) total += b->bytes();
    for (auto* b : words) total += b->bytes();
    if (total > Workspace<T>::kRetainBytes) {
      for (auto* b : all) b->release();
      for (auto* b : words) b->release();
    }
  }
};

template <class T>
inline BackwardWorkspace<T>& thread_backward_workspace() {
  static thread_local BackwardWorkspace<T> ws;
  return ws;
}

/// dst (cols_pad x rows_pad) = transpose of src (rows x cols), row r of src at
/// src + r * ld; everything outside the source is zero.
template <class T>
void transpose_padded(const T* src, index_t ld, index_t rows, index_t cols, index_t rows_pad,
                      index_t cols_pad, T* dst) {
  std::fill(dst, dst + cols_pad * rows_pad, T(0));
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) dst[c * rows_pad + r] = src[r * ld + c];
}

/// The per-row step of backward_group under score modifiers: row ii of the
/// block (query i, n keys from kb, its score rows at r[m] and dW at rw, as
/// backward_group leaves them) becomes dS_m (with respect to the raw scores)
/// and W; returns dlambda_i and adds the row's dsink_m to dsink[qh].
template <class S, class Mod, class T = compute_t<S>>
T backward_row_modified(const BackwardProblem<S>& bp, const SeqSpan& sq, index_t oh,
                        const HeadMap& hm, index_t i, index_t kb, index_t n, T* const* r, T* rw,
                        BackwardWorkspace<T>& ws, double* dsink, const Mod& mod) {
  // (S: the storage type; T, here, the compute type.)
  constexpr bool kScore = has_score<Mod, T>::value, kVisible = has_visible<Mod>::value;
  static_assert(!kScore || has_dscore<Mod, T>::value,
                "a score functor with `score` needs `dscore` (d score / d s) in a backward call");
  T* sin[2] = {nullptr, nullptr};
  using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  const AttentionProblem<S>& p = bp.fwd;
  const int maps = p.maps();
  const index_t diag = (i - sq.q0) + sq.m - sq.n;
  ModCoords mc;  // the functor's b and i (packed: b the sequence)
  if constexpr (kScore || kVisible) mc = mod_coords(p, sq);
  RowMods<T> rm[2];
  T* th[2] = {nullptr, nullptr};
  T pz[2] = {T(0), T(0)};  // sink weight of each map
  for (int m = 0; m < maps; ++m) {
    rm[m] = row_mods(p, hm.q[m]);
    if (rm[m].cap > T(0)) th[m] = ws.th[m].get(std::max<index_t>(n, 1));
    modify_scores(r[m], n, rm[m], diag, kb, th[m]);
    if constexpr (kScore) sin[m] = ws.sin[m].get(std::max<index_t>(n, 1));
    if constexpr (kScore || kVisible)
      functor_scores(mod, r[m], n, mc.b, hm.q[m], i - sq.q0 + mc.ioff, kb, sin[m]);
    ArrayMap a(r[m], n);
    const T lse = p.lse(sq.b, hm.q[m], i);
    if (lse == -std::numeric_limits<T>::infinity()) {
      a.setZero();
    } else {
      if constexpr (kVisible) {
        a = (a == -std::numeric_limits<T>::infinity()).select(T(0), (a - lse).exp());
      } else {
        a -= lse;
        a = a.exp();
      }
      if (rm[m].has_sink) pz[m] = std::exp(rm[m].sink - lse);
    }
  }
  ArrayMap dw(rw, n), a1(r[0], n);
  T dlambda_i = T(0);
  if (maps == 1) {
    const T dsum = bp.delta.empty() ? T((a1 * dw).sum()) : bp.delta(sq.b, hm.q[0], i);
    for (index_t j = 0; j < n; ++j) {
      const T x = r[0][j];
      r[0][j] = x * (rw[j] - dsum);
      rw[j] = x;
    }
    if (dsink && rm[0].has_sink) dsink[hm.q[0]] -= static_cast<double>(pz[0] * dsum);
  } else {
    ArrayMap a2(r[1], n);
    const T lambda = row_lambda(p, sq.b, i, oh);
    const T d1 = (a1 * dw).sum(), e = (a2 * dw).sum();
    dlambda_i = -e;
    for (index_t j = 0; j < n; ++j) {
      const T x1 = r[0][j], x2 = r[1][j], g_ = rw[j];
      r[0][j] = x1 * (g_ - d1);
      r[1][j] = -lambda * x2 * (g_ - e);
      rw[j] = x1 - lambda * x2;
    }
    if (dsink) {
      if (rm[0].has_sink) dsink[hm.q[0]] -= static_cast<double>(pz[0] * d1);
      if (rm[1].has_sink) dsink[hm.q[1]] += static_cast<double>(lambda * pz[1] * e);
    }
  }
  if constexpr (kScore && has_dscore<Mod, T>::value) {  // (else: the static_assert alone)
    for (int m = 0; m < maps; ++m)
      for (index_t j = 0; j < n; ++j)
        r[m][j] *= mod.dscore(sin[m][j], mc.b, hm.q[m], i - sq.q0 + mc.ioff, kb + j);
  }
  for (int m = 0; m < maps; ++m)
    if (th[m]) {
      ArrayMap t(th[m], n);
      ArrayMap(r[m], n) *= T(1) - t * t;
    }
  return dlambda_i;
}

/// One (sequence, kv group) task. dlambda_head receives, per output head of
/// the group, the sum over its rows of dlambda_i (V1 only); dsink (score
/// modifiers, indexed by query head) the sum over its rows of each sink's
/// gradient (may be null).
template <class T, class Mod = NoScoreMod, class C = compute_t<T>>
void backward_group(const BackwardProblem<T>& bp, index_t seq, index_t g, BackwardWorkspace<C>& ws,
                    double* dlambda_head, double* dsink = nullptr, const Mod& mod = Mod()) {
  constexpr bool functor = is_active_mod<Mod, C>;
  using Cfg = TileConfig<C>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM;
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  const AttentionProblem<T>& p = bp.fwd;
  const SeqSpan sq = p.seq(seq);
  const index_t N = sq.n, M = sq.m, d = p.head_dim, dv = p.value_dim;
  const int maps = p.maps();
  const bool shared_k = p.kind != AttnKind::v1;
  const int kbufs = shared_k ? 1 : 2;
  const HeadMap hg = head_map(p, g * p.group);

  // Keys any query sees lie below kend_all.
  const index_t kend_all = N > 0 ? p.band.end(N - 1, N, M) : 0;
  const index_t mpad = round_up(kend_all, NR);
  const index_t dpad_nr = round_up(d, NR), dpad_mr = round_up(d, MR), dvpad_mr = round_up(dv, MR);

  // bfloat16 storage under AVX512-BF16: S = Q K^T and dW = dO V^T on bf16
  // dot products (bf16_dot.hpp), keys and values packed as pairs along the
  // depth, queries unscaled with the scale applied to each score (as the
  // forward computes them); every input is exact, so each product is a float
  // sum of the same exact products in another order. dQ, dK and dV run on
  // them too, with dS and W rounded to bf16 once per element
  // (bf16_backward.hpp).
  constexpr bool dot = use_bf16_dot<T, T>;
  const index_t dk = bf16_pairs(d), dvk = bf16_pairs(dv), kpairs = bf16_pairs(kend_all);

  // Packed keys and values of the group; zeroed accumulators.
  C* kt[2] = {nullptr, nullptr};
  C* kc[2] = {nullptr, nullptr};
  C* dkt[2] = {nullptr, nullptr};
  std::uint32_t* kp[2] = {nullptr, nullptr};
  std::uint32_t* kcp[2] = {nullptr, nullptr};
  for (int m = 0; m < kbufs; ++m) {
    if constexpr (dot) {
      kp[m] = ws.kp[m].get(std::max<index_t>(mpad * dk, 1));
      kcp[m] = ws.kcp[m].get(std::max<index_t>(kpairs * dpad_nr, 1));
    } else {
      kt[m] = ws.kt[m].get(std::max<index_t>(mpad * d, 1));
      kc[m] = ws.kc[m].get(std::max<index_t>(kend_all * dpad_nr, 1));
    }
    dkt[m] = ws.dkt[m].get(std::max<index_t>(dpad_mr * mpad, 1));
    std::fill(dkt[m], dkt[m] + dpad_mr * mpad, C(0));
    if (kend_all > 0) {
      const T* src = &p.k(sq.b, sq.k0, hg.k[m], 0);
      if constexpr (dot) {
        pack_pairs_transposed_from(StridedRows<T>{src, p.k.stride(1)}, kend_all, d, kp[m]);
        pack_value_pairs_from(StridedRows<T>{src, p.k.stride(1)}, kend_all, d, kcp[m]);
      } else {
        pack_rows_transposed(src, p.k.stride(1), kend_all, d, kt[m]);
        pack_cols(src, p.k.stride(1), kend_all, d, kc[m]);
      }
    }
  }
  C* vt = nullptr;
  std::uint32_t* vp = nullptr;
  if constexpr (dot)
    vp = ws.vp.get(std::max<index_t>(mpad * dvk, 1));
  else
    vt = ws.vt.get(std::max<index_t>(mpad * dv, 1));
  C* dvt = ws.dvt.get(std::max<index_t>(dvpad_mr * mpad, 1));
  std::fill(dvt, dvt + dvpad_mr * mpad, C(0));
  if (kend_all > 0) {
    const T* src = &p.v(sq.b, sq.k0, hg.v, 0);
    if constexpr (dot)
      pack_pairs_transposed_from(StridedRows<T>{src, p.v.stride(1)}, kend_all, dv, vp);
    else
      pack_rows_transposed(src, p.v.stride(1), kend_all, dv, vt);
  }

  const index_t nblocks = (N + BM - 1) / BM;
  for (index_t oh = g * p.group; oh < (g + 1) * p.group; ++oh) {
    const HeadMap hm = head_map(p, oh);
    double dlambda_sum = 0;
    for (index_t blk = 0; blk < nblocks; ++blk) {
      const index_t i0 = blk * BM;
      const auto br =
          visible_rows(mod, p, sq, BlockRows{p.band, N, M, i0, std::min(BM, N - i0)}, hm);
      const index_t rows = br.rows;
      const index_t rows_pad = round_up(rows, MR), tiles = rows_pad / MR;
      auto tile_lo = [&](index_t r) { return br.begin(r * MR); };
      auto tile_hi = [&](index_t r) { return br.end(std::min(r * MR + MR - 1, rows - 1)); };
      // Score rows cover [kbase, kend_block): the block's band, its start
      // rounded down to a whole panel.
      const index_t kend_block = std::max(br.end(rows - 1), br.begin(0));
      const index_t kbase = br.begin(0) / NR * NR;
      const index_t lds = std::max<index_t>(round_up(kend_block - kbase, NR), NR);

      // Scaled queries, their transpose; dO and its transpose. Under bf16 dot
      // products: unscaled query and dO rows as pairs along the depth, and
      // their transposes with pairs of rows (rpairs of them) along each
      // feature.
      const index_t rpairs = bf16_pairs(rows);
      C* qs[2] = {nullptr, nullptr};
      C* qst[2] = {nullptr, nullptr};
      std::uint32_t* qp[2] = {nullptr, nullptr};
      std::uint32_t* qtp[2] = {nullptr, nullptr};
      for (int m = 0; m < maps; ++m) {
        if constexpr (dot) {
          const auto qrow = [&](index_t ii) { return &p.q(sq.b, sq.q0 + i0 + ii, hm.q[m], 0); };
          qp[m] = ws.qp[m].get(rows_pad * dk);
          for (index_t ii = 0; ii < rows; ++ii) pack_query_pairs(qrow(ii), d, qp[m] + ii * dk);
          std::fill(qp[m] + rows * dk, qp[m] + rows_pad * dk, 0u);
          qtp[m] = ws.qtp[m].get(dpad_mr * rpairs);
          pack_row_pairs_transposed(qrow, rows, d, dpad_mr, rpairs, qtp[m]);
        } else {
          qs[m] = ws.qs[m].get(rows_pad * d);
          for (index_t ii = 0; ii < rows; ++ii) {
            C* dst = qs[m] + ii * d;
            const C* row = row_as<C>(&p.q(sq.b, sq.q0 + i0 + ii, hm.q[m], 0), d, dst);
            for (index_t t = 0; t < d; ++t) dst[t] = p.scale * row[t];
          }
          std::fill(qs[m] + rows * d, qs[m] + rows_pad * d, C(0));
          qst[m] = ws.qst[m].get(dpad_mr * rows_pad);
          transpose_padded(qs[m], d, rows, d, rows_pad, dpad_mr, qst[m]);
        }
      }
      C* dob = nullptr;
      C* dobt = nullptr;
      std::uint32_t* dop = nullptr;
      std::uint32_t* dotp = nullptr;
      if constexpr (dot) {
        const auto drow = [&](index_t ii) { return &bp.dout(sq.b, sq.q0 + i0 + ii, oh, 0); };
        dop = ws.dop.get(rows_pad * dvk);
        for (index_t ii = 0; ii < rows; ++ii) pack_query_pairs(drow(ii), dv, dop + ii * dvk);
        std::fill(dop + rows * dvk, dop + rows_pad * dvk, 0u);
        dotp = ws.dotp.get(dvpad_mr * rpairs);
        pack_row_pairs_transposed(drow, rows, dv, dvpad_mr, rpairs, dotp);
      } else {
        dob = ws.dout.get(rows_pad * dv);
        for (index_t ii = 0; ii < rows; ++ii)
          convert_row(&bp.dout(sq.b, sq.q0 + i0 + ii, oh, 0), dv, dob + ii * dv);
        std::fill(dob + rows * dv, dob + rows_pad * dv, C(0));
        dobt = ws.doutt.get(dvpad_mr * rows_pad);
        transpose_padded(dob, dv, rows, dv, rows_pad, dvpad_mr, dobt);
      }

      // Scores of each map and dW = dO V^C, tile by tile inside the band.
      C* s[3] = {ws.s[0].get(rows_pad * lds), maps == 2 ? ws.s[1].get(rows_pad * lds) : nullptr,
                 ws.s[2].get(rows_pad * lds)};
      for (index_t j0 = kbase; j0 < kend_block; j0 += NR) {
        for (index_t r = 0; r < tiles; ++r) {
          if (j0 >= tile_hi(r) || j0 + NR <= tile_lo(r)) continue;
          const index_t col = r * MR * lds + (j0 - kbase);
          if constexpr (dot) {
            for (int m = 0; m < maps; ++m)
              micro_kernel_bf16(dk, qp[m] + r * MR * dk, dk, kp[shared_k ? 0 : m] + j0 * dk,
                                s[m] + col, lds, p.scale);
            micro_kernel_bf16(dvk, dop + r * MR * dvk, dvk, vp + j0 * dvk, s[2] + col, lds, 1.0f);
          } else {
            for (int m = 0; m < maps; ++m)
              micro_kernel<C>(d, qs[m] + r * MR * d, d, kt[shared_k ? 0 : m] + j0 * d, NR,
                              s[m] + col, lds, false);
            micro_kernel<C>(dv, dob + r * MR * dv, dv, vt + j0 * dv, NR, s[2] + col, lds, false);
          }
        }
      }

      // Per row: maps from the saved lse, then dS_m and W in place; zero
      // outside the row's keys (the dK and dV products read whole panels).
      for (index_t ii = 0; ii < rows; ++ii) {
        const index_t i = sq.q0 + i0 + ii, n = br.count(ii);
        const index_t off = n > 0 ? br.begin(ii) - kbase : 0;
        C* r0 = s[0] + ii * lds + off;
        C* rw = s[2] + ii * lds + off;
        if (functor || p.modified) {
          C* rows_m[2] = {r0, maps == 2 ? s[1] + ii * lds + off : nullptr};
          const C dlambda_i =
              backward_row_modified(bp, sq, oh, hm, i, br.begin(ii), n, rows_m, rw, ws, dsink, mod);
          if (maps == 2) {
            if (p.kind == AttnKind::v2) {
              const C sg = row_lambda(p, sq.b, i, oh);
              bp.dlambda_logit(sq.b, i, oh) = static_cast<T>(dlambda_i * sg * (C(1) - sg));
            } else {
              dlambda_sum += static_cast<double>(dlambda_i);
            }
          }
          for (int m = 0; m < 3; ++m) {
            if (!s[m]) continue;
            C* row = s[m] + ii * lds;
            std::fill(row, row + off, C(0));
            std::fill(row + off + n, row + lds, C(0));
          }
          continue;
        }
        // A = exp(S - lse) in place; a row with no visible key has lse = -inf
        // and A = 0.
        const auto probabilities = [&](ArrayMap& a, int m) {
          const C lse = p.lse(sq.b, hm.q[m], i);
          if (lse == -std::numeric_limits<C>::infinity()) {
            a.setZero();
          } else if constexpr (kHasFastExp<C>) {  // the forward's exp (softmax.hpp)
            exp_shift_sum<C, dot>(a.data(), a.size(), lse);
          } else {
            a -= lse;
            a = a.exp();
          }
        };
        ArrayMap a1(r0, n), dw(rw, n);
        probabilities(a1, 0);
        if (maps == 1) {
          const C dsum = bp.delta.empty() ? C((a1 * dw).sum()) : bp.delta(sq.b, hm.q[0], i);
          for (index_t j = 0; j < n; ++j) {
            const C x = r0[j];
            r0[j] = x * (rw[j] - dsum);  // dS
            rw[j] = x;                   // W = A
          }
        }
        if (maps == 2) {
          C* r1 = s[1] + ii * lds + off;
          ArrayMap a2(r1, n);
          probabilities(a2, 1);
          const C lambda = row_lambda(p, sq.b, i, oh);
          const C d1 = (a1 * dw).sum();
          const C e = (a2 * dw).sum();
          const C dlambda_i = -e;
          if (p.kind == AttnKind::v2) {
            const C sg = lambda;  // sigmoid(logit)
            bp.dlambda_logit(sq.b, i, oh) = static_cast<T>(dlambda_i * sg * (C(1) - sg));
          } else {
            dlambda_sum += static_cast<double>(dlambda_i);
          }
          // Order matters: read a1, a2, dw before overwriting them.
          for (index_t j = 0; j < n; ++j) {
            const C x1 = r0[j], x2 = r1[j], g_ = rw[j];
            r0[j] = x1 * (g_ - d1);
            r1[j] = -lambda * x2 * (g_ - e);
            rw[j] = x1 - lambda * x2;
          }
        }
        for (int m = 0; m < 3; ++m) {
          if (!s[m]) continue;
          C* row = s[m] + ii * lds;
          std::fill(row, row + off, C(0));
          std::fill(row + off + n, row + lds, C(0));
        }
      }
      for (int m = 0; m < 3; ++m)
        if (s[m]) std::fill(s[m] + rows * lds, s[m] + rows_pad * lds, C(0));

      // dQ_m = s dS_m K_m over each tile's keys (bf16: dS_m rounded row by
      // row, from an even key; keys past a row's band are zero in dS).
      C* dqb = ws.dq.get(rows_pad * dpad_nr);
      const index_t ldsp = lds / 2;  // words per row of dS rounded to bf16
      std::uint32_t* sp = nullptr;
      if constexpr (dot) sp = ws.sp.get(rows_pad * ldsp);
      for (int m = 0; m < maps; ++m) {
        std::fill(dqb, dqb + rows_pad * dpad_nr, C(0));
        const C* kcm = kc[shared_k ? 0 : m];
        if constexpr (dot)
          for (index_t ii = 0; ii < rows_pad; ++ii)
            round_weight_pairs(s[m] + ii * lds, 0, ldsp, sp + ii * ldsp);
        for (index_t r = 0; r < tiles; ++r) {
          const index_t lo = std::max(tile_lo(r), kbase), hi = tile_hi(r);
          if (hi <= lo) continue;
          if constexpr (dot) {
            const index_t lo2 = lo / 2;  // the pair of keys lo is in (kbase is even)
            const index_t pairs = bf16_pairs(hi) - lo2;
            for (index_t c0 = 0; c0 < dpad_nr; c0 += NR)
              micro_kernel_bf16(pairs, sp + r * MR * ldsp + (lo2 - kbase / 2), ldsp,
                                kcp[shared_k ? 0 : m] + c0 * kpairs + lo2 * NR,
                                dqb + r * MR * dpad_nr + c0, dpad_nr, 1.0f);
          } else {
            for (index_t c0 = 0; c0 < dpad_nr; c0 += NR)
              micro_kernel<C>(hi - lo, s[m] + r * MR * lds + (lo - kbase), lds,
                              kcm + c0 * kend_all + lo * NR, NR, dqb + r * MR * dpad_nr + c0,
                              dpad_nr, false);
          }
        }
        for (index_t ii = 0; ii < rows; ++ii) {
          T* dst = &bp.dq(sq.b, sq.q0 + i0 + ii, hm.q[m], 0);
          for (index_t t = 0; t < d; ++t) dst[t] = static_cast<T>(p.scale * dqb[ii * dpad_nr + t]);
        }
      }

      // dK_m^C += (s Q_m)^C dS_m and dV^C += dO^C W, key panel by key panel.
      // bf16: dK_m^C += Q_m^C dS_m (the scale comes when dK is written), dS_m
      // and W rounded into panels of row pairs, one at a time.
      if constexpr (dot) {
        const index_t cols = round_up(kend_block - kbase, NR);
        std::uint32_t* spt = ws.spt.get(std::max<index_t>(cols * rpairs, 1));
        for (int m = 0; m < maps + 1; ++m) {
          const bool wv = m == maps;  // W for dV after the maps' dS for dK
          round_row_pair_panels(s[wv ? 2 : m], lds, rpairs, cols, spt);
          C* acc = wv ? dvt : dkt[shared_k ? 0 : m];
          const std::uint32_t* at = wv ? dotp : qtp[m];
          for (index_t j0 = kbase; j0 < kend_block; j0 += NR)
            for (index_t t0 = 0; t0 < (wv ? dvpad_mr : dpad_mr); t0 += MR)
              micro_kernel_bf16_add(rpairs, at + t0 * rpairs, rpairs, spt + (j0 - kbase) * rpairs,
                                    acc + t0 * mpad + j0, mpad);
        }
      }
      for (index_t j0 = kbase; j0 < kend_block && !dot; j0 += NR) {
        const index_t col = j0 - kbase;
        for (int m = 0; m < maps; ++m) {
          C* acc = dkt[shared_k ? 0 : m];
          for (index_t t0 = 0; t0 < dpad_mr; t0 += MR)
            micro_kernel<C>(rows, qst[m] + t0 * rows_pad, rows_pad, s[m] + col, lds,
                            acc + t0 * mpad + j0, mpad, true);
        }
        for (index_t t0 = 0; t0 < dvpad_mr; t0 += MR)
          micro_kernel<C>(rows, dobt + t0 * rows_pad, rows_pad, s[2] + col, lds,
                          dvt + t0 * mpad + j0, mpad, true);
      }
    }
    if (dlambda_head) dlambda_head[oh - g * p.group] = dlambda_sum;
  }

  // Accumulators to the caller's layout; keys no query sees get zero.
  for (int m = 0; m < kbufs; ++m) {
    for (index_t j = 0; j < M; ++j) {
      T* dst = &bp.dk(sq.b, sq.k0 + j, hg.k[m], 0);
      for (index_t t = 0; t < d; ++t)
        dst[t] =
            static_cast<T>(j < kend_all ? (dot ? p.scale : C(1)) * dkt[m][t * mpad + j] : C(0));
    }
  }
  for (index_t j = 0; j < M; ++j) {
    T* dst = &bp.dv(sq.b, sq.k0 + j, hg.v, 0);
    for (index_t t = 0; t < dv; ++t)
      dst[t] = static_cast<T>(j < kend_all ? dvt[t * mpad + j] : C(0));
  }
}

template <class T, class Mod = NoScoreMod>
void run_attention_backward_kernel(const BackwardProblem<T>& bp, const AttentionOptions& options,
                                   const Mod& mod = Mod()) {
  using C = compute_t<T>;
  const AttentionProblem<T>& p = bp.fwd;
  const index_t groups = p.heads / p.group;
  const index_t seqs = p.num_seqs();
  const index_t tasks = seqs * groups;
  // Per (sequence, head) sums of dlambda_i, reduced in a fixed order below.
  std::vector<double> dlambda_parts(static_cast<std::size_t>(seqs * p.heads), 0.0);
  // Per (sequence, query head) sums of the sinks' gradients.
  const index_t qheads = p.q.shape(2);
  const bool want_dsinks = !bp.dsinks.empty();
  std::vector<double> dsink_parts(want_dsinks ? static_cast<std::size_t>(seqs * qheads) : 0, 0.0);
  auto zero_all = [&] {
    // Nothing to propagate (no queries): every gradient is zero.
    auto zero4 = [](const TensorView<T, 4>& t) {
      for (index_t a = 0; a < t.shape(0); ++a)
        for (index_t b = 0; b < t.shape(1); ++b)
          for (index_t c = 0; c < t.shape(2); ++c)
            for (index_t x = 0; x < t.shape(3); ++x) t(a, b, c, x) = T(0);
    };
    zero4(bp.dq);
    zero4(bp.dk);
    zero4(bp.dv);
  };
  if (p.seqlen_q == 0 || tasks == 0) {
    zero_all();
  } else {
    auto run_task = [&](index_t t) {
      const index_t sq = t / groups, g = t % groups;
      double* parts =
          p.kind == AttnKind::v1 ? dlambda_parts.data() + sq * p.heads + g * p.group : nullptr;
      backward_group(bp, sq, g, thread_backward_workspace<C>(), parts,
                     want_dsinks ? dsink_parts.data() + sq * qheads : nullptr, mod);
    };
    parallel_tasks(tasks, resolve_threads(options.num_threads, tasks, attention_work(p)), run_task,
                   [] { thread_backward_workspace<C>().trim(); });
  }
  if (want_dsinks) {
    for (index_t h = 0; h < qheads; ++h) {
      double total = 0;
      for (index_t sq = 0; sq < seqs; ++sq)
        total += dsink_parts[static_cast<std::size_t>(sq * qheads + h)];
      bp.dsinks(h) = static_cast<C>(total);
    }
  }
  if (p.kind == AttnKind::v1) {
    if (bp.dlambda.shape(0) == 1) {
      double total = 0;
      for (double x : dlambda_parts) total += x;
      bp.dlambda(0) = static_cast<C>(total);
    } else {
      for (index_t h = 0; h < p.heads; ++h) {
        double total = 0;
        for (index_t sq = 0; sq < seqs; ++sq)
          total += dlambda_parts[static_cast<std::size_t>(sq * p.heads + h)];
        bp.dlambda(h) = static_cast<C>(total);
      }
    }
  }
}

/// Runs a validated backward problem: here, or (DIFFATTN_DISPATCH) in
/// diffattn::dispatch's variant for this CPU (dispatch.hpp).
template <class T>
void run_attention_backward(const BackwardProblem<T>& bp, const AttentionOptions& options) {
#ifdef DIFFATTN_DISPATCH
  dispatch_attention_backward(bp, options);
#else
  run_attention_backward_kernel(bp, options);
#endif
}

/// With a user functor: always here, header-only (see run_attention).
template <class T, class Mod>
void run_attention_backward(const BackwardProblem<T>& bp, const AttentionOptions& options,
                            const Mod& mod) {
  if constexpr (is_active_mod<Mod, T>)
    run_attention_backward_kernel(bp, options, mod);
  else
    run_attention_backward(bp, options);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Read-only out and lse travel in the forward problem's mutable slots; the
/// backward pass never writes them.
template <class T, std::size_t R>
TensorView<T, R> unconst(const TensorView<const T, R>& t) {
  return TensorView<T, R>(const_cast<T*>(t.data()), t.shape(), t.strides());
}

/// Checks of the gradient arguments, after the forward's own checks.
template <class T>
void validate_backward(const char* fn, BackwardProblem<T>& bp) {
  const AttentionProblem<T>& p = bp.fwd;
  if (!p.has_lse() && p.seqlen_q > 0)  // (an lse of no rows may be an empty view)
    fail(fn, "lse is required: pass the (B, Hq, N) log-sum-exp the forward pass wrote");
  check_head_contiguous(fn, "dout", bp.dout);
  check_head_contiguous(fn, "dq", bp.dq);
  check_head_contiguous(fn, "dk", bp.dk);
  check_head_contiguous(fn, "dv", bp.dv);
  check_shape(fn, "dout", bp.dout, p.out.shape(), "the shape of out");
  check_shape(fn, "dq", bp.dq, p.q.shape(), "the shape of q");
  check_shape(fn, "dk", bp.dk, p.k.shape(), "the shape of k");
  check_shape(fn, "dv", bp.dv, p.v.shape(), "the shape of v");
  struct Named {
    const char* name;
    std::uintptr_t begin;
    std::uintptr_t end;
  };
  auto named = [](const char* name, const auto& t) {
    return Named{name, t.empty() ? 0 : t.span_begin(), t.empty() ? 0 : t.span_end()};
  };
  const Named inputs[] = {named("q", p.q),
                          named("k", p.k),
                          named("v", p.v),
                          named("out", p.out),
                          named("lse", p.lse),
                          named("dout", bp.dout),
                          named("lambda", p.lambda_heads),
                          named("lambda_logit", p.lambda_logit)};
  const Named outputs[] = {named("dq", bp.dq),
                           named("dk", bp.dk),
                           named("dv", bp.dv),
                           named("dlambda", bp.dlambda),
                           named("dlambda_logit", bp.dlambda_logit),
                           named("dsinks", bp.dsinks)};
  auto overlap = [](const Named& a, const Named& b) {
    return a.begin && b.begin && a.begin < b.end && b.begin < a.end;
  };
  for (const Named& o : outputs) {
    for (const Named& i : inputs)
      if (overlap(o, i)) fail(fn, "gradient ", o.name, " overlaps input ", i.name, " in memory");
    for (const Named& o2 : outputs)
      if (&o2 < &o && overlap(o, o2))
        fail(fn, "gradients ", o2.name, " and ", o.name, " overlap in memory");
  }
}

/// Attaches the optional gradient of the sinks, (Hq): only with options.sinks.
template <class T>
void attach_dsinks(const char* fn, BackwardProblem<T>& bp,
                   const TensorView<compute_t<T>, 1>& dsinks) {
  if (dsinks.empty()) return;  // (a (0) view as well: not wanted)
  if (bp.fwd.sinks.empty())
    fail(fn, "dsinks ", shape_str(dsinks.shape()),
         " is the gradient of options.sinks, which is empty: pass an empty dsinks");
  check_shape(fn, "dsinks", dsinks, {bp.fwd.q.shape(2)}, "(Hq)");
  bp.dsinks = dsinks;
  validate_backward(fn, bp);  // overlaps, dsinks included
}

/// Wraps the forward's checks so that their message names the backward entry point.
template <class F>
auto forward_checks(const char* fn, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const error& e) {
    throw error(std::string(fn) + " (forward arguments): " + e.what());
  }
}

template <class T>
BackwardProblem<T> backward_v1(TensorView<const T, 4> q, TensorView<const T, 4> k,
                               TensorView<const T, 4> v, const compute_t<T>* lambda,
                               const TensorView<const compute_t<T>, 1>* lambda_heads,
                               TensorView<const T, 4> out, TensorView<const compute_t<T>, 3> lse,
                               TensorView<const T, 4> dout, TensorView<T, 4> dq,
                               TensorView<T, 4> dk, TensorView<T, 4> dv,
                               TensorView<compute_t<T>, 1> dlambda, const AttentionOptions& options,
                               const char* fn = "diff_attention_v1_backward") {
  BackwardProblem<T> bp;
  bp.fwd = forward_checks(fn, [&] {
    return validate_v1<T>(q, k, v, lambda, lambda_heads, unconst(out), unconst(lse), options);
  });
  bp.dout = dout;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.dlambda = dlambda;
  if (lambda_heads) check_shape(fn, "dlambda", dlambda, {bp.fwd.heads}, "(H)");
  validate_backward(fn, bp);
  return bp;
}

template <class T>
BackwardProblem<T> backward_v2(TensorView<const T, 4> q, TensorView<const T, 4> k,
                               TensorView<const T, 4> v, TensorView<const T, 3> lambda_logit,
                               TensorView<const T, 4> out, TensorView<const compute_t<T>, 3> lse,
                               TensorView<const T, 4> dout, TensorView<T, 4> dq,
                               TensorView<T, 4> dk, TensorView<T, 4> dv,
                               TensorView<T, 3> dlambda_logit, const AttentionOptions& options,
                               const char* fn = "diff_attention_v2_backward") {
  BackwardProblem<T> bp;
  bp.fwd = forward_checks(fn, [&] {
    return validate_v2<T>(q, k, v, lambda_logit, unconst(out), unconst(lse), options);
  });
  bp.dout = dout;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.dlambda_logit = dlambda_logit;
  check_shape(fn, "dlambda_logit", dlambda_logit, lambda_logit.shape(), "(B, N, H)");
  validate_backward(fn, bp);
  return bp;
}

template <class T>
BackwardProblem<T> backward_plain(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<const T, 4> out,
                                  TensorView<const compute_t<T>, 3> lse,
                                  TensorView<const T, 4> dout, TensorView<T, 4> dq,
                                  TensorView<T, 4> dk, TensorView<T, 4> dv,
                                  const AttentionOptions& options,
                                  const char* fn = "attention_backward") {
  BackwardProblem<T> bp;
  bp.fwd = forward_checks(
      fn, [&] { return validate_plain<T>(q, k, v, unconst(out), unconst(lse), options); });
  bp.dout = dout;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  validate_backward(fn, bp);
  return bp;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
