// libFuzzer target: the layers' KV caches driven as an engine drives them.
// A fuzzed V1 or V2 layer (heads, kv heads, head width, rotary on or off, a
// sliding window or none) gets a cache of float, bfloat16 or half for a
// fuzzed batch and capacity, then up to 16 fuzzed calls: forward(x, cache) on
// 0-9 new tokens (x of the wrong width or batch now and then), and clear().
// Every call must run or throw diffattn::error, and the sanitizers check that
// nothing undefined runs. Checked on every call (a failure traps):
//   - a refused call leaves size() and stored() as they were, and it is
//     refused exactly when the tokens do not fit or x does not match;
//   - a float cache's outputs equal the layer's forward on the whole sequence
//     since the last clear() (1e-4 of its largest value), whatever the pieces,
//     so a refused call cannot have changed a held row either;
//   - a 16-bit cache's outputs equal, to 1e-4, those of a twin cache of the
//     same type fed the same tokens one at a time; for V2 they also stay
//     within 8 units of the storage's rounding of the float forward (V1's
//     per-head norm can scale a rounding error up by 1 / sqrt(eps)).
// The layer itself holds float, bfloat16 or half. A half layer computes in
// float and rounds its output once, so with any cache its outputs must equal,
// bit for bit, the rounding of its float twin's (the layer widened, with a
// cache of the same type fed the same tokens). A bfloat16 layer also rounds
// its activations (q, k, v, the lambda logits, the attention output) and
// runs the bfloat16 kernels, so its outputs need only be finite here; their
// accuracy is held to a bound derived from those roundings in
// tests/test_layers_half.cpp. Both must refuse exactly what the twin refuses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <diffattn/module.hpp>
#include <diffattn/types.hpp>

#include "fuzz_input.hpp"

namespace {

using diffattn::index_t;
using diffattn::Tensor;

using fuzz::Input;

/// max |a - b| over a's rows, b's rows [a0, a0 + a.shape(1)); and max |b| there.
struct Diff {
  float diff = 0, scale = 0;
};
Diff compare(const Tensor<float, 3>& a, const Tensor<float, 3>& b, index_t a0) {
  Diff d;
  for (index_t s = 0; s < a.shape(0); ++s)
    for (index_t i = 0; i < a.shape(1); ++i)
      for (index_t e = 0; e < a.shape(2); ++e) {
        const float x = a(s, i, e), y = b(s, a0 + i, e);
        if (!std::isfinite(x)) __builtin_trap();
        d.diff = std::max(d.diff, std::fabs(x - y));
        d.scale = std::max(d.scale, std::fabs(y));
      }
  return d;
}

/// Tokens [a, a + n) of x (B, N, E), as a view (the layers take any strides).
diffattn::TensorView<const float, 3> tokens(const Tensor<float, 3>& x, index_t a, index_t n) {
  const auto& s = x.shape();
  const float* first = x.size() > 0 ? x.data() + a * s[2] : x.data();  // batch 0: no buffer
  return {first, {s[0], n, s[2]}, {s[1] * s[2], s[2], 1}};
}

/// x (B, N, E) with tokens appended.
Tensor<float, 3> joined(const Tensor<float, 3>& x, const Tensor<float, 3>& more) {
  const index_t b = more.shape(0), n = x.shape(1), m = more.shape(1), e = more.shape(2);
  Tensor<float, 3> t({b, n + m, e});
  for (index_t s = 0; s < b; ++s)
    for (index_t e0 = 0; e0 < e; ++e0) {
      for (index_t i = 0; i < n; ++i) t(s, i, e0) = x(s, i, e0);
      for (index_t i = 0; i < m; ++i) t(s, n + i, e0) = more(s, i, e0);
    }
  return t;
}

/// One fuzzed call: clear(), or forward on n new tokens x (B, n, E), now and
/// then of the wrong batch or width. x holds multiples of 1/64 in [-2, 2),
/// exact in bfloat16 and half, so a 16-bit layer and its float twin see the
/// same tokens.
struct Call {
  bool clear = false;
  index_t n = 0;
  bool bad_shape = false;
  Tensor<float, 3> x;
  /// Whether a layer must run it on a cache holding `size` of `capacity`.
  bool valid(index_t size, index_t capacity) const { return !bad_shape && n <= capacity - size; }
};
Call next_call(Input& in, index_t batch, index_t E) {
  Call c;
  const std::uint8_t code = in.u8();
  if (code % 8 == 7) {
    c.clear = true;
    return c;
  }
  c.n = code % 10;
  const bool bad_width = code / 8 % 16 == 5, bad_batch = code / 8 % 16 == 9;
  c.bad_shape = bad_width || bad_batch;
  c.x = Tensor<float, 3>({bad_batch ? batch + 1 : batch, c.n, bad_width ? E + 1 : E});
  for (index_t i = 0; i < c.x.size(); ++i)
    c.x.data()[i] = static_cast<float>(static_cast<int>(in.u8()) - 128) / 64.0f;
  return c;
}

template <class Layer, class S>
void drive(Layer& layer, Input& in, index_t batch, index_t capacity) {
  constexpr bool narrow = !std::is_same<S, float>::value;
  // Against the float forward: to rounding for a float cache; for a 16-bit
  // one, 8 units of its rounding (2^-8 bfloat16, 2^-11 half) for V2, and no
  // bound for V1, whose per-head RMSNorm scales a head's output up by as much
  // as 1 / sqrt(eps) where its two maps nearly cancel (found with E = 1: a
  // bfloat16 cache 0.17 off, half 0.011, the twin below exact).
  constexpr bool v1 = std::is_same<Layer, diffattn::MultiheadDiffAttnV1<float>>::value;
  const float unit = std::is_same<S, diffattn::half>::value ? 0x1p-11f : 0x1p-8f;
  const float bound = !narrow ? 1e-4f : v1 ? INFINITY : 8 * unit;
  const index_t E = layer.config().embed_dim;
  auto cache = layer.template make_cache<S>(batch, capacity);
  auto twin = layer.template make_cache<S>(batch, capacity);  // one token at a time
  Tensor<float, 3> seen({batch, 0, E});                       // tokens since clear()
  for (int op = 0; op < 16 && in.n; ++op) {
    const Call c = next_call(in, batch, E);
    if (c.clear) {
      cache.clear();
      twin.clear();
      seen = Tensor<float, 3>({batch, 0, E});
      continue;
    }
    const Tensor<float, 3>& x = c.x;
    const index_t n = c.n;
    const index_t size = cache.size(), stored = cache.stored();
    const bool valid = c.valid(size, capacity);
    Tensor<float, 3> y;
    try {
      y = layer.forward(x, cache);
    } catch (const diffattn::error&) {
      if (cache.size() != size || cache.stored() != stored) __builtin_trap();
      if (valid) __builtin_trap();  // refused what fits
      continue;
    }
    if (!valid) __builtin_trap();  // accepted what does not
    if (cache.size() != size + n || y.shape(1) != n || y.shape(0) != batch) __builtin_trap();
    if (cache.stored() > cache.size()) __builtin_trap();
    const index_t a = seen.shape(1);
    seen = joined(seen, x);
    const Tensor<float, 3> full = layer.forward(seen);
    const Diff d = compare(y, full, a);
    if (!(d.diff <= bound * std::max(d.scale, 1.0f))) __builtin_trap();
    if (narrow) {
      Tensor<float, 3> one({batch, n, E});
      for (index_t i = 0; i < n; ++i) {
        const Tensor<float, 3> yi = layer.forward(tokens(x, i, 1), twin);
        for (index_t s = 0; s < batch; ++s)
          for (index_t e = 0; e < E; ++e) one(s, i, e) = yi(s, 0, e);
      }
      const Diff t = compare(y, one, 0);
      if (!(t.diff <= 1e-4f * std::max(t.scale, 1.0f))) __builtin_trap();
    }
  }
}

/// A 16-bit layer (T) and its float twin, each with a cache of S, driven by
/// the same calls: every output of a half layer is bitwise the rounding of
/// the twin's to T (a bfloat16 layer's is finite), and a call the one
/// refuses the other refuses, neither cache changed.
template <class T, class S, template <class> class Layer>
void drive_narrow(Layer<T>& layer, Layer<float>& twin, Input& in, index_t batch, index_t capacity) {
  const index_t E = layer.config().embed_dim;
  auto cache = layer.template make_cache<S>(batch, capacity);
  auto cache_f = twin.template make_cache<S>(batch, capacity);
  for (int op = 0; op < 16 && in.n; ++op) {
    const Call c = next_call(in, batch, E);
    if (c.clear) {
      cache.clear();
      cache_f.clear();
      continue;
    }
    const Tensor<float, 3>& x = c.x;
    const index_t n = c.n;
    Tensor<T, 3> xt(x.shape());
    for (index_t i = 0; i < x.size(); ++i) xt.data()[i] = static_cast<T>(x.data()[i]);
    const index_t size = cache.size(), stored = cache.stored();
    const bool valid = c.valid(size, capacity);
    Tensor<T, 3> y;
    try {
      y = layer.forward(xt, cache);
    } catch (const diffattn::error&) {
      if (cache.size() != size || cache.stored() != stored || valid) __builtin_trap();
      continue;
    }
    if (!valid || cache.size() != size + n || y.shape(0) != batch || y.shape(1) != n)
      __builtin_trap();
    Tensor<float, 3> yf;
    try {
      yf = twin.forward(x, cache_f);
    } catch (const diffattn::error&) {
      __builtin_trap();  // the twin refused what the layer ran
    }
    if (cache_f.size() != cache.size() || cache_f.stored() != cache.stored()) __builtin_trap();
    constexpr bool bitwise = !std::is_same<T, diffattn::bfloat16>::value;
    for (index_t i = 0; i < y.size(); ++i) {
      const T want = static_cast<T>(yf.data()[i]);
      if (!std::isfinite(static_cast<float>(y.data()[i]))) __builtin_trap();
      if (bitwise && Eigen::numext::bit_cast<std::uint16_t>(y.data()[i]) !=
                         Eigen::numext::bit_cast<std::uint16_t>(want))
        __builtin_trap();
    }
  }
}

/// f(S{}) for the cache type of `storage` (0 float, 1 bfloat16, 2 half).
template <class F>
void with_storage(int storage, F&& f) {
  switch (storage) {
    case 1:
      return f(diffattn::bfloat16{});
    case 2:
      return f(diffattn::half{});
    default:
      return f(float{});
  }
}

template <class T, template <class> class Layer>
void drive_narrow_any(const Layer<float>& trained, Input& in, int storage, index_t batch,
                      index_t capacity) {
  Layer<T> layer(trained);
  Layer<float> twin(layer);
  layer.set_num_threads(1);
  twin.set_num_threads(1);
  with_storage(storage,
               [&](auto s) { drive_narrow<T, decltype(s)>(layer, twin, in, batch, capacity); });
}

/// The layer of `layer_type` (0 float, 1 bfloat16, 2 half) made from a float
/// one, with a cache of `storage` (0 float, 1 bfloat16, 2 half).
template <template <class> class Layer>
void drive_any(Layer<float>& layer, Input& in, int layer_type, int storage, index_t batch,
               index_t capacity) {
  if (layer_type == 1)
    return drive_narrow_any<diffattn::bfloat16>(layer, in, storage, batch, capacity);
  if (layer_type == 2) return drive_narrow_any<diffattn::half>(layer, in, storage, batch, capacity);
  with_storage(storage,
               [&](auto s) { drive<Layer<float>, decltype(s)>(layer, in, batch, capacity); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  const std::uint8_t shape = in.u8(), dims = in.u8(), more = in.u8();
  const bool v1 = shape & 1, rope = shape & 2;
  const int storage = (shape >> 2) % 3;
  const index_t heads = 1 + (shape >> 4) % 3;
  const index_t kv = (shape >> 6) % 2 ? heads : 1;  // GQA/MQA or one kv head per head
  const index_t hd = 1 + dims % 6;                  // odd widths meet rotary's check
  const index_t embed = 1 + (dims >> 3) % 12;
  const index_t window = more % 4 == 0 ? -1 : static_cast<index_t>(more % 7) - 1;  // -1..5
  const index_t batch = (more >> 3) % 3, capacity = (more >> 5) * 4;               // 0..28
  const std::uint64_t seed = in.u8();
  const int layer_type = static_cast<int>(seed >> 6) % 3;  // float, bfloat16, half
  // The fields both layers' configurations have.
  const auto shaped = [&](auto c) {
    c.embed_dim = embed;
    c.num_heads = heads;
    c.num_kv_heads = kv;
    c.head_dim = hd;
    c.rope = rope;
    c.window_left = window;
    return c;
  };
  try {
    if (v1) {
      diffattn::DiffAttnV1Config c = shaped(diffattn::DiffAttnV1Config{});
      c.depth = static_cast<int>(seed % 4);
      diffattn::MultiheadDiffAttnV1<float> layer(c, seed);
      layer.set_num_threads(1);
      drive_any(layer, in, layer_type, storage, batch, capacity);
    } else {
      diffattn::MultiheadDiffAttnV2<float> layer(shaped(diffattn::DiffAttnV2Config{}), seed);
      layer.set_num_threads(1);
      drive_any(layer, in, layer_type, storage, batch, capacity);
    }
  } catch (const diffattn::error&) {
    // A configuration the layer refuses (odd widths with rotary, and so on).
  }
  return 0;
}
