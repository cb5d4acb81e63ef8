// Argument checks of the fused kernels: run once, at the public boundary, and
// turned into an AttentionProblem that the kernels trust.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "../config.hpp"
#include "../options.hpp"
#include "../tensor.hpp"
#include "format.hpp"
#include "traits.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

enum class AttnKind { plain, v1, v2 };

/// A checked problem. Head mapping, with g the kv group of output head oh:
///   plain: query head oh,           g = oh / group, key head g,            value head g
///   v1:    query heads 2oh, 2oh+1,  g = oh / group, key heads 2g and 2g+1, value head g
///   v2:    query heads 2oh, 2oh+1,  g = oh / group, key head g (both maps), value head g
template <class T>
struct AttentionProblem {
  AttnKind kind = AttnKind::plain;
  TensorView<const T, 4> q, k, v;
  TensorView<T, 4> out;
  TensorView<T, 3> lse;                 // (B, query heads, N); empty: not wanted
  TensorView<const T, 1> lambda_heads;  // v1, (H); empty: lambda_scalar for all heads
  TensorView<const T, 3> lambda_logit;  // v2, (B, N, H)
  T lambda_scalar = T(0);
  index_t batch = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, value_dim = 0;
  index_t heads = 0;  // output heads: H for the differential kernels, Hq for plain
  index_t group = 1;  // output heads per kv group
  T scale = T(1);
  bool causal = false;

  bool has_lse() const { return lse.data() != nullptr || lse.size() != 0; }
  int maps() const { return kind == AttnKind::plain ? 1 : 2; }
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
template <class T>
void validate_common(const char* fn, AttentionProblem<T>& p, const AttentionOptions& options) {
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
  p.scale = static_cast<T>(effective_scale(options, p.head_dim));
}

/// out and lse must not overlap any input or each other.
template <class T>
void check_outputs(const char* fn, const AttentionProblem<T>& p, const char* lambda_name) {
  const char* names[] = {"q", "k", "v"};
  const TensorView<const T, 4>* ins[] = {&p.q, &p.k, &p.v};
  for (int i = 0; i < 3; ++i) {
    if (ranges_overlap(p.out, *ins[i]))
      fail(fn, "out ", shape_str(p.out.shape()), " overlaps input ", names[i], " ",
           shape_str(ins[i]->shape()), " in memory");
    if (ranges_overlap(p.lse, *ins[i]))
      fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps input ", names[i], " ",
           shape_str(ins[i]->shape()), " in memory");
  }
  if (ranges_overlap(p.out, p.lse))
    fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps out ", shape_str(p.out.shape()),
         " in memory");
  if (ranges_overlap(p.out, p.lambda_heads) || ranges_overlap(p.out, p.lambda_logit))
    fail(fn, "out ", shape_str(p.out.shape()), " overlaps ", lambda_name, " in memory");
  if (ranges_overlap(p.lse, p.lambda_heads) || ranges_overlap(p.lse, p.lambda_logit))
    fail(fn, "lse ", shape_str(p.lse.shape()), " overlaps ", lambda_name, " in memory");
}

template <class T>
void check_lse(const char* fn, const AttentionProblem<T>& p, index_t query_heads) {
  if (!p.has_lse()) return;
  check_shape(fn, "lse", p.lse, {p.batch, query_heads, p.seqlen_q}, "(B, Hq, N)");
}

template <class T>
AttentionProblem<T> validate_v1(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, const T* lambda,
                                const TensorView<const T, 1>* lambda_heads, TensorView<T, 4> out,
                                TensorView<T, 3> lse, const AttentionOptions& options) {
  constexpr const char* fn = "diff_attention_v1";
  AttentionProblem<T> p;
  p.kind = AttnKind::v1;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  validate_common(fn, p, options);
  const index_t qh = q.shape(2), kh = k.shape(2);
  if (qh < 2 || qh % 2 != 0)
    fail(fn, "q has ", qh, " heads, expected 2*H >= 2 (heads 2h and 2h+1 form DIFF head h): q ",
         shape_str(q.shape()));
  const index_t H = qh / 2;
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

template <class T>
AttentionProblem<T> validate_v2(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<const T, 3> lambda_logit,
                                TensorView<T, 4> out, TensorView<T, 3> lse,
                                const AttentionOptions& options) {
  constexpr const char* fn = "diff_attention_v2";
  AttentionProblem<T> p;
  p.kind = AttnKind::v2;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  p.lambda_logit = lambda_logit;
  validate_common(fn, p, options);
  const index_t qh = q.shape(2), Hkv = k.shape(2);
  if (qh < 2 || qh % 2 != 0)
    fail(fn, "q has ", qh, " heads, expected 2*H >= 2 (heads 2h and 2h+1 form DIFF head h): q ",
         shape_str(q.shape()));
  const index_t H = qh / 2;
  if (Hkv < 1 || qh % Hkv != 0)
    fail(fn, "k has ", Hkv, " heads, expected Hkv dividing the 2H = ", qh, " query heads (q ",
         shape_str(q.shape()), ", k ", shape_str(k.shape()), ")");
  if ((qh / Hkv) % 2 != 0)
    fail(fn, "a DIFF pair would straddle two GQA groups: 2H / Hkv = ", qh, " / ", Hkv, " = ",
         qh / Hkv, " query heads per kv head must be even (q ", shape_str(q.shape()), ", k ",
         shape_str(k.shape()), ")");
  if (v.shape(2) != Hkv)
    fail(fn, "v has shape ", shape_str(v.shape()), ", expected ", Hkv, " heads like k ",
         shape_str(k.shape()));
  if (v.shape(3) < 1) fail(fn, "v has shape ", shape_str(v.shape()), ": value width must be >= 1");
  p.heads = H;
  p.group = H / Hkv;
  p.value_dim = v.shape(3);
  check_shape(fn, "out", out, {p.batch, p.seqlen_q, H, p.value_dim}, "(B, N, H, d)");
  check_shape(fn, "lambda_logit", lambda_logit, {p.batch, p.seqlen_q, H}, "(B, N, H)");
  check_lse(fn, p, 2 * H);
  check_outputs(fn, p, "lambda_logit");
  return p;
}

template <class T>
AttentionProblem<T> validate_plain(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                   TensorView<const T, 4> v, TensorView<T, 4> out,
                                   TensorView<T, 3> lse, const AttentionOptions& options) {
  constexpr const char* fn = "attention";
  AttentionProblem<T> p;
  p.kind = AttnKind::plain;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  validate_common(fn, p, options);
  const index_t Hq = q.shape(2), Hkv = k.shape(2);
  if (Hq < 1) fail(fn, "q has shape ", shape_str(q.shape()), ": at least one head is needed");
  if (Hkv < 1 || Hq % Hkv != 0)
    fail(fn, "k has ", Hkv, " heads, expected Hkv with Hq % Hkv == 0 (q ", shape_str(q.shape()),
         ", k ", shape_str(k.shape()), ")");
  if (v.shape(2) != Hkv)
    fail(fn, "v has shape ", shape_str(v.shape()), ", expected ", Hkv, " heads like k ",
         shape_str(k.shape()));
  if (v.shape(3) < 1) fail(fn, "v has shape ", shape_str(v.shape()), ": value width must be >= 1");
  p.heads = Hq;
  p.group = Hq / Hkv;
  p.value_dim = v.shape(3);
  check_shape(fn, "out", out, {p.batch, p.seqlen_q, Hq, p.value_dim}, "(B, N, Hq, dv)");
  check_lse(fn, p, Hq);
  check_outputs(fn, p, "lambda");
  return p;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
