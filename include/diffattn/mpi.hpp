// Context parallelism over MPI (ring attention): one sequence split across the
// ranks of a communicator, forward and backward. CMake target diffattn::mpi,
// present when find_package(MPI COMPONENTS CXX) succeeds; the rest of the
// library never includes MPI.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.hpp"
#include "attention_backward.hpp"
#include "config.hpp"
#include "detail/mpi_comm.hpp"
#include "detail/mpi_ring.hpp"
#include "detail/traits.hpp"
#include "detail/validate.hpp"
#include "lambda.hpp"
#include "options.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace mpi {

/// \defgroup mpi Context parallelism over MPI
///
/// Self-attention over one global sequence of N tokens split across the W
/// ranks of `comm`. Every tensor argument is a view of the calling rank's
/// shard, shaped as the single-process kernel's with n = N / W tokens (lse
/// (B, Hq, n) of the rank's rows). Results equal the single-process kernel's
/// on the gathered sequence, to rounding.
///
/// Sharding (N = 8 tokens t0..t7, W = 2 ranks):
///   contiguous: rank 0 holds t0 t1 t2 t3, rank 1 holds t4 t5 t6 t7
///   zigzag:     the sequence is cut into 2W chunks c0..c3 of N / 2W tokens;
///               rank r holds chunk r followed by chunk 2W - 1 - r:
///               rank 0 holds c0 c3 = t0 t1 t6 t7, rank 1 holds c1 c2 = t2 t3 t4 t5
/// Under a causal mask the late tokens see the most keys; zigzag gives each
/// rank one early and one late chunk, so the ranks do the same work.
///
/// `causal` and the windows (window_left, window_right) refer to global
/// positions: token i sees token j iff i - window_left <= j <= i + window_right
/// (causal: window_right = 0; -1 drops a limit). Pairs of chunks outside the
/// band are never computed.
///
/// Algorithm: ring attention. Each rank keeps its queries; the key/value
/// shards travel around the ring (MPI_Isend / MPI_Irecv to the neighbours),
/// the next one arriving while the current one is computed. Each softmax map
/// keeps its own (o, lse) state, merged exactly (merge_states); lambda is
/// subtracted after the last merge. The differential kernels run each map on
/// the plain kernel, so V1 does 1.5x the arithmetic of the fused
/// single-process kernel (two products with the 2d-wide values instead of
/// one), V2 4/3 x.
///
/// Collective: every rank of `comm` must call with the same options, lambda,
/// sharding and shard shapes. Before any ring traffic the ranks exchange these
/// (one MPI_Allgather); a bad argument on any rank, or a disagreement, throws
/// diffattn::error on every rank (never a hang). MPI failures become
/// diffattn::error too (the calls run on a duplicate of `comm` with
/// MPI_ERRORS_RETURN). A communicator of one rank is the single-process case.
/// Storage: float or double.
/// @{

/// How the global sequence is split across the ranks (see above).
enum class Sharding { contiguous, zigzag };

/// What one call did on the calling rank: wall time, time blocked in MPI
/// (waiting for a block or an accumulator, the allreduce of dlambda), bytes it
/// sent, ring steps.
struct RingStats {
  double seconds = 0;
  double wait_seconds = 0;
  std::uint64_t bytes_sent = 0;
  int steps = 0;
};

}  // namespace mpi

namespace detail {

inline const char* sharding_name(mpi::Sharding s) {
  return s == mpi::Sharding::zigzag ? "zigzag" : "contiguous";
}

/// Local checks shared by every entry point; the header every rank must agree on.
template <class T>
std::vector<HeaderField> ring_header(const char* fn, const AttentionProblem<T>& p,
                                     const AttentionOptions& o, mpi::Sharding s, double lambda) {
  if (p.seqlen_k != p.seqlen_q)
    fail(fn, "q holds ", p.seqlen_q, " tokens and k ", p.seqlen_k,
         ": self-attention over one sequence needs the same shard of tokens in q, k and v (q ",
         shape_str(p.q.shape()), ", k ", shape_str(p.k.shape()), ")");
  if (s == mpi::Sharding::zigzag && p.seqlen_q % 2 != 0)
    fail(fn, "zigzag sharding needs an even number of tokens per rank (two chunks of N / 2W), got ",
         p.seqlen_q, " (q ", shape_str(p.q.shape()), "); N must be a multiple of 2W");
  return {{"the scalar size", static_cast<std::int64_t>(sizeof(T))},
          {"the batch size B", p.q.shape(0)},
          {"the tokens per rank", p.q.shape(1)},
          {"the query heads", p.q.shape(2)},
          {"the key heads", p.k.shape(2)},
          {"the value heads", p.v.shape(2)},
          {"the head width d", p.q.shape(3)},
          {"the value width", p.v.shape(3)},
          {"options.causal", o.causal ? 1 : 0},
          {"options.window_left", o.window_left},
          {"options.window_right", o.window_right},
          {"options.scale", bits_of(o.scale)},
          {"lambda", bits_of(lambda)},
          {"the sharding", static_cast<std::int64_t>(s)}};
}

template <class T>
RingProblem<T> ring_problem(const AttentionProblem<T>& p, const AttentionOptions& o,
                            mpi::Sharding s) {
  RingProblem<T> rp;
  rp.kind = p.kind;
  rp.q = p.q;
  rp.k = p.k;
  rp.v = p.v;
  rp.B = p.batch;
  rp.n = p.seqlen_q;
  rp.d = p.head_dim;
  rp.dv = p.value_dim;
  rp.H = p.heads;
  rp.Hkv = p.heads / p.group;
  rp.Hk = p.k.shape(2);
  rp.scale = effective_scale(o, p.head_dim);
  rp.left = o.window_left;
  rp.right = o.causal ? 0 : o.window_right;
  rp.threads = o.num_threads;
  rp.zigzag = s == mpi::Sharding::zigzag;
  return rp;
}

/// Runs the local checks (validate) on every rank, then agrees; returns the
/// problem on every rank or throws on every rank.
template <class F>
auto checked_collective(RingComm& rc, F&& validate) -> decltype(validate()) {
  using R = decltype(validate());
  R result{};
  bool ok = true;
  std::string message;
  try {
    result = validate();
  } catch (const error& e) {
    ok = false;
    message = e.what();
  }
  agree(rc, ok, message, ok ? result.header : std::vector<HeaderField>(result.header.size()));
  return result;
}

template <class T>
struct CheckedRing {
  AttentionProblem<T> p;
  BackwardProblem<T> bp;
  std::vector<HeaderField> header = std::vector<HeaderField>(14);
};

inline void finish_stats(mpi::RingStats* stats, const RingComm& rc, double t0) {
  if (!stats) return;
  stats->seconds = mpi_now() - t0;
  stats->wait_seconds = rc.wait_seconds;
  stats->bytes_sent = rc.bytes_sent;
  stats->steps = rc.size();
}

/// The forward of any kind: states per map, then out and lse.
template <class T>
void ring_attention_forward(RingComm& rc, const AttentionProblem<T>& p,
                            const AttentionOptions& options, mpi::Sharding s) {
  if (rc.size() == 1) {  // every key is local: the fused kernel, exactly
    run_attention<T>(p, options);
    return;
  }
  const RingProblem<T> rp = ring_problem(p, options, s);
  std::vector<int> maps = rp.maps() == 2 ? std::vector<int>{0, 1} : std::vector<int>{0};
  std::vector<Tensor<T, 4>> o;
  std::vector<Tensor<T, 3>> lse;
  ring_forward(rp, rc, maps, o, lse);
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i)
      for (index_t h = 0; h < rp.H; ++h) {
        T* dst = &p.out(b, i, h, 0);
        const T* o1 = &o[0](b, i, h, 0);
        if (rp.maps() == 1) {
          std::copy(o1, o1 + rp.dv, dst);
        } else {
          const T lambda = row_lambda(p, b, i, h);
          const T* o2 = &o[1](b, i, h, 0);
          for (index_t c = 0; c < rp.dv; ++c) dst[c] = o1[c] - lambda * o2[c];
        }
        if (p.has_lse())
          for (int m = 0; m < rp.maps(); ++m)
            p.lse(b, rp.maps() == 2 ? 2 * h + m : h, i) = lse[static_cast<std::size_t>(m)](b, h, i);
      }
}

/// The backward of any kind. For the differential kernels o2 (map 2's
/// normalised output) is recomputed by a forward ring of map 2 alone, and
/// o1 = out + lambda o2; then D_m = dO_m . o_m with dO_1 = dO, dO_2 = -lambda dO.
/// Returns the local sum over rows of -dO . o2 (V1's dlambda before the allreduce).
template <class T>
double ring_attention_backward(RingComm& rc, const BackwardProblem<T>& bp,
                               const AttentionOptions& options, mpi::Sharding s) {
  if (rc.size() == 1) {  // every key is local: the fused backward, exactly
    run_attention_backward(bp, options);
    return bp.fwd.kind == AttnKind::v1 ? static_cast<double>(bp.dlambda(0)) : 0.0;
  }
  const AttentionProblem<T>& p = bp.fwd;
  const RingProblem<T> rp = ring_problem(p, options, s);
  const int maps = rp.maps();
  const std::array<index_t, 4> oshape = {rp.B, rp.n, rp.H, rp.dv};
  std::vector<Tensor<T, 4>> o, o2;
  std::vector<Tensor<T, 3>> lse_re;
  std::vector<TensorView<const T, 4>> o_m, dout_m;
  std::vector<TensorView<const T, 3>> lse_m, delta_m;
  Tensor<T, 4> o1({0, 0, 0, 0}), dout2({0, 0, 0, 0});
  double dlambda_sum = 0;
  if (maps == 1) {
    o_m.push_back(p.out);
    dout_m.push_back(bp.dout);
    lse_m.push_back(p.lse);
  } else {
    ring_forward(rp, rc, {1}, o2, lse_re);
    o1 = Tensor<T, 4>(oshape);
    dout2 = Tensor<T, 4>(oshape);
    for (index_t b = 0; b < rp.B; ++b)
      for (index_t i = 0; i < rp.n; ++i)
        for (index_t h = 0; h < rp.H; ++h) {
          const T lambda = row_lambda(p, b, i, h);
          double e = 0;
          for (index_t c = 0; c < rp.dv; ++c) {
            const T x2 = o2[0](b, i, h, c), g = bp.dout(b, i, h, c);
            o1(b, i, h, c) = p.out(b, i, h, c) + lambda * x2;
            dout2(b, i, h, c) = -lambda * g;
            e += static_cast<double>(g) * static_cast<double>(x2);
          }
          if (p.kind == AttnKind::v2)
            bp.dlambda_logit(b, i, h) = static_cast<T>(-e * lambda * (T(1) - lambda));
          else
            dlambda_sum -= e;
        }
    o_m = {o1.view(), o2[0].view()};
    dout_m = {bp.dout, dout2.view()};
    const TensorView<const T, 3> l = p.lse;
    for (int m = 0; m < 2; ++m)
      lse_m.push_back(TensorView<const T, 3>(l.data() + m * l.stride(1), {rp.B, rp.H, rp.n},
                                             {l.stride(0), 2 * l.stride(1), l.stride(2)}));
  }
  std::vector<Tensor<T, 3>> delta;
  for (int m = 0; m < maps; ++m) {
    delta.emplace_back(std::array<index_t, 3>{rp.B, rp.H, rp.n});
    for (index_t b = 0; b < rp.B; ++b)
      for (index_t h = 0; h < rp.H; ++h)
        for (index_t i = 0; i < rp.n; ++i) {
          double acc = 0;
          for (index_t c = 0; c < rp.dv; ++c)
            acc += static_cast<double>(dout_m[m](b, i, h, c)) *
                   static_cast<double>(o_m[m](b, i, h, c));
          delta.back()(b, h, i) = static_cast<T>(acc);
        }
  }
  for (const auto& t : delta) delta_m.push_back(t.view());
  std::vector<Tensor<T, 4>> dq_m;
  for (int m = 0; m < maps; ++m) dq_m.emplace_back(std::array<index_t, 4>{rp.B, rp.n, rp.H, rp.d});
  Tensor<T, 1> grad;
  ring_backward(rp, rc, o_m, lse_m, dout_m, delta_m, dq_m, grad);
  // Gradients to the caller's layout.
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i) {
      for (int m = 0; m < maps; ++m)
        for (index_t h = 0; h < rp.H; ++h)
          std::copy(&dq_m[m](b, i, h, 0), &dq_m[m](b, i, h, 0) + rp.d,
                    &bp.dq(b, i, maps == 2 ? 2 * h + m : h, 0));
      const T* gk = grad.data() + (b * rp.n + i) * rp.Hk * rp.d;
      for (index_t h = 0; h < rp.Hk; ++h)
        std::copy(gk + h * rp.d, gk + (h + 1) * rp.d, &bp.dk(b, i, h, 0));
      const T* gv = grad.data() + rp.k_elems() + (b * rp.n + i) * rp.Hkv * rp.dv;
      for (index_t h = 0; h < rp.Hkv; ++h)
        std::copy(gv + h * rp.dv, gv + (h + 1) * rp.dv, &bp.dv(b, i, h, 0));
    }
  return dlambda_sum;
}

}  // namespace detail

namespace mpi {

/// Differential attention V1 (Ye et al., ICLR 2025) over a sequence sharded
/// across the ranks of `comm`. Shapes as diffattn::diff_attention_v1 with n =
/// N / W tokens of the rank's shard:
///
///   q (B, n, 2H, d), k (B, n, 2Hkv, d), v (B, n, Hkv, 2d)  H % Hkv == 0
///   out (B, n, H, 2d), lse (B, 2H, n) (may be an empty view: not written)
///
/// lambda is one scalar for the layer and must be the same on every rank.
/// Collective; see the group's notes for sharding, masks and errors. `stats`,
/// when given, receives the call's timings on this rank.
template <class T>
void diff_attention_v1(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_t<T> lambda, detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<T, 3> lse, const AttentionOptions& options = {},
                       Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.p = detail::validate_v1<T>(q, k, v, &lambda, nullptr, out, lse, options, fn);
    r.header = detail::ring_header(fn, r.p, options, sharding, lambda);
    return r;
  });
  detail::ring_attention_forward(rc, c.p, options, sharding);
  detail::finish_stats(stats, rc, t0);
}

/// Differential attention V2 over a sequence sharded across the ranks:
///
///   q (B, n, 2H, d), k, v (B, n, Hkv, d), lambda_logit (B, n, H) of the rank's
///   tokens, out (B, n, H, d), lse (B, 2H, n) (may be empty)
///
/// 2H / Hkv must be even, as for diffattn::diff_attention_v2. Collective.
template <class T>
void diff_attention_v2(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options = {}, Sharding sharding = Sharding::zigzag,
                       RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v2";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.p = detail::validate_v2<T>(q, k, v, lambda_logit, out, lse, options, fn);
    r.header = detail::ring_header(fn, r.p, options, sharding, 0.0);
    return r;
  });
  detail::ring_attention_forward(rc, c.p, options, sharding);
  detail::finish_stats(stats, rc, t0);
}

/// Plain softmax attention with GQA over a sequence sharded across the ranks:
///
///   q (B, n, Hq, d), k (B, n, Hkv, d), v (B, n, Hkv, dv), out (B, n, Hq, dv),
///   lse (B, Hq, n) (may be empty)
///
/// Hq % Hkv == 0. Collective.
template <class T>
void attention(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
               detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
               detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
               const AttentionOptions& options = {}, Sharding sharding = Sharding::zigzag,
               RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::attention";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.p = detail::validate_plain<T>(q, k, v, out, lse, options, fn);
    r.header = detail::ring_header(fn, r.p, options, sharding, 0.0);
    return r;
  });
  detail::ring_attention_forward(rc, c.p, options, sharding);
  detail::finish_stats(stats, rc, t0);
}

/// Backward of mpi::diff_attention_v1. Arguments as
/// diffattn::diff_attention_v1_backward, each the rank's shard: out and lse
/// (B, 2H, n) as the forward wrote them (lse is required), dout (B, n, H, 2d);
/// writes dq, dk, dv (shapes of q, k, v: the gradients of the rank's own
/// tokens, summed over every rank's queries). dlambda is dL/dlambda summed
/// over batch, heads and ALL N rows of the global sequence: the same value on
/// every rank (an MPI_Allreduce), like the single-process scalar.
///
/// Cost: one forward ring of map 2 (to recover each map's normalised output,
/// which out alone does not determine) and one backward ring in which the
/// dK/dV accumulators follow the key/value blocks. Collective.
template <class T>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, T& dlambda,
    const AttentionOptions& options = {}, Sharding sharding = Sharding::zigzag,
    RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1_backward";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  T dl = 0;
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.bp = detail::backward_v1<T>(q, k, v, &lambda, nullptr, out, lse, dout, dq, dk, dv,
                                  TensorView<T, 1>(&dl, {1}), options, fn);
    if (r.bp.fwd.seqlen_q > 0 && !r.bp.fwd.has_lse()) detail::fail(fn, "lse is required");
    r.p = r.bp.fwd;
    r.header = detail::ring_header(fn, r.p, options, sharding, lambda);
    return r;
  });
  double sum = detail::ring_attention_backward(rc, c.bp, options, sharding);
  rc.allreduce_sum(&sum, 1);
  dlambda = static_cast<T>(sum);
  detail::finish_stats(stats, rc, t0);
}

/// Backward of mpi::diff_attention_v2: arguments as
/// diffattn::diff_attention_v2_backward, each the rank's shard;
/// dlambda_logit (B, n, H) of the rank's tokens. Collective.
template <class T>
void diff_attention_v2_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options = {},
    Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v2_backward";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.bp = detail::backward_v2<T>(q, k, v, lambda_logit, out, lse, dout, dq, dk, dv, dlambda_logit,
                                  options, fn);
    r.p = r.bp.fwd;
    r.header = detail::ring_header(fn, r.p, options, sharding, 0.0);
    return r;
  });
  detail::ring_attention_backward(rc, c.bp, options, sharding);
  detail::finish_stats(stats, rc, t0);
}

/// Backward of mpi::attention: arguments as diffattn::attention_backward,
/// each the rank's shard. Collective.
template <class T>
void attention_backward(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const T, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options = {}, Sharding sharding = Sharding::zigzag,
                        RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::attention_backward";
  const double t0 = detail::mpi_now();
  detail::RingComm rc(comm, fn);
  const auto c = detail::checked_collective(rc, [&] {
    detail::CheckedRing<T> r;
    r.bp = detail::backward_plain<T>(q, k, v, out, lse, dout, dq, dk, dv, options, fn);
    r.p = r.bp.fwd;
    r.header = detail::ring_header(fn, r.p, options, sharding, 0.0);
    return r;
  });
  detail::ring_attention_backward(rc, c.bp, options, sharding);
  detail::finish_stats(stats, rc, t0);
}

/// The rank's shard of a global tensor: its tokens along `axis` (1 for
/// (B, N, H, D) and (B, N, H); 2 for lse (B, H, N)), copied, contiguous. Throws
/// diffattn::error unless N % W == 0 (contiguous) or N % 2W == 0 (zigzag), or
/// for a rank outside [0, world). Deterministic, so every rank decides alike.
template <class T, std::size_t R>
Tensor<std::remove_const_t<T>, R> shard(TensorView<T, R> global, int rank, int world,
                                        Sharding sharding, std::size_t axis = 1) {
  constexpr const char* fn = "diffattn::mpi::shard";
  if (world < 1 || rank < 0 || rank >= world)
    detail::fail(fn, "rank ", rank, " is outside a world of ", world, " ranks");
  if (axis >= R) detail::fail(fn, "axis ", axis, " is not below the rank ", R, " of the tensor");
  const index_t N = global.shape(axis);
  const index_t parts = sharding == Sharding::zigzag ? 2 * index_t(world) : world;
  if (N % parts != 0)
    detail::fail(
        fn, "N = ", N, " tokens (shape ", detail::shape_str(global.shape()), ") do not split into ",
        parts, " equal ", sharding == Sharding::zigzag ? "chunks" : "shards", " (",
        detail::sharding_name(sharding), " over ", world, " ranks needs N % ", parts, " == 0)");
  auto shape = global.shape();
  shape[axis] = N / world;
  Tensor<std::remove_const_t<T>, R> local(shape);
  const auto runs = detail::shard_runs(shape[axis], rank, world, sharding == Sharding::zigzag);
  auto lv = local.view();
  detail::for_each_index(shape, [&](const std::array<index_t, R>& idx) {
    auto g = idx;
    g[axis] = detail::global_row(runs, idx[axis]);
    detail::element(lv, idx) = detail::element(global, g);
  });
  return local;
}

/// shard() of an owning tensor.
template <class T, std::size_t R>
Tensor<T, R> shard(const Tensor<T, R>& global, int rank, int world, Sharding sharding,
                   std::size_t axis = 1) {
  return shard(global.view(), rank, world, sharding, axis);
}

/// The inverse of shard(): gathers every rank's shard (the same shape on
/// every rank) to `root`, which receives the global tensor; the other ranks
/// get an empty tensor. Collective.
template <class T, std::size_t R>
Tensor<std::remove_const_t<T>, R> gather(MPI_Comm comm, TensorView<T, R> local, Sharding sharding,
                                         int root = 0, std::size_t axis = 1) {
  using U = std::remove_const_t<T>;
  constexpr const char* fn = "diffattn::mpi::gather";
  detail::RingComm rc(comm, fn);
  bool ok = true;
  std::string message;
  std::vector<detail::HeaderField> header;
  if (axis >= R) {
    ok = false;
    message = detail::cat(fn, ": axis ", axis, " is not below the rank ", R, " of the tensor");
  } else if (root < 0 || root >= rc.size()) {
    ok = false;
    message = detail::cat(fn, ": root ", root, " is outside a world of ", rc.size(), " ranks");
  } else if (sharding == Sharding::zigzag && local.shape(axis) % 2 != 0) {
    ok = false;
    message = detail::cat(fn, ": zigzag shards hold two chunks, so an even number of tokens; got ",
                          detail::shape_str(local.shape()));
  }
  for (std::size_t r = 0; r < R; ++r) header.push_back({"an extent of the shards", local.shape(r)});
  header.push_back({"root", root});
  header.push_back({"the sharding", static_cast<std::int64_t>(sharding)});
  detail::agree(rc, ok, message, header);
  Tensor<U, R> packed(local.shape());
  auto pv = packed.view();
  detail::for_each_index(local.shape(), [&](const std::array<index_t, R>& idx) {
    detail::element(pv, idx) = detail::element(local, idx);
  });
  const index_t n = packed.size();
  const int count = detail::mpi_count(n, fn);
  std::vector<U> all(rc.rank() == root ? static_cast<std::size_t>(n) * rc.size() : 0);
  detail::mpi_check(MPI_Gather(packed.data(), count, detail::mpi_type<U>(), all.data(), count,
                               detail::mpi_type<U>(), root, rc.get()),
                    fn, "MPI_Gather");
  if (rc.rank() != root) return Tensor<U, R>();
  auto shape = local.shape();
  shape[axis] *= rc.size();
  Tensor<U, R> global(shape);
  auto gv = global.view();
  for (int r = 0; r < rc.size(); ++r) {
    const auto runs =
        detail::shard_runs(local.shape(axis), r, rc.size(), sharding == Sharding::zigzag);
    const TensorView<const U, R> part(all.data() + static_cast<std::size_t>(n) * r, local.shape());
    detail::for_each_index(local.shape(), [&](const std::array<index_t, R>& idx) {
      auto g = idx;
      g[axis] = detail::global_row(runs, idx[axis]);
      detail::element(gv, g) = detail::element(part, idx);
    });
  }
  return global;
}

/// gather() of an owning tensor.
template <class T, std::size_t R>
Tensor<T, R> gather(MPI_Comm comm, const Tensor<T, R>& local, Sharding sharding, int root = 0,
                    std::size_t axis = 1) {
  return gather(comm, local.view(), sharding, root, axis);
}

/// @}

}  // namespace mpi
DIFFATTN_END_NAMESPACE
