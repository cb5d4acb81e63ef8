/// \file
/// quantize_rows: rows of keys or values to 8-bit storage (std::int8_t,
/// float8_e4m3) with one float scale per row, as the 8-bit KV caches hold them.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/traits.hpp"
#include "detail/core/validate.hpp"
#include "detail/decode/quant.hpp"
#include "detail/kernel/convert.hpp"
#include "float8.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// quantize_rows of any rank R >= 2: the rows are src's last extent.
template <class S, class Q, std::size_t R>
void quantize_rows_impl(const TensorView<const S, R>& src, const TensorView<Q, R>& dst,
                        const TensorView<float, R - 1>& scale) {
  static_assert(std::is_same<S, float>::value || is_half_storage_v<S>,
                "quantize_rows: src holds float, bfloat16 or half");
  static_assert(is_8bit_storage_v<Q>, "quantize_rows: dst holds std::int8_t or float8_e4m3");
  constexpr const char* fn = "quantize_rows";
  check_head_contiguous(fn, "src", src);
  check_head_contiguous(fn, "dst", dst);
  if (dst.shape() != src.shape())
    fail(fn, "dst has shape ", shape_str(dst.shape()), ", expected src's ", shape_str(src.shape()));
  std::array<index_t, R - 1> want{};
  for (std::size_t i = 0; i + 1 < R; ++i) want[i] = src.shape(i);
  if (scale.shape() != want)
    fail(fn, "scale has shape ", shape_str(scale.shape()), ", expected src ",
         shape_str(src.shape()), " without its last extent: ", shape_str(want));
  if (ranges_overlap(dst, scale))
    fail(fn, "dst ", shape_str(dst.shape()), " and scale ", shape_str(scale.shape()),
         " overlap in memory");
  if (src.empty()) return;

  const index_t d = src.shape(R - 1), rows = src.size() / d;
  // Row r's offsets: its index over the leading extents, last fastest.
  auto offset = [&](index_t r, const auto& strides, std::size_t rank) {
    index_t off = 0;
    for (std::size_t i = rank; i-- > 0;) {
      off += (r % want[i]) * strides[i];
      r /= want[i];
    }
    return off;
  };
  std::vector<float> buf(static_cast<std::size_t>(d));
  auto row_of = [&](index_t r) {
    return row_as<float>(src.data() + offset(r, src.strides(), R - 1), d, buf.data());
  };
  // Every value first, so that bad input leaves dst and scale as they were.
  for (index_t r = 0; r < rows; ++r) {
    const float* x = row_of(r);
    for (index_t t = 0; t < d; ++t)
      if (!std::isfinite(x[t])) {
        std::array<index_t, R> at{};
        index_t rest = r;
        for (std::size_t i = R - 1; i-- > 0;) {
          at[i] = rest % want[i];
          rest /= want[i];
        }
        at[R - 1] = t;
        fail(fn, "src ", shape_str(src.shape()), " holds ", x[t], " at ", shape_str(at),
             ": only finite values have a scale");
      }
  }
  for (index_t r = 0; r < rows; ++r)
    scale.data()[offset(r, scale.strides(), R - 1)] =
        quantize_row<Q>(row_of(r), d, dst.data() + offset(r, dst.strides(), R - 1));
}

}  // namespace detail

/// \ingroup storage
/// Quantizes rows to 8-bit storage with one float scale per row, as the 8-bit
/// KV caches hold keys and values:
///   src (.., H, d) float, bfloat16 or half (any strides, rows contiguous),
///   dst (.., H, d) std::int8_t or float8_e4m3 (same shape),
///   scale (.., H) float: src's shape without its last extent.
/// Ranks 2, 3 and 4: (H, d), (N, H, d) or (B, N, H, d); call with the types,
/// quantize_rows<float, std::int8_t>(src, dst, scale).
///
/// Row x gets scale = max |x| / 127 (int8) or max |x| / 448 (float8_e4m3),
/// 0 for a zero row, and stored values q = x / scale rounded to nearest:
/// int8 ties to even within [-127, 127], e4m3 to nearest even, saturating at
/// 448. Dequantized, x^ = scale q: |x - x^| <= scale / 2 (int8, up to float
/// rounding of x / scale), and for e4m3 |x - x^| <= 2^-4 |x| where |x| / scale
/// is normal (>= 2^-6), <= 2^-10 scale below. Vectorised with AVX-512.
///
/// Throws diffattn::error, writing nothing, for mismatched shapes, rows not
/// contiguous, or a value that is not finite (a row's scale must be).
template <class S, class Q>
void quantize_rows(detail::nondeduced_view<const S, 4> src, detail::nondeduced_view<Q, 4> dst,
                   detail::nondeduced_view<float, 3> scale) {
  detail::quantize_rows_impl<S, Q, 4>(src, dst, scale);
}
/// \ingroup storage
/// quantize_rows over (N, H, d) rows: scale (N, H).
template <class S, class Q>
void quantize_rows(detail::nondeduced_view<const S, 3> src, detail::nondeduced_view<Q, 3> dst,
                   detail::nondeduced_view<float, 2> scale) {
  detail::quantize_rows_impl<S, Q, 3>(src, dst, scale);
}
/// \ingroup storage
/// quantize_rows over (H, d) rows: scale (H).
template <class S, class Q>
void quantize_rows(detail::nondeduced_view<const S, 2> src, detail::nondeduced_view<Q, 2> dst,
                   detail::nondeduced_view<float, 1> scale) {
  detail::quantize_rows_impl<S, Q, 2>(src, dst, scale);
}

DIFFATTN_END_NAMESPACE
