// The drivers behind diffattn/mpi.hpp: argument agreement across the ranks,
// the ring problem, and the forward and backward over the ring (per-map
// states, merged; D = dO . O for the backward). Included by mpi.hpp only.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../attention.hpp"
#include "../../attention_backward.hpp"
#include "../../config.hpp"
#include "../../lambda.hpp"
#include "../../options.hpp"
#include "../../tensor.hpp"
#include "../core/validate.hpp"
#include "mpi_comm.hpp"
#include "mpi_gather.hpp"
#include "mpi_ring.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace mpi {

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

/// SFINAE guard of the functor overloads: a Sharding in the functor's place
/// is the overload without one.
template <class Mod>
using not_sharding_t = std::enable_if_t<!std::is_same<std::decay_t<Mod>, mpi::Sharding>::value>;

inline const char* sharding_name(mpi::Sharding s) {
  return s == mpi::Sharding::zigzag ? "zigzag" : "contiguous";
}

/// The bits of a V1 call's lambda (0 for the other kinds), so that the ranks
/// can check they agree: the scalar's, or for one lambda per head an FNV-1a
/// hash of every head's bits.
template <class T>
std::int64_t lambda_bits(const AttentionProblem<T>& p) {
  if (p.kind != AttnKind::v1) return 0;
  if (p.lambda_heads.empty()) return bits_of(static_cast<double>(p.lambda_scalar));
  std::uint64_t h = 1469598103934665603ull;
  for (index_t i = 0; i < p.lambda_heads.size(); ++i) {
    const std::uint64_t b =
        static_cast<std::uint64_t>(bits_of(static_cast<double>(p.lambda_heads(i))));
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((b >> (8 * byte)) & 0xffu)) * 1099511628211ull;
  }
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

/// An FNV-1a hash of a (Hq) modifier's bits (alibi_slopes, sinks), 0 when
/// empty, so that the ranks can check they pass the same values.
inline std::int64_t modifier_bits(const TensorView<const float, 1>& t) {
  if (t.empty()) return 0;
  std::uint64_t h = 1469598103934665603ull;
  for (index_t i = 0; i < t.size(); ++i) {
    std::uint32_t b = 0;
    const float x = t(i);
    std::memcpy(&b, &x, sizeof b);
    for (int byte = 0; byte < 4; ++byte) h = (h ^ ((b >> (8 * byte)) & 0xffu)) * 1099511628211ull;
  }
  std::int64_t out = 0;
  std::memcpy(&out, &h, sizeof out);
  return out == 0 ? 1 : out;
}

/// Fields of the argument header every rank must agree on.
constexpr std::size_t kRingHeaderFields = 18;

/// Local checks shared by every entry point; the header every rank must agree on.
template <class T>
std::vector<HeaderField> ring_header(const char* fn, const AttentionProblem<T>& p,
                                     const AttentionOptions& o, mpi::Sharding s) {
  if (p.seqlen_k != p.seqlen_q)
    fail(fn, "q holds ", p.seqlen_q, " tokens and k ", p.seqlen_k,
         ": self-attention over one sequence needs the same shard of tokens in q, k and v (q ",
         shape_str(p.q.shape()), ", k ", shape_str(p.k.shape()), ")");
  if (s == mpi::Sharding::zigzag && p.seqlen_q % 2 != 0)
    fail(fn, "zigzag sharding needs an even number of tokens per rank (two chunks of N / 2W), got ",
         p.seqlen_q, " (q ", shape_str(p.q.shape()), "); N must be a multiple of 2W");
  return header_with_shapes({{"the scalar size", static_cast<std::int64_t>(sizeof(T))}},
                            "the tokens per rank", p.q, p.k, p.v,
                            {{"options.causal", o.causal ? 1 : 0},
                             {"options.window_left", o.window_left},
                             {"options.window_right", o.window_right},
                             {"options.scale", bits_of(o.scale)},
                             {"lambda", lambda_bits(p)},
                             {"the sharding", static_cast<std::int64_t>(s)},
                             {"options.softcap", bits_of(static_cast<double>(o.softcap))},
                             {"options.alibi_slopes", modifier_bits(o.alibi_slopes)},
                             {"options.sinks", modifier_bits(o.sinks)},
                             {"whether dsinks is wanted", 0}});
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
  rp.softcap = o.softcap;
  rp.alibi_slopes = o.alibi_slopes;
  rp.sinks = o.sinks;
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
  std::vector<HeaderField> header = std::vector<HeaderField>(kRingHeaderFields);
};

inline void finish_stats(mpi::RingStats* stats, const RingComm& rc, double t0) {
  if (!stats) return;
  stats->seconds = mpi_now() - t0;
  stats->wait_seconds = rc.wait_seconds;
  stats->bytes_sent = rc.bytes_sent;
  stats->steps = rc.size();
}

/// The forward of any kind: states per map, then out and lse.
template <class T, class Mod>
void ring_attention_forward(RingComm& rc, const AttentionProblem<T>& p,
                            const AttentionOptions& options, mpi::Sharding s, const Mod& mod) {
  if (rc.size() == 1) {  // every key is local: the fused kernel, exactly
    run_attention(p, options, mod);
    return;
  }
  const RingProblem<T> rp = ring_problem(p, options, s);
  if (gathers(rp, rc.size())) {  // the keys gathered, the fused kernel (mpi_gather.hpp)
    gathered_forward(rc, rp, p, options, mod);
    return;
  }
  std::vector<int> maps = rp.maps() == 2 ? std::vector<int>{0, 1} : std::vector<int>{0};
  std::vector<Tensor<T, 4>> o;
  std::vector<Tensor<T, 3>> lse;
  ring_forward(rp, rc, maps, o, lse, mod);
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
/// Returns V1's dlambda before the allreduce: the local sums over rows of
/// -dO . o2, one per DIFF head when lambda is per head, else one (empty for
/// the other kinds). With bp.dsinks, writes the sinks' gradients summed over
/// every rank's rows: per row and map, -exp(sink - lse_m) delta_m (the
/// sink's probability times dO_m . o_m), added in double on each rank, then
/// gathered and added in rank order, so every rank gets the same bits.
template <class T, class Mod>
std::vector<double> ring_attention_backward(RingComm& rc, const BackwardProblem<T>& bp,
                                            const AttentionOptions& options, mpi::Sharding s,
                                            const Mod& mod) {
  const bool per_head = !bp.fwd.lambda_heads.empty();
  std::vector<double> dlambda_sum(
      bp.fwd.kind == AttnKind::v1 ? static_cast<std::size_t>(per_head ? bp.fwd.heads : 1) : 0);
  if (rc.size() == 1) {  // every key is local: the fused backward, exactly
    run_attention_backward(bp, options, mod);
    for (std::size_t h = 0; h < dlambda_sum.size(); ++h)
      dlambda_sum[h] = static_cast<double>(bp.dlambda(static_cast<index_t>(h)));
    return dlambda_sum;
  }
  const AttentionProblem<T>& p = bp.fwd;
  const RingProblem<T> rp = ring_problem(p, options, s);
  if (gathers(rp, rc.size()))  // the keys gathered, the fused backward (mpi_gather.hpp)
    return gathered_backward(rc, rp, bp, options, mod);
  const int maps = rp.maps();
  const std::array<index_t, 4> oshape = {rp.B, rp.n, rp.H, rp.dv};
  std::vector<Tensor<T, 4>> o, o2;
  std::vector<Tensor<T, 3>> lse_re;
  std::vector<TensorView<const T, 4>> o_m, dout_m;
  std::vector<TensorView<const T, 3>> lse_m, delta_m;
  Tensor<T, 4> o1({0, 0, 0, 0}), dout2({0, 0, 0, 0});
  if (maps == 1) {
    o_m.push_back(p.out);
    dout_m.push_back(bp.dout);
    lse_m.push_back(p.lse);
  } else {
    ring_forward(rp, rc, {1}, o2, lse_re, mod);
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
            dlambda_sum[static_cast<std::size_t>(per_head ? h : 0)] -= e;
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
  if (!bp.dsinks.empty()) {
    const index_t Hq = bp.dsinks.shape(0);
    std::vector<double> local(static_cast<std::size_t>(Hq), 0.0);
    for (int m = 0; m < maps; ++m)
      for (index_t b = 0; b < rp.B; ++b)
        for (index_t h = 0; h < rp.H; ++h) {
          const index_t qh = rp.qhead(m, h);
          const T sink = static_cast<T>(rp.sinks(qh));
          double acc = 0;
          for (index_t i = 0; i < rp.n; ++i) {
            const T l = lse_m[m](b, h, i);
            if (l == -std::numeric_limits<T>::infinity()) continue;
            acc -= static_cast<double>(std::exp(sink - l) * delta_m[m](b, h, i));
          }
          local[static_cast<std::size_t>(qh)] += acc;
        }
    const std::vector<double> sum = rc.allgather_sum(local);
    for (index_t h = 0; h < Hq; ++h)
      bp.dsinks(h) = static_cast<T>(sum[static_cast<std::size_t>(h)]);
  }
  std::vector<Tensor<T, 4>> dq_m;
  for (int m = 0; m < maps; ++m) dq_m.emplace_back(std::array<index_t, 4>{rp.B, rp.n, rp.H, rp.d});
  Tensor<T, 1> grad;
  ring_backward(rp, rc, o_m, lse_m, dout_m, delta_m, dq_m, grad, mod);
  // Gradients to the caller's layout.
  for (index_t b = 0; b < rp.B; ++b)
    for (index_t i = 0; i < rp.n; ++i)
      for (int m = 0; m < maps; ++m)
        for (index_t h = 0; h < rp.H; ++h)
          std::copy(&dq_m[m](b, i, h, 0), &dq_m[m](b, i, h, 0) + rp.d,
                    &bp.dq(b, i, maps == 2 ? 2 * h + m : h, 0));
  write_kv_grads(rp, grad, bp);
  return dlambda_sum;
}

/// One collective forward call: `validate` (run on every rank, its errors
/// agreed on) gives the problem, whose header the ranks compare before the ring.
template <class T, class Validate, class Mod = NoScoreMod>
void ring_forward_call(MPI_Comm comm, const char* fn, const AttentionOptions& options,
                       mpi::Sharding sharding, mpi::RingStats* stats, Validate&& validate,
                       const Mod& mod = Mod()) {
  const double t0 = mpi_now();
  RingComm rc(comm, fn);
  const auto c = checked_collective(rc, [&] {
    CheckedRing<T> r;
    r.p = validate();
    r.header = ring_header(fn, r.p, options, sharding);
    return r;
  });
  ring_attention_forward(rc, c.p, options, sharding, mod);
  finish_stats(stats, rc, t0);
}

/// mpi::diff_attention_v1 with one lambda (lambda) or one per DIFF head
/// (lambda_heads).
template <class T, class Mod>
void ring_v1_forward(MPI_Comm comm, TensorView<const T, 4> q, TensorView<const T, 4> k,
                     TensorView<const T, 4> v, const T* lambda,
                     const TensorView<const T, 1>* lambda_heads, TensorView<T, 4> out,
                     TensorView<T, 3> lse, const AttentionOptions& options, mpi::Sharding sharding,
                     mpi::RingStats* stats, const Mod& mod) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1";
  ring_forward_call<T>(
      comm, fn, options, sharding, stats,
      [&] { return validate_v1<T>(q, k, v, lambda, lambda_heads, out, lse, options, fn); }, mod);
}

/// One collective backward call, as ring_forward_call with `validate` giving
/// the backward problem. Returns V1's dlambda summed over every rank (one per
/// DIFF head with per-head lambda, else one); empty for the other kinds.
/// dsinks (an empty view: not wanted) is attached to the problem here, its
/// errors agreed on like the others'.
template <class T, class Validate, class Mod = NoScoreMod>
std::vector<double> ring_backward_call(MPI_Comm comm, const char* fn,
                                       const AttentionOptions& options, mpi::Sharding sharding,
                                       mpi::RingStats* stats, Validate&& validate,
                                       TensorView<T, 1> dsinks = {}, const Mod& mod = Mod()) {
  const double t0 = mpi_now();
  RingComm rc(comm, fn);
  const auto c = checked_collective(rc, [&] {
    CheckedRing<T> r;
    r.bp = validate();
    attach_dsinks(fn, r.bp, dsinks);
    r.p = r.bp.fwd;
    r.header = ring_header(fn, r.p, options, sharding);
    r.header.back().value = r.bp.dsinks.empty() ? 0 : 1;
    return r;
  });
  std::vector<double> sum = ring_attention_backward(rc, c.bp, options, sharding, mod);
  if (!sum.empty()) rc.allreduce_sum(sum.data(), static_cast<int>(sum.size()));
  finish_stats(stats, rc, t0);
  return sum;
}

/// mpi::diff_attention_v1_backward with one lambda (lambda, dlambda (1)) or
/// one per DIFF head (lambda_heads, dlambda (H)): dlambda gets the sums over
/// every rank.
template <class T, class Mod = NoScoreMod>
void ring_v1_backward(MPI_Comm comm, TensorView<const T, 4> q, TensorView<const T, 4> k,
                      TensorView<const T, 4> v, const T* lambda,
                      const TensorView<const T, 1>* lambda_heads, TensorView<const T, 4> out,
                      TensorView<const T, 3> lse, TensorView<const T, 4> dout, TensorView<T, 4> dq,
                      TensorView<T, 4> dk, TensorView<T, 4> dv, TensorView<T, 1> dlambda,
                      const AttentionOptions& options, mpi::Sharding sharding,
                      mpi::RingStats* stats, TensorView<T, 1> dsinks = {}, const Mod& mod = Mod()) {
  constexpr const char* fn = "diffattn::mpi::diff_attention_v1_backward";
  const std::vector<double> sum = ring_backward_call<T>(
      comm, fn, options, sharding, stats,
      [&] {
        auto bp = backward_v1<T>(q, k, v, lambda, lambda_heads, out, lse, dout, dq, dk, dv, dlambda,
                                 options, fn);
        if (bp.fwd.seqlen_q > 0 && !bp.fwd.has_lse()) fail(fn, "lse is required");
        return bp;
      },
      dsinks, mod);
  for (std::size_t h = 0; h < sum.size(); ++h)
    dlambda(static_cast<index_t>(h)) = static_cast<T>(sum[h]);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
