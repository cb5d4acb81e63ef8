/// \file
/// TensorView (non-owning, strided) and Tensor (owning, contiguous, aligned).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/memory.hpp"
#include "error.hpp"

DIFFATTN_BEGIN_NAMESPACE

namespace detail {

/// a * b, or false when it would overflow index_t (both non-negative).
inline bool mul_ok(index_t a, index_t b, index_t& out) {
  if (a != 0 && b > std::numeric_limits<index_t>::max() / a) return false;
  out = a * b;
  return true;
}

/// Number of elements of a shape; throws when an extent is negative or the
/// product (or its size in bytes) does not fit in index_t.
template <std::size_t R>
index_t checked_size(const char* fn, const std::array<index_t, R>& shape, std::size_t elem_bytes) {
  index_t n = 1;
  for (std::size_t i = 0; i < R; ++i) {
    if (shape[i] < 0) fail(fn, "negative extent ", shape[i], " in shape ", shape_str(shape));
  }
  for (std::size_t i = 0; i < R; ++i) {
    if (!mul_ok(n, shape[i], n))
      fail(fn, "the extents of shape ", shape_str(shape), " overflow index_t");
  }
  index_t bytes = 0;
  if (!mul_ok(n, static_cast<index_t>(elem_bytes), bytes))
    fail(fn, "shape ", shape_str(shape), " is too large to address in bytes");
  return n;
}

template <std::size_t R>
std::array<index_t, R> row_major_strides(const std::array<index_t, R>& shape) {
  // Saturating: an empty view may have huge other extents, and its strides
  // are never used to address anything.
  std::array<index_t, R> s{};
  index_t acc = 1;
  for (std::size_t i = R; i-- > 0;) {
    s[i] = acc;
    if (!mul_ok(acc, shape[i] > 0 ? shape[i] : 1, acc)) acc = std::numeric_limits<index_t>::max();
  }
  return s;
}

}  // namespace detail

/// \ingroup basics
/// Non-owning view of a rank-R tensor with arbitrary non-negative strides
/// (counted in elements, mdspan's layout_stride). Cheap to copy; never owns.
///
/// Constructing a view checks that extents and strides are non-negative and that
/// the largest offset fits in index_t; it throws diffattn::error otherwise.
template <class T, std::size_t R>
class TensorView {
  static_assert(R >= 1, "TensorView needs rank >= 1");

 public:
  /// The element type as given (const T for a read-only view).
  using element_type = T;
  /// The element type without const.
  using value_type = std::remove_cv_t<T>;
  /// Extents or strides: one index_t per dimension.
  using shape_type = std::array<index_t, R>;
  /// The rank R.
  static constexpr std::size_t rank_v = R;

  /// An empty view: null data, all extents zero.
  TensorView() noexcept : data_(nullptr), shape_{}, strides_{} {}

  /// Row-major view over `shape`.
  TensorView(T* data, const shape_type& shape) : data_(data), shape_(shape), strides_{} {
    detail::checked_size("TensorView", shape_, sizeof(T));  // before the strides multiply extents
    strides_ = detail::row_major_strides(shape_);
    check_data();
  }

  /// Strided view; strides in elements, each >= 0.
  TensorView(T* data, const shape_type& shape, const shape_type& strides)
      : data_(data), shape_(shape), strides_(strides) {
    detail::checked_size("TensorView", shape_, sizeof(T));
    index_t span = 0;
    for (std::size_t i = 0; i < R; ++i) {
      if (strides_[i] < 0)
        detail::fail("TensorView", "negative stride ", strides_[i], " in strides ",
                     detail::shape_str(strides_), " for shape ", detail::shape_str(shape_));
      index_t term = 0;
      if (shape_[i] > 0 && (!detail::mul_ok(shape_[i] - 1, strides_[i], term) ||
                            span > std::numeric_limits<index_t>::max() - term))
        detail::fail("TensorView", "strides ", detail::shape_str(strides_), " with shape ",
                     detail::shape_str(shape_), " overflow index_t");
      span += term;
    }
    check_data();
  }

  /// A view of T converts to a view of const T.
  template <class U,
            class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_same<U, T>::value>>
  TensorView(const TensorView<U, R>& other) noexcept  // NOLINT: implicit on purpose
      : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  /// The element at index (0, ..., 0); null for a default-constructed view.
  T* data() const noexcept { return data_; }
  /// The extents.
  const shape_type& shape() const noexcept { return shape_; }
  /// Extent of dimension i (i < R, unchecked).
  index_t shape(std::size_t i) const noexcept { return shape_[i]; }
  /// The strides, in elements.
  const shape_type& strides() const noexcept { return strides_; }
  /// Stride of dimension i, in elements (i < R, unchecked).
  index_t stride(std::size_t i) const noexcept { return strides_[i]; }
  /// mdspan spelling of shape(i).
  index_t extent(std::size_t i) const noexcept { return shape_[i]; }
  /// The rank R.
  static constexpr std::size_t rank() noexcept { return R; }

  /// Number of elements (product of the extents).
  index_t size() const noexcept {
    for (index_t e : shape_)
      if (e == 0) return 0;  // other extents may be huge: never multiply them
    index_t n = 1;
    for (index_t e : shape_) n *= e;
    return n;
  }
  /// True when some extent is 0.
  bool empty() const noexcept { return size() == 0; }

  /// True when the strides are the row-major strides of the shape (extents
  /// of 0 or 1 accept any stride).
  bool is_contiguous() const noexcept {
    if (empty()) return true;  // (and its extents' product may not fit in index_t)
    index_t acc = 1;
    for (std::size_t i = R; i-- > 0;) {
      if (shape_[i] > 1 && strides_[i] != acc) return false;
      acc *= shape_[i];
    }
    return true;
  }

  /// Element access. Indices are checked by DIFFATTN_ASSERT only (debug
  /// builds, or a DIFFATTN_ASSERT the program defines), never in release.
  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) == R, "TensorView::operator(): wrong number of indices");
    const index_t ii[R] = {static_cast<index_t>(idx)...};
    index_t off = 0;
    for (std::size_t r = 0; r < R; ++r) {
      DIFFATTN_ASSERT(ii[r] >= 0 && ii[r] < shape_[r]);
      off += ii[r] * strides_[r];
    }
    return data_[off];
  }

  /// Lowest and one-past-highest address the view can touch, as integers
  /// (equal when empty). Integers, not pointers: a view's span is only a
  /// promise about memory it may not own, and pointer arithmetic past an
  /// object is undefined.
  std::uintptr_t span_begin() const noexcept { return reinterpret_cast<std::uintptr_t>(data_); }
  /// One past the highest byte the view can touch, as an integer (see span_begin()).
  std::uintptr_t span_end() const noexcept {
    if (empty()) return span_begin();
    std::uintptr_t last = 0;
    for (std::size_t r = 0; r < R; ++r)
      last += static_cast<std::uintptr_t>(shape_[r] - 1) * static_cast<std::uintptr_t>(strides_[r]);
    return span_begin() + (last + 1) * sizeof(T);
  }

 private:
  void check_data() const {
    if (data_ == nullptr && size() != 0)
      detail::fail("TensorView", "null data with non-empty shape ", detail::shape_str(shape_));
  }

  T* data_;
  shape_type shape_;
  shape_type strides_;
};

/// \ingroup basics
/// Owning, contiguous (row-major), 64-byte aligned, zero-initialised tensor;
/// a buffer of 1 MiB or more (a KV cache, say) starts on a 4 KiB page, so that
/// its rows of a power-of-two size up to 4 KiB start on a multiple of their
/// size; one of 2 MiB or more starts on a huge page and asks Linux for
/// transparent huge pages (one page fault per 2 MiB instead of 512). Copies
/// are deep; moves are cheap.
template <class T, std::size_t R>
class Tensor {
  static_assert(std::is_trivially_copyable<T>::value, "Tensor holds trivially copyable scalars");

 public:
  /// Extents: one index_t per dimension.
  using shape_type = std::array<index_t, R>;
  /// Alignment of every buffer; of a buffer of page_aligned_bytes or more, page_alignment.
  static constexpr std::size_t alignment = 64;
  /// Alignment of a buffer of page_aligned_bytes or more (a 4 KiB page).
  static constexpr std::size_t page_alignment = 4096;
  /// Size from which a buffer is page-aligned (1 MiB).
  static constexpr std::size_t page_aligned_bytes = std::size_t(1) << 20;

  /// An empty tensor: no buffer, all extents zero.
  Tensor() noexcept : shape_{} {}

  /// A zero-filled tensor of `shape`; throws diffattn::error for a negative
  /// extent or a size in bytes that overflows.
  explicit Tensor(const shape_type& shape)
      : shape_(shape), size_(detail::checked_size("Tensor", shape, sizeof(T))) {
    if (size_ > 0) {
      const std::size_t bytes = static_cast<std::size_t>(size_) * sizeof(T);
      const std::size_t align = bytes >= page_aligned_bytes ? page_alignment : alignment;
      data_ = std::unique_ptr<T, AlignedDelete>(static_cast<T*>(detail::allocate_zeroed(bytes, align)),
                                                AlignedDelete{detail::zeroed_alignment(bytes, align)});
    }
  }

  /// Deep copy.
  Tensor(const Tensor& o) : Tensor(o.shape_) {
    if (size_ > 0)
      std::memcpy(static_cast<void*>(data_.get()), o.data_.get(),
                  static_cast<std::size_t>(size_) * sizeof(T));
  }
  /// Deep copy assignment.
  Tensor& operator=(const Tensor& o) {
    if (this != &o) {
      Tensor tmp(o);
      *this = std::move(tmp);
    }
    return *this;
  }
  /// Takes o's buffer; o is left empty.
  Tensor(Tensor&& o) noexcept : data_(std::move(o.data_)), shape_(o.shape_), size_(o.size_) {
    o.shape_ = shape_type{};
    o.size_ = 0;
  }
  /// Takes o's buffer; o is left empty.
  Tensor& operator=(Tensor&& o) noexcept {
    data_ = std::move(o.data_);
    shape_ = o.shape_;
    size_ = o.size_;
    o.shape_ = shape_type{};
    o.size_ = 0;
    return *this;
  }

  /// The buffer (row-major); null when empty.
  T* data() noexcept { return data_.get(); }
  /// The buffer (row-major); null when empty.
  const T* data() const noexcept { return data_.get(); }
  /// The extents.
  const shape_type& shape() const noexcept { return shape_; }
  /// Extent of dimension i (i < R, unchecked).
  index_t shape(std::size_t i) const noexcept { return shape_[i]; }
  /// mdspan spelling of shape(i).
  index_t extent(std::size_t i) const noexcept { return shape_[i]; }
  /// Number of elements (product of the extents).
  index_t size() const noexcept { return size_; }
  /// True when some extent is 0.
  bool empty() const noexcept { return size_ == 0; }
  /// The rank R.
  static constexpr std::size_t rank() noexcept { return R; }

  /// A row-major view that writes through to the tensor.
  TensorView<T, R> view() noexcept { return make_view<T>(data_.get()); }
  /// A read-only row-major view.
  TensorView<const T, R> view() const noexcept { return make_view<const T>(data_.get()); }
  /// A read-only view, also of a non-const tensor.
  TensorView<const T, R> cview() const noexcept { return view(); }
  /// Implicit view(): a Tensor passes where a TensorView is taken.
  operator TensorView<T, R>() noexcept { return view(); }              // NOLINT
  /// Implicit read-only view().
  operator TensorView<const T, R>() const noexcept { return view(); }  // NOLINT

  /// Element access, as TensorView::operator() (indices checked by DIFFATTN_ASSERT only).
  template <class... I>
  T& operator()(I... idx) {
    return view()(idx...);
  }
  /// Element access, as TensorView::operator() (indices checked by DIFFATTN_ASSERT only).
  template <class... I>
  const T& operator()(I... idx) const {
    return view()(idx...);
  }

  /// Sets every element to `value`.
  void fill(const T& value) noexcept { std::fill(data_.get(), data_.get() + size_, value); }

 private:
  struct AlignedDelete {
    std::size_t align = alignment;
    void operator()(T* p) const noexcept { ::operator delete(p, std::align_val_t(align)); }
  };

  template <class U>
  TensorView<U, R> make_view(U* p) const noexcept {
    return TensorView<U, R>(p, shape_, detail::row_major_strides(shape_));
  }

  std::unique_ptr<T, AlignedDelete> data_;
  shape_type shape_;
  index_t size_ = 0;
};

DIFFATTN_END_NAMESPACE
