/// \file
/// Sharded decoding at the layer level: a MultiheadDiffAttnV1 or V2 whose KV
/// cache is split across the ranks of an MPI communicator
/// (diffattn::mpi::forward).
/// CMake target diffattn::mpi. Uses only the layer's public interface.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "detail/layers/module_common.hpp"
#include "kv_cache.hpp"
#include "module_v1.hpp"
#include "module_v2.hpp"
#include "mpi.hpp"
#include "quantize.hpp"
#include "rope.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace mpi {

/// \ingroup mpi_decode
/// What one sharded layer step did: the rank that appended the new tokens'
/// keys and values, the global position of the first new token, and the
/// attention call's DecodeStats on this rank.
struct LayerStepStats {
  int owner = -1;         ///< the rank whose cache received the new tokens
  index_t position = 0;   ///< global position (rotary) of the first new token
  DecodeStats attention;  ///< the sharded attention call on this rank
};

}  // namespace mpi

namespace detail {

/// mpi::forward for either layer: L is MultiheadDiffAttnV1<T> or
/// MultiheadDiffAttnV2<T>.
template <class L, class S>
Tensor<typename L::value_type, 3> sharded_layer_forward(L& layer,
                                                        TensorView<const typename L::value_type, 3> x,
                                                        KVCache<S>& cache, MPI_Comm comm,
                                                        int num_threads, mpi::LayerStepStats* stats) {
  using T = typename L::value_type;
  using C = compute_t<T>;
  constexpr bool v1 = std::is_same<L, MultiheadDiffAttnV1<T>>::value;
  constexpr const char* fn = "diffattn::mpi::forward";
  const auto& cfg = layer.config();
  const index_t B = x.shape(0), n = x.shape(1);
  RingComm rc(comm, fn);
  bool ok = true;
  std::string message;
  try {
    if (n < 1) fail(fn, "x has shape ", shape_str(x.shape()), ", expected n >= 1 new tokens");
    ModuleAccess::check_cache_shape(layer, x, cache);
    if (cfg.alibi || cfg.window_left >= 0 || cfg.window_right >= 0)
      fail(fn,
           "layers with ALiBi or a window are not supported: the ranks' caches do not hold the "
           "tokens in order once decoding steps spread over them");
    if (num_threads < 0) fail(fn, "num_threads must be >= 0, got ", num_threads);
    if (cache.keep() >= 0) fail(fn, "windowed caches are not supported");
  } catch (const error& e) {
    ok = false;
    message = e.what();
  }
  agree(rc, ok, message,
        {{"the batch size B", B},
         {"the new tokens n", n},
         {"the embedding width E", x.shape(2)},
         {"the layer's version", v1 ? 1 : 2},
         {"the DIFF heads", cfg.num_heads},
         {"the kv heads", cache.key_heads()},
         {"the key width", cache.key_dim()},
         {"the cache type", storage_code<S>()}});
  // Every rank's (tokens, capacity): the global position and the owner.
  const int W = rc.size(), me = rc.rank();
  std::int64_t mine[2] = {cache.size(), cache.capacity()};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(W));
  mpi_check(MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, rc.get()), fn,
            "MPI_Allgather");
  index_t position = 0;
  int owner = n > 1 ? W - 1 : 0;
  for (int r = 0; r < W; ++r) {
    position += all[2 * r];
    if (n == 1 && all[2 * r] < all[2 * owner]) owner = r;
  }
  if (all[2 * owner] + n > all[2 * owner + 1])
    fail(fn, "rank ", owner, "'s cache (", all[2 * owner], " of ", all[2 * owner + 1],
         " tokens) has no room for the ", n, " new tokens it would receive");
  const int threads_before = layer.num_threads();
  layer.set_num_threads(num_threads);
  struct Restore {
    L& l;
    int t;
    ~Restore() { l.set_num_threads(t); }
  } restore{layer, threads_before};
  const index_t np = me == owner ? n : 0;  // the new rows this rank's cache receives
  Tensor<T, 3> y = ModuleAccess::forward_around(
      layer, x, position,
      [&](const Tensor<C, 4>& q, const Tensor<C, 4>& k, const Tensor<C, 4>& v, const auto& lambda,
          Tensor<C, 4>& out, const AttentionOptions& o) {
        // The owner writes the new rows (reserved, committed after the step).
        if (np > 0) {
          const index_t r = cache.reserve(np);
          TensorView<S, 4> kd = cache.key_rows(r, np), vd = cache.value_rows(r, np);
          if constexpr (is_8bit_storage_v<S>) {
            // quantize_rows refuses a non-finite key or value: the other
            // ranks learn of it below instead of waiting in the attention
            // call's collectives.
            try {
              quantize_rows<C, S>(k.view(), kd, cache.key_scale_rows(r, np));
              quantize_rows<C, S>(v.view(), vd, cache.value_scale_rows(r, np));
            } catch (const error& e) {
              ok = false;
              message = e.what();
            }
          } else {
            const index_t kr = k.shape(2) * k.shape(3), vr = v.shape(2) * v.shape(3);
            for (index_t b = 0; b < B; ++b) {
              convert_row(k.data() + b * np * kr, np * kr, &kd(b, 0, 0, 0));
              convert_row(v.data() + b * np * vr, np * vr, &vd(b, 0, 0, 0));
            }
          }
        }
        if constexpr (is_8bit_storage_v<S>) agree(rc, ok, message, {});
        const FullCache full(B, cache, np);
        mpi::DecodeStats* st = stats ? &stats->attention : nullptr;
        if constexpr (v1)
          mpi::diff_attention_v1_kvcache<C, S>(rc.get(), q.view(), cache.keys_with(np),
                                               cache.values_with(np), lambda, out.view(), {},
                                               full.batch, o, st);
        else
          mpi::diff_attention_v2_kvcache<C, S>(rc.get(), q.view(), cache.keys_with(np),
                                               cache.values_with(np), lambda.view(), out.view(), {},
                                               full.batch, o, st);
      });
  if (np > 0) cache.commit(np);
  if (stats) {
    stats->owner = owner;
    stats->position = position;
  }
  return y;
}

}  // namespace detail

namespace mpi {

/// \ingroup mpi_decode
/// Runs `layer` on n >= 1 new tokens x (B, n, E) per sequence after the
/// tokens that all ranks' caches hold together, and returns y (B, n, E): the
/// same bits on every rank, equal to layer.forward(x, cache) on one cache
/// holding every token to rounding.
///
/// Each rank's `cache` (layer.make_cache<S>(B, capacity), any storage the
/// layer takes) holds its own slice of the keys; cache.size() counts the
/// tokens of that slice. Rotary positions are global: the first new token
/// sits at the sum of every rank's cache.size(). The new tokens' keys and
/// values go to one rank: for a decoding step (n = 1) the rank holding the
/// fewest tokens, the lowest such rank on a tie, so the caches fill evenly;
/// for a block of n > 1 tokens (a prefill chunk) the last rank, so that the
/// block's keys are the last of the global sequence, where its causal mask
/// among the new tokens needs them.
/// That rank needs room for them (else every rank throws and no cache
/// changes). Collective over `comm`; x and the layer's parameters must be the
/// same on every rank (q, built from them, is compared by hash).
///
/// Supported layers: causal, no window and no ALiBi (the caches' rank order
/// is not the tokens' order once decoding steps spread over the ranks, and
/// windows and ALiBi need the order); softcap and learned sinks work. Caches
/// must not be windowed. Threads: `num_threads` for the projections and
/// the attention (0: the OpenMP default); the layer's own setting is restored
/// on return.
template <class T, class S>
Tensor<T, 3> forward(MultiheadDiffAttnV2<T>& layer, TensorView<const T, 3> x, KVCache<S>& cache,
                     MPI_Comm comm, int num_threads = 0, LayerStepStats* stats = nullptr) {
  return detail::sharded_layer_forward(layer, x, cache, comm, num_threads, stats);
}

/// \ingroup mpi_decode
/// The same for a DIFF V1 layer (diffattn::mpi::diff_attention_v1_kvcache
/// over the ranks' slices, then the layer's per-head norm and output
/// projection on every rank).
template <class T, class S>
Tensor<T, 3> forward(MultiheadDiffAttnV1<T>& layer, TensorView<const T, 3> x, KVCache<S>& cache,
                     MPI_Comm comm, int num_threads = 0, LayerStepStats* stats = nullptr) {
  return detail::sharded_layer_forward(layer, x, cache, comm, num_threads, stats);
}

}  // namespace mpi
DIFFATTN_END_NAMESPACE
