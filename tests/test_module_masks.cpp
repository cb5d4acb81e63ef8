// Layers with sliding windows and packed batches: a windowed layer's token i
// equals the global layer run on the window's tokens alone, and a packed
// forward / backward equals one call per sequence.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/module.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::index_t;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::PackedSequences;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;

namespace {

/// Rows [r0, r0 + n) of x (1, T, E) as a (1, n, E) view.
template <class T>
TensorView<const T, 3> rows(const Tensor<T, 3>& x, index_t r0, index_t n) {
  return TensorView<const T, 3>(x.data() + r0 * x.shape(2), {1, n, x.shape(2)});
}

double max_abs(const double* a, const double* b, index_t n) {
  double m = 0;
  for (index_t i = 0; i < n; ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

/// Token i of a causal layer with a window of W tokens (window_left = W - 1)
/// equals the last token of the same layer without a window run on tokens
/// i - W + 1 .. i alone, at their positions (rotary is relative).
template <class Layer>
void check_window_equivalence(Layer& windowed, Layer& global, index_t W) {
  const index_t N = 23, E = windowed.config().embed_dim;
  const auto x = random_tensor<double, 3>({1, N, E}, 9101);
  const Tensor<double, 3> y = windowed.forward(x);
  for (index_t i = 0; i < N; ++i) {
    const index_t start = std::max<index_t>(0, i - W + 1), len = i - start + 1;
    const Tensor<double, 3> yi = global.forward(rows(x, start, len), start);
    INFO("token " << i << " window start " << start);
    CHECK(max_abs(&y(0, i, 0), &yi(0, len - 1, 0), E) < 1e-12);
  }
}

template <class Layer>
std::map<std::string, std::vector<double>> grads_of(Layer& m) {
  std::map<std::string, std::vector<double>> g;
  for (auto& kv : m.gradients())
    g[kv.first] = std::vector<double>(kv.second.data(), kv.second.data() + kv.second.size());
  return g;
}

/// A packed forward and backward equals one call per sequence; gradients of
/// the parameters are the sum over the sequences.
template <class Layer>
void check_packed(Layer& m, const std::vector<index_t>& lengths) {
  const auto seqs = PackedSequences::from_lengths(lengths);
  const index_t T = seqs.cu_seqlens_q.back(), E = m.config().embed_dim;
  const auto x = random_tensor<double, 3>({1, T, E}, 9201);
  const auto dy = random_tensor<double, 3>({1, T, E}, 9202);
  m.zero_grad();
  const Tensor<double, 3> y = m.forward(x, seqs);
  const Tensor<double, 3> dx = m.backward(dy);
  const auto packed_grads = grads_of(m);
  m.zero_grad();
  for (index_t s = 0; s < seqs.size(); ++s) {
    const index_t r0 = seqs.cu_seqlens_q[s], n = seqs.cu_seqlens_q[s + 1] - r0;
    INFO("sequence " << s << " of length " << n);
    const Tensor<double, 3> ys = m.forward(rows(x, r0, n));
    CHECK(max_abs(&y(0, r0, 0), ys.data(), n * E) < 1e-12);
    const Tensor<double, 3> dxs = m.backward(rows(dy, r0, n));
    CHECK(max_abs(&dx(0, r0, 0), dxs.data(), n * E) < 1e-12);
  }
  const auto summed = grads_of(m);
  for (const auto& kv : packed_grads) {
    INFO(kv.first);
    const auto& want = summed.at(kv.first);
    double scale = 1;
    for (double v : want) scale = std::max(scale, std::abs(v));
    CHECK(max_abs(kv.second.data(), want.data(), static_cast<index_t>(want.size())) <
          1e-12 * scale);
  }
}

}  // namespace

TEST_CASE("a windowed V1 layer equals the global layer on each window", "[module][masks]") {
  for (index_t W : {1, 4, 9}) {
    DiffAttnV1Config cfg;
    cfg.embed_dim = 32;
    cfg.num_heads = 2;
    cfg.num_kv_heads = 1;
    MultiheadDiffAttnV1<double> global(cfg, 21);
    cfg.window_left = W - 1;
    MultiheadDiffAttnV1<double> windowed(cfg, 21);
    INFO("window of " << W << " tokens");
    check_window_equivalence(windowed, global, W);
  }
}

TEST_CASE("a windowed V2 layer equals the global layer on each window", "[module][masks]") {
  for (index_t W : {2, 7}) {
    DiffAttnV2Config cfg;
    cfg.embed_dim = 24;
    cfg.num_heads = 2;
    cfg.num_kv_heads = 1;
    MultiheadDiffAttnV2<double> global(cfg, 22);
    cfg.window_left = W - 1;
    MultiheadDiffAttnV2<double> windowed(cfg, 22);
    INFO("window of " << W << " tokens");
    check_window_equivalence(windowed, global, W);
  }
}

TEST_CASE("packed batches through the layers equal one call per sequence", "[module][packed]") {
  const std::vector<index_t> lengths = {5, 0, 1, 17, 8};
  for (bool rope : {true, false}) {
    DiffAttnV1Config c1;
    c1.embed_dim = 32;
    c1.num_heads = 2;
    c1.num_kv_heads = 1;
    c1.rope = rope;
    MultiheadDiffAttnV1<double> m1(c1, 31);
    check_packed(m1, lengths);
    c1.window_left = 3;
    MultiheadDiffAttnV1<double> w1(c1, 31);
    check_packed(w1, lengths);
    DiffAttnV2Config c2;
    c2.embed_dim = 24;
    c2.num_heads = 2;
    c2.rope = rope;
    MultiheadDiffAttnV2<double> m2(c2, 32);
    check_packed(m2, lengths);
  }
}

TEST_CASE("layers refuse bad windows and packed batches", "[module][masks][errors]") {
  DiffAttnV1Config c1;
  c1.embed_dim = 16;
  c1.num_heads = 2;
  c1.window_right = 1;  // with causal
  test::require_error([&] { MultiheadDiffAttnV1<float> m(c1); },
                      {"MultiheadDiffAttnV1", "causal", "window_right = 1"});
  c1.window_right = -1;
  c1.window_left = -3;
  test::require_error([&] { MultiheadDiffAttnV1<float> m(c1); },
                      {"MultiheadDiffAttnV1", "window_left", "-3"});
  DiffAttnV2Config c2;
  c2.embed_dim = 16;
  c2.num_heads = 2;
  MultiheadDiffAttnV2<float> m2(c2);
  const auto x2 = random_tensor<float, 3>({2, 5, 16}, 9301);
  test::require_error(
      [&] {
        m2.forward(x2, PackedSequences::from_lengths({5, 5}));
      },
      {"MultiheadDiffAttnV2::forward", "(1, T, E)", "(2, 5, 16)"});
  const auto x1 = random_tensor<float, 3>({1, 10, 16}, 9302);
  test::require_error(
      [&] {
        m2.forward(x1, PackedSequences::from_lengths({5, 4}));
      },
      {"MultiheadDiffAttnV2::forward", "cu_seqlens_q[2] = 9", "10 tokens"});
  test::require_error(
      [&] {
        m2.forward(x1, PackedSequences::from_lengths({5, 5}, {6, 4}));
      },
      {"MultiheadDiffAttnV2::forward", "cu_seqlens_k"});
}
