// Sharded decoding over MPI (diffattn::mpi::*_kvcache): each rank holds a
// contiguous slice of every sequence's keys, runs the single-process kvcache
// kernel on it as plain softmax maps (V2's two maps share its kv heads, so V2
// runs as plain GQA with 2H query heads; V1 runs one call per map), exchanges
// the per-map states (o, lse) with one MPI_Allgather, and merges them on every
// rank in rank order; lambda and the sinks come after the last merge.
// Included by mpi.hpp only.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../diff_states.hpp"
#include "../../kvcache_attention.hpp"
#include "../../options.hpp"
#include "../../states.hpp"
#include "../../tensor.hpp"
#include "../core/validate.hpp"
#include "mpi_comm.hpp"
#include "mpi_ring.hpp"  // for_each_index, element

DIFFATTN_BEGIN_NAMESPACE
namespace mpi {

/// What one sharded decoding call did on the calling rank.
struct DecodeStats {
  double seconds = 0;       ///< wall time of the call
  double comm_seconds = 0;  ///< time in the collectives (length exchange, state all-gather)
  /// Time from the start of the call until this rank reached the state
  /// all-gather (its checks and its own slice's states). The rank that
  /// reached it last waited for nobody there: its comm_seconds is the
  /// collectives' own cost; another rank's exceeds that by its wait for the
  /// slower ranks (the difference of these times).
  double ready_seconds = 0;
  /// Time in the state all-gather alone (part of comm_seconds; the rest is the
  /// communicator's duplication and the argument and length exchanges).
  double exchange_seconds = 0;
  std::uint64_t state_bytes = 0;  ///< bytes of per-map states this rank contributed
  std::uint64_t keys_read = 0;    ///< cache rows (tokens) of this rank's slice that were attended
  std::uint64_t bytes_read = 0;   ///< cache bytes those rows hold (keys, values, 8-bit scales)
};

}  // namespace mpi

namespace detail {

/// 64-bit hash of a view's elements (in index order), to compare arguments
/// that every rank must pass alike without sending them.
template <class U, std::size_t R>
std::int64_t view_hash(const TensorView<U, R>& t) {
  std::uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(t.size());
  for_each_index(t.shape(), [&](const std::array<index_t, R>& idx) {
    std::uint64_t w = 0;
    const auto& x = element(t, idx);
    std::memcpy(&w, &x, std::min(sizeof(w), sizeof(x)));
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 29;
  });
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

/// A code for a storage type, so that the ranks can check they agree.
template <class S>
std::int64_t storage_code() {
  std::int64_t c = static_cast<std::int64_t>(sizeof(S)) * 16;
  if (std::is_same<S, float8_e4m3>::value) c += 1;
  if (std::is_same<S, std::int8_t>::value) c += 2;
  if (std::is_same<S, bfloat16>::value) c += 3;
  if (std::is_same<S, half>::value) c += 4;
  return c;
}

/// The keys of one slice that a block of query rows may see, in the slice's
/// own coordinates. The rows' global diagonal is `diag` keys of the slice on
/// (query i of the block sees global key (slice start + j) iff
/// -left <= j - i - diag <= right; -1 no limit). The kernel aligns its band
/// bottom-right (j - i in [m - n - L, m - n + R]); trailing keys no row sees
/// and trailing rows that see no key are dropped so that L, R >= 0 (as the
/// ring's pairs), and a limit that removes nothing becomes -1.
struct SliceBand {
  index_t n, m, left, right;
  bool empty() const { return n <= 0 || m <= 0; }
};

inline SliceBand slice_band(index_t n, index_t m, index_t diag, index_t left, index_t right) {
  SliceBand w{n, m, -1, -1};
  auto R = [&] { return right + diag - (w.m - w.n); };
  auto L = [&] { return left - diag + (w.m - w.n); };
  for (int it = 0; it < 2 && !w.empty(); ++it) {
    if (right >= 0 && R() < 0) w.m -= std::min(w.m, -R());
    if (!w.empty() && left >= 0 && L() < 0) w.n -= std::min(w.n, -L());
  }
  if (w.empty()) return w;
  w.right = right >= 0 && R() < w.n - 1 ? R() : -1;
  w.left = left >= 0 && L() < w.m - 1 ? L() : -1;
  return w;
}

/// One kernel call's worth of one sequence: query rows [row0, row0 + n) against
/// the first m keys of the slice, with the band (left, right) of the kernel;
/// alibi_shift: the global distance minus the kernel's (ALiBi, one query row).
struct SlicePiece {
  index_t b, row0, n, m, left, right, alibi_shift;
};

/// The arguments of a sharded decoding call.
template <class T, class KV>
struct ShardArgs {
  TensorView<const T, 4> q;
  TensorView<const KV, 4> k, v;
  TensorView<T, 4> out;
  TensorView<compute_t<T>, 3> lse;
  const KVCacheBatch* cache = nullptr;
};

constexpr int kShardHeader = 20;  // the fields of shard_header

/// The local checks: the single-process validation of the rank's slice (the
/// causal check on the lengths waits for the global lengths), and the header
/// the ranks must agree on.
template <class T, class KV>
std::vector<HeaderField> shard_header(const char* fn, const AttentionProblem<T, KV>& p,
                                      const AttentionOptions& o) {
  std::int64_t lambda = 0;
  if (p.kind == AttnKind::v1)
    lambda = p.lambda_heads.empty() ? bits_of(static_cast<double>(p.lambda_scalar))
                                    : view_hash(p.lambda_heads);
  if (p.kind == AttnKind::v2) lambda = view_hash(p.lambda_logit);
  if (!o.alibi_slopes.empty() && p.seqlen_q > 1 && (o.causal ? 0 : o.window_right) != 0)
    fail(fn, "alibi_slopes with ", p.seqlen_q,
         " new queries per sequence needs causal = true (or window_right = 0): a rank's keys "
         "then lie on one side of every query");
  return header_with_shapes(
      {{"the query type", storage_code<T>()},
       {"the cache type", storage_code<KV>()},
       {"the kernel (plain, V1, V2)", static_cast<std::int64_t>(p.kind)}},
      "the new queries n", p.q, p.k, p.v,
      {{"whether lse is wanted", p.has_lse() ? 1 : 0},
       {"q (its values)", view_hash(p.q)},
       {"lambda", lambda},
       {"options.causal", o.causal ? 1 : 0},
       {"options.window_left", o.window_left},
       {"options.window_right", o.window_right},
       {"options.scale", bits_of(o.scale)},
       {"options.softcap", bits_of(static_cast<double>(o.softcap))},
       {"options.alibi_slopes", o.alibi_slopes.empty() ? 0 : view_hash(o.alibi_slopes)},
       {"options.sinks", o.sinks.empty() ? 0 : view_hash(o.sinks)}});
}

/// Query heads m, m + 2, ... of a (H2) vector.
inline TensorView<const float, 1> map_slopes(const TensorView<const float, 1>& s, int m) {
  if (s.empty()) return s;
  return TensorView<const float, 1>(s.data() + m * s.stride(0), {s.shape(0) / 2},
                                    {2 * s.stride(0)});
}

/// Key heads m, m + 2, ... of an 8-bit cache's scales (V1's key heads).
inline TensorView<const float, 3> map_scales(const TensorView<const float, 3>& s, int m) {
  if (s.empty() && s.data() == nullptr) return s;
  return TensorView<const float, 3>(s.data() + m * s.stride(2),
                                    {s.shape(0), s.shape(1), s.shape(2) / 2},
                                    {s.stride(0), s.stride(1), 2 * s.stride(2)});
}

/// This rank's per-map states over its slice: o (B, n, lanes, dv) and lse
/// (B, lanes, n), lanes the kernel's query heads (2h + m for the differential
/// kernels); rows that see no key of the slice stay (0, -inf).
template <class T, class KV>
void shard_states(const AttentionProblem<T, KV>& p, const ShardArgs<T, KV>& a,
                  const AttentionOptions& options, const std::vector<SlicePiece>& pieces,
                  compute_t<T>* o_state, compute_t<T>* lse_state) {
  using C = compute_t<T>;
  const index_t B = p.batch, n = p.seqlen_q, dv = p.value_dim, lanes = p.heads * p.maps();
  // q in the compute type: the states come out unrounded, as the fused kernel keeps them.
  Tensor<C, 4> qc;
  TensorView<const C, 4> q;
  if constexpr (std::is_same<T, C>::value) {
    q = a.q;
  } else {
    qc = Tensor<C, 4>(a.q.shape());
    for_each_index(a.q.shape(), [&](const std::array<index_t, 4>& i) {
      element(qc.view(), i) = static_cast<C>(element(a.q, i));
    });
    q = qc.view();
  }
  // Pieces of one (rows, band, shift-free) shape run as one call over the batch,
  // the other sequences with no key.
  std::map<std::tuple<index_t, index_t, index_t, index_t>, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const SlicePiece& s = pieces[i];
    groups[std::make_tuple(s.row0, s.n, s.left, s.right)].push_back(i);
  }
  const KVCacheBatch& cache = *a.cache;
  std::vector<index_t> lens(static_cast<std::size_t>(B));
  for (const auto& g : groups) {
    const index_t row0 = std::get<0>(g.first), rows = std::get<1>(g.first);
    std::fill(lens.begin(), lens.end(), 0);
    for (std::size_t i : g.second) lens[static_cast<std::size_t>(pieces[i].b)] = pieces[i].m;
    KVCacheBatch cb = cache;
    cb.cache_seqlens = TensorView<const index_t, 1>(lens.data(), {B});
    AttentionOptions o;
    o.scale = options.scale;
    o.num_threads = options.num_threads;
    o.softcap = options.softcap;
    o.alibi_slopes = options.alibi_slopes;
    o.window_left = std::get<2>(g.first);
    o.window_right = std::get<3>(g.first);
    Tensor<C, 4> ot({B, rows, lanes, dv});
    Tensor<C, 3> lt({B, lanes, rows});
    const TensorView<const C, 4> qr(q.data() + row0 * q.stride(1),
                                    {B, rows, q.shape(2), q.shape(3)}, q.strides());
    if (p.kind != AttnKind::v1) {
      attention_kvcache<C, KV>(qr, a.k, a.v, ot.view(), lt.view(), cb, o);
    } else {
      for (int m = 0; m < 2; ++m) {
        AttentionOptions om = o;
        om.alibi_slopes = map_slopes(options.alibi_slopes, m);
        KVCacheBatch cm = cb;
        cm.k_scale = map_scales(cache.k_scale, m);
        const TensorView<C, 3> lm(lt.data() + m * rows, {B, p.heads, rows},
                                  {lanes * rows, 2 * rows, 1});
        attention_kvcache<C, KV>(map_heads<const C>(qr, m), map_heads<const KV>(a.k, m), a.v,
                                 map_heads<C>(ot.view(), m), lm, cm, om);
      }
    }
    for (std::size_t i : g.second) {
      const SlicePiece& s = pieces[i];
      for (index_t ii = 0; ii < rows; ++ii)
        for (index_t l = 0; l < lanes; ++l) {
          std::copy(&ot(s.b, ii, l, 0), &ot(s.b, ii, l, 0) + dv,
                    o_state + ((s.b * n + row0 + ii) * lanes + l) * dv);
          C x = lt(s.b, l, ii);
          if (s.alibi_shift != 0 && std::isfinite(x))
            x -= static_cast<C>(options.alibi_slopes(l)) * static_cast<C>(s.alibi_shift);
          lse_state[(s.b * lanes + l) * n + row0 + ii] = x;
        }
    }
  }
}

/// One sharded decoding call: checks (agreed on by every rank), the global
/// lengths, the local states, their all-gather and the merge in rank order.
template <class T, class KV, class Validate>
void sharded_kvcache_call(MPI_Comm comm, const char* fn, const ShardArgs<T, KV>& a,
                          const AttentionOptions& options, mpi::DecodeStats* stats,
                          Validate&& validate) {
  using C = compute_t<T>;
  const double t0 = mpi_now();
  double comm_s = 0;
  RingComm rc(comm, fn);
  comm_s += mpi_now() - t0;  // MPI_Comm_dup
  AttentionProblem<T, KV> p;
  bool ok = true;
  std::string message;
  std::vector<HeaderField> header(kShardHeader, HeaderField{"", 0});
  try {
    p = validate();
    header = shard_header<T, KV>(fn, p, options);
  } catch (const error& e) {
    ok = false;
    message = e.what();
  }
  double tc = mpi_now();
  agree(rc, ok, message, header);
  // Every rank's lengths: rank r's keys of sequence b start after the lower ranks'.
  const index_t B = p.batch, n = p.seqlen_q, dv = p.value_dim;
  const int W = rc.size(), me = rc.rank();
  std::vector<std::int64_t> mine(static_cast<std::size_t>(B)), all(mine.size() * W);
  for (index_t b = 0; b < B; ++b) mine[static_cast<std::size_t>(b)] = a.cache->cache_seqlens(b);
  if (B > 0)
    mpi_check(MPI_Allgather(mine.data(), mpi_count(B, fn), MPI_INT64_T, all.data(),
                            mpi_count(B, fn), MPI_INT64_T, rc.get()),
              fn, "MPI_Allgather");
  comm_s += mpi_now() - tc;
  const auto len = [&](int r, index_t b) {
    return static_cast<index_t>(all[static_cast<std::size_t>(r) * B + b]);
  };
  std::vector<index_t> start(static_cast<std::size_t>(B), 0), total(start.size(), 0);
  for (index_t b = 0; b < B; ++b)
    for (int r = 0; r < W; ++r) {
      if (r < me) start[static_cast<std::size_t>(b)] += len(r, b);
      total[static_cast<std::size_t>(b)] += len(r, b);
    }
  for (index_t b = 0; b < B; ++b) {  // the same decision on every rank
    const index_t M = total[static_cast<std::size_t>(b)];
    if (options.causal && M > 0 && M < n)
      fail(fn, "the ranks' cache_seqlens[", b, "] add up to ", M, " < the ", n,
           " new queries of q ", shape_str(p.q.shape()),
           ": with causal = true the caches must already hold their keys");
  }
  // The pieces of the local work.
  const index_t left = options.window_left, right = options.causal ? 0 : options.window_right;
  const bool alibi = !options.alibi_slopes.empty();
  std::vector<SlicePiece> pieces;
  std::uint64_t keys = 0;
  for (index_t b = 0; b < B; ++b) {
    const index_t s = start[static_cast<std::size_t>(b)], m = len(me, b);
    const index_t diag = total[static_cast<std::size_t>(b)] - n - s;  // row 0's, in slice keys
    const index_t per_row = alibi ? 1 : n;
    index_t lo = m, hi = 0;  // the keys of the slice some row sees
    for (index_t r0 = 0; r0 < n; r0 += per_row) {
      const index_t rows = std::min(per_row, n - r0);
      const SliceBand w = slice_band(rows, m, diag + r0, left, right);
      if (w.empty()) continue;
      // With ALiBi (one row, every key at or before its global diagonal) the
      // kernel's distance is m - 1 - j, the global one diag + r0 - j.
      pieces.push_back({b, r0, w.n, w.m, w.left, w.right, alibi ? diag + r0 - (w.m - 1) : 0});
      lo = std::min(lo, w.left < 0 ? 0 : std::max<index_t>(0, w.m - w.n - w.left));
      hi = std::max(hi, w.m);
    }
    if (hi > lo) keys += static_cast<std::uint64_t>(hi - lo);
  }
  std::uint64_t row_bytes =
      static_cast<std::uint64_t>(p.k.shape(2) * p.head_dim + p.v.shape(2) * p.value_dim) *
      sizeof(KV);
  if (is_8bit_storage_v<KV>)
    row_bytes += static_cast<std::uint64_t>(p.k.shape(2) + p.v.shape(2)) * 4;
  auto finish_stats = [&](std::uint64_t state_bytes) {
    if (!stats) return;
    stats->seconds = mpi_now() - t0;
    stats->comm_seconds = comm_s;
    stats->state_bytes = state_bytes;
    stats->keys_read = keys;
    stats->bytes_read = keys * row_bytes;
  };
  if (W == 1) {  // every key is local: the single-process kernel itself
    run_kvcache(fn, p, options);
    finish_stats(0);
    return;
  }
  // Local states, then one all-gather of (status, o, lse) per rank.
  const index_t lanes = p.heads * p.maps();
  const index_t o_elems = B * n * lanes * dv, l_elems = B * lanes * n;
  const index_t per_rank = 1 + o_elems + l_elems;
  std::vector<C> payload(static_cast<std::size_t>(per_rank), C(0));
  std::fill(payload.begin() + 1 + o_elems, payload.end(), -std::numeric_limits<C>::infinity());
  std::string local_error;
  try {
    shard_states<T, KV>(p, a, options, pieces, payload.data() + 1, payload.data() + 1 + o_elems);
  } catch (const std::exception& e) {
    payload[0] = C(1);
    local_error = e.what();
  }
  std::vector<C> gathered(static_cast<std::size_t>(per_rank) * W);
  tc = mpi_now();
  if (stats) stats->ready_seconds = tc - t0;
  mpi_check(MPI_Allgather(payload.data(), mpi_count(per_rank, fn), mpi_type<C>(), gathered.data(),
                          mpi_count(per_rank, fn), mpi_type<C>(), rc.get()),
            fn, "MPI_Allgather");
  const double exchange_s = mpi_now() - tc;
  comm_s += exchange_s;
  if (stats) stats->exchange_seconds = exchange_s;
  if (payload[0] != C(0)) throw error(local_error);
  for (int r = 0; r < W; ++r)
    if (gathered[static_cast<std::size_t>(r) * per_rank] != C(0))
      fail(fn, "rank ", r, " of ", W,
           " failed in its slice's step (its error says why); out and "
           "lse are left unspecified");
  // Merge in rank order (the same arithmetic on every rank), then sinks and lambda.
  C* o0 = gathered.data() + 1;
  C* l0 = o0 + o_elems;
  for (int r = 1; r < W; ++r) {
    const C* orr = gathered.data() + static_cast<std::size_t>(r) * per_rank + 1;
    const C* lr = orr + o_elems;
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < n; ++i)
        for (index_t l = 0; l < lanes; ++l) {
          const index_t row = (b * n + i) * lanes + l, li = (b * lanes + l) * n + i;
          l0[li] = merge_row<C>(o0 + row * dv, l0[li], orr + row * dv, lr[li], dv);
        }
  }
  if (!options.sinks.empty())
    for (index_t b = 0; b < B; ++b)
      for (index_t i = 0; i < n; ++i)
        for (index_t l = 0; l < lanes; ++l) {
          C& lse = l0[(b * lanes + l) * n + i];
          const C sink = static_cast<C>(options.sinks(l));
          C f = C(1);
          if (std::isnan(lse)) continue;
          if (lse == -std::numeric_limits<C>::infinity()) {
            f = C(0);
            lse = sink;
          } else {
            const C mx = std::max(lse, sink);
            const C nl = mx + std::log(std::exp(lse - mx) + std::exp(sink - mx));
            f = std::exp(lse - nl);
            lse = nl;
          }
          C* o = o0 + ((b * n + i) * lanes + l) * dv;
          for (index_t c = 0; c < dv; ++c) o[c] *= f;
        }
  const int maps = p.maps();
  for (index_t b = 0; b < B; ++b)
    for (index_t i = 0; i < n; ++i)
      for (index_t h = 0; h < p.heads; ++h) {
        const C* o1 = o0 + ((b * n + i) * lanes + h * maps) * dv;
        T* dst = &a.out(b, i, h, 0);
        if (maps == 1) {
          for (index_t c = 0; c < dv; ++c) dst[c * a.out.stride(3)] = static_cast<T>(o1[c]);
        } else {
          const C lambda = row_lambda(p, b, i, h);
          const C* o2 = o1 + dv;
          for (index_t c = 0; c < dv; ++c)
            dst[c * a.out.stride(3)] = static_cast<T>(o1[c] - lambda * o2[c]);
        }
        if (p.has_lse())
          for (int m = 0; m < maps; ++m)
            a.lse(b, h * maps + m, i) = l0[(b * lanes + h * maps + m) * n + i];
      }
  finish_stats(static_cast<std::uint64_t>(per_rank) * sizeof(C));
}

/// Options without the causal check on the rank's own lengths (done on the
/// global ones) for attach_kvcache.
inline AttentionOptions shard_local_options(const AttentionOptions& o) {
  AttentionOptions l = o;
  l.causal = false;
  return l;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
