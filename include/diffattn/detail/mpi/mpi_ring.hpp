// Ring attention over MPI: the rank's queries stay, key/value shards travel
// around the ring, every (query run, key run) pair is one call of the plain
// kernel per softmax map, and each map keeps its own (o, lse) state, merged
// exactly (states.hpp). The backward pass sends the key/value shards around
// again with their dK/dV accumulators following one step behind.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../attention.hpp"
#include "../../attention_backward.hpp"
#include "../../config.hpp"
#include "../../states.hpp"
#include "../../tensor.hpp"
#include "../backward/attention_backward.hpp"
#include "../core/validate.hpp"
#include "../kernel/score_mods.hpp"
#include "mpi_comm.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// A run of consecutive tokens of a shard: global position of its first token,
/// its first local row, its length.
struct ShardRun {
  index_t global, local, len;
};

/// The runs of rank `rank`'s shard of n_local tokens: contiguous, one run at
/// rank * n_local; zigzag, chunks rank and 2 world - 1 - rank of n_local / 2.
inline std::vector<ShardRun> shard_runs(index_t n_local, int rank, int world, bool zigzag) {
  const index_t r = rank, w = world;
  if (!zigzag) return {{r * n_local, 0, n_local}};
  const index_t c = n_local / 2;
  return {{r * c, 0, c}, {(2 * w - 1 - r) * c, c, c}};
}

/// Global row of local row l.
inline index_t global_row(const std::vector<ShardRun>& runs, index_t l) {
  for (const ShardRun& s : runs)
    if (l >= s.local && l < s.local + s.len) return s.global + (l - s.local);
  return -1;
}

/// The part of a (query run, key run) pair that the global band (left, right;
/// -1 no limit) lets take part, as rows [q0, q0 + n) and keys [k0, k0 + m) of
/// the two shards, and the window of the plain kernel on them.
///
/// With D = (global start of the queries) - (global start of the keys), query
/// row i and key row j are visible iff -left <= j - i - D <= right; the kernel
/// aligns bottom-right, j - i in [m - n - L, m - n + R], so R = right + D -
/// (m - n) and L = left - D + (m - n). The kernel takes limits >= 0 (or -1, no
/// limit): a negative R means the last -R keys are seen by no row, a negative
/// L that the last -L rows see no key; dropping them gives R, L >= 0 (R + L =
/// left + right is fixed). A pair whose rows or keys all drop is skipped.
struct PairWindow {
  index_t q0, n, k0, m, left, right;
  bool empty() const { return n <= 0 || m <= 0; }
};

inline PairWindow pair_window(const ShardRun& qr, const ShardRun& kr, index_t left, index_t right) {
  PairWindow w{qr.local, qr.len, kr.local, kr.len, -1, -1};
  const index_t D = qr.global - kr.global;
  auto R = [&] { return right + D - (w.m - w.n); };
  auto L = [&] { return left - D + (w.m - w.n); };
  for (int it = 0; it < 2 && !w.empty(); ++it) {
    if (right >= 0 && R() < 0) w.m -= std::min(w.m, -R());
    if (!w.empty() && left >= 0 && L() < 0) w.n -= std::min(w.n, -L());
  }
  if (!w.empty()) {
    w.right = right >= 0 ? R() : -1;
    w.left = left >= 0 ? L() : -1;
    DIFFATTN_ASSERT(w.right >= -1 && w.left >= -1);
  }
  return w;
}

/// Calls f(index) for every index of `shape`, last axis fastest.
template <std::size_t R, class F>
void for_each_index(const std::array<index_t, R>& shape, F&& f) {
  for (index_t e : shape)
    if (e <= 0) return;
  std::array<index_t, R> idx{};
  for (;;) {
    f(idx);
    std::size_t r = R;
    for (;;) {
      if (r == 0) return;
      --r;
      if (++idx[r] < shape[r]) break;
      idx[r] = 0;
    }
  }
}

/// The element of t at a multi-index.
template <class U, std::size_t R>
U& element(const TensorView<U, R>& t, const std::array<index_t, R>& idx) {
  index_t off = 0;
  for (std::size_t r = 0; r < R; ++r) off += idx[r] * t.stride(r);
  return t.data()[off];
}

/// Rows [r0, r0 + len) of a (B, N, H, D) view.
template <class U>
TensorView<U, 4> rows_of(const TensorView<U, 4>& t, index_t r0, index_t len) {
  return TensorView<U, 4>(t.data() + r0 * t.stride(1), {t.shape(0), len, t.shape(2), t.shape(3)},
                          t.strides());
}
/// Rows [r0, r0 + len) of a (B, H, N) view.
template <class U>
TensorView<U, 3> rows_of(const TensorView<U, 3>& t, index_t r0, index_t len) {
  return TensorView<U, 3>(t.data() + r0 * t.stride(2), {t.shape(0), t.shape(1), len}, t.strides());
}

/// The context-parallel problem as one rank sees it, checked.
template <class T>
struct RingProblem {
  AttnKind kind = AttnKind::plain;
  TensorView<const T, 4> q, k, v;  // the rank's shard
  index_t B = 0, n = 0, d = 0, dv = 0;
  index_t H = 0;    // output heads (plain: Hq), the query heads of one map
  index_t Hkv = 0;  // kv groups: value heads, and key heads of one map
  index_t Hk = 0;   // key heads of k: 2 Hkv for V1, else Hkv
  double scale = 1;
  index_t left = -1, right = -1;  // the global band
  int threads = 0;
  bool zigzag = true;
  // Score modifiers: the softcap goes to every pair call; the ALiBi slopes
  // (with global positions) through RingMod; each map's sinks are merged once
  // into its final state (ring_forward) and differentiated by the driver.
  double softcap = 0;
  TensorView<const float, 1> alibi_slopes, sinks;  // (Hq) or empty

  int maps() const { return kind == AttnKind::plain ? 1 : 2; }
  /// The query head (of q, (Hq)) of map m's head h: 2h + m, or h for plain.
  index_t qhead(int m, index_t h) const { return kind == AttnKind::plain ? h : 2 * h + m; }
  /// Map m's query heads, (B, n, H, d): V1 and V2 heads 2h + m.
  TensorView<const T, 4> q_map(int m) const {
    if (kind == AttnKind::plain) return q;
    return TensorView<const T, 4>(q.data() + m * q.stride(2), {B, n, H, d},
                                  {q.stride(0), q.stride(1), 2 * q.stride(2), q.stride(3)});
  }
  /// Elements of a travelling block: k (B, n, Hk, d) then v (B, n, Hkv, dv).
  index_t k_elems() const { return B * n * Hk * d; }
  index_t block_elems() const { return k_elems() + B * n * Hkv * dv; }
  /// Map m's key heads in a block, rows [r0, r0 + len): (B, len, Hkv, d).
  template <class U>
  TensorView<U, 4> k_map(U* block, int m, index_t r0, index_t len) const {
    const index_t hs = kind == AttnKind::v1 ? 2 * d : d;
    return TensorView<U, 4>(block + r0 * Hk * d + (kind == AttnKind::v1 ? m * d : 0),
                            {B, len, Hkv, d}, {n * Hk * d, Hk * d, hs, 1});
  }
  /// Values in a block, rows [r0, r0 + len): (B, len, Hkv, dv).
  template <class U>
  TensorView<U, 4> v_rows(U* block, index_t r0, index_t len) const {
    return TensorView<U, 4>(block + k_elems() + r0 * Hkv * dv, {B, len, Hkv, dv},
                            {n * Hkv * dv, Hkv * dv, dv, 1});
  }
  /// The kernel options of one pair.
  AttentionOptions pair_options(const PairWindow& w) const {
    AttentionOptions o;
    o.scale = scale;
    o.num_threads = threads;
    o.window_left = w.left;
    o.window_right = w.right;
    o.softcap = static_cast<float>(softcap);
    return o;
  }
};

/// The functor of one pair call: the kernel's query head h of a map's view,
/// and its rows i and keys j within the pair, become the caller's query head
/// and global positions; ALiBi (kAlibi) subtracts slope |i - j| over global
/// positions, then the user's functor (NoScoreMod: none) sees them. A member
/// exists only where the kernel must call it, so a pair without ALiBi and a
/// user functor without `score` keep the kernels' cheaper paths.
template <class Mod, bool kAlibi>
struct RingMod {
  const Mod* user = nullptr;
  TensorView<const float, 1> slopes;  // (Hq), with kAlibi
  index_t gq0 = 0, gk0 = 0;           // global positions of the pair's first query and key
  index_t hmul = 1, hadd = 0;         // query head = hmul h + hadd

  index_t head(index_t h) const { return hmul * h + hadd; }
  template <class S>
  S alibi(S s, index_t qh, index_t gi, index_t gj) const {
    if constexpr (kAlibi) s -= static_cast<S>(slopes(qh)) * static_cast<S>(std::abs(gi - gj));
    (void)qh, (void)gi, (void)gj;
    return s;
  }
  template <class S, bool A = kAlibi, std::enable_if_t<A || has_score<Mod, S>::value, int> = 0>
  S score(S s, index_t b, index_t h, index_t i, index_t j) const {
    const index_t qh = head(h), gi = gq0 + i, gj = gk0 + j;
    s = alibi(s, qh, gi, gj);
    if constexpr (has_score<Mod, S>::value) s = user->score(s, b, qh, gi, gj);
    (void)b;
    return s;
  }
  // d score / d s: ALiBi's is 1; a user score without dscore leaves this out,
  // so the backward's own static_assert names what is missing.
  template <
      class S, bool A = kAlibi,
      std::enable_if_t<has_dscore<Mod, S>::value || (A && !has_score<Mod, S>::value), int> = 0>
  S dscore(S s, index_t b, index_t h, index_t i, index_t j) const {
    if constexpr (has_dscore<Mod, S>::value) {
      const index_t qh = head(h), gi = gq0 + i, gj = gk0 + j;
      return user->dscore(alibi(s, qh, gi, gj), b, qh, gi, gj);
    } else {
      (void)s, (void)b, (void)h, (void)i, (void)j;
      return S(1);
    }
  }
  template <class M = Mod, std::enable_if_t<has_visible<M>::value, int> = 0>
  bool visible(index_t b, index_t h, index_t i, index_t j) const {
    return static_cast<bool>(user->visible(b, head(h), gq0 + i, gk0 + j));
  }
  template <class M = Mod, std::enable_if_t<has_visible_block<M>::value, int> = 0>
  int visible_block(index_t b, index_t h, index_t i0, index_t i1, index_t j0, index_t j1) const {
    return static_cast<int>(
        user->visible_block(b, head(h), gq0 + i0, gq0 + i1, gk0 + j0, gk0 + j1));
  }
  template <class M = Mod, std::enable_if_t<has_visible_range<M>::value, int> = 0>
  std::pair<index_t, index_t> visible_range(index_t b, index_t h, index_t i) const {
    const std::pair<index_t, index_t> r = user->visible_range(b, head(h), gq0 + i);
    return {r.first - gk0, r.second - gk0};
  }
};

/// Calls f with the functor of map m's pair of query run qr and key run kr:
/// the user's NoScoreMod itself when there is neither ALiBi nor a user
/// functor (the kernels without one, as before), else a RingMod. m = -1: a
/// call of the fused kernel on q's own heads (both maps at once).
template <class T, class Mod, class F>
void with_pair_mod(const RingProblem<T>& rp, const Mod& mod, int m, const ShardRun& qr,
                   const ShardRun& kr, F&& f) {
  const bool alibi = !rp.alibi_slopes.empty();
  auto make = [&](auto tag) {
    RingMod<Mod, decltype(tag)::value> r;
    r.user = &mod;
    r.slopes = rp.alibi_slopes;
    r.gq0 = qr.global;
    r.gk0 = kr.global;
    r.hmul = rp.kind == AttnKind::plain || m < 0 ? 1 : 2;
    r.hadd = rp.kind == AttnKind::plain || m < 0 ? 0 : m;
    return r;
  };
  if (alibi) {
    f(make(std::true_type()));
  } else if constexpr (is_active_mod<Mod, T>) {
    f(make(std::false_type()));
  } else {
    f(mod);
  }
}

/// Calls f(qr, kr, w, opt) for every pair of a run of the rank's queries
/// (qruns) and a run of rank src's keys that the band lets take part: w the
/// pair's part, opt its kernel options.
template <class T, class F>
void for_each_pair(const RingProblem<T>& rp, const std::vector<ShardRun>& qruns, int src, int world,
                   F&& f) {
  for (const ShardRun& qr : qruns)
    for (const ShardRun& kr : shard_runs(rp.n, src, world, rp.zigzag)) {
      const PairWindow w = pair_window(qr, kr, rp.left, rp.right);
      if (!w.empty()) f(qr, kr, w, rp.pair_options(w));
    }
}

/// The local k and v in one contiguous block.
template <class T>
void pack_block(const RingProblem<T>& rp, T* block) {
  T* kb = block;
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i)
      for (index_t h = 0; h < rp.Hk; ++h, kb += rp.d)
        std::copy(&rp.k(b, i, h, 0), &rp.k(b, i, h, 0) + rp.d, kb);
  T* vb = block + rp.k_elems();
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i)
      for (index_t h = 0; h < rp.Hkv; ++h, vb += rp.dv)
        std::copy(&rp.v(b, i, h, 0), &rp.v(b, i, h, 0) + rp.dv, vb);
}

/// The rank's dk (B, n, Hk, d) and dv (B, n, Hkv, dv) from their sum in
/// block layout (as pack_block lays out k and v).
template <class T>
void write_kv_grads(const RingProblem<T>& rp, const Tensor<T, 1>& grad,
                    const BackwardProblem<T>& bp) {
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i) {
      const T* gk = grad.data() + (b * rp.n + i) * rp.Hk * rp.d;
      for (index_t h = 0; h < rp.Hk; ++h)
        std::copy(gk + h * rp.d, gk + (h + 1) * rp.d, &bp.dk(b, i, h, 0));
      const T* gv = grad.data() + rp.k_elems() + (b * rp.n + i) * rp.Hkv * rp.dv;
      for (index_t h = 0; h < rp.Hkv; ++h)
        std::copy(gv + h * rp.dv, gv + (h + 1) * rp.dv, &bp.dv(b, i, h, 0));
    }
}

constexpr int kTagBlock = 7201;  // key/value blocks
constexpr int kTagGrad = 7202;   // dK/dV accumulators

/// Forward ring: for each map in `maps`, the rank's merged state over all
/// keys, o[i] (B, n, H, dv) and lse[i] (B, H, n), with the map's sinks merged
/// into it once at the end (a state o = 0, lse = sink).
template <class T, class Mod = NoScoreMod>
void ring_forward(const RingProblem<T>& rp, RingComm& rc, const std::vector<int>& maps,
                  std::vector<Tensor<T, 4>>& o, std::vector<Tensor<T, 3>>& lse,
                  const Mod& mod = Mod()) {
  const int W = rc.size();
  o.clear();
  lse.clear();
  for (std::size_t i = 0; i < maps.size(); ++i) {
    o.emplace_back(std::array<index_t, 4>{rp.B, rp.n, rp.H, rp.dv});
    lse.emplace_back(std::array<index_t, 3>{rp.B, rp.H, rp.n});
    lse.back().fill(-std::numeric_limits<T>::infinity());
  }
  Tensor<T, 1> block[2] = {Tensor<T, 1>({rp.block_elems()}),
                           Tensor<T, 1>({W > 1 ? rp.block_elems() : 0})};
  pack_block(rp, block[0].data());
  Tensor<T, 4> ob({rp.B, rp.n, rp.H, rp.dv});  // one pair's state
  Tensor<T, 3> lb({rp.B, rp.H, rp.n});
  const auto qruns = shard_runs(rp.n, rc.rank(), W, rp.zigzag);
  for (int s = 0; s < W; ++s) {
    const int cur = s % 2, src = (rc.rank() - s + W) % W;
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (s + 1 < W) {  // the next block arrives while this one is computed
      rc.irecv(block[1 - cur].data(), rp.block_elems(), rc.left(), kTagBlock, &req[0]);
      rc.isend(block[cur].data(), rp.block_elems(), rc.right(), kTagBlock, &req[1]);
    }
    const T* kv = block[cur].data();
    for_each_pair(
        rp, qruns, src, W,
        [&](const ShardRun& qr, const ShardRun& kr, const PairWindow& w,
            const AttentionOptions& opt) {
          const TensorView<T, 4> obv(ob.data(), {rp.B, w.n, rp.H, rp.dv}, ob.view().strides());
          const TensorView<T, 3> lbv(lb.data(), {rp.B, rp.H, w.n}, lb.view().strides());
          for (std::size_t mi = 0; mi < maps.size(); ++mi) {
            with_pair_mod(rp, mod, maps[mi], qr, kr, [&](const auto& pm) {
              attention<T>(rows_of(rp.q_map(maps[mi]), w.q0, w.n),
                           rp.k_map(kv, maps[mi], w.k0, w.m), rp.v_rows(kv, w.k0, w.m), obv, lbv,
                           opt, pm);
            });
            merge_states<T>(rows_of(o[mi].view(), w.q0, w.n), rows_of(lse[mi].view(), w.q0, w.n),
                            obv, lbv, rp.threads);
          }
          rc.poke(req, 2);
        });
    rc.wait(req, 2);
  }
  if (rp.sinks.empty()) return;
  const std::vector<T> zero(static_cast<std::size_t>(rp.dv), T(0));
  for (std::size_t mi = 0; mi < maps.size(); ++mi)
    for (index_t b = 0; b < rp.B; ++b)
      for (index_t h = 0; h < rp.H; ++h) {
        const T sink = static_cast<T>(rp.sinks(rp.qhead(maps[mi], h)));
        for (index_t i = 0; i < rp.n; ++i)
          lse[mi](b, h, i) = merge_row<T>(rp.dv > 0 ? &o[mi](b, i, h, 0) : nullptr,
                                          lse[mi](b, h, i), zero.data(), sink, rp.dv);
      }
}

/// Backward ring. Per map m: o_m and lse_m the final merged state, dout_m the
/// gradient of o_m, delta_m = dout_m . o_m (B, H, n). Accumulates dq_m (B, n,
/// H, d) (zeroed by the caller) and writes the rank's own dk (B, n, Hk, d) and
/// dv (B, n, Hkv, dv) (the sum over both maps). Under sinks lse_m and o_m
/// hold them and delta_m = dout_m . o_m stays the row's constant: the sink's
/// column has no value, so dS = P (dP - delta) over the keys is unchanged;
/// the pair calls get no sinks (the driver differentiates them once per row).
template <class T, class Mod = NoScoreMod>
void ring_backward(const RingProblem<T>& rp, RingComm& rc,
                   const std::vector<TensorView<const T, 4>>& o_m,
                   const std::vector<TensorView<const T, 3>>& lse_m,
                   const std::vector<TensorView<const T, 4>>& dout_m,
                   const std::vector<TensorView<const T, 3>>& delta_m,
                   std::vector<Tensor<T, 4>>& dq_m, Tensor<T, 1>& grad, const Mod& mod = Mod()) {
  const int W = rc.size(), maps = rp.maps();
  const index_t elems = rp.block_elems();
  Tensor<T, 1> block[2] = {Tensor<T, 1>({elems}), Tensor<T, 1>({W > 1 ? elems : 0})};
  pack_block(rp, block[0].data());
  // The rank's contribution to the block at hand, the accumulator that
  // arrives for it, and two outgoing accumulators (one may still be in flight).
  Tensor<T, 1> contrib({elems}), incoming({W > 1 ? elems : 0});
  Tensor<T, 1> outgoing[2] = {Tensor<T, 1>({W > 1 ? elems : 0}), Tensor<T, 1>({W > 1 ? elems : 0})};
  MPI_Request out_req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  Tensor<T, 4> dq_t({rp.B, rp.n, rp.H, rp.d});
  Tensor<T, 4> dk_t({rp.B, rp.n, rp.Hkv, rp.d});
  Tensor<T, 4> dv_t({rp.B, rp.n, rp.Hkv, rp.dv});
  const auto qruns = shard_runs(rp.n, rc.rank(), W, rp.zigzag);
  for (int s = 0; s < W; ++s) {
    const int cur = s % 2, src = (rc.rank() - s + W) % W;
    MPI_Request req[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (s + 1 < W) {
      rc.irecv(block[1 - cur].data(), elems, rc.left(), kTagBlock, &req[0]);
      rc.isend(block[cur].data(), elems, rc.right(), kTagBlock, &req[1]);
    }
    // The left neighbour's accumulator of this block, sent after its step s - 1.
    if (s > 0) rc.irecv(incoming.data(), elems, rc.left(), kTagGrad, &req[2]);
    contrib.fill(T(0));
    T* kv = block[cur].data();
    for_each_pair(
        rp, qruns, src, W,
        [&](const ShardRun& qr, const ShardRun& kr, const PairWindow& w,
            const AttentionOptions& opt) {
          const TensorView<T, 4> dq_v(dq_t.data(), {rp.B, w.n, rp.H, rp.d}, dq_t.view().strides());
          const TensorView<T, 4> dk_v(dk_t.data(), {rp.B, w.m, rp.Hkv, rp.d},
                                      dk_t.view().strides());
          const TensorView<T, 4> dv_v(dv_t.data(), {rp.B, w.m, rp.Hkv, rp.dv},
                                      dv_t.view().strides());
          for (int m = 0; m < maps; ++m) {
            BackwardProblem<T> bp = backward_plain<T>(
                rows_of(rp.q_map(m), w.q0, w.n), rp.k_map(static_cast<const T*>(kv), m, w.k0, w.m),
                rp.v_rows(static_cast<const T*>(kv), w.k0, w.m), rows_of(o_m[m], w.q0, w.n),
                rows_of(lse_m[m], w.q0, w.n), rows_of(dout_m[m], w.q0, w.n), dq_v, dk_v, dv_v, opt,
                rc.fn());
            bp.delta = rows_of(delta_m[m], w.q0, w.n);
            with_pair_mod(rp, mod, m, qr, kr,
                          [&](const auto& pm) { run_attention_backward(bp, opt, pm); });
            const TensorView<T, 4> dq_acc = rows_of(dq_m[m].view(), w.q0, w.n);
            for (index_t b = 0; b < rp.B; ++b)
              for (index_t i = 0; i < w.n; ++i)
                for (index_t h = 0; h < rp.H; ++h)
                  for (index_t t = 0; t < rp.d; ++t) dq_acc(b, i, h, t) += dq_v(b, i, h, t);
            const TensorView<T, 4> dk_acc = rp.k_map(contrib.data(), m, w.k0, w.m);
            const TensorView<T, 4> dv_acc = rp.v_rows(contrib.data(), w.k0, w.m);
            for (index_t b = 0; b < rp.B; ++b)
              for (index_t j = 0; j < w.m; ++j)
                for (index_t h = 0; h < rp.Hkv; ++h) {
                  for (index_t t = 0; t < rp.d; ++t) dk_acc(b, j, h, t) += dk_v(b, j, h, t);
                  for (index_t t = 0; t < rp.dv; ++t) dv_acc(b, j, h, t) += dv_v(b, j, h, t);
                }
          }
          rc.poke(req, 3);
        });
    if (W == 1) {
      grad = contrib;
      break;
    }
    // This block's accumulator: what came from the left plus ours, to the right
    // (after the last step the right neighbour is the block's owner).
    rc.wait(&req[2], 1);
    rc.wait(&out_req[cur], 1);
    T* out = outgoing[cur].data();
    const T* a = contrib.data();
    const T* in = incoming.data();
    if (s > 0)
      for (index_t e = 0; e < elems; ++e) out[e] = a[e] + in[e];
    else
      std::copy(a, a + elems, out);
    rc.isend(out, elems, rc.right(), kTagGrad, &out_req[cur]);
    rc.wait(req, 2);
  }
  if (W > 1) {
    MPI_Request last = MPI_REQUEST_NULL;
    rc.irecv(incoming.data(), elems, rc.left(), kTagGrad, &last);
    rc.wait(&last, 1);
    rc.wait(out_req, 2);
    grad = incoming;
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
