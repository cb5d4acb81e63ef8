// The analysis kernel behind diffattn/analysis.hpp.
//
// Same task split and the same first steps as the fused kernel
// (attention_kernel.hpp): one task is one batch entry, one output head and one
// block of kBlockM queries; the block's scaled queries are packed, both maps'
// score rows against every visible key are computed with the micro-kernel, and
// O = W V is one product. Between the scores and the product each row is
// measured (largest |logit|, optionally quantised logits, softmax, entropy,
// mass on the needle and on the rest) while it is in cache. Scratch memory is
// the kernel's O(kBlockM x M) per thread plus one score row.
//
// Every task writes its sums into its own slot of a partial-sums table; the
// slots are reduced in task order afterwards, so results are bitwise identical
// for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../config.hpp"
#include "../options.hpp"
#include "attention_kernel.hpp"
#include "gemm.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "softmax.hpp"
#include "tile.hpp"
#include "validate.hpp"
#include "workspace.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The analysis options, checked and resolved against a problem.
struct AnalysisSpec {
  index_t needle_begin = 0, needle_end = 0;  // key span
  index_t query_begin = 0, query_end = 0;    // query rows measured
  int bits = 0;                              // 0: exact logits
};

/// Keys [begin, end) that query row i sees.
struct KeySpan {
  index_t begin, end;
};

/// The one place where the analysis decides visibility: every other step
/// (which score tiles to compute, the softmax span, the W V product) follows
/// it. Windows change this function only.
template <class T>
KeySpan analysis_keys(const AttentionProblem<T>& p, index_t i) {
  const index_t b = p.band.begin(i, p.seqlen_q, p.seqlen_k);
  return {b, std::max(b, p.band.end(i, p.seqlen_q, p.seqlen_k))};
}

/// Slots of one task's partial sums.
struct StatSlot {
  // Per map m (0, 1): max |logit|, sum of row entropies, sum of needle masses.
  static constexpr int max_logit(int m) { return 3 * m; }
  static constexpr int entropy(int m) { return 3 * m + 1; }
  static constexpr int map_needle(int m) { return 3 * m + 2; }
  // Of the combined weights W.
  static constexpr int needle = 6, context = 7, context_abs = 8, negative = 9;
  static constexpr int out_sq = 10;  // sum of squared outputs
  static constexpr int rows = 11;    // measured rows that see at least one key
  static constexpr int count = 12;
};

/// x <- round(x / step) * step with step = max|x| / (2^(bits-1) - 1): the
/// symmetric per-row quantisation. Round half away from zero. A row of zeros
/// (or a non-finite maximum) is left as it is.
template <class T>
void quantise_row(T* x, index_t n, int bits) {
  if (n == 0) return;
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> a(x, n);
  const T amax = a.abs().maxCoeff();
  if (!(amax > T(0)) || !std::isfinite(amax)) return;
  const T step = amax / static_cast<T>((std::int64_t(1) << (bits - 1)) - 1);
  a = (a / step).round() * step;
}

/// This thread's copy of one score row (the logits, for the entropy).
template <class T>
ScratchBuffer<T>& analysis_row_buffer() {
  static thread_local ScratchBuffer<T> row;
  return row;
}

/// One task: block blk of output head oh in batch entry b. Writes the block's
/// output rows when p.out is not empty and adds the measured rows' sums to acc.
template <class T>
void analysis_block(const AttentionProblem<T>& p, const AnalysisSpec& spec, index_t b, index_t oh,
                    index_t blk, Workspace<T>& ws, std::uint64_t call_id, double* acc) {
  using Cfg = TileConfig<T>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

  const index_t d = p.head_dim, dv = p.value_dim;
  const index_t i0 = blk * BM;
  const index_t rows = std::min(BM, p.seqlen_q - i0);
  const index_t rows_pad = round_up(rows, MR);
  const index_t tiles = rows_pad / MR;
  const int maps = p.maps();
  const bool shared_k = p.kind != AttnKind::v1;
  const HeadMap hm = head_map(p, oh);

  auto span = [&](index_t ii) { return analysis_keys(p, i0 + ii); };
  auto tile_end = [&](index_t r) { return span(std::min(r * MR + MR - 1, rows - 1)).end; };
  index_t kend_block = 0;  // keys any row of the block sees end here
  for (index_t ii = 0; ii < rows; ++ii) kend_block = std::max(kend_block, span(ii).end);
  const index_t lds = round_up(kend_block, NR);  // (rows_pad, lds) score rows

  // 1. Scaled queries (rows_pad, d).
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

  // 2. Key panels, reused across consecutive blocks of one kv group.
  const int kbufs = shared_k ? 1 : 2;
  const bool cached = ws.packed_call == call_id && ws.packed_seq == b &&
                      ws.packed_group == hm.group && ws.packed_begin == 0 &&
                      ws.packed_end >= kend_block;
  if (!cached && kend_block > 0) {
    for (int m = 0; m < kbufs; ++m)
      pack_rows_transposed(&p.k(b, 0, hm.k[m], 0), p.k.stride(1), kend_block, d,
                           ws.k[m].get(lds * d));
    ws.packed_call = call_id;
    ws.packed_seq = b;
    ws.packed_group = hm.group;
    ws.packed_begin = 0;
    ws.packed_end = kend_block;
  }

  // 3. Scores S_m (rows_pad, lds), skipping tiles no row of which sees the keys.
  T* s[2] = {nullptr, nullptr};
  for (int m = 0; m < maps; ++m) {
    s[m] = ws.s[m].get(rows_pad * lds);
    const T* kp = ws.k[shared_k ? 0 : m].get(0);
    for (index_t j0 = 0; j0 < kend_block; j0 += NR)
      for (index_t r = 0; r < tiles; ++r) {
        if (j0 >= tile_end(r)) continue;
        micro_kernel<T>(d, qs[m] + r * MR * d, d, kp + j0 * d, NR, s[m] + r * MR * lds + j0, lds,
                        false);
      }
  }

  // 4. Per row: measure each map, softmax, W = A1 - lambda A2 over S_1.
  T* logits = analysis_row_buffer<T>().get(std::max<index_t>(kend_block, 1));
  for (index_t ii = 0; ii < rows; ++ii) {
    const index_t i = i0 + ii;
    const KeySpan ks = span(ii);
    const index_t n = ks.end - ks.begin;
    const bool measured = i >= spec.query_begin && i < spec.query_end && n > 0;
    // The needle within the row's span, relative to ks.begin.
    const index_t nb = std::clamp(spec.needle_begin, ks.begin, ks.end) - ks.begin;
    const index_t ne = std::clamp(spec.needle_end, ks.begin, ks.end) - ks.begin;
    T coef[2] = {T(0), T(0)};
    for (int m = 0; m < maps; ++m) {
      T* x = s[m] + ii * lds + ks.begin;
      if (n == 0) continue;
      ArrayMap xa(x, n);
      if (measured)
        acc[StatSlot::max_logit(m)] =
            std::max(acc[StatSlot::max_logit(m)], static_cast<double>(xa.abs().maxCoeff()));
      if (spec.bits > 0) quantise_row(x, n, spec.bits);
      if (measured) std::memcpy(logits, x, static_cast<std::size_t>(n) * sizeof(T));
      const RowStats<T> st = exp_row(x, n, false);
      const T inv = st.sum > T(0) ? T(1) / st.sum : T(0);
      coef[m] = m == 0 ? inv : row_lambda(p, b, i, oh) * inv;
      if (!measured) continue;
      // H = -sum p log p = log S - sum e (x - max) / S, with e = exp(x - max).
      double entropy = 0;
      if (st.sum > T(0) && std::isfinite(st.max)) {
        const ArrayMap la(logits, n);
        entropy = std::log(static_cast<double>(st.sum)) -
                  static_cast<double>((xa * (la - st.max)).sum() * inv);
      } else if (std::isnan(st.sum)) {
        entropy = std::numeric_limits<double>::quiet_NaN();
      }
      acc[StatSlot::entropy(m)] += entropy;
      if (ne > nb)
        acc[StatSlot::map_needle(m)] += static_cast<double>(xa.segment(nb, ne - nb).sum() * inv);
    }
    T* w = s[0] + ii * lds;
    if (n > 0) {
      ArrayMap wa(w + ks.begin, n);
      if (maps == 2)
        wa = wa * coef[0] - ArrayMap(s[1] + ii * lds + ks.begin, n) * coef[1];
      else
        wa *= coef[0];
      if (measured) {
        const double needle = ne > nb ? static_cast<double>(wa.segment(nb, ne - nb).sum()) : 0.0;
        const double needle_abs =
            ne > nb ? static_cast<double>(wa.segment(nb, ne - nb).abs().sum()) : 0.0;
        acc[StatSlot::needle] += needle;
        acc[StatSlot::context] += static_cast<double>(wa.sum()) - needle;
        acc[StatSlot::context_abs] += static_cast<double>(wa.abs().sum()) - needle_abs;
        acc[StatSlot::negative] += static_cast<double>(wa.min(T(0)).sum());
        acc[StatSlot::rows] += 1;
      }
    }
    std::fill(w, w + std::min(ks.begin, kend_block), T(0));
    std::fill(w + std::max(ks.end, ks.begin), w + kend_block, T(0));
  }

  // 5. O (rows_pad, dvp) = W V, value chunk by chunk (as the fused kernel: keys
  // that only a tile's later rows see are added row by row).
  const index_t dvp = round_up(dv, NR);
  T* o = ws.o.get(rows_pad * dvp);
  std::fill(o, o + rows_pad * dvp, T(0));
  for (index_t j0 = 0; j0 < kend_block; j0 += BN) {
    const index_t j1 = std::min(j0 + BN, kend_block), kc = j1 - j0;
    T* vp = ws.v.get(BN * dvp);
    pack_cols(&p.v(b, j0, hm.v, 0), p.v.stride(1), kc, dv, vp);
    for (index_t r = 0; r < tiles; ++r) {
      const index_t te = tile_end(r);
      if (te <= j0) continue;
      const index_t shared_end = std::min(j1, span(r * MR).end);
      const T* a = s[0] + r * MR * lds + j0;
      if (shared_end > j0)
        for (index_t c0 = 0; c0 < dvp; c0 += NR)
          micro_kernel<T>(shared_end - j0, a, lds, vp + c0 * kc, NR, o + r * MR * dvp + c0, dvp,
                          true);
      for (index_t j = std::max(j0, shared_end); j < std::min(j1, te); ++j)
        for (index_t ii = r * MR; ii < std::min(r * MR + MR, rows); ++ii) {
          if (j >= span(ii).end) continue;
          const T wij = s[0][ii * lds + j];
          T* orow = o + ii * dvp;
          for (index_t c0 = 0; c0 < dvp; c0 += NR) {
            const T* vrow = vp + c0 * kc + (j - j0) * NR;
            for (index_t c = 0; c < NR; ++c) orow[c0 + c] += wij * vrow[c];
          }
        }
    }
  }

  // 6. Output rows: their squares for the context RMS, and to the caller.
  for (index_t ii = 0; ii < rows; ++ii) {
    const index_t i = i0 + ii;
    const KeySpan ks = span(ii);
    if (i >= spec.query_begin && i < spec.query_end && ks.end > ks.begin)
      acc[StatSlot::out_sq] += static_cast<double>(
          Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(o + ii * dvp, dv).square().sum());
    if (!p.out.empty())
      std::memcpy(&p.out(b, i, oh, 0), o + ii * dvp, static_cast<std::size_t>(dv) * sizeof(T));
  }
}

/// Per-head results, filled by run_analysis (the public AttentionStats).
template <class Stats, class T>
Stats run_analysis(const AttentionProblem<T>& p, const AnalysisSpec& spec,
                   const AttentionOptions& options) {
  const int maps = p.maps();
  Stats st;
  st.heads = p.heads;
  st.maps = maps;
  const std::size_t hm = static_cast<std::size_t>(p.heads * maps);
  const std::size_t h = static_cast<std::size_t>(p.heads);
  st.max_abs_logit.assign(hm, 0.0);
  st.entropy.assign(hm, 0.0);
  st.map_needle_mass.assign(hm, 0.0);
  for (auto* v : {&st.needle_mass, &st.context_mass, &st.context_abs_mass, &st.negative_mass,
                  &st.context_rms})
    v->assign(h, 0.0);
  if (p.batch == 0 || p.seqlen_q == 0) return st;

  const index_t bm = TileConfig<T>::kBlockM;
  const index_t nblocks = (p.seqlen_q + bm - 1) / bm;
  const index_t tasks = p.batch * p.heads * nblocks;
  std::vector<double> partial(static_cast<std::size_t>(tasks) * StatSlot::count, 0.0);
  const std::uint64_t call_id = next_call_id();
  const bool need_all_rows = !p.out.empty();
  auto run_task = [&](index_t t) {
    // Heaviest (latest) blocks of a head first, as the fused kernel.
    const index_t blk = nblocks - 1 - t % nblocks;
    const index_t bh = t / nblocks;
    const index_t first = blk * bm, last = std::min(first + bm, p.seqlen_q);
    if (!need_all_rows && (last <= spec.query_begin || first >= spec.query_end)) return;
    analysis_block<T>(p, spec, bh / p.heads, bh % p.heads, blk, thread_workspace<T>(), call_id,
                      partial.data() + static_cast<std::size_t>(t) * StatSlot::count);
  };
  parallel_tasks(tasks, resolve_threads(options.num_threads, tasks), run_task, [] {
    thread_workspace<T>().trim();
    ScratchBuffer<T>& row = analysis_row_buffer<T>();
    if (row.bytes() > Workspace<T>::kRetainBytes) row.release();
  });

  // Reduce in task order: per head, over batch entries and blocks.
  std::vector<double> rows(h, 0.0), out_sq(h, 0.0);
  for (index_t t = 0; t < tasks; ++t) {
    const double* a = partial.data() + static_cast<std::size_t>(t) * StatSlot::count;
    const std::size_t oh = static_cast<std::size_t>((t / nblocks) % p.heads);
    for (int m = 0; m < maps; ++m) {
      const std::size_t k = oh * static_cast<std::size_t>(maps) + static_cast<std::size_t>(m);
      st.max_abs_logit[k] = std::max(st.max_abs_logit[k], a[StatSlot::max_logit(m)]);
      st.entropy[k] += a[StatSlot::entropy(m)];
      st.map_needle_mass[k] += a[StatSlot::map_needle(m)];
    }
    st.needle_mass[oh] += a[StatSlot::needle];
    st.context_mass[oh] += a[StatSlot::context];
    st.context_abs_mass[oh] += a[StatSlot::context_abs];
    st.negative_mass[oh] += a[StatSlot::negative];
    out_sq[oh] += a[StatSlot::out_sq];
    rows[oh] += a[StatSlot::rows];
  }
  st.rows = static_cast<index_t>(rows[0]);
  if (st.rows == 0) return st;
  const double r = rows[0];
  for (std::size_t k = 0; k < hm; ++k) {
    st.entropy[k] /= r;
    st.map_needle_mass[k] /= r;
  }
  for (std::size_t k = 0; k < h; ++k) {
    st.needle_mass[k] /= r;
    st.context_mass[k] /= r;
    st.context_abs_mass[k] /= r;
    st.negative_mass[k] /= r;
    st.context_rms[k] = std::sqrt(out_sq[k] / (r * static_cast<double>(p.value_dim)));
  }
  return st;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
