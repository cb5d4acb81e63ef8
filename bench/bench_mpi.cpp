// Context parallelism: W ranks x 1 thread against 1 process x 1 thread.
//
//   mpirun -np 2 ./build/bench/bench_mpi [--n 16384] [--heads 2] [--d 64] [--reps 7]
//
// DIFF V1, then V2 for comparison, causal, float, forward and backward.
// Baseline on rank 0 alone (the other ranks sleep, not spin): the fused
// single-process kernels. Then the MPI calls over all ranks, zigzag and
// contiguous (V1 and V2: the keys gathered, the fused kernels on each rank's
// rows): time of the slowest rank, the largest
// fraction of a call spent in MPI, bytes sent. Best of --reps runs each.
// The speed-up also in CPU time (the fused call's against the busiest rank's):
// on shared cores wall time follows each process's share of a core. For V1
// with zigzag sharding, each rank's own computation (the fused kernel on its
// query runs) is also timed alone on rank 0, in CPU time. Last, V1's zigzag call's
// forward with score modifiers (softcap; ALiBi over global positions; sinks) against the same call
// without, the calls interleaved, as ratios of the best times.
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
#include <ctime>
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

/// CPU seconds of the calling thread (the kernels run on it: 1 thread per
/// process). On a machine whose cores are shared, wall time follows the share
/// of a core each process gets; CPU time follows the work (and time spinning
/// in MPI calls, which Open MPI does while it waits).
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
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
  // Per step, every rank's (seconds, comm_seconds, ready_seconds,
  // exchange_seconds, bytes read): the step is the slowest rank's time. The
  // rank that reached the state exchange last waited for nobody there: its
  // exchange_seconds is the all-gather's own cost; the largest
  // exchange_seconds adds the wait for the slower rank (imbalance); the rest
  // of comm_seconds (communicator, argument and length exchanges) is given
  // apart.
  double best = 1e30, own = 0, worst_ex = 0, setup = 0, worst_comm = 0, skew = 0, bytes_read = 0,
         state = 0;
  for (int r = 0; r < reps; ++r) {
    dm::DecodeStats st;
    MPI_Barrier(MPI_COMM_WORLD);
    dm::diff_attention_v2_kvcache<float, KV>(MPI_COMM_WORLD, q, k, v, logit, out, lse, cb, o, &st);
    constexpr int F = 5;
    const double mine[F] = {st.seconds, st.comm_seconds, st.ready_seconds, st.exchange_seconds,
                            double(st.bytes_read)};
    std::vector<double> all(F * static_cast<std::size_t>(world));
    MPI_Allgather(mine, F, MPI_DOUBLE, all.data(), F, MPI_DOUBLE, MPI_COMM_WORLD);
    double step = 0, ready_lo = 1e30, ready_hi = -1, comm_hi = 0, ex_hi = 0, own_ex = 0,
           setup_hi = 0, read = 0;
    for (int w = 0; w < world; ++w) {
      const double* a = all.data() + F * w;
      step = std::max(step, a[0]);
      comm_hi = std::max(comm_hi, a[1]);
      ex_hi = std::max(ex_hi, a[3]);
      setup_hi = std::max(setup_hi, a[1] - a[3]);
      read = std::max(read, a[4]);
      ready_lo = std::min(ready_lo, a[2]);
      if (a[2] > ready_hi) {
        ready_hi = a[2];
        own_ex = a[3];
      }
    }
    if (step < best) {
      best = step;
      own = own_ex / step;
      worst_ex = ex_hi / step;
      setup = setup_hi / step;
      worst_comm = comm_hi / step;
      skew = (ready_hi - ready_lo) / step;
      bytes_read = read;
      state = double(st.state_bytes);
    }
  }
  if (rank == 0) {
    char label[64];
    std::snprintf(label, sizeof label, "%d ranks, sharded step (slowest rank)", world);
    std::printf(
        "  %-40s %9.3f ms   speed-up %.2fx (vs single-process)   states %.1f KiB per rank   "
        "K/V read %.0f MiB per rank\n",
        label, best * 1e3, single / best, state / 1024, bytes_read / (1 << 20));
    std::printf(
        "  %-40s state all-gather: its own cost %.3f%% of the step (on the rank that came "
        "last), with waiting for the slower rank up to %.2f%%; the ranks reached it %.2f%% of "
        "the step apart; setup collectives (communicator, arguments, lengths) up to %.2f%%; all "
        "MPI up to %.2f%%\n",
        "", 100 * own, 100 * worst_ex, 100 * skew, 100 * setup, 100 * worst_comm);
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
  int reps = 7;  // best of 7: on a shared host, other tenants slow whole seconds of a run
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
             v = random4({B, N, Hkv, 2 * d}, 3), dout = random4({B, N, H, 2 * d}, 4);
  // V2 for comparison: 2H query heads on Hkv kv heads of d.
  const auto k2 = random4({B, N, Hkv, d}, 5), v2 = random4({B, N, Hkv, d}, 6),
             dout2 = random4({B, N, H, d}, 7);
  Tensor<float, 3> logit({B, N, H});
  logit.fill(0.3f);
  if (rank == 0)
    std::printf("DIFF causal, B=1, H=%lld, d=%lld, N=%lld, float, 1 thread per process\n",
                static_cast<long long>(H), static_cast<long long>(d), static_cast<long long>(N));
  for (int kind = 1; kind <= 2; ++kind) {
    const bool v1 = kind == 1;
    const index_t dv = v1 ? 2 * d : d;
    const auto& kk = v1 ? k : k2;
    const auto& vv = v1 ? v : v2;
    const auto& dd = v1 ? dout : dout2;
    // Forward then backward of one call, single-process or over comm.
    auto fwd = [&](MPI_Comm comm, const Tensor<float, 4>& ql, const Tensor<float, 4>& kl,
                   const Tensor<float, 4>& vl, const Tensor<float, 3>& ll, Tensor<float, 4>& out,
                   Tensor<float, 3>& lse, dm::Sharding s, dm::RingStats* st) {
      if (comm == MPI_COMM_NULL && v1)
        diffattn::diff_attention_v1<float>(ql, kl, vl, lambda, out, lse, o);
      else if (comm == MPI_COMM_NULL)
        diffattn::diff_attention_v2<float>(ql, kl, vl, ll, out, lse, o);
      else if (v1)
        dm::diff_attention_v1<float>(comm, ql, kl, vl, lambda, out, lse, o, s, st);
      else
        dm::diff_attention_v2<float>(comm, ql, kl, vl, ll, out, lse, o, s, st);
    };
    auto bwd = [&](MPI_Comm comm, const Tensor<float, 4>& ql, const Tensor<float, 4>& kl,
                   const Tensor<float, 4>& vl, const Tensor<float, 3>& ll,
                   const Tensor<float, 4>& out, const Tensor<float, 3>& lse,
                   const Tensor<float, 4>& gl, dm::Sharding s, dm::RingStats* st) {
      Tensor<float, 4> dq(ql.shape()), dk(kl.shape()), dvg(vl.shape());
      Tensor<float, 3> dlogit(ll.shape());
      float dlambda = 0;
      if (comm == MPI_COMM_NULL && v1)
        diffattn::diff_attention_v1_backward<float>(ql, kl, vl, lambda, out, lse, gl, dq, dk, dvg,
                                                    dlambda, o);
      else if (comm == MPI_COMM_NULL)
        diffattn::diff_attention_v2_backward<float>(ql, kl, vl, ll, out, lse, gl, dq, dk, dvg,
                                                    dlogit, o);
      else if (v1)
        dm::diff_attention_v1_backward<float>(comm, ql, kl, vl, lambda, out, lse, gl, dq, dk, dvg,
                                              dlambda, o, s, st);
      else
        dm::diff_attention_v2_backward<float>(comm, ql, kl, vl, ll, out, lse, gl, dq, dk, dvg,
                                              dlogit, o, s, st);
    };
    // Best wall and CPU seconds of the forward and the backward: [pass], [2 + pass].
    double fused[4] = {1e30, 1e30, 1e30, 1e30};
    on_root_alone(rank, [&] {
      Tensor<float, 4> out({B, N, H, dv});
      Tensor<float, 3> lse({B, 2 * H, N});
      for (int r = 0; r < reps; ++r)
        for (int pass = 0; pass < 2; ++pass) {
          const double t0 = now(), c0 = cpu_now();
          if (pass == 0)
            fwd(MPI_COMM_NULL, q, kk, vv, logit, out, lse, dm::Sharding::zigzag, nullptr);
          else
            bwd(MPI_COMM_NULL, q, kk, vv, logit, out, lse, dd, dm::Sharding::zigzag, nullptr);
          fused[pass] = std::min(fused[pass], now() - t0);
          fused[2 + pass] = std::min(fused[2 + pass], cpu_now() - c0);
        }
      std::printf(
          "  V%d 1 process, fused kernel: forward %8.3f s (CPU %.3f s), backward %8.3f s (CPU "
          "%.3f s)\n",
          kind, fused[0], fused[2], fused[1], fused[3]);
    });
    MPI_Bcast(fused, 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (v1) {
      // Each rank's own computation under zigzag sharding (the fused kernel on
      // each of its query runs against the keys before it), timed one rank
      // after the other on rank 0 alone, in CPU time: what the MPI call
      // computes on that rank, free of the share of a core it gets when the
      // ranks run at once, against the fused call's CPU time.
      on_root_alone(rank, [&] {
        const index_t c = N / (2 * world);
        auto rows = [&](const Tensor<float, 4>& x, index_t r0, index_t len) {
          return diffattn::TensorView<const float, 4>(x.data() + r0 * x.view().stride(1),
                                                      {x.shape(0), len, x.shape(2), x.shape(3)},
                                                      x.view().strides());
        };
        double slowest[2] = {0, 0};
        std::printf("  V1 zigzag, each rank's fused work alone, CPU s (forward, backward):");
        for (int r = 0; r < world; ++r) {
          double t[2] = {1e30, 1e30};
          for (int rep = 0; rep < reps; ++rep) {
            double sum[2] = {0, 0};
            for (index_t g : {index_t(r) * c, (2 * index_t(world) - 1 - r) * c}) {
              const auto qr = rows(q, g, c), kr = rows(kk, 0, g + c), vr = rows(vv, 0, g + c);
              Tensor<float, 4> out({B, c, H, dv}), dq(qr.shape()), dk(kr.shape()), dvg(vr.shape());
              Tensor<float, 3> lse({B, 2 * H, c});
              float dl = 0;
              double t0 = cpu_now();
              diffattn::diff_attention_v1<float>(qr, kr, vr, lambda, out, lse, o);
              sum[0] += cpu_now() - t0;
              t0 = cpu_now();
              diffattn::diff_attention_v1_backward<float>(qr, kr, vr, lambda, out, lse,
                                                          rows(dd, g, c), dq, dk, dvg, dl, o);
              sum[1] += cpu_now() - t0;
            }
            for (int pass = 0; pass < 2; ++pass) t[pass] = std::min(t[pass], sum[pass]);
          }
          for (int pass = 0; pass < 2; ++pass) slowest[pass] = std::max(slowest[pass], t[pass]);
          std::printf(" rank %d %.3f s, %.3f s;", r, t[0], t[1]);
        }
        std::printf(" fused / busiest rank: %.2fx, %.2fx\n", fused[2] / slowest[0],
                    fused[3] / slowest[1]);
      });
    }
    for (dm::Sharding s : {dm::Sharding::zigzag, dm::Sharding::contiguous}) {
      const auto ql = dm::shard(q, rank, world, s), kl = dm::shard(kk, rank, world, s),
                 vl = dm::shard(vv, rank, world, s), gl = dm::shard(dd, rank, world, s);
      const auto ll = dm::shard(logit, rank, world, s);
      const index_t n = ql.shape(1);
      Tensor<float, 4> out({B, n, H, dv});
      Tensor<float, 3> lse({B, 2 * H, n});
      // Per pass: the slowest rank's best time, its largest fraction waiting on
      // MPI, bytes sent; the largest CPU time of a rank (best of the runs).
      double best[2] = {1e30, 1e30}, wait_frac[2] = {0, 0}, bytes[2] = {0, 0};
      double best_cpu[2] = {1e30, 1e30};
      for (int r = 0; r < reps; ++r)
        for (int pass = 0; pass < 2; ++pass) {
          dm::RingStats st;
          MPI_Barrier(MPI_COMM_WORLD);
          const double c0 = cpu_now();
          if (pass == 0)
            fwd(MPI_COMM_WORLD, ql, kl, vl, ll, out, lse, s, &st);
          else
            bwd(MPI_COMM_WORLD, ql, kl, vl, ll, out, lse, gl, s, &st);
          double mine[3] = {st.seconds, st.wait_seconds / st.seconds, cpu_now() - c0}, worst[3];
          MPI_Allreduce(mine, worst, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          best_cpu[pass] = std::min(best_cpu[pass], worst[2]);
          if (worst[0] < best[pass]) {
            best[pass] = worst[0];
            wait_frac[pass] = worst[1];
            bytes[pass] = double(st.bytes_sent);
          }
        }
      if (rank == 0)
        for (int pass = 0; pass < 2; ++pass)
          std::printf(
              "  V%d %d ranks, %-10s %-8s %8.3f s   speed-up %.2fx (vs fused; in CPU time "
              "%.2fx)   waiting on MPI <= %.1f%%   sent %.1f MiB per rank\n",
              kind, world, s == dm::Sharding::zigzag ? "zigzag," : "contiguous,",
              pass == 0 ? "forward" : "backward", best[pass], fused[pass] / best[pass],
              fused[2 + pass] / best_cpu[pass], 100 * wait_frac[pass], bytes[pass] / (1 << 20));
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
        std::printf("  %d ranks, V1 zigzag, modifier %-8s %8.3f s   %.3fx the call without\n",
                    world, names[m], best[m], best[m] / best[0]);
  }
  MPI_Finalize();
  return 0;
}
