// 16-bit layers: MultiheadDiffAttnV1 and MultiheadDiffAttnV2 with bfloat16 or
// half parameters, input and output (module_v1.hpp, module_v2.hpp), against
// the float64 layer built from the same rounded parameters on the same rounded
// input; cached and packed forwards; safetensors; parameter bytes.
//
// Error bound. A 16-bit layer widens its parameters and x exactly to float
// (where the projections pack them), computes every intermediate (q, k, v,
// lambda, the attention output, the norm) in float as the float layer does,
// and rounds once: each element of y, relative u = 2^-8 (bfloat16) or 2^-11
// (half). Its twins MultiheadDiffAttnV1<float>(m) and <double>(m) hold the
// same values exactly. So with y_f the float twin's output on the widened x,
// y the float64 twin's and e_f = max|y_f - y| / max|y| (the float layer's own
// error, held to 1e-4 as in test_module.cpp),
//   y_S = round_S(y_f)   (bitwise: the statement the bound rests on)
//   max|y_S - y| / max|y| <= u (1 + e_f) + e_f,
// since |round_S(a) - a| <= u |a| and max|y_f| <= (1 + e_f) max|y|.
// Where bfloat16 runs on bf16 dot products (AVX512-BF16 builds: the
// projections and the attention products), y_S rounds another float result
// y_d: the same exact products summed in another order, whose error obeys the
// float path's bound; with e_f standing for that bound (measured), the check
// is max|y_S - y| / max|y| <= u (1 + 2 e_f) + 2 e_f, y_S != round_S(y_f) allowed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/io/safetensors.hpp>
#include <diffattn/module.hpp>
#include <diffattn/types.hpp>

#include "attention_support.hpp"
#include "half_support.hpp"
#include "support.hpp"

using diffattn::bfloat16;
using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::half;
using diffattn::index_t;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;
using diffattn::TensorView;
using test::bitwise_equal;
using test::cast;
using test::random_tensor;
using test::rel_error;
using test::type_name;
using test::unit_roundoff;

namespace {

/// The float layer's error against float64 (test_module.cpp's tolerance).
constexpr double kFloatLayerTol = 1e-4;

/// Moves every parameter of a float layer off its initial values: lambda
/// vectors N(0, 0.3^2), subln.weight 1 + N(0, 0.3^2), projections kept.
template <class Layer>
void randomize_small(Layer& m, std::uint64_t seed) {
  diffattn::detail::Rng rng(seed);
  for (auto& kv : m.parameters()) {
    const bool vec = kv.first.rfind("lambda_", 0) == 0 && kv.first != "lambda_proj.weight";
    if (!vec && kv.first != "subln.weight") continue;
    for (index_t i = 0; i < kv.second.size(); ++i)
      kv.second(i) =
          static_cast<float>((kv.first == "subln.weight" ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
}

/// Every parameter's bits, by name.
template <class Layer>
std::map<std::string, std::vector<unsigned char>> bits(Layer&& m) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (auto& kv : m.parameters()) {
    const auto* p = reinterpret_cast<const unsigned char*>(kv.second.data());
    out[kv.first].assign(p, p + kv.second.size() * sizeof(*kv.second.data()));
  }
  return out;
}

/// Bytes of all parameters.
template <class Layer>
std::size_t parameter_bytes(Layer&& m) {
  std::size_t n = 0;
  for (auto& kv : m.parameters())
    n += static_cast<std::size_t>(kv.second.size()) * sizeof(*kv.second.data());
  return n;
}

/// Tokens [a, a + n) of x (B, N, E), a strided view.
template <class T>
TensorView<const T, 3> tokens(const Tensor<T, 3>& x, index_t a, index_t n) {
  const index_t len = x.shape(1), e = x.shape(2);
  return TensorView<const T, 3>(x.data() + a * e, {x.shape(0), n, e}, {len * e, e, 1});
}

/// max |y - full[:, a : a + n, :]| and max |full[:, a : a + n, :]|.
template <class T>
std::pair<double, double> diff_max(const Tensor<T, 3>& y, const Tensor<T, 3>& full, index_t a) {
  double num = 0, den = 0;
  for (index_t b = 0; b < y.shape(0); ++b)
    for (index_t i = 0; i < y.shape(1); ++i)
      for (index_t e = 0; e < y.shape(2); ++e) {
        const double want = static_cast<double>(full(b, a + i, e));
        num = std::max(num, std::abs(static_cast<double>(y(b, i, e)) - want));
        den = std::max(den, std::abs(want));
      }
  return {num, den};
}

/// The 16-bit layer made from a randomised float one against its float64
/// twin, on x of S (B, N, E); see the bound at the top.
template <class S, template <class> class Layer, class Config>
double check_forward(const Config& cfg, index_t b, index_t n, std::uint64_t seed) {
  Layer<float> trained(cfg, seed);
  randomize_small(trained, seed + 1);
  Layer<S> m(trained);
  Layer<float> mf(m);
  Layer<double> md(m);
  const index_t e = cfg.embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({b, n, e}, seed + 2));
  const Tensor<S, 3> y = m.forward(x);
  const Tensor<float, 3> yf = mf.forward(cast<float>(x));
  const Tensor<double, 3> yd = md.forward(cast<double>(x));
  const double u = unit_roundoff<S>(), e_f = rel_error(yf, yd), err = rel_error(y, yd);
  INFO(type_name<S>() << " B=" << b << " N=" << n << " E=" << e << ": e_f = " << e_f
                      << ", error = " << err << " = " << err / u << " u");
  CHECK(e_f < kFloatLayerTol);
  if (test::bf16_dot<S>()) {
    CHECK(err <= u * (1 + 2 * e_f) + 2 * e_f);
  } else {
    CHECK(bitwise_equal(y, cast<S>(yf)));
    CHECK(err <= u * (1 + e_f) + e_f);
  }
  CHECK(err > 0);  // y is rounded: not the float64 result
  // one thread or two: the same bits
  m.set_num_threads(1);
  const Tensor<S, 3> y1 = m.forward(x);
  m.set_num_threads(2);
  CHECK(bitwise_equal(y1, m.forward(x)));
  return err / u;
}

DiffAttnV1Config v1(index_t e, index_t h, index_t hkv) {
  DiffAttnV1Config c;
  c.embed_dim = e;
  c.num_heads = h;
  c.num_kv_heads = hkv;
  c.depth = 2;
  return c;
}

DiffAttnV2Config v2(index_t e, index_t h, index_t hkv, index_t hd = 0) {
  DiffAttnV2Config c;
  c.embed_dim = e;
  c.num_heads = h;
  c.num_kv_heads = hkv;
  c.head_dim = hd;
  return c;
}

template <class S>
void forward_cases() {
  double worst = 0;
  std::uint64_t seed = 91000;
  // V1: MHA with rope; GQA without rope and with a window; non-causal; a
  // head width of 10; 106 rows (the projections' packed path; fewer rows
  // take dot products).
  DiffAttnV1Config c = v1(32, 2, 2);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 13, seed += 10));
  c = v1(48, 4, 2);
  c.rope = false;
  c.window_left = 4;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 3, 7, seed += 10));
  c = v1(32, 2, 1);
  c.causal = false;
  c.norm_affine = false;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 11, seed += 10));
  c = v1(40, 2, 1);
  c.depth = 5;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV1>(c, 2, 53, seed += 10));
  // V2: MHA with rope; GQA 4 / 2 with a window; head_dim 7 without rope,
  // non-causal; 106 rows.
  DiffAttnV2Config d = v2(24, 2, 2);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 2, 9, seed += 10));
  d = v2(32, 4, 2);
  d.window_left = 3;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 3, 17, seed += 10));
  d = v2(30, 3, 1, 7);
  d.rope = false;
  d.causal = false;
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 1, 5, seed += 10));
  d = v2(24, 4, 1);
  worst = std::max(worst, check_forward<S, MultiheadDiffAttnV2>(d, 2, 53, seed += 10));
  INFO(type_name<S>() << ": largest error " << worst << " u");
  CHECK(worst <= 1.1);  // u (1 + e_f) + e_f with e_f < 1e-4: at most 1.03 u (half)
}

/// Prefill then decoding of a 16-bit layer against its forward on the whole
/// sequence.
///
/// Bound. Both outputs are rounded once to S. Before that rounding they
/// differ only by the cache: each cached key and value is rounded once to S,
/// which moves the float output by at most 8 u max|y| (the first-order bound
/// of test_half.cpp for layers with default weights, inputs of sigma 0.5 and
/// d = 8..16), plus the float kernels' own 1e-5. Hence, a and b the float
/// outputs, |round(b) - round(a)| <= u |b| + |b - a| + u |a|, and relative to
/// max|y| >= (1 - u) max|a|:
///   (u (2 + 8 u + 1e-5) + 8 u + 1e-5) / (1 - u),  about 10 u.
/// A float cache (make_cache<float>) keeps the keys and values exact: the
/// float outputs differ by 1e-5 at most, (2 u + 1e-5 (1 + u)) / (1 - u).
/// And as for forward, each cached call is bitwise the float twin's with a
/// cache of the same type, rounded to S.
template <template <class> class Layer, class S>
Layer<float> float_twin(const Layer<S>& m) {
  return Layer<float>(m);
}

template <class S, class Layer>
double check_cached(Layer& m, const std::vector<index_t>& chunks, std::uint64_t seed) {
  index_t total = 0;
  for (index_t c : chunks) total += c;
  const index_t b = 2, e = m.config().embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({b, total, e}, seed, 0.5));
  const Tensor<S, 3> full = m.forward(x);
  auto cache = m.make_cache(b, total + 3);
  static_assert(std::is_same<decltype(cache), diffattn::KVCache<S>>::value, "a cache of S");
  auto cache_f = m.template make_cache<float>(b, total + 3);
  REQUIRE(cache.bytes() * 2 == cache_f.bytes());
  auto mf = float_twin(m);
  auto twin_cache = mf.template make_cache<S>(b, total + 3);
  const Tensor<float, 3> xf = cast<float>(x);
  const double u = unit_roundoff<S>();
  const double tol = (u * (2 + 8 * u + 1e-5) + 8 * u + 1e-5) / (1 - u);
  const double tol_f = (2 * u + 1e-5 * (1 + u)) / (1 - u);
  double worst = 0;
  index_t a = 0;
  for (index_t c : chunks) {
    INFO(type_name<S>() << " layer, chunk of " << c << " at " << a);
    const Tensor<S, 3> y = m.forward(tokens(x, a, c), cache);
    CHECK(bitwise_equal(y, cast<S>(mf.forward(tokens(xf, a, c), twin_cache))));
    const auto dm = diff_max(y, full, a);
    worst = std::max(worst, dm.first / dm.second);
    CHECK(dm.first <= tol * dm.second);
    const auto df = diff_max(m.forward(tokens(x, a, c), cache_f), full, a);
    CHECK(df.first <= tol_f * df.second);
    a += c;
    CHECK(cache.size() == a);
  }
  INFO("largest relative difference " << worst / u << " u (tolerance " << tol / u << " u)");
  CHECK(worst > 0);
  return worst / u;
}

std::vector<index_t> prefill_then_decode(index_t prefill, index_t decode) {
  std::vector<index_t> c = {prefill};
  for (index_t i = 0; i < decode; ++i) c.push_back(1);
  return c;
}

/// The packed forward of a 16-bit layer against one forward per sequence.
/// Each is the float computation rounded once; the float values differ only
/// by the float kernels' order of sums (the packed batch may take the
/// projections' packed path where a short sequence takes dot products),
/// 1e-5 at most: (2 u + 1e-5 (1 + u)) / (1 - u) relative to max|y|. And the
/// packed forward is bitwise the float twin's packed forward, rounded.
template <class S, template <class> class Layer, class Config>
void check_packed(const Config& cfg, const std::vector<index_t>& lengths, std::uint64_t seed) {
  Layer<S> m(Layer<float>(cfg, seed));
  diffattn::PackedSequences seqs;
  seqs.cu_seqlens_q = {0};
  for (index_t l : lengths) seqs.cu_seqlens_q.push_back(seqs.cu_seqlens_q.back() + l);
  const index_t total = seqs.cu_seqlens_q.back(), e = cfg.embed_dim;
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({1, total, e}, seed + 1));
  const Tensor<S, 3> y = m.forward(x, seqs);
  Layer<float> mf(m);
  CHECK(bitwise_equal(y, cast<S>(mf.forward(cast<float>(x), seqs))));
  const double u = unit_roundoff<S>(), tol = (2 * u + 1e-5 * (1 + u)) / (1 - u);
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    const index_t a = seqs.cu_seqlens_q[s], n = lengths[s];
    if (n == 0) continue;
    INFO(type_name<S>() << " sequence " << s << " of " << n << " tokens");
    const Tensor<S, 3> ys = m.forward(tokens(x, a, n));
    const auto dm = diff_max(ys, y, a);
    CHECK(dm.first <= tol * dm.second);
  }
}

std::string temp_path(const std::string& name) {
  return "diffattn_test_layers_half_" + name + ".safetensors";
}

/// A V1 layer's parameters in DiffLlama's layout (the inverse of the
/// documented permutation: native q row (2j + m, 2i + r) is DiffLlama row
/// (j + m heads/2, i + r d/2); the value of pair g is heads g and g + Hkv),
/// written as S tensors under `prefix`.
template <class S>
void write_diffllama(MultiheadDiffAttnV1<S>& m, const std::string& path,
                     const std::string& prefix) {
  namespace st = diffattn::safetensors;
  const index_t d = m.head_dim(), e = m.config().embed_dim, hkv = m.config().num_kv_heads;
  auto params = m.parameters();
  auto qk = [&](const std::string& name, index_t heads) {
    const S* w = params.at(name).data();
    std::vector<S> hf(static_cast<std::size_t>(heads * d * e));
    for (index_t j = 0; j < heads / 2; ++j)
      for (index_t mm = 0; mm < 2; ++mm)
        for (index_t i = 0; i < d / 2; ++i)
          for (index_t r = 0; r < 2; ++r)
            std::copy_n(w + ((2 * j + mm) * d + 2 * i + r) * e, e,
                        hf.begin() + ((j + mm * heads / 2) * d + i + r * d / 2) * e);
    return st::make_tensor<S>({heads * d, e}, hf.data());
  };
  std::map<std::string, st::TensorData> file;
  file[prefix + "q_proj.weight"] = qk("q_proj.weight", 2 * m.config().num_heads);
  file[prefix + "k_proj.weight"] = qk("k_proj.weight", 2 * hkv);
  const S* wv = params.at("v_proj.weight").data();
  std::vector<S> hv(static_cast<std::size_t>(2 * hkv * d * e));
  for (index_t g = 0; g < hkv; ++g)
    for (index_t mm = 0; mm < 2; ++mm)
      std::copy_n(wv + (g * 2 * d + mm * d) * e, d * e, hv.begin() + (g + mm * hkv) * d * e);
  file[prefix + "v_proj.weight"] = st::make_tensor<S>({2 * hkv * d, e}, hv.data());
  file[prefix + "o_proj.weight"] =
      st::make_tensor<S>({e, 2 * m.config().num_heads * d}, params.at("out_proj.weight").data());
  for (const char* n : {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"})
    file[prefix + n] = st::make_tensor<S>({d}, params.at(n).data());
  diffattn::write_safetensors(path, file);
}

template <class S>
void check_safetensors() {
  namespace st = diffattn::safetensors;
  const std::string path = temp_path(type_name<S>());
  const char* dtype = std::is_same<S, bfloat16>::value ? "BF16" : "F16";
  DiffAttnV1Config c = v1(32, 2, 1);
  MultiheadDiffAttnV1<float> trained(c, 5);
  randomize_small(trained, 6);
  MultiheadDiffAttnV1<S> a(trained), b(c, 7);
  REQUIRE(bits(a) != bits(b));

  // native layout: S's dtype written and read back bit for bit
  a.save_safetensors(path, "model.layers.2.self_attn.");
  {
    const st::Reader r(path);
    CHECK(r.tensors().size() == 9);
    for (auto& kv : a.parameters()) {
      INFO(kv.first);
      const st::TensorData t = r.read("model.layers.2.self_attn." + kv.first);
      CHECK(t.dtype == dtype);
      REQUIRE(t.bytes.size() == static_cast<std::size_t>(2 * kv.second.size()));
      // little-endian bytes of the parameter's own bits
      for (index_t i = 0; i < kv.second.size(); ++i) {
        std::uint16_t u16;
        std::memcpy(&u16, static_cast<const void*>(kv.second.data() + i), 2);
        CHECK(t.bytes[2 * i] + 256 * t.bytes[2 * i + 1] == u16);
      }
    }
  }
  b.load_safetensors(path, "model.layers.2.self_attn.");
  CHECK(bits(a) == bits(b));
  const Tensor<S, 3> x = cast<S>(random_tensor<float, 3>({2, 9, 32}, 8));
  CHECK(bitwise_equal(a.forward(x), b.forward(x)));

  // DiffLlama layout (subln.weight is ones there: the layer's default)
  MultiheadDiffAttnV1<S> native(c, 9), loaded(trained);
  write_diffllama(native, path, "model.layers.2.self_attn.");
  loaded.load_safetensors(path, "model.layers.2.self_attn.", diffattn::WeightLayout::diffllama);
  CHECK(bits(loaded) == bits(native));

  // F32 into the 16-bit layer: each value rounded to nearest even, once
  trained.save_safetensors(path);
  MultiheadDiffAttnV1<S> from_f32(c, 10);
  from_f32.load_safetensors(path);
  CHECK(bits(from_f32) == bits(a));
  auto pf = trained.parameters();
  index_t rounded = 0;
  for (auto& kv : from_f32.parameters())
    for (index_t i = 0; i < kv.second.size(); ++i) {
      const float want = pf.at(kv.first)(i);
      REQUIRE(std::memcmp(&kv.second(i), &static_cast<const S&>(S(want)), 2) == 0);
      rounded += static_cast<float>(kv.second(i)) != want;
    }
  CHECK(rounded > 1000);  // most of the 4096 + 72 values were not exact in S

  // V2: own dtype bit for bit, F32 rounded
  DiffAttnV2Config d = v2(24, 4, 2);
  MultiheadDiffAttnV2<float> t2(d, 11);
  MultiheadDiffAttnV2<S> a2(t2), b2(d, 12), c2(d, 13);
  a2.save_safetensors(path, "blk.");
  CHECK(st::Reader(path).info("blk.lambda_proj.weight").dtype == dtype);
  b2.load_safetensors(path, "blk.");
  CHECK(bits(a2) == bits(b2));
  t2.save_safetensors(path);
  c2.load_safetensors(path);
  CHECK(bits(c2) == bits(a2));
  std::remove(path.c_str());
}

}  // namespace

TEST_CASE("16-bit layers against the float64 layer on the same rounded values", "[layers][half]") {
  forward_cases<bfloat16>();
  forward_cases<half>();
}

TEST_CASE("16-bit layers decode against a cache of their type", "[layers][half][kvcache]") {
  std::uint64_t seed = 92000;
  double worst = 0;
  for (index_t hkv : {2, 1}) {
    DiffAttnV1Config c1 = v1(32, 2, hkv);
    c1.depth = 3;
    MultiheadDiffAttnV1<bfloat16> m1(c1, seed++);
    worst = std::max(worst, check_cached<bfloat16>(m1, prefill_then_decode(13, 12), seed++));
    MultiheadDiffAttnV1<half> h1(c1, seed++);
    worst = std::max(worst, check_cached<half>(h1, {1, 1, 70, 5, 1, 2}, seed++));
    MultiheadDiffAttnV2<bfloat16> m2(v2(24, 2, hkv), seed++);
    worst = std::max(worst, check_cached<bfloat16>(m2, prefill_then_decode(9, 15), seed++));
    MultiheadDiffAttnV2<half> h2(v2(24, 2, hkv), seed++);
    worst = std::max(worst, check_cached<half>(h2, {64, 3, 1}, seed++));
  }
  DiffAttnV1Config cw = v1(32, 2, 1);
  cw.window_left = 3;
  MultiheadDiffAttnV1<bfloat16> mw(cw, seed++);
  worst = std::max(worst, check_cached<bfloat16>(mw, prefill_then_decode(7, 30), seed++));
  INFO("largest difference " << worst << " u");
  CHECK(worst < 3);  // measured near 1 u; the bound is about 10 u
}

TEST_CASE("16-bit layers: a packed batch equals one forward per sequence",
          "[layers][half][varlen]") {
  DiffAttnV1Config c1 = v1(32, 2, 1);
  check_packed<bfloat16, MultiheadDiffAttnV1>(c1, {5, 1, 0, 9}, 93000);
  check_packed<half, MultiheadDiffAttnV1>(c1, {40, 1, 59}, 93010);  // 100 rows: packed path
  DiffAttnV2Config c2 = v2(24, 4, 2);
  c2.window_left = 2;
  check_packed<bfloat16, MultiheadDiffAttnV2>(c2, {40, 1, 59}, 93020);
  check_packed<half, MultiheadDiffAttnV2>(c2, {3, 8}, 93030);
}

TEST_CASE("16-bit layers save and load their own dtype bit for bit, round F32",
          "[layers][half][safetensors]") {
  check_safetensors<bfloat16>();
  check_safetensors<half>();
}

TEST_CASE("16-bit layers convert to and from float, and hold half the bytes", "[layers][half]") {
  // E = 64, 4 DIFF heads on 2 kv pairs: q and out 64 x 64, k and v 32 x 64
  const DiffAttnV1Config c = v1(64, 4, 2);
  MultiheadDiffAttnV1<float> f(c, 21);
  MultiheadDiffAttnV1<bfloat16> b(f), seeded(c, 21);
  MultiheadDiffAttnV1<half> h(f);
  // the seed draws the float layer's values, rounded
  CHECK(bits(b) == bits(seeded));
  // widening is exact, and rounding it again gives the same bits
  MultiheadDiffAttnV1<double> wide(b);
  CHECK(bits(MultiheadDiffAttnV1<bfloat16>(wide)) == bits(b));
  CHECK(bits(MultiheadDiffAttnV1<bfloat16>(MultiheadDiffAttnV1<float>(b))) == bits(b));
  auto pb = b.parameters();
  for (auto& kv : wide.parameters())
    for (index_t i = 0; i < kv.second.size(); ++i)
      REQUIRE(kv.second(i) == static_cast<double>(static_cast<float>(pb.at(kv.first)(i))));
  CHECK(b.num_parameters() == f.num_parameters());
  CHECK(b.num_parameters() == 4 * 64 * 64 - 2 * 32 * 64 + 4 * 8 + 16);
  CHECK(parameter_bytes(b) * 2 == parameter_bytes(f));
  CHECK(parameter_bytes(h) * 2 == parameter_bytes(f));
  CHECK(parameter_bytes(b) == static_cast<std::size_t>(2 * b.num_parameters()));
  CHECK(b.lambda_full() == Approx(static_cast<double>(f.lambda_full())).epsilon(0.05));
  static_assert(std::is_same<decltype(b.lambda_full()), float>::value, "lambda in float");
  static_assert(std::is_same<MultiheadDiffAttnV1<half>::compute_type, float>::value, "");
  static_assert(std::is_same<MultiheadDiffAttnV1<double>::compute_type, double>::value, "");

  const DiffAttnV2Config c2 = v2(64, 4, 2);
  MultiheadDiffAttnV2<float> f2(c2, 22);
  MultiheadDiffAttnV2<bfloat16> b2(f2), seeded2(c2, 22);
  CHECK(bits(b2) == bits(seeded2));
  CHECK(parameter_bytes(b2) * 2 == parameter_bytes(f2));
  CHECK(parameter_bytes(MultiheadDiffAttnV2<half>(f2)) * 2 == parameter_bytes(f2));
  // the attention maps come in float
  const Tensor<bfloat16, 3> x = cast<bfloat16>(random_tensor<float, 3>({1, 6, 64}, 23));
  const Tensor<float, 4> w = b2.attention_maps(x);
  CHECK(w.shape() == std::array<index_t, 4>{1, 4, 6, 6});
  const Tensor<float, 4> wf = MultiheadDiffAttnV2<float>(b2).attention_maps(cast<float>(x));
  if (test::bf16_dot<bfloat16>())  // products on bf16 dot products: float sums in another order
    CHECK(rel_error(w, wf) < 1e-5);
  else
    CHECK(bitwise_equal(w, wf));
}

TEST_CASE("16-bit layers: bad input names the argument and the shapes", "[layers][half][errors]") {
  MultiheadDiffAttnV1<bfloat16> m(v1(32, 2, 1), 1);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 31}));
      },
      {"MultiheadDiffAttnV1::forward", "x has shape (2, 5, 31)", "(B, N, 32)"});
  diffattn::PackedSequences seqs;
  seqs.cu_seqlens_q = {0, 3, 5};
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 32}), seqs);
      },
      {"MultiheadDiffAttnV1::forward", "(1, T, E)", "(2, 5, 32)"});
  auto cache = m.make_cache(2, 4);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({2, 5, 32}), cache);
      },
      {"MultiheadDiffAttnV1::forward", "cannot append 5 tokens", "capacity 4"});
  CHECK(cache.size() == 0);
  test::require_error(
      [&] {
        m.forward(Tensor<bfloat16, 3>({3, 1, 32}), cache);
      },
      {"x has shape (3, 1, 32)", "batch 2"});
  MultiheadDiffAttnV2<half> m2(v2(24, 2, 2), 1);
  auto other = MultiheadDiffAttnV2<half>(v2(24, 2, 1), 1).make_cache(1, 8);
  test::require_error(
      [&] {
        m2.forward(Tensor<half, 3>({1, 1, 24}), other);
      },
      {"MultiheadDiffAttnV2::forward", "make_cache"});

  // a BF16 file of the wrong shape changes nothing
  namespace st = diffattn::safetensors;
  const std::string path = temp_path("errors");
  MultiheadDiffAttnV1<bfloat16> small(v1(16, 2, 1), 2);
  small.save_safetensors(path);
  const auto before = bits(m);
  test::require_error(
      [&] { m.load_safetensors(path); },
      {"MultiheadDiffAttnV1::load_safetensors", "'q_proj.weight' has shape (16, 16)",
       "expected (32, 32)", "no parameter was changed"});
  CHECK(bits(m) == before);
  std::remove(path.c_str());
}
