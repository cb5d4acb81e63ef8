// Small type helpers.
#pragma once

#include <cstddef>

#include "../../config.hpp"
#include "../../tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct identity {
  using type = T;
};
/// Blocks template argument deduction: T then comes from elsewhere (usually an
/// explicit diff_attention_v1<float>(...)), and any argument that converts to
/// the parameter type is accepted (a Tensor, a view of non-const T).
template <class T>
using nondeduced_t = typename identity<T>::type;

template <class T, std::size_t R>
using nondeduced_view = nondeduced_t<TensorView<T, R>>;

}  // namespace detail
DIFFATTN_END_NAMESPACE
