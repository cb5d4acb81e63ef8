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

/// Dot products of one key row k (stored as S, widened once per packet)
/// with R query rows q + i qstep: out[i ostep] = q_i . k for i < R. R is a
/// constant so that the accumulators stay in registers.
template <int R, class C, class S>
EIGEN_ALWAYS_INLINE void dot_rows_n(const S* k, index_t d, const C* q, index_t qstep, C* out,
                                    index_t ostep) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::predux;
  using Eigen::internal::pset1;
  constexpr index_t P = TileConfig<C>::kPacket;
  Packet acc[R];
  for (int i = 0; i < R; ++i) acc[i] = pset1<Packet>(C(0));
  index_t t = 0;
  for (; t + P <= d; t += P) {
    const Packet kp = pload_widened<Packet>(k + t);
    for (int i = 0; i < R; ++i) acc[i] = pmadd(ploadu<Packet>(q + i * qstep + t), kp, acc[i]);
  }
  for (int i = 0; i < R; ++i) {
    C sum = predux(acc[i]);
    for (index_t u = t; u < d; ++u) sum += q[i * qstep + u] * static_cast<C>(k[u]);
    out[i * ostep] = sum;
  }
}

/// dot_rows_n over `rows` query rows, four at a time. The narrow-cache path
/// of decode_states.
template <class C, class S>
EIGEN_ALWAYS_INLINE void dot_rows(const S* k, index_t d, const C* q, index_t qstep, C* out,
                                  index_t ostep, index_t rows) {
  index_t i = 0;
  for (; i + 4 <= rows; i += 4) dot_rows_n<4>(k, d, q + i * qstep, qstep, out + i * ostep, ostep);
  switch (rows - i) {
    case 1:
      return dot_rows_n<1>(k, d, q + i * qstep, qstep, out + i * ostep, ostep);
    case 2:
      return dot_rows_n<2>(k, d, q + i * qstep, qstep, out + i * ostep, ostep);
    case 3:
      return dot_rows_n<3>(k, d, q + i * qstep, qstep, out + i * ostep, ostep);
    default:
      return;
  }
}

/// Scores of one query row q against P consecutive keys (P the packet
/// size), key jj at krows[jj] (stored as S, widened once per packet):
/// out[jj] = q . k_jj. One accumulator per key, reduced by one transpose
/// (ptranspose) instead of P horizontal sums.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // PacketBlock of a vector type
#endif
template <class C, class S>
EIGEN_ALWAYS_INLINE void dot_keys(const C* q, const S* const* krows, index_t d, C* out) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = TileConfig<C>::kPacket;
  Eigen::internal::PacketBlock<Packet, P> acc;
  for (int jj = 0; jj < P; ++jj) acc.packet[jj] = pset1<Packet>(C(0));
  index_t t = 0;
  for (; t + P <= d; t += P) {
    const Packet qp = ploadu<Packet>(q + t);
    for (int jj = 0; jj < P; ++jj)
      acc.packet[jj] = pmadd(pload_widened<Packet>(krows[jj] + t), qp, acc.packet[jj]);
  }
  Eigen::internal::ptranspose(acc);
  Packet sum = acc.packet[0];
  for (int jj = 1; jj < P; ++jj) sum = padd(sum, acc.packet[jj]);
  pstoreu(out, sum);
  for (; t < d; ++t)
    for (int jj = 0; jj < P; ++jj) out[jj] += q[t] * static_cast<C>(krows[jj][t]);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// o + i ostep += sum_jj w[i wstep + jj] v_jj over P consecutive keys (P the
/// packet size) for i < R, value jj at vrows[jj] (stored as S): the output
/// rows are loaded and stored once per block of keys, not once per key.
template <int R, class C, class S>
EIGEN_ALWAYS_INLINE void axpy_keys_n(const S* const* vrows, index_t dv, C* o, index_t ostep,
                                     const C* w, index_t wstep) {
  using Packet = typename TileConfig<C>::Packet;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = TileConfig<C>::kPacket;
  index_t t = 0;
  for (; t + P <= dv; t += P) {
    Packet acc[R];
    for (int i = 0; i < R; ++i) acc[i] = ploadu<Packet>(o + i * ostep + t);
    for (int jj = 0; jj < P; ++jj) {
      const Packet vp = pload_widened<Packet>(vrows[jj] + t);
      for (int i = 0; i < R; ++i) acc[i] = pmadd(pset1<Packet>(w[i * wstep + jj]), vp, acc[i]);
    }
    for (int i = 0; i < R; ++i) pstoreu(o + i * ostep + t, acc[i]);
  }
  for (; t < dv; ++t)
    for (int i = 0; i < R; ++i)
      for (int jj = 0; jj < P; ++jj)
        o[i * ostep + t] += w[i * wstep + jj] * static_cast<C>(vrows[jj][t]);
}

/// axpy_keys_n over `rows` rows, four at a time.
template <class C, class S>
EIGEN_ALWAYS_INLINE void axpy_keys(const S* const* vrows, index_t dv, C* o, index_t ostep,
                                   const C* w, index_t wstep, index_t rows) {
  index_t i = 0;
  for (; i + 4 <= rows; i += 4)
    axpy_keys_n<4>(vrows, dv, o + i * ostep, ostep, w + i * wstep, wstep);
  switch (rows - i) {
    case 1:
      return axpy_keys_n<1>(vrows, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 2:
      return axpy_keys_n<2>(vrows, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 3:
      return axpy_keys_n<3>(vrows, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    default:
      return;
  }
}

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

/// States of every query row of sequence sq over the keys [lo, hi): o (rows,
/// dv) normalised over the keys each row sees there, lse (rows); -inf and
/// zeros for a row that sees none of them. Key by key, every kv group's heads
/// of that key: a cache laid out (.., M, H, D) is read front to back.
///
/// Storage: q holds T, the cache KV; the work is in C = compute_t<T>. A row
/// stored narrower than C (a 16-bit cache) is widened packet by packet as it
/// is read, for up to four query rows of its group at once (dot_rows,
/// axpy_rows): with half the bytes to read, the step would otherwise be
/// bound by the per-row work rather than by memory.
template <class T, class KV, class C>
void decode_states(const AttentionProblem<T, KV>& p, const SeqSpan& sq, const DecodeLanes& dl,
                   index_t lo, index_t hi, Workspace<C>& ws, C* o, C* lse) {
  using RowMap = Eigen::Map<const Eigen::Matrix<C, 1, Eigen::Dynamic>>;
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  using ConstArrayMap = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>;
  const index_t n = dl.n, d = p.head_dim, dv = p.value_dim, R = dl.rows();
  const BlockRows br{p.band, sq.n, sq.m, 0, n};
  // Keys of this chunk that query ii sees: [rb[ii], re[ii]) (at most kMR queries).
  index_t rb[TileConfig<C>::kMR], re[TileConfig<C>::kMR];
  for (index_t ii = 0; ii < n; ++ii) {
    rb[ii] = std::max(lo, br.begin(ii));
    re[ii] = std::max(rb[ii], std::min(hi, br.end(ii)));
  }
  const index_t jlo = rb[0], jhi = std::max(jlo, re[n - 1]);
  const index_t lds = std::max<index_t>(jhi - jlo, 1);
  const index_t ksh = p.k.stride(2), vsh = p.v.stride(2);  // head strides of the caches
  const int kh = dl.key_heads;

  // Scaled queries (R, d).
  C* qs = ws.q[0].get(R * d);
  C* rowbuf = ws.row.get(std::max(d, dv));  // row_as: unused when KV is C
  for (index_t l = 0; l < dl.lanes; ++l) {
    const index_t qh = head_map(p, l / dl.maps).q[l % dl.maps];
    for (index_t ii = 0; ii < n; ++ii) {
      const T* src = &p.q(sq.b, sq.q0 + ii, qh, 0);
      C* dst = qs + (l * n + ii) * d;
      const C* row = row_as<C>(src, d, dst);
      for (index_t t = 0; t < d; ++t) dst[t] = p.scale * row[t];
    }
  }

  // Scores (R, lds): each key row once, against every query row that reads it.
  C* s = ws.s[0].get(R * lds);
  constexpr bool narrow = !std::is_same<KV, C>::value;
  // Narrow caches: the query rows of (group g, slot) that see key j as query
  // ii are r = (g per_group + slot + m kh) n + ii, m < per_group / kh: evenly
  // spaced, so they go to dot_rows as a base and a step.
  const index_t lanes_per_slot = dl.per_group / kh;
  // Blocks of P keys that every query row sees go through dot_keys (float
  // compute only); the rest key by key through dot_rows.
  constexpr index_t P = TileConfig<C>::kPacket;
  constexpr bool by_block = narrow && std::is_same<C, float>::value && P > 1;
  const index_t blo = by_block ? std::min(rb[n - 1], re[0]) : jlo;
  const index_t bhi = by_block ? std::max(blo, re[0]) : jlo;  // [blo, bhi): seen by all rows
  const index_t bend = blo + (bhi - blo) / P * P;
  const KV* kblock[TileConfig<C>::kPacket];  // rows of a block of keys (later values)
  for (index_t j0 = blo; j0 < bend && by_block; j0 += P) {
    for (index_t jj = 0; jj < P; ++jj) kblock[jj] = p.key_row(sq, j0 + jj, 0);
    // The next block's rows: a block reads P rows head by head, a pattern the
    // hardware prefetcher follows less well than one row after another.
    for (index_t jj = 0; jj < P && j0 + P + jj < bend; ++jj)
      prefetch_row(p.key_row(sq, j0 + P + jj, 0), dl.groups * kh * ksh);
    for (index_t g = 0; g < dl.groups; ++g)
      for (int slot = 0; slot < kh; ++slot) {
        const KV* kg[TileConfig<C>::kPacket];
        for (index_t jj = 0; jj < P; ++jj) kg[jj] = kblock[jj] + (g * kh + slot) * ksh;
        for (index_t l = g * dl.per_group + slot; l < (g + 1) * dl.per_group; l += kh)
          for (index_t ii = 0; ii < n; ++ii) {
            const index_t r = l * n + ii;
            dot_keys(qs + r * d, kg, d, s + r * lds + (j0 - jlo));
          }
      }
  }
  for (index_t j = jlo; j < jhi && narrow; ++j) {
    if (j == blo && bend > blo) j = bend;  // done by blocks
    if (j >= jhi) break;
    const KV* k0 = p.key_row(sq, j, 0);
    for (index_t g = 0; g < dl.groups; ++g)
      for (int slot = 0; slot < kh; ++slot) {
        const KV* krow = k0 + (g * kh + slot) * ksh;
        for (index_t ii = 0; ii < n; ++ii) {
          if (j < rb[ii] || j >= re[ii]) continue;
          const index_t r0 = (g * dl.per_group + slot) * n + ii, rstep = kh * n;
          dot_rows(krow, d, qs + r0 * d, rstep * d, s + r0 * lds + (j - jlo), rstep * lds,
                   lanes_per_slot);
        }
      }
  }
  for (index_t j = jlo; j < jhi && !narrow; ++j) {
    const KV* k0 = p.key_row(sq, j, 0);
    for (index_t g = 0; g < dl.groups; ++g)
      for (int slot = 0; slot < kh; ++slot) {
        const RowMap krow(row_as<C>(k0 + (g * kh + slot) * ksh, d, rowbuf), d);
        for (index_t l = g * dl.per_group + slot; l < (g + 1) * dl.per_group; l += kh)
          for (index_t ii = 0; ii < n; ++ii)
            if (j >= rb[ii] && j < re[ii]) {
              const index_t r = l * n + ii;
              s[r * lds + (j - jlo)] = RowMap(qs + r * d, d).dot(krow);
            }
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

  // o = W V, each value row once.
  std::fill(o, o + R * dv, C(0));
  for (index_t j0 = blo; j0 < bend && by_block; j0 += P) {  // the blocks of the scores
    for (index_t jj = 0; jj < P; ++jj) kblock[jj] = p.value_row(sq, j0 + jj, 0);
    for (index_t jj = 0; jj < P && j0 + P + jj < bend; ++jj)
      prefetch_row(p.value_row(sq, j0 + P + jj, 0), dl.groups * vsh);
    for (index_t g = 0; g < dl.groups; ++g) {
      const KV* vg[TileConfig<C>::kPacket];
      for (index_t jj = 0; jj < P; ++jj) vg[jj] = kblock[jj] + g * vsh;
      for (index_t ii = 0; ii < n; ++ii) {
        const index_t r0 = g * dl.per_group * n + ii;  // rows r0 + m n, m < per_group
        axpy_keys(vg, dv, o + r0 * dv, n * dv, s + r0 * lds + (j0 - jlo), n * lds, dl.per_group);
      }
    }
  }
  for (index_t j = jlo; j < jhi && narrow; ++j) {
    if (j == blo && bend > blo) j = bend;  // done by blocks
    if (j >= jhi) break;
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
  for (index_t j = jlo; j < jhi && !narrow; ++j) {
    const KV* v0 = p.value_row(sq, j, 0);
    for (index_t g = 0; g < dl.groups; ++g) {
      const ConstArrayMap vrow(row_as<C>(v0 + g * vsh, dv, rowbuf), dv);
      for (index_t r = g * dl.per_group * n; r < (g + 1) * dl.per_group * n; ++r) {
        const index_t ii = r % n;
        if (j >= rb[ii] && j < re[ii]) ArrayMap(o + r * dv, dv) += s[r * lds + (j - jlo)] * vrow;
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
