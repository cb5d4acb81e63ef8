// Run-time score modifiers (AttentionOptions::softcap, alibi_slopes, sinks)
// on one row of scores, shared by the fused forward, the decoding step and
// the backward.
//
// The kernels keep a block's score rows in memory between the products and
// the softmax, so the modifiers are applied there, row by row, in one pass over
// the row: no kernel is instantiated once per modifier, and a call without
// modifiers never reaches this code (the kernels test
// AttentionProblem::modified once per row, before the softmax).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../options.hpp"
#include "../core/validate.hpp"
#include "block_info.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Members of a user score functor (options.hpp, NoScoreMod), detected at
/// compile time: a member that is absent adds nothing to the kernels.
/// detected<void, Op, A...> is true when Op<A...> is well-formed.
template <class, template <class...> class Op, class... A>
struct detected : std::false_type {};
template <template <class...> class Op, class... A>
struct detected<std::void_t<Op<A...>>, Op, A...> : std::true_type {};

template <class Mod, class S>
using score_call = decltype(std::declval<const Mod&>().score(std::declval<S>(), index_t(),
                                                             index_t(), index_t(), index_t()));
template <class Mod, class S>
using dscore_call = decltype(std::declval<const Mod&>().dscore(std::declval<S>(), index_t(),
                                                               index_t(), index_t(), index_t()));
template <class Mod>
using visible_call = decltype(static_cast<bool>(
    std::declval<const Mod&>().visible(index_t(), index_t(), index_t(), index_t())));
template <class Mod>
using visible_block_call = decltype(static_cast<int>(std::declval<const Mod&>().visible_block(
    index_t(), index_t(), index_t(), index_t(), index_t(), index_t())));
template <class Mod>
using visible_range_call = decltype(std::pair<index_t, index_t>(
    std::declval<const Mod&>().visible_range(index_t(), index_t(), index_t())));

template <class Mod, class S>
using has_score = detected<void, score_call, Mod, S>;
template <class Mod>
using has_visible = detected<void, visible_call, Mod>;
template <class Mod, class S>
using has_dscore = detected<void, dscore_call, Mod, S>;
/// Optional with `visible`: visible_block(b, h, i0, i1, j0, j1) classifies the
/// pairs [i0, i1) x [j0, j1): 0 when none is visible, 2 when all are, 1 when
/// some are (or it cannot tell cheaply). FlexAttention's block mask, asked
/// for each block instead of stored.
template <class Mod>
using has_visible_block = detected<void, visible_block_call, Mod>;
/// Optional with `visible`: visible_range(b, h, i) returns the keys [lo, hi)
/// query i sees (std::pair<index_t, index_t>; lo >= hi: none), exactly those
/// for which visible(b, h, i, j) is true. The kernels then mask by the range,
/// one call per row, and never call `visible` (document masks, prefix-LM,
/// sliding windows: every mask whose rows see one run of keys).
template <class Mod>
using has_visible_range = detected<void, visible_range_call, Mod>;
/// Keys per chunk classified by visible_block.
constexpr index_t kVisibleChunk = 64;

/// True, or a compile error when the functor's members do not fit together
/// (visible_range without visible: the MPI ring, among others, calls visible).
template <class Mod>
constexpr bool mod_members_ok() {
  static_assert(!has_visible_range<Mod>::value || has_visible<Mod>::value,
                "a functor with `visible_range` must define `visible` as well (the same mask, "
                "pair by pair)");
  return true;
}

/// A functor the kernels must call (score or visible).
template <class Mod, class S>
constexpr bool is_active_mod = mod_members_ok<Mod>() &&
                               (has_score<Mod, S>::value || has_visible<Mod>::value);

/// The first and one past the last of the n keys kb .. kb + n - 1 that lie in
/// [lo, hi), as offsets from kb (first == last: none).
inline std::pair<index_t, index_t> range_in(index_t lo, index_t hi, index_t kb, index_t n) {
  const index_t a = lo <= kb ? 0 : std::min(n, lo - kb);
  const index_t e = hi <= kb ? 0 : std::min(n, hi - kb);
  return {a, std::max(a, e)};
}

/// The functor's score and mask on the n scores w of keys kb .. kb + n - 1 of
/// query i (batch entry b, query head h), after the run-time modifiers: a
/// masked pair becomes -inf. When `score_in` is given it receives the scores
/// the functor's score was given (the backward's dscore takes them).
/// Returns the offsets [first, second) outside which every score is masked:
/// the row's range under visible_range, else [0, n).
template <class Mod, class C>
std::pair<index_t, index_t> functor_scores(const Mod& mod, C* w, index_t n, index_t b, index_t h,
                                           index_t i, index_t kb, C* score_in = nullptr) {
  if constexpr (has_score<Mod, C>::value) {
    for (index_t t = 0; t < n; ++t) {
      if (score_in) score_in[t] = w[t];
      w[t] = mod.score(w[t], b, h, i, kb + t);
    }
  }
  if constexpr (has_visible<Mod>::value) {
    constexpr C ninf = -std::numeric_limits<C>::infinity();
    if constexpr (has_visible_range<Mod>::value) {
      // One call per row: the keys outside its range are masked.
      const std::pair<index_t, index_t> r = mod.visible_range(b, h, i);
      const std::pair<index_t, index_t> t = range_in(r.first, r.second, kb, n);
      std::fill(w, w + t.first, ninf);
      std::fill(w + t.second, w + n, ninf);
      return t;
    } else if constexpr (has_visible_block<Mod>::value) {
      // Chunks that visible_block calls all visible or none cost one call.
      for (index_t t0 = 0; t0 < n; t0 += kVisibleChunk) {
        const index_t t1 = std::min(n, t0 + kVisibleChunk);
        const int cls = mod.visible_block(b, h, i, i + 1, kb + t0, kb + t1);
        if (cls == 2) continue;
        for (index_t t = t0; t < t1; ++t)
          if (cls == 0 || !mod.visible(b, h, i, kb + t)) w[t] = ninf;
      }
    } else {
      for (index_t t = 0; t < n; ++t)
        if (!mod.visible(b, h, i, kb + t)) w[t] = ninf;
    }
  }
  (void)mod, (void)w, (void)n, (void)b, (void)h, (void)i, (void)kb, (void)score_in;
  return {0, n};
}

/// What a user functor is told about the rows of sequence sq: `b`, the batch
/// entry, or (packed batches) the sequence's index; `ioff`, added to a query's
/// row within the sequence to give the functor's i: 0, or (KV caches) m_b - n,
/// so that i is the query's position among the sequence's keys (the key index
/// of its own token when the cache holds it). j is always the key index within
/// the sequence.
struct ModCoords {
  index_t b = 0, ioff = 0;
};
template <class T, class KV>
ModCoords mod_coords(const AttentionProblem<T, KV>& p, const SeqSpan& sq) {
  ModCoords c{sq.b, 0};
  // A sequence with rows starts at cu_q[s] < cu_q[s + 1]: the last offset <= q0.
  if (p.cu_q)
    c.b = static_cast<index_t>(std::upper_bound(p.cu_q, p.cu_q + p.packed + 1, sq.q0) - p.cu_q) - 1;
  if (!p.cache_seqlens.empty()) c.ioff = sq.m - sq.n;
  return c;
}

/// The rows of a block narrowed to [lo, hi), the keys some row of the block
/// sees under the functor's `visible` (begin and end stay non-decreasing).
struct ClampedRows : BlockRows {
  index_t lo = 0, hi = 0;
  index_t begin(index_t ii) const { return std::max(BlockRows::begin(ii), lo); }
  index_t end(index_t ii) const { return std::min(BlockRows::end(ii), hi); }
  index_t count(index_t ii) const { return std::max<index_t>(0, end(ii) - begin(ii)); }
};

/// The per-call block classification of a `visible` functor: the keys the
/// block's rows see in the band [begin, end) are narrowed to the hull of the
/// pairs visible for some row and map, found from each end of the band by
/// evaluating visible key by key (or, when the functor has visible_block,
/// chunk by chunk of kVisibleChunk keys) until one is. Tiles outside the hull
/// (the other documents of a packed row, a prefix no row sees) are never
/// computed; inside it the softmax step masks the pairs (functor_scores:
/// every pair evaluated, or only those of the chunks visible_block calls
/// partial).
/// The functor sees the block's row ii as query br.i0 + ii + ioff (ModCoords).
template <class Mod>
ClampedRows clamp_rows(const Mod& mod, const BlockRows& br, index_t b, index_t ioff,
                       const index_t* qh, int maps) {
  ClampedRows cr;
  static_cast<BlockRows&>(cr) = br;
  const index_t jb = br.begin(0), je = std::max(jb, br.end(br.rows - 1));
  if constexpr (has_visible_block<Mod>::value) {
    // Chunks of kVisibleChunk keys, classified for the block's rows at once.
    const index_t i0 = br.i0 + ioff, i1 = br.i0 + br.rows + ioff;
    auto any = [&](index_t j0, index_t j1) {
      for (int m = 0; m < maps; ++m)
        if (mod.visible_block(b, qh[m], i0, i1, j0, j1) != 0) return true;
      return false;
    };
    cr.lo = cr.hi = jb;
    bool found = false;
    for (index_t j = jb; j < je && !found; j += kVisibleChunk)
      if (any(j, std::min(je, j + kVisibleChunk))) {
        cr.lo = j;
        found = true;
      }
    if (!found) return cr;
    for (index_t j = je; j > cr.lo; j -= std::min(kVisibleChunk, j - cr.lo))
      if (any(std::max(cr.lo, j - kVisibleChunk), j)) {
        cr.hi = j;
        break;
      }
    return cr;
  }
  auto seen = [&](index_t j) {
    for (index_t ii = 0; ii < br.rows; ++ii) {
      if (j < br.begin(ii) || j >= br.end(ii)) continue;
      for (int m = 0; m < maps; ++m)
        if (mod.visible(b, qh[m], br.i0 + ii + ioff, j)) return true;
    }
    return false;
  };
  cr.lo = cr.hi = jb;  // nothing visible: every row empty
  bool found = false;
  for (index_t j = jb; j < je && !found; ++j)
    if (seen(j)) {
      cr.lo = j;
      found = true;
    }
  if (!found) return cr;
  for (index_t j = je; j-- > cr.lo;)
    if (seen(j)) {
      cr.hi = j + 1;
      break;
    }
  return cr;
}

/// The rows of a block, each narrowed to the keys the functor's
/// visible_range gives it (its maps' ranges joined). Each row's [begin, end)
/// is widened just enough that begin and end stay non-decreasing, as the
/// kernels' tiles require: end the largest of the rows' ends up to this one,
/// begin the smallest of the rows' begins from this one on (a row inside a
/// wider neighbour's range is masked to its own by functor_scores).
struct RangedRows : BlockRows {
  static constexpr index_t kMaxRows = 64;  // >= TileConfig<C>::kBlockM
  index_t lo[kMaxRows], hi[kMaxRows];
  index_t begin(index_t ii) const { return lo[ii]; }
  index_t end(index_t ii) const { return hi[ii]; }
  index_t count(index_t ii) const { return std::max<index_t>(0, hi[ii] - lo[ii]); }
};
static_assert(TileConfig<float>::kBlockM <= RangedRows::kMaxRows &&
                  TileConfig<double>::kBlockM <= RangedRows::kMaxRows,
              "RangedRows holds a block's rows");

/// range_rows: clamp_rows for a functor with visible_range, one call per row
/// and map instead of a search of the band.
template <class Mod>
RangedRows range_rows(const Mod& mod, const BlockRows& br, index_t b, index_t ioff,
                      const index_t* qh, int maps) {
  RangedRows rr;
  static_cast<BlockRows&>(rr) = br;
  constexpr index_t kNone = std::numeric_limits<index_t>::max();
  index_t hull_lo = kNone, hull_hi = -kNone;
  bool seen[RangedRows::kMaxRows];
  for (index_t ii = 0; ii < br.rows; ++ii) {
    // The row's keys in its band, joined over the maps.
    index_t lo = kNone, hi = -kNone;
    const index_t kb = br.begin(ii), n = br.count(ii);
    for (int m = 0; m < maps; ++m) {
      const std::pair<index_t, index_t> r = mod.visible_range(b, qh[m], br.i0 + ii + ioff);
      const std::pair<index_t, index_t> t = range_in(r.first, r.second, kb, n);
      if (t.first == t.second) continue;
      lo = std::min(lo, kb + t.first);
      hi = std::max(hi, kb + t.second);
    }
    seen[ii] = lo < hi;
    rr.lo[ii] = lo;
    rr.hi[ii] = hi;
    hull_lo = std::min(hull_lo, lo);
    hull_hi = std::max(hull_hi, hi);
  }
  if (hull_lo >= hull_hi) {  // nothing visible: every row empty
    std::fill(rr.lo, rr.lo + br.rows, br.begin(0));
    std::fill(rr.hi, rr.hi + br.rows, br.begin(0));
    return rr;
  }
  for (index_t ii = br.rows, run = hull_hi; ii-- > 0;) {
    if (seen[ii]) run = std::min(run, rr.lo[ii]);
    rr.lo[ii] = run;
  }
  for (index_t ii = 0, run = hull_lo; ii < br.rows; ++ii) {
    if (seen[ii]) run = std::max(run, rr.hi[ii]);
    rr.hi[ii] = run;
  }
  return rr;
}

/// A block's rows as the kernels walk them: the band's, or (a functor with
/// `visible`) narrowed by clamp_rows (range_rows with visible_range) for the
/// maps of output head hm.
template <class Mod, class T, class KV>
auto visible_rows(const Mod& mod, const AttentionProblem<T, KV>& p, const SeqSpan& sq,
                  const BlockRows& br, const HeadMap& hm) {
  if constexpr (has_visible<Mod>::value) {
    const ModCoords mc = mod_coords(p, sq);
    if constexpr (has_visible_range<Mod>::value)
      return range_rows(mod, br, mc.b, mc.ioff, hm.q, p.maps());
    else
      return clamp_rows(mod, br, mc.b, mc.ioff, hm.q, p.maps());
  } else {
    (void)mod, (void)p, (void)sq, (void)hm;
    return br;
  }
}

/// The modifiers of one query head in the compute type C.
template <class C>
struct RowMods {
  C cap = C(0);                                  // softcap, 0: none
  C slope = C(0);                                // ALiBi slope, 0: none
  C sink = -std::numeric_limits<C>::infinity();  // sink logit
  bool has_sink = false;
};

template <class T, class KV>
RowMods<compute_t<T>> row_mods(const AttentionProblem<T, KV>& p, index_t qh) {
  using C = compute_t<T>;
  RowMods<C> r;
  r.cap = p.softcap;
  if (!p.alibi_slopes.empty()) r.slope = static_cast<C>(p.alibi_slopes(qh));
  if (!p.sinks.empty()) {
    r.sink = static_cast<C>(p.sinks(qh));
    r.has_sink = true;
  }
  return r;
}

/// Soft-capping then ALiBi on the n scores w of keys kb .. kb + n - 1 of a
/// query whose diagonal (i + M - N) is `diag`: w_t = cap tanh(w_t / cap) -
/// slope |diag - (kb + t)|. When `tanh_out` is given it receives
/// tanh(w_t / cap) (the backward's derivative 1 - tanh^2).
template <class C>
void modify_scores(C* w, index_t n, const RowMods<C>& rm, index_t diag, index_t kb,
                   C* tanh_out = nullptr) {
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  if (n <= 0) return;
  if (rm.cap > C(0)) {
    ArrayMap a(w, n);
    if (tanh_out) {
      ArrayMap t(tanh_out, n);
      t = (a / rm.cap).tanh();
      a = rm.cap * t;
    } else {
      a = rm.cap * (a / rm.cap).tanh();
    }
  }
  if (rm.slope != C(0)) {
    const index_t c = diag - kb;
    for (index_t t = 0; t < n; ++t) w[t] -= rm.slope * static_cast<C>(std::abs(c - t));
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
