// Helpers of the 16-bit storage tests (test_half, test_half_backward,
// test_layers_half).
#pragma once

#include <type_traits>

#include <diffattn/detail/kernel/bf16_dot.hpp>
#include <diffattn/isa.hpp>
#include <diffattn/types.hpp>

namespace test {

/// Unit roundoff of the storage type: 2^-8 for bfloat16, 2^-11 for half.
template <class S>
constexpr double unit_roundoff() {
  return std::is_same<S, diffattn::bfloat16>::value ? 1.0 / 256 : 1.0 / 2048;
}

template <class S>
const char* type_name() {
  return std::is_same<S, diffattn::bfloat16>::value ? "bfloat16" : "half";
}

/// True when the kernels of S storage run their products on bf16 dot
/// products (vdpbf16ps), so that they are not bitwise the float kernels':
/// decided by the test's own flags header-only, by the variant in use under
/// diffattn::dispatch.
template <class S>
bool bf16_dot() {
#ifdef DIFFATTN_DISPATCH
  return std::is_same<S, diffattn::bfloat16>::value && diffattn::isa() == "avx512bf16";
#else
  return diffattn::detail::use_bf16_dot<S, S>;
#endif
}

}  // namespace test
