// The analysis kernel behind diffattn/analysis.hpp.
//
// The fused kernel's own task (attention_kernel.hpp's process_block: one batch
// entry, one output head, one block of kBlockM queries; the same packing,
// score tiles, masks and O = W V product), with its per-row steps replaced by
// AnalysisRows: between the scores and the weights each row is measured
// (largest |logit|, optionally quantised logits, softmax, entropy, mass on the
// needle and on the rest) while it is in cache, and each output row as it is
// written. Scratch memory is the kernel's O(kBlockM x M) per thread plus one
// score row.
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

#include "../../config.hpp"
#include "../../options.hpp"
#include "../core/parallel.hpp"
#include "../core/validate.hpp"
#include "../core/workspace.hpp"
#include "../kernel/attention_kernel.hpp"
#include "../kernel/softmax.hpp"
#include "../kernel/tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The analysis options, checked and resolved against a problem.
struct AnalysisSpec {
  index_t needle_begin = 0, needle_end = 0;  // key span
  index_t query_begin = 0, query_end = 0;    // query rows measured
  int bits = 0;                              // 0: exact logits
};

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

/// The rows of one analysis task: process_block's steps 4 and 6 (see
/// FusedRows), each row measured between its scores and its weights, and its
/// output row measured as it is written. Adds the measured rows' sums to acc.
template <class T>
struct AnalysisRows {
  using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
  const AnalysisSpec& spec;
  double* acc;  // this task's slot of the partial sums (StatSlot)

  bool measured(index_t i, index_t n) const {
    return i >= spec.query_begin && i < spec.query_end && n > 0;
  }

  void weights(const AttentionProblem<T>& p, const SeqSpan& sq, index_t oh, const HeadMap&,
               index_t i, index_t kb, index_t n, T* w, T* w2) const {
    if (n == 0) return;
    const bool meas = measured(i, n);
    // The needle within the row's keys, relative to kb.
    const index_t nb = std::clamp(spec.needle_begin, kb, kb + n) - kb;
    const index_t ne = std::clamp(spec.needle_end, kb, kb + n) - kb;
    T* logits = meas ? analysis_row_buffer<T>().get(n) : nullptr;
    T* x_of[2] = {w, w2};
    T coef[2] = {T(0), T(0)};
    const int maps = w2 ? 2 : 1;
    for (int m = 0; m < maps; ++m) {
      T* x = x_of[m];
      ArrayMap xa(x, n);
      if (meas)
        acc[StatSlot::max_logit(m)] =
            std::max(acc[StatSlot::max_logit(m)], static_cast<double>(xa.abs().maxCoeff()));
      if (spec.bits > 0) quantise_row(x, n, spec.bits);
      if (meas) std::memcpy(logits, x, static_cast<std::size_t>(n) * sizeof(T));
      const RowStats<T> st = exp_row(x, n, false);
      const T inv = st.sum > T(0) ? T(1) / st.sum : T(0);
      // As FusedRows forms them, so that exact logits give the kernel's output bit for bit.
      coef[m] = st.sum > T(0) ? (m == 0 ? T(1) : row_lambda(p, sq.b, i, oh)) / st.sum : T(0);
      if (!meas) continue;
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
    ArrayMap wa(w, n);
    if (maps == 2)
      wa = wa * coef[0] - ArrayMap(w2, n) * coef[1];
    else
      wa *= coef[0];
    if (!meas) return;
    const double needle = ne > nb ? static_cast<double>(wa.segment(nb, ne - nb).sum()) : 0.0;
    const double needle_abs =
        ne > nb ? static_cast<double>(wa.segment(nb, ne - nb).abs().sum()) : 0.0;
    acc[StatSlot::needle] += needle;
    acc[StatSlot::context] += static_cast<double>(wa.sum()) - needle;
    acc[StatSlot::context_abs] += static_cast<double>(wa.abs().sum()) - needle_abs;
    acc[StatSlot::negative] += static_cast<double>(wa.min(T(0)).sum());
    acc[StatSlot::rows] += 1;
  }

  /// Output row i: its squares for the context RMS, and to the caller.
  void output(const AttentionProblem<T>& p, const SeqSpan& sq, index_t oh, index_t i, index_t n,
              const T* o) const {
    const index_t dv = p.value_dim;
    if (measured(i, n))
      acc[StatSlot::out_sq] += static_cast<double>(
          Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(o, dv).square().sum());
    if (!p.out.empty())
      std::memcpy(&p.out(sq.b, i, oh, 0), o, static_cast<std::size_t>(dv) * sizeof(T));
  }
};

/// The results of run_analysis_flat in one array of doubles (what crosses
/// diffattn::dispatch's seam: no standard-library type, whose layout a
/// program's flags may change): the measured row count, then per map (heads *
/// maps each) max |logit|, entropy and needle mass, then per head (heads
/// each) needle, context, |context| and negative mass and the context RMS.
struct AnalysisLayout {
  std::size_t hm, h;
  AnalysisLayout(index_t heads, int maps)
      : hm(static_cast<std::size_t>(heads) * static_cast<std::size_t>(maps)),
        h(static_cast<std::size_t>(heads)) {}
  std::size_t size() const { return 1 + 3 * hm + 5 * h; }
  static constexpr std::size_t rows = 0;
  std::size_t per_map(int which) const { return 1 + static_cast<std::size_t>(which) * hm; }
  std::size_t per_head(int which) const { return 1 + 3 * hm + static_cast<std::size_t>(which) * h; }
};

/// Runs the analysis of a checked problem into flat (AnalysisLayout(p.heads,
/// p.maps()).size() doubles).
template <class T>
void run_analysis_flat(const AttentionProblem<T>& p, const AnalysisSpec& spec,
                       const AttentionOptions& options, double* flat) {
  const int maps = p.maps();
  const AnalysisLayout lay(p.heads, maps);
  std::fill(flat, flat + lay.size(), 0.0);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  double* max_abs_logit = flat + lay.per_map(0);
  double* entropy = flat + lay.per_map(1);
  double* map_needle_mass = flat + lay.per_map(2);
  double *needle_mass = flat + lay.per_head(0), *context_mass = flat + lay.per_head(1),
         *context_abs_mass = flat + lay.per_head(2), *negative_mass = flat + lay.per_head(3),
         *context_rms = flat + lay.per_head(4);

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
    const AnalysisRows<T> rows_do{spec,
                                  partial.data() + static_cast<std::size_t>(t) * StatSlot::count};
    process_block<T, T, T>(p, bh / p.heads, bh % p.heads, blk, thread_workspace<T>(), call_id,
                           rows_do);
  };
  parallel_tasks(tasks, resolve_threads(options.num_threads, tasks), run_task, [] {
    thread_workspace<T>().trim();
    ScratchBuffer<T>& row = analysis_row_buffer<T>();
    if (row.bytes() > Workspace<T>::kRetainBytes) row.release();
  });

  // Reduce in task order: per head, over batch entries and blocks.
  std::vector<double> rows(lay.h, 0.0), out_sq(lay.h, 0.0);
  for (index_t t = 0; t < tasks; ++t) {
    const double* a = partial.data() + static_cast<std::size_t>(t) * StatSlot::count;
    const std::size_t oh = static_cast<std::size_t>((t / nblocks) % p.heads);
    for (int m = 0; m < maps; ++m) {
      const std::size_t k = oh * static_cast<std::size_t>(maps) + static_cast<std::size_t>(m);
      max_abs_logit[k] = std::max(max_abs_logit[k], a[StatSlot::max_logit(m)]);
      entropy[k] += a[StatSlot::entropy(m)];
      map_needle_mass[k] += a[StatSlot::map_needle(m)];
    }
    needle_mass[oh] += a[StatSlot::needle];
    context_mass[oh] += a[StatSlot::context];
    context_abs_mass[oh] += a[StatSlot::context_abs];
    negative_mass[oh] += a[StatSlot::negative];
    out_sq[oh] += a[StatSlot::out_sq];
    rows[oh] += a[StatSlot::rows];
  }
  flat[AnalysisLayout::rows] = rows[0];
  if (rows[0] == 0) return;
  const double r = rows[0];
  for (std::size_t k = 0; k < lay.hm; ++k) {
    entropy[k] /= r;
    map_needle_mass[k] /= r;
  }
  for (std::size_t k = 0; k < lay.h; ++k) {
    needle_mass[k] /= r;
    context_mass[k] /= r;
    context_abs_mass[k] /= r;
    negative_mass[k] /= r;
    context_rms[k] = std::sqrt(out_sq[k] / (r * static_cast<double>(p.value_dim)));
  }
}

/// Per-head results (the public AttentionStats) from run_analysis_flat's array.
template <class Stats>
Stats analysis_stats_from(const double* flat, index_t heads, int maps) {
  const AnalysisLayout lay(heads, maps);
  Stats st;
  st.heads = heads;
  st.maps = maps;
  st.rows = static_cast<index_t>(flat[AnalysisLayout::rows]);
  auto take = [&](std::vector<double>& v, std::size_t at, std::size_t n) {
    v.assign(flat + at, flat + at + n);
  };
  take(st.max_abs_logit, lay.per_map(0), lay.hm);
  take(st.entropy, lay.per_map(1), lay.hm);
  take(st.map_needle_mass, lay.per_map(2), lay.hm);
  take(st.needle_mass, lay.per_head(0), lay.h);
  take(st.context_mass, lay.per_head(1), lay.h);
  take(st.context_abs_mass, lay.per_head(2), lay.h);
  take(st.negative_mass, lay.per_head(3), lay.h);
  take(st.context_rms, lay.per_head(4), lay.h);
  return st;
}

/// Per-head results, filled by the analysis of a checked problem here, for
/// this unit's instruction set.
template <class Stats, class T>
Stats run_analysis(const AttentionProblem<T>& p, const AnalysisSpec& spec,
                   const AttentionOptions& options) {
  std::vector<double> flat(AnalysisLayout(p.heads, p.maps()).size());
  run_analysis_flat(p, spec, options, flat.data());
  return analysis_stats_from<Stats>(flat.data(), p.heads, p.maps());
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
