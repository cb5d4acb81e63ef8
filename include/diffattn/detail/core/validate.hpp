// Argument checks of the fused kernels: run once, at the public boundary, and
// turned into an AttentionProblem that the kernels trust.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../float8.hpp"
#include "../../options.hpp"
#include "../../tensor.hpp"
#include "../../types.hpp"
#include "../decode/quant.hpp"
#include "../kernel/tile.hpp"
#include "format.hpp"
#include "traits.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

enum class AttnKind { plain, v1, v2 };

/// The rows of one sequence: queries [q0, q0 + n) and keys [k0, k0 + m) on the
/// token axis of batch entry b. A plain batch has one per batch entry (q0 = k0
/// = 0); a packed batch has one per packed sequence, all in batch entry 0.
struct SeqSpan {
  index_t b, q0, n, k0, m;
};

/// Where the kernels report an 8-bit cache's scale they read that is
/// negative, not finite, or (e4m3) too large to take the factor 2^8 of its
/// units: the public functions throw after the kernel (kvcache_attention.hpp).
struct ScaleCheck {
  std::atomic<bool> bad{false};
};

/// A scale the kernels take: finite, >= 0, and finite times kv_unit<KV>().
template <class KV>
inline bool scale_ok(float s) noexcept {
  return s >= 0.0f && s * kv_unit<KV>() <= std::numeric_limits<float>::max();
}

/// A checked problem. Head mapping, with g the kv group of output head oh:
///   plain: query head oh,           g = oh / group, key head g,            value head g
///   v1:    query heads 2oh, 2oh+1,  g = oh / group, key heads 2g and 2g+1, value head g
///   v2:    query heads 2oh, 2oh+1,  g = oh / group, key head g (both maps), value head g
///
/// Storage: q, out and lambda_logit hold T, k and v hold KV (T, a 16-bit
/// cache under float or double queries, or an 8-bit cache (int8, e4m3) with
/// its scales under float or 16-bit queries). The kernels compute in C =
/// compute_t<T> (float for 16-bit T); lse, lambda and the scale are C.
template <class T, class KV = T>
struct AttentionProblem {
  static_assert(std::is_same<KV, T>::value || is_half_storage_v<KV> ||
                    (is_8bit_storage_v<KV> && std::is_same<compute_t<T>, float>::value),
                "k and v hold the queries' type, a 16-bit type (a bfloat16 or half cache), or an "
                "8-bit type (std::int8_t, float8_e4m3) under float or 16-bit queries");
  /// 8-bit caches: each (token, head) row has a float scale.
  static constexpr bool kQuantized = is_8bit_storage_v<KV>;
  using C = compute_t<T>;
  AttnKind kind = AttnKind::plain;
  TensorView<const T, 4> q;
  TensorView<const KV, 4> k, v;
  TensorView<T, 4> out;
  TensorView<C, 3> lse;                 // (B, query heads, N); empty: not wanted
  TensorView<const C, 1> lambda_heads;  // v1, (H); empty: lambda_scalar for all heads
  TensorView<const T, 3> lambda_logit;  // v2, (B, N, H)
  C lambda_scalar = C(0);
  index_t batch = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, value_dim = 0;
  index_t heads = 0;  // output heads: H for the differential kernels, Hq for plain
  index_t group = 1;  // output heads per kv group
  C scale = C(1);
  bool causal = false;
  KeyBand band;  // the visible keys of each row (causal and window)
  // Packed batch (batch == 1): sequence s owns query rows [cu_q[s], cu_q[s+1])
  // and key rows [cu_k[s], cu_k[s+1]); null for a plain batch.
  const index_t* cu_q = nullptr;
  const index_t* cu_k = nullptr;
  index_t packed = 0;  // number of packed sequences
  // KV caches (FlashAttention's cache_seqlens): batch entry b sees the keys
  // [0, cache_seqlens(b)) of its cache; empty: all seqlen_k keys.
  TensorView<const index_t, 1> cache_seqlens;  // (B)
  // Paged caches (vLLM's block tables): k and v are pools (num_blocks,
  // block_size, H, D), and key j of batch entry b is row j % block_size of
  // block block_table(b, j / block_size). block_size 0: k and v are
  // (B, M, H, D).
  TensorView<const index_t, 2> block_table;  // (B, max_blocks_per_seq)
  index_t block_size = 0;
  // Decoding steps (fewer than kMR queries) split their visible keys into
  // chunks of split_keys keys, merged as softmax states (0: never split).
  index_t split_keys = 0;
  // 8-bit caches: one scale per row of k and v, laid out as k and v without
  // their last extent ((B, M, H) or (num_blocks, block_size, H)); empty else.
  TensorView<const float, 3> k_scale, v_scale;
  ScaleCheck* scale_check = nullptr;  // set by the public functions of 8-bit caches
  // Score modifiers (AttentionOptions): softcap (0: none), ALiBi slopes and
  // sinks per query head ((Hq), empty: none); `modified` when any is set, the
  // one flag the kernels test before taking their modifier path.
  C softcap = C(0);
  TensorView<const float, 1> alibi_slopes, sinks;
  bool modified = false;

  bool has_lse() const { return lse.data() != nullptr || lse.size() != 0; }
  int maps() const { return kind == AttnKind::plain ? 1 : 2; }
  /// Sequences: batch entries, or the packed sequences.
  index_t num_seqs() const { return cu_q ? packed : batch; }
  SeqSpan seq(index_t s) const {
    if (cu_q) return {0, cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s], cu_k[s + 1] - cu_k[s]};
    if (!cache_seqlens.empty()) return {s, 0, seqlen_q, 0, cache_seqlens(s)};
    return {s, 0, seqlen_q, 0, seqlen_k};
  }
  /// Key j (0-based within sequence sq) of key head h: the row source every
  /// path reads keys through (contiguous, per-sequence lengths, paged).
  const KV* key_row(const SeqSpan& sq, index_t j, index_t h) const { return row_of(k, sq, j, h); }
  /// Value j of sequence sq, value head h.
  const KV* value_row(const SeqSpan& sq, index_t j, index_t h) const { return row_of(v, sq, j, h); }
  /// The scales of key j's heads (8-bit caches): head h at [h * stride(2)].
  const float* key_scales(const SeqSpan& sq, index_t j) const { return row_of(k_scale, sq, j, 0); }
  const float* value_scales(const SeqSpan& sq, index_t j) const {
    return row_of(v_scale, sq, j, 0);
  }
  /// Key j of key head h as the packing functions read it: the row, or (8-bit
  /// caches) a QuantRow holding its scale (checked: a bad one is reported to
  /// scale_check).
  auto packed_key_row(const SeqSpan& sq, index_t j, index_t h) const {
    if constexpr (kQuantized)
      return quant_row(key_row(sq, j, h), key_scales(sq, j)[h * k_scale.stride(2)]);
    else
      return key_row(sq, j, h);
  }
  auto packed_value_row(const SeqSpan& sq, index_t j, index_t h) const {
    if constexpr (kQuantized)
      return quant_row(value_row(sq, j, h), value_scales(sq, j)[h * v_scale.stride(2)]);
    else
      return value_row(sq, j, h);
  }
  /// Reports a scale outside scale_ok to scale_check.
  void report_bad_scale() const {
    if (scale_check) scale_check->bad.store(true, std::memory_order_relaxed);
  }

 private:
  QuantRow<KV> quant_row(const KV* row, float row_scale) const {
    if (!scale_ok<KV>(row_scale)) report_bad_scale();
    return {row, row_scale * kv_unit<KV>()};
  }
  template <class U>
  const U* row_of(const TensorView<const U, 3>& t, const SeqSpan& sq, index_t j, index_t h) const {
    if (block_size == 0) return &t(sq.b, sq.k0 + j, h);
    return &t(block_table(sq.b, j / block_size), j % block_size, h);
  }
  const KV* row_of(const TensorView<const KV, 4>& t, const SeqSpan& sq, index_t j,
                   index_t h) const {
    if (block_size == 0) return &t(sq.b, sq.k0 + j, h, 0);
    return &t(block_table(sq.b, j / block_size), j % block_size, h, 0);
  }
};

template <class A, class B>
bool ranges_overlap(const A& a, const B& b) {
  if (a.empty() || b.empty()) return false;
  const std::uintptr_t a0 = a.span_begin(), a1 = a.span_end();
  const std::uintptr_t b0 = b.span_begin(), b1 = b.span_end();
  return a0 < b1 && b0 < a1;
}

template <class V>
void check_head_contiguous(const char* fn, const char* name, const V& t) {
  if (t.shape(V::rank() - 1) > 1 && t.stride(V::rank() - 1) != 1)
    fail(fn, name, " must be contiguous in its last (head) dimension: shape ", shape_str(t.shape()),
         ", strides ", shape_str(t.strides()));
}

template <class V>
void check_shape(const char* fn, const char* name, const V& t, const typename V::shape_type& want,
                 const char* layout) {
  if (t.shape() != want)
    fail(fn, name, " has shape ", shape_str(t.shape()), ", expected ", layout, " = ",
         shape_str(want));
}

/// Checks shared by all kernels; fills the extents that q, k and v fix.
template <class T, class KV>
void validate_common(const char* fn, AttentionProblem<T, KV>& p, const AttentionOptions& options) {
  validate_options(fn, options);
  check_head_contiguous(fn, "q", p.q);
  check_head_contiguous(fn, "k", p.k);
  check_head_contiguous(fn, "v", p.v);
  check_head_contiguous(fn, "out", p.out);
  const auto& qs = p.q.shape();
  const auto& ks = p.k.shape();
  const auto& vs = p.v.shape();
  if (ks[0] != qs[0] || vs[0] != qs[0])
    fail(fn, "batch sizes differ: q ", shape_str(qs), ", k ", shape_str(ks), ", v ", shape_str(vs));
  if (vs[1] != ks[1])
    fail(fn, "k and v differ in seqlen_k: k ", shape_str(ks), ", v ", shape_str(vs));
  if (qs[3] < 1) fail(fn, "q has shape ", shape_str(qs), ": head width d must be >= 1");
  if (ks[3] != qs[3])
    fail(fn, "k has shape ", shape_str(ks), ", head width ", ks[3], " differs from q's d = ", qs[3],
         " (q ", shape_str(qs), ")");
  p.batch = qs[0];
  p.seqlen_q = qs[1];
  p.seqlen_k = ks[1];
  p.head_dim = qs[3];
  p.causal = options.causal;
  p.band = band_of(options);
  p.scale = static_cast<compute_t<T>>(effective_scale(options, p.head_dim));
  p.split_keys = kSplitKeys;
  validate_score_mods(fn, options, qs[2]);
  p.softcap = static_cast<compute_t<T>>(options.softcap);
  p.alibi_slopes = options.alibi_slopes;
  p.sinks = options.sinks;
  p.modified = has_score_mods(options);
}

/// out and lse must not overlap any input or each other.
template <class T, class KV>
void check_outputs(const char* fn, const AttentionProblem<T, KV>& p, const char* lambda_name) {
  auto check_input = [&](const char* name, const auto& in) {
    if (ranges_overlap(p.out, in))
      fail(fn, "out ", shape_str(p.out.shape()), " overlaps input ", name, " ",
           shape_str(in.shape()), " in memory");
    if (ranges_overlap(p.lse, in))
      fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps input ", name, " ",
           shape_str(in.shape()), " in memory");
  };
  check_input("q", p.q);
  check_input("k", p.k);
  check_input("v", p.v);
  if (ranges_overlap(p.out, p.lse))
    fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps out ", shape_str(p.out.shape()),
         " in memory");
  if (ranges_overlap(p.out, p.lambda_heads) || ranges_overlap(p.out, p.lambda_logit))
    fail(fn, "out ", shape_str(p.out.shape()), " overlaps ", lambda_name, " in memory");
  if (ranges_overlap(p.lse, p.lambda_heads) || ranges_overlap(p.lse, p.lambda_logit))
    fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps ", lambda_name, " in memory");
}

/// The prologue of every validate_*: a problem of `kind` over the views, with
/// the checks all kernels share done (validate_common).
template <class T, class KV>
AttentionProblem<T, KV> attach_problem(const char* fn, AttnKind kind, TensorView<const T, 4> q,
                                       TensorView<const KV, 4> k, TensorView<const KV, 4> v,
                                       TensorView<T, 4> out, TensorView<compute_t<T>, 3> lse,
                                       const AttentionOptions& options) {
  AttentionProblem<T, KV> p;
  p.kind = kind;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  validate_common(fn, p, options);
  return p;
}

/// H, the DIFF heads of a differential problem's 2H query heads.
template <class T, class KV>
index_t diff_heads(const char* fn, const AttentionProblem<T, KV>& p) {
  const index_t qh = p.q.shape(2);
  if (qh < 2 || qh % 2 != 0)
    fail(fn, "q has ", qh, " heads, expected 2*H >= 2 (heads 2h and 2h+1 form DIFF head h): q ",
         shape_str(p.q.shape()));
  return qh / 2;
}

/// v with one head per k head (V2, plain attention): checks it and sets the
/// output heads, the GQA group and the value width.
template <class T, class KV>
void attach_values(const char* fn, AttentionProblem<T, KV>& p, index_t heads) {
  const index_t Hkv = p.k.shape(2);
  const auto& v = p.v;
  if (v.shape(2) != Hkv)
    fail(fn, "v has shape ", shape_str(v.shape()), ", expected ", Hkv, " heads like k ",
         shape_str(p.k.shape()));
  if (v.shape(3) < 1) fail(fn, "v has shape ", shape_str(v.shape()), ": value width must be >= 1");
  p.heads = heads;
  p.group = heads / Hkv;
  p.value_dim = v.shape(3);
}

template <class T, class KV>
void check_lse(const char* fn, const AttentionProblem<T, KV>& p, index_t query_heads) {
  if (!p.has_lse()) return;
  check_shape(fn, "lse", p.lse, {p.batch, query_heads, p.seqlen_q}, "(B, Hq, N)");
}

template <class T, class KV = T>
AttentionProblem<T, KV> validate_v1(TensorView<const T, 4> q, nondeduced_view<const KV, 4> k,
                                    nondeduced_view<const KV, 4> v, const compute_t<T>* lambda,
                                    const TensorView<const compute_t<T>, 1>* lambda_heads,
                                    TensorView<T, 4> out, TensorView<compute_t<T>, 3> lse,
                                    const AttentionOptions& options,
                                    const char* fn = "diff_attention_v1") {
  AttentionProblem<T, KV> p = attach_problem<T, KV>(fn, AttnKind::v1, q, k, v, out, lse, options);
  const index_t kh = k.shape(2), qh = q.shape(2), H = diff_heads(fn, p);
  if (kh < 2 || kh % 2 != 0 || H % (kh / 2) != 0)
    fail(fn, "k has ", kh, " heads, expected 2*Hkv with H % Hkv == 0 (q ", shape_str(q.shape()),
         " has 2H = ", qh, " heads; k ", shape_str(k.shape()), ")");
  const index_t Hkv = kh / 2, d = p.head_dim;
  check_shape(fn, "v", v, {p.batch, p.seqlen_k, Hkv, 2 * d}, "(B, M, Hkv, 2d)");
  check_shape(fn, "out", out, {p.batch, p.seqlen_q, H, 2 * d}, "(B, N, H, 2d)");
  check_lse(fn, p, 2 * H);
  p.heads = H;
  p.group = H / Hkv;
  p.value_dim = 2 * d;
  if (lambda_heads) {
    p.lambda_heads = *lambda_heads;
    check_shape(fn, "lambda", p.lambda_heads, {H}, "(H)");
    for (index_t h = 0; h < H; ++h)
      if (!std::isfinite(static_cast<double>(p.lambda_heads(h))))
        fail(fn, "lambda must be finite, got lambda[", h, "] = ", p.lambda_heads(h));
  } else {
    if (!std::isfinite(static_cast<double>(*lambda)))
      fail(fn, "lambda must be finite, got ", *lambda);
    p.lambda_scalar = *lambda;
  }
  check_outputs(fn, p, "lambda");
  return p;
}

template <class T, class KV = T>
AttentionProblem<T, KV> validate_v2(TensorView<const T, 4> q, nondeduced_view<const KV, 4> k,
                                    nondeduced_view<const KV, 4> v,
                                    TensorView<const T, 3> lambda_logit, TensorView<T, 4> out,
                                    TensorView<compute_t<T>, 3> lse,
                                    const AttentionOptions& options,
                                    const char* fn = "diff_attention_v2") {
  AttentionProblem<T, KV> p = attach_problem<T, KV>(fn, AttnKind::v2, q, k, v, out, lse, options);
  p.lambda_logit = lambda_logit;
  const index_t qh = q.shape(2), Hkv = k.shape(2), H = diff_heads(fn, p);
  if (Hkv < 1 || qh % Hkv != 0)
    fail(fn, "k has ", Hkv, " heads, expected Hkv dividing the 2H = ", qh, " query heads (q ",
         shape_str(q.shape()), ", k ", shape_str(k.shape()), ")");
  if ((qh / Hkv) % 2 != 0)
    fail(fn, "a DIFF pair would straddle two GQA groups: 2H / Hkv = ", qh, " / ", Hkv, " = ",
         qh / Hkv, " query heads per kv head must be even (q ", shape_str(q.shape()), ", k ",
         shape_str(k.shape()), ")");
  attach_values(fn, p, H);
  check_shape(fn, "out", out, {p.batch, p.seqlen_q, H, p.value_dim}, "(B, N, H, d)");
  check_shape(fn, "lambda_logit", lambda_logit, {p.batch, p.seqlen_q, H}, "(B, N, H)");
  check_lse(fn, p, 2 * H);
  check_outputs(fn, p, "lambda_logit");
  return p;
}

template <class T, class KV = T>
AttentionProblem<T, KV> validate_plain(TensorView<const T, 4> q, nondeduced_view<const KV, 4> k,
                                       nondeduced_view<const KV, 4> v, TensorView<T, 4> out,
                                       TensorView<compute_t<T>, 3> lse,
                                       const AttentionOptions& options,
                                       const char* fn = "attention") {
  AttentionProblem<T, KV> p =
      attach_problem<T, KV>(fn, AttnKind::plain, q, k, v, out, lse, options);
  const index_t Hq = q.shape(2), Hkv = k.shape(2);
  if (Hq < 1) fail(fn, "q has shape ", shape_str(q.shape()), ": at least one head is needed");
  if (Hkv < 1 || Hq % Hkv != 0)
    fail(fn, "k has ", Hkv, " heads, expected Hkv with Hq % Hkv == 0 (q ", shape_str(q.shape()),
         ", k ", shape_str(k.shape()), ")");
  attach_values(fn, p, Hq);
  check_shape(fn, "out", out, {p.batch, p.seqlen_q, Hq, p.value_dim}, "(B, N, Hq, dv)");
  check_lse(fn, p, Hq);
  check_outputs(fn, p, "lambda");
  return p;
}

/// A rank-3 view (T, H, D) of a packed batch as the rank-4 (1, T, H, D) the
/// kernels take.
template <class T>
TensorView<T, 4> as_batch1(const TensorView<T, 3>& t) {
  return TensorView<T, 4>(t.data(), {1, t.shape(0), t.shape(1), t.shape(2)},
                          {0, t.stride(0), t.stride(1), t.stride(2)});
}
/// A rank-2 view (H, T) (lse) or (T, H) (lambda_logit) as (1, ., .).
template <class T>
TensorView<T, 3> as_batch1(const TensorView<T, 2>& t) {
  if (t.data() == nullptr && t.size() == 0) return TensorView<T, 3>();
  return TensorView<T, 3>(t.data(), {1, t.shape(0), t.shape(1)}, {0, t.stride(0), t.stride(1)});
}

/// Checks cumulative sequence offsets: cu[0] = 0, non-decreasing, and
/// cu.back() = total, the token count of `tensors`.
inline void check_cu_seqlens(const char* fn, const char* name, const std::vector<index_t>& cu,
                             index_t total, const char* tensors) {
  if (cu.empty()) fail(fn, name, " is empty: it must hold S + 1 offsets for S >= 0 sequences");
  if (cu.front() != 0) fail(fn, name, "[0] must be 0, got ", cu.front());
  for (std::size_t s = 1; s < cu.size(); ++s)
    if (cu[s] < cu[s - 1])
      fail(fn, name, "[", s, "] = ", cu[s], " < ", name, "[", s - 1, "] = ", cu[s - 1],
           ": offsets must be non-decreasing");
  if (cu.back() != total)
    fail(fn, name, "[", cu.size() - 1, "] = ", cu.back(), " must equal the ", total, " tokens of ",
         tensors);
}

/// Checks the cumulative offsets of a packed batch against the token extents
/// of q (p.seqlen_q) and k (p.seqlen_k) and attaches them to the problem.
template <class T, class KV>
void attach_packed(const char* fn, AttentionProblem<T, KV>& p, const std::vector<index_t>& cu_q,
                   const std::vector<index_t>& cu_k_in) {
  const std::vector<index_t>& cu_k = cu_k_in.empty() ? cu_q : cu_k_in;
  check_cu_seqlens(fn, "cu_seqlens_q", cu_q, p.seqlen_q, "q");
  if (cu_k.size() != cu_q.size())
    fail(fn, "cu_seqlens_k has ", cu_k.size(), " offsets, cu_seqlens_q ", cu_q.size(),
         ": both must hold S + 1");
  check_cu_seqlens(fn, cu_k_in.empty() ? "cu_seqlens_q (as cu_seqlens_k)" : "cu_seqlens_k", cu_k,
                   p.seqlen_k, "k and v");
  p.cu_q = cu_q.data();
  p.cu_k = cu_k.data();
  p.packed = static_cast<index_t>(cu_q.size()) - 1;
}

/// The (T, H, D) view of a (1, T, H, D) tensor (a packed batch).
template <class T>
TensorView<T, 3> drop_batch(const TensorView<T, 4>& t) {
  return TensorView<T, 3>(t.data(), {t.shape(1), t.shape(2), t.shape(3)},
                          {t.stride(1), t.stride(2), t.stride(3)});
}
/// The (A, B) view of a (1, A, B) tensor.
template <class T>
TensorView<T, 2> drop_batch(const TensorView<T, 3>& t) {
  return TensorView<T, 2>(t.data(), {t.shape(1), t.shape(2)}, {t.stride(1), t.stride(2)});
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
