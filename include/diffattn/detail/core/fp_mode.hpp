// The floating-point mode the kernels' tasks run in: denormals flushed.
//
// A float whose magnitude is below 2^-126 (a denormal, or subnormal) costs
// x86 cores a microcode assist where an instruction takes or makes one: about
// 100 cycles for one FMA on an Emerald Rapids Xeon against half a cycle. The
// kernels make them where attention is peaked: exp(s - max) lies in
// (2^-150, 2^-126) for s - max in (-104, -87.3), and the backward's dS =
// P (dP - D) and the products taking P then take them as inputs. With scores
// of standard deviation 30 (trained models reach logits of 40 to 300), a V2
// forward at N = 2048 ran 13x and its backward 62x slower than on N(0, 1)
// scores on that Xeon (docs/kernels.md, "Denormals"). So each task runs with
// MXCSR's FTZ (flush-to-zero: a denormal result becomes 0) and DAZ
// (denormals-are-zero: a denormal input reads as 0), as TensorFlow's CPU
// kernels run, and the thread's mode is put back after it, so that the
// caller's own code never sees it. Each flushed term is below 2^-126 times
// the other factor: far below the float rounding of any sum it joins.
// DIFFATTN_FLUSH_DENORMALS=0 keeps the caller's mode (config.hpp).
#pragma once

#include "../../config.hpp"

#if DIFFATTN_FLUSH_DENORMALS && (defined(__SSE2__) || defined(_M_X64))
#include <xmmintrin.h>
#define DIFFATTN_DETAIL_FLUSH_MXCSR 1
#else
#define DIFFATTN_DETAIL_FLUSH_MXCSR 0
#endif

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6).
constexpr unsigned kMxcsrFlushDenormals = 0x8040u;

/// Sets FTZ and DAZ on this thread for its lifetime and then puts back the
/// thread's own setting of those two bits, keeping the exception flags the
/// work raised (underflow among them, where a result was flushed). Nothing
/// where DIFFATTN_FLUSH_DENORMALS is 0 or the target is not x86.
class DenormalsFlushed {
 public:
  DenormalsFlushed() noexcept {
#if DIFFATTN_DETAIL_FLUSH_MXCSR
    const unsigned csr = _mm_getcsr();
    saved_ = csr & kMxcsrFlushDenormals;
    if (saved_ != kMxcsrFlushDenormals) _mm_setcsr(csr | kMxcsrFlushDenormals);
#endif
  }
  ~DenormalsFlushed() {
#if DIFFATTN_DETAIL_FLUSH_MXCSR
    if (saved_ != kMxcsrFlushDenormals)
      _mm_setcsr((_mm_getcsr() & ~kMxcsrFlushDenormals) | saved_);
#endif
  }
  DenormalsFlushed(const DenormalsFlushed&) = delete;
  DenormalsFlushed& operator=(const DenormalsFlushed&) = delete;

 private:
  unsigned saved_ = 0;  // the thread's own FTZ and DAZ bits
};

/// The mode of code that keeps the caller's floating-point mode (the
/// float64 reference: IEEE gradual underflow as written).
struct CallerFpMode {};

}  // namespace detail
DIFFATTN_END_NAMESPACE
