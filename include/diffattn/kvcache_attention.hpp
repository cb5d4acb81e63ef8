/// \file
/// Fused kernels over a batch of KV caches: per-sequence key lengths
/// (FlashAttention's flash_attn_with_kvcache / cache_seqlens) and paged caches
/// (vLLM's block tables), for decoding and for prefill chunks against a cache.
#pragma once

#include "attention.hpp"
#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "detail/kernel/attention_kernel.hpp"
#include "detail/kernel/tile.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup kvcache
/// The caches of a batch of B sequences, as the *_kvcache kernels read them.
///
/// Contiguous caches (block_table empty): k_cache (B, capacity, Hk, d) and
/// v_cache (B, capacity, Hkv, dv); sequence b's keys are rows
/// [0, cache_seqlens(b)) of its cache.
///
/// Paged caches (block_table given): k_cache (num_blocks, block_size, Hk, d)
/// and v_cache (num_blocks, block_size, Hkv, dv) are pools of blocks shared by
/// the batch, and key j of sequence b is row j % block_size of block
/// block_table(b, j / block_size); capacity = max_blocks_per_seq x block_size.
/// Any block_size >= 1. Only the entries of the blocks a sequence uses are
/// read (and checked to lie in [0, num_blocks)); the rest may hold anything.
/// The kernels read rows through the table in place, never gathering them.
struct KVCacheBatch {
  /// (B) valid keys of each sequence, 0 <= cache_seqlens(b) <= capacity
  /// (FlashAttention's cache_seqlens; the new tokens' keys already appended).
  TensorView<const index_t, 1> cache_seqlens;
  /// (B, max_blocks_per_seq) block indices into the pools; a default (0 x 0)
  /// view: contiguous caches. A table of B rows and no column is a paged
  /// layout of capacity 0.
  TensorView<const index_t, 2> block_table;
  /// Keys per split-KV chunk of a decoding step (fewer than 6 new queries per
  /// sequence): longer key ranges are cut into chunks of this many keys, each
  /// a task, merged as softmax states in chunk order. 0 means the default,
  /// 1024; a value at least the longest cache turns splitting off. The chunks
  /// never depend on the thread count, so neither does the result.
  index_t split_keys = 0;
  /// 8-bit caches (std::int8_t, float8_e4m3) only, empty for the others: one
  /// float scale per (token, head) row of k_cache and of v_cache, laid out as
  /// the cache without its last extent: (B, capacity, Hk) and (B, capacity,
  /// Hkv) for contiguous caches, (num_blocks, block_size, H) pools beside the
  /// block pools for paged ones (any strides). Row x = scale * stored value;
  /// every scale the kernel reads must be finite and >= 0.
  TensorView<const float, 3> k_scale;
  /// 8-bit caches: the scales of v_cache's rows, as k_scale.
  TensorView<const float, 3> v_scale;
};

namespace detail {

/// Whether the caches are paged: a block table other than the default 0 x 0
/// view (one of B rows and no column holds no element either, but is paged).
inline bool kvcache_paged(const KVCacheBatch& c) {
  return c.block_table.data() != nullptr || c.block_table.shape(0) != 0 ||
         c.block_table.shape(1) != 0;
}

/// The views the contiguous kernels' checks see: the caches themselves, or
/// (paged) each pool seen as a (B, block_size, H, D) cache whose every batch
/// entry is block 0, so that head counts and widths are checked as there.
template <class T, class KV>
std::array<TensorView<const KV, 4>, 2> kvcache_check_views(const char* fn,
                                                           const TensorView<const T, 4>& q,
                                                           const TensorView<const KV, 4>& k,
                                                           const TensorView<const KV, 4>& v,
                                                           const KVCacheBatch& c) {
  if (!kvcache_paged(c)) return {k, v};
  check_head_contiguous(fn, "k_cache", k);
  check_head_contiguous(fn, "v_cache", v);
  if (k.shape(0) < 1 || k.shape(1) < 1)
    fail(fn, "k_cache pool has shape ", shape_str(k.shape()),
         ": expected (num_blocks, block_size, Hk, d) with num_blocks >= 1 and block_size >= 1");
  if (v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1))
    fail(fn, "v_cache pool has shape ", shape_str(v.shape()), ", expected the (num_blocks, ",
         "block_size) = (", k.shape(0), ", ", k.shape(1), ") of k_cache ", shape_str(k.shape()));
  const index_t B = q.shape(0);
  auto proxy = [&](const TensorView<const KV, 4>& t) {
    return TensorView<const KV, 4>(t.data(), {B, t.shape(1), t.shape(2), t.shape(3)},
                                   {0, t.stride(1), t.stride(2), t.stride(3)});
  };
  return {proxy(k), proxy(v)};
}

/// Attaches the caches to a problem checked on kvcache_check_views: lengths,
/// block table, and (paged) the pools themselves.
template <class T, class KV>
void attach_kvcache(const char* fn, AttentionProblem<T, KV>& p, const TensorView<const KV, 4>& k,
                    const TensorView<const KV, 4>& v, const KVCacheBatch& c,
                    const AttentionOptions& options) {
  const index_t B = p.batch;
  const bool paged = kvcache_paged(c);
  check_shape(fn, "cache_seqlens", c.cache_seqlens, {B}, "(B)");
  if (c.split_keys < 0) fail(fn, "split_keys must be >= 0 (0: the default), got ", c.split_keys);
  if (paged) {
    if (c.block_table.shape(0) != B)
      fail(fn, "block_table has shape ", shape_str(c.block_table.shape()),
           ", expected (B, max_blocks_per_seq) with B = ", B, " (q ", shape_str(p.q.shape()), ")");
    p.block_size = k.shape(1);
    p.seqlen_k = c.block_table.shape(1) * p.block_size;
    p.k = k;
    p.v = v;
    p.block_table = c.block_table;
    if (ranges_overlap(p.out, k) || ranges_overlap(p.out, v) || ranges_overlap(p.lse, k) ||
        ranges_overlap(p.lse, v))
      fail(fn, "out ", shape_str(p.out.shape()), " or lse overlaps the k_cache ",
           shape_str(k.shape()), " or v_cache ", shape_str(v.shape()), " pool in memory");
  }
  const index_t capacity = p.seqlen_k;
  for (index_t b = 0; b < B; ++b) {
    const index_t m = c.cache_seqlens(b);
    if (m < 0 || m > capacity)
      fail(
          fn, "cache_seqlens[", b, "] = ", m, " is outside [0, capacity = ", capacity, "] (",
          paged ? "block_table " : "k_cache ",
          shape_str(paged ? c.block_table.shape() : std::array<index_t, 2>{k.shape(0), k.shape(1)}),
          ")");
    if (options.causal && m > 0 && m < p.seqlen_q)
      fail(fn, "cache_seqlens[", b, "] = ", m, " < the ", p.seqlen_q, " new queries of q ",
           shape_str(p.q.shape()), ": with causal = true the cache must already hold their keys");
    if (!paged) continue;
    for (index_t blk = 0; blk * p.block_size < m; ++blk) {
      const index_t id = c.block_table(b, blk);
      if (id < 0 || id >= k.shape(0))
        fail(fn, "block_table[", b, ", ", blk, "] = ", id,
             " is outside [0, num_blocks = ", k.shape(0), ") of k_cache ", shape_str(k.shape()));
    }
  }
  p.cache_seqlens = c.cache_seqlens;
  p.split_keys = c.split_keys > 0 ? c.split_keys : kSplitKeys;
  attach_scales(fn, p, k, v, c);
}

/// Whether a scale view was given (anything but the default empty view).
inline bool scale_given(const TensorView<const float, 3>& t) {
  return t.data() != nullptr || t.size() != 0;
}

/// Checks the shapes of an 8-bit cache's scales (k_cache, v_cache: the caches
/// or pools as given) and attaches them; refuses scales for other caches.
template <class T, class KV>
void attach_scales(const char* fn, AttentionProblem<T, KV>& p, const TensorView<const KV, 4>& k,
                   const TensorView<const KV, 4>& v, const KVCacheBatch& c) {
  if constexpr (!is_8bit_storage_v<KV>) {
    (void)p;
    (void)k;
    (void)v;
    if (scale_given(c.k_scale) || scale_given(c.v_scale))
      fail(fn, scale_given(c.k_scale) ? "k_scale " : "v_scale ",
           shape_str(scale_given(c.k_scale) ? c.k_scale.shape() : c.v_scale.shape()),
           " is given for a cache of ", is_half_storage_v<KV> ? "16-bit" : "float or double",
           " values (k_cache ", shape_str(k.shape()),
           "): scales belong to 8-bit caches (std::int8_t, float8_e4m3)");
  } else {
    const bool paged = kvcache_paged(c);
    const char* layout = paged ? "(num_blocks, block_size, H) of the pool" : "(B, capacity, H)";
    auto check = [&](const char* name, const char* cache_name, const TensorView<const float, 3>& t,
                     const TensorView<const KV, 4>& cache) {
      const std::array<index_t, 3> want{cache.shape(0), cache.shape(1), cache.shape(2)};
      if (!scale_given(t))
        fail(fn, name, " is missing: an 8-bit ", cache_name, " ", shape_str(cache.shape()),
             " needs one float scale per row, ", layout, " = ", shape_str(want));
      if (t.shape() != want)
        fail(fn, name, " has shape ", shape_str(t.shape()), ", expected ", layout, " = ",
             shape_str(want), " (", cache_name, " ", shape_str(cache.shape()), ")");
      if (ranges_overlap(p.out, t) || ranges_overlap(p.lse, t))
        fail(fn, "out ", shape_str(p.out.shape()), " or lse overlaps ", name, " ",
             shape_str(t.shape()), " in memory");
    };
    check("k_scale", "k_cache", c.k_scale, k);
    check("v_scale", "v_cache", c.v_scale, v);
    p.k_scale = c.k_scale;
    p.v_scale = c.v_scale;
  }
}

/// Throws for the first scale of `name` that the kernel may read (rows
/// [0, cache_seqlens(b)) of each sequence) that is negative or not finite, or
/// whose product with kv_unit<KV>() is not finite. Called only after a kernel
/// reported such a scale (ScaleCheck): the kernels check the scales as they
/// read them, at no measurable cost, where a scan here would add 6-14% to a
/// decoding step that reads 8-bit rows.
template <class T, class KV>
void fail_bad_scale(const char* fn, const AttentionProblem<T, KV>& p, const char* name,
                    const TensorView<const float, 3>& t) {
  for (index_t s = 0; s < p.num_seqs(); ++s) {
    const SeqSpan sq = p.seq(s);
    for (index_t j = 0; j < sq.m; ++j)
      for (index_t h = 0; h < t.shape(2); ++h) {
        const float x = p.block_size == 0 ? t(sq.b, sq.k0 + j, h)
                                          : t(p.block_table(sq.b, j / p.block_size),
                                              j % p.block_size, h);
        if (!scale_ok<KV>(x))
          fail(fn, name, " ", shape_str(t.shape()), " holds ", x, " for key ", j, ", head ", h,
               " of sequence ", sq.b, ": scales must be finite and >= 0",
               kv_unit<KV>() != 1.0f ? " (and at most 3.4e38 / 256 for float8_e4m3)" : "",
               "; out and lse are left unspecified");
      }
  }
}

/// Runs a validated kvcache problem (with a user functor `mod`, header-only:
/// run_attention); with an 8-bit cache, throws after the kernel if it met a
/// bad scale.
template <class T, class KV, class Mod = NoScoreMod>
void run_kvcache(const char* fn, AttentionProblem<T, KV>& p, const AttentionOptions& options,
                 const Mod& mod = Mod()) {
  if constexpr (!is_8bit_storage_v<KV>) {
    (void)fn;
    run_attention(p, options, mod);
  } else {
    ScaleCheck check;
    p.scale_check = &check;
    run_attention(p, options, mod);
    if (check.bad.load(std::memory_order_relaxed)) {
      fail_bad_scale(fn, p, "k_scale", p.k_scale);
      fail_bad_scale(fn, p, "v_scale", p.v_scale);
      fail(fn, "a scale the kernel read was negative or not finite");
    }
  }
}

/// The kvcache entry points' one prologue: checks the views against the
/// cache, `validate(k, v)` on the views it gives makes the problem, the cache
/// is attached, and the problem runs with `mod` (run_kvcache).
template <class T, class KV, class Mod, class Validate>
void kvcache_call(const char* fn, const TensorView<const T, 4>& q,
                  const TensorView<const KV, 4>& k_cache, const TensorView<const KV, 4>& v_cache,
                  const KVCacheBatch& cache, const AttentionOptions& options, const Mod& mod,
                  const Validate& validate) {
  const auto kv = kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, cache);
  AttentionProblem<T, KV> p = validate(kv[0], kv[1]);
  attach_kvcache<T, KV>(fn, p, k_cache, v_cache, cache, options);
  run_kvcache(fn, p, options, mod);
}

}  // namespace detail

/// \defgroup kvcache Attention over KV caches
///
/// The kernels of attention.hpp over a batch of B caches holding different
/// numbers of keys (see KVCacheBatch for the contiguous and paged layouts):
///
///   q (B, n, Hq, d)            n new queries per sequence (1 when decoding)
///   k_cache, v_cache           (B, capacity, H, D) or pools (num_blocks, block_size, H, D)
///   out (B, n, H, dv), lse (B, Hq, n) (pass {} to skip)
///
/// with the head layouts, GQA rules and lambda of the kernels without cache
/// (V1: k_cache holds 2Hkv key heads, v_cache Hkv heads of 2d; V2 and plain:
/// Hkv heads). Sequence b sees keys [0, m_b), m_b = cache_seqlens(b), and the
/// causal mask and window are aligned bottom-right to its own m_b: query i sees
/// key j iff j <= i + (m_b - n) (causal). For n = 2, m_b = 4, causal:
///       1 1 1 0
///       1 1 1 1
/// The result equals the kernel without cache on the slice [0, m_b) of each
/// sequence's keys, to rounding. With causal = true each non-empty cache must
/// hold at least the n new keys (m_b >= n); an empty cache (m_b = 0) gives
/// zero rows and lse -inf.
///
/// A decoding step (n < 6) reads each K and V row once per kv group: all the
/// query heads of a group go through one pass over its rows. Long caches are
/// split into chunks of KVCacheBatch::split_keys keys that run in parallel and
/// merge as softmax states (each map's, lambda subtracted after the merge), so
/// one sequence with one kv head still keeps every thread busy; results are
/// bitwise identical for any thread count. Bad input (shapes, lengths outside
/// [0, capacity], block indices outside the pool, split_keys < 0) throws
/// diffattn::error naming the function, the argument and the shapes.
///
/// Storage: q, out (and V2's lambda_logit) hold T; the caches hold KV, T by
/// default, or a 16-bit type under float or double queries
/// (`attention_kvcache<float, bfloat16>(...)`): a float layer keeps a bfloat16
/// or half cache without rounding its queries. The work is in compute_t<T>
/// (float for 16-bit T), which lse and lambda use too; cache rows are widened
/// as they are read.
///
/// Speed: keep the caches 64-byte aligned (diffattn::Tensor and the layers'
/// caches are). Cache rows 16 bytes off that, as in a std::vector's memory,
/// made the float step 0.75-0.79x as fast with the rows in L2 on Zen 5 (each
/// vector load then spans two cache lines). Large caches do best starting on
/// a 4 KiB page, as a Tensor of 1 MiB or more does: 64 bytes past one (where
/// glibc puts large 64-byte aligned blocks), MQA's step ran 0.88-0.91x as fast.
/// @{

/// diff_attention_v1 over KV caches; one lambda for every head.
///   q (B, n, 2H, d), k_cache (B, capacity, 2Hkv, d) or (num_blocks, block_size, 2Hkv, d),
///   v_cache (B, capacity, Hkv, 2d) or (num_blocks, block_size, Hkv, 2d),
///   out (B, n, H, 2d), lse (B, 2H, n) or empty.
template <class T, class KV = T>
void diff_attention_v1_kvcache(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_t<compute_t<T>> lambda,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& cache, const AttentionOptions& options = {}) {
  diff_attention_v1_kvcache<T, KV>(q, k_cache, v_cache, lambda, out, lse, cache, options,
                                   NoScoreMod{});
}

/// diff_attention_v1 over KV caches; one lambda per DIFF head, lambda (H).
template <class T, class KV = T>
void diff_attention_v1_kvcache(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_view<const compute_t<T>, 1> lambda,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& cache, const AttentionOptions& options = {}) {
  diff_attention_v1_kvcache<T, KV>(q, k_cache, v_cache, lambda, out, lse, cache, options,
                                   NoScoreMod{});
}

/// diff_attention_v2 over KV caches.
///   q (B, n, 2H, d), k_cache (B, capacity, Hkv, d) or (num_blocks, block_size, Hkv, d),
///   v_cache likewise with width dv, lambda_logit (B, n, H), out (B, n, H, dv),
///   lse (B, 2H, n) or empty.
template <class T, class KV = T>
void diff_attention_v2_kvcache(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_view<const T, 3> lambda_logit,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& cache, const AttentionOptions& options = {}) {
  diff_attention_v2_kvcache<T, KV>(q, k_cache, v_cache, lambda_logit, out, lse, cache, options,
                                   NoScoreMod{});
}

/// Plain attention over KV caches.
///   q (B, n, Hq, d), k_cache (B, capacity, Hkv, d) or (num_blocks, block_size, Hkv, d),
///   v_cache likewise with width dv, out (B, n, Hq, dv), lse (B, Hq, n) or empty.
template <class T, class KV = T>
void attention_kvcache(detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const KV, 4> k_cache,
                       detail::nondeduced_view<const KV, 4> v_cache,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse, const KVCacheBatch& cache,
                       const AttentionOptions& options = {}) {
  attention_kvcache<T, KV>(q, k_cache, v_cache, out, lse, cache, options, NoScoreMod{});
}

/// \name With a user score functor
/// The kernels above with a functor `mod`, as in attention.hpp (NoScoreMod in
/// options.hpp lists its optional members), inlined into the kernel and run
/// header-only. The functor's b is the batch entry, h the query head, j the
/// key's index in sequence b's cache, and i the query's position there:
/// i = row + m_b - n for row `row` of the n new queries, the key index of the
/// query's own token (a decoding step's query is key m_b - 1). Decoding steps
/// call the functor in the decoding kernel on every split-KV chunk's keys (the
/// result is still bitwise the same for any thread count); prefill chunks in
/// the block kernel, which narrows each block's keys to those `visible`
/// leaves it.
/// @{

/// diff_attention_v1_kvcache (one lambda) with a user score functor `mod`.
template <class T, class KV = T, class Mod>
void diff_attention_v1_kvcache(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const KV, 4> k_cache,
    detail::nondeduced_view<const KV, 4> v_cache, detail::nondeduced_t<compute_t<T>> lambda,
    detail::nondeduced_view<T, 4> out, detail::nondeduced_view<compute_t<T>, 3> lse,
    const KVCacheBatch& cache, const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_kvcache";
  detail::kvcache_call<T, KV>(
      fn, q, k_cache, v_cache, cache, options, mod, [&](const auto& k, const auto& v) {
        return detail::validate_v1<T, KV>(q, k, v, &lambda, nullptr, out, lse, options, fn);
      });
}

/// diff_attention_v1_kvcache (lambda per DIFF head, (H)) with a user score functor `mod`.
template <class T, class KV = T, class Mod>
void diff_attention_v1_kvcache(detail::nondeduced_view<const T, 4> q,
                               detail::nondeduced_view<const KV, 4> k_cache,
                               detail::nondeduced_view<const KV, 4> v_cache,
                               detail::nondeduced_view<const compute_t<T>, 1> lambda,
                               detail::nondeduced_view<T, 4> out,
                               detail::nondeduced_view<compute_t<T>, 3> lse,
                               const KVCacheBatch& cache, const AttentionOptions& options,
                               const Mod& mod) {
  constexpr const char* fn = "diff_attention_v1_kvcache";
  detail::kvcache_call<T, KV>(
      fn, q, k_cache, v_cache, cache, options, mod, [&](const auto& k, const auto& v) {
        return detail::validate_v1<T, KV>(q, k, v, nullptr, &lambda, out, lse, options, fn);
      });
}

/// diff_attention_v2_kvcache with a user score functor `mod`.
template <class T, class KV = T, class Mod>
void diff_attention_v2_kvcache(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const KV, 4> k_cache,
    detail::nondeduced_view<const KV, 4> v_cache, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<T, 4> out, detail::nondeduced_view<compute_t<T>, 3> lse,
    const KVCacheBatch& cache, const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "diff_attention_v2_kvcache";
  detail::kvcache_call<T, KV>(
      fn, q, k_cache, v_cache, cache, options, mod, [&](const auto& k, const auto& v) {
        return detail::validate_v2<T, KV>(q, k, v, lambda_logit, out, lse, options, fn);
      });
}

/// attention_kvcache (plain softmax) with a user score functor `mod`.
template <class T, class KV = T, class Mod>
void attention_kvcache(detail::nondeduced_view<const T, 4> q,
                       detail::nondeduced_view<const KV, 4> k_cache,
                       detail::nondeduced_view<const KV, 4> v_cache,
                       detail::nondeduced_view<T, 4> out,
                       detail::nondeduced_view<compute_t<T>, 3> lse, const KVCacheBatch& cache,
                       const AttentionOptions& options, const Mod& mod) {
  constexpr const char* fn = "attention_kvcache";
  detail::kvcache_call<T, KV>(
      fn, q, k_cache, v_cache, cache, options, mod, [&](const auto& k, const auto& v) {
        return detail::validate_plain<T, KV>(q, k, v, out, lse, options, fn);
      });
}
/// @}

/// @}

DIFFATTN_END_NAMESPACE
