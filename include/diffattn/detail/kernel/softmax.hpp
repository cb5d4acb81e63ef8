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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// log2(e) as a float and the float of its remainder.
constexpr float kLog2eHi = 1.44269502162933349609375f, kLog2eLo = 1.925963033500011e-08f;
/// 2^f on [-1/2, 1/2], constant term 1: the coefficients of f^5 down to f (relative error
/// 2^-22.5 as rounded to floats), and of f^6 down to f (2^-28.9).
constexpr float kExp2Degree5[] = {1.326472731307149e-3f, 9.671512991189957e-3f,
                                  5.550733581185341e-2f, 2.4022242426872253e-1f,
                                  6.931470036506653e-1f};
constexpr float kExp2Degree6[] = {1.5353361959569156e-4f, 1.3398875016719103e-3f,
                                  9.61843691766262e-3f,   5.5503323674201965e-2f,
                                  2.4022647738456726e-1f, 6.931471824645996e-1f};

#if defined(__AVX512F__)
/// exp of 16 floats by vscalefps, for the kernels' rows (x = s - max or s -
/// lse, at most 0): 2^n 2^f with n = x log2(e) rounded to nearest, f =
/// x log2(e) - n in [-1/2, 1/2] reduced in two steps (log2(e) split into a
/// float and the float of its remainder, so that f keeps its accuracy up to
/// |x| = 104), 2^f by a polynomial of degree Degree (Horner, constant term 1,
/// so that exp(0) = 1 exactly; fitted for relative error), and the scaling by
/// 2^n by one vscalefps. Below -104 (-inf included) the result is 0 (exp
/// underflows float there); NaN stays NaN.
///
/// Degree 6 (the float kernels, 12 operations): at most 1.2 ulp where exp(x)
/// is a normal float (every float x in [-87, 0] checked against the double
/// exp; the polynomial's own error is 2^-28.9), where Eigen's pexp (cephes:
/// clamps, a polynomial of degree 7 and pldexp, about 26 operations) reaches
/// 4.5 ulp near -87. On an Emerald Rapids Xeon pexp took a quarter of the
/// float forward's time.
///
/// Degree 5 (the bf16 dot-product kernels and 8-bit caches, 11 operations):
/// relative error at most 2^-21 (the polynomial's 2^-22.5 and the rounding of
/// its five FMAs; tests/test_half.cpp), far below bfloat16's or an 8-bit
/// cache's own rounding. On Zen 5 the bf16 forwards ran 2-5% faster than with
/// a degree-7 polynomial (bench_half, N = 2048, 2 threads, best of 20 runs
/// each).
template <int Degree = 5>
EIGEN_ALWAYS_INLINE __m512 exp_scalef(__m512 x) {
  static_assert(Degree == 5 || Degree == 6, "exp_scalef: degree 5 or 6");
  const float* c = Degree == 5 ? kExp2Degree5 : kExp2Degree6;
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // a NaN x is the result (second operand)
  const __m512 log2e_hi = _mm512_set1_ps(kLog2eHi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e_hi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f =
      _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2eLo), _mm512_fmsub_ps(x, log2e_hi, n));
  __m512 y = _mm512_set1_ps(c[0]);
  for (int i = 1; i < Degree; ++i) y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c[i]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/// The float kernels' exp of 8 floats under AVX2 + FMA (no vscalefps): the
/// reduction and the degree-6 polynomial of exp_scalef<6>, and 2^n as the
/// float whose exponent field is n + 127, multiplied in: 15 operations where
/// pexp takes about 25. x is clamped to -88 first, so that n >= -127; n =
/// -127 gives the field 0, the float 0, and the result 0 exactly (-inf
/// included), below about -87.7, where exp(x) is a denormal at most 2^-126.
/// Between there and -87.3 the result is a denormal, as it should be. At
/// most 1.2 ulp where exp(x) is a normal float, as exp_scalef<6>; NaN stays
/// NaN. For x <= 0, as the kernels' rows are.
EIGEN_ALWAYS_INLINE __m256 exp_fma256(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-88.0f), x);  // a NaN x is the result (second operand)
  const __m256 log2e_hi = _mm256_set1_ps(kLog2eHi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e_hi),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f =
      _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2eLo), _mm256_fmsub_ps(x, log2e_hi, n));
  __m256 y = _mm256_set1_ps(kExp2Degree6[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2Degree6[i]));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

/// The float kernels' exp of a packet: exp_scalef<6> (AVX-512), exp_fma256
/// (AVX2 + FMA), Eigen's pexp elsewhere and for double.
template <class Packet>
EIGEN_ALWAYS_INLINE Packet exp_packet(const Packet& x) {
  return Eigen::internal::pexp(x);
}
#if defined(__AVX512F__)
EIGEN_ALWAYS_INLINE __m512 exp_packet(const __m512& x) { return exp_scalef<6>(x); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
EIGEN_ALWAYS_INLINE __m256 exp_packet(const __m256& x) { return exp_fma256(x); }
#endif

/// True when the rows' exps run exp_scalef (float under AVX-512): degree 6 in
/// the float kernels, degree 5 in exp_shift_sum<T, true>.
template <class T>
constexpr bool kHasExpScalef =
#if defined(__AVX512F__)
    std::is_same<T, float>::value;
#else
    false;
#endif
/// True when the float kernels' exps run exp_scalef<6> or exp_fma256 (float
/// under AVX-512, or AVX2 + FMA), not Eigen's pexp.
template <class T>
constexpr bool kHasFastExp =
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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
/// shift, the vectorised exp and the running sum per packet, so each score
/// is loaded and stored once (on a machine with two FMA units per core these
/// passes over the score rows, not the products, are what limits the kernels).
///
/// Float under AVX-512 (kHasExpScalef): exp_scalef in place of Eigen's pexp,
/// of degree 6, or of degree 5 with Scalef (the bf16 dot-product kernels and
/// 8-bit caches). Elsewhere exp_packet: exp_fma256 for float under AVX2 + FMA,
/// pexp otherwise.
template <class T, bool Scalef = false>
inline T exp_shift_sum(T* x, index_t n, T m) {
#if defined(__AVX512F__)
  if constexpr (kHasExpScalef<T>) {
    constexpr int kDegree = Scalef ? 5 : 6;
    const __m512 pm = _mm512_set1_ps(m);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    index_t j = 0;
    for (; j + 32 <= n; j += 32) {
      const __m512 e0 = exp_scalef<kDegree>(_mm512_sub_ps(_mm512_loadu_ps(x + j), pm));
      const __m512 e1 = exp_scalef<kDegree>(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), pm));
      _mm512_storeu_ps(x + j, e0);
      _mm512_storeu_ps(x + j + 16, e1);
      acc0 = _mm512_add_ps(acc0, e0);
      acc1 = _mm512_add_ps(acc1, e1);
    }
    for (; j < n; j += 16) {  // the last 1 to 31 entries, 16 at a time under a mask
      const __mmask16 k = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
      const __m512 e = exp_scalef<kDegree>(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), pm));
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
    const Packet e0 = exp_packet(psub(ploadu<Packet>(x + j), pm));
    const Packet e1 = exp_packet(psub(ploadu<Packet>(x + j + P), pm));
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
/// 0 (pexp(-inf) may return a denormal; exp_scalef and exp_fma256 return 0),
/// in the same single vectorised pass.
template <class T>
inline T exp_shift_sum_masked(T* x, index_t n, T m) {
  if constexpr (kHasExpScalef<T>) return exp_shift_sum(x, n, m);
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  constexpr index_t P = Eigen::internal::packet_traits<T>::size;
  using namespace Eigen::internal;  // NOLINT: Eigen's packet vocabulary
  const Packet pm = pset1<Packet>(m), ninf = pset1<Packet>(-std::numeric_limits<T>::infinity());
  const Packet zero = pset1<Packet>(T(0));
  Packet acc = zero;
  index_t j = 0;
  for (; j + P <= n; j += P) {
    const Packet v = ploadu<Packet>(x + j);
    const Packet e = pselect(pcmp_eq(v, ninf), zero, exp_packet(psub(v, pm)));
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
/// so that they become exactly 0 (Eigen's pexp(-inf) may return a denormal).
/// Scalef: exp_shift_sum<T, true> (degree 5) for the row's exponentials (bf16
/// kernels, 8-bit caches).
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
  return {m, exp_shift_sum_masked(x, n, m)};
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
