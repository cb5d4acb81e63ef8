// The seam between the public entry points and the compiled kernels of
// diffattn::dispatch (src/): the storage combinations the library compiles,
// and the functions it defines for them (the attention kernels, the layers'
// projections and the analysis kernel).
//
// Header-only use (DIFFATTN_DISPATCH undefined) never calls these: the
// kernels compile in the including translation unit, for its flags. A
// program linking diffattn::dispatch is compiled with DIFFATTN_DISPATCH, and
// detail::run_attention / run_attention_backward then hand the checked
// problem to the library, which runs the variant chosen for this CPU; so do
// detail::linear / linear_backward, the layers' projections, and the
// statistics functions of diffattn/analysis.hpp.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <cstdint>

#include "../../config.hpp"
#include "../../float8.hpp"
#include "../../options.hpp"
#include "../../types.hpp"

// Every (query storage T, cache storage KV) pair the forward kernels take:
// KV is T, a 16-bit cache (bfloat16, half) under any query type, or an 8-bit
// cache (int8, e4m3) under float or 16-bit queries. A call with a pair missing
// here does not compile under DIFFATTN_DISPATCH (no overload).
#define DIFFATTN_FORWARD_STORAGE(X)                                                      \
  X(float, float) X(float, ::diffattn::bfloat16) X(float, ::diffattn::half)              \
  X(double, double) X(double, ::diffattn::bfloat16) X(double, ::diffattn::half)          \
  X(::diffattn::bfloat16, ::diffattn::bfloat16)                                          \
  X(::diffattn::bfloat16, ::diffattn::half) X(::diffattn::half, ::diffattn::half)        \
  X(::diffattn::half, ::diffattn::bfloat16)                                              \
  X(float, std::int8_t) X(float, ::diffattn::float8_e4m3)                                \
  X(::diffattn::bfloat16, std::int8_t) X(::diffattn::bfloat16, ::diffattn::float8_e4m3)  \
  X(::diffattn::half, std::int8_t) X(::diffattn::half, ::diffattn::float8_e4m3)

// The storage types of the backward kernels (q, k, v, out and dout share one).
#define DIFFATTN_BACKWARD_STORAGE(X) X(float) X(double) X(::diffattn::bfloat16) X(::diffattn::half)

// The layers' projections (detail/layers/linear.hpp): every (x, W, y) storage
// triple of y = x W^T that a float, double, bfloat16 or half layer runs (a
// 16-bit layer's x and y are its own storage or float), and the storage of
// its backward. A triple missing here compiles in the calling unit instead.
#define DIFFATTN_LINEAR_STORAGE(X)                                                               \
  X(float, float, float) X(double, double, double)                                               \
  X(::diffattn::bfloat16, ::diffattn::bfloat16, ::diffattn::bfloat16)                            \
  X(::diffattn::bfloat16, ::diffattn::bfloat16, float)                                           \
  X(float, ::diffattn::bfloat16, ::diffattn::bfloat16) X(float, ::diffattn::bfloat16, float)     \
  X(::diffattn::half, ::diffattn::half, ::diffattn::half)                                        \
  X(::diffattn::half, ::diffattn::half, float) X(float, ::diffattn::half, ::diffattn::half)      \
  X(float, ::diffattn::half, float)
#define DIFFATTN_LINEAR_BACKWARD_STORAGE(X) X(float) X(double)

// The storage types of the analysis kernel (diffattn/analysis.hpp: q, k, v
// and out share one).
#define DIFFATTN_ANALYSIS_STORAGE(X) X(float) X(double)

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T, class KV>
struct AttentionProblem;
struct AnalysisSpec;
template <class T>
struct BackwardProblem;

// Defined in diffattn::dispatch: run the problem on the selected variant.
#define DIFFATTN_DECLARE_FORWARD(T, KV) \
  void dispatch_attention(const AttentionProblem<T, KV>& p, const AttentionOptions& options);
DIFFATTN_FORWARD_STORAGE(DIFFATTN_DECLARE_FORWARD)
#undef DIFFATTN_DECLARE_FORWARD
#define DIFFATTN_DECLARE_BACKWARD(T) \
  void dispatch_attention_backward(const BackwardProblem<T>& bp, const AttentionOptions& options);
DIFFATTN_BACKWARD_STORAGE(DIFFATTN_DECLARE_BACKWARD)
#undef DIFFATTN_DECLARE_BACKWARD

#define DIFFATTN_DECLARE_LINEAR(SX, SW, SY)                                                  \
  void dispatch_linear(const SX* x, index_t rows, index_t in, const SW* w, index_t out, SY* y, \
                       int threads);
DIFFATTN_LINEAR_STORAGE(DIFFATTN_DECLARE_LINEAR)
#undef DIFFATTN_DECLARE_LINEAR
#define DIFFATTN_DECLARE_LINEAR_BACKWARD(T)                                                    \
  void dispatch_linear_backward(const T* x, index_t rows, index_t in, const T* w, index_t out, \
                                const T* dy, T* dw, T* dx, bool accumulate_dx, int threads);
DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_DECLARE_LINEAR_BACKWARD)
#undef DIFFATTN_DECLARE_LINEAR_BACKWARD

// The statistics come back in an array of doubles (analysis_impl.hpp's
// AnalysisLayout): nothing of the standard library crosses the seam, as
// nothing does in the problems, so a program built with other library flags
// (_GLIBCXX_DEBUG) can still link the library.
#define DIFFATTN_DECLARE_ANALYSIS(T)                                                        \
  void dispatch_analysis(const AttentionProblem<T, T>& p, const AnalysisSpec& spec,          \
                         const AttentionOptions& options, double* flat);
DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_DECLARE_ANALYSIS)
#undef DIFFATTN_DECLARE_ANALYSIS

/// Whether diffattn::dispatch compiles linear for (SX, SW, SY), and
/// linear_backward for T.
template <class SX, class SW, class SY>
constexpr bool linear_dispatched() {
#define DIFFATTN_MATCH(A, B, C) \
  (std::is_same<SX, A>::value && std::is_same<SW, B>::value && std::is_same<SY, C>::value) ||
  return DIFFATTN_LINEAR_STORAGE(DIFFATTN_MATCH) false;
#undef DIFFATTN_MATCH
}
template <class T>
constexpr bool linear_backward_dispatched() {
#define DIFFATTN_MATCH(A) std::is_same<T, A>::value ||
  return DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_MATCH) false;
#undef DIFFATTN_MATCH
}
/// Whether diffattn::dispatch compiles the analysis kernel for T.
template <class T>
constexpr bool analysis_dispatched() {
#define DIFFATTN_MATCH(A) std::is_same<T, A>::value ||
  return DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_MATCH) false;
#undef DIFFATTN_MATCH
}

/// The name of the variant diffattn::dispatch selected (selecting it on the
/// first call); throws diffattn::error when DIFFATTN_ISA names a variant that
/// is unknown, not compiled in, or not supported by this CPU.
const char* dispatch_isa();
/// The variant that runs the kernels with bfloat16 q and k, and the
/// projections of bfloat16 x by bfloat16 W: dispatch_isa(), or avx512 where
/// that is avx512bf16, chosen without DIFFATTN_ISA, and this CPU's bf16 dot
/// products are slower than its float FMAs.
const char* dispatch_bf16_isa();
/// The variants compiled into the library, least to most capable.
std::vector<std::string_view> dispatch_variants();
/// Whether the variant is compiled in and this CPU runs it.
bool dispatch_supported(std::string_view name);
/// The variant DIFFATTN_ISA=name would select (the best one for an empty
/// name), or diffattn::error; selects nothing (for tests).
std::string dispatch_check(std::string_view name);

}  // namespace detail
DIFFATTN_END_NAMESPACE
