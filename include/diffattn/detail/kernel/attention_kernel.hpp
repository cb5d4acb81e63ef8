// The fused kernel shared by plain, V1 and V2 attention.
//
// Algorithm (one task = one sequence (a batch entry, or one sequence of a
// packed batch), one output head, one block of kBlockM queries):
//   1. pack the block's queries of each map, scaled by s;
//   2. pack the keys the block sees into kNR-wide panels (kept across the
//      consecutive blocks of one kv head that a thread processes);
//   3. S_m = (s Q_m) K_m^T for every visible key, register tile by tile,
//      skipping tiles outside the band of keys the block sees (causal mask,
//      sliding window: see mask.hpp);
//   4. per row, an exact softmax of each map and W = A1 - lambda A2, written
//      over S_1 (the row's log-sum-exp per map goes to lse);
//   5. O = W V in key chunks of kBlockN; values are packed with the keys (once
//      per kv head and key range, not per block) and read once for both maps.
// This does exactly the useful work (both maps' scores and one product of W
// with V) at O(kBlockM x M) memory per thread (O(kBlockM x (kBlockM + W))
// under a window of W keys). A single-pass streaming
// ("flash") softmax would need one accumulator per map, so two products with V:
// 1.5x the work of V1. Keeping a block's score rows instead costs memory linear
// in M, 7.5 MiB per thread at M = 16384 (kBlockM = 60, two float maps).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../lambda.hpp"
#include "../../options.hpp"
#include "../core/parallel.hpp"
#include "../core/validate.hpp"
#include "../core/workspace.hpp"
#include "../decode/decode_kernel.hpp"
#include "bf16_dot.hpp"
#include "bf16_wv.hpp"
#include "block_info.hpp"
#include "convert.hpp"
#include "dispatch.hpp"
#include "gemm.hpp"
#include "mask.hpp"
#include "score_mods.hpp"
#include "softmax.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// What the fused kernel does with each row of a block between its scores and
/// its output (process_block's steps 4 and 6); the analysis kernel
/// (analysis_impl.hpp) measures the rows there instead, through the same two
/// calls.
template <class T, class KV, class C, class Mod = NoScoreMod>
struct FusedRows {
  /// The user's score functor (NoScoreMod: none; every use below is behind
  /// `if constexpr`, so the default compiles to the kernel without one).
  Mod mod{};
  static constexpr bool kFunctor = is_active_mod<Mod, C>;
  static constexpr bool kVisible = has_visible<Mod>::value;
  /// Rows may hold -inf inside the range functor_scores leaves them (a mask
  /// pair by pair, or a score functor's -inf next to visible_range).
  static constexpr bool kMasked =
      kVisible && (!has_visible_range<Mod>::value || has_score<Mod, C>::value);

  /// Step 4, query i of sequence sq: the scores of its n visible keys (from
  /// key kb) of map 1 at w and of map 2 at w2 (nullptr for one map) become
  /// its weights over w: softmax, or W = A1 - lambda A2; each map's lse.
  void weights(const AttentionProblem<T, KV>& p, const SeqSpan& sq, index_t oh, const HeadMap& hm,
               index_t i, index_t kb, index_t n, C* w, C* w2) const {
    using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
    if (kFunctor || p.modified) {
      modified_weights(p, sq, oh, hm, i, kb, n, w, w2);
      return;
    }
    // bf16 dot products: exp by vscalefps (softmax.hpp), the float path's pexp elsewhere.
    constexpr bool scalef = use_bf16_wv<T, KV>;
    const RowStats<C> st1 = exp_row<C, scalef>(w, n, false);
    const C c1 = st1.sum > C(0) ? C(1) / st1.sum : C(0);
    if (p.has_lse()) p.lse(sq.b, hm.q[0], i) = row_lse(st1);
    if (w2) {
      const RowStats<C> st2 = exp_row<C, scalef>(w2, n, false);
      const C c2 = st2.sum > C(0) ? row_lambda(p, sq.b, i, oh) / st2.sum : C(0);
      if (p.has_lse()) p.lse(sq.b, hm.q[1], i) = row_lse(st2);
      ArrayMap wa(w, n);
      wa = wa * c1 - ArrayMap(w2, n) * c2;
    } else {
      ArrayMap(w, n) *= c1;
    }
  }
  /// Step 4 under score modifiers (softcap, ALiBi, sinks, a user functor):
  /// each map's scores modified in place, then its softmax with the sink in
  /// the denominator.
  void modified_weights(const AttentionProblem<T, KV>& p, const SeqSpan& sq, index_t oh,
                        const HeadMap& hm, index_t i, index_t kb, index_t n, C* w, C* w2) const {
    using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
    const index_t diag = (i - sq.q0) + sq.m - sq.n;  // i + M - N within the sequence
    C coef[2] = {C(1), C(0)};
    C* rows[2] = {w, w2};
    ModCoords mc;
    if constexpr (kFunctor) mc = mod_coords(p, sq);
    for (int m = 0; m < (w2 ? 2 : 1); ++m) {
      const RowMods<C> rm = row_mods(p, hm.q[m]);
      modify_scores(rows[m], n, rm, diag, kb);
      // Under visible_range the softmax runs over the row's range only, the
      // keys outside it weigh 0.
      std::pair<index_t, index_t> t{0, n};
      if constexpr (kFunctor)
        t = functor_scores(mod, rows[m], n, mc.b, hm.q[m], i - sq.q0 + mc.ioff, kb);
      C* x = rows[m] + t.first;
      const index_t len = t.second - t.first;
      const RowStats<C> st = kMasked ? exp_row_masked(x, len) : exp_row(x, len, false);
      std::fill(rows[m], x, C(0));
      std::fill(x + len, rows[m] + n, C(0));
      SinkNorm<C> sn{st.sum > C(0) ? C(1) / st.sum : C(0), row_lse(st)};
      if (rm.has_sink) sn = sink_norm(st, rm.sink);
      if (p.has_lse()) p.lse(sq.b, hm.q[m], i) = sn.lse;
      coef[m] = sn.scale;
    }
    if (w2) {
      const C c2 = row_lambda(p, sq.b, i, oh) * coef[1];
      ArrayMap wa(w, n);
      wa = wa * coef[0] - ArrayMap(w2, n) * c2;
    } else {
      ArrayMap(w, n) *= coef[0];
    }
  }
  /// Step 6: output row i (dv values at o) to the caller's layout, rounded
  /// once to T for 16-bit storage.
  void output(const AttentionProblem<T, KV>& p, const SeqSpan& sq, index_t oh, index_t i, index_t n,
              const C* o) const {
    (void)n;
    T* dst = &p.out(sq.b, i, oh, 0);
    if constexpr (std::is_same<T, C>::value)
      std::memcpy(dst, o, static_cast<std::size_t>(p.value_dim) * sizeof(T));
    else
      convert_row(o, p.value_dim, dst);
  }
};

/// The rows of a block as process_block sees them: the band's, or (a user
/// functor with `visible`) narrowed to the keys it makes visible.
template <class T, class KV, class RowsDo>
BlockRows block_rows_of(const RowsDo&, const AttentionProblem<T, KV>&, const SeqSpan&,
                        const BlockRows& br, const HeadMap&) {
  return br;
}
template <class T, class KV, class C, class Mod>
auto block_rows_of(const FusedRows<T, KV, C, Mod>& rows_do, const AttentionProblem<T, KV>& p,
                   const SeqSpan& sq, const BlockRows& br, const HeadMap& hm) {
  return visible_rows(rows_do.mod, p, sq, br, hm);
}

/// One task: sequence `seq`, output head oh, query block blk (decoding steps,
/// fewer than kMR queries, go to decode_kernel.hpp instead). Keys and values
/// come through the problem's row source, so contiguous, per-sequence-length
/// and paged caches take the same path.
///
/// The block sees the keys [begin(0), end(rows - 1)) (a band under a window);
/// score rows start at kbase, that band's start rounded down to a whole panel.
/// Tiles outside the band are skipped, so the work follows the visible pairs.
///
/// Storage: q and out hold T, k and v hold KV; everything here (scaled
/// queries, panels, scores, W, the output block) is the compute type C
/// (float for 16-bit storage). Each stored element is converted once: queries
/// when scaled, keys and values when packed, output rows when written.
///
/// bfloat16 q and k under AVX512-BF16 (use_bf16_dot, bf16_dot.hpp): queries
/// and keys are packed as bf16 pairs instead, unscaled and unwidened, and
/// S = Q K^T runs on bf16 dot products with the scale applied to each score.
/// With bfloat16 values as well (use_bf16_wv, bf16_wv.hpp), O = W V runs on
/// them too: values packed as pairs of keys, W rounded to bf16 row by row
/// after step 4 (lse is the float scores', unaffected), the band's ragged
/// edges added in float. The rest is the same.
///
/// Steps 4 and 6 go through `rows_do` (FusedRows, or the analysis' measuring
/// rows).
template <class T, class KV, class C = compute_t<T>, class RowsDo = FusedRows<T, KV, C>>
void process_block(const AttentionProblem<T, KV>& p, index_t seq, index_t oh, index_t blk,
                   Workspace<C>& ws, std::uint64_t call_id, const RowsDo& rows_do = RowsDo()) {
  using Cfg = TileConfig<C>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM, BN = Cfg::kBlockN;

  const SeqSpan sq = p.seq(seq);
  const index_t d = p.head_dim, dv = p.value_dim;
  const index_t i0 = blk * BM;
  const HeadMap hm = head_map(p, oh);
  const auto br =
      block_rows_of(rows_do, p, sq, BlockRows{p.band, sq.n, sq.m, i0, std::min(BM, sq.n - i0)}, hm);
  const index_t rows = br.rows;
  const index_t rows_pad = round_up(rows, MR);
  const index_t tiles = rows_pad / MR;
  const int maps = p.maps();
  const bool shared_k = p.kind != AttnKind::v1;  // V2 and plain: one key head
  constexpr bool dot = use_bf16_dot<T, KV>;
  constexpr bool wv16 = use_bf16_wv<T, KV> && std::is_same<C, float>::value;
  const index_t dk = dot ? bf16_pairs(d) : d;  // packed depth: words of bf16 pairs, or floats

  // Tile r holds rows [r MR, r MR + MR): the union of their keys is
  // [tile_lo, tile_hi), the keys all of them see [shared_lo, shared_hi).
  auto last_row = [&](index_t r) { return std::min(r * MR + MR - 1, rows - 1); };
  auto tile_lo = [&](index_t r) { return br.begin(r * MR); };
  auto tile_hi = [&](index_t r) { return br.end(last_row(r)); };
  const index_t kend_block = std::max(br.end(rows - 1), br.begin(0));
  const index_t kbase = br.begin(0) / NR * NR;
  const index_t lds = round_up(kend_block - kbase, NR);  // (rows_pad, lds) score rows

  // 1. Scaled queries (rows_pad, d), or unscaled bf16 pairs (rows_pad, dk);
  //    padding rows are zero.
  C* qs[2] = {nullptr, nullptr};
  std::uint32_t* qp[2] = {nullptr, nullptr};
  for (int m = 0; m < maps; ++m) {
    if constexpr (dot) {
      qp[m] = ws.q_pairs[m].get(rows_pad * dk);
      for (index_t ii = 0; ii < rows; ++ii)
        pack_query_pairs(&p.q(sq.b, sq.q0 + i0 + ii, hm.q[m], 0), d, qp[m] + ii * dk);
      std::fill(qp[m] + rows * dk, qp[m] + rows_pad * dk, 0u);
    } else {
      qs[m] = ws.q[m].get(rows_pad * d);
      for (index_t ii = 0; ii < rows; ++ii) {
        const T* src = &p.q(sq.b, sq.q0 + i0 + ii, hm.q[m], 0);
        C* dst = qs[m] + ii * d;
        const C* row = row_as<C>(src, d, dst);
        for (index_t t = 0; t < d; ++t) dst[t] = p.scale * row[t];
      }
      std::fill(qs[m] + rows * d, qs[m] + rows_pad * d, C(0));
    }
  }

  // 2. Key and value panels of [kbase, kend_block), reused while the same (call,
  //    sequence, kv group) holds them: consecutive blocks of one head (and
  //    every block under a plain causal mask, the last one packing all keys).
  const int kbufs = shared_k ? 1 : 2;
  const bool cached = ws.packed_call == call_id && ws.packed_seq == seq &&
                      ws.packed_group == hm.group && ws.packed_begin <= kbase &&
                      ws.packed_end >= kend_block;
  if (!cached && kend_block > kbase) {
    // Under a window the band slides left block by block (blocks run last to
    // first): pack kPackAhead blocks' worth of keys further left as well, so
    // that the next blocks this thread takes find their keys packed. Without
    // one the band starts at key 0, and only a functor's `visible` moves a
    // block's start (to the next document's, say): the keys left of it are
    // not the next blocks' keys.
    const index_t ahead = p.band.left >= 0 ? Cfg::kPackAhead * BM : 0;
    const index_t pbegin = std::max<index_t>(0, kbase - ahead) / NR * NR;
    const index_t prows = kend_block - pbegin;
    for (int m = 0; m < kbufs; ++m) {
      const index_t kh = hm.k[m];
      auto key = [&](index_t r) { return p.packed_key_row(sq, pbegin + r, kh); };
      if constexpr (dot)
        pack_pairs_transposed_from(key, prows, d, ws.k_pairs[m].get(round_up(prows, NR) * dk));
      else
        pack_rows_transposed_from(key, prows, d, ws.k[m].get(round_up(prows, NR) * d));
    }
    // Values of the same keys in column panels, read by O = W V (pairs of
    // keys per word for bf16 dot products).
    auto value = [&](index_t r) { return p.packed_value_row(sq, pbegin + r, hm.v); };
    if constexpr (wv16)
      pack_value_pairs_from(value, prows, dv, ws.v_pairs.get(bf16_pairs(prows) * round_up(dv, NR)));
    else
      pack_cols_from(value, prows, dv, ws.v.get(prows * round_up(dv, NR)));
    ws.packed_call = call_id;
    ws.packed_seq = seq;
    ws.packed_group = hm.group;
    ws.packed_begin = pbegin;
    ws.packed_end = kend_block;
  }

  // 3. Scores S_m (rows_pad, lds): panel by panel, skipping tiles outside the band.
  C* s[2] = {nullptr, nullptr};
  for (int m = 0; m < maps; ++m) s[m] = ws.s[m].get(rows_pad * lds);
  for (int m = 0; m < maps; ++m) {
    const int km = shared_k ? 0 : m;
    for (index_t j0 = kbase; j0 < kend_block; j0 += NR) {
      const index_t panel = (j0 - ws.packed_begin) * dk;  // offset of the keys' panel
      for (index_t r = 0; r < tiles; ++r) {
        if (j0 >= tile_hi(r) || j0 + NR <= tile_lo(r)) continue;
        C* st = s[m] + r * MR * lds + (j0 - kbase);
        if constexpr (dot)
          micro_kernel_bf16(dk, qp[m] + r * MR * dk, dk, ws.k_pairs[km].get(0) + panel, st, lds,
                            p.scale);
        else
          micro_kernel<C>(d, qs[m] + r * MR * d, d, ws.k[km].get(0) + panel, NR, st, lds, false);
      }
    }
  }

  // 4. Per row, its weights over its visible keys (FusedRows: exact softmax
  //    per map, W = A1 - lambda A2 over S_1). Entries outside a row's keys are
  //    never read again.
  for (index_t ii = 0; ii < rows; ++ii) {
    const index_t n = br.count(ii), kb = n > 0 ? br.begin(ii) : kbase;
    const index_t off = kb - kbase;
    rows_do.weights(p, sq, oh, hm, sq.q0 + i0 + ii, kb, n, s[0] + ii * lds + off,
                    maps == 2 ? s[1] + ii * lds + off : nullptr);
  }

  // 4b. bf16 dot products: each row's weights rounded to bf16, as pairs of keys
  //     (word t: keys kbase + 2t, kbase + 2t + 1). Only whole pairs of keys the
  //     row sees are written, all that step 5's tiles read; padding rows are zero.
  const index_t ldp = lds / 2;  // lds is a multiple of kNR, kbase of 2
  std::uint32_t* wp = nullptr;  // (rows_pad, ldp) words
  if constexpr (wv16) {
    wp = ws.w_pairs.get(rows_pad * ldp);
    for (index_t ii = 0; ii < rows; ++ii) {
      const index_t n = br.count(ii);
      if (n <= 0) continue;
      const index_t off = br.begin(ii) - kbase;
      const index_t t0 = (off + 1) / 2, t1 = (off + n) / 2;
      if (t0 < t1) round_weight_pairs(s[0] + ii * lds, t0, t1, wp + ii * ldp);
    }
    std::fill(wp + rows * ldp, wp + rows_pad * ldp, 0u);
  }

  // 5. O (rows_pad, dvp) = W V, value chunk by chunk.
  const index_t dvp = round_up(dv, NR);
  C* o = ws.o.get(rows_pad * dvp);
  std::fill(o, o + rows_pad * dvp, C(0));
  {
    // Value panel c0 holds the packed keys' rows at vp + c0 * prows, key j at
    // row j - packed_begin (for bf16 dot products: pairs of keys at
    // vpp + c0 * ppairs, key j in word (j - packed_begin) / 2). Chunks of
    // kBlockN keys keep what the tiles share in L2.
    const index_t prows = ws.packed_end - ws.packed_begin, pb = ws.packed_begin;
    const index_t ppairs = bf16_pairs(prows);
    const C* vp =
        wv16 ? nullptr : ws.v.get(0);  // key j of panel c0 at vp + c0 * prows + (j - pb) NR
    const std::uint32_t* vpp = wv16 ? ws.v_pairs.get(0) : nullptr;
    for (index_t j0 = kbase; j0 < kend_block; j0 += BN) {
      const index_t j1 = std::min(j0 + BN, kend_block);
      for (index_t r = 0; r < tiles; ++r) {
        const index_t lo = std::max(j0, tile_lo(r)), hi = std::min(j1, tile_hi(r));
        if (lo >= hi) continue;
        // Keys every row of the tile sees go through the micro-kernel; the few
        // (< kMR at each edge of the band) that only some rows see are added
        // row by row, so that a non-finite value row never meets a masked
        // weight: NaN stays in the rows that see it.
        const index_t r0 = r * MR, r1 = std::min(r0 + MR, rows);
        auto add_rows = [&](index_t ja, index_t jb) {
          for (index_t j = ja; j < jb; ++j)
            for (index_t ii = r0; ii < r1; ++ii) {
              if (j < br.begin(ii) || j >= br.end(ii)) continue;
              const C wij = s[0][ii * lds + (j - kbase)];
              C* orow = o + ii * dvp;
              if constexpr (wv16) {
                for (index_t c0 = 0; c0 < dvp; c0 += NR)
                  add_value_pair_row(vpp + c0 * ppairs, j - pb, wij, orow + c0);
              } else {
                for (index_t c0 = 0; c0 < dvp; c0 += NR) {
                  const C* vrow = vp + c0 * prows + (j - pb) * NR;
                  for (index_t c = 0; c < NR; ++c) orow[c0 + c] += wij * vrow[c];
                }
              }
            }
        };
        index_t sh_lo = std::max(lo, br.begin(r1 - 1)), sh_hi = std::min(hi, br.end(r0));
        if constexpr (wv16) {
          // Whole pairs of keys only (pb and kbase are even): an odd key at
          // either end goes row by row.
          sh_lo += sh_lo % 2;
          sh_hi -= sh_hi % 2;
        }
        if (sh_lo >= sh_hi) {
          add_rows(lo, hi);
          continue;
        }
        add_rows(lo, sh_lo);
        if constexpr (wv16) {
          const std::uint32_t* a = wp + r0 * ldp + (sh_lo - kbase) / 2;
          for (index_t c0 = 0; c0 < dvp; c0 += NR)
            micro_kernel_bf16_add((sh_hi - sh_lo) / 2, a, ldp,
                                  vpp + c0 * ppairs + (sh_lo - pb) / 2 * NR, o + r0 * dvp + c0,
                                  dvp);
        } else {
          const C* a = s[0] + r0 * lds + (sh_lo - kbase);
          for (index_t c0 = 0; c0 < dvp; c0 += NR)
            micro_kernel<C>(sh_hi - sh_lo, a, lds, vp + c0 * prows + (sh_lo - pb) * NR, NR,
                            o + r0 * dvp + c0, dvp, true);
        }
        add_rows(sh_hi, hi);
      }
    }
  }

  // 6. Rows to the caller (FusedRows: its layout, rounded once to T).
  for (index_t ii = 0; ii < rows; ++ii)
    rows_do.output(p, sq, oh, sq.q0 + i0 + ii, br.count(ii), o + ii * dvp);
}

/// The multiply-adds of a call, at most (every query of every lane against
/// every key of its sequence, for the scores and for W V): what
/// resolve_threads weighs against the cost of waking threads.
template <class T, class KV>
double attention_work(const AttentionProblem<T, KV>& p) {
  double work = 0;
  for (index_t s = 0; s < p.num_seqs(); ++s) {
    const SeqSpan sq = p.seq(s);
    work += static_cast<double>(p.heads * p.maps() * sq.n) * static_cast<double>(sq.m) *
            static_cast<double>(p.head_dim + p.value_dim);
  }
  return work;
}

inline std::uint64_t next_call_id() {
  static std::atomic<std::uint64_t> counter{0};
  return ++counter;
}

/// Runs a validated problem. A sequence of at least kMR queries runs as
/// (head, run of query blocks) tasks of process_block; one of fewer (a
/// decoding step) as one task per key chunk (decode_kernel.hpp). Tasks
/// are handed out dynamically.
///
/// Blocks of one (sequence, head) go last to first: under the causal mask the
/// late blocks are the heaviest, and the first block a thread takes packs
/// every key the others need. Under a left window the blocks cost the same and
/// each sees a band that slides left; a task then takes a run of kPackAhead
/// consecutive blocks, so that one thread packs the keys of the run once.
///
/// A decoding step split into several key chunks leaves one state per chunk;
/// a second pass merges each sequence's states in chunk order and
/// writes the output. Which chunks exist follows from the problem alone, so
/// the result is the same for any thread count.
template <class T, class KV, class Mod = NoScoreMod>
void run_attention_kernel(const AttentionProblem<T, KV>& p, const AttentionOptions& options,
                          const Mod& mod = Mod()) {
  using C = compute_t<T>;
  // A user functor runs in process_block (FusedRows) and in the decoding step.
  const FusedRows<T, KV, C, Mod> rows_do{mod};
  using Cfg = TileConfig<C>;
  const index_t bm = Cfg::kBlockM;
  const index_t run = p.band.left >= 0 ? Cfg::kPackAhead : 1;  // blocks per task
  const index_t S = p.num_seqs();
  if (S == 0 || p.heads == 0) return;
  const index_t dv = p.value_dim;
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };

  // Per sequence: its first task, its decoding chunks (0: not decoding) and
  // the offset of its chunks' states (only when there are several).
  std::vector<index_t> first(at(S + 1), 0), chunks(at(S), 0), state_first(at(S + 1), 0);
  std::vector<DecodeChunks> plan(at(S));
  const double work = attention_work(p);
  for (index_t s = 0; s < S; ++s) {
    const SeqSpan sq = p.seq(s);
    index_t tasks = 0, states = 0;
    if (sq.n > 0 && sq.n < Cfg::kMR) {
      plan[at(s)] = decode_chunks(p, sq);
      chunks[at(s)] = plan[at(s)].count;
      tasks = chunks[at(s)];
      if (tasks > 1) states = tasks * decode_lanes(p, sq.n).rows() * (dv + 1);
    } else {
      const index_t nb = (sq.n + bm - 1) / bm;
      tasks = p.heads * ((nb + run - 1) / run);
    }
    first[at(s + 1)] = first[at(s)] + tasks;
    state_first[at(s + 1)] = state_first[at(s)] + states;
  }
  const index_t tasks = first.back();
  if (tasks == 0) return;
  std::vector<C> states(at(state_first.back()));
  auto seq_of = [&](index_t t) {
    return static_cast<index_t>(std::upper_bound(first.begin(), first.end(), t) - first.begin()) -
           1;
  };
  const std::uint64_t call_id = next_call_id();
  auto run_task = [&](index_t t) {
    const index_t s = seq_of(t);
    const index_t local = t - first[at(s)];
    const SeqSpan sq = p.seq(s);
    Workspace<C>& ws = thread_workspace<C>();
    if (chunks[at(s)] > 0) {
      const index_t nc = chunks[at(s)], c = local;
      const DecodeLanes dl = decode_lanes(p, sq.n);
      const DecodeChunks& pl = plan[at(s)];
      if (nc == 1) {
        C* o = ws.o.get(dl.rows() * dv);
        C* lse = ws.lse.get(dl.rows());
        decode_states(p, sq, dl, pl.begin(0), pl.end(0), ws, o, lse, mod);
        decode_finish(p, sq, dl, o, lse, ws);
      } else {
        C* o = states.data() + state_first[at(s)] + local * dl.rows() * (dv + 1);
        decode_states(p, sq, dl, pl.begin(c), pl.end(c), ws, o, o + dl.rows() * dv, mod);
      }
      return;
    }
    const index_t nb = (sq.n + bm - 1) / bm, runs = (nb + run - 1) / run;
    const index_t oh = local / runs, r = runs - 1 - local % runs;
    for (index_t blk = std::min(nb, (r + 1) * run) - 1; blk >= r * run; --blk)
      process_block(p, s, oh, blk, ws, call_id, rows_do);
  };
  parallel_tasks(tasks, resolve_threads(options.num_threads, tasks, work), run_task,
                 [] { thread_workspace<C>().trim(); });
  if (states.empty()) return;

  // Merge the chunk states of every split sequence, in chunk order.
  std::vector<index_t> split;
  for (index_t s = 0; s < S; ++s)
    if (chunks[at(s)] > 1) split.push_back(s);
  const index_t merges = static_cast<index_t>(split.size());
  parallel_tasks(
      merges, resolve_threads(options.num_threads, merges, work),
      [&](index_t t) {
        const index_t s = split[at(t)];
        const SeqSpan sq = p.seq(s);
        const DecodeLanes dl = decode_lanes(p, sq.n);
        const index_t stride = dl.rows() * (dv + 1);
        C* st = states.data() + state_first[at(s)];
        const index_t nc = chunks[at(s)];
        merge_chunk_states(st, nc, stride, dl.rows(), dv);
        decode_finish(p, sq, dl, st, st + dl.rows() * dv, thread_workspace<C>());
      },
      [] {});
}

/// Runs a validated problem: here, compiled for the including translation
/// unit's flags, or (DIFFATTN_DISPATCH) in diffattn::dispatch's variant for
/// this CPU (dispatch.hpp).
template <class T, class KV>
void run_attention(const AttentionProblem<T, KV>& p, const AttentionOptions& options) {
#ifdef DIFFATTN_DISPATCH
  dispatch_attention(p, options);
#else
  run_attention_kernel(p, options);
#endif
}

/// With a user functor: always here, header-only (a user's type cannot go
/// through the compiled library); NoScoreMod takes run_attention's way.
template <class T, class KV, class Mod>
void run_attention(const AttentionProblem<T, KV>& p, const AttentionOptions& options,
                   const Mod& mod) {
  if constexpr (is_active_mod<Mod, compute_t<T>>)
    run_attention_kernel(p, options, mod);
  else
    run_attention(p, options);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
