/// \file
/// Eigen matrix aliases used by the single-head (materialised) API.
#pragma once

#include <Eigen/Core>

#include "config.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup materialised
/// @{

/// Dense row-major matrix: rows are queries, columns keys or features.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
/// Dense column vector (one entry per row of a Matrix).
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// @}

DIFFATTN_END_NAMESPACE
