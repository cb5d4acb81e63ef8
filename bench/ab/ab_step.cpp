// One decoding step of the headers this file is compiled against, as a C
// function named AB_STEP (ab_decode.sh compiles it twice: once against a
// revision's headers, once against the working tree's, each in its own
// inline namespace). Caches are raw (B, M, H, D) float arrays.
#include <diffattn/kvcache_attention.hpp>

#include "ab_step.h"

extern "C" void AB_STEP(const AbStep* s) {
  using diffattn::index_t;
  using diffattn::TensorView;
  const AbLayer& L = s->layer;
  TensorView<const float, 4> k(s->k, {s->B, s->M, L.kh, L.d});
  TensorView<const float, 4> v(s->v, {s->B, s->M, L.vh, L.dv});
  TensorView<const float, 4> q(s->q, {s->B, 1, L.qh, L.d});
  diffattn::KVCacheBatch cache;
  cache.cache_seqlens = TensorView<const index_t, 1>(s->lens, {s->B});
  diffattn::AttentionOptions options;
  options.causal = true;
  options.num_threads = s->threads;
  switch (L.kind) {
    case 1:
      diffattn::diff_attention_v1_kvcache<float>(
          q, k, v, 0.8f, TensorView<float, 4>(s->out, {s->B, 1, L.qh / 2, 2 * L.d}), {}, cache,
          options);
      break;
    case 2:
      diffattn::diff_attention_v2_kvcache<float>(
          q, k, v, TensorView<const float, 3>(s->logit, {s->B, 1, L.qh / 2}),
          TensorView<float, 4>(s->out, {s->B, 1, L.qh / 2, L.dv}), {}, cache, options);
      break;
    default:
      diffattn::attention_kvcache<float>(
          q, k, v, TensorView<float, 4>(s->out, {s->B, 1, L.qh, L.dv}), {}, cache, options);
  }
}
