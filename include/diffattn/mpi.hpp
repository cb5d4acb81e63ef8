/// \file
/// Context parallelism over MPI (ring attention): one sequence split across the
/// ranks of a communicator, forward and backward. CMake target diffattn::mpi,
/// present when find_package(MPI COMPONENTS CXX) succeeds; the rest of the
/// library never includes MPI.
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
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "detail/mpi/mpi_decode.hpp"
#include "detail/mpi/mpi_driver.hpp"
#include "kvcache_attention.hpp"
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
/// Algorithm: ring attention for plain attention. Each rank keeps its
/// queries; the key/value shards travel around the ring (MPI_Isend /
/// MPI_Irecv to the neighbours), the next one arriving while the current one
/// is computed, and each softmax map keeps its own (o, lse) state, merged
/// exactly (merge_states). For V1 and V2 per-map states would cost 1.5x and
/// 4/3 x the fused single-process kernel's arithmetic (two products with the
/// values instead of one W V), so they gather the key/value shards of all
/// ranks instead (one MPI_Allgather) and run the fused single-process kernel
/// on each run of the rank's queries against the keys it sees; the backward
/// runs the fused backward likewise and returns each rank's dK and dV by one
/// MPI_Alltoall, added in rank order. The price: during such a call every
/// rank holds the whole sequence's K and V (and in the backward their
/// gradients); so V1 and V2 gather only while those take at most 256 MiB per
/// rank, and beyond run the ring with per-map states, lambda subtracted after
/// the last merge.
///
/// Collective: every rank of `comm` must call with the same options, lambda,
/// sharding and shard shapes. Before any ring traffic the ranks exchange these
/// (one MPI_Allgather); a bad argument on any rank, or a disagreement, throws
/// diffattn::error on every rank (never a hang). MPI failures become
/// diffattn::error too (the calls run on a duplicate of `comm` with
/// MPI_ERRORS_RETURN). A communicator of one rank is the single-process case.
/// Storage: float or double.
///
/// Score modifiers (options.softcap, alibi_slopes, sinks) and user functors
/// act as in the single-process kernels on the gathered sequence: ALiBi and a
/// functor's i and j are global positions (the token's index in the whole
/// sequence, whatever the sharding), h the query head of q. In the ring every
/// pair of shards gets the softcap, ALiBi and the functor; each map's sink is
/// merged into its state once, after the ring (V1: the fused kernel takes
/// them all, as in one process). The backward's dsinks (Hq), when
/// given, is summed over every rank's rows, the same bits on every rank. The
/// ranks check that they pass the same softcap, slopes and sinks; a functor's
/// members are the caller's to keep alike on every rank.
/// Sharding and RingStats (the sharding of a call, and what a call did on
/// the calling rank) are defined with the drivers in detail/mpi/mpi_driver.hpp.
/// @{

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
  diff_attention_v1<T>(comm, q, k, v, lambda, out, lse, options, NoScoreMod{}, sharding, stats);
}

/// diff_attention_v1 with one lambda per DIFF head: lambda (H), the same on
/// every rank (as diffattn::diff_attention_v1's per-head overload).
template <class T>
void diff_attention_v1(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 1> lambda,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options = {}, Sharding sharding = Sharding::zigzag,
                       RingStats* stats = nullptr) {
  diff_attention_v1<T>(comm, q, k, v, lambda, out, lse, options, NoScoreMod{}, sharding, stats);
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
  diff_attention_v2<T>(comm, q, k, v, lambda_logit, out, lse, options, NoScoreMod{}, sharding,
                       stats);
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
  attention<T>(comm, q, k, v, out, lse, options, NoScoreMod{}, sharding, stats);
}

/// \name With a user score functor
/// The forward entry points above with a functor `mod` (as diffattn's
/// kernels with a functor, NoScoreMod in options.hpp lists its members): its
/// i and j are global positions in the gathered sequence, h the query head of
/// q. The ring passes it to every pair of shards, after the softcap and
/// ALiBi. Collective.
/// @{

/// mpi::diff_attention_v1 (one lambda) with a user score functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v1(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_t<T> lambda, detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<T, 3> lse, const AttentionOptions& options,
                       const Mod& mod, Sharding sharding = Sharding::zigzag,
                       RingStats* stats = nullptr) {
  detail::ring_v1_forward<T>(comm, q, k, v, &lambda, nullptr, out, lse, options, sharding, stats,
                             mod);
}

/// mpi::diff_attention_v1 (one lambda per DIFF head) with a user score functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v1(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 1> lambda,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options, const Mod& mod,
                       Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  detail::ring_v1_forward<T>(comm, q, k, v, nullptr, &lambda, out, lse, options, sharding, stats,
                             mod);
}

/// mpi::diff_attention_v2 with a user score functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v2(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options, const Mod& mod,
                       Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v2";
  detail::ring_forward_call<T>(
      comm, fn, options, sharding, stats,
      [&] { return detail::validate_v2<T>(q, k, v, lambda_logit, out, lse, options, fn); }, mod);
}

/// mpi::attention with a user score functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void attention(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
               detail::nondeduced_view<const T, 4> k, detail::nondeduced_view<const T, 4> v,
               detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
               const AttentionOptions& options, const Mod& mod,
               Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::attention";
  detail::ring_forward_call<T>(
      comm, fn, options, sharding, stats,
      [&] { return detail::validate_plain<T>(q, k, v, out, lse, options, fn); }, mod);
}
/// @}

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
  diff_attention_v1_backward<T>(comm, q, k, v, lambda, out, lse, dout, dq, dk, dv, dlambda, options,
                                TensorView<T, 1>(), NoScoreMod{}, sharding, stats);
}

/// Backward of mpi::diff_attention_v1 with one lambda per DIFF head: dlambda
/// (H), each head's dL/dlambda summed over batch and ALL N rows of the global
/// sequence, the same on every rank (as diffattn's per-head backward).
template <class T>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 1> dlambda, const AttentionOptions& options = {},
    Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  diff_attention_v1_backward<T>(comm, q, k, v, lambda, out, lse, dout, dq, dk, dv, dlambda, options,
                                TensorView<T, 1>(), NoScoreMod{}, sharding, stats);
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
  diff_attention_v2_backward<T>(comm, q, k, v, lambda_logit, out, lse, dout, dq, dk, dv,
                                dlambda_logit, options, TensorView<T, 1>(), NoScoreMod{}, sharding,
                                stats);
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
  attention_backward<T>(comm, q, k, v, out, lse, dout, dq, dk, dv, options, TensorView<T, 1>(),
                        NoScoreMod{}, sharding, stats);
}

/// \name Backward with the gradient of the sinks, or a user functor
/// The backward entry points above with dsinks (Hq) after the options, as
/// diffattn's backward kernels: the gradient of options.sinks summed over
/// batch and ALL N rows of the global sequence, the same bits on every rank
/// (an empty view: not computed; a non-empty one needs options.sinks). With
/// `mod`, the forward's functor (one with `score` needs `dscore`), its i and
/// j global positions. Collective.
/// @{

/// mpi::diff_attention_v1_backward (one lambda) with dsinks.
template <class T>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, T& dlambda,
    const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks,
    Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  diff_attention_v1_backward<T>(comm, q, k, v, lambda, out, lse, dout, dq, dk, dv, dlambda, options,
                                dsinks, NoScoreMod{}, sharding, stats);
}

/// mpi::diff_attention_v1_backward (one lambda) with dsinks and the forward's functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, T& dlambda,
    const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks, const Mod& mod,
    Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  T dl = 0;
  detail::ring_v1_backward<T>(comm, q, k, v, &lambda, nullptr, out, lse, dout, dq, dk, dv,
                              TensorView<T, 1>(&dl, {1}), options, sharding, stats, dsinks, mod);
  dlambda = dl;
}

/// mpi::diff_attention_v1_backward (lambda per DIFF head) with dsinks.
template <class T>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 1> dlambda, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, Sharding sharding = Sharding::zigzag,
    RingStats* stats = nullptr) {
  diff_attention_v1_backward<T>(comm, q, k, v, lambda, out, lse, dout, dq, dk, dv, dlambda, options,
                                dsinks, NoScoreMod{}, sharding, stats);
}

/// mpi::diff_attention_v1_backward (lambda per DIFF head) with dsinks and the forward's functor
/// `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v1_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 1> dlambda, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, const Mod& mod, Sharding sharding = Sharding::zigzag,
    RingStats* stats = nullptr) {
  detail::ring_v1_backward<T>(comm, q, k, v, nullptr, &lambda, out, lse, dout, dq, dk, dv, dlambda,
                              options, sharding, stats, dsinks, mod);
}

/// mpi::diff_attention_v2_backward with dsinks and the forward's functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void diff_attention_v2_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, const Mod& mod, Sharding sharding = Sharding::zigzag,
    RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v2_backward";
  detail::ring_backward_call<T>(
      comm, fn, options, sharding, stats,
      [&] {
        return detail::backward_v2<T>(q, k, v, lambda_logit, out, lse, dout, dq, dk, dv,
                                      dlambda_logit, options, fn);
      },
      dsinks, mod);
}

/// mpi::diff_attention_v2_backward with dsinks.
template <class T>
void diff_attention_v2_backward(
    MPI_Comm comm, detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options,
    detail::nondeduced_view<T, 1> dsinks, Sharding sharding = Sharding::zigzag,
    RingStats* stats = nullptr) {
  diff_attention_v2_backward<T>(comm, q, k, v, lambda_logit, out, lse, dout, dq, dk, dv,
                                dlambda_logit, options, dsinks, NoScoreMod{}, sharding, stats);
}

/// mpi::attention_backward with dsinks and the forward's functor `mod`.
template <class T, class Mod, class = detail::not_sharding_t<Mod>>
void attention_backward(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const T, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks,
                        const Mod& mod, Sharding sharding = Sharding::zigzag,
                        RingStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::attention_backward";
  detail::ring_backward_call<T>(
      comm, fn, options, sharding, stats,
      [&] { return detail::backward_plain<T>(q, k, v, out, lse, dout, dq, dk, dv, options, fn); },
      dsinks, mod);
}

/// mpi::attention_backward with dsinks.
template <class T>
void attention_backward(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const T, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options, detail::nondeduced_view<T, 1> dsinks,
                        Sharding sharding = Sharding::zigzag, RingStats* stats = nullptr) {
  attention_backward<T>(comm, q, k, v, out, lse, dout, dq, dk, dv, options, dsinks, NoScoreMod{},
                        sharding, stats);
}
/// @}

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

/// \defgroup mpi_decode Sharded decoding over MPI
///
/// The *_kvcache kernels (kvcache_attention.hpp) over caches split across the
/// W ranks of `comm`: each rank holds a contiguous slice of every sequence's
/// keys, and the slices of ranks 0, 1, ..., W - 1 in rank order make up the
/// whole cache. Rank r's KVCacheBatch describes its own slice (contiguous or
/// paged, any storage the single-process kernels take, 8-bit scales
/// included); its cache_seqlens(b) are its own keys of sequence b, and may be
/// 0. q, lambda (V1), lambda_logit (V2) and the options are the same on every
/// rank. out and lse come back on every rank, bitwise the same on all of them
/// and for any thread count, and equal to the single-process kernel on the
/// concatenated cache to rounding.
///
/// Positions are global: rank r's keys of sequence b start at the sum of the
/// lower ranks' cache_seqlens(b) (exchanged once per call), the new queries
/// are the last n of the M_b = sum over ranks keys, and the causal mask, the
/// windows and ALiBi use these positions. A rank reads only the keys of its
/// slice that some query sees (none when its slice lies wholly outside a
/// window). Sinks count once, after the merge.
///
/// Algorithm (tree attention): each rank runs the single-process kvcache
/// kernel on its slice as plain softmax maps (V2 as GQA with 2H query heads,
/// which reads each K/V row once as the fused kernel does; V1 one call per map,
/// so its 2d-wide values are read twice), in the compute type. The per-map
/// states (o, lse), B n 2H (dv + 1) numbers per rank, go to every rank in one
/// MPI_Allgather, and every rank merges them in rank order with the same
/// arithmetic (merge_states), then applies the sinks and subtracts lambda.
/// Among the collectives measured (docs/mpi.md) the all-gather was as fast as
/// an MPI_Allreduce with a user operation on the packed states and faster
/// than a reduce-scatter + all-gather at decoding's state sizes, and it alone
/// fixes the merge order on every rank, which gives bitwise-equal results.
///
/// Collective. Errors: each rank first runs the single-process checks on its
/// slice (shapes, lengths within capacity, block tables, scales); one
/// MPI_Allgather then compares the shapes, the storage types, the options, a
/// hash of q and of lambda across the ranks. A bad argument or a disagreement
/// on any rank throws diffattn::error on every rank, never a hang; so does a
/// bad 8-bit scale met during the step (its status travels with the states).
/// ALiBi with n > 1 new queries needs causal = true (or window_right = 0).
/// A communicator of one rank runs the single-process kernel itself. `stats`,
/// when given, receives what the call did on this rank.
/// @{

/// Plain attention over sharded KV caches: the arguments of
/// diffattn::attention_kvcache with `comm` first, `shard` the rank's slice.
///   q (B, n, Hq, d), k_cache / v_cache the rank's slice (contiguous or paged),
///   out (B, n, Hq, dv), lse (B, Hq, n) or empty.
template <class T, class KV = T>
void attention_kvcache(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const KV, 4> k_cache,
                       detail::nondeduced_view<const KV, 4> v_cache,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse, const KVCacheBatch& shard,
                       const AttentionOptions& options = {}, DecodeStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::attention_kvcache";
  const detail::ShardArgs<T, KV> a{q, k_cache, v_cache, out, lse, &shard};
  detail::sharded_kvcache_call<T, KV>(comm, fn, a, options, stats, [&] {
    const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, shard);
    auto p = detail::validate_plain<T, KV>(q, kv[0], kv[1], out, lse, options, fn);
    detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, shard,
                                  detail::shard_local_options(options));
    return p;
  });
}

/// diff_attention_v1_kvcache over sharded KV caches; one lambda for every
/// head, the same on every rank.
///   q (B, n, 2H, d), k_cache (.., 2Hkv, d), v_cache (.., Hkv, 2d) the rank's
///   slice, out (B, n, H, 2d), lse (B, 2H, n) or empty.
template <class T, class KV = T>
void diff_attention_v1_kvcache(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_t<compute_t<T>> lambda,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& shard, const AttentionOptions& options = {},
                               DecodeStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1_kvcache";
  const detail::ShardArgs<T, KV> a{q, k_cache, v_cache, out, lse, &shard};
  detail::sharded_kvcache_call<T, KV>(comm, fn, a, options, stats, [&] {
    const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, shard);
    auto p = detail::validate_v1<T, KV>(q, kv[0], kv[1], &lambda, nullptr, out, lse, options, fn);
    detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, shard,
                                  detail::shard_local_options(options));
    return p;
  });
}

/// diff_attention_v1_kvcache over sharded KV caches with one lambda per DIFF
/// head, lambda (H), the same on every rank.
template <class T, class KV = T>
void diff_attention_v1_kvcache(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_view<const compute_t<T>, 1> lambda,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& shard, const AttentionOptions& options = {},
                               DecodeStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1_kvcache";
  const detail::ShardArgs<T, KV> a{q, k_cache, v_cache, out, lse, &shard};
  detail::sharded_kvcache_call<T, KV>(comm, fn, a, options, stats, [&] {
    const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, shard);
    auto p = detail::validate_v1<T, KV>(q, kv[0], kv[1], nullptr, &lambda, out, lse, options, fn);
    detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, shard,
                                  detail::shard_local_options(options));
    return p;
  });
}

/// diff_attention_v2_kvcache over sharded KV caches.
///   q (B, n, 2H, d), k_cache (.., Hkv, d), v_cache (.., Hkv, dv) the rank's
///   slice, lambda_logit (B, n, H) the same on every rank, out (B, n, H, dv),
///   lse (B, 2H, n) or empty.
template <class T, class KV = T>
void diff_attention_v2_kvcache(MPI_Comm comm, detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_view<const T, 3> lambda_logit,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& shard, const AttentionOptions& options = {},
                               DecodeStats* stats = nullptr) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v2_kvcache";
  const detail::ShardArgs<T, KV> a{q, k_cache, v_cache, out, lse, &shard};
  detail::sharded_kvcache_call<T, KV>(comm, fn, a, options, stats, [&] {
    const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, shard);
    auto p = detail::validate_v2<T, KV>(q, kv[0], kv[1], lambda_logit, out, lse, options, fn);
    detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, shard,
                                  detail::shard_local_options(options));
    return p;
  });
}

/// @}

}  // namespace mpi
DIFFATTN_END_NAMESPACE
