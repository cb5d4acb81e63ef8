/// \file
/// diffattn::error, the one exception type thrown at the public boundary.
#pragma once

#include <stdexcept>
#include <string>

#include "config.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup basics
/// @{

/// Thrown for every invalid argument (shapes, strides, aliasing, non-finite
/// scalars) and for unreadable or malformed files. The message names the
/// function, the argument and the shapes involved, e.g.
/// "diff_attention_v1: k has 3 heads, expected 2*Hkv with H % Hkv == 0".
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// @}

DIFFATTN_END_NAMESPACE
