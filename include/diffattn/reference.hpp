/// \file
/// Reference implementations of the fused kernels: same signatures, the plain
/// materialised computation (N x M maps per head, Eigen products). The oracle of
/// the tests and the baseline of the benchmarks; O(N M) memory per thread,
/// threaded over (batch, head) like the fused kernels.
#pragma once

#include "config.hpp"
#include "detail/backward/attention_backward.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "detail/reference/reference_backward_impl.hpp"
#include "detail/reference/reference_impl.hpp"
#include "options.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace reference {

/// \addtogroup materialised
/// @{

/// Reference of diffattn::diff_attention_v1 (same shapes, same checks).
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options = {}) {
  detail::reference_run(detail::validate_v1<T>(q, k, v, &lambda, nullptr, out, lse, options),
                        options);
}
/// Reference of diffattn::diff_attention_v1 without lse.
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
                       detail::nondeduced_view<T, 4> out, const AttentionOptions& options = {}) {
  reference::diff_attention_v1<T>(q, k, v, lambda, out, TensorView<T, 3>(), options);
}
/// Reference of diffattn::diff_attention_v1 with one lambda per head (H).
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 1> lambda,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options = {}) {
  detail::reference_run(detail::validate_v1<T>(q, k, v, nullptr, &lambda, out, lse, options),
                        options);
}
/// Reference of diffattn::diff_attention_v1 with one lambda per head, without lse.
template <class T>
void diff_attention_v1(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 1> lambda,
                       detail::nondeduced_view<T, 4> out, const AttentionOptions& options = {}) {
  reference::diff_attention_v1<T>(q, k, v, lambda, out, TensorView<T, 3>(), options);
}

/// Reference of diffattn::diff_attention_v2.
template <class T>
void diff_attention_v2(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out, detail::nondeduced_view<T, 3> lse,
                       const AttentionOptions& options = {}) {
  detail::reference_run(detail::validate_v2<T>(q, k, v, lambda_logit, out, lse, options), options);
}
/// Reference of diffattn::diff_attention_v2 without lse.
template <class T>
void diff_attention_v2(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
                       detail::nondeduced_view<const T, 4> v,
                       detail::nondeduced_view<const T, 3> lambda_logit,
                       detail::nondeduced_view<T, 4> out, const AttentionOptions& options = {}) {
  reference::diff_attention_v2<T>(q, k, v, lambda_logit, out, TensorView<T, 3>(), options);
}

/// Reference of diffattn::attention.
template <class T>
void attention(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
               detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<T, 4> out,
               detail::nondeduced_view<T, 3> lse, const AttentionOptions& options = {}) {
  detail::reference_run(detail::validate_plain<T>(q, k, v, out, lse, options), options);
}
/// Reference of diffattn::attention without lse.
template <class T>
void attention(detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
               detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<T, 4> out,
               const AttentionOptions& options = {}) {
  reference::attention<T>(q, k, v, out, TensorView<T, 3>(), options);
}

/// Reference of diffattn::diff_attention_v1_backward (one lambda).
template <class T>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_t<T> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv, T& dlambda,
    const AttentionOptions& options = {}) {
  detail::reference_backward_run(detail::backward_v1<T>(q, k, v, &lambda, nullptr, out, lse, dout,
                                                        dq, dk, dv, TensorView<T, 1>(&dlambda, {1}),
                                                        options));
}
/// Reference of diffattn::diff_attention_v1_backward (one lambda per head).
template <class T>
void diff_attention_v1_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 1> lambda,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 1> dlambda, const AttentionOptions& options = {}) {
  detail::reference_backward_run(detail::backward_v1<T>(q, k, v, nullptr, &lambda, out, lse, dout,
                                                        dq, dk, dv, dlambda, options));
}
/// Reference of diffattn::diff_attention_v2_backward.
template <class T>
void diff_attention_v2_backward(
    detail::nondeduced_view<const T, 4> q, detail::nondeduced_view<const T, 4> k,
    detail::nondeduced_view<const T, 4> v, detail::nondeduced_view<const T, 3> lambda_logit,
    detail::nondeduced_view<const T, 4> out, detail::nondeduced_view<const T, 3> lse,
    detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
    detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
    detail::nondeduced_view<T, 3> dlambda_logit, const AttentionOptions& options = {}) {
  detail::reference_backward_run(detail::backward_v2<T>(q, k, v, lambda_logit, out, lse, dout, dq,
                                                        dk, dv, dlambda_logit, options));
}
/// Reference of diffattn::attention_backward.
template <class T>
void attention_backward(detail::nondeduced_view<const T, 4> q,
                        detail::nondeduced_view<const T, 4> k,
                        detail::nondeduced_view<const T, 4> v,
                        detail::nondeduced_view<const T, 4> out,
                        detail::nondeduced_view<const T, 3> lse,
                        detail::nondeduced_view<const T, 4> dout, detail::nondeduced_view<T, 4> dq,
                        detail::nondeduced_view<T, 4> dk, detail::nondeduced_view<T, 4> dv,
                        const AttentionOptions& options = {}) {
  detail::reference_backward_run(
      detail::backward_plain<T>(q, k, v, out, lse, dout, dq, dk, dv, options));
}

/// @}

}  // namespace reference
DIFFATTN_END_NAMESPACE
