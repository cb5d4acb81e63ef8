/// \file
/// Which instruction-set variant runs the kernels: the flags of the including
/// translation unit (header-only), or the variant diffattn::dispatch selects
/// for this CPU at run time.
#pragma once

#include <string_view>
#include <vector>

#include "config.hpp"
#include "detail/kernel/dispatch.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \defgroup dispatch Run-time instruction-set dispatch
///
/// Header-only, the kernels compile for the flags of the translation unit that
/// includes them (add diffattn::native, i.e. -march=native, where the program
/// runs where it is built). A program linking the compiled library
/// diffattn::dispatch (which defines DIFFATTN_DISPATCH for it) calls the same
/// entry points, and the fused forward, backward, KV-cache and packed kernels,
/// the layers' projections and the statistics of analysis.hpp run the most
/// capable variant compiled into the library that the CPU and
/// its operating system support: on x86-64 "generic" (x86-64), "sse4"
/// (x86-64-v2), "avx2" (x86-64-v3: AVX2, FMA, F16C), "avx512" (x86-64-v4: F,
/// BW, CD, DQ, VL) and "avx512bf16" (x86-64-v4 with AVX512-BF16 and
/// AVX512-VNNI). The choice is made once, at the first kernel call; the
/// environment variable `DIFFATTN_ISA=<name>` forces a variant, and a variant
/// the CPU lacks, or a name not compiled in, is refused with diffattn::error
/// at that call. Every translation unit of a program that includes diffattn
/// must agree on DIFFATTN_DISPATCH (the target sets it for all of them). One
/// exception to the single variant: where the selection without DIFFATTN_ISA
/// is "avx512bf16" and a probe (about 1 ms, at the first such call) finds
/// that this CPU's bf16 dot products (`vdpbf16ps`) do fewer flops a second
/// than its float FMAs, as on Intel's Sapphire Rapids class, the kernels whose
/// q and k are bfloat16 (the bfloat16 forward and backward, and projections
/// of bfloat16 inputs by bfloat16 weights) run the "avx512" variant, which
/// widens bfloat16 to float; isa() still names "avx512bf16". Header-only
/// builds make the same choice at compile time (DIFFATTN_BF16_DOT,
/// config.hpp). Not dispatched: kernels with a user's score functor, the
/// layers' rotary embedding, lambda and normalisation, which compile with the
/// program's flags.
/// @{

/// The variant in use: "native" header-only; with diffattn::dispatch the
/// selected variant's name (selecting it if no kernel ran yet).
inline std::string_view isa() {
#ifdef DIFFATTN_DISPATCH
  return detail::dispatch_isa();
#else
  return "native";
#endif
}

/// The variants compiled in, from the least to the most capable: {"native"}
/// header-only.
inline std::vector<std::string_view> isa_variants() {
#ifdef DIFFATTN_DISPATCH
  return detail::dispatch_variants();
#else
  return {"native"};
#endif
}

/// Whether this CPU and its operating system run the variant `name` (false
/// for a name not among isa_variants()).
inline bool isa_supported(std::string_view name) {
#ifdef DIFFATTN_DISPATCH
  return detail::dispatch_supported(name);
#else
  return name == "native";
#endif
}

/// @}

DIFFATTN_END_NAMESPACE
