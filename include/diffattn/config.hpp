/// \file
/// diffattn: version, namespace and the index type.
#pragma once

#include <cstddef>

/// \addtogroup basics
/// @{

/// Major version: incompatible API changes.
#define DIFFATTN_VERSION_MAJOR 0
/// Minor version: compatible additions.
#define DIFFATTN_VERSION_MINOR 1
/// Patch version: fixes.
#define DIFFATTN_VERSION_PATCH 0
/// Single number for preprocessor comparisons: major * 10000 + minor * 100 + patch.
#define DIFFATTN_VERSION \
  (DIFFATTN_VERSION_MAJOR * 10000 + DIFFATTN_VERSION_MINOR * 100 + DIFFATTN_VERSION_PATCH)

/// The versioned inline namespace everything lives in, diffattn::v0: objects built
/// against two incompatible versions fail to link instead of misbehaving.
/// Defining DIFFATTN_INLINE_NAMESPACE renames it for one translation unit, so that builds
/// of the headers with different flags can sit side by side in one program
/// (bench_dispatch compares them in one process); everything else keeps v0.
#ifndef DIFFATTN_INLINE_NAMESPACE
#define DIFFATTN_INLINE_NAMESPACE v0
#endif
/// Opens namespace diffattn and its inline namespace (the headers' own use).
#define DIFFATTN_BEGIN_NAMESPACE \
  namespace diffattn {           \
  inline namespace DIFFATTN_INLINE_NAMESPACE {
/// Closes what DIFFATTN_BEGIN_NAMESPACE opened.
#define DIFFATTN_END_NAMESPACE \
  }                            \
  }

/// Checks internal invariants (never argument checks: those throw diffattn::error);
/// assert() unless defined before the first include (tests define it to turn
/// a failure into an exception).
#ifndef DIFFATTN_ASSERT
#include <cassert>
#define DIFFATTN_ASSERT(cond) assert(cond)
#endif

/// 1: bfloat16 products (prefill, backward, the layers' projections) run on
/// AVX512-BF16's vdpbf16ps where the build targets it; 0: they widen
/// bfloat16 to float and run on float FMAs. Unless defined before the first
/// include, 1 where the target has AVX512-BF16 and not AMX-BF16, that is on
/// AMD Zen 4 and Zen 5, and 0 on Intel Xeons of the Sapphire Rapids class
/// and later: there vdpbf16ps does fewer multiply-adds a second than float
/// FMAs (0.46x the flops on an Emerald Rapids Xeon), and bfloat16 prefill
/// built with -march=native ran at 0.70-0.78x float on it, about float's
/// speed widened. (diffattn::dispatch makes the same choice at run time
/// with a probe.) Widened, bfloat16 inputs give the float kernels' results
/// on the widened values; on vdpbf16ps, scores are summed in another order
/// and W is rounded to bfloat16 before W V (docs/storage.md).
#ifndef DIFFATTN_BF16_DOT
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define DIFFATTN_BF16_DOT 1
#else
#define DIFFATTN_BF16_DOT 0
#endif
#endif

/// 1 (the default): the kernels' work (every forward, backward, decoding
/// step and projection, on the library's threads or the caller's) runs with
/// denormal floats flushed to zero, MXCSR's FTZ and DAZ bits, set for each
/// task and put back after it, so the caller's own code keeps its mode.
/// Attention makes denormals wherever it is peaked (exp of scores 87 to 104
/// below the row's max), and x86 cores take about 100 cycles for each
/// instruction that meets one: with scores of standard deviation 30, as
/// trained models reach, the V2 forward ran 13x and its backward 62x slower
/// on an Emerald Rapids Xeon without the flush. A flushed term is below
/// 2^-126 times the other factor, far below the rounding of any sum it joins
/// (docs/kernels.md). 0: the kernels run in the caller's mode (IEEE gradual
/// underflow unless the caller set FTZ or DAZ). No effect off x86.
#ifndef DIFFATTN_FLUSH_DENORMALS
#define DIFFATTN_FLUSH_DENORMALS 1
#endif

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup basics
/// Signed 64-bit (on 64-bit targets) index for every extent, stride and offset.
using index_t = std::ptrdiff_t;

DIFFATTN_END_NAMESPACE

/// @}
