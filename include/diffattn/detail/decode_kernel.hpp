// Decoding steps: a few new queries (fewer than kMR) of one sequence against
// its cached keys, for plain, V1 and V2 attention.
//
// One task = one sequence, one chunk of its visible keys. Every query row goes
// through one pass over the chunk's K and V rows, each key row holding every
// kv group's heads: plain GQA's Hq / Hkv heads per kv head, V2's pairs of the
// group (both maps on the one kv head), V1's DIFF heads of the group (map 1 on
// key head 2g, map 2 on 2g + 1). Each K and V row is thus read once per step,
// in place (rows come through the problem's row source: contiguous,
// per-sequence lengths or paged), front to back in the usual (.., M, H, D)
// layout, since packing would cost more than the memory-bound products.
// Parallelism comes from the batch and from the chunks (kSplitKeys keys).
//
// A task leaves a softmax state per map and row (o normalised over the chunk,
// lse), never W = A1 - lambda A2: the states of a sequence's chunks merge in
// chunk order (merge_row) and lambda is subtracted after the last merge. The
// chunks follow from the problem alone (split_keys and the band), so results
// are bitwise identical for any thread count.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "../config.hpp"
#include "../states.hpp"
#include "block_info.hpp"
#include "convert.hpp"
#include "gemm.hpp"
#include "softmax.hpp"
#include "validate.hpp"
#include "workspace.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// The query rows of a decoding step: every query head of the problem. Lane l
/// is map l % maps of output head l / maps; row r = l * n + ii is query ii of
/// lane l. The lanes of kv group g are [g per_group, (g + 1) per_group); they
/// read key head g (V1: 2g for map 1, 2g + 1 for map 2) and value head g.
struct DecodeLanes {
  index_t lanes;      // heads * maps
  index_t per_group;  // lanes per kv group: group * maps
  index_t groups;     // kv groups (Hkv)
  int maps;           // 1 (plain) or 2
  int key_heads;      // key heads per kv group: 1, or 2 for V1 (one per map)
  index_t n;          // queries per lane
  index_t rows() const { return lanes * n; }
};

template <class T, class KV>
DecodeLanes decode_lanes(const AttentionProblem<T, KV>& p, index_t n) {
  DecodeLanes dl{};
  dl.maps = p.maps();
  dl.lanes = p.heads * dl.maps;
  dl.per_group = p.group * dl.maps;
  dl.groups = p.heads / p.group;
  dl.key_heads = p.kind == AttnKind::v1 ? 2 : 1;
  dl.n = n;
  return dl;
}

/// The keys a decoding step of sequence sq sees, [kb, ke), and its chunks.
struct DecodeChunks {
  index_t kb, ke, size, count;
  index_t begin(index_t c) const { return kb + c * size; }
  index_t end(index_t c) const { return std::min(ke, kb + (c + 1) * size); }
};

template <class T, class KV>
DecodeChunks decode_chunks(const AttentionProblem<T, KV>& p, const SeqSpan& sq) {
  const index_t kb = p.band.begin(0, sq.n, sq.m);
  const index_t ke = std::max(kb, p.band.end(sq.n - 1, sq.n, sq.m));
  const index_t keys = ke - kb;
  if (p.split_keys <= 0 || keys <= p.split_keys) return {kb, ke, std::max<index_t>(keys, 1), 1};
  return {kb, ke, p.split_keys, (keys + p.split_keys - 1) / p.split_keys};
}

/// Partial dot products of one key row k (stored as S, widened once per
/// packet) with R query rows q + i qstep over the first dp features (dp a
/// multiple of the packet size P): the packet whose lanes sum to q_i . k,
/// stored unreduced at part + i pstep. reduce_keys sums the lanes of P keys'
/// packets at once, so no (row, key) pair pays for a horizontal sum. R is a
/// constant so that the accumulators stay in registers.
template <int R, class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots_n(const S* k, index_t dp, const C* q, index_t qstep,
                                        C* part, index_t pstep) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr index_t P = TileConfig<C>::kPacket;
  Packet acc[R];
  for (int i = 0; i < R; ++i) acc[i] = pset1<Packet>(C(0));
  for (index_t t = 0; t < dp; t += P) {
    const Packet kp = pload_widened<Packet>(k + t);
    for (int i = 0; i < R; ++i) acc[i] = pmadd(ploadu<Packet>(q + i * qstep + t), kp, acc[i]);
  }
  for (int i = 0; i < R; ++i) pstoreu(part + i * pstep, acc[i]);
}

/// partial_dots_n over `rows` query rows, four at a time.
template <class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots(const S* k, index_t dp, const C* q, index_t qstep, C* part,
                                      index_t pstep, index_t rows) {
  index_t i = 0;
  for (; i + 4 <= rows; i += 4)
    partial_dots_n<4>(k, dp, q + i * qstep, qstep, part + i * pstep, pstep);
  switch (rows - i) {
    case 1:
      return partial_dots_n<1>(k, dp, q + i * qstep, qstep, part + i * pstep, pstep);
    case 2:
      return partial_dots_n<2>(k, dp, q + i * qstep, qstep, part + i * pstep, pstep);
    case 3:
      return partial_dots_n<3>(k, dp, q + i * qstep, qstep, part + i * pstep, pstep);
    default:
      return;
  }
}

/// out[jj] = the sum of the lanes of the packet at part + jj P, for the P
/// keys jj < P of a block: one transpose (ptranspose) and P - 1 additions
/// for P scores, instead of P horizontal sums.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // PacketBlock of a vector type
#endif
template <class C>
EIGEN_ALWAYS_INLINE void reduce_keys(const C* part, C* out) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pstoreu;
  constexpr int P = TileConfig<C>::kPacket;
  if constexpr (P == 1) {
    out[0] = part[0];
  } else {
    Eigen::internal::PacketBlock<Packet, P> b;
    for (int jj = 0; jj < P; ++jj) b.packet[jj] = ploadu<Packet>(part + jj * P);
    Eigen::internal::ptranspose(b);
    Packet sum = b.packet[0];
    for (int jj = 1; jj < P; ++jj) sum = padd(sum, b.packet[jj]);
    pstoreu(out, sum);
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// o + i ostep += w[i wstep] v for i < R, v (stored as S) loaded and widened
/// once per packet for every row.
template <int R, class C, class S>
EIGEN_ALWAYS_INLINE void axpy_rows_n(const S* v, index_t dv, C* o, index_t ostep, const C* w,
                                     index_t wstep) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr index_t P = TileConfig<C>::kPacket;
  Packet wp[R];
  for (int i = 0; i < R; ++i) wp[i] = pset1<Packet>(w[i * wstep]);
  index_t t = 0;
  for (; t + P <= dv; t += P) {
    const Packet vp = pload_widened<Packet>(v + t);
    for (int i = 0; i < R; ++i) {
      C* oi = o + i * ostep + t;
      pstoreu(oi, pmadd(wp[i], vp, ploadu<Packet>(oi)));
    }
  }
  for (int i = 0; i < R; ++i)
    for (index_t u = t; u < dv; ++u) o[i * ostep + u] += w[i * wstep] * static_cast<C>(v[u]);
}

/// axpy_rows_n over `rows` rows, four at a time.
template <class C, class S>
EIGEN_ALWAYS_INLINE void axpy_rows(const S* v, index_t dv, C* o, index_t ostep, const C* w,
                                   index_t wstep, index_t rows) {
  index_t i = 0;
  for (; i + 4 <= rows; i += 4) axpy_rows_n<4>(v, dv, o + i * ostep, ostep, w + i * wstep, wstep);
  switch (rows - i) {
    case 1:
      return axpy_rows_n<1>(v, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 2:
      return axpy_rows_n<2>(v, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 3:
      return axpy_rows_n<3>(v, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    default:
      return;
  }
}

/// How far ahead of the row being read a decoding step asks for the cache's
/// rows, into L2 (a prefetch with locality 1), when two or more query rows
/// read each head. The hardware prefetcher alone then keeps too few lines in
/// flight: on Zen 4, 2 threads, M = 32k, V2 took 1.31x the time of GQA with
/// one row per head without it, 1.11-1.18x with it. With one row per head
/// the prefetch measured slower (V1's keys, GQA 8q/8kv), as did nearer
/// distances (8-64 KiB) and prefetching into L1.
constexpr index_t kDecodeAheadBytes = index_t(128) << 10;

/// States of every query row of sequence sq over the keys [lo, hi): o (rows,
/// dv) normalised over the keys each row sees there, lse (rows); -inf and
/// zeros for a row that sees none of them.
///
/// The step reads each K and V row once and is bound by memory, so its
/// shape follows the memory: key after key, every kv group's heads of that
/// key, so that a cache laid out (.., M, H, D) is read front to back as one
/// stream (reading a block of keys head by head instead defeats the
/// hardware prefetcher: measured 20-25% slower). The work per (row, key) pair
/// is kept to its FMAs: a score is a packet of partial sums (partial_dots,
/// the key widened once for up to four rows) whose lanes are summed P keys at
/// a time (reduce_keys); a value row is widened once and added to up to four
/// output rows (axpy_rows).
///
/// Storage: q holds T, the cache KV; the work is in C = compute_t<T>.
template <class T, class KV, class C>
void decode_states(const AttentionProblem<T, KV>& p, const SeqSpan& sq, const DecodeLanes& dl,
                   index_t lo, index_t hi, Workspace<C>& ws, C* o, C* lse) {
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  constexpr index_t P = TileConfig<C>::kPacket;
  const index_t n = dl.n, d = p.head_dim, dv = p.value_dim, R = dl.rows();
  const index_t dp = d / P * P;  // features in whole packets; the rest [dp, d) one by one
  const BlockRows br{p.band, sq.n, sq.m, 0, n};
  // Keys of this chunk that query ii sees: [rb[ii], re[ii]) (at most kMR queries).
  index_t rb[TileConfig<C>::kMR], re[TileConfig<C>::kMR];
  for (index_t ii = 0; ii < n; ++ii) {
    rb[ii] = std::max(lo, br.begin(ii));
    re[ii] = std::max(rb[ii], std::min(hi, br.end(ii)));
  }
  const index_t jlo = rb[0], jhi = std::max(jlo, re[n - 1]);
  const index_t lds = round_up(std::max<index_t>(jhi - jlo, 1), P);
  const index_t ksh = p.k.stride(2), vsh = p.v.stride(2);  // head strides of the caches
  const int kh = dl.key_heads;

  // Scaled queries (R, d).
  C* qs = ws.q[0].get(R * d);
  for (index_t l = 0; l < dl.lanes; ++l) {
    const index_t qh = head_map(p, l / dl.maps).q[l % dl.maps];
    for (index_t ii = 0; ii < n; ++ii) {
      const T* src = &p.q(sq.b, sq.q0 + ii, qh, 0);
      C* dst = qs + (l * n + ii) * d;
      const C* row = row_as<C>(src, d, dst);
      for (index_t t = 0; t < d; ++t) dst[t] = p.scale * row[t];
    }
  }

  // Scores (R, lds) of every row against every key of [jlo, jhi) (a row's
  // keys outside its own range are computed and never used). Row r of
  // (group g, key slot) and query ii is r = (g per_group + slot + m kh) n + ii
  // for m < per_group / kh: evenly spaced, so each query's rows of a key head
  // go to partial_dots as a base and a step. part holds P packets per row,
  // tails the features [dp, d) of P keys per row.
  C* s = ws.s[0].get(R * lds);
  C* part = ws.s[1].get(R * P * P);
  C* tails = dp < d ? ws.q[1].get(R * P) : nullptr;
  const index_t lanes_per_slot = dl.per_group / kh, rstep = kh * n;
  const index_t row_bytes = dl.groups * kh * d * static_cast<index_t>(sizeof(KV));
  const index_t kahead = std::max<index_t>(4, kDecodeAheadBytes / row_bytes);
  const bool kpre = lanes_per_slot * n >= 2;
  for (index_t j0 = jlo; j0 < jhi; j0 += P) {
    const index_t jn = std::min<index_t>(P, jhi - j0);
    for (index_t jj = 0; jj < jn; ++jj) {
      const index_t j = j0 + jj;
      if (kpre && j + kahead < jhi) {
        const KV* ahead = p.key_row(sq, j + kahead, 0);
        for (index_t h = 0; h < dl.groups * kh; ++h) prefetch_row<1>(ahead + h * ksh, d);
      }
      const KV* k0 = p.key_row(sq, j, 0);
      for (index_t g = 0; g < dl.groups; ++g)
        for (int slot = 0; slot < kh; ++slot) {
          const KV* krow = k0 + (g * kh + slot) * ksh;
          for (index_t ii = 0; ii < n; ++ii) {
            const index_t r0 = (g * dl.per_group + slot) * n + ii;
            partial_dots(krow, dp, qs + r0 * d, rstep * d, part + r0 * P * P + jj * P,
                         rstep * P * P, lanes_per_slot);
            for (index_t m = 0; tails && m < lanes_per_slot; ++m) {
              const C* qr = qs + (r0 + m * rstep) * d;
              C sum = 0;
              for (index_t t = dp; t < d; ++t) sum += qr[t] * static_cast<C>(krow[t]);
              tails[(r0 + m * rstep) * P + jj] = sum;
            }
          }
        }
    }
    for (index_t r = 0; r < R; ++r) {
      C* sr = s + r * lds + (j0 - jlo);
      if (jn < P) std::fill(part + r * P * P + jn * P, part + (r + 1) * P * P, C(0));
      reduce_keys(part + r * P * P, sr);
      for (index_t jj = 0; tails && jj < jn; ++jj) sr[jj] += tails[r * P + jj];
    }
  }

  // Exact softmax per row over its keys of the chunk, normalised in place.
  for (index_t r = 0; r < R; ++r) {
    const index_t ii = r % n, cnt = re[ii] - rb[ii];
    C* w = s + r * lds + (rb[ii] - jlo);
    const RowStats<C> st = exp_row(w, cnt, false);
    lse[r] = cnt > 0 ? row_lse(st) : -std::numeric_limits<C>::infinity();
    const C c = st.sum > C(0) ? C(1) / st.sum : C(0);
    ArrayMap(w, cnt) *= c;
  }

  // o = W V, value row after value row; a row's keys outside its range are
  // skipped (never multiplied by a zero weight, which would turn a NaN value
  // it does not see into a NaN output).
  std::fill(o, o + R * dv, C(0));
  const index_t vahead =
      std::max<index_t>(4, kDecodeAheadBytes / (dl.groups * dv * static_cast<index_t>(sizeof(KV))));
  const bool vpre = dl.per_group * n >= 2;
  for (index_t j = jlo; j < jhi; ++j) {
    if (vpre && j + vahead < jhi) {
      const KV* ahead = p.value_row(sq, j + vahead, 0);
      for (index_t g = 0; g < dl.groups; ++g) prefetch_row<1>(ahead + g * vsh, dv);
    }
    const KV* v0 = p.value_row(sq, j, 0);
    for (index_t g = 0; g < dl.groups; ++g) {
      const KV* vrow = v0 + g * vsh;
      for (index_t ii = 0; ii < n; ++ii) {
        if (j < rb[ii] || j >= re[ii]) continue;
        const index_t r0 = g * dl.per_group * n + ii;  // rows r0 + m n, m < per_group
        axpy_rows(vrow, dv, o + r0 * dv, n * dv, s + r0 * lds + (j - jlo), n * lds, dl.per_group);
      }
    }
  }
}

/// Final output from the merged states: out = o_1 - lambda o_2 per DIFF head
/// (o for plain), and each map's lse. Rows stored narrower than C are formed
/// in ws.row and rounded once as they are written.
template <class T, class KV, class C>
void decode_finish(const AttentionProblem<T, KV>& p, const SeqSpan& sq, const DecodeLanes& dl,
                   const C* o, const C* lse, Workspace<C>& ws) {
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  using ConstArrayMap = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>;
  const index_t n = dl.n, dv = p.value_dim;
  constexpr bool same = std::is_same<T, C>::value;
  C* tmp = same ? nullptr : ws.row.get(dv);
  for (index_t oh = 0; oh < p.heads; ++oh) {
    const HeadMap hm = head_map(p, oh);
    for (index_t ii = 0; ii < n; ++ii) {
      const index_t i = sq.q0 + ii, r1 = oh * dl.maps * n + ii;
      if (p.has_lse()) p.lse(sq.b, hm.q[0], i) = lse[r1];
      T* out_row = &p.out(sq.b, i, oh, 0);
      C* dst_row = tmp;
      if constexpr (same) dst_row = out_row;
      ArrayMap dst(dst_row, dv);
      const ConstArrayMap o1(o + r1 * dv, dv);
      if (dl.maps == 2) {
        const index_t r2 = r1 + n;
        if (p.has_lse()) p.lse(sq.b, hm.q[1], i) = lse[r2];
        dst = o1 - row_lambda(p, sq.b, i, oh) * ConstArrayMap(o + r2 * dv, dv);
      } else {
        dst = o1;
      }
      if constexpr (!same) convert_row(tmp, dv, out_row);
    }
  }
}

/// Merges the states of chunks 1 .. count - 1 into chunk 0's, in chunk order.
/// A chunk's state is (rows, dv) outputs then (rows) lse, `stride` values apart.
template <class T>
void merge_chunk_states(T* states, index_t count, index_t stride, index_t rows, index_t dv) {
  T* o0 = states;
  T* l0 = states + rows * dv;
  for (index_t c = 1; c < count; ++c) {
    const T* oc = states + c * stride;
    const T* lc = oc + rows * dv;
    for (index_t r = 0; r < rows; ++r)
      l0[r] = merge_row(o0 + r * dv, l0[r], oc + r * dv, lc[r], dv);
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
