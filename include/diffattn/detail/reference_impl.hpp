// The materialised reference path behind diffattn::reference: per batch entry
// and head, the full N x M maps with Eigen, softmax, W and W V.
#pragma once

#include "../config.hpp"
#include "../diff_weights.hpp"
#include "../lambda.hpp"
#include "../matrix.hpp"
#include "../softmax.hpp"
#include "attention_kernel.hpp"
#include "parallel.hpp"
#include "validate.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
Matrix<T> gather_head(const TensorView<const T, 4>& t, index_t b, index_t head) {
  Matrix<T> m(t.shape(1), t.shape(3));
  for (index_t i = 0; i < t.shape(1); ++i)
    for (index_t c = 0; c < t.shape(3); ++c) m(i, c) = t(b, i, head, c);
  return m;
}

template <class T>
void reference_head(const AttentionProblem<T>& p, index_t b, index_t oh) {
  const index_t N = p.seqlen_q, M = p.seqlen_k;
  {
    {
      const index_t g = oh / p.group;
      Matrix<T> w;  // (N, M)
      Vector<T> lse[2];
      index_t qhead[2] = {oh, oh};
      if (p.kind == AttnKind::plain) {
        const Matrix<T> s =
            masked_scores<T>(gather_head(p.q, b, oh), gather_head(p.k, b, g), p.scale, p.causal);
        w = softmax(s, &lse[0]);
      } else {
        qhead[0] = 2 * oh;
        qhead[1] = 2 * oh + 1;
        const index_t k1 = p.kind == AttnKind::v1 ? 2 * g : g;
        const index_t k2 = p.kind == AttnKind::v1 ? 2 * g + 1 : g;
        const Matrix<T> a1 = softmax(masked_scores<T>(gather_head(p.q, b, qhead[0]),
                                                      gather_head(p.k, b, k1), p.scale, p.causal),
                                     &lse[0]);
        const Matrix<T> a2 = softmax(masked_scores<T>(gather_head(p.q, b, qhead[1]),
                                                      gather_head(p.k, b, k2), p.scale, p.causal),
                                     &lse[1]);
        Vector<T> lambda(N);
        for (index_t i = 0; i < N; ++i) {
          if (p.kind == AttnKind::v2)
            lambda(i) = lambda_sigmoid<T>(p.lambda_logit(b, i, oh));
          else
            lambda(i) = p.lambda_heads.empty() ? p.lambda_scalar : p.lambda_heads(oh);
        }
        w = a1 - lambda.asDiagonal() * a2;
      }
      // Each row only over the keys it sees: a masked key's (zero) weight never
      // multiplies its values, so non-finite values stay in the rows that see them.
      const Matrix<T> v = gather_head(p.v, b, g);  // (M, dv)
      for (index_t i = 0; i < N; ++i) {
        const index_t n = key_end(p.causal, i, N, M);
        Eigen::Matrix<T, 1, Eigen::Dynamic> o =
            Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(p.value_dim);
        if (n > 0) o.noalias() = w.row(i).head(n) * v.topRows(n);
        for (index_t c = 0; c < p.value_dim; ++c) p.out(b, i, oh, c) = o(c);
      }
      if (p.has_lse())
        for (int m = 0; m < p.maps(); ++m)
          for (index_t i = 0; i < N; ++i) p.lse(b, qhead[m], i) = lse[m](i);
    }
  }
}

/// Runs every (batch, head) of a validated problem, threaded over them as a
/// user of Eigen would (each head's products then run single-threaded).
template <class T>
void reference_run(const AttentionProblem<T>& p, const AttentionOptions& options) {
  const index_t tasks = p.batch * p.heads;
  if (tasks == 0) return;
  parallel_tasks(
      tasks, resolve_threads(options.num_threads, tasks),
      [&](index_t t) { reference_head(p, t / p.heads, t % p.heads); }, [] {});
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
