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
// layout in blocks of a packet's worth of keys, since packing would cost more
// than the memory-bound products.
// Parallelism comes from the batch and from the chunks (kSplitKeys keys).
//
// A task leaves a softmax state per map and row (o normalised over the chunk,
// lse), never W = A1 - lambda A2: the states of a sequence's chunks merge in
// chunk order (merge_row) and lambda is subtracted after the last merge. The
// chunks follow from the problem alone (split_keys and the band), so results
// are bitwise identical for any thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../states.hpp"
#include "../core/validate.hpp"
#include "../core/workspace.hpp"
#include "../kernel/block_info.hpp"
#include "../kernel/convert.hpp"
#include "../kernel/gemm.hpp"
#include "../kernel/score_mods.hpp"
#include "../kernel/softmax.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Whether the decoding step's prefetches ahead of its reads take the
/// non-temporal hint (prefetchnta, on AMD processors) or T1 (prefetcht1, into
/// L2, elsewhere), read once at start-up from the CPU's vendor.
///
/// The step reads each K and V row once, and its rows are strided (see
/// kDecodeAheadBytes), so it asks for them itself. On Zen 5 the non-temporal
/// hint made V2 and the GQA steps 1.07-1.12x as fast as T0 (T1 did worse).
/// On an Intel Xeon of the Sapphire Rapids class (Emerald Rapids, 2 cores,
/// M = 32k, bench/ab) it made them 2.3-2.5x slower than T1: there
/// prefetchnta's lines bypass L2, and the step read 0.34-0.50 of the read
/// probe with it against 0.85-0.90 with T1 (T0 and T2 read about as T1, no
/// prefetch 0.7). Only where the step prefetches: a wrong guess costs speed,
/// never a result.
inline const bool kDecodePrefetchNta = [] {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
#else
  return true;
#endif
}();

/// prefetch_row with the decoding step's hint (kDecodePrefetchNta).
template <class T>
EIGEN_ALWAYS_INLINE void prefetch_decode(const T* p, index_t width) {
  if (kDecodePrefetchNta)
    prefetch_row<0>(p, width);
  else
    prefetch_row<2>(p, width);
}


/// p, computed into a register of its own (AVX-512 builds), so that the loads
/// and prefetches of a head address it with constant displacements. Without
/// it GCC 12 kept one offset per cache line of the heads read together, ran
/// out of general registers and moved the offsets in and out of vector
/// registers for every key (partial_dots_gn<2, 2, 4>: 7 vmovq and a stack
/// reload among 52 instructions per key, 46 now). On Zen 5, both builds in
/// one process and each in turn second: V2 and GQA 16 q 1.04-1.06x as fast
/// with the rows in L2 and 1.00-1.05x in L3, GQA 8 q, V1 and MQA 0.98-1.05x;
/// from memory (V2, GQA 8 q, MQA) 0.99-1.04x. In the AVX2 build the same
/// made GQA 8 q and V1 0.94-0.98x as fast, so there p is left to the compiler.
template <class T>
EIGEN_ALWAYS_INLINE const T* in_register(const T* p) {
#if (defined(__GNUC__) || defined(__clang__)) && defined(__AVX512F__)
  __asm__("" : "+r"(p));
#endif
  return p;
}

/// The packet operations of the decoding kernels, brought into a kernel's
/// scope at once (`using namespace decode_packet_ops;`).
namespace decode_packet_ops {
using Eigen::internal::padd;
using Eigen::internal::ploadu;
using Eigen::internal::pmadd;
using Eigen::internal::pmul;
using Eigen::internal::pset1;
using Eigen::internal::pstoreu;
}  // namespace decode_packet_ops

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

/// The products of partial_dots_n for G consecutive key heads of each row
/// (G = 1: partial_dots_n itself): head gi at krows[u] + off + gi kstep
/// against its R query rows q + gi qgstep + i qstep, packets stored at
/// part + gi pgstep + i pstep + u P.
template <int G, int R, int DP, class C, class S>
EIGEN_ALWAYS_INLINE void dots_heads(const S* const* krows, const S* const* pre, index_t off,
                                    index_t kstep, index_t U, const C* q, index_t qstep,
                                    index_t qgstep, C* part, index_t pstep, index_t pgstep) {
  using Packet = typename TileConfig<C>::Packet;
  using namespace decode_packet_ops;
  constexpr index_t P = TileConfig<C>::kPacket;
  Packet qv[G][R][DP];
  for (int gi = 0; gi < G; ++gi)
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < DP; ++t)
        qv[gi][i][t] = ploadu<Packet>(q + gi * qgstep + i * qstep + t * P);
  for (index_t u = 0; u < U; ++u) {
    const S* k = krows[u] + off;
    if (pre && pre[u])
      for (int gi = 0; gi < G; ++gi)
        prefetch_decode(in_register(pre[u] + off + gi * kstep), DP * P);
    for (int gi = 0; gi < G; ++gi) {
      Packet acc[R];
      const S* kh = in_register(k + gi * kstep);
      if constexpr (widen_pairs_v<P, S> && DP % 2 == 0) {
        for (int t = 0; t < DP; t += 2) {
          Packet k0, k1;
          pload_widened_pair(kh + t * P, k0, k1);
          for (int i = 0; i < R; ++i)
            acc[i] = t == 0 ? pmul(qv[gi][i][0], k0) : pmadd(qv[gi][i][t], k0, acc[i]);
          for (int i = 0; i < R; ++i) acc[i] = pmadd(qv[gi][i][t + 1], k1, acc[i]);
        }
      } else {
        const Packet k0 = pload_widened<Packet>(kh);
        for (int i = 0; i < R; ++i) acc[i] = pmul(qv[gi][i][0], k0);
        for (int t = 1; t < DP; ++t) {
          const Packet kp = pload_widened<Packet>(kh + t * P);
          for (int i = 0; i < R; ++i) acc[i] = pmadd(qv[gi][i][t], kp, acc[i]);
        }
      }
      for (int i = 0; i < R; ++i) pstoreu(part + gi * pgstep + i * pstep + u * P, acc[i]);
    }
  }
}

/// Partial dot products of U key rows, key u at krows[u] + off (stored as S,
/// widened once per packet), with R query rows q + i qstep over the first dp
/// features (dp a multiple of the packet size P): the packet whose lanes sum
/// to q_i . k_u, stored unreduced at part + i pstep + u P. reduce_keys sums
/// the lanes of P keys' packets at once, so no (row, key) pair pays for a
/// horizontal sum. R and DP = dp / P (0: known only at run time) are
/// constants, so that the queries stay in registers across the keys and the
/// loop over a key's packets unrolls. pre[u] (if pre is not null and pre[u]
/// is not) is the row to prefetch the same features of as key u is read.
template <int R, int DP, class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots_n(const S* const* krows, const S* const* pre, index_t off,
                                        index_t U, index_t dp, const C* q, index_t qstep, C* part,
                                        index_t pstep) {
  using Packet = typename TileConfig<C>::Packet;
  using namespace decode_packet_ops;
  constexpr index_t P = TileConfig<C>::kPacket;
  if constexpr (DP > 0) {
    dots_heads<1, R, DP>(krows, pre, off, 0, U, q, qstep, 0, part, pstep, 0);
  } else {
    for (index_t u = 0; u < U; ++u) {
      const S* k = krows[u] + off;
      if (pre && pre[u]) prefetch_decode(pre[u] + off, dp);
      Packet acc[R];
      for (int i = 0; i < R; ++i) acc[i] = pset1<Packet>(C(0));
      for (index_t t = 0; t < dp; t += P) {
        const Packet kp = pload_widened<Packet>(k + t);
        for (int i = 0; i < R; ++i) acc[i] = pmadd(ploadu<Packet>(q + i * qstep + t), kp, acc[i]);
      }
      for (int i = 0; i < R; ++i) pstoreu(part + i * pstep + u * P, acc[i]);
    }
  }
}

/// dots_heads for G consecutive key heads of each row, read together. Out of
/// line on purpose: inlined into decode_states, GCC spilled queries and
/// addresses to the stack (V2 0.90x as fast with K/V in cache).
template <int G, int R, int DP, class C, class S>
EIGEN_DONT_INLINE void partial_dots_gn(const S* const* krows, const S* const* pre, index_t off,
                                       index_t kstep, index_t U, const C* q, index_t qstep,
                                       index_t qgstep, C* part, index_t pstep, index_t pgstep) {
  dots_heads<G, R, DP>(krows, pre, off, kstep, U, q, qstep, qgstep, part, pstep, pgstep);
}

/// partial_dots_n over `rows` query rows, four at a time. (Four rows of 8
/// packets do not fit the registers and reload their queries from L1, which
/// measured faster for MQA with d = 128 than blocks of 3 rows that fit, and
/// as fast as 2 rows, 2 or 4 keys at a time with the queries from L1, or two
/// accumulators per row: 0.93-1.03x, all at about 0.65 FMA per cycle with
/// the rows in L2.)
/// The first four prefetch pre.
template <int DP, class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots_rows(const S* const* krows, const S* const* pre, index_t off,
                                           index_t U, index_t dp, const C* q, index_t qstep,
                                           C* part, index_t pstep, index_t rows) {
  constexpr int RB = 4;
  index_t i = 0;
  for (; i + RB <= rows; i += RB, pre = nullptr)
    partial_dots_n<RB, DP>(krows, pre, off, U, dp, q + i * qstep, qstep, part + i * pstep, pstep);
  switch (rows - i) {
    case 1:
      return partial_dots_n<1, DP>(krows, pre, off, U, dp, q + i * qstep, qstep, part + i * pstep,
                                   pstep);
    case 2:
      return partial_dots_n<2, DP>(krows, pre, off, U, dp, q + i * qstep, qstep, part + i * pstep,
                                   pstep);
    case 3:
      return partial_dots_n<3, DP>(krows, pre, off, U, dp, q + i * qstep, qstep, part + i * pstep,
                                   pstep);
    default:
      return;
  }
}

/// partial_dots_rows with the queries in registers for the usual head
/// widths: 64 and 128 features in 4 or 8 packets (AVX-512: 16 floats) or 8
/// (AVX2: 8 floats; 128 features run as `dp` known at run time).
template <class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots(const S* const* krows, const S* const* pre, index_t off,
                                      index_t U, index_t dp, const C* q, index_t qstep, C* part,
                                      index_t pstep, index_t rows) {
  switch (dp / TileConfig<C>::kPacket) {
    case 4:
      return partial_dots_rows<4>(krows, pre, off, U, dp, q, qstep, part, pstep, rows);
    case 8:
      return partial_dots_rows<8>(krows, pre, off, U, dp, q, qstep, part, pstep, rows);
    default:
      return partial_dots_rows<0>(krows, pre, off, U, dp, q, qstep, part, pstep, rows);
  }
}

/// out[jj] = the sum of the lanes of the packet at part + jj P, for the P
/// keys jj < P of a block: one transpose (ptranspose; with AVX-512 one that
/// adds as it goes) and P - 1 additions for P scores, instead of P
/// horizontal sums.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // PacketBlock of a vector type
#endif
template <class C>
EIGEN_ALWAYS_INLINE void reduce_keys(const C* part, C* out) {
  using Packet = typename TileConfig<C>::Packet;
  using namespace decode_packet_ops;
  constexpr int P = TileConfig<C>::kPacket;
  if constexpr (P == 1) {
    out[0] = part[0];
#if defined(__AVX512F__)
  } else if constexpr (std::is_same<Packet, __m512>::value) {
    // A transpose that adds as it goes: 30 shuffles and 15 additions for 16
    // keys, where Eigen's full 16 x 16 transpose takes over 100 shuffles.
    // Keys 2m, 2m + 1: in each 128-bit lane, pairs of lanes summed.
    __m512 w[8];
    for (int m = 0; m < 8; ++m) {
      const __m512 a = _mm512_loadu_ps(part + 2 * m * P),
                   b = _mm512_loadu_ps(part + (2 * m + 1) * P);
      w[m] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // Keys 4q .. 4q + 3: each 128-bit lane summed.
    __m512 z[4];
    for (int q = 0; q < 4; ++q)
      z[q] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * q], w[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(w[2 * q], w[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Across 128-bit lanes: pairs, then all four, keys in order.
    __m512 t[2];
    for (int h = 0; h < 2; ++h)
      t[h] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * h], z[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(z[2 * h], z[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1))));
#endif
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

/// The sums of axpy_keys_n over the first dv features (a multiple of NP P)
/// for G consecutive value heads of each row (G = 1: axpy_keys_n's): head
/// gi at vrows[u] + off + gi vstep into its R output rows
/// o + gi ogstep + i ostep, weights w + gi wgstep + i wstep.
template <int G, int R, int NP, class C, class S>
EIGEN_ALWAYS_INLINE void axpy_heads(const S* const* vrows, const S* const* pre, index_t off,
                                    index_t vstep, index_t U, index_t dv, C* o, index_t ostep,
                                    index_t ogstep, const C* w, index_t wstep, index_t wgstep) {
  using Packet = typename TileConfig<C>::Packet;
  using namespace decode_packet_ops;
  constexpr index_t P = TileConfig<C>::kPacket;
  for (index_t t = 0; t < dv; t += NP * P) {
    Packet acc[G][R][NP];
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < NP; ++c)
          acc[gi][i][c] = ploadu<Packet>(o + gi * ogstep + i * ostep + t + c * P);
    for (index_t u = 0; u < U; ++u) {
      const S* v = vrows[u] + off + t;
      if (pre && pre[u])
        for (int gi = 0; gi < G; ++gi)
          prefetch_decode(in_register(pre[u] + off + gi * vstep + t), NP * P);
      for (int gi = 0; gi < G; ++gi) {
        Packet vp[NP];
        const S* vh = in_register(v + gi * vstep);
        if constexpr (widen_pairs_v<P, S> && NP % 2 == 0) {
          for (int c = 0; c < NP; c += 2) pload_widened_pair(vh + c * P, vp[c], vp[c + 1]);
        } else {
          for (int c = 0; c < NP; ++c) vp[c] = pload_widened<Packet>(vh + c * P);
        }
        for (int i = 0; i < R; ++i) {
          const Packet wp = pset1<Packet>(w[gi * wgstep + i * wstep + u]);
          for (int c = 0; c < NP; ++c) acc[gi][i][c] = pmadd(wp, vp[c], acc[gi][i][c]);
        }
      }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < NP; ++c)
          pstoreu(o + gi * ogstep + i * ostep + t + c * P, acc[gi][i][c]);
  }
}

/// o + i ostep += sum over u < U of w[i wstep + u] v_u for i < R, value row
/// v_u at vrows[u] + off (stored as S, widened once per packet for every
/// row). The outputs stay in registers across the U keys, NP packets of
/// each row at a time: an output packet is loaded and stored once per block
/// of keys, not once per key (which made the step 2x slower on Zen 5 with the
/// K/V rows in L2). pre as for partial_dots_n.
template <int R, int NP, class C, class S>
EIGEN_ALWAYS_INLINE void axpy_keys_n(const S* const* vrows, const S* const* pre, index_t off,
                                     index_t U, index_t dv, C* o, index_t ostep, const C* w,
                                     index_t wstep) {
  constexpr index_t P = TileConfig<C>::kPacket;
  index_t t = dv / (NP * P) * (NP * P);
  axpy_heads<1, R, NP>(vrows, pre, off, 0, U, t, o, ostep, 0, w, wstep, 0);
  if constexpr (NP > 1) {
    // The rest of the packets one at a time, then the last dv % P features.
    if (t < dv) return axpy_keys_n<R, 1>(vrows, pre, off + t, U, dv - t, o + t, ostep, w, wstep);
  } else {
    for (; t < dv; ++t)
      for (int i = 0; i < R; ++i) {
        C sum = o[i * ostep + t];
        for (index_t u = 0; u < U; ++u)
          sum += w[i * wstep + u] * widen_scalar<C>(vrows[u][off + t]);
        o[i * ostep + t] = sum;
      }
  }
}

/// axpy_heads for G consecutive value heads of each row, read together (dv
/// a multiple of NP P). Out of line as partial_dots_gn.
template <int G, int R, int NP, class C, class S>
EIGEN_DONT_INLINE void axpy_keys_gn(const S* const* vrows, const S* const* pre, index_t off,
                                    index_t vstep, index_t U, index_t dv, C* o, index_t ostep,
                                    index_t ogstep, const C* w, index_t wstep, index_t wgstep) {
  axpy_heads<G, R, NP>(vrows, pre, off, vstep, U, dv, o, ostep, ogstep, w, wstep, wgstep);
}

/// axpy_keys_n over `rows` rows: four at a time with 32 vector registers
/// (16 accumulators), two with 16. The first of them prefetch pre.
template <class C, class S>
EIGEN_ALWAYS_INLINE void axpy_keys(const S* const* vrows, const S* const* pre, index_t off,
                                   index_t U, index_t dv, C* o, index_t ostep, const C* w,
                                   index_t wstep, index_t rows) {
  constexpr int RB = TileConfig<C>::kVectorRegisters >= 32 ? 4 : 2;
  index_t i = 0;
  for (; i + RB <= rows; i += RB, pre = nullptr)
    axpy_keys_n<RB, 4>(vrows, pre, off, U, dv, o + i * ostep, ostep, w + i * wstep, wstep);
  switch (rows - i) {
    case 3:
      return axpy_keys_n<3, 4>(vrows, pre, off, U, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 2:
      return axpy_keys_n<2, 4>(vrows, pre, off, U, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    case 1:
      return axpy_keys_n<1, 4>(vrows, pre, off, U, dv, o + i * ostep, ostep, w + i * wstep, wstep);
    default:
      return;
  }
}

/// How many consecutive kv heads of a row the step reads together: G key
/// heads (partial_dots_gn) whose R = `rows` query rows each keep DP =
/// `packets` packets of queries in registers (G R DP <= 16), or G value heads
/// (axpy_keys_gn, `packets` = 4 per pass) whose R output rows each keep 4
/// packets (G R 4 <= 16), and no more than 512 bytes of the row per pass
/// (`head_bytes`: what one head contributes to a pass); 1 where one head at
/// a time is read. Float arithmetic with AVX-512 only, where it was measured.
///
/// Together, a row's heads are read 512 bytes at a time instead of 256, and
/// share the row's pointer, prefetch test and loop. On Zen 5 (2 threads,
/// variants compiled side by side in one process) against one head at a
/// time: from memory (M = 32k) V1 1.18x, V2 1.06x, GQA 8q 1.07x, GQA 16q
/// 1.04x; with K/V in L3 (M = 4k) 1.19x, 1.04x, 1.19x, 1.02x (V1 and GQA 8q
/// then read four heads, 1 KiB, at a time). The 512-byte cap: the step's
/// read order alone (bench_decode's BM_DecodeReadOrder_*, no arithmetic, 2
/// threads) reads 0.82-0.87 of address order's rate in passes of 512 bytes
/// of every row and 0.75-0.76 in passes of 1 KiB, and GQA 8q's step ran
/// 1.03-1.09x as fast at M = 32k (1.10-1.16x at 128k, 1.09-1.10x on one
/// thread) with two heads of 64 floats per pass instead of four; V1's
/// 0.92-1.11x (median 1.01) and MQA's 0.97-1.04x.
template <class C>
index_t heads_together(index_t rows, index_t packets, index_t head_bytes) {
  if (TileConfig<C>::kPacket != 16) return 1;
  index_t g = 1;
  if (packets == 4) g = rows == 1 ? 4 : rows == 2 ? 2 : 1;
  if (packets == 8) g = rows == 1 ? 2 : 1;
  while (g > 1 && g * head_bytes > 512) g /= 2;
  return g;
}

/// partial_dots_gn with G = heads_together(R, dp / P, ..).
template <class C, class S>
EIGEN_ALWAYS_INLINE void partial_dots_heads(index_t G, index_t R, const S* const* krows,
                                            const S* const* pre, index_t off, index_t kstep,
                                            index_t U, index_t dp, const C* q, index_t qstep,
                                            index_t qgstep, C* part, index_t pstep,
                                            index_t pgstep) {
  if constexpr (TileConfig<C>::kPacket == 16) {
    const auto args = [&](auto f) {
      f(krows, pre, off, kstep, U, q, qstep, qgstep, part, pstep, pgstep);
    };
    if (dp == 64 && G == 4 && R == 1) return args(partial_dots_gn<4, 1, 4, C, S>);
    if (dp == 64 && G == 2 && R == 2) return args(partial_dots_gn<2, 2, 4, C, S>);
    if (dp == 64 && G == 2 && R == 1) return args(partial_dots_gn<2, 1, 4, C, S>);
    if (dp == 128 && G == 2 && R == 1) return args(partial_dots_gn<2, 1, 8, C, S>);
  }
  // No kernel for G heads together (heads_together never asks for one): the
  // same products, one head at a time.
  for (index_t gi = 0; gi < G; ++gi)
    partial_dots(krows, pre, off + gi * kstep, U, dp, q + gi * qgstep, qstep, part + gi * pgstep,
                 pstep, R);
}

/// axpy_keys_gn with G = heads_together(R, 4, ..).
template <class C, class S>
EIGEN_ALWAYS_INLINE void axpy_keys_heads(index_t G, index_t R, const S* const* vrows,
                                         const S* const* pre, index_t off, index_t vstep, index_t U,
                                         index_t dv, C* o, index_t ostep, index_t ogstep,
                                         const C* w, index_t wstep, index_t wgstep) {
  if constexpr (TileConfig<C>::kPacket == 16) {
    const auto args = [&](auto f) {
      f(vrows, pre, off, vstep, U, dv, o, ostep, ogstep, w, wstep, wgstep);
    };
    if (G == 4 && R == 1) return args(axpy_keys_gn<4, 1, 4, C, S>);
    if (G == 2 && R == 2) return args(axpy_keys_gn<2, 2, 4, C, S>);
    if (G == 2 && R == 1) return args(axpy_keys_gn<2, 1, 4, C, S>);
  }
  // No kernel for G heads together: the same sums, one head at a time.
  for (index_t gi = 0; gi < G; ++gi)
    axpy_keys(vrows, pre, off + gi * vstep, U, dv, o + gi * ogstep, ostep, w + gi * wgstep, wstep,
              R);
}

/// How far ahead of the row being read a decoding step asks for the cache's
/// rows: 16 KiB of rows, at least 4 and at most 16 rows.
///
/// A block reads P rows head after head, a stride of a whole row (2 KiB for
/// 8 heads of 64 floats), which the hardware prefetchers do not follow. As it
/// loads a head of a row, the step prefetches the same head of the row this
/// far on with the non-temporal hint (partial_dots, axpy_keys: one prefetch
/// per line, next to that line's loads; issued together before a head's
/// products, the prefetches stalled the step: 1.3x slower for V2 with the
/// rows in L2). Measured on Zen 5, M = 32k, 2 threads, with the variants
/// compiled side by side in one process, against no prefetch: V2 1.16x,
/// GQA 16q 1.16x, MQA 1.31x as fast with the T0 hint, and the non-temporal
/// hint a further 1.07-1.12x for V2 and the GQA steps (V1, MQA 1.02-1.03x).
/// 8 or 32 KiB ahead did worse for V2, T1 or prefetching in address order
/// worse for all; MQA (rows of 512 bytes) gains 1.07x from the 16-row cap.
/// Also measured for V2 and not kept: 32 KiB ahead with the T0 or T1 hint
/// (0.94-0.96x), taking the exps block by block in the V pass (0.98-1.01x),
/// the key products in address order with the queries read from L1
/// (0.82-0.89x), each key packet loaded once into a register instead of
/// once per query row (0.95-0.98x), one pass with an online softmax
/// (0.83-0.89x), each block's rows first copied in address order into an L1
/// buffer (0.58-0.71x); a head-major cache read head by head as pure streams,
/// hardware prefetch only, was no faster (0.98-1.00x). Nor were one whole
/// block (16 rows) ahead (0.96-1.05x), blocks read in halves of 8 keys
/// (0.93-0.98x), caches on 2 MiB pages (0.96-1.03x), or whole rows also
/// prefetched into L2 32-64 rows ahead (0.77-0.83x); the key pass on 256-bit
/// packets gained for one or two query rows of 64 per kv head (V2 0.99-1.12x,
/// GQA 8q 1.03-1.09x) and lost elsewhere (V1 0.75x, MQA 0.83-0.85x, in L2
/// or L3 0.83-0.87x): see bench/DECODE.md.
constexpr index_t kDecodeAheadBytes = index_t(16) << 10;

/// How much of a chunk's value rows a decoding step asks for (T1 hint) while
/// its softmax runs, before the V pass. On Zen 5 (2 threads, in one process
/// against none): 1.003-1.035x as fast over 12 runs (V2, V1, GQA 8q and 16q,
/// MQA; M = 32k and 128k, B = 8 at 4k, a paged cache of 16-row blocks), never
/// slower; a first version gave V2 and GQA 16q 1.01-1.06x; 128 and 256 KiB
/// gained less.
constexpr index_t kValueWarmBytes = index_t(64) << 10;

inline index_t decode_ahead_rows(index_t row_bytes) {
  return std::min<index_t>(16, std::max<index_t>(4, kDecodeAheadBytes / row_bytes));
}

/// The rows of keys [j0, j0 + jn) into rows (row_of(j): key j's row, all its
/// heads), and the rows `ahead` keys on into pre (nullptr from jhi on). Where
/// even(a, n) says keys [a, a + n) lie `stride` elements apart (a contiguous
/// cache, or one block of a paged one), one row_of and additions.
template <class S, class RowOf, class Even>
EIGEN_ALWAYS_INLINE void block_rows(const RowOf& row_of, const Even& even, index_t stride,
                                    index_t j0, index_t jn, index_t jhi, index_t ahead,
                                    const S** rows, const S** pre) {
  const auto fill = [&](index_t a, index_t n, const S** dst) {
    if (n <= 0) return;
    if (even(a, n)) {
      const S* r = row_of(a);
      for (index_t jj = 0; jj < n; ++jj) dst[jj] = r + jj * stride;
    } else {
      for (index_t jj = 0; jj < n; ++jj) dst[jj] = row_of(a + jj);
    }
  };
  fill(j0, jn, rows);
  const index_t pn = std::max<index_t>(0, std::min(jn, jhi - (j0 + ahead)));
  fill(j0 + ahead, pn, pre);
  for (index_t jj = pn; jj < jn; ++jj) pre[jj] = nullptr;
}

/// True when an int8 cache's key products run on VNNI integer dot products
/// (vpdpbusd, AVX512-VNNI with AVX512-BW and 16-float packets) for head
/// widths of one or two 64-byte vectors (d = 64 or 128).
///
/// Why: widening int8 keys to float costs two instructions per 16 values and
/// a float FMA per query row, which held the step to the ~12.5 G values/s
/// per thread that float and bfloat16 rows run at with the rows in L2 (Zen 5,
/// V2): the speed of the instructions, not of the bytes. vpdpbusd multiplies
/// 64 byte pairs and adds them into 16 int32 lanes in one instruction.
///
/// How: each scaled query row qs is quantized once per step (per chunk) to
/// |qs_t| / sq rounded to nearest, an unsigned byte (sq = max |qs| / 255), and
/// its signs kept as a 64-bit mask per 64 features; a key vector is negated
/// where the query is negative (one masked subtract, exact: stored int8 keys
/// are never -128), so the products are |q| (unsigned) times the signed key.
/// The integer sums are exact (at most 64 x 255 x 127 per packet, and below
/// 2^24: their conversion to float is exact too); the score is that integer
/// sum times sq times the key's scale. The only error beyond float rounding is
/// the query's own quantization: |qs_t - sq q_t| <= sq / 2 = max |qs| / 510,
/// which moves a score by at most sq / 2 sum_t |k^_t| (see the README's
/// 8-bit section for the bound and the measured errors).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasVnniDots = TileConfig<float>::kPacket == 16;
#else
constexpr bool kHasVnniDots = false;
#endif
template <class T, class KV>
constexpr bool decode_vnni_keys =
    kHasVnniDots&& std::is_same<KV, std::int8_t>::value&& std::is_same<compute_t<T>, float>::value;
/// Whether a step of head width d runs its key products on VNNI.
template <class T, class KV>
bool decode_uses_vnni(index_t d) {
  return decode_vnni_keys<T, KV> && (d == 64 || d == 128);
}

/// The VNNI form of a scaled query row qs (d floats, d = 64 or 128): |qs_t| /
/// sq rounded to nearest (ties to even, the default mode) as bytes qa, the
/// signs as d / 64 masks (bit t of mask c: qs_{64 c + t} < 0), sq = max |qs| /
/// 255 returned (0 for a zero row: then qa is 0). Portable, so that tests can
/// form the queries the step uses.
inline float quantize_query_u8(const float* qs, index_t d, std::uint8_t* qa, std::uint64_t* masks) {
#if defined(__AVX512F__)
  // The same values 16 features at a time (exact division and rounding to
  // nearest, as below), for finite rows of whole 64-feature masks.
  if (d % 64 == 0) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (index_t t = 0; t < d; t += 16) {
      const __m512 x = _mm512_loadu_ps(qs + t);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, _mm512_abs_ps(x));
    }
    const float amax = _mm512_reduce_max_ps(m);
    if (nan == 0 && std::isfinite(amax)) {
      const float sq = amax / 255;
      const __m512 div = _mm512_set1_ps(sq > 0 ? sq : 1.0f);
      const __m512 top = _mm512_set1_ps(sq > 0 ? 255.0f : 0.0f);
      for (index_t c = 0; c * 64 < d; ++c) {
        std::uint64_t mask = 0;
        for (int k = 0; k < 4; ++k) {
          const index_t t = c * 64 + k * 16;
          const __m512 x = _mm512_loadu_ps(qs + t);
          const __m512 y = _mm512_roundscale_ps(_mm512_div_ps(_mm512_abs_ps(x), div),
                                                _MM_FROUND_CUR_DIRECTION);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + t),
                           _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(y, top))));
          mask |= static_cast<std::uint64_t>(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ))
                  << (16 * k);
        }
        masks[c] = mask;
      }
      return sq;
    }
  }
#endif
  float amax = 0;
  for (index_t t = 0; t < d; ++t) amax = std::max(amax, std::abs(qs[t]));
  const float sq = amax / 255;
  for (index_t c = 0; c * 64 < d; ++c) masks[c] = 0;
  for (index_t t = 0; t < d; ++t) {
    qa[t] = sq > 0
                ? static_cast<std::uint8_t>(std::min(255.0f, std::nearbyint(std::abs(qs[t]) / sq)))
                : std::uint8_t(0);
    if (qs[t] < 0) masks[t / 64] |= std::uint64_t(1) << (t % 64);
  }
  return sq;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/// The integer packets of four keys (lane sums a[k] = q . key k) folded into
/// one: in each 128-bit lane, the four keys' sums of that lane's features.
/// reduce_keys' first two rounds, on exact int32 sums.
EIGEN_ALWAYS_INLINE __m512i fold_four_keys(const __m512i a[4]) {
  const __m512i w0 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
  const __m512i w1 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
  const __m512 x0 = _mm512_castsi512_ps(w0), x1 = _mm512_castsi512_ps(w1);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0))),
                          _mm512_castps_si512(_mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2))));
}

/// Two folded packets (keys 0-3, 4-7 of eight, or of two such halves) summed
/// across 128-bit lanes: reduce_keys' last rounds.
EIGEN_ALWAYS_INLINE __m512i fold_lanes(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/// The scores of a block of U <= 16 int8 keys on VNNI: G consecutive key
/// heads (kstep apart) of U rows against R query rows each, DB = d / 64
/// vectors per head; query row i of head gi at qa + gi qgstep + i qstep
/// (bytes) with masks at qm + gi mgstep + i mstep and scale qsc[gi qsgstep +
/// i qsstep]; the head's key scales (16, zero from U on) at ksc + gi 16. Key
/// u's score, float(integer sum) * (key scale * query scale), is stored at
/// s + gi sgstep + i sstep + u, for all 16 u (0 from U on).
///
/// The integer packets of four keys are folded as they come (fold_four_keys)
/// and the block's four folds summed across lanes (fold_lanes) in registers:
/// one conversion and one product per 16 scores, where storing each key's
/// packet for reduce_keys took a conversion, a store and a load per key and
/// row. The sums are exact either way (below 2^24), so the scores are the
/// same to the bit. Out of line as partial_dots_gn.
template <int G, int R, int DB>
EIGEN_DONT_INLINE void scores_vnni(const std::int8_t* const* krows, const std::int8_t* const* pre,
                                   index_t off, index_t kstep, index_t U, const std::uint8_t* qa,
                                   index_t qstep, index_t qgstep, const std::uint64_t* qm,
                                   index_t mstep, index_t mgstep, const float* qsc, index_t qsstep,
                                   index_t qsgstep, const float* ksc, float* s, index_t sstep,
                                   index_t sgstep) {
  __m512i q[G][R][DB];
  __mmask64 m[G][R][DB];
  for (int gi = 0; gi < G; ++gi)
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < DB; ++t) {
        q[gi][i][t] = _mm512_loadu_si512(qa + gi * qgstep + i * qstep + t * 64);
        m[gi][i][t] = qm[gi * mgstep + i * mstep + t];
      }
  const __m512i zero = _mm512_setzero_si512();
  __m512i half[G][R];  // keys 0-7 folded, while keys 8-15 are read
  __m512i quad[G][R];  // the first four keys of the current eight folded
  for (int b = 0; b < 4; ++b) {
    __m512i acc[G][R][4];
    for (int k4 = 0; k4 < 4; ++k4) {
      const index_t u = 4 * b + k4;
      if (u >= U) {
        for (int gi = 0; gi < G; ++gi)
          for (int i = 0; i < R; ++i) acc[gi][i][k4] = zero;
        continue;
      }
      const std::int8_t* k = krows[u] + off;
      if (pre && pre[u])
        for (int gi = 0; gi < G; ++gi)
          prefetch_decode(in_register(pre[u] + off + gi * kstep), DB * 64);
      for (int gi = 0; gi < G; ++gi) {
        const std::int8_t* kh = in_register(k + gi * kstep);
        __m512i kv[DB];
        for (int t = 0; t < DB; ++t) kv[t] = _mm512_loadu_si512(kh + t * 64);
        for (int i = 0; i < R; ++i) {
          __m512i a = _mm512_dpbusd_epi32(zero, q[gi][i][0],
                                          _mm512_mask_sub_epi8(kv[0], m[gi][i][0], zero, kv[0]));
          for (int t = 1; t < DB; ++t)
            a = _mm512_dpbusd_epi32(a, q[gi][i][t],
                                    _mm512_mask_sub_epi8(kv[t], m[gi][i][t], zero, kv[t]));
          acc[gi][i][k4] = a;
        }
      }
    }
    for (int gi = 0; gi < G; ++gi)
      for (int i = 0; i < R; ++i) {
        const __m512i z = fold_four_keys(acc[gi][i]);
        if (b % 2 == 0) {
          quad[gi][i] = z;
        } else {
          const __m512i t = fold_lanes(quad[gi][i], z);
          if (b == 1)
            half[gi][i] = t;
          else
            _mm512_storeu_ps(
                s + gi * sgstep + i * sstep,
                _mm512_mul_ps(_mm512_cvtepi32_ps(fold_lanes(half[gi][i], t)),
                              _mm512_mul_ps(_mm512_loadu_ps(ksc + gi * 16),
                                            _mm512_set1_ps(qsc[gi * qsgstep + i * qsstep]))));
        }
      }
  }
}
#endif

/// scores_vnni for G heads of R query rows each (G R DB <= 4 picks a
/// kernel; otherwise one head at a time, rows four at a time).
inline void scores_vnni_heads(index_t G, index_t R, index_t DB, const std::int8_t* const* krows,
                              const std::int8_t* const* pre, index_t off, index_t kstep, index_t U,
                              const std::uint8_t* qa, index_t qstep, index_t qgstep,
                              const std::uint64_t* qm, index_t mstep, index_t mgstep,
                              const float* qsc, index_t qsstep, index_t qsgstep, const float* ksc,
                              float* s, index_t sstep, index_t sgstep) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const auto args = [&](auto f) {
    f(krows, pre, off, kstep, U, qa, qstep, qgstep, qm, mstep, mgstep, qsc, qsstep, qsgstep, ksc, s,
      sstep, sgstep);
  };
  if (DB == 1) {
    if (G == 4 && R == 1) return args(scores_vnni<4, 1, 1>);
    if (G == 2 && R == 2) return args(scores_vnni<2, 2, 1>);
    if (G == 2 && R == 1) return args(scores_vnni<2, 1, 1>);
  } else if (DB == 2) {
    if (G == 2 && R == 1) return args(scores_vnni<2, 1, 2>);
  }
  // One head at a time, rows four at a time.
  for (index_t gi = 0; gi < G; ++gi) {
    for (index_t i = 0; i < R;) {
      const index_t rc = std::min<index_t>(4, R - i);
      const auto one = [&](auto f) {
        f(krows, i == 0 ? pre : nullptr, off + gi * kstep, 0, U, qa + gi * qgstep + i * qstep,
          qstep, 0, qm + gi * mgstep + i * mstep, mstep, 0, qsc + gi * qsgstep + i * qsstep, qsstep,
          0, ksc + gi * 16, s + gi * sgstep + i * sstep, sstep, 0);
      };
      if (DB == 1) {
        if (rc == 4) one(scores_vnni<1, 4, 1>);
        if (rc == 3) one(scores_vnni<1, 3, 1>);
        if (rc == 2) one(scores_vnni<1, 2, 1>);
        if (rc == 1) one(scores_vnni<1, 1, 1>);
      } else {
        if (rc == 4) one(scores_vnni<1, 4, 2>);
        if (rc == 3) one(scores_vnni<1, 3, 2>);
        if (rc == 2) one(scores_vnni<1, 2, 2>);
        if (rc == 1) one(scores_vnni<1, 1, 2>);
      }
      i += rc;
    }
  }
#else
  (void)G, (void)R, (void)DB, (void)krows, (void)pre, (void)off, (void)kstep, (void)U, (void)qa;
  (void)qstep, (void)qgstep, (void)qm, (void)mstep, (void)mgstep, (void)qsc, (void)qsstep;
  (void)qsgstep, (void)ksc, (void)s, (void)sstep, (void)sgstep;
#endif
}

/// Key heads a VNNI pass reads together: G R DB <= 4 vectors of queries in
/// registers (each with two folds of keys beside it), at most 512 bytes of
/// the row per pass (as heads_together).
inline index_t vnni_heads_together(index_t rows, index_t DB) {
  index_t g = 4;
  while (g > 1 && (g * rows * DB > 4 || g * 64 * DB > 512)) g /= 2;
  return g;
}

/// 8-bit caches: the scales of keys [j0, j0 + jn) for `heads` heads, each
/// times kv_unit<KV>(), transposed to dst[h dstep + jj] (zero from jn to P), as
/// the step folds them into a block's scores or weights. scales_of(j): key
/// j's scales, head h at [h hstride]. Returns false if one is not scale_ok.
///
/// Where the block's scale rows are evenly spaced, `kstride` apart (`even`:
/// a contiguous cache, or keys of one block of a paged one), and the target
/// gathers, one gather per head: the scalar transposition cost the int8 step
/// ~15% of its time with the rows in L2 (V2, 8 kv heads).
template <class KV, index_t P, class ScalesOf>
EIGEN_ALWAYS_INLINE bool block_scales(const ScalesOf& scales_of, index_t j0, index_t jn,
                                      index_t heads, index_t hstride, bool even, index_t kstride,
                                      float* dst, index_t dstep = P) {
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (P == 16) {
    if (even && jn == P && heads == 8 && hstride == 1 && kstride == 8) {
      // 16 keys of 8 heads, packed: a 16 x 8 block transposed by three
      // rounds of two-source permutes (24 in all; gathering took 3x longer).
      const float* x = scales_of(j0);
      __m512 z[8], u[8], v[8];
      const __m512 limit = _mm512_set1_ps(std::numeric_limits<float>::max() / kv_unit<KV>());
      __mmask16 ok = 0xFFFF;
      for (int m = 0; m < 8; ++m) {
        z[m] = _mm512_loadu_ps(x + 16 * m);
        ok &= _mm512_cmp_ps_mask(z[m], _mm512_setzero_ps(), _CMP_GE_OQ) &
              _mm512_cmp_ps_mask(z[m], limit, _CMP_LE_OQ);
      }
      const __m512i l1a =
          _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
      const __m512i l1b =
          _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
      const __m512i l2a = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i l2b =
          _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      const __m512i l3a = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      const __m512i l3b =
          _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      // u[2a], u[2a + 1]: keys 4a .. 4a + 3, heads 0-3 and 4-7, head-major.
      for (int a = 0; a < 4; ++a) {
        u[2 * a] = _mm512_permutex2var_ps(z[2 * a], l1a, z[2 * a + 1]);
        u[2 * a + 1] = _mm512_permutex2var_ps(z[2 * a], l1b, z[2 * a + 1]);
      }
      // v: pairs of heads over 8 keys: (h0-1, h2-3) of keys 0-7, of keys
      // 8-15, then (h4-5, h6-7) of keys 0-7 and of keys 8-15.
      const int src[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
      for (int b = 0; b < 4; ++b) {
        v[2 * b] = _mm512_permutex2var_ps(u[src[b][0]], l2a, u[src[b][1]]);
        v[2 * b + 1] = _mm512_permutex2var_ps(u[src[b][0]], l2b, u[src[b][1]]);
      }
      // Heads 2c, 2c + 1 from the pair's keys 0-7 and 8-15.
      const int lo[4] = {0, 1, 4, 5}, hi[4] = {2, 3, 6, 7};
      const __m512 unit = _mm512_set1_ps(kv_unit<KV>());
      for (int c = 0; c < 4; ++c) {
        _mm512_storeu_ps(dst + (2 * c) * dstep,
                         _mm512_mul_ps(_mm512_permutex2var_ps(v[lo[c]], l3a, v[hi[c]]), unit));
        _mm512_storeu_ps(dst + (2 * c + 1) * dstep,
                         _mm512_mul_ps(_mm512_permutex2var_ps(v[lo[c]], l3b, v[hi[c]]), unit));
      }
      return ok == 0xFFFF;
    }
    if (even && jn == P && kstride >= 0 && kstride < (index_t(1) << 26) && hstride >= 0) {
      const float* first = scales_of(j0);
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(static_cast<int>(kstride)));
      const __m512 unit = _mm512_set1_ps(kv_unit<KV>());
      const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
      __mmask16 ok = 0xFFFF;
      for (index_t h = 0; h < heads; ++h) {
        const __m512 x = _mm512_i32gather_ps(idx, first + h * hstride, 4);
        const __m512 y = _mm512_mul_ps(x, unit);
        ok &= _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ) &
              _mm512_cmp_ps_mask(y, big, _CMP_LE_OQ);
        _mm512_storeu_ps(dst + h * dstep, y);
      }
      return ok == 0xFFFF;
    }
  }
#else
  (void)even;
  (void)kstride;
#endif
  bool ok = true;
  for (index_t jj = 0; jj < jn; ++jj) {
    const float* sc = scales_of(j0 + jj);
    for (index_t h = 0; h < heads; ++h) {
      const float x = sc[h * hstride];
      ok &= scale_ok<KV>(x);
      dst[h * dstep + jj] = x * kv_unit<KV>();
    }
  }
  for (index_t h = 0; jn < P && h < heads; ++h)
    std::fill(dst + h * dstep + jn, dst + h * dstep + P, 0.0f);
  return ok;
}

/// How many blocks ahead of the one it reads a decoding step asks for an
/// 8-bit cache's scales (T0 hint). The scales are a stream of their own, 4
/// bytes a key and head beside the row's 64 or 128: without the hint the
/// step stalled on the first load of each block's scales (perf: about a
/// tenth of an int8 V2 step at M = 128k on Zen 5).
constexpr index_t kScaleAheadBlocks = 4;

/// Asks for the scales of keys [j, j + jn) (their first `row` floats each,
/// rows kstride apart where `even`, else key by key).
template <int Locality = 3, class ScalesOf>
EIGEN_ALWAYS_INLINE void prefetch_scales(const ScalesOf& scales_of, index_t j, index_t jn,
                                         index_t row, bool even, index_t kstride) {
  if (jn <= 0) return;
  if (even) {
    prefetch_row<Locality>(scales_of(j), (jn - 1) * kstride + row);
  } else {
    for (index_t jj = 0; jj < jn; ++jj) prefetch_row<Locality>(scales_of(j + jj), row);
  }
}

/// States of every query row of sequence sq over the keys [lo, hi): o (rows,
/// dv) normalised over the keys each row sees there, lse (rows); -inf and
/// zeros for a row that sees none of them.
///
/// The step reads each K and V row once, so its shape follows the memory and
/// keeps the instructions per row few. Keys go in blocks of P (16 floats with
/// AVX-512): a block of a (.., M, H, D) cache is P whole key rows, read head
/// after head, so the cache is still read front to back block after block,
/// while a head's query rows stay in registers across the block's keys
/// (partial_dots) and its output rows across the block's values
/// (axpy_keys). A score is a packet of partial sums whose lanes are summed P
/// keys at a time (reduce_keys); an output packet is loaded and stored once
/// per block, not once per key. On Zen 5 (2 threads, M = 32k) this made the
/// step 1.3x (V2) to 1.7x (MQA) faster than going key after key through every
/// head with the outputs loaded and stored for each key (2x with the K/V rows
/// in L2).
///
/// Storage: q holds T, the cache KV; the work is in C = compute_t<T>. An
/// 8-bit row is widened in registers as it is read (quant.hpp's units), and
/// its scale applied where the step already multiplies: to a block's scores
/// of its key head after their lanes are summed (one product per score) and
/// to its weights before the V pass (one per weight), so the products over
/// the features run as for any other row.
///
/// A user functor (Mod other than NoScoreMod) modifies and masks each row's
/// scores of the chunk after softcap and ALiBi, before its softmax
/// (score_mods.hpp's functor_scores); keys it masks get weight 0.
template <class T, class KV, class C, class Mod = NoScoreMod>
void decode_states(const AttentionProblem<T, KV>& p, const SeqSpan& sq, const DecodeLanes& dl,
                   index_t lo, index_t hi, Workspace<C>& ws, C* o, C* lse, const Mod& mod = Mod()) {
  constexpr bool kFunctor = is_active_mod<Mod, C>;
  ModCoords mc;
  if constexpr (kFunctor) mc = mod_coords(p, sq);
  (void)mod, (void)mc;
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

  // VNNI key products (int8 caches): each query row quantized once, its
  // bytes (R, d), sign masks (R, d / 64) and scale (R).
  const bool vnni = decode_uses_vnni<T, KV>(d);
  const index_t DB = d / 64;
  std::uint8_t* qa = nullptr;
  std::uint64_t* qm = nullptr;
  C* qscale = nullptr;
  (void)qa, (void)qm, (void)qscale;
  if constexpr (decode_vnni_keys<T, KV>) {
    if (vnni) {
      C* buf = ws.q[1].get(R * d / 4 + 2 * R * DB + 16);
      qa = reinterpret_cast<std::uint8_t*>(buf);
      qm = reinterpret_cast<std::uint64_t*>(buf + round_up(R * d / 4, 2));
      qscale = ws.row.get(R);
      for (index_t r = 0; r < R; ++r) {
        std::uint64_t masks[2];
        qscale[r] = quantize_query_u8(qs + r * d, d, qa + r * d, masks);
        std::memcpy(qm + r * DB, masks, static_cast<std::size_t>(DB) * sizeof(std::uint64_t));
      }
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
  const index_t kahead = decode_ahead_rows(row_bytes);
  // Key heads read together: G consecutive ones whose query rows are evenly
  // spaced, hstep rows apart (one key head per kv group; V1's two key heads
  // per pair, across pairs when a pair reads one DIFF head).
  const index_t nkh = dl.groups * kh, hstep = kh == 1 ? dl.per_group * n : n;
  const index_t kv_bytes = static_cast<index_t>(sizeof(KV));
  index_t kg = dp == d ? heads_together<C>(lanes_per_slot, dp / P, dp * kv_bytes) : 1;
  if (kh > 1 && dl.per_group != kh && kg > kh) kg = 1;
  // VNNI: heads read together likewise (evenly spaced rows), dividing nkh.
  index_t kgv = vnni ? vnni_heads_together(lanes_per_slot, DB) : 1;
  if (kh > 1 && dl.per_group != kh && kgv > kh) kgv = kh;
  while (kgv > 1 && nkh % kgv != 0) kgv /= 2;
  const KV* rows[P];  // the key (then value) rows of a block of keys
  const KV* pre[P];   // and those to prefetch
  // 8-bit caches: a block's scales, (heads, P) (the packing buffers are free
  // in a decoding step; a later block of the same call repacks).
  constexpr bool quant = is_8bit_storage_v<KV>;
  bool scales_ok = true;
  float* ksc = nullptr;
  float* vsc = nullptr;
  // Keys [j0, j0 + jn) whose rows (and scales) are evenly spaced.
  const auto even_rows = [&](index_t a, index_t an) {
    return p.block_size == 0 || a / p.block_size == (a + an - 1) / p.block_size;
  };
  (void)even_rows;
  if constexpr (quant) {
    ksc = ws.k[0].get(nkh * P);
    vsc = ws.k[1].get(dl.groups * lds);
    ws.packed_call = 0;
  }
  for (index_t j0 = jlo; j0 < jhi; j0 += P) {
    const index_t jn = std::min<index_t>(P, jhi - j0);
    block_rows([&](index_t j) { return p.key_row(sq, j, 0); }, even_rows, p.k.stride(1), j0, jn,
               jhi, kahead, rows, pre);
    if constexpr (quant) {
      const auto scales_of = [&](index_t j) { return p.key_scales(sq, j); };
      const index_t ja = j0 + kScaleAheadBlocks * P, jan = std::min<index_t>(P, jhi - ja);
      prefetch_scales(scales_of, ja, jan, (nkh - 1) * p.k_scale.stride(2) + 1, even_rows(ja, jan),
                      p.k_scale.stride(1));
      scales_ok &= block_scales<KV, P>(scales_of, j0, jn, nkh, p.k_scale.stride(2),
                                       even_rows(j0, jn), p.k_scale.stride(1), ksc);
      // The block's value scales, read after the key pass (into L2).
      prefetch_scales<2>([&](index_t j) { return p.value_scales(sq, j); }, j0, jn,
                         (dl.groups - 1) * p.v_scale.stride(2) + 1, even_rows(j0, jn),
                         p.v_scale.stride(1));
    }
    index_t hk0 = 0;  // key heads [0, hk0) read kg at a time
    if constexpr (decode_vnni_keys<T, KV>) {
      if (vnni) {
        for (; hk0 < nkh; hk0 += kgv) {
          const index_t g = hk0 / kh, slot = hk0 % kh;
          for (index_t ii = 0; ii < n; ++ii) {
            const index_t r0 = (g * dl.per_group + slot) * n + ii;
            scores_vnni_heads(kgv, lanes_per_slot, DB, rows, ii ? nullptr : pre, hk0 * ksh, ksh, jn,
                              qa + r0 * d, rstep * d, hstep * d, qm + r0 * DB, rstep * DB,
                              hstep * DB, qscale + r0, rstep, hstep, ksc + hk0 * P,
                              s + r0 * lds + (j0 - jlo), rstep * lds, hstep * lds);
          }
        }
      }
    }
    for (; !vnni && kg > 1 && hk0 + kg <= nkh; hk0 += kg) {
      const index_t g = hk0 / kh, slot = hk0 % kh;
      for (index_t ii = 0; ii < n; ++ii) {
        const index_t r0 = (g * dl.per_group + slot) * n + ii;
        partial_dots_heads(kg, lanes_per_slot, rows, ii ? nullptr : pre, hk0 * ksh, ksh, jn, dp,
                           qs + r0 * d, rstep * d, hstep * d, part + r0 * P * P, rstep * P * P,
                           hstep * P * P);
      }
    }
    for (index_t g = hk0 / kh; g < dl.groups; ++g)
      for (index_t slot = hk0 > g * kh ? hk0 - g * kh : 0; slot < kh; ++slot) {
        const index_t off = (g * kh + slot) * ksh;
        for (index_t ii = 0; ii < n; ++ii) {
          const index_t r0 = (g * dl.per_group + slot) * n + ii;
          partial_dots(rows, ii ? nullptr : pre, off, jn, dp, qs + r0 * d, rstep * d,
                       part + r0 * P * P, rstep * P * P, lanes_per_slot);
          for (index_t m = 0; tails && m < lanes_per_slot; ++m) {
            const C* qr = qs + (r0 + m * rstep) * d;
            for (index_t jj = 0; jj < jn; ++jj) {
              C sum = 0;
              // Fused where the target has FMA, written out so that the
              // result does not hang on the compiler contracting a * b + c
              // in one storage type's instantiation and not another's
              // (16-bit caches stay bitwise the float step at -O3).
              for (index_t t = dp; t < d; ++t) {
#if defined(__FMA__)
                sum = std::fma(qr[t], widen_scalar<C>(rows[jj][off + t]), sum);
#else
                sum += qr[t] * widen_scalar<C>(rows[jj][off + t]);
#endif
              }
              tails[(r0 + m * rstep) * P + jj] = sum;
            }
          }
        }
      }
    for (index_t r = 0; !vnni && r < R; ++r) {
      C* sr = s + r * lds + (j0 - jlo);
      if (jn < P) std::fill(part + r * P * P + jn * P, part + (r + 1) * P * P, C(0));
      reduce_keys(part + r * P * P, sr);
      for (index_t jj = 0; tails && jj < jn; ++jj) sr[jj] += tails[r * P + jj];
    }
    if constexpr (quant) {
      // Lane l reads key head g kh + (l % per_group) % kh, g = l / per_group
      // (VNNI: scaled as they were summed).
      using Block = Eigen::Map<Eigen::Array<C, P, 1>>;
      using ConstBlock = Eigen::Map<const Eigen::Array<C, P, 1>>;
      index_t g = 0, m = 0;
      for (index_t l = 0; l < dl.lanes; ++l) {
        const ConstBlock f(ksc + (g * kh + (kh == 2 ? (m & 1) : 0)) * P);
        for (index_t ii = 0; !vnni && ii < n; ++ii) Block(s + (l * n + ii) * lds + (j0 - jlo)) *= f;
        if (++m == dl.per_group) m = 0, ++g;
      }
    }
  }

  // 8-bit caches: the chunk's value scales, (groups, lds), each row's weights
  // times its value head's scales as they are normalised.
  if constexpr (quant) {
    for (index_t j0 = jlo; j0 < jhi; j0 += P) {
      const index_t jn = std::min<index_t>(P, jhi - j0);
      scales_ok &= block_scales<KV, P>([&](index_t j) { return p.value_scales(sq, j); }, j0, jn,
                                       dl.groups, p.v_scale.stride(2), even_rows(j0, jn),
                                       p.v_scale.stride(1), vsc + (j0 - jlo), lds);
    }
  }

  // Exact softmax per row over its keys of the chunk, normalised in place
  // (8-bit caches: and times the value scales).
  // Meanwhile the first kValueWarmBytes of the chunk's value rows are asked
  // for (T1 hint), a few rows per score row, so that the memory does not idle
  // while the exps run and the V pass starts on rows already on their way.
  const index_t vrow_bytes = dl.groups * dv * static_cast<index_t>(sizeof(KV));
  const index_t warm_rows = std::min(jhi - jlo, kValueWarmBytes / vrow_bytes);
  const index_t warm_per_row = (warm_rows + R - 1) / R;
  for (index_t r = 0; r < R; ++r) {
    const index_t wend = std::min(jlo + warm_rows, jlo + (r + 1) * warm_per_row);
    for (index_t j = jlo + r * warm_per_row; j < wend; ++j) {
      const KV* row = p.value_row(sq, j, 0);
      for (index_t g = 0; g < dl.groups; ++g) prefetch_row<2>(row + g * vsh, dv);
    }
    const index_t ii = r % n, cnt = re[ii] - rb[ii];
    C* w = s + r * lds + (rb[ii] - jlo);
    if (p.modified || kFunctor) {  // the sink joins in decode_finish
      const index_t l = r / n;
      const index_t qh = head_map(p, l / dl.maps).q[l % dl.maps];
      if (p.modified) modify_scores(w, cnt, row_mods(p, qh), ii + sq.m - sq.n, rb[ii]);
      if constexpr (kFunctor) functor_scores(mod, w, cnt, mc.b, qh, ii + mc.ioff, rb[ii]);
    }
    // 8-bit caches: the exps by exp_scalef (softmax.hpp, relative error at
    // most 2^-21 against pexp's ~2^-23, far below the rows' quantization), an
    // int8 step's exps in 11 operations instead of about 26. Other caches
    // keep pexp: a 16-bit cache's step is bitwise the float step on its
    // widened rows.
    const RowStats<C> st = has_visible<Mod>::value ? exp_row_masked(w, cnt)
                                                   : exp_row<C, quant>(w, cnt, false);
    lse[r] = cnt > 0 ? row_lse(st) : -std::numeric_limits<C>::infinity();
    const C c = st.sum > C(0) ? C(1) / st.sum : C(0);
    if constexpr (quant) {
      const float* f = vsc + (r / (dl.per_group * n)) * lds + (rb[ii] - jlo);
      ArrayMap(w, cnt) = ArrayMap(w, cnt) * c * Eigen::Map<const Eigen::ArrayXf>(f, cnt);
    } else {
      ArrayMap(w, cnt) *= c;
    }
  }

  // o = W V, block of value rows after block; a row's keys outside its range
  // are skipped (never multiplied by a zero weight, which would turn a NaN value
  // it does not see into a NaN output).
  std::fill(o, o + R * dv, C(0));
  // Value heads read together: G consecutive kv groups, per_group n rows apart.
  const index_t vg = dv % (4 * P) == 0 ? heads_together<C>(dl.per_group, 4, 4 * P * kv_bytes) : 1;
  const index_t vahead = decode_ahead_rows(vrow_bytes);
  for (index_t j0 = jlo; j0 < jhi; j0 += P) {
    const index_t jn = std::min<index_t>(P, jhi - j0);
    block_rows([&](index_t j) { return p.value_row(sq, j, 0); }, even_rows, p.v.stride(1), j0, jn,
               jhi, vahead, rows, pre);
    index_t g0 = 0;  // kv groups [0, g0) read vg at a time
    for (; vg > 1 && g0 + vg <= dl.groups; g0 += vg)
      for (index_t ii = 0; ii < n; ++ii) {
        const index_t a = std::max(j0, rb[ii]), e = std::min(j0 + jn, re[ii]);
        if (a >= e) continue;
        const index_t r0 = g0 * dl.per_group * n + ii, gs = dl.per_group * n;
        axpy_keys_heads(vg, dl.per_group, rows + (a - j0), ii ? nullptr : pre + (a - j0), g0 * vsh,
                        vsh, e - a, dv, o + r0 * dv, n * dv, gs * dv, s + r0 * lds + (a - jlo),
                        n * lds, gs * lds);
      }
    for (index_t g = g0; g < dl.groups; ++g) {
      for (index_t ii = 0; ii < n; ++ii) {
        const index_t a = std::max(j0, rb[ii]), e = std::min(j0 + jn, re[ii]);
        if (a >= e) continue;
        const index_t r0 = g * dl.per_group * n + ii;  // rows r0 + m n, m < per_group
        axpy_keys(rows + (a - j0), ii ? nullptr : pre + (a - j0), g * vsh, e - a, dv, o + r0 * dv,
                  n * dv, s + r0 * lds + (a - jlo), n * lds, dl.per_group);
      }
    }
  }
  if (!scales_ok) p.report_bad_scale();
}

/// Final output from the merged states: out = o_1 - lambda o_2 per DIFF head
/// (o for plain), and each map's lse. Rows stored narrower than C are formed
/// in ws.row and rounded once as they are written. With attention sinks, each
/// map's merged state (o, lse) is merged once more with its sink's state (no
/// output, lse = sink), after the chunks', so a split step counts the sink
/// exactly once.
template <class T, class KV, class C>
void decode_finish(const AttentionProblem<T, KV>& p, const SeqSpan& sq, const DecodeLanes& dl,
                   const C* o, const C* lse, Workspace<C>& ws) {
  using ArrayMap = Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>;
  using ConstArrayMap = Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>;
  const index_t n = dl.n, dv = p.value_dim;
  constexpr bool same = std::is_same<T, C>::value;
  const bool sinks = !p.sinks.empty();
  C* tmp = same && !sinks ? nullptr : ws.row.get(dv);
  // The lse merged with a sink's, and the factor of the state's o.
  auto with_sink = [](C l, C sink, C& f) {
    f = C(1);
    if (std::isnan(l)) return l;
    if (l == -std::numeric_limits<C>::infinity()) {
      f = C(0);
      return sink;
    }
    const C m = std::max(l, sink);
    const C nl = m + std::log(std::exp(l - m) + std::exp(sink - m));
    f = std::exp(l - nl);
    return nl;
  };
  for (index_t oh = 0; oh < p.heads; ++oh) {
    const HeadMap hm = head_map(p, oh);
    for (index_t ii = 0; ii < n; ++ii) {
      const index_t i = sq.q0 + ii, r1 = oh * dl.maps * n + ii, r2 = r1 + n;
      T* out_row = &p.out(sq.b, i, oh, 0);
      C* dst_row = tmp;
      if constexpr (same)
        if (!sinks) dst_row = out_row;
      ArrayMap dst(dst_row, dv);
      const ConstArrayMap o1(o + r1 * dv, dv);
      if (sinks) {
        C f1 = C(1), f2 = C(1);
        const C l1 = with_sink(lse[r1], static_cast<C>(p.sinks(hm.q[0])), f1);
        if (p.has_lse()) p.lse(sq.b, hm.q[0], i) = l1;
        dst = f1 * o1;
        if (dl.maps == 2) {
          const C l2 = with_sink(lse[r2], static_cast<C>(p.sinks(hm.q[1])), f2);
          if (p.has_lse()) p.lse(sq.b, hm.q[1], i) = l2;
          dst -= (row_lambda(p, sq.b, i, oh) * f2) * ConstArrayMap(o + r2 * dv, dv);
        }
      } else {
        if (p.has_lse()) p.lse(sq.b, hm.q[0], i) = lse[r1];
        if (dl.maps == 2) {
          if (p.has_lse()) p.lse(sq.b, hm.q[1], i) = lse[r2];
          dst = o1 - row_lambda(p, sq.b, i, oh) * ConstArrayMap(o + r2 * dv, dv);
        } else {
          dst = o1;
        }
      }
      if constexpr (same) {
        if (sinks) std::memcpy(out_row, tmp, static_cast<std::size_t>(dv) * sizeof(T));
      } else {
        convert_row(tmp, dv, out_row);
      }
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
