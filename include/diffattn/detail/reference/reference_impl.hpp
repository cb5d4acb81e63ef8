// The materialised reference path behind diffattn::reference: per batch entry
// and head, the full N x M maps with Eigen, softmax, W and W V.
#pragma once

#include "../../config.hpp"
#include "../../diff_weights.hpp"
#include "../../lambda.hpp"
#include "../../matrix.hpp"
#include "../../softmax.hpp"
#include "../core/parallel.hpp"
#include "../core/validate.hpp"
#include "../kernel/attention_kernel.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Rows [row0, row0 + rows) of one head of batch entry b, as a matrix (rows, D).
template <class T>
Matrix<T> gather_head(const TensorView<const T, 4>& t, index_t b, index_t head, index_t row0,
                      index_t rows) {
  Matrix<T> m(rows, t.shape(3));
  for (index_t i = 0; i < rows; ++i)
    for (index_t c = 0; c < t.shape(3); ++c) m(i, c) = t(b, row0 + i, head, c);
  return m;
}
template <class T>
Matrix<T> gather_head(const TensorView<const T, 4>& t, index_t b, index_t head) {
  return gather_head(t, b, head, 0, t.shape(1));
}

template <class T>
void reference_head(const AttentionProblem<T>& p, index_t seq, index_t oh) {
  const SeqSpan sq = p.seq(seq);
  const index_t N = sq.n, M = sq.m;
  const HeadMap hm = head_map(p, oh);
  auto qhead = [&](int m) { return gather_head(p.q, sq.b, hm.q[m], sq.q0, N); };
  auto khead = [&](int m) { return gather_head(p.k, sq.b, hm.k[m], sq.k0, M); };
  Vector<T> lse[2];
  Matrix<T> w = softmax(masked_scores<T>(qhead(0), khead(0), p.scale, p.band), &lse[0]);  // (N, M)
  if (p.kind != AttnKind::plain) {
    const Matrix<T> a2 = softmax(masked_scores<T>(qhead(1), khead(1), p.scale, p.band), &lse[1]);
    Vector<T> lambda(N);
    for (index_t i = 0; i < N; ++i) lambda(i) = row_lambda(p, sq.b, sq.q0 + i, oh);
    w -= lambda.asDiagonal() * a2;
  }
  // Each row only over the keys it sees: a masked key's (zero) weight never
  // multiplies its values, so non-finite values stay in the rows that see them.
  const Matrix<T> v = gather_head(p.v, sq.b, hm.v, sq.k0, M);  // (M, dv)
  for (index_t i = 0; i < N; ++i) {
    const index_t j0 = p.band.begin(i, N, M), n = p.band.count(i, N, M);
    Eigen::Matrix<T, 1, Eigen::Dynamic> o = Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(p.value_dim);
    if (n > 0) o.noalias() = w.row(i).segment(j0, n) * v.middleRows(j0, n);
    for (index_t c = 0; c < p.value_dim; ++c) p.out(sq.b, sq.q0 + i, oh, c) = o(c);
  }
  if (p.has_lse())
    for (int m = 0; m < p.maps(); ++m)
      for (index_t i = 0; i < N; ++i) p.lse(sq.b, hm.q[m], sq.q0 + i) = lse[m](i);
}

/// Runs every (sequence, head) of a validated problem, threaded over them as a
/// user of Eigen would (each head's products then run single-threaded).
template <class T>
void reference_run(const AttentionProblem<T>& p, const AttentionOptions& options) {
  // The materialised reference knows no score modifier: refuse rather than ignore.
  if (p.modified)
    fail("diffattn::reference", "options.softcap, alibi_slopes and sinks are not supported here");
  const index_t tasks = p.num_seqs() * p.heads;
  if (tasks == 0) return;
  parallel_tasks<false>(
      tasks, resolve_threads(options.num_threads, tasks),
      [&](index_t t) { reference_head(p, t / p.heads, t % p.heads); }, [] {});
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
