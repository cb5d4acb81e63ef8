// Pieces shared by the layer classes: projections, initialisation, parameter
// lists, and loading / saving them through safetensors.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../diff_weights.hpp"
#include "../../io/safetensors.hpp"
#include "../../kv_cache.hpp"
#include "../../kvcache_attention.hpp"
#include "../../matrix.hpp"
#include "../../options.hpp"
#include "../../quantize.hpp"
#include "../../rope.hpp"
#include "../../softmax.hpp"
#include "../../tensor.hpp"
#include "../../types.hpp"
#include "../core/format.hpp"
#include "../core/parallel.hpp"
#include "../core/random.hpp"
#include "../core/validate.hpp"
#include "../kernel/convert.hpp"
#include "linear.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// y (rows, out) = x (rows, in) w^T, w (out, in) row-major as nn.Linear.weight,
/// on `threads` threads (0: the OpenMP default). In a 16-bit layer w (and the
/// layer's input x, or its output y) are bfloat16 / half, the products float.
template <class SX, class SW, class SY>
void module_linear(const SX* x, index_t rows, index_t in, const SW* w, index_t out, SY* y,
                   int threads) {
  linear(x, rows, in, w, out, y, threads);
}

/// What a layer of storage T keeps its activations in between stages (q, k,
/// v after rotary, V2's lambda logits, the attention output, V1's normed
/// output): bfloat16 for a bfloat16 layer, as a PyTorch bf16 module does, so
/// that the attention kernel and the output projection run on bf16 data
/// (bf16 dot products where the build targets AVX512-BF16); compute_t<T>
/// otherwise (float, double, and half, whose products widen to float anyway).
template <class T>
using module_act_t = std::conditional_t<std::is_same<T, bfloat16>::value, bfloat16, compute_t<T>>;

/// A contiguous copy of t in D (each element converted once).
template <class D, class S, std::size_t R>
Tensor<D, R> module_converted(const Tensor<S, R>& t) {
  Tensor<D, R> out(t.shape());
  convert_row(t.data(), t.size(), out.data());
  return out;
}

/// Backward of module_linear: dw (out, in) += dy^T x, and dx (rows, in) = dy w
/// (or += when accumulate_dx, for an input that feeds several projections).
/// dy is (rows, out). dx may be null when the input's gradient is not wanted.
template <class T>
void module_linear_backward(const T* x, index_t rows, index_t in, const T* w, index_t out,
                            const T* dy, T* dw, T* dx, bool accumulate_dx, int threads) {
  linear_backward<T>(x, rows, in, w, out, dy, dw, dx, accumulate_dx, threads);
}

/// A small parameter vector (a norm weight) as the compute type C: a view of
/// p itself when it is stored as C, else of its widened copy in buf.
template <class C, class T>
TensorView<const C, 1> module_compute_view(const Tensor<T, 1>& p, Tensor<C, 1>& buf) {
  if constexpr (std::is_same<C, T>::value) {
    (void)buf;
    return p.cview();
  } else {
    buf = Tensor<C, 1>(p.shape());
    convert_row(p.data(), p.size(), buf.data());
    return buf.cview();
  }
}

/// Checks a layer configuration's mask fields as validate_options does.
inline void module_check_window(const char* fn, bool causal, index_t left, index_t right) {
  if (left < -1) fail(fn, "window_left must be >= 0, or -1 for no limit, got ", left);
  if (right < -1) fail(fn, "window_right must be >= 0, or -1 for no limit, got ", right);
  if (causal && right > 0)
    fail(fn, "causal means window_right = 0, got window_right = ", right, " with causal = true");
}

/// Rotary embedding (or its inverse) on t (1 or B, T, H, D): with `cu` (the
/// offsets of a packed batch, B = 1) each sequence's positions start at 0;
/// otherwise they start at position_offset.
template <class T>
void module_rope(TensorView<T, 4> t, index_t position_offset, const std::vector<index_t>* cu,
                 double base, bool inverse) {
  auto apply = [&](TensorView<T, 4> x, index_t offset) {
    if (inverse)
      apply_rope_inverse<T>(x, offset, base);
    else
      apply_rope<T>(x, offset, base);
  };
  if (!cu) return apply(t, position_offset);
  for (std::size_t s = 0; s + 1 < cu->size(); ++s) {
    const index_t r0 = (*cu)[s], n = (*cu)[s + 1] - r0;
    if (n > 0)
      apply(TensorView<T, 4>(&t(0, r0, 0, 0), {1, n, t.shape(2), t.shape(3)}, t.strides()), 0);
  }
}

/// The rotary angles of n token rows (per batch entry) of `heads` heads of
/// `dim` features at module_rope's positions (cu: a packed batch), in C, as
/// rope_apply computes them; apply rotates one row of all heads.
template <class C>
struct ModuleRopeTable {
  index_t n, heads, dim, half;
  std::vector<index_t> pos;     // (n) each row's position
  std::vector<C> cos_t, sin_t;  // (max position + 1, half)

  ModuleRopeTable(index_t rows, index_t nheads, index_t width, index_t position_offset,
                  const std::vector<index_t>* cu, double base, int threads)
      : n(rows), heads(nheads), dim(width), half(width / 2), pos(static_cast<std::size_t>(rows)) {
    if (n == 0) return;
    for (index_t i = 0; i < n; ++i) pos[i] = position_offset + i;
    if (cu)
      for (std::size_t s = 0; s + 1 < cu->size(); ++s)
        for (index_t i = (*cu)[s]; i < (*cu)[s + 1]; ++i) pos[i] = i - (*cu)[s];
    const index_t max_pos = *std::max_element(pos.begin(), pos.end());
    cos_t.resize(static_cast<std::size_t>((max_pos + 1) * half));
    sin_t.resize(cos_t.size());
    std::vector<double> inv_freq(static_cast<std::size_t>(half));
    for (index_t i = 0; i < half; ++i) inv_freq[i] = rope_inv_freq(i, dim, base);
    constexpr index_t kRows = 64;  // positions per task
    const index_t tasks = (max_pos + kRows) / kRows;
    parallel_tasks(
        tasks, resolve_threads(threads, tasks, static_cast<double>(max_pos + 1) * half * 64),
        [&](index_t t) {
          for (index_t p = t * kRows; p < std::min(max_pos + 1, (t + 1) * kRows); ++p)
            for (index_t i = 0; i < half; ++i) {
              const double angle = static_cast<double>(p) * inv_freq[i];
              cos_t[p * half + i] = static_cast<C>(std::cos(angle));
              sin_t[p * half + i] = static_cast<C>(std::sin(angle));
            }
        },
        [] {});
  }
  /// dst = src rotated (heads x dim values; dst may be src), r the row among
  /// B * n.
  void apply(const C* src, C* dst, index_t r) const {
    const C* c = cos_t.data() + pos[r % n] * half;
    const C* s = sin_t.data() + pos[r % n] * half;
    for (index_t h = 0; h < heads; ++h)
      for (index_t i = 0; i < half; ++i) {
        const C a = src[h * dim + 2 * i], b = src[h * dim + 2 * i + 1];
        dst[h * dim + 2 * i] = a * c[i] - b * s[i];
        dst[h * dim + 2 * i + 1] = a * s[i] + b * c[i];
      }
  }
};

/// dst = rope(src) for src (B, N, H, D) in the compute type C, contiguous,
/// dst (same shape) in A: each rotated pair computed in C exactly as
/// module_rope computes it in place, then rounded once to A. Positions as
/// module_rope's (cu: a packed batch). Threads over token rows.
template <class C, class A>
void module_rope_round(const Tensor<C, 4>& src, Tensor<A, 4>& dst, index_t position_offset,
                       const std::vector<index_t>* cu, double base, int threads) {
  const index_t b = src.shape(0), n = src.shape(1), width = src.shape(2) * src.shape(3);
  if (src.size() == 0) return;
  const ModuleRopeTable<C> table(n, src.shape(2), src.shape(3), position_offset, cu, base, threads);
  constexpr index_t kRows = 64;  // token rows per task
  const index_t tasks = (b * n + kRows - 1) / kRows;
  parallel_tasks(
      tasks, resolve_threads(threads, tasks, static_cast<double>(src.size())),
      [&](index_t t) {
        std::vector<C> row(static_cast<std::size_t>(width));
        for (index_t r = t * kRows; r < std::min(b * n, (t + 1) * kRows); ++r) {
          table.apply(src.data() + r * width, row.data(), r);
          convert_row(row.data(), width, dst.data() + r * width);
        }
      },
      [] {});
}

/// out (rows, heads, width) = x (rows, in) w^T, then rotary (when `rope`) at
/// the positions module_rope gives: in the layer's activation type A. When A
/// is the compute type C the product is written to out and rotated in place;
/// otherwise (a bfloat16 layer) the product is rotated in C and rounded once
/// to A: inside the product's epilogue where it runs on bf16 dot products
/// (linear_bf16_rows), else from a C copy (module_rope_round); without
/// rotary, rounded once as it is written.
template <class C, class A, class SX, class SW>
void module_project(const SX* x, index_t rows, index_t in, const SW* w, Tensor<A, 4>& out,
                    bool rope, index_t position_offset, const std::vector<index_t>* cu, double base,
                    int threads) {
  const index_t width = out.shape(2) * out.shape(3);
  if constexpr (std::is_same<A, C>::value) {
    module_linear(x, rows, in, w, width, out.data(), threads);
    if (rope) module_rope<C>(out.view(), position_offset, cu, base, false);
  } else {
    if (!rope) return module_linear(x, rows, in, w, width, out.data(), threads);
#if defined(__AVX512BF16__)
    if constexpr (kHasBf16Dot && std::is_same<SX, bfloat16>::value &&
                  std::is_same<SW, bfloat16>::value && std::is_same<C, float>::value) {
      if (out.size() == 0) return;
      const ModuleRopeTable<C> table(out.shape(1), out.shape(2), out.shape(3), position_offset, cu,
                                     base, threads);
      return linear_bf16_rows(x, rows, in, w, width, out.data(), threads,
                              [&](float* row, index_t r) { table.apply(row, row, r); });
    }
#endif
    Tensor<C, 4> wide(out.shape());
    module_linear(x, rows, in, w, width, wide.data(), threads);
    module_rope_round(wide, out, position_offset, cu, base, threads);
  }
}

/// V1's per-head RMSNorm (rms_norm's arithmetic) on x (B, N, H, D) stored
/// as A (a bfloat16 layer's attention output): each row widened to C, its
/// sum of squares in double, x * f * weight(j) in C with f = C(scale / rms),
/// rounded once to A into out (same shape). weight (D) or empty. Threads over
/// rows.
template <class C, class A>
void module_rms_norm_round(const Tensor<A, 4>& x, TensorView<const C, 1> weight, Tensor<A, 4>& out,
                           double eps, double scale, int threads) {
  const index_t dim = x.shape(3), rows = x.size() / std::max<index_t>(dim, 1);
  if (x.size() == 0) return;
  constexpr index_t kRows = 256;  // norm rows per task
  const index_t tasks = (rows + kRows - 1) / kRows;
  parallel_tasks(
      tasks, resolve_threads(threads, tasks, static_cast<double>(x.size())),
      [&](index_t t) {
        std::vector<C> row(static_cast<std::size_t>(dim));
        for (index_t r = t * kRows; r < std::min(rows, (t + 1) * kRows); ++r) {
          convert_row(x.data() + r * dim, dim, row.data());
          double ss = 0;
          for (index_t j = 0; j < dim; ++j) ss += static_cast<double>(row[j]) * row[j];
          const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
          const C f = static_cast<C>(inv * scale);
          if (weight.empty())
            for (index_t j = 0; j < dim; ++j) row[j] = row[j] * f;
          else
            for (index_t j = 0; j < dim; ++j) row[j] = row[j] * f * weight(j);
          convert_row(row.data(), dim, out.data() + r * dim);
        }
      },
      [] {});
}

/// Checks the packed-batch arguments of a layer's forward: x (1, T, E) and
/// self-attention offsets over its T tokens.
template <class T>
void module_check_packed(const char* fn, const TensorView<const T, 3>& x,
                         const std::vector<index_t>& cu_q, const std::vector<index_t>& cu_k) {
  if (x.shape(0) != 1) fail(fn, "a packed batch has x (1, T, E), got x ", shape_str(x.shape()));
  check_cu_seqlens(fn, "cu_seqlens_q", cu_q, x.shape(1), "x");
  if (!cu_k.empty() && cu_k != cu_q)
    fail(fn,
         "a layer attends each sequence to itself: cu_seqlens_k must be empty or equal to "
         "cu_seqlens_q");
}

/// Rows [r0, r0 + n) of t (B, N, H, D) as a (B, n, H, D) view. Empty t (no
/// batch entry, no row) has no buffer, and is not offset into.
template <class T>
TensorView<T, 4> module_rows(Tensor<T, 4>& t, index_t r0, index_t n) {
  const auto& s = t.shape();
  const bool empty = n == 0 || s[0] == 0;
  return TensorView<T, 4>(t.data() + (empty ? 0 : r0 * s[2] * s[3]), {s[0], n, s[2], s[3]},
                          {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1});
}
template <class T>
TensorView<const T, 3> module_rows(const Tensor<T, 3>& t, index_t r0, index_t n) {
  const auto& s = t.shape();
  const bool empty = n == 0 || s[0] == 0;
  return TensorView<const T, 3>(t.data() + (empty ? 0 : r0 * s[2]), {s[0], n, s[2]},
                                {s[1] * s[2], s[2], 1});
}

/// Checks that `cache` fits a layer whose tokens have k_heads x k_dim keys and
/// v_heads x v_dim values, the batch of x (B, n, E), and room for n tokens.
template <class S, class T>
void module_check_cache(const char* fn, const KVCache<S>& cache, const TensorView<const T, 3>& x,
                        index_t k_heads, index_t k_dim, index_t v_heads, index_t v_dim,
                        index_t keep) {
  if (cache.key_heads() != k_heads || cache.key_dim() != k_dim || cache.value_heads() != v_heads ||
      cache.value_dim() != v_dim || cache.keep() != keep)
    fail(fn, "the cache holds keys ", cache.key_heads(), " x ", cache.key_dim(), " and values ",
         cache.value_heads(), " x ", cache.value_dim(), " per token (keep ", cache.keep(),
         "), this layer ", k_heads, " x ", k_dim, " and ", v_heads, " x ", v_dim, " (keep ", keep,
         "): make it with this layer's make_cache");
  if (cache.batch() != x.shape(0))
    fail(fn, "x has shape ", shape_str(x.shape()), " but the cache was made for batch ",
         cache.batch());
  if (x.shape(1) > cache.capacity() - cache.size())
    fail(fn, "cannot append ", x.shape(1), " tokens (x ", shape_str(x.shape()),
         ") to a cache holding ", cache.size(), " of capacity ", cache.capacity());
}

/// Appends the new keys k (B, n, Hk, dk) and values v (B, n, Hv, dv) to the
/// cache, in pieces that fit it, and after writing each piece calls
/// attend(a, np, keys, values): the queries of tokens [a, a + np) attend to
/// keys and values, every held token followed by the piece's (so a causal
/// mask aligned bottom-right is the right one). A cache of a narrower type S
/// (a float layer's bfloat16 cache) gets the keys and values rounded to S;
/// an 8-bit one (int8, e4m3) gets them quantized with their scales
/// (quantize_rows, which refuses non-finite keys or values before writing).
///
/// If attend (or anything else) throws, the cache is as it was before the
/// call. One piece needs nothing for that: reserve only moves the held rows
/// and nothing counts until commit. Several pieces (a windowed cache shorter
/// than the append) commit one by one and each reserve overwrites rows the
/// cache held before, so a copy of the cache (at most 2W rows) is restored.
template <class S, class T, class Attend>
void module_cache_append(KVCache<S>& cache, Tensor<T, 4>& k, Tensor<T, 4>& v, Attend&& attend) {
  const index_t n = k.shape(1), row = k.shape(2) * k.shape(3), vrow = v.shape(2) * v.shape(3);
  auto pieces = [&] {
    for (index_t a = 0; a < n;) {
      const index_t np = std::min(n - a, cache.max_append());
      if (np < 1) fail("KVCache", "no room to append to a cache holding ", cache.size());
      const index_t r = cache.reserve(np);
      TensorView<S, 4> kd = cache.key_rows(r, np), vd = cache.value_rows(r, np);
      if constexpr (is_8bit_storage_v<S>) {
        quantize_rows<T, S>(module_rows(k, a, np), kd, cache.key_scale_rows(r, np));
        quantize_rows<T, S>(module_rows(v, a, np), vd, cache.value_scale_rows(r, np));
      } else {
        for (index_t b = 0; b < k.shape(0); ++b) {
          convert_row(&k(b, a, 0, 0), np * row, &kd(b, 0, 0, 0));
          convert_row(&v(b, a, 0, 0), np * vrow, &vd(b, 0, 0, 0));
        }
      }
      attend(a, np, cache.keys_with(np), cache.values_with(np));
      cache.commit(np);
      a += np;
    }
  };
  if (n <= cache.max_append()) return pieces();
  KVCache<S> saved = cache;
  try {
    pieces();
  } catch (...) {
    cache = std::move(saved);
    throw;
  }
}

/// The cache lengths of a batch of b sequences that each hold all `keys` rows:
/// how a layer hands its own 16-bit cache to the *_kvcache kernels (the only
/// kernels that read keys and values of another type than the queries).
struct FullCache {
  Tensor<index_t, 1> lengths;  // (B)
  KVCacheBatch batch;
  FullCache(index_t b, index_t keys) : lengths({b}) {
    lengths.fill(keys);
    batch.cache_seqlens = lengths;
  }
  /// All the keys of `cache` and its n reserved rows (keys_with(n)), with
  /// their scales for an 8-bit cache.
  template <class S>
  FullCache(index_t b, const KVCache<S>& cache, index_t np) : FullCache(b, cache.stored() + np) {
    batch.k_scale = cache.key_scales_with(np);
    batch.v_scale = cache.value_scales_with(np);
  }
  FullCache(const FullCache&) = delete;
  FullCache& operator=(const FullCache&) = delete;
};

/// The kernel options of a layer.
inline AttentionOptions module_options(bool causal, index_t left, index_t right, int threads) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = left;
  o.window_right = right;
  o.num_threads = threads;
  return o;
}

/// A layer's score modifiers (config fields softcap, alibi, sinks): the
/// options they give and, for learned sinks (2H) stored as T, their float copy.
struct ModuleMods {
  float softcap = 0;
  std::vector<float> alibi;          // (2H) slopes, or empty
  mutable std::vector<float> sinks;  // float copy of the layer's sinks, or empty

  ModuleMods() = default;
  ModuleMods(float cap, bool alibi_on, index_t query_heads)
      : softcap(cap), alibi(alibi_on ? standard_alibi_slopes(query_heads) : std::vector<float>()) {}
  bool any(bool sinks_on) const { return softcap > 0 || !alibi.empty() || sinks_on; }
  /// o with the modifiers; `learned` (n values of T) the sinks, or null.
  template <class T>
  void apply(AttentionOptions& o, const T* learned, index_t n) const {
    o.softcap = softcap;
    if (!alibi.empty())
      o.alibi_slopes =
          TensorView<const float, 1>(alibi.data(), {static_cast<index_t>(alibi.size())});
    if (learned) {
      sinks.resize(static_cast<std::size_t>(n));
      for (index_t h = 0; h < n; ++h)
        sinks[static_cast<std::size_t>(h)] = static_cast<float>(learned[h]);
      o.sinks = TensorView<const float, 1>(sinks.data(), {n});
    }
  }
};

/// Checks a layer's softcap.
inline void module_check_softcap(const char* fn, float softcap) {
  if (!std::isfinite(softcap) || softcap < 0)
    fail(fn, "softcap must be finite and >= 0 (0: none), got ", softcap);
}

/// dst[i] += src[i], i < n.
template <class T>
void module_add(T* dst, const T* src, index_t n) {
  for (index_t i = 0; i < n; ++i) dst[i] += src[i];
}

/// Gradient storage of a layer: one zero-initialised buffer per parameter,
/// keyed and sized as the parameters, so that an optimizer pairs them by name.
/// None for a 16-bit layer, which has no backward.
template <class T>
class ModuleGrads {
 public:
  ModuleGrads() = default;
  explicit ModuleGrads(const std::map<std::string, std::vector<index_t>>& shapes) {
    if (is_half_storage_v<T>) return;
    for (const auto& kv : shapes) {
      index_t n = 1;
      for (const index_t e : kv.second) n *= e;
      buffers_.emplace(kv.first, Tensor<T, 1>({n}));
    }
  }
  /// The buffer of parameter `name` (which must exist).
  T* at(const std::string& name) { return buffers_.at(name).data(); }
  std::map<std::string, TensorView<T, 1>> views() {
    std::map<std::string, TensorView<T, 1>> out;
    for (auto& kv : buffers_) out.emplace(kv.first, kv.second.view());
    return out;
  }
  void zero() {
    for (auto& kv : buffers_) kv.second.fill(T(0));
  }

 private:
  std::map<std::string, Tensor<T, 1>> buffers_;
};

/// softmax(s q_qh k_kh^T + mask) of batch entry b, materialised (N x M), from
/// q (B, N, Hq, d) and k (B, M, Hk, d), s = 1/sqrt(d); for analysis.
/// q and k may be stored narrower than T (a bfloat16 layer's activations):
/// widened exactly.
template <class T, class A>
Matrix<T> module_softmax_map(const Tensor<A, 4>& q, const Tensor<A, 4>& k, index_t b, index_t qh,
                             index_t kh, const KeyBand& band) {
  const index_t n = q.shape(1), m = k.shape(1), d = q.shape(3);
  Matrix<T> qm(n, d), km(m, d);
  for (index_t i = 0; i < n; ++i)
    for (index_t t = 0; t < d; ++t) qm(i, t) = static_cast<T>(q(b, i, qh, t));
  for (index_t j = 0; j < m; ++j)
    for (index_t t = 0; t < d; ++t) km(j, t) = static_cast<T>(k(b, j, kh, t));
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  return softmax(masked_scores<T>(qm, km, scale, band));
}

/// Copies the map m (N x M) into w[b, h] of w (B, H, N, M).
template <class T>
void module_store_map(const Matrix<T>& m, Tensor<T, 4>& w, index_t b, index_t h) {
  for (index_t i = 0; i < m.rows(); ++i)
    for (index_t j = 0; j < m.cols(); ++j) w(b, h, i, j) = m(i, j);
}

/// A contiguous copy of x (B, N, E), any strides.
template <class T>
Tensor<T, 3> module_contiguous_copy(TensorView<const T, 3> x) {
  Tensor<T, 3> c(x.shape());
  T* dst = c.data();
  for (index_t i = 0; i < x.shape(0); ++i)
    for (index_t j = 0; j < x.shape(1); ++j) {
      const T* src = x.data() + i * x.stride(0) + j * x.stride(1);
      for (index_t k = 0; k < x.shape(2); ++k) *dst++ = src[k * x.stride(2)];
    }
  return c;
}

/// x (B, N, E) itself when it is contiguous, else its contiguous copy, made
/// in buf.
template <class T>
TensorView<const T, 3> module_contiguous(TensorView<const T, 3> x, Tensor<T, 3>& buf) {
  const index_t n = x.shape(1), e = x.shape(2);
  if (x.stride(2) == 1 && x.stride(1) == e && x.stride(0) == n * e) return x;
  buf = module_contiguous_copy<T>(x);
  return buf.cview();
}

/// nn.Linear's default initialisation, kaiming_uniform_(a = sqrt(5)): the bound
/// gain * sqrt(3 / fan_in) with gain sqrt(2 / (1 + 5)) is 1 / sqrt(fan_in).
template <class T>
void module_init_linear(Rng& rng, T* w, index_t out, index_t in) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  for (index_t i = 0; i < out * in; ++i) w[i] = static_cast<T>(rng.uniform(-bound, bound));
}

template <class T>
void module_init_normal(Rng& rng, T* v, index_t n, double stddev) {
  for (index_t i = 0; i < n; ++i) v[i] = static_cast<T>(stddev * rng.normal());
}

/// A parameter of a layer: its state_dict name, PyTorch shape and storage.
template <class T>
struct ModuleParam {
  std::string name;
  std::vector<index_t> shape;
  T* data;
  index_t numel() const {
    index_t n = 1;
    for (index_t e : shape) n *= e;
    return n;
  }
};

/// Selects a layer's constructor that allocates the parameters and leaves them
/// zero, for a constructor that fills them itself.
struct ModuleNoInit {};

/// Copies the parameters `src` of a layer of another type into `dst`, the
/// same list of a layer of T (same config), each element converted once
/// (convert_row: to nearest even when T is narrower).
template <class U, class T>
void module_convert_params(const std::vector<ModuleParam<const U>>& src,
                           const std::vector<ModuleParam<T>>& dst) {
  for (std::size_t i = 0; i < dst.size(); ++i)
    convert_row(src[i].data, dst[i].numel(), dst[i].data);
}

/// Total element count of a set of shapes.
inline index_t module_count(const std::map<std::string, std::vector<index_t>>& shapes) {
  index_t total = 0;
  for (const auto& kv : shapes) {
    index_t n = 1;
    for (const index_t e : kv.second) n *= e;
    total += n;
  }
  return total;
}

/// How one parameter is found in a file: the tensor name (without prefix) and
/// an optional row permutation applied after conversion (row r of the parameter
/// is row row_perm[r] of the file's tensor).
struct ModuleSource {
  std::string file_name;
  bool required = true;           // false: absent means "set to fill_value"
  double fill_value = 1;          // for a parameter the file's convention lacks
  std::vector<index_t> row_perm;  // empty: identity
};

/// Loads every parameter from `path` or changes nothing: every tensor is looked
/// up, its shape and dtype checked and its data read and converted before any
/// parameter is written. `sources` maps each parameter name to where it is found.
template <class T>
void module_load(const char* fn, const std::string& path, const std::string& prefix,
                 const std::vector<ModuleParam<T>>& params,
                 const std::map<std::string, ModuleSource>& sources) {
  const safetensors::Reader reader(path, fn);
  // A biased projection would be silently wrong without its bias: refuse it.
  for (const auto& kv : sources) {
    const std::string& w = kv.second.file_name;
    const std::string::size_type dot = w.rfind(".weight");
    if (dot == std::string::npos || dot + 7 != w.size()) continue;
    const std::string bias = prefix + w.substr(0, dot) + ".bias";
    if (reader.contains(bias))
      fail(fn, "'", path, "': the file has '", bias,
           "', but the layer's projections have no bias; no parameter was changed");
  }
  std::string missing, mismatched;
  for (const ModuleParam<T>& p : params) {
    const ModuleSource& src = sources.at(p.name);
    const std::string name = prefix + src.file_name;
    if (!reader.contains(name)) {
      if (src.required)
        missing +=
            cat(missing.empty() ? "" : ", ", "'", name, "' ", safetensors::shape_str(p.shape));
      continue;
    }
    const safetensors::TensorInfo& info = reader.info(name);
    if (info.shape != p.shape)
      mismatched +=
          cat(mismatched.empty() ? "" : "; ", "tensor '", name, "' has shape ",
              safetensors::shape_str(info.shape), ", expected ", safetensors::shape_str(p.shape));
    else if (!safetensors::is_float_dtype(info.dtype))
      mismatched += cat(mismatched.empty() ? "" : "; ", "tensor '", name, "' has dtype ",
                        info.dtype, ", expected F16, BF16, F32 or F64");
  }
  if (!missing.empty())
    fail(fn, "'", path, "': missing tensor", missing.find(", ") == std::string::npos ? " " : "s ",
         missing, " (prefix '", prefix, "'); no parameter was changed");
  if (!mismatched.empty()) fail(fn, "'", path, "': ", mismatched, "; no parameter was changed");

  std::vector<std::vector<T>> staged;
  staged.reserve(params.size());
  for (const ModuleParam<T>& p : params) {
    const ModuleSource& src = sources.at(p.name);
    const std::string name = prefix + src.file_name;
    if (!reader.contains(name)) {
      staged.emplace_back(static_cast<std::size_t>(p.numel()), static_cast<T>(src.fill_value));
      continue;
    }
    std::vector<T> v = reader.read_as<T>(name);
    if (!src.row_perm.empty()) {
      const std::size_t rows = src.row_perm.size(), width = v.size() / rows;
      std::vector<T> permuted(v.size());
      for (std::size_t r = 0; r < rows; ++r)
        std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(
                                    static_cast<std::size_t>(src.row_perm[r]) * width),
                    width, permuted.begin() + static_cast<std::ptrdiff_t>(r * width));
      v.swap(permuted);
    }
    staged.push_back(std::move(v));
  }
  for (std::size_t i = 0; i < params.size(); ++i)
    std::copy(staged[i].begin(), staged[i].end(), params[i].data);
}

/// Writes every parameter as prefix + name in T's dtype (a 16-bit T: BF16 or
/// F16, bit for bit), with metadata format=pt.
template <class T>
void module_save(const std::string& path, const std::string& prefix,
                 const std::vector<ModuleParam<const T>>& params) {
  std::map<std::string, safetensors::TensorData> tensors;
  for (const ModuleParam<const T>& p : params)
    tensors[prefix + p.name] = safetensors::make_tensor<T>(p.shape, p.data);
  write_safetensors(path, tensors, {{"format", "pt"}});
}

/// Row permutation of a (heads * width, in) weight into the V1 pair order, from
/// the DiffLlama order. DiffLlama keeps the two maps of a pair in the first and
/// second half of its heads (head j and j + heads/2) and rotates each head with
/// rotate-half (feature i with i + width/2); V1 keeps them as heads 2j, 2j + 1
/// and rotates interleaved pairs (2i, 2i + 1). Native row (2j + m, 2i + r) takes
/// DiffLlama row (j + m * heads/2, i + r * width/2).
inline std::vector<index_t> module_diffllama_qk_perm(index_t heads, index_t width) {
  const index_t half_heads = heads / 2, half = width / 2;
  std::vector<index_t> perm(static_cast<std::size_t>(heads * width));
  for (index_t j = 0; j < half_heads; ++j)
    for (index_t m = 0; m < 2; ++m)
      for (index_t i = 0; i < half; ++i)
        for (index_t r = 0; r < 2; ++r) {
          perm[(2 * j + m) * width + 2 * i + r] = (j + m * half_heads) * width + i + r * half;
        }
  return perm;
}

/// Row permutation of v_proj (kv_heads * 2 * width, in) from DiffLlama's order:
/// the value of kv pair g is the concatenation of its heads g and g + kv_heads.
inline std::vector<index_t> module_diffllama_v_perm(index_t kv_heads, index_t width) {
  std::vector<index_t> perm(static_cast<std::size_t>(2 * kv_heads * width));
  for (index_t g = 0; g < kv_heads; ++g)
    for (index_t m = 0; m < 2; ++m)
      for (index_t t = 0; t < width; ++t) {
        perm[g * 2 * width + m * width + t] = (g + m * kv_heads) * width + t;
      }
  return perm;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
