/// \file
/// The KV cache of a layer: keys (after rotary) and values of the tokens seen
/// so far, for a batch of sequences that advance together.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "config.hpp"
#include "detail/core/format.hpp"
#include "float8.hpp"
#include "tensor.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \ingroup decoding
/// Keys and values of the tokens a layer has seen, for B sequences decoded in
/// step: keys (B, rows, Hk, dk) after rotary, values (B, rows, Hv, dv), in the
/// layer's own head layout (V1: 2Hkv key heads of d and Hkv value heads of
/// 2d; V2: Hkv heads of head_dim for both). Made by a layer's
/// make_cache(batch, capacity) and filled by its forward(x, cache).
///
/// size() counts the tokens seen (the rotary position of the next one);
/// capacity() is the most it accepts; appending past it throws and changes
/// nothing. A layer with a sliding window of W tokens needs only the last
/// W - 1 of them: its cache keeps at most 2W rows, a linear buffer whose last
/// W - 1 rows move to the front when it fills (once per about W tokens), so
/// that every read stays one contiguous view and memory is bounded by W, not
/// by the sequence.
///
/// The row-level calls (reserve, key_rows, value_rows, keys_with, commit) are
/// what a layer uses to append; engines that build their own layers can use
/// them too. Rows outside the storage, or more rows than the last reserve()
/// made room for, throw diffattn::error and change nothing.
///
/// 8-bit caches (T = std::int8_t or float8_e4m3) also hold one float scale
/// per (token, head) row: key scales (B, rows, Hk) and value scales (B, rows,
/// Hv) beside the rows (key_scales(), key_scale_rows(), ...; see
/// quantize_rows), moved and dropped with them; bytes() counts them.
template <class T>
class KVCache {
 public:
  /// True for an 8-bit cache, which holds scales beside its rows.
  static constexpr bool quantized = is_8bit_storage_v<T>;

  /// An empty cache: batch 0, capacity 0.
  KVCache() = default;

  /// A cache for `batch` sequences of at most `capacity` tokens with
  /// k_heads x k_dim keys and v_heads x v_dim values per token. keep >= 0:
  /// only the last `keep` tokens are ever read again (a sliding window of
  /// keep + 1 tokens); -1: all of them.
  KVCache(index_t batch, index_t capacity, index_t k_heads, index_t k_dim, index_t v_heads,
          index_t v_dim, index_t keep = -1)
      : batch_(batch), capacity_(capacity), keep_(keep) {
    constexpr const char* fn = "KVCache";
    if (batch < 0) detail::fail(fn, "batch must be >= 0, got ", batch);
    if (capacity < 0) detail::fail(fn, "capacity must be >= 0, got ", capacity);
    if (k_heads < 1 || k_dim < 1 || v_heads < 1 || v_dim < 1)
      detail::fail(fn, "head counts and widths must be >= 1, got keys ", k_heads, " x ", k_dim,
                   ", values ", v_heads, " x ", v_dim);
    if (keep < -1) detail::fail(fn, "keep must be >= 0, or -1 for every token, got ", keep);
    const index_t rows = keep < 0 ? capacity : std::min(capacity, 2 * (keep + 1));
    k_ = Tensor<T, 4>({batch, rows, k_heads, k_dim});
    v_ = Tensor<T, 4>({batch, rows, v_heads, v_dim});
    if (quantized) {
      ks_ = Tensor<float, 4>({batch, rows, k_heads, 1});
      vs_ = Tensor<float, 4>({batch, rows, v_heads, 1});
    }
  }

  /// Sequences B.
  index_t batch() const noexcept { return batch_; }
  /// Tokens seen: the position of the next token.
  index_t size() const noexcept { return size_; }
  /// The most tokens the cache accepts.
  index_t capacity() const noexcept { return capacity_; }
  /// Rows held now (size() without a window; fewer with one).
  index_t stored() const noexcept { return end_ - start_; }
  /// Tokens read again by later queries (-1: all; keep + 1 is the window).
  index_t keep() const noexcept { return keep_; }
  /// Bytes of key and value storage.
  std::size_t bytes() const noexcept {
    return static_cast<std::size_t>(k_.size() + v_.size()) * sizeof(T) +
           static_cast<std::size_t>(ks_.size() + vs_.size()) * sizeof(float);
  }
  /// Forgets every token (the storage stays).
  void clear() noexcept { size_ = start_ = end_ = reserved_ = 0; }

  /// The held keys (B, stored(), Hk, dk) and values (B, stored(), Hv, dv),
  /// oldest first.
  TensorView<const T, 4> keys() const { return rows_of(k_, start_, stored()); }
  /// The held values (B, stored(), Hv, dv), oldest first.
  TensorView<const T, 4> values() const { return rows_of(v_, start_, stored()); }
  /// 8-bit caches: the scales of the held keys (B, stored(), Hk) and values
  /// (B, stored(), Hv); empty views for other caches.
  TensorView<const float, 3> key_scales() const { return scales_of(ks_, start_, stored()); }
  /// 8-bit caches: the scales of the held values (B, stored(), Hv).
  TensorView<const float, 3> value_scales() const { return scales_of(vs_, start_, stored()); }

  /// Most tokens one reserve() may take: everything up to capacity, or with
  /// a window the room left beside the kept rows.
  index_t max_append() const noexcept {
    const index_t left = capacity_ - size_;
    return keep_ < 0 ? left : std::min(left, k_.shape(1) - std::min(stored(), keep_));
  }
  /// Makes room for n new tokens after the held rows (moving the kept rows to
  /// the front when the buffer is full) and returns the row where they go.
  /// Nothing is appended until commit(n); another reserve replaces this one.
  /// Throws when n > max_append().
  index_t reserve(index_t n) {
    if (n < 0 || n > max_append())
      detail::fail("KVCache::reserve", "cannot append ", n, " tokens to a cache holding ", size_,
                   " of capacity ", capacity_,
                   keep_ < 0 ? "" : " (windowed: at most max_append() at a time)");
    if (end_ + n > k_.shape(1)) {  // windowed: keep the last keep_ rows
      const index_t kept = std::min(stored(), keep_);
      move_rows(k_, end_ - kept, kept);
      move_rows(v_, end_ - kept, kept);
      if (quantized) {
        move_rows(ks_, end_ - kept, kept);
        move_rows(vs_, end_ - kept, kept);
      }
      start_ = 0;
      end_ = kept;
    }
    reserved_ = n;
    return end_;
  }
  /// Writable rows [row, row + n) of the key and value storage (B, n, H, D),
  /// 0 <= row <= row + n <= the rows it has (capacity, or 2W with a window).
  TensorView<T, 4> key_rows(index_t row, index_t n) {
    check_rows("KVCache::key_rows", row, n);
    return rows_of(k_, row, n);
  }
  /// Writable value rows [row, row + n), (B, n, Hv, dv), as key_rows.
  TensorView<T, 4> value_rows(index_t row, index_t n) {
    check_rows("KVCache::value_rows", row, n);
    return rows_of(v_, row, n);
  }
  /// 8-bit caches: writable scales of rows [row, row + n), (B, n, Hk) and
  /// (B, n, Hv), as key_rows and value_rows (empty views for other caches).
  TensorView<float, 3> key_scale_rows(index_t row, index_t n) {
    check_rows("KVCache::key_scale_rows", row, n);
    return scales_of(ks_, row, n);
  }
  /// 8-bit caches: writable value scales of rows [row, row + n), (B, n, Hv).
  TensorView<float, 3> value_scale_rows(index_t row, index_t n) {
    check_rows("KVCache::value_scale_rows", row, n);
    return scales_of(vs_, row, n);
  }
  /// Keys and values of the held rows and the n reserved ones after them:
  /// what the queries of those n tokens attend to (0 <= n <= the last reserve).
  TensorView<const T, 4> keys_with(index_t n) const {
    check_reserved("KVCache::keys_with", n);
    return rows_of(k_, start_, stored() + n);
  }
  /// Values of the held rows and the n reserved ones, as keys_with(n).
  TensorView<const T, 4> values_with(index_t n) const {
    check_reserved("KVCache::values_with", n);
    return rows_of(v_, start_, stored() + n);
  }
  /// 8-bit caches: the scales of keys_with(n) and values_with(n).
  TensorView<const float, 3> key_scales_with(index_t n) const {
    check_reserved("KVCache::key_scales_with", n);
    return scales_of(ks_, start_, stored() + n);
  }
  /// 8-bit caches: the scales of values_with(n).
  TensorView<const float, 3> value_scales_with(index_t n) const {
    check_reserved("KVCache::value_scales_with", n);
    return scales_of(vs_, start_, stored() + n);
  }
  /// Appends n of the reserved tokens (0 <= n <= the last reserve); with a
  /// window, rows no query will read again are dropped from the front.
  void commit(index_t n) {
    check_reserved("KVCache::commit", n);
    end_ += n;
    size_ += n;
    reserved_ = 0;
    if (keep_ >= 0 && stored() > keep_) start_ = end_ - keep_;
  }

  /// Shape of one token's keys (heads, width) and values, for layout checks:
  /// key heads Hk.
  index_t key_heads() const noexcept { return k_.shape(2); }
  /// Key width dk.
  index_t key_dim() const noexcept { return k_.shape(3); }
  /// Value heads Hv.
  index_t value_heads() const noexcept { return v_.shape(2); }
  /// Value width dv.
  index_t value_dim() const noexcept { return v_.shape(3); }

 private:
  void check_rows(const char* fn, index_t row, index_t n) const {
    if (row < 0 || n < 0 || row > k_.shape(1) - n)
      detail::fail(fn, "rows [", row, ", ", row, " + ", n, ") are outside the ", k_.shape(1),
                   " rows of the cache's storage ", detail::shape_str(k_.shape()));
  }
  void check_reserved(const char* fn, index_t n) const {
    if (n < 0 || n > reserved_)
      detail::fail(fn, "n = ", n, " new rows, but the last reserve() made room for ", reserved_,
                   " (a cache holding ", size_, " of capacity ", capacity_, ")");
  }

  template <class U>
  static TensorView<U, 4> rows_view(U* base, const std::array<index_t, 4>& shape, index_t row,
                                    index_t n) {
    // No offset into empty storage (batch 0: no buffer at all).
    const bool empty = n == 0 || shape[0] == 0;
    return TensorView<U, 4>(base + (empty ? 0 : row * shape[2] * shape[3]),
                            {shape[0], n, shape[2], shape[3]},
                            {shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1});
  }
  static TensorView<const T, 4> rows_of(const Tensor<T, 4>& t, index_t row, index_t n) {
    return rows_view<const T>(t.data(), t.shape(), row, n);
  }
  static TensorView<T, 4> rows_of(Tensor<T, 4>& t, index_t row, index_t n) {
    return rows_view<T>(t.data(), t.shape(), row, n);
  }
  // Scales (B, rows, H, 1) as (B, n, H) views; empty views when not held.
  template <class U>
  static TensorView<U, 3> scale_view(U* base, const std::array<index_t, 4>& shape, index_t row,
                                     index_t n) {
    if (!quantized) return TensorView<U, 3>();
    const TensorView<U, 4> v = rows_view<U>(base, shape, row, n);
    return TensorView<U, 3>(v.data(), {v.shape(0), v.shape(1), v.shape(2)},
                            {v.stride(0), v.stride(1), v.stride(2)});
  }
  static TensorView<const float, 3> scales_of(const Tensor<float, 4>& t, index_t row, index_t n) {
    return scale_view<const float>(t.data(), t.shape(), row, n);
  }
  static TensorView<float, 3> scales_of(Tensor<float, 4>& t, index_t row, index_t n) {
    return scale_view<float>(t.data(), t.shape(), row, n);
  }
  // Rows [from, from + n) to [0, n) of every batch entry (regions may overlap).
  template <class U>
  static void move_rows(Tensor<U, 4>& t, index_t from, index_t n) {
    if (n == 0 || from == 0) return;
    const index_t row = t.shape(2) * t.shape(3);
    for (index_t b = 0; b < t.shape(0); ++b) {
      U* base = t.data() + b * t.shape(1) * row;
      std::memmove(static_cast<void*>(base), base + from * row,
                   static_cast<std::size_t>(n * row) * sizeof(U));
    }
  }

  index_t batch_ = 0, capacity_ = 0, keep_ = -1;
  index_t size_ = 0;             // tokens seen
  index_t start_ = 0, end_ = 0;  // held rows [start_, end_)
  index_t reserved_ = 0;         // rows the last reserve() made room for
  Tensor<T, 4> k_, v_;           // (B, rows, Hk, dk), (B, rows, Hv, dv)
  Tensor<float, 4> ks_, vs_;     // 8-bit: (B, rows, Hk, 1), (B, rows, Hv, 1); else empty
};

DIFFATTN_END_NAMESPACE
