// Context parallelism over MPI: every rank builds the same global problem, runs
// the single-process kernel on it as the oracle, and compares its own shard of
// the ring result, forward and backward. Run under mpirun with any number of
// ranks; prints "mpi: <passed> passed, <failed> failed" (counted over all
// ranks) and exits non-zero on any failure.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/mpi.hpp>

#include "mpi_check.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using diffattn::mpi::Sharding;

namespace {

using mpi_check::bitwise_equal;
using mpi_check::check;
using mpi_check::g_failed;
using mpi_check::g_passed;
using mpi_check::g_rank;
using mpi_check::g_world;
using mpi_check::rel_error;

template <class T, std::size_t R>
Tensor<T, R> random_tensor(const std::array<index_t, R>& shape, std::uint64_t seed,
                           double sigma = 1.0) {
  Tensor<T, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(sigma * rng.normal());
  return t;
}

template <class T>
double tol() {
  return std::is_same<T, float>::value ? 3e-5 : 1e-12;
}

enum class Kind { plain, v1, v2 };
const char* kind_name(Kind k) { return k == Kind::plain ? "plain" : k == Kind::v1 ? "v1" : "v2"; }

/// Score modifiers of a case (options.softcap, alibi_slopes, sinks).
struct Mods {
  float softcap = 0;
  bool alibi = false, sinks = false;
  bool any() const { return softcap > 0 || alibi || sinks; }
};

struct Case {
  Kind kind;
  index_t B, N, H, Hkv, d;  // H: DIFF heads (plain: query heads)
  bool causal;
  index_t window_left, window_right;
  Sharding sharding;
  bool per_head = false;  // v1: one lambda per DIFF head
  Mods mods = {};
};

/// A user functor over global positions: a score that depends on the pair
/// (with its derivative), and documents of `doc` tokens (not aligned with the
/// shards) that see each other, with query head 1 blind in rows 3 .. 5, so
/// that its rows there see no key (the sink, when there is one, takes them).
struct DocWarp {
  index_t doc;
  template <class S>
  S score(S s, index_t b, index_t h, index_t i, index_t j) const {
    return s + S(0.15) * std::tanh(s) * static_cast<S>((b + h + i + 2 * j) % 3);
  }
  template <class S>
  S dscore(S s, index_t b, index_t h, index_t i, index_t j) const {
    const S t = std::tanh(s);
    return S(1) + S(0.15) * (S(1) - t * t) * static_cast<S>((b + h + i + 2 * j) % 3);
  }
  bool visible(index_t, index_t h, index_t i, index_t j) const {
    if (h == 1 && i >= 3 && i < 6) return false;
    return i / doc == j / doc;
  }
};

/// DocWarp's mask alone, with visible_block classifying whole chunks.
struct DocBlocks {
  index_t doc;
  bool visible(index_t, index_t, index_t i, index_t j) const { return i / doc == j / doc; }
  int visible_block(index_t, index_t, index_t i0, index_t i1, index_t j0, index_t j1) const {
    const index_t qa = i0 / doc, qb = (i1 - 1) / doc, ka = j0 / doc, kb = (j1 - 1) / doc;
    if (qb < ka || kb < qa) return 0;
    return qa == qb && ka == kb && qa == ka ? 2 : 1;
  }
};

/// The same documents as visible_range (each row's document), which the ring
/// must shift to the pair's keys.
struct DocRanges {
  index_t doc;
  bool visible(index_t, index_t, index_t i, index_t j) const { return i / doc == j / doc; }
  std::pair<index_t, index_t> visible_range(index_t, index_t, index_t i) const {
    return {i / doc * doc, i / doc * doc + doc};
  }
};

template <class M>
const char* mod_name() {
  if (std::is_same<M, DocWarp>::value) return " functor DocWarp";
  if (std::is_same<M, DocBlocks>::value) return " functor DocBlocks";
  if (std::is_same<M, DocRanges>::value) return " functor DocRanges";
  return "";
}

std::string describe(const Case& c, const char* type) {
  return diffattn::detail::cat(kind_name(c.kind), "<", type, "> B=", c.B, " N=", c.N, " H=", c.H,
                               " Hkv=", c.Hkv, " d=", c.d, " causal=", c.causal, " window=(",
                               c.window_left, ", ", c.window_right, ") ",
                               diffattn::detail::sharding_name(c.sharding), " W=", g_world,
                               c.per_head ? " lambda per head" : "", " softcap=", c.mods.softcap,
                               c.mods.alibi ? " alibi" : "", c.mods.sinks ? " sinks" : "");
}

/// True when x holds the same bits on every rank of comm.
template <class T>
bool same_on_all_ranks(MPI_Comm comm, const T* x, index_t n) {
  std::vector<double> lo(static_cast<std::size_t>(n)), hi;
  for (index_t i = 0; i < n; ++i) lo[static_cast<std::size_t>(i)] = static_cast<double>(x[i]);
  hi = lo;
  MPI_Allreduce(MPI_IN_PLACE, lo.data(), static_cast<int>(n), MPI_DOUBLE, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, hi.data(), static_cast<int>(n), MPI_DOUBLE, MPI_MAX, comm);
  for (index_t i = 0; i < n; ++i)
    if (std::memcmp(&lo[static_cast<std::size_t>(i)], &hi[static_cast<std::size_t>(i)],
                    sizeof(double)) != 0)
      return false;
  return true;
}

/// One case, forward and backward, against the single-process kernels (with
/// the case's modifiers and the functor mod, NoScoreMod: none). Under
/// modifiers the ring also runs with 2 threads, which must give the same bits.
template <class T, class Mod = diffattn::NoScoreMod>
void run_case(const Case& c, std::uint64_t seed, MPI_Comm comm, int rank, int world,
              const Mod& mod = Mod()) {
  constexpr bool kFunctor = !std::is_same<Mod, diffattn::NoScoreMod>::value;
  const std::string name =
      describe(c, std::is_same<T, float>::value ? "float" : "double") + mod_name<Mod>();
  const index_t B = c.B, N = c.N, d = c.d;
  const index_t qh = c.kind == Kind::plain ? c.H : 2 * c.H;
  const index_t kh = c.kind == Kind::v1 ? 2 * c.Hkv : c.Hkv;
  const index_t dv = c.kind == Kind::v1 ? 2 * d : d;
  const index_t oh = c.H;
  const T lambda = T(0.37);
  auto q = random_tensor<T, 4>({B, N, qh, d}, seed);
  auto k = random_tensor<T, 4>({B, N, kh, d}, seed + 1);
  auto v = random_tensor<T, 4>({B, N, c.Hkv, dv}, seed + 2);
  auto logit = random_tensor<T, 3>({B, N, c.H}, seed + 3);
  auto dout = random_tensor<T, 4>({B, N, oh, dv}, seed + 4);
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.num_threads = 1;
  // Modifiers: ALiBi slopes and sinks of every query head, the same on every
  // rank, as views with a stride of 2 (every other float of a buffer).
  std::vector<float> slopes(static_cast<std::size_t>(2 * qh)), sinks(slopes.size());
  for (index_t h = 0; h < qh; ++h) {
    slopes[static_cast<std::size_t>(2 * h)] = 0.03f + 0.02f * static_cast<float>(h);
    sinks[static_cast<std::size_t>(2 * h)] = 0.4f * static_cast<float>(h % 3) - 0.3f;
    slopes[static_cast<std::size_t>(2 * h + 1)] = sinks[static_cast<std::size_t>(2 * h + 1)] = 9.f;
  }
  o.softcap = c.mods.softcap;
  if (c.mods.alibi) o.alibi_slopes = TensorView<const float, 1>(slopes.data(), {qh}, {2});
  if (c.mods.sinks) o.sinks = TensorView<const float, 1>(sinks.data(), {qh}, {2});
  Tensor<T, 1> dsinks({c.mods.sinks ? qh : 0}), dsinksl({c.mods.sinks ? qh : 0});
  // The oracle on the whole sequence.
  Tensor<T, 4> out({B, N, oh, dv}), dq(q.shape()), dk(k.shape()), dvg(v.shape());
  Tensor<T, 3> lse({B, qh, N}), dlogit(logit.shape());
  T dlambda = 0;
  Tensor<T, 1> lambdas({c.H}), dlambdas({c.H});
  for (index_t h = 0; h < c.H; ++h) lambdas(h) = T(0.2) + T(0.15) * T(h);
  if (c.kind == Kind::v1 && c.per_head) {
    diffattn::diff_attention_v1<T>(q, k, v, lambdas, out, lse, o, mod);
    diffattn::diff_attention_v1_backward<T>(q, k, v, lambdas, out, lse, dout, dq, dk, dvg, dlambdas,
                                            o, dsinks, mod);
  } else if (c.kind == Kind::v1) {
    diffattn::diff_attention_v1<T>(q, k, v, lambda, out, lse, o, mod);
    diffattn::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, dq, dk, dvg, dlambda,
                                            o, dsinks, mod);
  } else if (c.kind == Kind::v2) {
    diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o, mod);
    diffattn::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, dq, dk, dvg, dlogit, o,
                                            dsinks, mod);
  } else {
    diffattn::attention<T>(q, k, v, out, lse, o, mod);
    diffattn::attention_backward<T>(q, k, v, out, lse, dout, dq, dk, dvg, o, dsinks, mod);
  }
  // The ring on the shards.
  namespace dm = diffattn::mpi;
  const Sharding s = c.sharding;
  const auto ql = dm::shard(q, rank, world, s), kl = dm::shard(k, rank, world, s),
             vl = dm::shard(v, rank, world, s), dol = dm::shard(dout, rank, world, s);
  const auto ll = dm::shard(logit, rank, world, s);  // rank 3, the others rank 4
  const index_t n = ql.shape(1);
  Tensor<T, 4> outl({B, n, oh, dv}), dql(ql.shape()), dkl(kl.shape()), dvl(vl.shape());
  Tensor<T, 3> lsel({B, qh, n}), dlogitl(ll.shape());
  T dlambdal = 0;
  Tensor<T, 1> dlambdasl({c.H});
  // The ring: without modifiers through the overloads it always had; with
  // sinks and no functor through those taking dsinks; with a functor through
  // those taking it.
  auto ring = [&](const AttentionOptions& ro) {
    if constexpr (kFunctor) {
      if (c.kind == Kind::v1 && c.per_head) {
        dm::diff_attention_v1<T>(comm, ql, kl, vl, lambdas, outl, lsel, ro, mod, s);
        dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambdas, outl, lsel, dol, dql, dkl, dvl,
                                          dlambdasl, ro, dsinksl, mod, s);
      } else if (c.kind == Kind::v1) {
        dm::diff_attention_v1<T>(comm, ql, kl, vl, lambda, outl, lsel, ro, mod, s);
        dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambda, outl, lsel, dol, dql, dkl, dvl,
                                          dlambdal, ro, dsinksl, mod, s);
      } else if (c.kind == Kind::v2) {
        dm::diff_attention_v2<T>(comm, ql, kl, vl, ll, outl, lsel, ro, mod, s);
        dm::diff_attention_v2_backward<T>(comm, ql, kl, vl, ll, outl, lsel, dol, dql, dkl, dvl,
                                          dlogitl, ro, dsinksl, mod, s);
      } else {
        dm::attention<T>(comm, ql, kl, vl, outl, lsel, ro, mod, s);
        dm::attention_backward<T>(comm, ql, kl, vl, outl, lsel, dol, dql, dkl, dvl, ro, dsinksl,
                                  mod, s);
      }
    } else if (c.mods.sinks) {
      if (c.kind == Kind::v1 && c.per_head) {
        dm::diff_attention_v1<T>(comm, ql, kl, vl, lambdas, outl, lsel, ro, s);
        dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambdas, outl, lsel, dol, dql, dkl, dvl,
                                          dlambdasl, ro, dsinksl, s);
      } else if (c.kind == Kind::v1) {
        dm::diff_attention_v1<T>(comm, ql, kl, vl, lambda, outl, lsel, ro, s);
        dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambda, outl, lsel, dol, dql, dkl, dvl,
                                          dlambdal, ro, dsinksl, s);
      } else if (c.kind == Kind::v2) {
        dm::diff_attention_v2<T>(comm, ql, kl, vl, ll, outl, lsel, ro, s);
        dm::diff_attention_v2_backward<T>(comm, ql, kl, vl, ll, outl, lsel, dol, dql, dkl, dvl,
                                          dlogitl, ro, dsinksl, s);
      } else {
        dm::attention<T>(comm, ql, kl, vl, outl, lsel, ro, s);
        dm::attention_backward<T>(comm, ql, kl, vl, outl, lsel, dol, dql, dkl, dvl, ro, dsinksl, s);
      }
    } else if (c.kind == Kind::v1 && c.per_head) {
      dm::diff_attention_v1<T>(comm, ql, kl, vl, lambdas, outl, lsel, ro, s);
      dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambdas, outl, lsel, dol, dql, dkl, dvl,
                                        dlambdasl, ro, s);
    } else if (c.kind == Kind::v1) {
      dm::diff_attention_v1<T>(comm, ql, kl, vl, lambda, outl, lsel, ro, s);
      dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambda, outl, lsel, dol, dql, dkl, dvl,
                                        dlambdal, ro, s);
    } else if (c.kind == Kind::v2) {
      dm::diff_attention_v2<T>(comm, ql, kl, vl, ll, outl, lsel, ro, s);
      dm::diff_attention_v2_backward<T>(comm, ql, kl, vl, ll, outl, lsel, dol, dql, dkl, dvl,
                                        dlogitl, ro, s);
    } else {
      dm::attention<T>(comm, ql, kl, vl, outl, lsel, ro, s);
      dm::attention_backward<T>(comm, ql, kl, vl, outl, lsel, dol, dql, dkl, dvl, ro, s);
    }
  };
  ring(o);
  const double t = tol<T>(), tb = 4 * tol<T>();
  auto cmp = [&](const char* what, double err, double limit) {
    check(err <= limit,
          diffattn::detail::cat(name, ": ", what, " relative error ", err, " > ", limit));
  };
  cmp("out", rel_error(outl, dm::shard(out, rank, world, s)), t);
  cmp("lse", rel_error(lsel, dm::shard(lse, rank, world, s, 2)), t);
  cmp("dq", rel_error(dql, dm::shard(dq, rank, world, s)), tb);
  cmp("dk", rel_error(dkl, dm::shard(dk, rank, world, s)), tb);
  cmp("dv", rel_error(dvl, dm::shard(dvg, rank, world, s)), tb);
  if (c.kind == Kind::v1 && c.per_head)
    cmp("dlambda per head", rel_error(dlambdasl, dlambdas), tb);
  else if (c.kind == Kind::v1)
    cmp("dlambda",
        std::abs(double(dlambdal) - double(dlambda)) / std::max(1.0, std::abs(double(dlambda))),
        tb);
  if (c.kind == Kind::v1)
    check(c.per_head ? same_on_all_ranks(comm, dlambdasl.data(), dlambdasl.size())
                     : same_on_all_ranks(comm, &dlambdal, 1),
          name + ": dlambda differs between the ranks");
  if (c.kind == Kind::v2)
    cmp("dlambda_logit", rel_error(dlogitl, dm::shard(dlogit, rank, world, s)), tb);
  if (c.mods.sinks) {
    cmp("dsinks", rel_error(dsinksl, dsinks), tb);
    check(same_on_all_ranks(comm, dsinksl.data(), dsinksl.size()),
          name + ": dsinks differs between the ranks");
  }
  if (c.mods.any() || kFunctor) {
    // The same bits with 2 threads.
    const Tensor<T, 4> out1 = outl, dq1 = dql, dk1 = dkl, dv1 = dvl;
    const Tensor<T, 3> lse1 = lsel, dlogit1 = dlogitl;
    const Tensor<T, 1> dsinks1 = dsinksl, dlambdas1 = dlambdasl;
    const T dlambda1 = dlambdal;
    AttentionOptions o2 = o;
    o2.num_threads = 2;
    ring(o2);
    check(bitwise_equal(out1, outl) && bitwise_equal(lse1, lsel) && bitwise_equal(dq1, dql) &&
              bitwise_equal(dk1, dkl) && bitwise_equal(dv1, dvl) &&
              bitwise_equal(dlogit1, dlogitl) && bitwise_equal(dsinks1, dsinksl) &&
              bitwise_equal(dlambdas1, dlambdasl) &&
              std::memcmp(&dlambda1, &dlambdal, sizeof(T)) == 0,
          name + ": 1 and 2 threads differ");
  }
}

/// f must throw diffattn::error holding `word` on this rank.
void expect_error(const std::string& what, const std::function<void()>& f, const char* word) {
  std::string msg;
  bool thrown = false;
  try {
    f();
  } catch (const diffattn::error& e) {
    thrown = true;
    msg = e.what();
  }
  check(thrown, what + ": no diffattn::error");
  if (thrown)
    check(msg.find(word) != std::string::npos,
          what + ": message \"" + msg + "\" lacks \"" + word + "\"");
}

void error_cases(MPI_Comm comm) {
  namespace dm = diffattn::mpi;
  const int rank = g_rank, world = g_world;
  const index_t N = 4 * world;
  auto q = random_tensor<float, 4>({1, N, 2, 8}, 1), k = random_tensor<float, 4>({1, N, 2, 8}, 2),
       v = random_tensor<float, 4>({1, N, 1, 16}, 3);
  // N not divisible: the shard helper refuses on every rank alike.
  auto qodd = random_tensor<float, 4>({1, 2 * world + 1, 2, 8}, 4);
  if (world > 1)
    expect_error(
        "shard of N = 2W + 1 tokens", [&] { dm::shard(qodd, rank, world, Sharding::contiguous); },
        "do not split");
  expect_error(
      "zigzag shard of N = 2W + 1 tokens", [&] { dm::shard(qodd, rank, world, Sharding::zigzag); },
      "do not split");
  if (world > 1)
    expect_error(
        "zigzag shard of N = 2W + 2 tokens",
        [&] {
          auto q2 = random_tensor<float, 4>({1, 2 * world + 2, 2, 8}, 4);
          dm::shard(q2, rank, world, Sharding::zigzag);
        },
        "do not split");
  // Shards of unequal length (an N that does not split): every rank refuses.
  if (world > 1) {
    const index_t n = rank == 0 ? 5 : 4;
    auto qa = random_tensor<float, 4>({1, n, 2, 8}, 5),
         ka = random_tensor<float, 4>({1, n, 2, 8}, 6),
         va = random_tensor<float, 4>({1, n, 1, 16}, 7);
    Tensor<float, 4> oa({1, n, 1, 16});
    Tensor<float, 3> la({1, 2, n});
    expect_error(
        "unequal shards",
        [&] {
          dm::diff_attention_v1<float>(comm, qa, ka, va, 0.5f, oa, la, {}, Sharding::contiguous);
        },
        "the tokens per rank");
  }
  // An odd shard under zigzag: refused on every rank (the same shape everywhere).
  {
    auto qa = random_tensor<float, 4>({1, 3, 2, 8}, 5),
         ka = random_tensor<float, 4>({1, 3, 2, 8}, 6),
         va = random_tensor<float, 4>({1, 3, 1, 16}, 7);
    Tensor<float, 4> oa({1, 3, 1, 16});
    Tensor<float, 3> la({1, 2, 3});
    expect_error(
        "odd zigzag shard", [&] { dm::diff_attention_v1<float>(comm, qa, ka, va, 0.5f, oa, la); },
        "zigzag");
  }
  const auto ql = dm::shard(q, rank, world, Sharding::zigzag),
             kl = dm::shard(k, rank, world, Sharding::zigzag),
             vl = dm::shard(v, rank, world, Sharding::zigzag);
  Tensor<float, 4> ol({1, ql.shape(1), 1, 16});
  Tensor<float, 3> ll({1, 2, ql.shape(1)});
  if (world > 1) {
    // Lambda and options that differ across ranks.
    expect_error(
        "lambda differs",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, rank == 0 ? 0.5f : 0.25f, ol, ll); },
        "lambda");
    Tensor<float, 1> heads({1});
    heads(0) = rank == 0 ? 0.5f : 0.25f;
    expect_error(
        "lambda per head differs",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, heads, ol, ll); }, "lambda");
    AttentionOptions o;
    o.causal = rank == world - 1;
    expect_error(
        "causal differs", [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
        "options.causal");
    // One rank with a bad argument: all ranks throw.
    Tensor<float, 4> bad({1, ql.shape(1), 1, rank == 0 ? 15 : 16});
    expect_error(
        "one rank's bad out",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, bad, ll); },
        rank == 0 ? "out has shape" : "rank 0 of");
  }
  // Bad local arguments on every rank (k and q hold different tokens).
  auto kshort = random_tensor<float, 4>({1, ql.shape(1) + 2, 2, 8}, 8),
       vshort = random_tensor<float, 4>({1, ql.shape(1) + 2, 1, 16}, 9);
  expect_error(
      "q and k of different lengths",
      [&] { dm::diff_attention_v1<float>(comm, ql, kshort, vshort, 0.5f, ol, ll); },
      "same shard of tokens");
  // The backward needs lse.
  Tensor<float, 4> dq(ql.shape()), dk(kl.shape()), dv(vl.shape());
  float dl = 0;
  expect_error(
      "backward without lse",
      [&] {
        dm::diff_attention_v1_backward<float>(comm, ql, kl, vl, 0.5f, ol,
                                              TensorView<const float, 3>(), ol, dq, dk, dv, dl);
      },
      "lse");
  // Bad score modifiers: refused on every rank, never a hang.
  {
    std::vector<float> slopes = {0.1f, 0.2f}, sinks = {0.5f, -0.5f}, sinks3 = {0.f, 0.f, 0.f};
    std::vector<float> slopes_r = slopes;
    if (rank == world - 1) slopes_r[1] = 0.25f;
    AttentionOptions o;
    o.softcap = -1.0f;
    expect_error(
        "negative softcap",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
        "options.softcap");
    o = {};
    o.softcap = std::numeric_limits<float>::infinity();
    expect_error(
        "infinite softcap",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
        "options.softcap");
    o = {};
    o.sinks = TensorView<const float, 1>(sinks3.data(), {3});
    expect_error(
        "sinks of the wrong length",
        [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); }, "options.sinks");
    // dsinks without sinks, and dsinks of the wrong length.
    Tensor<float, 1> ds({2}), ds3({3});
    expect_error(
        "dsinks without sinks",
        [&] {
          dm::diff_attention_v1_backward<float>(comm, ql, kl, vl, 0.5f, ol, ll, ol, dq, dk, dv, dl,
                                                AttentionOptions{}, ds);
        },
        "dsinks");
    o = {};
    o.sinks = TensorView<const float, 1>(sinks.data(), {2});
    expect_error(
        "dsinks of the wrong length",
        [&] {
          dm::diff_attention_v1_backward<float>(comm, ql, kl, vl, 0.5f, ol, ll, ol, dq, dk, dv, dl,
                                                o, ds3);
        },
        "dsinks");
    if (world > 1) {
      // One rank with bad slopes: every rank throws.
      std::vector<float> nan_slopes = slopes;
      if (rank == 0) nan_slopes[0] = std::numeric_limits<float>::quiet_NaN();
      o = {};
      o.alibi_slopes = TensorView<const float, 1>(nan_slopes.data(), {2});
      expect_error(
          "one rank's NaN slope",
          [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
          rank == 0 ? "options.alibi_slopes" : "rank 0 of");
      // Modifiers that differ across ranks.
      o = {};
      o.alibi_slopes = TensorView<const float, 1>(slopes_r.data(), {2});
      expect_error(
          "slopes differ", [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
          "options.alibi_slopes");
      o = {};
      o.softcap = rank == 0 ? 5.0f : 4.0f;
      expect_error(
          "softcap differs",
          [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
          "options.softcap");
      o = {};
      if (rank == 0) o.sinks = TensorView<const float, 1>(sinks.data(), {2});
      expect_error(
          "sinks on one rank only",
          [&] { dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o); },
          rank == 0 ? "options.sinks" : "options.sinks");
      // The backward: dsinks wanted on one rank only.
      o = {};
      o.sinks = TensorView<const float, 1>(sinks.data(), {2});
      dm::diff_attention_v1<float>(comm, ql, kl, vl, 0.5f, ol, ll, o);
      expect_error(
          "dsinks on one rank only",
          [&] {
            dm::diff_attention_v1_backward<float>(comm, ql, kl, vl, 0.5f, ol, ll, ol, dq, dk, dv,
                                                  dl, o,
                                                  rank == 0 ? ds.view() : TensorView<float, 1>());
          },
          "dsinks");
    }
  }
  // Still in step: a collective after the errors completes.
  int one = 1, sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, comm);
  check(sum == world, "a collective after the errors");
}

void gather_case(MPI_Comm comm) {
  namespace dm = diffattn::mpi;
  for (Sharding s : {Sharding::contiguous, Sharding::zigzag}) {
    auto x = random_tensor<double, 4>({2, 6 * g_world, 3, 5}, 77);
    auto l = random_tensor<double, 3>({2, 3, 6 * g_world}, 78);
    auto back = dm::gather(comm, dm::shard(x, g_rank, g_world, s), s);
    auto lb = dm::gather(comm, dm::shard(l, g_rank, g_world, s, 2), s, 0, 2);
    if (g_rank == 0) {
      check(rel_error(back, x) == 0, "gather(shard(x)) == x");
      check(rel_error(lb, l) == 0, "gather(shard(lse, axis 2)) == lse");
    } else {
      check(back.size() == 0, "gather gives an empty tensor off the root");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init failed\n");
    return 2;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  std::uint64_t seed = 100;
  const index_t W = g_world;
  std::vector<Case> cases;
  for (Sharding s : {Sharding::zigzag, Sharding::contiguous}) {
    for (bool causal : {false, true}) {
      cases.push_back({Kind::v1, 2, 2 * W * 7, 2, 1, 8, causal, -1, -1, s});  // GQA 2:1
      cases.push_back({Kind::v2, 1, 2 * W * 9, 2, 2, 8, causal, -1, -1, s});  // 2H / Hkv = 2
      cases.push_back({Kind::plain, 1, 2 * W * 33, 4, 2, 16, causal, -1, -1, s});
    }
    // One lambda per DIFF head (GQA 2:1), causal and with a window.
    cases.push_back({Kind::v1, 1, 2 * W * 7, 4, 2, 8, true, -1, -1, s, true});
    cases.push_back({Kind::v1, 2, 2 * W * 8, 2, 1, 8, false, 5, 3, s, true});
    // Windows over global positions, reaching across shard boundaries.
    cases.push_back({Kind::v1, 1, 2 * W * 10, 2, 2, 8, true, 13, -1, s});
    cases.push_back({Kind::v2, 1, 2 * W * 10, 2, 1, 8, false, 3, 11, s});
    cases.push_back({Kind::plain, 1, 2 * W * 10, 2, 1, 8, false, -1, 7, s});
  }
  // Score modifiers over global positions: softcap, ALiBi, sinks, and each alone.
  std::vector<Case> mod_cases;
  const Mods all{2.0f, true, true};
  for (Sharding s : {Sharding::zigzag, Sharding::contiguous}) {
    mod_cases.push_back({Kind::v1, 2, 2 * W * 7, 2, 1, 8, true, -1, -1, s, false, all});
    mod_cases.push_back({Kind::v1, 1, 2 * W * 7, 2, 1, 8, false, -1, -1, s, false, all});
    mod_cases.push_back({Kind::v1, 1, 2 * W * 8, 2, 2, 8, false, -1, -1, s, true, {0, true, true}});
    mod_cases.push_back({Kind::v1, 1, 2 * W * 8, 4, 2, 8, true, -1, -1, s, true, all});
    mod_cases.push_back({Kind::v2, 1, 2 * W * 9, 2, 2, 8, true, 11, -1, s, false, all});
    mod_cases.push_back({Kind::v2, 1, 2 * W * 9, 2, 1, 8, false, -1, -1, s, false, all});
    mod_cases.push_back(
        {Kind::v2, 1, 2 * W * 6, 2, 1, 8, false, -1, -1, s, false, {1.5f, false, false}});
    mod_cases.push_back({Kind::plain, 1, 2 * W * 17, 4, 2, 16, false, -1, -1, s, false, all});
    mod_cases.push_back({Kind::plain, 1, 2 * W * 17, 4, 2, 16, true, -1, -1, s, false, all});
    mod_cases.push_back(
        {Kind::plain, 2, 2 * W * 10, 2, 1, 8, true, -1, -1, s, false, {0, false, true}});
    mod_cases.push_back(
        {Kind::plain, 1, 2 * W * 10, 2, 1, 8, false, 4, 6, s, false, {0, true, false}});
  }
  try {
    for (const Case& c : cases) {
      run_case<double>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
      run_case<float>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
    }
    for (const Case& c : mod_cases) {
      run_case<double>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
      run_case<float>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
    }
    // V1 and V2 beyond the size they gather their keys at: the ring with
    // per-map states.
    diffattn::detail::gather_limit() = 0;
    for (const std::vector<Case>* list : {&cases, &mod_cases})
      for (const Case& c : *list)
        if (c.kind != Kind::plain) {
          run_case<double>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
          run_case<float>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
        }
    diffattn::detail::gather_limit() = std::uint64_t(256) << 20;
    // User functors, i and j global: documents across shard boundaries.
    for (Sharding s : {Sharding::zigzag, Sharding::contiguous}) {
      const Case v1c{Kind::v1, 1, 2 * W * 7, 2, 1, 8, true, -1, -1, s, false, all};
      const Case v1h{Kind::v1, 1, 2 * W * 8, 2, 2, 8, false, -1, -1, s, true, {}};
      const Case v2c{Kind::v2, 1, 2 * W * 9, 2, 1, 8, false, -1, -1, s, false, {0, false, true}};
      const Case plc{Kind::plain, 2, 2 * W * 11, 4, 2, 8, false, -1, -1, s, false, all};
      const Case plk{Kind::plain, 1, 2 * W * 12, 2, 1, 8, true, -1, -1, s, false, {}};
      for (index_t doc : {index_t(5), index_t(W * 7 + 3)}) {
        for (std::uint64_t limit : {std::uint64_t(0), std::uint64_t(256) << 20}) {
          diffattn::detail::gather_limit() = limit;  // V1, V2 on the ring, then gathered
          run_case<double>(v1c, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocWarp{doc});
          run_case<float>(v1h, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocWarp{doc});
          run_case<double>(v2c, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocWarp{doc});
        }
        run_case<double>(plc, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocBlocks{doc});
        run_case<float>(plk, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocWarp{doc});
        run_case<double>(v1c, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocRanges{doc});
        run_case<double>(plc, seed += 10, MPI_COMM_WORLD, g_rank, g_world, DocRanges{doc});
      }
    }
    // A communicator of one rank: the single-process case on every rank.
    MPI_Comm self;
    MPI_Comm_split(MPI_COMM_WORLD, g_rank, 0, &self);
    for (Sharding s : {Sharding::zigzag, Sharding::contiguous}) {
      run_case<double>({Kind::v1, 1, 26, 2, 1, 8, true, -1, -1, s}, seed += 10, self, 0, 1);
      run_case<double>({Kind::v2, 1, 26, 2, 1, 8, true, -1, -1, s, false, all}, seed += 10, self, 0,
                       1);
      run_case<double>({Kind::plain, 1, 26, 2, 1, 8, false, -1, -1, s, false, all}, seed += 10,
                       self, 0, 1, DocWarp{6});
    }
    MPI_Comm_free(&self);
    gather_case(MPI_COMM_WORLD);
    error_cases(MPI_COMM_WORLD);
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  return mpi_check::finish("mpi");
}
