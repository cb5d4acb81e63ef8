// Dense products of the layers' projections, on the kernels' micro-kernel and
// threads: y = x W^T and its backward (dW += dy^T x, dx = dy W).
//
// Eigen's products would pick their own thread count; inference engines that
// run their own thread pools need the count they ask for, and bitwise equal
// results for any count. Each task owns a block of kBlockM output rows and
// accumulates over the depth in a fixed order.
//
// x, W and y may each be stored as bfloat16 or half (a 16-bit layer): the
// product then runs in float, each element widened once where it is packed (W
// into panels, a block of x rows into the block buffer) and each result
// rounded once where it is written, so a 16-bit W is never widened whole.
//
// When x and W are both bfloat16 and the build targets AVX512-BF16, the
// products run on bf16 dot products instead (vdpbf16ps, as Q K^T and W V do:
// bf16_dot.hpp): W packed into panels of bf16 pairs (its own bytes, no
// slabs), x's rows read as pairs, float accumulators. Every product of two
// bf16 is exact in float, so y is a float sum of the same exact terms in
// another order: |y^ - y| <= gamma_in sum_t |x_t w_t| as on the float path
// (plus the instruction's flush of bf16 denormals, terms below 2^-126). A
// bfloat16 y is that sum rounded once.
#pragma once

#include <algorithm>
#include <type_traits>

#include <Eigen/Core>

#include "../../config.hpp"
#include "../../types.hpp"
#include "../core/parallel.hpp"
#include "../core/workspace.hpp"
#include "../kernel/bf16_dot.hpp"
#include "../kernel/convert.hpp"
#include "../kernel/dispatch.hpp"
#include "../kernel/gemm.hpp"
#include "../kernel/tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct LinearWorkspace {
  ScratchBuffer<T> b;       // packed B, shared read-only by the workers (caller's thread)
  ScratchBuffer<T> a;       // a block of A rows, zero-padded   (kBlockM, k)
  ScratchBuffer<T> c;       // the block's C                     (kBlockM, n padded)
  ScratchBuffer<T> at;      // A^T for dW                        (n_out, rows)
  ScratchBuffer<T> wide_x;  // few rows of a 16-bit x, widened (rows, k)
  ScratchBuffer<T> wide_w;  // one 16-bit W row, widened       (k)
  void trim() {
    ScratchBuffer<T>* all[] = {&b, &a, &c, &at, &wide_x, &wide_w};
    std::size_t total = 0;
    for (auto* x : all) total += x->bytes();
    if (total > Workspace<T>::kRetainBytes)
      for (auto* x : all) x->release();
  }
};

template <class T>
inline LinearWorkspace<T>& thread_linear_workspace() {
  static thread_local LinearWorkspace<T> ws;
  return ws;
}

/// C (m, n) (+)= A (m, k) B. A row-major with leading dimension lda; B packed
/// in column panels (panel p at bp + p * k * kNR, row t at + t * kNR); C
/// row-major with leading dimension ldc. A and C may be stored narrower than
/// T (SA, SC: bfloat16 or half): A's rows are widened as they are copied into
/// the block buffer, C's rounded once as they are written.
template <class T, class SA, class SC>
void gemm_packed_b(index_t m, index_t n, index_t k, const SA* a, index_t lda, const T* bp, SC* c,
                   index_t ldc, bool accumulate, int threads) {
  using Cfg = TileConfig<T>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM;
  // Depth chunk: a kNR-wide panel slice (kKC x kNR, 16 KiB for 256 floats x 16)
  // stays in L1 while the block's 10 register tiles consume it.
  constexpr index_t kKC = 256;
  const index_t npad = round_up(n, NR), blocks = (m + BM - 1) / BM;
  if (m == 0 || n == 0) return;
  auto run_block = [&](index_t blk) {
    LinearWorkspace<T>& ws = thread_linear_workspace<T>();
    const index_t i0 = blk * BM, rows = std::min(BM, m - i0), rows_pad = round_up(rows, MR);
    T* ab = ws.a.get(std::max<index_t>(rows_pad * k, 1));
    for (index_t r = 0; r < rows; ++r) convert_row(a + (i0 + r) * lda, k, ab + r * k);
    std::fill(ab + rows * k, ab + rows_pad * k, T(0));
    T* cb = ws.c.get(rows_pad * npad);
    std::fill(cb, cb + rows_pad * npad, T(0));
    for (index_t k0 = 0; k0 < k; k0 += kKC) {
      const index_t depth = std::min(kKC, k - k0);
      for (index_t p0 = 0; p0 < npad; p0 += NR) {
        const T* panel = bp + p0 * k + k0 * NR;
        for (index_t r0 = 0; r0 < rows_pad; r0 += MR)
          micro_kernel<T>(depth, ab + r0 * k + k0, k, panel, NR, cb + r0 * npad + p0, npad, true);
      }
    }
    for (index_t r = 0; r < rows; ++r) {
      SC* dst = c + (i0 + r) * ldc;
      const T* src = cb + r * npad;
      if (accumulate)
        for (index_t j = 0; j < n; ++j) dst[j] = static_cast<SC>(static_cast<T>(dst[j]) + src[j]);
      else
        convert_row(src, n, dst);
    }
  };
  parallel_tasks(blocks, std::min<int>(threads, static_cast<int>(blocks)), run_block,
                 [] { thread_linear_workspace<T>().trim(); });
}

#if defined(__AVX512BF16__)
/// Words of bf16 pairs per row of a bfloat16 matrix of `in` columns, rounded
/// up to whole 64-byte lines so that the A rows of the register tile stay
/// aligned.
inline index_t linear_pair_stride(index_t in) { return round_up(bf16_pairs(in), index_t(16)); }

/// No epilogue: linear_bf16_packed's default.
struct LinearNoEpilogue {
  void operator()(float*, index_t) const noexcept {}
};

/// y (rows, out) = x W^T on bf16 dot products: x and W bfloat16, y any
/// storage with float compute. W is packed into pair panels once (in
/// parallel), then each task takes kBlockM rows of x as pairs and runs the
/// bf16 register tile over depth chunks of kKC / 2 pairs. epi(row, r) sees
/// each finished float row r (out values) before it is written to y.
template <class SY, class Epi = LinearNoEpilogue>
void linear_bf16_packed(const bfloat16* x, index_t rows, index_t in, const bfloat16* w, index_t out,
                        SY* y, int nt, const Epi& epi = Epi()) {
  using Cfg = TileConfig<float>;
  constexpr index_t MR = Cfg::kMR, NR = Cfg::kNR, BM = Cfg::kBlockM;
  constexpr index_t kKCPairs = 128;  // 256 elements: the float path's depth chunk
  const index_t pairs = bf16_pairs(in), npad = round_up(out, NR), lda = linear_pair_stride(in);
  LinearWorkspace<float>& main_ws = thread_linear_workspace<float>();
  // Pair panels of W: npad x pairs words, the bytes of W itself (as floats:
  // one word each).
  std::uint32_t* bp = reinterpret_cast<std::uint32_t*>(main_ws.b.get(npad * pairs));
  parallel_tasks(
      npad / NR, nt,
      [&](index_t p) {
        const index_t o0 = p * NR;
        pack_pairs_transposed_from(StridedRows<bfloat16>{w + o0 * in, in}, std::min(NR, out - o0),
                                   in, bp + o0 * pairs);
      },
      [] {});
  const index_t blocks = (rows + BM - 1) / BM;
  parallel_tasks(
      blocks, std::min<int>(nt, static_cast<int>(blocks)),
      [&](index_t blk) {
        LinearWorkspace<float>& ws = thread_linear_workspace<float>();
        const index_t i0 = blk * BM, nrows = std::min(BM, rows - i0),
                      rows_pad = round_up(nrows, MR);
        std::uint32_t* ab = reinterpret_cast<std::uint32_t*>(ws.a.get(rows_pad * lda));
        for (index_t r = 0; r < nrows; ++r) pack_query_pairs(x + (i0 + r) * in, in, ab + r * lda);
        std::fill(ab + nrows * lda, ab + rows_pad * lda, 0u);
        // The first depth chunk stores its sums (times 1), the others add to
        // them: no zero fill of the block (a sum from +0 accumulators is
        // never -0, so the bits are those of adding to zeros).
        float* cb = ws.c.get(rows_pad * npad);
        if (pairs == 0) std::fill(cb, cb + rows_pad * npad, 0.0f);
        for (index_t k0 = 0; k0 < pairs; k0 += kKCPairs) {
          const index_t depth = std::min(kKCPairs, pairs - k0);
          for (index_t p0 = 0; p0 < npad; p0 += NR) {
            const std::uint32_t* panel = bp + p0 * pairs + k0 * NR;
            for (index_t r0 = 0; r0 < rows_pad; r0 += MR) {
              float* c = cb + r0 * npad + p0;
              if (k0 == 0)
                micro_kernel_bf16_tile<false>(depth, ab + r0 * lda, lda, panel, c, npad, 1.0f);
              else
                micro_kernel_bf16_tile<true>(depth, ab + r0 * lda + k0, lda, panel, c, npad, 1.0f);
            }
          }
        }
        for (index_t r = 0; r < nrows; ++r) {
          epi(cb + r * npad, i0 + r);
          convert_row(cb + r * npad, out, y + (i0 + r) * out);
        }
      },
      [] { thread_linear_workspace<float>().trim(); });
}

/// sum_t a_t b_t over n bfloat16 values on bf16 dot products (32 a step, the
/// tail with masked loads: zeros are exact).
inline float dot_bf16(const bfloat16* a, const bfloat16* b, index_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  index_t t = 0;
  for (; t + 64 <= n; t += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + t),
                            (__m512bh)_mm512_loadu_si512(b + t));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + t + 32),
                            (__m512bh)_mm512_loadu_si512(b + t + 32));
  }
  for (; t < n; t += 32) {
    const index_t left = std::min<index_t>(32, n - t);
    const __mmask32 m = static_cast<__mmask32>((std::uint64_t(1) << left) - 1);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m, a + t),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, b + t));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

/// Outputs per slab of a 16-bit W packed into float panels: 4 MiB of panels
/// (1024 outputs at in = 1024), at least one panel. Re-reading the block of x
/// rows once per slab costs 1 / slab of the products.
template <class T>
constexpr index_t linear_slab_outputs(index_t in) {
  constexpr index_t kSlabBytes = index_t(4) << 20, NR = TileConfig<T>::kNR;
  const index_t slab = kSlabBytes / static_cast<index_t>(sizeof(T)) / std::max<index_t>(in, 1);
  return std::max(NR, slab / NR * NR);
}

/// linear's products in this translation unit, for its instruction set.
template <class SX, class SW, class SY>
void linear_kernel(const SX* x, index_t rows, index_t in, const SW* w, index_t out, SY* y,
                   int threads) {
  using T = compute_t<SW>;
  static_assert(std::is_same<compute_t<SX>, T>::value && std::is_same<compute_t<SY>, T>::value,
                "linear: x, W and y compute in one type (float for bfloat16 / half)");
  constexpr index_t NR = TileConfig<T>::kNR;
  constexpr index_t kOutBlock = 64;
  // Below this many rows the dot products beat packing W (measured with
  // bench_linear at 1024 x 1024: equal near 96 rows).
  constexpr index_t kDotRows = 96;
  if (rows == 0 || out == 0) return;
  const double work =
      static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
#if defined(__AVX512BF16__)
  if constexpr (kHasBf16Dot && std::is_same<SX, bfloat16>::value &&
                std::is_same<SW, bfloat16>::value) {
    if (rows < kDotRows) {
      // Few rows: dot products of x's rows with W's, both read in place.
      const index_t blocks = (out + kOutBlock - 1) / kOutBlock;
      parallel_tasks(
          blocks, resolve_threads(threads, blocks, work),
          [&](index_t blk) {
            for (index_t o = blk * kOutBlock; o < std::min(out, (blk + 1) * kOutBlock); ++o)
              for (index_t r = 0; r < rows; ++r)
                y[r * out + o] = static_cast<SY>(dot_bf16(x + r * in, w + o * in, in));
          },
          [] {});
    } else {
      linear_bf16_packed(x, rows, in, w, out, y, resolve_threads(threads, rows, work));
    }
    return;
  }
#endif
  if (rows < kDotRows) {
    // Few rows (decoding): packing W would cost more than the product. Dot
    // products against W's contiguous rows, threads over blocks of outputs.
    // A 16-bit x is widened once for all tasks, a 16-bit W row by the task
    // that owns it, once; the dot products are then the float ones.
    using Row = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
    const T* xc = nullptr;
    if constexpr (std::is_same<SX, T>::value)
      xc = x;
    else
      xc = row_as<T>(x, rows * in, thread_linear_workspace<T>().wide_x.get(rows * in));
    const index_t blocks = (out + kOutBlock - 1) / kOutBlock;
    parallel_tasks(
        blocks, resolve_threads(threads, blocks, work),
        [&](index_t blk) {
          T* wbuf = nullptr;
          if constexpr (!std::is_same<SW, T>::value)
            wbuf = thread_linear_workspace<T>().wide_w.get(in);
          for (index_t o = blk * kOutBlock; o < std::min(out, (blk + 1) * kOutBlock); ++o) {
            const Row wo(row_as<T>(w + o * in, in, wbuf), in);
            for (index_t r = 0; r < rows; ++r)
              y[r * out + o] = static_cast<SY>(Row(xc + r * in, in).dot(wo));
          }
        },
        [] {});
    if constexpr (!std::is_same<SX, T>::value || !std::is_same<SW, T>::value)
      thread_linear_workspace<T>().trim();
    return;
  }
  const int nt = resolve_threads(threads, rows, work);
  // B = W^T in panels of kNR outputs, packed in parallel. A 16-bit W is
  // widened here, a slab of outputs at a time: panels of the whole W in float
  // would take twice W's own bytes. Each output still sums over the depth in
  // the same order, so slabs change no bit of y.
  const index_t slab = std::is_same<SW, T>::value ? out : linear_slab_outputs<T>(in);
  for (index_t s0 = 0; s0 < out; s0 += slab) {
    const index_t ns = std::min(slab, out - s0);
    T* bp = thread_linear_workspace<T>().b.get(round_up(ns, NR) * in);
    parallel_tasks(
        round_up(ns, NR) / NR, nt,
        [&](index_t p) {
          const index_t o0 = p * NR;
          pack_rows_transposed(w + (s0 + o0) * in, in, std::min(NR, ns - o0), in, bp + o0 * in);
        },
        [] {});
    gemm_packed_b(rows, ns, in, x, in, bp, y + s0, out, false, nt);
  }
}

#if defined(__AVX512BF16__)
/// linear on bf16 dot products (x and W bfloat16, an AVX512-BF16 build) with
/// epi(row, r) applied to each float output row r (out values) before it is
/// rounded once to y: a per-row step fused into the product (a bfloat16
/// layer's rotary), without a float copy of y.
template <class SY, class Epi>
void linear_bf16_rows(const bfloat16* x, index_t rows, index_t in, const bfloat16* w, index_t out,
                      SY* y, int threads, const Epi& epi) {
  constexpr index_t kDotRows = 96;  // as linear's
  if (rows == 0 || out == 0) return;
  if (rows < kDotRows) {  // few rows: linear's dot products into float, then the rows
    float* f = thread_linear_workspace<float>().wide_x.get(rows * out);
    linear_kernel(x, rows, in, w, out, f, threads);
    for (index_t r = 0; r < rows; ++r) {
      epi(f + r * out, r);
      convert_row(f + r * out, out, y + r * out);
    }
    thread_linear_workspace<float>().trim();
    return;
  }
  const double work =
      static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  linear_bf16_packed(x, rows, in, w, out, y, resolve_threads(threads, rows, work), epi);
}
#endif

/// y (rows, out) = x (rows, in) W^T, W (out, in): nn.Linear without bias.
/// threads: 0 means the OpenMP default. x, W and y are float or double, or
/// bfloat16 / half with float products (all three share compute_t). Runs
/// here, for this unit's instruction set, or (DIFFATTN_DISPATCH, for the
/// storage triples of DIFFATTN_LINEAR_STORAGE) in diffattn::dispatch's
/// variant for this CPU: a layer in a build without -march then projects at
/// the speed of the CPU, not of SSE2.
template <class SX, class SW, class SY>
void linear(const SX* x, index_t rows, index_t in, const SW* w, index_t out, SY* y,
            int threads = 0) {
#ifdef DIFFATTN_DISPATCH
  if constexpr (linear_dispatched<SX, SW, SY>()) {
    dispatch_linear(x, rows, in, w, out, y, threads);
    return;
  }
#endif
  linear_kernel(x, rows, in, w, out, y, threads);
}

/// linear_backward's products in this translation unit.
template <class T>
void linear_backward_kernel(const T* x, index_t rows, index_t in, const T* w, index_t out,
                            const T* dy, T* dw, T* dx, bool accumulate_dx, int threads) {
  constexpr index_t NR = TileConfig<T>::kNR;
  LinearWorkspace<T>& ws = thread_linear_workspace<T>();
  const double work =
      static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  if (dx != nullptr) {
    const int nt = resolve_threads(threads, std::max<index_t>(rows, 1), work);
    T* bp = ws.b.get(std::max<index_t>(round_up(in, NR) * out, 1));
    pack_cols(w, in, out, in, bp);  // B = W (out, in)
    gemm_packed_b(rows, in, out, dy, out, bp, dx, in, accumulate_dx, nt);
  }
  // dW = dy^T x: A = dy^T (out, rows), B = x (rows, in).
  const int nt = resolve_threads(threads, std::max<index_t>(out, 1), work);
  T* at = ws.at.get(std::max<index_t>(out * rows, 1));
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) at[o * rows + r] = dy[r * out + o];
  T* bp = ws.b.get(std::max<index_t>(round_up(in, NR) * rows, 1));
  pack_cols(x, in, rows, in, bp);
  gemm_packed_b(out, in, rows, at, rows, bp, dw, in, true, nt);
}

/// Backward of linear: dw (out, in) += dy^T x and dx (rows, in) = dy W (or +=
/// when accumulate_dx: an input that feeds several projections). dx may be
/// null. Where it runs: as linear's.
template <class T>
void linear_backward(const T* x, index_t rows, index_t in, const T* w, index_t out, const T* dy,
                     T* dw, T* dx, bool accumulate_dx, int threads = 0) {
#ifdef DIFFATTN_DISPATCH
  if constexpr (linear_backward_dispatched<T>()) {
    dispatch_linear_backward(x, rows, in, w, out, dy, dw, dx, accumulate_dx, threads);
    return;
  }
#endif
  linear_backward_kernel(x, rows, in, w, out, dy, dw, dx, accumulate_dx, threads);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
