/// \file
/// Storage types: the 16-bit floating-point formats the kernels, caches and
/// safetensors files take besides float and double.
#pragma once

#include <type_traits>

#include <Eigen/Core>

#include "config.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup storage
/// @{

/// bfloat16: 8 exponent bits and 8 significand bits (float's range, relative
/// rounding 2^-8). Eigen's type: converts to and from float explicitly.
using bfloat16 = Eigen::bfloat16;
/// IEEE 754 binary16: 5 exponent bits and 11 significand bits (largest finite
/// 65504, relative rounding 2^-11). Eigen's type.
using half = Eigen::half;

/// True for the 16-bit storage types (bfloat16, half).
template <class T>
struct is_half_storage
    : std::integral_constant<bool, std::is_same<std::remove_cv_t<T>, bfloat16>::value ||
                                       std::is_same<std::remove_cv_t<T>, half>::value> {};
/// is_half_storage<T>::value.
template <class T>
constexpr bool is_half_storage_v = is_half_storage<T>::value;

/// The type a kernel computes and accumulates in for storage T: float for the
/// 16-bit types, T itself for float and double. lse, lambda and the scale of a
/// kernel on T-storage are compute_t<T>.
template <class T>
using compute_t = std::conditional_t<is_half_storage_v<T>, float, std::remove_cv_t<T>>;

/// @}

DIFFATTN_END_NAMESPACE
