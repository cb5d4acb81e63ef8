// Fused kernels over a batch of KV caches: per-sequence key lengths
// (FlashAttention's flash_attn_with_kvcache / cache_seqlens) and paged caches
// (vLLM's block tables), for decoding and for prefill chunks against a cache.
#pragma once

#include "attention.hpp"
#include "config.hpp"
#include "detail/attention_kernel.hpp"
#include "detail/format.hpp"
#include "detail/tile.hpp"
#include "detail/traits.hpp"
#include "detail/validate.hpp"
#include "options.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

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
  constexpr const char* fn = "diff_attention_v1_kvcache";
  const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, cache);
  detail::AttentionProblem<T, KV> p =
      detail::validate_v1<T, KV>(q, kv[0], kv[1], &lambda, nullptr, out, lse, options, fn);
  detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, cache, options);
  detail::run_attention(p, options);
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
  constexpr const char* fn = "diff_attention_v1_kvcache";
  const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, cache);
  detail::AttentionProblem<T, KV> p =
      detail::validate_v1<T, KV>(q, kv[0], kv[1], nullptr, &lambda, out, lse, options, fn);
  detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, cache, options);
  detail::run_attention(p, options);
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
  constexpr const char* fn = "diff_attention_v2_kvcache";
  const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, cache);
  detail::AttentionProblem<T, KV> p =
      detail::validate_v2<T, KV>(q, kv[0], kv[1], lambda_logit, out, lse, options, fn);
  detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, cache, options);
  detail::run_attention(p, options);
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
  constexpr const char* fn = "attention_kvcache";
  const auto kv = detail::kvcache_check_views<T, KV>(fn, q, k_cache, v_cache, cache);
  detail::AttentionProblem<T, KV> p =
      detail::validate_plain<T, KV>(q, kv[0], kv[1], out, lse, options, fn);
  detail::attach_kvcache<T, KV>(fn, p, k_cache, v_cache, cache, options);
  detail::run_attention(p, options);
}

/// @}

DIFFATTN_END_NAMESPACE
