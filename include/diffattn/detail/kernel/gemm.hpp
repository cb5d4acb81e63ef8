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
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../../config.hpp"
#include "tile.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Calls f(std::integral_constant<int, I>{}) for I = 0 .. N-1, unrolled: the
/// rows of a register tile, named by constants so that the tile stays in
/// registers.
template <int... I, class F>
EIGEN_ALWAYS_INLINE void static_for_impl(std::integer_sequence<int, I...>, F&& f) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
EIGEN_ALWAYS_INLINE void static_for(F&& f) {
  static_for_impl(std::make_integer_sequence<int, N>{}, f);
}

/// The register tile of every micro-kernel: C[r][h] = sum_t a_r[t] (x) B[t][h]
/// for rows r < 6, the two packets h of a B row, and t < depth, where a_r is
/// row r of A at a + r * lda and B row t starts at b + t * ldb; then
/// store(r, C[r][0], C[r][1]) for each row. Ops gives the element type:
/// load(p) a B packet, bcast(e) an A element spread over a packet,
/// madd(x, y, acc) the product added to acc (a float FMA, or a bfloat16 pair
/// dot product on a word of two bf16). The accumulators are locals named by
/// constants, so they stay in registers (6 x 2 and the two B packets: 14 of
/// 16 ymm or 32 zmm registers); a caller's array would be stored to memory on
/// every step, since A's loads might alias it.
template <class Ops, class Elem, class Store>
EIGEN_ALWAYS_INLINE void register_tile(index_t depth, const Elem* a, index_t lda, const Elem* b,
                                       index_t ldb, Store&& store) {
  constexpr int P = Ops::kPacket;
  using Acc = decltype(Ops::zero());
  const Elem* rows[6];
  Acc acc[6][2];
  static_for<6>([&](auto r) {
    rows[r] = a + r * lda;
    acc[r][0] = acc[r][1] = Ops::zero();
  });
  for (index_t t = 0; t < depth; ++t) {
    const auto b0 = Ops::load(b);
    const auto b1 = Ops::load(b + P);
    b += ldb;
    static_for<6>([&](auto r) {
      const auto x = Ops::bcast(rows[r][t]);
      acc[r][0] = Ops::madd(x, b0, acc[r][0]);
      acc[r][1] = Ops::madd(x, b1, acc[r][1]);
    });
  }
  static_for<6>([&](auto r) { store(static_cast<int>(r), acc[r][0], acc[r][1]); });
}

/// Float (or double) FMAs on Eigen packets: the ops of micro_kernel's tile.
template <class T>
struct PacketFma {
  using Packet = typename TileConfig<T>::Packet;
  static constexpr int kPacket = TileConfig<T>::kPacket;
  static EIGEN_ALWAYS_INLINE Packet zero() { return Eigen::internal::pset1<Packet>(T(0)); }
  static EIGEN_ALWAYS_INLINE Packet load(const T* p) { return Eigen::internal::pload<Packet>(p); }
  static EIGEN_ALWAYS_INLINE Packet bcast(T e) { return Eigen::internal::pset1<Packet>(e); }
  static EIGEN_ALWAYS_INLINE Packet madd(Packet x, Packet y, Packet c) {
    return Eigen::internal::pmadd(x, y, c);
  }
};

/// C[r, 0:kNR] (+)= sum_t A[r, t] B[t, 0:kNR] for r < kMR.
/// a: row r at a + r * lda, contiguous in t; b: row t at b + t * ldb, aligned to
/// a packet; c: row r at c + r * ldc. accumulate adds to C.
template <class T>
inline void micro_kernel(index_t depth, const T* a, index_t lda, const T* b, index_t ldb, T* c,
                         index_t ldc, bool accumulate) {
  using Cfg = TileConfig<T>;
  using Packet = typename Cfg::Packet;
  using Eigen::internal::ploadu;
  using Eigen::internal::pstoreu;
  constexpr int P = Cfg::kPacket;
  static_assert(Cfg::kMR == 6, "the micro-kernel's register tile has 6 rows");
  register_tile<PacketFma<T>>(depth, a, lda, b, ldb, [&](int r, Packet c0, Packet c1) {
    T* cr = c + r * ldc;
    if (accumulate) {
      c0 = Eigen::internal::padd(ploadu<Packet>(cr), c0);
      c1 = Eigen::internal::padd(ploadu<Packet>(cr + P), c1);
    }
    pstoreu(cr, c0);
    pstoreu(cr + P, c1);
  });
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
