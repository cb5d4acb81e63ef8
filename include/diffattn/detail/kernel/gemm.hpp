// Register-tiled micro-kernel and packing for the two products of a block:
// scores S = (s Q) K^T and output O = W V.
//
// Both are C (kMR x kNR) += A (kMR x depth) B (depth x kNR): A rows are read in
// place (row-major, one scalar broadcast per row and step), B rows are kNR
// contiguous, packet-aligned elements: a packed panel, or a row-major buffer
// whose leading dimension is a multiple of kNR.
#pragma once

#include <algorithm>
#include <cstring>

#include <Eigen/Core>

#include "../../config.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// C[r, 0:kNR] (+)= sum_t A[r, t] B[t, 0:kNR] for r < kMR.
/// a: row r at a + r * lda, contiguous in t; b: row t at b + t * ldb, aligned to
/// a packet; c: row r at c + r * ldc. accumulate adds to C.
template <class T>
inline void micro_kernel(index_t depth, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                         index_t ldc, bool accumulate) {
  using Cfg = TileConfig<T>;
  using Packet = typename Cfg::Packet;
  using Eigen::internal::pload;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = Cfg::kPacket;
  static_assert(Cfg::kMR == 6, "the micro-kernel is unrolled for 6 rows");

  const T* a0 = a;
  const T* a1 = a + lda;
  const T* a2 = a + 2 * lda;
  const T* a3 = a + 3 * lda;
  const T* a4 = a + 4 * lda;
  const T* a5 = a + 5 * lda;
  Packet c00 = pset1<Packet>(T(0)), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  Packet c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (index_t t = 0; t < depth; ++t) {
    const Packet b0 = pload<Packet>(b);
    const Packet b1 = pload<Packet>(b + P);
    b += ldb;
    Packet x = pset1<Packet>(a0[t]);
    c00 = pmadd(x, b0, c00);
    c01 = pmadd(x, b1, c01);
    x = pset1<Packet>(a1[t]);
    c10 = pmadd(x, b0, c10);
    c11 = pmadd(x, b1, c11);
    x = pset1<Packet>(a2[t]);
    c20 = pmadd(x, b0, c20);
    c21 = pmadd(x, b1, c21);
    x = pset1<Packet>(a3[t]);
    c30 = pmadd(x, b0, c30);
    c31 = pmadd(x, b1, c31);
    x = pset1<Packet>(a4[t]);
    c40 = pmadd(x, b0, c40);
    c41 = pmadd(x, b1, c41);
    x = pset1<Packet>(a5[t]);
    c50 = pmadd(x, b0, c50);
    c51 = pmadd(x, b1, c51);
  }
  const Packet acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < 6; ++r) {
    T* cr = c + r * ldc;
    if (accumulate) {
      pstoreu(cr, Eigen::internal::padd(ploadu<Packet>(cr), acc[r][0]));
      pstoreu(cr + P, Eigen::internal::padd(ploadu<Packet>(cr + P), acc[r][1]));
    } else {
      pstoreu(cr, acc[r][0]);
      pstoreu(cr + P, acc[r][1]);
    }
  }
}

/// Rows fetched ahead while packing.
constexpr index_t kPrefetchRows = 4;

/// Hints that the `width` elements at p will be read soon: Locality 3 into
/// every cache level (L1 on), 1 into L2 and beyond, 0 non-temporal
/// (prefetchnta).
///
/// Always inlined: GCC 12 at -O3 left it out of line in the decoding step
/// and, its interprocedural mod/ref analysis finding no side effect, deleted
/// the calls, so the step ran without any prefetch.
template <int Locality = 3, class T>
EIGEN_ALWAYS_INLINE void prefetch_row(const T* p, index_t width) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = reinterpret_cast<const char*>(p);
  const index_t bytes = width * static_cast<index_t>(sizeof(T));
  for (index_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, Locality);
#else
  (void)p;
  (void)width;
#endif
}

/// Rows of a strided matrix: row r at base + r * ld. The row source of the
/// packing functions for a contiguous key or value range; a paged cache gives
/// another (one pointer per row, through its block table).
template <class T>
struct StridedRows {
  const T* base;
  index_t ld;
  const T* operator()(index_t r) const noexcept { return base + r * ld; }
};

/// Packs rows [0, rows) of an (rows x width) source, row r at row(r), into
/// panels of kNR rows each stored transposed: panel p holds
/// dst[p * width * kNR + t * kNR + c] = row(p * kNR + c)[t]; rows from `rows`
/// up to the next multiple of kNR are zero. Used for K: one panel is the B
/// operand of S = Q K^T for kNR keys. The source may be stored narrower than
/// T (a 16-bit cache under float panels): each element is converted once,
/// here. row(r) is a pointer, or any row with operator[] (an 8-bit row with
/// its scale, quant.hpp's QuantRow) for which prefetch_row is declared.
template <class T, class Rows>
inline void pack_rows_transposed_from(const Rows& row_of, index_t rows, index_t width, T* dst) {
  constexpr index_t nr = TileConfig<T>::kNR;
  const index_t padded = round_up(rows, nr);
  for (index_t p0 = 0; p0 < padded; p0 += nr) {
    T* panel = dst + p0 * width;
    for (index_t c = 0; c < nr; ++c) {
      const index_t j = p0 + c;
      if (j < rows) {
        const auto row = row_of(j);
        // Rows of a strided K lie far apart (one kv head among many), beyond
        // what the hardware prefetcher follows: ask for a row a few ahead.
        if (j + kPrefetchRows < rows) prefetch_row(row_of(j + kPrefetchRows), width);
        for (index_t t = 0; t < width; ++t) panel[t * nr + c] = static_cast<T>(row[t]);
      } else {
        for (index_t t = 0; t < width; ++t) panel[t * nr + c] = T(0);
      }
    }
  }
}

/// pack_rows_transposed_from for rows at src + r * ld.
template <class S, class T>
inline void pack_rows_transposed(const S* src, index_t ld, index_t rows, index_t width, T* dst) {
  pack_rows_transposed_from(StridedRows<S>{src, ld}, rows, width, dst);
}

/// Packs a (rows x width) source, row r at row(r), into column panels of kNR
/// columns: panel c holds dst[c * rows * kNR + r * kNR + cc] =
/// row(r)[c * kNR + cc], zero beyond `width`. Used for V: one panel is the B
/// operand of O = W V for kNR output features. As for the keys, a narrower
/// source is converted here, element by element in a fixed-size loop.
template <class T, class Rows>
inline void pack_cols_from(const Rows& row_of, index_t rows, index_t width, T* dst) {
  constexpr index_t nr = TileConfig<T>::kNR;
  const index_t panels = round_up(width, nr) / nr;
  for (index_t c = 0; c < panels; ++c) {
    T* panel = dst + c * rows * nr;
    const index_t c0 = c * nr;
    const index_t n = std::min(nr, width - c0);
    for (index_t r = 0; r < rows; ++r) {
      const auto row = row_of(r) + c0;
      T* out = panel + r * nr;
      if (r + kPrefetchRows < rows) prefetch_row(row_of(r + kPrefetchRows) + c0, n);
      if (n == nr) {  // a whole panel row: a fixed-size copy the compiler inlines
        for (index_t cc = 0; cc < nr; ++cc) out[cc] = static_cast<T>(row[cc]);
      } else {
        for (index_t cc = 0; cc < n; ++cc) out[cc] = static_cast<T>(row[cc]);
        for (index_t cc = n; cc < nr; ++cc) out[cc] = T(0);
      }
    }
  }
}

/// pack_cols_from for rows at src + r * ld.
template <class S, class T>
inline void pack_cols(const S* src, index_t ld, index_t rows, index_t width, T* dst) {
  pack_cols_from(StridedRows<S>{src, ld}, rows, width, dst);
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
