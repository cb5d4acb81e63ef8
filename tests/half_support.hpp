// Helpers of the 16-bit storage tests (test_half, test_layers_half).
#pragma once

#include <type_traits>

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

}  // namespace test
