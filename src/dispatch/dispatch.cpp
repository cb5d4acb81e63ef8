// diffattn::dispatch: selects, once per process, the best variant of the
// kernels compiled into the library that this CPU and its operating system
// can run, and forwards every checked problem to it. Compiled for the
// baseline instruction set of the target, like the code that calls it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <diffattn/detail/kernel/dispatch.hpp>
#include <diffattn/error.hpp>
#include <diffattn/isa.hpp>

#include "variant.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DIFFATTN_DISPATCH_X86 1
#if defined(__GNUC__) || defined(__clang__)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#define DIFFATTN_DISPATCH_BF16_PROBE 1
#endif
#endif

// The variants compiled in, from the least to the most capable:
// DIFFATTN_VARIANT_LIST(X) expands X(name) for each (variants.inc, generated).
#include "variants.inc"

#define DIFFATTN_DECLARE_TABLES(name)                                        \
  extern "C" const diffattn_dispatch::ErasedFn DIFFATTN_FORWARD_TABLE(name)[]; \
  extern "C" const diffattn_dispatch::ErasedFn DIFFATTN_BACKWARD_TABLE(name)[]; \
  extern "C" const diffattn_dispatch::ErasedFn DIFFATTN_LINEAR_TABLE(name)[];   \
  extern "C" const diffattn_dispatch::ErasedFn DIFFATTN_ANALYSIS_TABLE(name)[];
DIFFATTN_VARIANT_LIST(DIFFATTN_DECLARE_TABLES)
#undef DIFFATTN_DECLARE_TABLES

namespace diffattn_dispatch {
namespace {

struct Variant {
  const char* name;
  const ErasedFn* forward;
  const ErasedFn* backward;
  const ErasedFn* linear;
  const ErasedFn* analysis;
};

#define DIFFATTN_VARIANT_ENTRY(name)                                          \
  Variant{#name, DIFFATTN_FORWARD_TABLE(name), DIFFATTN_BACKWARD_TABLE(name), \
          DIFFATTN_LINEAR_TABLE(name), DIFFATTN_ANALYSIS_TABLE(name)},
constexpr Variant kVariants[] = {DIFFATTN_VARIANT_LIST(DIFFATTN_VARIANT_ENTRY)};
#undef DIFFATTN_VARIANT_ENTRY
constexpr int kVariantCount = static_cast<int>(sizeof(kVariants) / sizeof(kVariants[0]));

/// The instruction-set extensions the variants need, as this CPU and its
/// operating system provide them.
struct CpuFeatures {
  bool x86_64_v2 = false;  // SSE3, SSSE3, SSE4.1, SSE4.2, POPCNT, CMPXCHG16B, LAHF
  bool x86_64_v3 = false;  // + AVX, AVX2, FMA, F16C, BMI1, BMI2, LZCNT, MOVBE, OS-saved ymm
  bool x86_64_v4 = false;  // + AVX-512 F, BW, CD, DQ, VL, OS-saved zmm and mask registers
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
};

#ifdef DIFFATTN_DISPATCH_X86
CpuFeatures detect() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  unsigned c1 = 0, d1 = 0, b7 = 0, c7 = 0, a7_1 = 0, c81 = 0, d81 = 0;
  __get_cpuid(1, &a, &b, &c1, &d1);
  if (max_leaf >= 7) {
    unsigned max_subleaf = 0;
    __cpuid_count(7, 0, max_subleaf, b7, c7, d);
    if (max_subleaf >= 1) __cpuid_count(7, 1, a7_1, b, c, d);
  }
  __get_cpuid(0x80000001u, &a, &b, &c81, &d81);  // leaves c81 at 0 where absent
  auto bit = [](unsigned reg, int i) { return ((reg >> i) & 1u) != 0; };
  // XCR0: which register states the operating system saves on a context switch.
  std::uint64_t xcr0 = 0;
  if (bit(c1, 27)) {  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<std::uint64_t>(hi) << 32) | lo;
  }
  const bool os_ymm = (xcr0 & 0x6) == 0x6;           // xmm and ymm
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask, zmm0-15 upper, zmm16-31
  f.x86_64_v2 = bit(c1, 0) && bit(c1, 9) && bit(c1, 13) && bit(c1, 19) && bit(c1, 20) &&
                bit(c1, 23) && bit(c81, 0);
  f.x86_64_v3 = f.x86_64_v2 && os_ymm && bit(c1, 28) && bit(c1, 12) && bit(c1, 29) &&
                bit(c1, 22) && bit(b7, 5) && bit(b7, 3) && bit(b7, 8) && bit(c81, 5);
  f.x86_64_v4 = f.x86_64_v3 && os_zmm && bit(b7, 16) && bit(b7, 17) && bit(b7, 28) &&
                bit(b7, 30) && bit(b7, 31);
  f.avx512_bf16 = f.x86_64_v4 && bit(a7_1, 5);
  f.avx512_vnni = f.x86_64_v4 && bit(c7, 11);
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

/// Whether this CPU runs the variant, and if not, what it lacks.
bool supported(std::string_view name, std::string* missing = nullptr) {
  const CpuFeatures& f = features();
  auto need = [&](bool have, const char* what) {
    if (!have && missing) *missing = what;
    return have;
  };
  if (name == "generic") return true;
  if (name == "sse4") return need(f.x86_64_v2, "SSE4.2 and POPCNT (x86-64-v2)");
  if (name == "avx2")
    return need(f.x86_64_v3, "AVX2, FMA and F16C with the OS saving ymm registers (x86-64-v3)");
  if (name == "avx512")
    return need(f.x86_64_v4,
                "AVX-512 F, BW, CD, DQ and VL with the OS saving zmm registers (x86-64-v4)");
  if (name == "avx512bf16")
    return need(f.x86_64_v4, "AVX-512 (x86-64-v4)") &&
           need(f.avx512_bf16, "AVX512-BF16") && need(f.avx512_vnni, "AVX512-VNNI");
  if (missing) *missing = "a variant of this name";
  return false;
}

std::string variant_names() {
  std::string s;
  for (const Variant& v : kVariants) s += (s.empty() ? "" : ", ") + std::string(v.name);
  return s;
}

/// The variant DIFFATTN_ISA names (which must be compiled in and supported),
/// or else the most capable supported one.
const Variant& select(const char* requested) {
  if (requested && *requested) {
    for (const Variant& v : kVariants) {
      if (std::strcmp(v.name, requested) != 0) continue;
      std::string missing;
      if (!supported(v.name, &missing))
        throw diffattn::error(std::string("diffattn::dispatch: DIFFATTN_ISA=") + requested +
                              ", but this CPU (or its operating system) lacks " + missing);
      return v;
    }
    throw diffattn::error(std::string("diffattn::dispatch: DIFFATTN_ISA=") + requested +
                          " is not a variant of this library (compiled in: " + variant_names() +
                          ")");
  }
  for (int i = kVariantCount - 1; i > 0; --i)
    if (supported(kVariants[i].name)) return kVariants[i];
  return kVariants[0];
}

const Variant& selected() {
  // Thread-safe, once; a throw leaves it unset, so every call reports the error.
  static const Variant& v = select(std::getenv("DIFFATTN_ISA"));
  return v;
}

#ifdef DIFFATTN_DISPATCH_BF16_PROBE
constexpr int kProbeChains = 12;  // independent accumulators, as bench's peak probes
constexpr long kProbeRounds = 20000;

/// Seconds since t0, after the chains' sum is stored where the compiler must
/// keep it (so that the timed loop is not removed).
__attribute__((target("avx512f"))) double seconds_since(
    std::chrono::steady_clock::time_point t0, const __m512 (&c)[kProbeChains]) {
  __m512 s = c[0];
  for (int j = 1; j < kProbeChains; ++j) s = _mm512_add_ps(s, c[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  volatile float sink = lanes[0];
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Seconds for kProbeRounds rounds of kProbeChains zmm vdpbf16ps (64 flops each).
__attribute__((target("avx512f,avx512bf16"))) double bf16_dot_seconds() {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-20f), _mm512_set1_ps(0x1p-20f));
  __m512 c[kProbeChains];
  for (auto& x : c) x = _mm512_set1_ps(0.5f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kProbeRounds; ++i)
    for (auto& x : c) x = _mm512_dpbf16_ps(x, a, b);
  return seconds_since(t0, c);
}

/// Seconds for kProbeRounds rounds of kProbeChains zmm FMAs (32 flops each).
__attribute__((target("avx512f,fma"))) double fma_seconds() {
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0x1p-20f);
  __m512 c[kProbeChains];
  for (auto& x : c) x = _mm512_set1_ps(0.5f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kProbeRounds; ++i)
    for (auto& x : c) x = _mm512_fmadd_ps(a, b, x);
  return seconds_since(t0, c);
}

/// Whether this CPU's bf16 dot products do at least as many flops a second as
/// its float FMAs (best of 3 alternated runs of each, about 1 ms in all; called
/// only where AVX512-BF16 runs). Zen 5 ran 12 chains of vdpbf16ps at 1.84x the
/// flops of 12 chains of FMA; an Intel Xeon of the Sapphire Rapids class
/// (Emerald Rapids) at 0.46x, where the bf16 kernels ran 0.67-0.78x as fast as
/// float and the avx512 variant's, which widen bfloat16 to float, faster.
bool bf16_dot_pays() {
  double tb = 1e30, tf = 1e30;
  for (int r = 0; r < 3; ++r) {
    tb = std::min(tb, bf16_dot_seconds());
    tf = std::min(tf, fma_seconds());
  }
  return 64.0 / tb >= 32.0 / tf;
}
#else
bool bf16_dot_pays() { return true; }
#endif

/// The variant of the kernels whose q and k are bfloat16 (the forward with
/// bfloat16 q, k and v, the bfloat16 backward, a projection of bfloat16 x
/// by bfloat16 W): the selected one, except where
/// it was selected without DIFFATTN_ISA as avx512bf16 and this CPU's bf16 dot
/// products are slower than its float FMAs (bf16_dot_pays): then avx512.
const Variant& selected_bf16() {
  static const Variant& v = []() -> const Variant& {
    const Variant& s = selected();
    const char* env = std::getenv("DIFFATTN_ISA");
    if ((env && *env) || std::strcmp(s.name, "avx512bf16") != 0) return s;
    for (const Variant& w : kVariants)
      if (std::strcmp(w.name, "avx512") == 0) return bf16_dot_pays() ? s : w;
    return s;
  }();
  return v;
}

template <class T, class KV>
const Variant& variant_for() {
  if constexpr (std::is_same<T, diffattn::bfloat16>::value &&
                std::is_same<KV, diffattn::bfloat16>::value)
    return selected_bf16();
  else
    return selected();
}

}  // namespace
}  // namespace diffattn_dispatch

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

#define DIFFATTN_DEFINE_FORWARD(T, KV)                                                     \
  void dispatch_attention(const AttentionProblem<T, KV>& p, const AttentionOptions& options) { \
    using namespace diffattn_dispatch;                                                     \
    reinterpret_cast<ForwardFn<T, KV>>(                                                   \
        variant_for<T, KV>().forward[forward_slot<T, KV>()])(p, options);                   \
  }
DIFFATTN_FORWARD_STORAGE(DIFFATTN_DEFINE_FORWARD)
#undef DIFFATTN_DEFINE_FORWARD

#define DIFFATTN_DEFINE_BACKWARD(T)                                                          \
  void dispatch_attention_backward(const BackwardProblem<T>& bp,                             \
                                   const AttentionOptions& options) {                        \
    using namespace diffattn_dispatch;                                                       \
    reinterpret_cast<BackwardFn<T>>(variant_for<T, T>().backward[backward_slot<T>()])(bp, options); \
  }
DIFFATTN_BACKWARD_STORAGE(DIFFATTN_DEFINE_BACKWARD)
#undef DIFFATTN_DEFINE_BACKWARD

// A projection takes bf16 dot products, where its variant has them, when x
// and W are both bfloat16: it runs where the bfloat16 kernels do.
#define DIFFATTN_DEFINE_LINEAR(SX, SW, SY)                                                    \
  void dispatch_linear(const SX* x, index_t rows, index_t in, const SW* w, index_t out, SY* y, \
                       int threads) {                                                         \
    using namespace diffattn_dispatch;                                                        \
    reinterpret_cast<LinearFn<SX, SW, SY>>(                                                   \
        variant_for<SX, SW>().linear[linear_slot<SX, SW, SY>()])(x, rows, in, w, out, y,       \
                                                                threads);                     \
  }
DIFFATTN_LINEAR_STORAGE(DIFFATTN_DEFINE_LINEAR)
#undef DIFFATTN_DEFINE_LINEAR

#define DIFFATTN_DEFINE_LINEAR_BACKWARD(T)                                                     \
  void dispatch_linear_backward(const T* x, index_t rows, index_t in, const T* w, index_t out, \
                                const T* dy, T* dw, T* dx, bool accumulate_dx, int threads) {  \
    using namespace diffattn_dispatch;                                                         \
    reinterpret_cast<LinearBackwardFn<T>>(selected().linear[linear_backward_slot<T>()])(       \
        x, rows, in, w, out, dy, dw, dx, accumulate_dx, threads);                              \
  }
DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_DEFINE_LINEAR_BACKWARD)
#undef DIFFATTN_DEFINE_LINEAR_BACKWARD

// The analysis runs the fused kernel's block task: where the forward of T runs.
#define DIFFATTN_DEFINE_ANALYSIS(T)                                                            \
  void dispatch_analysis(const AttentionProblem<T, T>& p, const AnalysisSpec& spec,            \
                         const AttentionOptions& options, double* flat) {                      \
    using namespace diffattn_dispatch;                                                         \
    reinterpret_cast<AnalysisFn<T>>(variant_for<T, T>().analysis[analysis_slot<T>()])(         \
        p, spec, options, flat);                                                               \
  }
DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_DEFINE_ANALYSIS)
#undef DIFFATTN_DEFINE_ANALYSIS

const char* dispatch_isa() { return diffattn_dispatch::selected().name; }

const char* dispatch_bf16_isa() { return diffattn_dispatch::selected_bf16().name; }

std::vector<std::string_view> dispatch_variants() {
  std::vector<std::string_view> names;
  for (const auto& v : diffattn_dispatch::kVariants) names.emplace_back(v.name);
  return names;
}

bool dispatch_supported(std::string_view name) {
  for (const auto& v : diffattn_dispatch::kVariants)
    if (name == v.name) return diffattn_dispatch::supported(name);
  return false;
}

std::string dispatch_check(std::string_view name) {
  return diffattn_dispatch::select(std::string(name).c_str()).name;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
