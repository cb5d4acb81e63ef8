// The fused kernel shared by plain, V1 and V2 attention.
//
// Algorithm (one task = one batch entry, one output head, one block of
// kBlockM queries):
//   1. pack the block's queries of each map, scaled by s;
//   2. pack the keys the block sees into kNR-wide panels (kept across the
//      consecutive blocks of one kv head that a thread processes);
//   3. S_m = (s Q_m) K_m^T for every visible key, register tile by tile,
//      skipping tiles the causal mask hides entirely;
//   4. per row, an exact softmax of each map and W = A1 - lambda A2, written
//      over S_1 (the row's log-sum-exp per map goes to lse);
//   5. O = W V in key chunks of kBlockN, each value chunk packed once and read
//      once for both maps.
// This does exactly the useful work (both maps' scores and one product of W
// with V) at O(kBlockM x M) memory per thread. A single-pass streaming
// ("flash") softmax would need one accumulator per map, so two products with V:
// 1.5x the work of V1. Keeping a block's score rows instead costs memory linear
// in M, 7.5 MiB per thread at M = 16384 (kBlockM = 60, two float maps).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include <Eigen/Core>

#include "../config.hpp"
#include "../lambda.hpp"
#include "../options.hpp"
#include "gemm.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "softmax.hpp"
#include "tile.hpp"
#include "validate.hpp"
#include "workspace.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Head indices of one task.
struct HeadMap {
  index_t q[2];   // query head of each map
  index_t k[2];   // key head of each map
  index_t v;      // value head
  index_t group;  // kv group, the cache key of the packed keys
};

template <class T>
HeadMap head_map(const AttentionProblem<T>& p, index_t oh) {
  const index_t g = oh / p.group;
  switch (p.kind) {
    case AttnKind::v1:
      return {{2 * oh, 2 * oh + 1}, {2 * g, 2 * g + 1}, g, g};
    case AttnKind::v2:
      return {{2 * oh, 2 * oh + 1}, {g, g}, g, g};
    default:
      return {{oh, oh}, {g, g}, g, g};
  }
}

template <class T>
T row_lambda(const AttentionProblem<T>& p, index_t b, index_t i, index_t oh) {
  if (p.kind == AttnKind::v2) return lambda_sigmoid<T>(p.lambda_logit(b, i, oh));
  if (!p.lambda_heads.empty()) return p.lambda_heads(oh);
  return p.lambda_scalar;
}

/// Scores of a block of fewer than kMR queries, from K rows in place, both
/// maps in one pass over the keys (V2's maps share each key row):
/// s[m][ii, j] = q_m,ii . k_m,j (q already scaled) for the keys row ii sees.
template <class T>
void direct_scores(const AttentionProblem<T>& p, index_t b, const HeadMap& hm, index_t i0,
                   index_t rows, T* const* q, T* const* s, index_t lds) {
  using RowMap = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
  const index_t N = p.seqlen_q, M = p.seqlen_k, d = p.head_dim;
  const index_t kend_block = key_end(p.causal, i0 + rows - 1, N, M);
  const int maps = p.maps();
  for (index_t j = 0; j < kend_block; ++j) {
    for (int m = 0; m < maps; ++m) {
      const RowMap krow(&p.k(b, j, hm.k[m], 0), d);
      for (index_t ii = 0; ii < rows; ++ii)
        if (j < key_end(p.causal, i0 + ii, N, M))
          s[m][ii * lds + j] = RowMap(q[m] + ii * d, d).dot(krow);
    }
  }
}

/// o[ii] += sum_j w[ii, j] v_j over the keys row ii sees, V rows in place.
template <class T>
void direct_output(const AttentionProblem<T>& p, index_t b, index_t vhead, index_t i0, index_t rows,
                   const T* w, index_t lds, T* o, index_t ldo) {
  using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
  const index_t N = p.seqlen_q, M = p.seqlen_k, dv = p.value_dim;
  const index_t kend_block = key_end(p.causal, i0 + rows - 1, N, M);
  for (index_t j = 0; j < kend_block; ++j) {
    const ConstArrayMap vrow(&p.v(b, j, vhead, 0), dv);
    for (index_t ii = 0; ii < rows; ++ii)
      if (j < key_end(p.causal, i0 + ii, N, M))
        ArrayMap(o + ii * ldo, dv) += w[ii * lds + j] * vrow;
  }
}

/// One task. Direct: a block of fewer than kMR queries (decoding) reads K and
/// V rows in place, since packing them would cost more than the products,
/// which are memory-bound then. A template flag, so that the tiled path's code
/// is the same as if the direct one did not exist.
template <class T, bool Direct>
void process_block(const AttentionProblem<T>& p, index_t b, index_t oh, index_t blk,
                   Workspace<T>& ws, std::uint64_t call_id) {
  using Cfg = TileConfig<T>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

  const index_t N = p.seqlen_q, M = p.seqlen_k, d = p.head_dim, dv = p.value_dim;
  const index_t i0 = blk * BM;
  const index_t rows = std::min(BM, N - i0);
  const index_t rows_pad = round_up(rows, MR);
  const index_t tiles = rows_pad / MR;
  const int maps = p.maps();
  const bool shared_k = p.kind != AttnKind::v1;  // V2 and plain: one key head
  const HeadMap hm = head_map(p, oh);

  // Visible keys: row ii sees [0, kend(ii)), non-decreasing in ii.
  auto kend = [&](index_t ii) { return key_end(p.causal, i0 + ii, N, M); };
  auto tile_end = [&](index_t r) { return kend(std::min(r * MR + MR - 1, rows - 1)); };
  const index_t kend_block = kend(rows - 1);
  const index_t lds = round_up(kend_block, NR);  // (rows_pad, lds) score rows

  // 1. Scaled queries (rows_pad, d); padding rows are zero.
  T* qs[2] = {nullptr, nullptr};
  for (int m = 0; m < maps; ++m) {
    qs[m] = ws.q[m].get(rows_pad * d);
    for (index_t ii = 0; ii < rows; ++ii) {
      const T* src = &p.q(b, i0 + ii, hm.q[m], 0);
      T* dst = qs[m] + ii * d;
      for (index_t t = 0; t < d; ++t) dst[t] = p.scale * src[t];
    }
    std::fill(qs[m] + rows * d, qs[m] + rows_pad * d, T(0));
  }

  // 2. Key panels, reused while the same (call, batch, kv group) holds enough keys.
  const int kbufs = shared_k ? 1 : 2;
  const bool cached = ws.packed_call == call_id && ws.packed_batch == b &&
                      ws.packed_group == hm.group && ws.packed_keys >= kend_block;
  if (!Direct && !cached && kend_block > 0) {
    for (int m = 0; m < kbufs; ++m)
      pack_rows_transposed(&p.k(b, 0, hm.k[m], 0), p.k.stride(1), kend_block, d,
                           ws.k[m].get(lds * d));
    ws.packed_call = call_id;
    ws.packed_batch = b;
    ws.packed_group = hm.group;
    ws.packed_keys = kend_block;
  }

  // 3. Scores S_m (rows_pad, lds): panel by panel, skipping fully masked tiles.
  T* s[2] = {nullptr, nullptr};
  for (int m = 0; m < maps; ++m) s[m] = ws.s[m].get(rows_pad * lds);
  if constexpr (Direct) direct_scores(p, b, hm, i0, rows, qs, s, lds);
  for (int m = 0; m < maps && !Direct; ++m) {
    const T* kp = ws.k[shared_k ? 0 : m].get(0);
    for (index_t j0 = 0; j0 < kend_block; j0 += NR) {
      const T* panel = kp + j0 * d;
      for (index_t r = 0; r < tiles; ++r) {
        if (j0 >= tile_end(r)) continue;
        micro_kernel<T>(d, qs[m] + r * MR * d, d, panel, NR, s[m] + r * MR * lds + j0, lds, false);
      }
    }
  }

  // 4. Exact softmax per row and map; W = A1 - lambda A2 over S_1.
  for (index_t ii = 0; ii < rows; ++ii) {
    const index_t i = i0 + ii, n = kend(ii);
    T* w = s[0] + ii * lds;
    const RowStats<T> st1 = exp_row(w, n, false);
    const T c1 = st1.sum > T(0) ? T(1) / st1.sum : T(0);
    if (p.has_lse()) p.lse(b, hm.q[0], i) = row_lse(st1);
    if (maps == 2) {
      T* s2 = s[1] + ii * lds;
      const RowStats<T> st2 = exp_row(s2, n, false);
      const T c2 = st2.sum > T(0) ? row_lambda(p, b, i, oh) / st2.sum : T(0);
      if (p.has_lse()) p.lse(b, hm.q[1], i) = row_lse(st2);
      ArrayMap wa(w, n);
      wa = wa * c1 - ArrayMap(s2, n) * c2;
    } else {
      ArrayMap(w, n) *= c1;
    }
    std::fill(w + n, w + kend_block, T(0));
  }

  // 5. O (rows_pad, dvp) = W V, value chunk by chunk.
  const index_t dvp = round_up(dv, NR);
  T* o = ws.o.get(rows_pad * dvp);
  std::fill(o, o + rows_pad * dvp, T(0));
  if constexpr (Direct) {
    direct_output(p, b, hm.v, i0, rows, s[0], lds, o, dvp);
  } else {
    for (index_t j0 = 0; j0 < kend_block; j0 += BN) {
      const index_t j1 = std::min(j0 + BN, kend_block), kc = j1 - j0;
      T* vp = ws.v.get(BN * dvp);
      pack_cols(&p.v(b, j0, hm.v, 0), p.v.stride(1), kc, dv, vp);
      for (index_t r = 0; r < tiles; ++r) {
        const index_t te = tile_end(r);
        if (te <= j0) continue;
        // Keys every row of the tile sees go through the micro-kernel; the few
        // (< kMR) that only its later rows see are added row by row, so that a
        // non-finite value row never meets a masked (zero) weight: NaN stays in
        // the rows that see it.
        const index_t shared_end = std::min(j1, kend(r * MR));
        const T* a = s[0] + r * MR * lds + j0;
        if (shared_end > j0)
          for (index_t c0 = 0; c0 < dvp; c0 += NR)
            micro_kernel<T>(shared_end - j0, a, lds, vp + c0 * kc, NR, o + r * MR * dvp + c0, dvp,
                            true);
        for (index_t j = std::max(j0, shared_end); j < std::min(j1, te); ++j) {
          for (index_t ii = r * MR; ii < std::min(r * MR + MR, rows); ++ii) {
            if (j >= kend(ii)) continue;
            const T wij = s[0][ii * lds + j];
            T* orow = o + ii * dvp;
            for (index_t c0 = 0; c0 < dvp; c0 += NR) {
              const T* vrow = vp + c0 * kc + (j - j0) * NR;
              for (index_t c = 0; c < NR; ++c) orow[c0 + c] += wij * vrow[c];
            }
          }
        }
      }
    }
  }

  // 6. Rows to the caller's layout.
  for (index_t ii = 0; ii < rows; ++ii)
    std::memcpy(&p.out(b, i0 + ii, oh, 0), o + ii * dvp, static_cast<std::size_t>(dv) * sizeof(T));
}

inline std::uint64_t next_call_id() {
  static std::atomic<std::uint64_t> counter{0};
  return ++counter;
}

/// Runs a validated problem over (batch, head, query block) tasks. Blocks of
/// one head are consecutive and heaviest first (the causal mask makes late
/// blocks longer), handed out dynamically.
template <class T>
void run_attention(const AttentionProblem<T>& p, const AttentionOptions& options) {
  if (p.batch == 0 || p.seqlen_q == 0) return;
  const index_t bm = TileConfig<T>::kBlockM;
  const index_t nblocks = (p.seqlen_q + bm - 1) / bm;
  const index_t tasks = p.batch * p.heads * nblocks;
  const std::uint64_t call_id = next_call_id();
  auto run_task = [&](index_t t) {
    const index_t blk = nblocks - 1 - t % nblocks;
    const index_t bh = t / nblocks;
    const index_t rows = std::min(bm, p.seqlen_q - blk * bm);
    if (rows < TileConfig<T>::kMR)
      process_block<T, true>(p, bh / p.heads, bh % p.heads, blk, thread_workspace<T>(), call_id);
    else
      process_block<T, false>(p, bh / p.heads, bh % p.heads, blk, thread_workspace<T>(), call_id);
  };
  parallel_tasks(tasks, resolve_threads(options.num_threads, tasks), run_task,
                 [] { thread_workspace<T>().trim(); });
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
