/// \file
/// Whole differential attention layers with reference-compatible parameters:
/// MultiheadDiffAttnV1 (split heads, Ye et al.) and MultiheadDiffAttnV2 (doubled
/// query heads), one header each.
#pragma once

#include "module_v1.hpp"
#include "module_v2.hpp"
