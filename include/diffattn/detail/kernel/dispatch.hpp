// The seam between the public entry points and the compiled kernels of
// diffattn::dispatch (src/): the storage combinations the library compiles,
// and the functions it defines for them.
//
// Header-only use (DIFFATTN_DISPATCH undefined) never calls these: the
// kernels compile in the including translation unit, for its flags. A
// program linking diffattn::dispatch is compiled with DIFFATTN_DISPATCH, and
// detail::run_attention / run_attention_backward then hand the checked
// problem to the library, which runs the variant chosen for this CPU.
#pragma once

#include <string>
#include <string_view>
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

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T, class KV>
struct AttentionProblem;
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

/// The name of the variant diffattn::dispatch selected (selecting it on the
/// first call); throws diffattn::error when DIFFATTN_ISA names a variant that
/// is unknown, not compiled in, or not supported by this CPU.
const char* dispatch_isa();
/// The variants compiled into the library, least to most capable.
std::vector<std::string_view> dispatch_variants();
/// Whether the variant is compiled in and this CPU runs it.
bool dispatch_supported(std::string_view name);
/// The variant DIFFATTN_ISA=name would select (the best one for an empty
/// name), or diffattn::error; selects nothing (for tests).
std::string dispatch_check(std::string_view name);

}  // namespace detail
DIFFATTN_END_NAMESPACE
