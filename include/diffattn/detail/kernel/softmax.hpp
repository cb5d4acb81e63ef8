// Row softmax pieces shared by the public softmax and the fused kernels.
//
// A row is processed in two steps so that kernels can fold the normalisation
// into later arithmetic: exp_row() leaves exp(x - max) in place and returns the
// row's max and sum; lse = max + log(sum). Special rows:
//   - every entry -inf (fully masked): the row becomes zeros, max = -inf, sum = 0;
//   - some entries +inf: those share the mass equally, the rest get 0;
//   - a NaN anywhere makes the whole row NaN (it never leaks into other rows).
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

#if defined(__AVX512F__)
/// exp of 16 floats for the bf16 dot-product kernels' rows (x = s - max or
/// s - lse, at most 0): 2^n 2^f with n = x log2(e) rounded to nearest, f =
/// x log2(e) - n in [-1/2, 1/2] reduced in two steps (log2(e) split into a
/// float and the float of its remainder, so that f keeps its accuracy up to
/// |x| = 104), 2^f by a polynomial of degree 5 (Horner), and the scaling by
/// 2^n by one vscalefps: 11 operations where Eigen's pexp (cephes: exp(r) of
/// degree 7, clamps and pldexp) takes about 26 and the degree-7 polynomial
/// with vscalefps 15. Relative error at most 2^-21 where exp(x) is a normal
/// float (the polynomial's own error, 2^-22.5 on [-1/2, 1/2] as fitted for
/// relative error with its constant term 1, so that exp(0) = 1 exactly, and
/// the rounding of its five FMAs; tests/test_half.cpp). Below -104
/// (-inf included) the result is 0 (exp underflows float there); NaN stays
/// NaN. On Zen 5 the bf16 forwards ran 2-5% faster than with the degree-7
/// polynomial (bench_half, N = 2048, 2 threads, best of 20 runs each).
EIGEN_ALWAYS_INLINE __m512 exp_scalef(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // a NaN x is the result (second operand)
  const __m512 log2e_hi = _mm512_set1_ps(1.44269502162933349609375f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e_hi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmadd_ps(x, _mm512_set1_ps(1.925963033500011e-08f),
                                   _mm512_fmsub_ps(x, log2e_hi, n));
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.326472731307149e-3f), f,
                             _mm512_set1_ps(9.671512991189957e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550733581185341e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022242426872253e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931470036506653e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

/// True when exp_shift_sum<T, true> runs exp_scalef.
template <class T>
constexpr bool kHasExpScalef =
#if defined(__AVX512F__)
    std::is_same<T, float>::value;
#else
    false;
#endif

template <class T>
struct RowStats {
  T max;  // row maximum (-inf for a fully masked row)
  T sum;  // sum of exp(x - max) over the row (0 for a fully masked row)
};

template <class T>
inline T row_max(const T* x, index_t n) {
  if (n == 0) return -std::numeric_limits<T>::infinity();
  return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(x, n).maxCoeff();
}

/// x <- exp(x - m) over n entries, m finite; returns the sum. One pass: the
/// shift, Eigen's vectorised exp and the running sum per packet, so each score
/// is loaded and stored once (on a machine with two FMA units per core these
/// passes over the score rows, not the products, are what limits the kernels).
///
/// Scalef (float under AVX-512, kHasExpScalef): exp_scalef in place of pexp,
/// for the bf16 dot-product kernels; everything else keeps pexp, bit for bit.
template <class T, bool Scalef = false>
inline T exp_shift_sum(T* x, index_t n, T m) {
#if defined(__AVX512F__)
  if constexpr (Scalef && kHasExpScalef<T>) {
    const __m512 pm = _mm512_set1_ps(m);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    index_t j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512 e0 = exp_scalef(_mm512_sub_ps(_mm512_loadu_ps(x + j), pm));
      const __m512 e1 = exp_scalef(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), pm));
      _mm512_storeu_ps(x + j, e0);
      _mm512_storeu_ps(x + j + 16, e1);
      acc0 = _mm512_add_ps(acc0, e0);
      acc1 = _mm512_add_ps(acc1, e1);
    }
    for (; j < n; j += 16) {  // the last 1 to 31 entries, 16 at a time under a mask
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp_scalef(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), pm));
      _mm512_mask_storeu_ps(x + j, k, e);
      acc0 = _mm512_add_ps(acc0, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr index_t P = Eigen::internal::packet_traits<T>::size;
  using namespace Eigen::internal;  // NOLINT: Eigen's packet vocabulary
  const Packet pm = pset1<Packet>(m);
  Packet acc0 = pset1<Packet>(T(0)), acc1 = acc0;
  index_t j = 0;
  for (; j + 2 * P <= n; j += 2 * P) {
    const Packet e0 = pexp(psub(ploadu<Packet>(x + j), pm));
    const Packet e1 = pexp(psub(ploadu<Packet>(x + j + P), pm));
    pstoreu(x + j, e0);
    pstoreu(x + j + P, e1);
    acc0 = padd(acc0, e0);
    acc1 = padd(acc1, e1);
  }
  T sum = predux(padd(acc0, acc1));
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

/// exp_shift_sum for a row whose masked entries are -inf: they become exactly
/// 0 (a vectorised exp(-inf) may return a denormal), in the same single
/// vectorised pass.
template <class T>
inline T exp_shift_sum_masked(T* x, index_t n, T m) {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr index_t P = Eigen::internal::packet_traits<T>::size;
  using namespace Eigen::internal;  // NOLINT: Eigen's packet vocabulary
  const Packet pm = pset1<Packet>(m), ninf = pset1<Packet>(-std::numeric_limits<T>::infinity());
  const Packet zero = pset1<Packet>(T(0));
  Packet acc = zero;
  index_t j = 0;
  for (; j + P <= n; j += P) {
    const Packet v = ploadu<Packet>(x + j);
    const Packet e = pselect(pcmp_eq(v, ninf), zero, pexp(psub(v, pm)));
    pstoreu(x + j, e);
    acc = padd(acc, e);
  }
  T sum = predux(acc);
  for (; j < n; ++j) {
    x[j] = x[j] == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}

/// In-place exp(x - max) of one row; see the header comment for special rows.
/// When the row may hold -inf entries (an explicit mask), pass has_masked = true
/// so that they become exactly 0 (a vectorised exp(-inf) may return a denormal).
/// Scalef: exp_shift_sum<T, true> for the row's exponentials (bf16 kernels).
template <class T, bool Scalef = false>
inline RowStats<T> exp_row(T* x, index_t n, bool has_masked) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  T m = row_max(x, n);
  bool has_nan = false;
  if (std::isnan(m) || !std::isfinite(m)) {
    // Eigen's maxCoeff may skip NaN: look for it before giving up on the row.
    for (index_t j = 0; j < n; ++j) has_nan = has_nan || std::isnan(x[j]);
  }
  if (has_nan) {
    for (index_t j = 0; j < n; ++j) x[j] = std::numeric_limits<T>::quiet_NaN();
    return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::quiet_NaN()};
  }
  if (m == -inf) {  // fully masked
    for (index_t j = 0; j < n; ++j) x[j] = T(0);
    return {m, T(0)};
  }
  if (m == inf) {  // the +inf entries share the mass
    T count = 0;
    for (index_t j = 0; j < n; ++j) {
      x[j] = x[j] == inf ? T(1) : T(0);
      count += x[j];
    }
    return {m, count};
  }
  if (!has_masked) return {m, exp_shift_sum<T, Scalef>(x, n, m)};
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> a(x, n);
  a -= m;
  a = (a == -inf).select(T(0), a.exp());
  return {m, a.sum()};
}

/// exp_row for rows with -inf entries (masked pairs), vectorised: the same
/// special rows as exp_row (NaN, all masked, +inf).
template <class T>
inline RowStats<T> exp_row_masked(T* x, index_t n) {
  const T m = row_max(x, n);
  if (std::isfinite(m)) return {m, exp_shift_sum_masked(x, n, m)};
  return exp_row(x, n, true);
}

/// log-sum-exp from RowStats: -inf for a fully masked row.
template <class T>
inline T row_lse(const RowStats<T>& s) {
  if (s.sum == T(0)) return -std::numeric_limits<T>::infinity();
  return s.max + std::log(s.sum);
}

/// A row's normaliser and lse with one more logit, `sink`, in its denominator
/// and not in its output (attention sinks): weights = exp(x - max) * scale.
template <class T>
struct SinkNorm {
  T scale;
  T lse;
};

/// From the RowStats of exp_row: a row that sees no key gets scale 0 and
/// lse = sink; a NaN row stays NaN. Computed in the frame of the larger of
/// max and sink, so neither exp overflows.
template <class T>
inline SinkNorm<T> sink_norm(const RowStats<T>& st, T sink) {
  if (std::isnan(st.max) || std::isnan(st.sum))
    return {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::quiet_NaN()};
  if (st.sum == T(0)) return {T(0), sink};
  if (st.max >= sink) {
    const T den = st.sum + std::exp(sink - st.max);
    return {T(1) / den, st.max + std::log(den)};
  }
  const T e = std::exp(st.max - sink), den = st.sum * e + T(1);
  return {e / den, sink + std::log(den)};
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
