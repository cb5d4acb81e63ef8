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
//
//   mpirun -np 2 ./build/bench/bench_mpi --decode [--keys 262144] [--bf16] [--reps 5]
//
// Sharded decoding (diffattn::mpi::diff_attention_v2_kvcache): one decoding
// step of V2 with 16 query heads (8 DIFF heads) on 8 kv heads of 64 over
// --keys keys in all, each rank holding keys / W of them, 1 thread per rank;
// against the single-process kernel on the whole cache (rank 0 alone). Then
// the collectives that could carry the per-map states, timed on the step's
// state size and on larger ones (see bench_collectives).
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
#include <diffattn/kvcache_attention.hpp>
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

/// Records of `rec` floats (lse, then o) merged as softmax states: inout =
/// in (the lower ranks) merged with inout.
int g_rec = 0;
void merge_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const float* a = static_cast<const float*>(in);
  float* b = static_cast<float*>(inout);
  const index_t dv = g_rec - 1;
  for (int r = 0; r < *len; ++r, a += g_rec, b += g_rec) {
    std::vector<float> o(a + 1, a + 1 + dv);
    const float l = diffattn::detail::merge_row<float>(o.data(), a[0], b + 1, b[0], dv);
    std::copy(o.begin(), o.end(), b + 1);
    b[0] = l;
  }
}

/// The collectives that could merge `rows` states of dv values across the
/// ranks, each timed over `iters` calls (microseconds per call, slowest rank):
/// MPI_Allgather then the merge in rank order on every rank; MPI_Allreduce
/// with a user operation (not commutative: rank order); MPI_Reduce_scatter_block
/// with it then MPI_Allgather.
void bench_collectives(int rank, int world, index_t rows, index_t dv, int iters) {
  g_rec = static_cast<int>(dv + 1);
  const index_t padded = (rows + world - 1) / world * world;
  std::vector<float> mine(static_cast<std::size_t>(padded * g_rec)), all(mine.size() * world),
      red(mine.size()), part(mine.size() / world);
  diffattn::detail::Rng rng(7 + rank);
  for (float& x : mine) x = static_cast<float>(rng.normal());
  MPI_Datatype rec;
  MPI_Type_contiguous(g_rec, MPI_FLOAT, &rec);
  MPI_Type_commit(&rec);
  MPI_Op op;
  MPI_Op_create(merge_op, 0, &op);
  const int n = static_cast<int>(padded), per = static_cast<int>(padded / world);
  auto timed = [&](const std::function<void()>& f) {
    f();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = now();
    for (int i = 0; i < iters; ++i) f();
    double t = (now() - t0) / iters * 1e6, worst = 0;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
  };
  const double ag = timed([&] {
    MPI_Allgather(mine.data(), n, rec, all.data(), n, rec, MPI_COMM_WORLD);
    std::copy(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()), red.begin());
    for (int r = 1; r < world; ++r) {
      int len = n;
      merge_op(all.data() + static_cast<std::size_t>(r) * mine.size(), red.data(), &len, nullptr);
    }
  });
  const double ar =
      timed([&] { MPI_Allreduce(mine.data(), red.data(), n, rec, op, MPI_COMM_WORLD); });
  const double rs = timed([&] {
    MPI_Reduce_scatter_block(mine.data(), part.data(), per, rec, op, MPI_COMM_WORLD);
    MPI_Allgather(part.data(), per, rec, red.data(), per, rec, MPI_COMM_WORLD);
  });
  if (rank == 0)
    std::printf(
        "  states of %6lld rows x %lld (%7.1f KiB per rank): allgather+merge %8.1f us, "
        "allreduce(user op) %8.1f us, reduce_scatter+allgather %8.1f us\n",
        static_cast<long long>(rows), static_cast<long long>(dv + 1),
        double(mine.size()) * 4 / 1024, ag, ar, rs);
  MPI_Op_free(&op);
  MPI_Type_free(&rec);
}

/// One sharded decoding step against the single-process kernel.
template <class KV>
void bench_decode(int rank, int world, index_t M, int reps) {
  const index_t B = 1, H = 8, Hkv = 8, d = 64, n = 1;
  const index_t m = M / world + (rank < M % world ? 1 : 0);  // this rank's keys
  AttentionOptions o;
  o.causal = true;
  o.num_threads = 1;
  const auto q = random4({B, n, 2 * H, d}, 11);
  Tensor<float, 3> logit({B, n, H});
  logit.fill(0.3f);
  auto cache = [](index_t rows, std::uint64_t seed) {
    Tensor<KV, 4> t({1, rows, 8, 64});
    diffattn::detail::Rng rng(seed);
    for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<KV>(rng.normal());
    return t;
  };
  if (rank == 0)
    std::printf(
        "sharded decode step: V2, 16 q heads on 8 kv heads of 64, M = %lld keys, %s "
        "cache, causal, 1 thread per rank, %d ranks\n",
        static_cast<long long>(M), sizeof(KV) == 2 ? "bfloat16" : "float", world);
  double single = 1e30, self_rank = 1e30;
  on_root_alone(rank, [&] {
    const auto k = cache(M, 21), v = cache(M, 22);
    std::vector<index_t> lens = {M};
    diffattn::KVCacheBatch cb;
    cb.cache_seqlens = diffattn::TensorView<const index_t, 1>(lens.data(), {1});
    Tensor<float, 4> out({B, n, H, d});
    Tensor<float, 3> lse({B, 2 * H, n});
    for (int r = 0; r < reps; ++r) {
      const double t0 = now();
      diffattn::diff_attention_v2_kvcache<float, KV>(q, k, v, logit, out, lse, cb, o);
      single = std::min(single, now() - t0);
    }
    // The kernel each rank runs for its states: plain GQA with 2H query heads.
    Tensor<float, 4> o_maps({B, n, 2 * H, d});
    Tensor<float, 3> l_maps({B, 2 * H, n});
    double maps = 1e30;
    for (int r = 0; r < reps; ++r) {
      double t0 = now();
      dm::diff_attention_v2_kvcache<float, KV>(MPI_COMM_SELF, q, k, v, logit, out, lse, cb, o);
      self_rank = std::min(self_rank, now() - t0);
      t0 = now();
      diffattn::attention_kvcache<float, KV>(q, k, v, o_maps, l_maps, cb, o);
      maps = std::min(maps, now() - t0);
    }
    std::printf("  %-40s %9.3f ms\n", "1 process, per-map states (plain, 2H q)", maps * 1e3);
    std::printf("  %-40s %9.3f ms   (%.0f MiB of K/V read)\n", "1 process, single-process kernel",
                single * 1e3, double(2 * M * Hkv * d * sizeof(KV)) / (1 << 20));
    std::printf("  %-40s %9.3f ms\n", "1 rank, sharded path (MPI_COMM_SELF)", self_rank * 1e3);
  });
  const auto k = cache(m, 31 + rank), v = cache(m, 41 + rank);
  std::vector<index_t> lens = {m};
  diffattn::KVCacheBatch cb;
  cb.cache_seqlens = diffattn::TensorView<const index_t, 1>(lens.data(), {1});
  Tensor<float, 4> out({B, n, H, d});
  Tensor<float, 3> lse({B, 2 * H, n});
  double best = 1e30, comm = 0, bytes_read = 0, state = 0;
  for (int r = 0; r < reps; ++r) {
    dm::DecodeStats st;
    MPI_Barrier(MPI_COMM_WORLD);
    dm::diff_attention_v2_kvcache<float, KV>(MPI_COMM_WORLD, q, k, v, logit, out, lse, cb, o, &st);
    double mine[3] = {st.seconds, st.comm_seconds / st.seconds, double(st.bytes_read)}, worst[3];
    MPI_Allreduce(mine, worst, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (worst[0] < best) {
      best = worst[0];
      comm = worst[1];
      bytes_read = worst[2];
      state = double(st.state_bytes);
    }
  }
  if (rank == 0) {
    char label[64];
    std::snprintf(label, sizeof label, "%d ranks, sharded step (slowest rank)", world);
    std::printf(
        "  %-40s %9.3f ms   speed-up %.2fx (vs single-process)   communication <= %.1f%% "
        "of the step   states %.1f KiB per rank   K/V read %.0f MiB per rank\n",
        label, best * 1e3, single / best, 100 * comm, state / 1024, bytes_read / (1 << 20));
  }
  bench_collectives(rank, world, B * n * 2 * H, d, 2000);
  bench_collectives(rank, world, 64 * 2 * H, d, 200);
  bench_collectives(rank, world, 64 * 4 * 2 * H, 2 * d, 50);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  index_t N = 16384, H = 2, d = 64;
  int reps = 3;
  index_t keys = 262144;
  bool decode = false, bf16 = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--decode")) decode = true;
    if (!std::strcmp(argv[i], "--bf16")) bf16 = true;
    if (i + 1 >= argc) continue;
    if (!std::strcmp(argv[i], "--keys")) keys = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--n")) N = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--heads")) H = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--d")) d = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[++i]);
  }
  if (decode) {
    if (bf16)
      bench_decode<diffattn::bfloat16>(rank, world, keys, reps);
    else
      bench_decode<float>(rank, world, keys, reps);
    MPI_Finalize();
    return 0;
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
