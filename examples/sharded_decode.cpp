// Decoding over a long KV cache split across MPI ranks (tree attention):
//
//   mpirun -np 4 ./build/examples/sharded_decode [--keys 262144] [--steps 8] [--quick]
//
// A MultiheadDiffAttnV2 layer (8 DIFF heads, 16 query heads on 8 kv heads of
// 64, bfloat16 cache) holds a context of --keys tokens split evenly across the
// ranks (each rank's cache is its slice, filled here with the keys and values
// of a seeded stand-in context), then decodes --steps tokens with
// diffattn::mpi::forward: each step's key and value go to the rank holding the
// fewest tokens, every rank attends its slice, and the per-map softmax states
// are merged across the ranks. Prints each step's time, the bytes of cache each
// rank read, and the share of the step spent in MPI. Runs with any number of
// ranks; --quick (a small context) also checks y against the single-process
// layer on one cache holding every token, on rank 0.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/module_v2.hpp>
#include <diffattn/mpi_layer.hpp>

using diffattn::bfloat16;
using diffattn::index_t;
using diffattn::Tensor;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Appends the stand-in context's tokens [first, first + count) to `cache`:
/// token t's keys and values depend on t alone, so any split of the tokens
/// across caches holds the same rows.
void fill(diffattn::KVCache<bfloat16>& cache, index_t first, index_t count) {
  const index_t chunk = 4096;
  for (index_t a = 0; a < count; a += chunk) {
    const index_t n = std::min(chunk, count - a);
    const index_t row = cache.reserve(n);
    auto k = cache.key_rows(row, n);
    auto v = cache.value_rows(row, n);
    for (index_t b = 0; b < k.shape(0); ++b)
      for (index_t i = 0; i < n; ++i) {
        diffattn::detail::Rng rng(1000003 * static_cast<std::uint64_t>(first + a + i) + b);
        for (index_t h = 0; h < k.shape(2); ++h)
          for (index_t c = 0; c < k.shape(3); ++c) {
            k(b, i, h, c) = static_cast<bfloat16>(rng.normal());
            v(b, i, h, c) = static_cast<bfloat16>(rng.normal());
          }
      }
    cache.commit(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  index_t keys = 262144, steps = 8;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (i + 1 < argc && !std::strcmp(argv[i], "--keys")) keys = std::atoll(argv[++i]);
    if (i + 1 < argc && !std::strcmp(argv[i], "--steps")) steps = std::atoll(argv[++i]);
  }
  if (quick) {
    keys = 4096;
    steps = 4;
  }
  diffattn::DiffAttnV2Config cfg;
  cfg.embed_dim = 512;
  cfg.num_heads = 8;  // 16 query heads
  cfg.num_kv_heads = 8;
  cfg.head_dim = 64;
  diffattn::MultiheadDiffAttnV2<float> layer(cfg, 7);
  const index_t B = 1;
  // This rank's slice of the context: tokens [first, first + mine).
  const index_t base = keys / world, extra = keys % world;
  const index_t mine = base + (rank < extra ? 1 : 0);
  const index_t first = rank * base + std::min<index_t>(rank, extra);
  auto cache = layer.make_cache<bfloat16>(B, mine + steps);
  fill(cache, first, mine);
  if (rank == 0)
    std::printf(
        "V2 layer, 16 q heads on 8 kv heads of 64, bfloat16 cache of %lld tokens over %d "
        "ranks (1 thread each)\n",
        static_cast<long long>(keys), world);
  int failures = 0;
  diffattn::detail::Rng rng(5);
  std::vector<Tensor<float, 3>> xs, ys;
  for (index_t s = 0; s < steps; ++s) {
    Tensor<float, 3> x({B, 1, cfg.embed_dim});
    for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng.normal());
    diffattn::mpi::LayerStepStats st;
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = now();
    Tensor<float, 3> y =
        diffattn::mpi::forward<float, bfloat16>(layer, x.view(), cache, MPI_COMM_WORLD, 1, &st);
    const double t = now() - t0;
    // Every rank's time, bytes read and time in MPI.
    double me[3] = {t, double(st.attention.bytes_read), st.attention.comm_seconds};
    std::vector<double> all(3 * static_cast<std::size_t>(world));
    MPI_Gather(me, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    // y is the same on every rank.
    std::vector<float> ys_all(static_cast<std::size_t>(y.size()) * world);
    MPI_Allgather(y.data(), static_cast<int>(y.size()), MPI_FLOAT, ys_all.data(),
                  static_cast<int>(y.size()), MPI_FLOAT, MPI_COMM_WORLD);
    for (int r = 1; r < world; ++r)
      if (std::memcmp(ys_all.data(), ys_all.data() + static_cast<std::size_t>(r) * y.size(),
                      static_cast<std::size_t>(y.size()) * sizeof(float)) != 0)
        ++failures;
    if (rank == 0) {
      double slowest = 0, comm = 0;
      std::printf("step %lld (token %lld, appended on rank %d):", static_cast<long long>(s),
                  static_cast<long long>(st.position), st.owner);
      for (int r = 0; r < world; ++r) {
        slowest = std::max(slowest, all[3 * r]);
        comm = std::max(comm, all[3 * r + 2] / all[3 * r]);
        std::printf("  r%d %.1f MiB", r, all[3 * r + 1] / (1 << 20));
      }
      std::printf("   %.2f ms, in MPI <= %.0f%%\n", slowest * 1e3, 100 * comm);
    }
    xs.push_back(std::move(x));
    ys.push_back(std::move(y));
  }
  if (quick && rank == 0) {  // one process, one cache holding every token
    auto whole = layer.make_cache<bfloat16>(B, keys + steps);
    fill(whole, 0, keys);
    double worst = 0;
    for (index_t s = 0; s < steps; ++s) {
      const Tensor<float, 3> ref = layer.forward(xs[s].view(), whole);
      double num = 0, den = 0;
      for (index_t i = 0; i < ref.size(); ++i) {
        num = std::max(num, double(std::abs(ys[s].data()[i] - ref.data()[i])));
        den = std::max(den, double(std::abs(ref.data()[i])));
      }
      worst = std::max(worst, num / den);
    }
    std::printf("max relative error against one process: %.2e\n", worst);
    if (!(worst < 1e-4)) ++failures;
  }
  int any = 0;
  MPI_Allreduce(&failures, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf(any == 0 ? "all checks passed\n" : "%d checks FAILED\n", any);
  MPI_Finalize();
  return any == 0 ? 0 : 1;
}
