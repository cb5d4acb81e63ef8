// Context parallelism over MPI: every rank builds the same global problem, runs
// the single-process kernel on it as the oracle, and compares its own shard of
// the ring result, forward and backward. Run under mpirun with any number of
// ranks; prints "mpi: <passed> passed, <failed> failed" (counted over all
// ranks) and exits non-zero on any failure.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/mpi.hpp>

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using diffattn::mpi::Sharding;

namespace {

int g_rank = 0, g_world = 1;
int g_passed = 0, g_failed = 0;

void check(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("[rank %d] FAILED: %s\n", g_rank, what.c_str());
    std::fflush(stdout);
  }
}

template <class T, std::size_t R>
Tensor<T, R> random_tensor(const std::array<index_t, R>& shape, std::uint64_t seed,
                           double sigma = 1.0) {
  Tensor<T, R> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(sigma * rng.normal());
  return t;
}

/// max |a - b| / max(1e-30, max |b|); infinities must match exactly.
template <class T, std::size_t R>
double rel_error(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  if (a.shape() != b.shape()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (index_t i = 0; i < a.size(); ++i) {
    const double x = a.data()[i], y = b.data()[i];
    if (std::isinf(y) || std::isinf(x)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(x - y));
    den = std::max(den, std::abs(y));
  }
  return num / std::max(den, 1e-30);
}

template <class T>
double tol() {
  return std::is_same<T, float>::value ? 3e-5 : 1e-12;
}

enum class Kind { plain, v1, v2 };
const char* kind_name(Kind k) { return k == Kind::plain ? "plain" : k == Kind::v1 ? "v1" : "v2"; }

struct Case {
  Kind kind;
  index_t B, N, H, Hkv, d;  // H: DIFF heads (plain: query heads)
  bool causal;
  index_t window_left, window_right;
  Sharding sharding;
  bool per_head = false;  // v1: one lambda per DIFF head
};

std::string describe(const Case& c, const char* type) {
  return diffattn::detail::cat(kind_name(c.kind), "<", type, "> B=", c.B, " N=", c.N, " H=", c.H,
                               " Hkv=", c.Hkv, " d=", c.d, " causal=", c.causal, " window=(",
                               c.window_left, ", ", c.window_right, ") ",
                               diffattn::detail::sharding_name(c.sharding), " W=", g_world,
                               c.per_head ? " lambda per head" : "");
}

/// One case, forward and backward, against the single-process kernels.
template <class T>
void run_case(const Case& c, std::uint64_t seed, MPI_Comm comm, int rank, int world) {
  const std::string name = describe(c, std::is_same<T, float>::value ? "float" : "double");
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
  // The oracle on the whole sequence.
  Tensor<T, 4> out({B, N, oh, dv}), dq(q.shape()), dk(k.shape()), dvg(v.shape());
  Tensor<T, 3> lse({B, qh, N}), dlogit(logit.shape());
  T dlambda = 0;
  Tensor<T, 1> lambdas({c.H}), dlambdas({c.H});
  for (index_t h = 0; h < c.H; ++h) lambdas(h) = T(0.2) + T(0.15) * T(h);
  if (c.kind == Kind::v1 && c.per_head) {
    diffattn::diff_attention_v1<T>(q, k, v, lambdas, out, lse, o);
    diffattn::diff_attention_v1_backward<T>(q, k, v, lambdas, out, lse, dout, dq, dk, dvg, dlambdas,
                                            o);
  } else if (c.kind == Kind::v1) {
    diffattn::diff_attention_v1<T>(q, k, v, lambda, out, lse, o);
    diffattn::diff_attention_v1_backward<T>(q, k, v, lambda, out, lse, dout, dq, dk, dvg, dlambda,
                                            o);
  } else if (c.kind == Kind::v2) {
    diffattn::diff_attention_v2<T>(q, k, v, logit, out, lse, o);
    diffattn::diff_attention_v2_backward<T>(q, k, v, logit, out, lse, dout, dq, dk, dvg, dlogit, o);
  } else {
    diffattn::attention<T>(q, k, v, out, lse, o);
    diffattn::attention_backward<T>(q, k, v, out, lse, dout, dq, dk, dvg, o);
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
  if (c.kind == Kind::v1 && c.per_head) {
    dm::diff_attention_v1<T>(comm, ql, kl, vl, lambdas, outl, lsel, o, s);
    dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambdas, outl, lsel, dol, dql, dkl, dvl,
                                      dlambdasl, o, s);
  } else if (c.kind == Kind::v1) {
    dm::diff_attention_v1<T>(comm, ql, kl, vl, lambda, outl, lsel, o, s);
    dm::diff_attention_v1_backward<T>(comm, ql, kl, vl, lambda, outl, lsel, dol, dql, dkl, dvl,
                                      dlambdal, o, s);
  } else if (c.kind == Kind::v2) {
    dm::diff_attention_v2<T>(comm, ql, kl, vl, ll, outl, lsel, o, s);
    dm::diff_attention_v2_backward<T>(comm, ql, kl, vl, ll, outl, lsel, dol, dql, dkl, dvl, dlogitl,
                                      o, s);
  } else {
    dm::attention<T>(comm, ql, kl, vl, outl, lsel, o, s);
    dm::attention_backward<T>(comm, ql, kl, vl, outl, lsel, dol, dql, dkl, dvl, o, s);
  }
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
  if (c.kind == Kind::v2)
    cmp("dlambda_logit", rel_error(dlogitl, dm::shard(dlogit, rank, world, s)), tb);
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
  try {
    for (const Case& c : cases) {
      run_case<double>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
      run_case<float>(c, seed += 10, MPI_COMM_WORLD, g_rank, g_world);
    }
    // A communicator of one rank: the single-process case on every rank.
    MPI_Comm self;
    MPI_Comm_split(MPI_COMM_WORLD, g_rank, 0, &self);
    for (Sharding s : {Sharding::zigzag, Sharding::contiguous})
      run_case<double>({Kind::v1, 1, 26, 2, 1, 8, true, -1, -1, s}, seed += 10, self, 0, 1);
    MPI_Comm_free(&self);
    gather_case(MPI_COMM_WORLD);
    error_cases(MPI_COMM_WORLD);
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  int counts[2] = {g_passed, g_failed}, total[2] = {0, 0};
  MPI_Reduce(counts, total, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  int failed_any = 0;
  MPI_Allreduce(&g_failed, &failed_any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("mpi: %d passed, %d failed (%d ranks)\n", total[0], total[1], g_world);
  MPI_Finalize();
  // Nothing checked is a failure too: ctest judges these runs by exit code.
  return failed_any || (g_rank == 0 && total[0] == 0) ? 1 : 0;
}
