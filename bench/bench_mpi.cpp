// Context parallelism: W ranks x 1 thread against 1 process x 1 thread.
//
//   mpirun -np 2 ./build/bench/bench_mpi [--n 16384] [--heads 2] [--d 64] [--reps 3]
//
// DIFF V1, causal, float. Baselines on rank 0 alone (the other ranks sleep,
// not spin): the fused single-process kernel, and the ring's own arithmetic
// in one process: each map's state by the plain kernel on that map's heads
// (the ring needs one (o, lse) state per map to merge across ranks, so V1
// costs 2d + 2 x 2d multiply-adds per pair against the fused kernel's
// 2d + 2d: 1.5x). A one-rank communicator runs the fused kernel itself.
// Then the ring over all ranks, zigzag and contiguous: time of the slowest
// rank, the largest fraction of a call spent waiting on MPI, bytes sent.
// Best of --reps runs each. Last, the zigzag ring's forward with score
// modifiers (softcap; ALiBi over global positions; sinks) against the same
// ring without, the calls interleaved, as ratios of the best times.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/diff_states.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/mpi.hpp>

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
namespace dm = diffattn::mpi;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Tensor<float, 4> random4(const std::array<index_t, 4>& shape, std::uint64_t seed) {
  Tensor<float, 4> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

/// Runs f on rank 0 while the other ranks sleep in a non-blocking barrier.
void on_root_alone(int rank, const std::function<void()>& f) {
  if (rank == 0) f();
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  int done = 0;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  index_t N = 16384, H = 2, d = 64;
  int reps = 3;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--n")) N = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--heads")) H = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--d")) d = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[++i]);
  }
  const index_t B = 1, Hkv = H;
  const float lambda = 0.8f;
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 1;
  const auto q = random4({B, N, 2 * H, d}, 1), k = random4({B, N, 2 * Hkv, d}, 2),
             v = random4({B, N, Hkv, 2 * d}, 3);
  if (rank == 0)
    std::printf("DIFF V1 causal, B=1, H=%lld, d=%lld, N=%lld, float, 1 thread per process\n",
                static_cast<long long>(H), static_cast<long long>(d), static_cast<long long>(N));
  double fused = 1e30, self_ring = 1e30;
  on_root_alone(rank, [&] {
    Tensor<float, 4> out({B, N, H, 2 * d});
    Tensor<float, 3> lse({B, 2 * H, N});
    for (int r = 0; r < reps; ++r) {
      const double t0 = now();
      diffattn::diff_attention_v1<float>(q, k, v, lambda, out, lse, o);
      fused = std::min(fused, now() - t0);
    }
    Tensor<float, 4> o_map({B, N, H, 2 * d});
    Tensor<float, 3> l_map({B, H, N});
    for (int r = 0; r < reps; ++r) {
      const double t0 = now();
      for (int m = 0; m < 2; ++m)
        diffattn::attention<float>(diffattn::map_heads<const float>(q.view(), m),
                                   diffattn::map_heads<const float>(k.view(), m), v, o_map, l_map,
                                   o);
      self_ring = std::min(self_ring, now() - t0);
    }
    std::printf("  %-36s %8.3f s\n", "1 process, fused kernel", fused);
    std::printf("  %-36s %8.3f s\n", "1 process, per-map states", self_ring);
  });
  for (dm::Sharding s : {dm::Sharding::zigzag, dm::Sharding::contiguous}) {
    const auto ql = dm::shard(q, rank, world, s), kl = dm::shard(k, rank, world, s),
               vl = dm::shard(v, rank, world, s);
    const index_t n = ql.shape(1);
    Tensor<float, 4> out({B, n, H, 2 * d});
    Tensor<float, 3> lse({B, 2 * H, n});
    double best = 1e30, wait_frac = 0, bytes = 0;
    for (int r = 0; r < reps; ++r) {
      dm::RingStats st;
      MPI_Barrier(MPI_COMM_WORLD);
      dm::diff_attention_v1<float>(MPI_COMM_WORLD, ql, kl, vl, lambda, out, lse, o, s, &st);
      double mine[2] = {st.seconds, st.wait_seconds / st.seconds}, worst[2];
      MPI_Allreduce(mine, worst, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (worst[0] < best) {
        best = worst[0];
        wait_frac = worst[1];
        bytes = double(st.bytes_sent);
      }
    }
    if (rank == 0) {
      char label[64];
      std::snprintf(label, sizeof label, "%d ranks, ring, %s", world,
                    s == dm::Sharding::zigzag ? "zigzag" : "contiguous");
      std::printf(
          "  %-36s %8.3f s   speed-up %.2f (vs fused) %.2f (vs per-map states)   "
          "waiting on MPI <= %.1f%%   sent %.1f MiB per rank\n",
          label, best, fused / best, self_ring / best, 100 * wait_frac, bytes / (1 << 20));
    }
  }
  {
    const dm::Sharding s = dm::Sharding::zigzag;
    const auto ql = dm::shard(q, rank, world, s), kl = dm::shard(k, rank, world, s),
               vl = dm::shard(v, rank, world, s);
    const index_t n = ql.shape(1);
    Tensor<float, 4> out({B, n, H, 2 * d});
    Tensor<float, 3> lse({B, 2 * H, n});
    std::vector<float> slopes = diffattn::standard_alibi_slopes(2 * H), sinks(slopes.size(), 0.5f);
    AttentionOptions variants[4] = {o, o, o, o};
    variants[1].softcap = 30.0f;
    variants[2].alibi_slopes = diffattn::TensorView<const float, 1>(slopes.data(), {2 * H});
    variants[3].sinks = diffattn::TensorView<const float, 1>(sinks.data(), {2 * H});
    const char* names[4] = {"none", "softcap", "ALiBi", "sinks"};
    double best[4] = {1e30, 1e30, 1e30, 1e30};
    for (int r = 0; r < reps; ++r)
      for (int m = 0; m < 4; ++m) {
        dm::RingStats st;
        MPI_Barrier(MPI_COMM_WORLD);
        dm::diff_attention_v1<float>(MPI_COMM_WORLD, ql, kl, vl, lambda, out, lse, variants[m], s,
                                     &st);
        double worst = 0;
        MPI_Allreduce(&st.seconds, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        best[m] = std::min(best[m], worst);
      }
    if (rank == 0)
      for (int m = 0; m < 4; ++m)
        std::printf("  %d ranks, ring, zigzag, modifier %-8s %8.3f s   %.3fx the ring without\n",
                    world, names[m], best[m], best[m] / best[0]);
  }
  MPI_Finalize();
  return 0;
}
