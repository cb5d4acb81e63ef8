// Dense products of the layers' projections, on the kernels' micro-kernel and
// threads: y = x W^T and its backward (dW += dy^T x, dx = dy W).
//
// Eigen's products would pick their own thread count; inference engines that
// run their own thread pools need the count they ask for, and bitwise equal
// results for any count. Each task owns a block of kBlockM output rows and
// accumulates over the depth in a fixed order.
#pragma once

#include <algorithm>
#include <cstring>

#include <Eigen/Core>

#include "../config.hpp"
#include "gemm.hpp"
#include "parallel.hpp"
#include "tile.hpp"
#include "workspace.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct LinearWorkspace {
  ScratchBuffer<T> b;   // packed B, shared read-only by the workers (caller's thread)
  ScratchBuffer<T> a;   // a block of A rows, zero-padded   (kBlockM, k)
  ScratchBuffer<T> c;   // the block's C                     (kBlockM, n padded)
  ScratchBuffer<T> at;  // A^T for dW                        (n_out, rows)
  void trim() {
    ScratchBuffer<T>* all[] = {&b, &a, &c, &at};
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
/// row-major with leading dimension ldc.
template <class T>
void gemm_packed_b(index_t m, index_t n, index_t k, const T* a, index_t lda, const T* bp, T* c,
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
    for (index_t r = 0; r < rows; ++r)
      std::memcpy(ab + r * k, a + (i0 + r) * lda, static_cast<std::size_t>(k) * sizeof(T));
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
      T* dst = c + (i0 + r) * ldc;
      const T* src = cb + r * npad;
      if (accumulate)
        for (index_t j = 0; j < n; ++j) dst[j] += src[j];
      else
        std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
    }
  };
  parallel_tasks(blocks, std::min<int>(threads, static_cast<int>(blocks)), run_block,
                 [] { thread_linear_workspace<T>().trim(); });
}

/// y (rows, out) = x (rows, in) W^T, W (out, in): nn.Linear without bias.
/// threads: 0 means the OpenMP default.
template <class T>
void linear(const T* x, index_t rows, index_t in, const T* w, index_t out, T* y, int threads = 0) {
  constexpr index_t NR = TileConfig<T>::kNR;
  constexpr index_t kOutBlock = 64;
  // Below this many rows the dot products beat packing W (measured with
  // bench_linear at 1024 x 1024: equal near 96 rows).
  constexpr index_t kDotRows = 96;
  if (rows == 0 || out == 0) return;
  if (rows < kDotRows) {
    // Few rows (decoding): packing W would cost more than the product. Dot
    // products against W's contiguous rows, threads over blocks of outputs.
    using Row = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
    const index_t blocks = (out + kOutBlock - 1) / kOutBlock;
    parallel_tasks(
        blocks, resolve_threads(threads, blocks),
        [&](index_t blk) {
          for (index_t o = blk * kOutBlock; o < std::min(out, (blk + 1) * kOutBlock); ++o) {
            const Row wo(w + o * in, in);
            for (index_t r = 0; r < rows; ++r) y[r * out + o] = Row(x + r * in, in).dot(wo);
          }
        },
        [] {});
    return;
  }
  const index_t npad = round_up(out, NR);
  const int nt = resolve_threads(threads, rows);
  T* bp = thread_linear_workspace<T>().b.get(npad * in);
  // B = W^T in panels of kNR outputs, packed in parallel.
  parallel_tasks(
      npad / NR, nt,
      [&](index_t p) {
        const index_t o0 = p * NR;
        pack_rows_transposed(w + o0 * in, in, std::min(NR, out - o0), in, bp + o0 * in);
      },
      [] {});
  gemm_packed_b(rows, out, in, x, in, bp, y, out, false, nt);
}

/// Backward of linear: dw (out, in) += dy^T x and dx (rows, in) = dy W (or +=
/// when accumulate_dx: an input that feeds several projections). dx may be null.
template <class T>
void linear_backward(const T* x, index_t rows, index_t in, const T* w, index_t out, const T* dy,
                     T* dw, T* dx, bool accumulate_dx, int threads = 0) {
  constexpr index_t NR = TileConfig<T>::kNR;
  LinearWorkspace<T>& ws = thread_linear_workspace<T>();
  if (dx != nullptr) {
    const int nt = resolve_threads(threads, std::max<index_t>(rows, 1));
    T* bp = ws.b.get(std::max<index_t>(round_up(in, NR) * out, 1));
    pack_cols(w, in, out, in, bp);  // B = W (out, in)
    gemm_packed_b(rows, in, out, dy, out, bp, dx, in, accumulate_dx, nt);
  }
  // dW = dy^T x: A = dy^T (out, rows), B = x (rows, in).
  const int nt = resolve_threads(threads, std::max<index_t>(out, 1));
  T* at = ws.at.get(std::max<index_t>(out * rows, 1));
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) at[o * rows + r] = dy[r * out + o];
  T* bp = ws.b.get(std::max<index_t>(round_up(in, NR) * rows, 1));
  pack_cols(x, in, rows, in, bp);
  gemm_packed_b(out, in, rows, at, rows, bp, dw, in, true, nt);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
