/// \file
/// diffattn: version, namespace and the index type.
#pragma once

#include <cstddef>

#define DIFFATTN_VERSION_MAJOR 0
#define DIFFATTN_VERSION_MINOR 1
#define DIFFATTN_VERSION_PATCH 0
/// Single number for preprocessor comparisons: major * 10000 + minor * 100 + patch.
#define DIFFATTN_VERSION \
  (DIFFATTN_VERSION_MAJOR * 10000 + DIFFATTN_VERSION_MINOR * 100 + DIFFATTN_VERSION_PATCH)

// Everything lives in the versioned inline namespace diffattn::v0: objects built
// against two incompatible versions fail to link instead of misbehaving.
// DIFFATTN_INLINE_NAMESPACE renames it for one translation unit, so that builds
// of the headers with different flags can sit side by side in one program
// (bench_dispatch compares them in one process); everything else keeps v0.
#ifndef DIFFATTN_INLINE_NAMESPACE
#define DIFFATTN_INLINE_NAMESPACE v0
#endif
#define DIFFATTN_BEGIN_NAMESPACE \
  namespace diffattn {           \
  inline namespace DIFFATTN_INLINE_NAMESPACE {
#define DIFFATTN_END_NAMESPACE \
  }                            \
  }

// Internal invariants (never argument checks: those throw diffattn::error).
// Tests may define DIFFATTN_ASSERT before the first include to turn a failure
// into an exception.
#ifndef DIFFATTN_ASSERT
#include <cassert>
#define DIFFATTN_ASSERT(cond) assert(cond)
#endif

DIFFATTN_BEGIN_NAMESPACE

/// Signed 64-bit (on 64-bit targets) index for every extent, stride and offset.
using index_t = std::ptrdiff_t;

DIFFATTN_END_NAMESPACE
