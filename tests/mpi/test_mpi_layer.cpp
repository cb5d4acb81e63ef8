// Sharded decoding at the layer level (diffattn::mpi::forward): a V1 or V2
// layer decodes several steps and prefill chunks with its cache split across the
// ranks; every step's y is checked against the single-process layer with one
// cache, bitwise across ranks, and the caches' sizes against the append rule.
// Prints "mpi_layer: <passed> passed, <failed> failed" (summed over the ranks).
// First, so that the header is seen to compile on its own.
#include <diffattn/mpi_layer.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/module_v1.hpp>
#include <diffattn/module_v2.hpp>

#include "mpi_check.hpp"

using diffattn::index_t;
using diffattn::Tensor;

namespace {

using mpi_check::check;
using mpi_check::g_failed;
using mpi_check::g_passed;
using mpi_check::g_rank;
using mpi_check::g_world;
using mpi_check::rel_error;
using mpi_check::same_on_all_ranks;

/// Steps of n tokens: a prefill chunk, decoding steps, another chunk, more steps.
template <class T, class S, class Layer = diffattn::MultiheadDiffAttnV2<T>, class Config>
void run_layer(const char* name, Config cfg, double tol) {
  Layer layer(cfg, 17);
  layer.set_num_threads(2);
  if (cfg.sinks) {
    auto p = layer.parameters();
    auto s = p.at("sinks");
    for (index_t i = 0; i < s.size(); ++i) s(i) = static_cast<T>(0.3 * double(i) - 0.5);
  }
  const index_t B = 2, E = cfg.embed_dim;
  auto whole = layer.template make_cache<S>(B, 128);
  auto slice = layer.template make_cache<S>(B, 64);
  diffattn::detail::Rng rng(99);
  const std::vector<index_t> steps = {5, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1};
  index_t total = 0;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const index_t n = steps[s];
    Tensor<T, 3> x({B, n, E});
    for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(rng.normal());
    const Tensor<T, 3> ref = layer.forward(x.view(), whole);
    diffattn::mpi::LayerStepStats st;
    const Tensor<T, 3> y =
        diffattn::mpi::forward<T, S>(layer, x.view(), slice, MPI_COMM_WORLD, 0, &st);
    const std::string what = std::string(name) + " step " + std::to_string(s) +
                             " (n = " + std::to_string(n) + ", W = " + std::to_string(g_world) +
                             ")";
    const double e = rel_error(y, ref);
    check(e <= tol, what + ": y rel error " + std::to_string(e));
    check(same_on_all_ranks(y), what + ": y bitwise the same on every rank");
    check(st.position == total, what + ": global position " + std::to_string(st.position));
    check(n == 1 || st.owner == g_world - 1, what + ": a block goes to the last rank");
    total += n;
    long long size = slice.size(), sum = 0;
    MPI_Allreduce(&size, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    check(sum == total, what + ": the slices hold every token once");
    check(layer.num_threads() == 2, what + ": the layer's threads restored");
  }
}

void layer_errors() {
  diffattn::DiffAttnV2Config cfg{32, 2, 1, 16};
  diffattn::MultiheadDiffAttnV2<float> layer(cfg, 3);
  auto slice = layer.make_cache<float>(1, 2);
  Tensor<float, 3> x({1, 3, 32});
  x.fill(0.5f);
  bool threw = false;
  try {
    diffattn::mpi::forward<float, float>(layer, x.view(), slice, MPI_COMM_WORLD);
  } catch (const diffattn::error&) {
    threw = true;
  }
  check(threw && slice.size() == 0,
        "3 tokens for a last rank of capacity 2: throws everywhere, "
        "cache unchanged");
  Tensor<float, 3> xb({1, 1, g_rank == g_world - 1 ? 31 : 32});
  xb.fill(0.5f);
  threw = false;
  try {
    diffattn::mpi::forward<float, float>(layer, xb.view(), slice, MPI_COMM_WORLD);
  } catch (const diffattn::error&) {
    threw = true;
  }
  check(threw && slice.size() == 0, "a bad x on some rank: throws everywhere");
  diffattn::DiffAttnV2Config wcfg = cfg;
  wcfg.window_left = 4;
  diffattn::MultiheadDiffAttnV2<float> wl(wcfg, 3);
  auto wc = wl.make_cache<float>(1, 8);
  Tensor<float, 3> x1({1, 1, 32});
  x1.fill(0.5f);
  threw = false;
  try {
    diffattn::mpi::forward<float, float>(wl, x1.view(), wc, MPI_COMM_WORLD);
  } catch (const diffattn::error&) {
    threw = true;
  }
  check(threw, "a windowed layer is refused");
  // A non-finite key for an int8 cache: the owner's quantize_rows refuses it
  // and every rank throws (none waits in a collective), no cache changed.
  auto q8 = layer.make_cache<std::int8_t>(1, 8);
  Tensor<float, 3> xinf({1, 1, 32});
  xinf.fill(0.5f);
  xinf(0, 0, 3) = std::numeric_limits<float>::infinity();
  threw = false;
  try {
    diffattn::mpi::forward<float, std::int8_t>(layer, xinf.view(), q8, MPI_COMM_WORLD);
  } catch (const diffattn::error&) {
    threw = true;
  }
  check(threw && q8.size() == 0, "a non-finite key for an int8 cache: throws everywhere");
  x1.fill(0.25f);
  const Tensor<float, 3> y = diffattn::mpi::forward<float, std::int8_t>(layer, x1.view(), q8,
                                                                          MPI_COMM_WORLD);
  long long held = q8.size(), sum = 0;
  MPI_Allreduce(&held, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  check(sum == 1 && same_on_all_ranks(y), "the next step runs");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  try {
    diffattn::DiffAttnV2Config cfg{32, 2, 1, 16};  // E 32, 2 DIFF heads on 1 kv head of 16
    run_layer<float, float>("float", cfg, 2e-5);
    run_layer<double, double>("double", cfg, 1e-12);
    run_layer<float, diffattn::bfloat16>("float, bfloat16 cache", cfg, 2e-5);
    run_layer<float, std::int8_t>("float, int8 cache", cfg, 2e-5);
    run_layer<diffattn::bfloat16, diffattn::bfloat16>("bfloat16", cfg, 1.6e-2);
    diffattn::DiffAttnV2Config mods{48, 4, 2, 12};
    mods.softcap = 4.0f;
    mods.sinks = true;
    run_layer<float, float>("float, softcap and sinks, GQA", mods, 2e-5);
    diffattn::DiffAttnV1Config v1{32, 2, 1};  // E 32, 2 DIFF heads on 1 kv pair, d = 8
    using V1f = diffattn::MultiheadDiffAttnV1<float>;
    run_layer<float, float, V1f>("V1 float", v1, 2e-5);
    run_layer<double, double, diffattn::MultiheadDiffAttnV1<double>>("V1 double", v1, 1e-12);
    run_layer<float, diffattn::bfloat16, V1f>("V1 float, bfloat16 cache", v1, 2e-5);
    run_layer<float, std::int8_t, V1f>("V1 float, int8 cache", v1, 2e-5);
    diffattn::DiffAttnV1Config v1m{48, 4, 2};
    v1m.softcap = 4.0f;
    v1m.sinks = true;
    run_layer<float, float, V1f>("V1 float, softcap and sinks, GQA", v1m, 2e-5);
    layer_errors();
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  return mpi_check::finish("mpi_layer");
}
