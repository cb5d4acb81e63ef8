// The materialised reference of the backward pass: per batch entry and head,
// full N x M maps recomputed from q and k, and the textbook chain rule.
#pragma once

#include <vector>

#include "../../config.hpp"
#include "../../lambda.hpp"
#include "../../matrix.hpp"
#include "../../softmax.hpp"
#include "../backward/attention_backward.hpp"
#include "reference_impl.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
void scatter_head_add(const TensorView<T, 4>& t, index_t b, index_t head, index_t row0,
                      const Matrix<T>& m) {
  for (index_t i = 0; i < m.rows(); ++i)
    for (index_t c = 0; c < m.cols(); ++c) t(b, row0 + i, head, c) += m(i, c);
}

template <class T>
void reference_backward_run(const BackwardProblem<T>& bp) {
  const AttentionProblem<T>& p = bp.fwd;
  for (const TensorView<T, 4>* t : {&bp.dq, &bp.dk, &bp.dv})
    for (index_t a = 0; a < t->shape(0); ++a)
      for (index_t i = 0; i < t->shape(1); ++i)
        for (index_t h = 0; h < t->shape(2); ++h)
          for (index_t c = 0; c < t->shape(3); ++c) (*t)(a, i, h, c) = T(0);
  std::vector<T> dlambda(static_cast<std::size_t>(p.heads), T(0));
  for (index_t seq = 0; seq < p.num_seqs(); ++seq) {
    const SeqSpan sq = p.seq(seq);
    const index_t N = sq.n, M = sq.m, b = sq.b;
    for (index_t oh = 0; oh < p.heads; ++oh) {
      const HeadMap hm = head_map(p, oh);
      const Matrix<T> dout = gather_head(bp.dout, b, oh, sq.q0, N);  // (N, dv)
      const Matrix<T> v = gather_head(p.v, b, hm.v, sq.k0, M);       // (M, dv)
      const Matrix<T> dw = dout * v.transpose();                     // (N, M)
      Matrix<T> q[2], k[2], a[2];
      for (int m = 0; m < p.maps(); ++m) {
        q[m] = gather_head(p.q, b, hm.q[m], sq.q0, N);
        k[m] = gather_head(p.k, b, hm.k[m], sq.k0, M);
        a[m] = softmax(masked_scores<T>(q[m], k[m], p.scale, p.band));
      }
      Vector<T> lambda = Vector<T>::Zero(N);
      Matrix<T> w = a[0];
      Matrix<T> da[2] = {dw, Matrix<T>()};
      if (p.maps() == 2) {
        for (index_t i = 0; i < N; ++i) lambda(i) = row_lambda(p, b, sq.q0 + i, oh);
        w = a[0] - lambda.asDiagonal() * a[1];
        da[1] = -(lambda.asDiagonal() * dw);
        const Vector<T> dlambda_rows = -(a[1].cwiseProduct(dw)).rowwise().sum();  // (N)
        if (p.kind == AttnKind::v2) {
          for (index_t i = 0; i < N; ++i)
            bp.dlambda_logit(b, sq.q0 + i, oh) = dlambda_rows(i) * lambda(i) * (T(1) - lambda(i));
        } else {
          dlambda[static_cast<std::size_t>(oh)] += dlambda_rows.sum();
        }
      }
      scatter_head_add(bp.dv, b, hm.v, sq.k0, Matrix<T>(w.transpose() * dout));
      for (int m = 0; m < p.maps(); ++m) {
        const Vector<T> rowdot = a[m].cwiseProduct(da[m]).rowwise().sum();
        const Matrix<T> ds = a[m].cwiseProduct(da[m] - rowdot.replicate(1, da[m].cols()));
        scatter_head_add(bp.dq, b, hm.q[m], sq.q0, Matrix<T>(p.scale * ds * k[m]));
        scatter_head_add(bp.dk, b, hm.k[m], sq.k0, Matrix<T>(p.scale * ds.transpose() * q[m]));
      }
    }
  }
  if (p.kind == AttnKind::v1) {
    if (bp.dlambda.shape(0) == 1) {
      T total = 0;
      for (T x : dlambda) total += x;
      bp.dlambda(0) = total;
    } else {
      for (index_t h = 0; h < p.heads; ++h) bp.dlambda(h) = dlambda[static_cast<std::size_t>(h)];
    }
  }
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
