// A hybrid stack, as long-context models build them: global DIFF V2 layers
// alternating with sliding-window DIFF V2 layers, run over a long sequence
// beside an all-global stack of the same depth. Prints per-layer time and the
// KV memory each layer needs for decoding, and checks the windowed layers
// against a materialised masked reference (the maps W = A1 - lambda A2 with an
// explicit mask, times V, through o_proj).
//
//   ./build/examples/hybrid [--tokens N] [--window W] [--quick]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <diffattn/diffattn.hpp>

using diffattn::DiffAttnV2Config;
using diffattn::index_t;
using diffattn::MultiheadDiffAttnV2;
using diffattn::Tensor;

namespace {

constexpr index_t kEmbed = 256, kHeads = 4, kKvHeads = 2, kHeadDim = 64, kLayers = 4;

DiffAttnV2Config layer_config(index_t window) {
  DiffAttnV2Config c;
  c.embed_dim = kEmbed;
  c.num_heads = kHeads;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  if (window > 0) c.window_left = window - 1;  // W tokens, the current one included
  return c;
}

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

/// The layer's output on x (1, n, E) computed the plain way: the materialised
/// maps (attention_maps: softmax with an explicit mask, A1 - lambda A2), times
/// V = x Wv^T, heads concatenated, through o_proj.
Tensor<float, 3> materialised(MultiheadDiffAttnV2<float>& m, const Tensor<float, 3>& x) {
  const index_t n = x.shape(1), hd = kHeadDim;
  const Tensor<float, 4> w = m.attention_maps(x);  // (1, H, n, n)
  auto params = m.parameters();
  const float* wv = params.at("v_proj.weight").data();                      // (Hkv hd, E)
  const float* wo = params.at("o_proj.weight").data();                      // (E, H hd)
  std::vector<double> v(static_cast<std::size_t>(n * kKvHeads * hd), 0.0);  // (n, Hkv hd)
  for (index_t j = 0; j < n; ++j)
    for (index_t r = 0; r < kKvHeads * hd; ++r) {
      double s = 0;
      for (index_t e = 0; e < kEmbed; ++e) s += double(x(0, j, e)) * wv[r * kEmbed + e];
      v[static_cast<std::size_t>(j * kKvHeads * hd + r)] = s;
    }
  std::vector<double> attn(static_cast<std::size_t>(n * kHeads * hd), 0.0);  // (n, H hd)
  for (index_t h = 0; h < kHeads; ++h) {
    const index_t g = h / (kHeads / kKvHeads);
    for (index_t i = 0; i < n; ++i)
      for (index_t j = 0; j < n; ++j) {
        const double wij = w(0, h, i, j);
        if (wij == 0) continue;
        for (index_t c = 0; c < hd; ++c)
          attn[static_cast<std::size_t>(i * kHeads * hd + h * hd + c)] +=
              wij * v[static_cast<std::size_t>(j * kKvHeads * hd + g * hd + c)];
      }
  }
  Tensor<float, 3> y({1, n, kEmbed});
  for (index_t i = 0; i < n; ++i)
    for (index_t e = 0; e < kEmbed; ++e) {
      double s = 0;
      for (index_t c = 0; c < kHeads * hd; ++c)
        s += attn[static_cast<std::size_t>(i * kHeads * hd + c)] * wo[e * kHeads * hd + c];
      y(0, i, e) = static_cast<float>(s);
    }
  return y;
}

/// Runs the stack x <- x + layer(x) once; returns each layer's time.
std::vector<double> run_stack(std::vector<MultiheadDiffAttnV2<float>>& stack, Tensor<float, 3> x) {
  std::vector<double> ms;
  for (auto& layer : stack) {
    const double t0 = now_ms();
    const Tensor<float, 3> y = layer.forward(x);
    ms.push_back(now_ms() - t0);
    for (index_t i = 0; i < x.size(); ++i) x.data()[i] += y.data()[i];
  }
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  index_t tokens = 8192, window = 512;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      tokens = 2048;
      window = 128;
    } else if (a == "--tokens" && i + 1 < argc) {
      tokens = std::atol(argv[++i]);
    } else if (a == "--window" && i + 1 < argc) {
      window = std::atol(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: hybrid [--tokens N] [--window W] [--quick]\n");
      return 2;
    }
  }
  if (tokens < 1 || window < 1) {
    std::fprintf(stderr, "hybrid: --tokens and --window must be >= 1\n");
    return 2;
  }

  // Layer l of the hybrid stack is global for even l, windowed for odd l; the
  // all-global stack has the same weights with no window.
  std::vector<MultiheadDiffAttnV2<float>> hybrid, global;
  for (index_t l = 0; l < kLayers; ++l) {
    hybrid.emplace_back(layer_config(l % 2 ? window : 0), 100 + static_cast<std::uint64_t>(l));
    global.emplace_back(layer_config(0), 100 + static_cast<std::uint64_t>(l));
  }
  Tensor<float, 3> x({1, tokens, kEmbed});
  diffattn::detail::Rng rng(7);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng.normal());

  std::printf(
      "hybrid stack: %lld DIFF V2 layers (E %lld, %lld heads on %lld kv heads of %lld), "
      "%lld tokens, window %lld tokens on odd layers\n\n",
      (long long)kLayers, (long long)kEmbed, (long long)kHeads, (long long)kKvHeads,
      (long long)kHeadDim, (long long)tokens, (long long)window);
  run_stack(hybrid, x);  // warm-up: scratch buffers, pages
  const std::vector<double> th = run_stack(hybrid, x);
  const std::vector<double> tg = run_stack(global, x);

  // KV cache per layer for decoding: 2 (k and v) x Hkv x head_dim floats per
  // token kept; a windowed layer keeps only its last W tokens.
  const double kv_per_token = 2.0 * kKvHeads * kHeadDim * sizeof(float);
  std::printf("%-6s %-10s %12s %12s %16s %16s\n", "layer", "kind", "hybrid ms", "global ms",
              "hybrid KV MiB", "global KV MiB");
  double sum_h = 0, sum_g = 0, kv_h = 0, kv_g = 0;
  for (index_t l = 0; l < kLayers; ++l) {
    const bool windowed = l % 2 == 1;
    const double kh = kv_per_token * double(windowed ? std::min(window, tokens) : tokens) / 1048576;
    const double kg = kv_per_token * double(tokens) / 1048576;
    std::printf("%-6lld %-10s %12.1f %12.1f %16.2f %16.2f\n", (long long)l,
                windowed ? "window" : "global", th[l], tg[l], kh, kg);
    sum_h += th[l];
    sum_g += tg[l];
    kv_h += kh;
    kv_g += kg;
  }
  std::printf("%-6s %-10s %12.1f %12.1f %16.2f %16.2f\n", "total", "", sum_h, sum_g, kv_h, kv_g);
  std::printf("hybrid / global: time %.2f, KV memory %.2f\n\n", sum_h / sum_g, kv_h / kv_g);

  // Windowed layers against the materialised masked reference on a prefix.
  const index_t n_check = std::min<index_t>(tokens, quick ? 300 : 600);
  Tensor<float, 3> xc({1, n_check, kEmbed});
  std::memcpy(xc.data(), x.data(), sizeof(float) * static_cast<std::size_t>(xc.size()));
  bool ok = true;
  for (index_t l = 1; l < kLayers; l += 2) {
    const Tensor<float, 3> fused = hybrid[static_cast<std::size_t>(l)].forward(xc);
    const Tensor<float, 3> ref = materialised(hybrid[static_cast<std::size_t>(l)], xc);
    double num = 0, den = 0;
    for (index_t i = 0; i < ref.size(); ++i) {
      num = std::max(num, double(std::abs(fused.data()[i] - ref.data()[i])));
      den = std::max(den, double(std::abs(ref.data()[i])));
    }
    const double err = num / den;
    std::printf(
        "layer %lld (window %lld) vs materialised masked reference over %lld tokens: "
        "max relative error %.2e\n",
        (long long)l, (long long)window, (long long)n_check, err);
    ok = ok && err < 1e-4;
  }
  // The window changes the result once a token has more than W predecessors.
  const Tensor<float, 3> yw = hybrid[1].forward(x), yg = global[1].forward(x);
  double diff_early = 0, diff_late = 0;
  for (index_t i = 0; i < tokens; ++i)
    for (index_t e = 0; e < kEmbed; ++e) {
      const double dlt = std::abs(yw(0, i, e) - yg(0, i, e));
      (i < window ? diff_early : diff_late) = std::max(i < window ? diff_early : diff_late, dlt);
    }
  std::printf(
      "windowed vs global layer 1: max |difference| %.2e on the first %lld tokens, %.2e "
      "after\n",
      diff_early, (long long)std::min(window, tokens), diff_late);
  ok = ok && diff_early < 1e-5 && (tokens <= window || diff_late > 1e-3);
  std::printf(ok ? "all checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
