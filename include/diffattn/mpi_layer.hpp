/// \file
/// Sharded decoding at the layer level: a MultiheadDiffAttnV2 whose KV cache
/// is split across the ranks of an MPI communicator (diffattn::mpi::forward).
/// CMake target diffattn::mpi. Uses only the layer's public interface.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "detail/layers/module_common.hpp"
#include "kv_cache.hpp"
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
/// the attention (0: the OpenMP default).
template <class T, class S>
Tensor<T, 3> forward(MultiheadDiffAttnV2<T>& layer, TensorView<const T, 3> x, KVCache<S>& cache,
                     MPI_Comm comm, int num_threads = 0, LayerStepStats* stats = nullptr) {
  using C = compute_t<T>;
  constexpr const char* fn = "diffattn::mpi::forward";
  const DiffAttnV2Config& cfg = layer.config();
  const index_t B = x.shape(0), n = x.shape(1), E = cfg.embed_dim, H = cfg.num_heads,
                Hkv = cfg.num_kv_heads, hd = cfg.head_dim;
  detail::RingComm rc(comm, fn);
  bool ok = true;
  std::string message;
  try {
    if (x.shape(2) != E || n < 1)
      detail::fail(fn, "x has shape ", detail::shape_str(x.shape()), ", expected (B, n, E = ", E,
                   ") with n >= 1");
    if (!cfg.causal) detail::fail(fn, "a KV cache needs a causal layer (config.causal = true)");
    if (cfg.alibi || cfg.window_left >= 0 || cfg.window_right >= 0)
      detail::fail(fn,
                   "layers with ALiBi or a window are not supported: the ranks' caches do not "
                   "hold the tokens in order once decoding steps spread over them");
    if (num_threads < 0) detail::fail(fn, "num_threads must be >= 0, got ", num_threads);
    if (cache.keep() >= 0) detail::fail(fn, "windowed caches are not supported");
    if (cache.batch() != B || cache.key_heads() != Hkv || cache.key_dim() != hd)
      detail::fail(fn, "the cache (batch ", cache.batch(), ", ", cache.key_heads(), " heads of ",
                   cache.key_dim(), ") is not this layer's for x ", detail::shape_str(x.shape()),
                   " (batch ", B, ", ", Hkv, " kv heads of ", hd, ")");
  } catch (const error& e) {
    ok = false;
    message = e.what();
  }
  detail::agree(rc, ok, message,
                {{"the batch size B", B},
                 {"the new tokens n", n},
                 {"the embedding width E", E},
                 {"the DIFF heads", H},
                 {"the kv heads", Hkv},
                 {"the head width", hd},
                 {"the cache type", detail::storage_code<S>()}});
  // Every rank's (tokens, capacity): the global position and the owner.
  const int W = rc.size(), me = rc.rank();
  std::int64_t mine[2] = {cache.size(), cache.capacity()};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(W));
  detail::mpi_check(MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, rc.get()), fn,
                    "MPI_Allgather");
  index_t position = 0;
  int owner = n > 1 ? W - 1 : 0;
  for (int r = 0; r < W; ++r) {
    position += all[2 * r];
    if (n == 1 && all[2 * r] < all[2 * owner]) owner = r;
  }
  if (all[2 * owner] + n > all[2 * owner + 1])
    detail::fail(fn, "rank ", owner, "'s cache (", all[2 * owner], " of ", all[2 * owner + 1],
                 " tokens) has no room for the ", n, " new tokens it would receive");
  // Projections and rotary at the global positions.
  auto params = layer.parameters();
  const Tensor<T, 3> xc = detail::module_contiguous_copy<T>(x);
  const index_t rows = B * n;
  Tensor<C, 4> q({B, n, 2 * H, hd}), k({B, n, Hkv, hd}), v({B, n, Hkv, hd});
  Tensor<C, 3> logit({B, n, H});
  detail::module_linear(xc.data(), rows, E, params.at("q_proj.weight").data(), 2 * H * hd, q.data(),
                        num_threads);
  detail::module_linear(xc.data(), rows, E, params.at("k_proj.weight").data(), Hkv * hd, k.data(),
                        num_threads);
  detail::module_linear(xc.data(), rows, E, params.at("v_proj.weight").data(), Hkv * hd, v.data(),
                        num_threads);
  detail::module_linear(xc.data(), rows, E, params.at("lambda_proj.weight").data(), H, logit.data(),
                        num_threads);
  if (cfg.rope) {
    apply_rope<C>(q.view(), position, cfg.rope_base);
    apply_rope<C>(k.view(), position, cfg.rope_base);
  }
  // The owner writes the new rows (reserved, committed only after the step).
  const index_t np = me == owner ? n : 0;
  if (np > 0) {
    const index_t r = cache.reserve(np);
    TensorView<S, 4> kd = cache.key_rows(r, np), vd = cache.value_rows(r, np);
    if constexpr (is_8bit_storage_v<S>) {
      quantize_rows<C, S>(k.view(), kd, cache.key_scale_rows(r, np));
      quantize_rows<C, S>(v.view(), vd, cache.value_scale_rows(r, np));
    } else {
      for (index_t b = 0; b < B; ++b) {
        detail::convert_row(&k(b, 0, 0, 0), np * Hkv * hd, &kd(b, 0, 0, 0));
        detail::convert_row(&v(b, 0, 0, 0), np * Hkv * hd, &vd(b, 0, 0, 0));
      }
    }
  }
  AttentionOptions o;
  o.causal = true;
  o.num_threads = num_threads;
  o.softcap = cfg.softcap;
  std::vector<float> sinks;
  if (cfg.sinks) {
    const TensorView<T, 1> s = params.at("sinks");
    for (index_t i = 0; i < s.size(); ++i) sinks.push_back(static_cast<float>(s(i)));
    o.sinks = TensorView<const float, 1>(sinks.data(), {static_cast<index_t>(sinks.size())});
  }
  const detail::FullCache full(B, cache, np);
  Tensor<C, 4> attn({B, n, H, hd});
  diff_attention_v2_kvcache<C, S>(rc.get(), q.view(), cache.keys_with(np), cache.values_with(np),
                                  logit.view(), attn.view(), {}, full.batch, o,
                                  stats ? &stats->attention : nullptr);
  if (np > 0) cache.commit(np);
  Tensor<T, 3> y({B, n, E});
  detail::module_linear(attn.data(), rows, H * hd, params.at("o_proj.weight").data(), E, y.data(),
                        num_threads);
  if (stats) {
    stats->owner = owner;
    stats->position = position;
  }
  return y;
}

}  // namespace mpi
DIFFATTN_END_NAMESPACE
