// Ring attention: one long sequence split across MPI ranks (context
// parallelism), DIFF V1 and V2, causal, zigzag sharding.
//
//   mpirun -np 4 ./build/examples/ring_attention            64k tokens
//   mpirun -np 2 ./build/examples/ring_attention --quick    a short run (ctest)
//   options: --n N (tokens of the long run), --check-n N (the checked run)
//
// 1. A shorter sequence is sharded, run on the ring (forward and backward),
//    gathered on rank 0 and compared with the single-process kernels there.
// 2. The long sequence: every rank makes only its own shard, runs V1 and V2,
//    and reports its time, the bytes it sent and the fraction of the time it
//    waited on communication. V2 runs the ring (no rank holds the whole
//    sequence); V1 gathers the keys and values while they take at most 256 MiB
//    per rank (here: 64k tokens x 256 floats = 64 MiB), and runs the ring
//    beyond (docs/mpi.md).
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/mpi.hpp>

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
namespace dm = diffattn::mpi;

namespace {

int rank = 0, world = 1;

Tensor<float, 4> random4(const std::array<index_t, 4>& shape, std::uint64_t seed) {
  Tensor<float, 4> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

double rel_error(const Tensor<float, 4>& a, const Tensor<float, 4>& b) {
  double num = 0, den = 0;
  for (index_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(double(a.data()[i]) - double(b.data()[i])));
    den = std::max(den, std::abs(double(b.data()[i])));
  }
  return num / std::max(den, 1e-30);
}

bool check_against_single_process(index_t N) {
  const index_t B = 1, H = 2, Hkv = 1, d = 32;
  const float lambda = 0.8f;
  const auto q = random4({B, N, 2 * H, d}, 1), k = random4({B, N, 2 * Hkv, d}, 2),
             v = random4({B, N, Hkv, 2 * d}, 3), dout = random4({B, N, H, 2 * d}, 4);
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 1;
  const dm::Sharding s = dm::Sharding::zigzag;
  const auto ql = dm::shard(q, rank, world, s), kl = dm::shard(k, rank, world, s),
             vl = dm::shard(v, rank, world, s), dl = dm::shard(dout, rank, world, s);
  const index_t n = ql.shape(1);
  Tensor<float, 4> out({B, n, H, 2 * d}), dq(ql.shape()), dk(kl.shape()), dv(vl.shape());
  Tensor<float, 3> lse({B, 2 * H, n});
  float dlambda = 0;
  dm::diff_attention_v1<float>(MPI_COMM_WORLD, ql, kl, vl, lambda, out, lse, o, s);
  dm::diff_attention_v1_backward<float>(MPI_COMM_WORLD, ql, kl, vl, lambda, out, lse, dl, dq, dk,
                                        dv, dlambda, o, s);
  const auto out_g = dm::gather(MPI_COMM_WORLD, out, s), dq_g = dm::gather(MPI_COMM_WORLD, dq, s),
             dk_g = dm::gather(MPI_COMM_WORLD, dk, s), dv_g = dm::gather(MPI_COMM_WORLD, dv, s);
  int ok = 1;
  if (rank == 0) {
    Tensor<float, 4> ref({B, N, H, 2 * d}), rq(q.shape()), rk(k.shape()), rv(v.shape());
    Tensor<float, 3> rl({B, 2 * H, N});
    float rdl = 0;
    diffattn::diff_attention_v1<float>(q, k, v, lambda, ref, rl, o);
    diffattn::diff_attention_v1_backward<float>(q, k, v, lambda, ref, rl, dout, rq, rk, rv, rdl, o);
    const double e[5] = {rel_error(out_g, ref), rel_error(dq_g, rq), rel_error(dk_g, rk),
                         rel_error(dv_g, rv),
                         std::abs(double(dlambda) - rdl) / std::max(1.0, std::abs(double(rdl)))};
    std::printf("check: %lld tokens over %d ranks (V1, causal, zigzag) against one process\n",
                static_cast<long long>(N), world);
    std::printf("  max relative error: out %.1e, dq %.1e, dk %.1e, dv %.1e, dlambda %.1e\n", e[0],
                e[1], e[2], e[3], e[4]);
    for (double x : e) ok = ok && x < 1e-4;
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return ok != 0;
}

/// The long run of one kernel: rows of per-rank stats on rank 0.
void long_run(const char* name, index_t N, bool v2) {
  const index_t B = 1, H = 1, d = 64, n = N / world;
  const index_t kh = v2 ? 1 : 2, dv = v2 ? d : 2 * d;
  // Only this rank's shard exists anywhere.
  const std::uint64_t seed = 1000 + 10 * static_cast<std::uint64_t>(rank);
  const auto q = random4({B, n, 2 * H, d}, seed), k = random4({B, n, kh, d}, seed + 1),
             v = random4({B, n, 1, dv}, seed + 2);
  Tensor<float, 3> logit({B, n, H});
  Tensor<float, 4> out({B, n, H, dv});
  Tensor<float, 3> lse({B, 2 * H, n});
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 1;
  dm::RingStats st;
  MPI_Barrier(MPI_COMM_WORLD);
  if (v2)
    dm::diff_attention_v2<float>(MPI_COMM_WORLD, q, k, v, logit, out, lse, o, dm::Sharding::zigzag,
                                 &st);
  else
    dm::diff_attention_v1<float>(MPI_COMM_WORLD, q, k, v, 0.8f, out, lse, o, dm::Sharding::zigzag,
                                 &st);
  double mine[3] = {st.seconds, st.wait_seconds, double(st.bytes_sent)};
  std::vector<double> all(3 * static_cast<std::size_t>(world));
  MPI_Gather(mine, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  std::printf("\n%s, causal, zigzag: %lld tokens, %d ranks of %lld, B=1, H=1, d=64, float\n", name,
              static_cast<long long>(N), world, static_cast<long long>(n));
  std::printf("  rank   time (s)   sent (MiB)   waiting on MPI\n");
  for (int r = 0; r < world; ++r) {
    const double* x = &all[3 * static_cast<std::size_t>(r)];
    std::printf("  %4d %10.3f %12.2f %15.1f%%\n", r, x[0], x[2] / (1 << 20), 100 * x[1] / x[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    std::fprintf(stderr, "MPI_Init failed\n");
    return 1;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  bool quick = false;
  index_t N = 65536, check_n = 4096;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--n") && i + 1 < argc) N = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--check-n") && i + 1 < argc) check_n = std::atoll(argv[++i]);
  }
  if (quick) {
    N = 4096;
    check_n = 512;
  }
  // Zigzag needs N % 2W == 0: round to a multiple.
  const index_t unit = 2 * static_cast<index_t>(world);
  N = std::max(unit, N / unit * unit);
  check_n = std::max(unit, check_n / unit * unit);
  int rc = 0;
  try {
    const bool ok = check_against_single_process(check_n);
    long_run("DIFF V1", N, false);
    long_run("DIFF V2", N, true);
    if (rank == 0) std::printf(ok ? "\nall checks passed\n" : "\nCHECK FAILED\n");
    rc = ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
