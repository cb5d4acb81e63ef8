// Parameter budget of one attention layer in a 7B-class model (hidden 4096,
// 32 heads of 128, 32 layers): a baseline Transformer, DIFF V1 and DIFF V2,
// component by component, and the KV cache per token under GQA. Then a
// planner for the model given on the command line: parameters, KV-cache
// memory, prefill FLOPs and decode bytes per token of the three, and the time
// these take here, from a short calibration run of the fused kernels.
//
// The DIFF numbers come from the layer classes' own parameter shapes
// (parameter_shapes(config) needs no weights, so nothing 4096 wide is built).
//
//   parameter_count [--hidden 4096] [--heads 32] [--kv-heads 8] [--layers 32]
//                   [--context 4096] [--batch 1] [--threads 0] [--no-calibrate]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <diffattn/attention.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/module.hpp>
#include <map>
#include <string>
#include <vector>

#include "progress.hpp"

using diffattn::index_t;
using Shapes = std::map<std::string, std::vector<index_t>>;

namespace {

index_t numel(const std::vector<index_t>& s) {
  index_t n = 1;
  for (index_t e : s) n *= e;
  return n;
}

index_t total(const Shapes& shapes) {
  index_t t = 0;
  for (const auto& kv : shapes) t += numel(kv.second);
  return t;
}

/// A baseline (softmax) attention layer: heads of width head_dim, kv_heads for GQA.
Shapes baseline_shapes(index_t e, index_t heads, index_t kv_heads, index_t head_dim) {
  return {{"q_proj.weight", {heads * head_dim, e}},
          {"k_proj.weight", {kv_heads * head_dim, e}},
          {"v_proj.weight", {kv_heads * head_dim, e}},
          {"o_proj.weight", {e, heads * head_dim}}};
}

index_t get(const Shapes& s, const char* name) {
  const auto it = s.find(name);
  return it == s.end() ? 0 : numel(it->second);
}

void row(const char* component, index_t base, index_t v1, index_t v2) {
  auto verdict = [base](index_t x) {
    return x == 0 && base == 0 ? "-" : x == base ? "kept" : x > base ? "gained" : "lost";
  };
  std::printf("  %-22s %12lld %12lld %-6s %12lld %s\n", component, static_cast<long long>(base),
              static_cast<long long>(v1), verdict(v1), static_cast<long long>(v2), verdict(v2));
}

struct Plan {
  index_t e = 4096, heads = 32, kv_heads = 8, layers = 32, context = 4096, batch = 1;
  int threads = 0;
  bool calibrate = true;
};

/// Measured speed of the fused kernels on this machine.
struct Speed {
  double v1_gflops = 0, v2_gflops = 0, plain_gflops = 0;  // causal prefill, useful work
  double decode_gbs = 0;                                  // bytes of K and V read per second
};

diffattn::Tensor<float, 4> random4(std::array<index_t, 4> shape, std::uint64_t seed) {
  diffattn::Tensor<float, 4> t(shape);
  diffattn::detail::Rng rng(seed);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

/// Seconds per call of f: repeated until `budget` seconds have passed (at least twice).
template <class F>
double time_per_call(F&& f, double budget) {
  using Clock = std::chrono::steady_clock;
  f();  // warm-up: scratch memory, packed panels
  int calls = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (elapsed < budget || calls < 2);
  return elapsed / calls;
}

/// About 1 s: each fused kernel on a causal prefill of 1024 tokens with the
/// model's head width, and V1 decoding one token against 8192 cached keys.
Speed calibrate(index_t hd, int threads) {
  Progress progress;
  Speed sp;
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  const index_t n = 1024, h = 4;
  const double pairs = 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
  {
    progress.update("calibrating: DIFF V1 prefill");
    const auto q = random4({1, n, 2 * h, hd}, 1), k = random4({1, n, 2 * h, hd}, 2),
               v = random4({1, n, h, 2 * hd}, 3);
    diffattn::Tensor<float, 4> out({1, n, h, 2 * hd});
    const double s = time_per_call(
        [&] { diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out.view(), o); }, 0.25);
    sp.v1_gflops = 8.0 * pairs * static_cast<double>(hd * h) / s * 1e-9;
  }
  {
    progress.update("calibrating: DIFF V2 prefill");
    const auto q = random4({1, n, 2 * h, hd}, 4), k = random4({1, n, h, hd}, 5),
               v = random4({1, n, h, hd}, 6);
    diffattn::Tensor<float, 3> logit({1, n, h});
    diffattn::Tensor<float, 4> out({1, n, h, hd});
    const double s = time_per_call(
        [&] { diffattn::diff_attention_v2<float>(q, k, v, logit, out.view(), o); }, 0.25);
    sp.v2_gflops = 6.0 * pairs * static_cast<double>(hd * h) / s * 1e-9;
  }
  {
    progress.update("calibrating: plain prefill");
    const auto q = random4({1, n, 2 * h, hd}, 7), k = random4({1, n, 2 * h, hd}, 8),
               v = random4({1, n, 2 * h, hd}, 9);
    diffattn::Tensor<float, 4> out({1, n, 2 * h, hd});
    const double s =
        time_per_call([&] { diffattn::attention<float>(q, k, v, out.view(), o); }, 0.25);
    sp.plain_gflops = 4.0 * pairs * static_cast<double>(hd * 2 * h) / s * 1e-9;
  }
  {
    progress.update("calibrating: DIFF V1 decode");
    const index_t m = 8192;
    const auto q = random4({1, 1, 2 * h, hd}, 10), k = random4({1, m, 2 * h, hd}, 11),
               v = random4({1, m, h, 2 * hd}, 12);
    diffattn::Tensor<float, 4> out({1, 1, h, 2 * hd});
    const double s = time_per_call(
        [&] { diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out.view(), o); }, 0.2);
    sp.decode_gbs = static_cast<double>((k.size() + v.size()) * 4) / s * 1e-9;
  }
  return sp;
}

std::string human(double x, const char* unit) {
  const char* prefix[] = {"", "K", "M", "G", "T", "P"};
  int i = 0;
  while (std::abs(x) >= 1000 && i < 5) x /= 1000, ++i;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g %s%s", x, prefix[i], unit);
  return buf;
}

std::string bytes_str(double x) {
  const char* prefix[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (x >= 1024 && i < 4) x /= 1024, ++i;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g %s", x, prefix[i]);
  return buf;
}

std::string seconds_str(double s) {
  char buf[64];
  if (s < 1e-3)
    std::snprintf(buf, sizeof buf, "%.3g us", s * 1e6);
  else if (s < 1)
    std::snprintf(buf, sizeof buf, "%.3g ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

void plan_row(const char* what, const std::string& a, const std::string& b, const std::string& c) {
  std::printf("  %-34s %14s %14s %14s\n", what, a.c_str(), b.c_str(), c.c_str());
}

bool parse(int argc, char** argv, Plan& p) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto value = [&]() { return std::atoll(argv[++i]); };
    if (a == "--no-calibrate") {
      p.calibrate = false;
    } else if (a == "--hidden" && has_value) {
      p.e = value();
    } else if (a == "--heads" && has_value) {
      p.heads = value();
    } else if (a == "--kv-heads" && has_value) {
      p.kv_heads = value();
    } else if (a == "--layers" && has_value) {
      p.layers = value();
    } else if (a == "--context" && has_value) {
      p.context = value();
    } else if (a == "--batch" && has_value) {
      p.batch = value();
    } else if (a == "--threads" && has_value) {
      p.threads = static_cast<int>(value());
    } else {
      return false;
    }
  }
  return p.e >= 1 && p.heads >= 2 && p.heads % 2 == 0 && p.e % p.heads == 0 && p.kv_heads >= 2 &&
         p.kv_heads % 2 == 0 && p.heads % p.kv_heads == 0 && p.layers >= 1 && p.context >= 1 &&
         p.batch >= 1 && p.threads >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  Plan plan;
  if (!parse(argc, argv, plan)) {
    std::fprintf(stderr,
                 "usage: parameter_count [--hidden E] [--heads H] [--kv-heads K] [--layers L] "
                 "[--context N] [--batch B] [--threads T] [--no-calibrate]\n"
                 "  H and K even, E %% H == 0, H %% K == 0 (V1 halves both)\n");
    return 2;
  }
  const index_t e = plan.e, heads = plan.heads, head_dim = e / heads, layers = plan.layers;
  bool ok = true;

  // Baseline: 32 heads of 128. V1: half the heads (16 DIFF heads), each query/key
  // half 128 wide, values 256 wide. V2: 32 DIFF heads of 128 from 64 query heads.
  diffattn::DiffAttnV1Config c1;
  c1.embed_dim = e;
  c1.num_heads = heads / 2;
  c1.depth = 0;
  diffattn::DiffAttnV2Config c2;
  c2.embed_dim = e;
  c2.num_heads = heads;
  c2.head_dim = head_dim;
  const Shapes base = baseline_shapes(e, heads, heads, head_dim);
  const Shapes v1 = diffattn::MultiheadDiffAttnV1<float>::parameter_shapes(c1);
  const Shapes v2 = diffattn::MultiheadDiffAttnV2<float>::parameter_shapes(c2);

  std::printf("7B-class attention: hidden %lld, %lld heads of %lld, %lld layers\n\n",
              static_cast<long long>(e), static_cast<long long>(heads),
              static_cast<long long>(head_dim), static_cast<long long>(layers));
  std::printf("  %-22s %12s %12s %-6s %12s\n", "component", "baseline", "DIFF V1", "", "DIFF V2");
  row("q_proj", get(base, "q_proj.weight"), get(v1, "q_proj.weight"), get(v2, "q_proj.weight"));
  row("k_proj", get(base, "k_proj.weight"), get(v1, "k_proj.weight"), get(v2, "k_proj.weight"));
  row("v_proj", get(base, "v_proj.weight"), get(v1, "v_proj.weight"), get(v2, "v_proj.weight"));
  row("out_proj / o_proj", get(base, "o_proj.weight"), get(v1, "out_proj.weight"),
      get(v2, "o_proj.weight"));
  const index_t v1_lambda =
      get(v1, "lambda_q1") + get(v1, "lambda_k1") + get(v1, "lambda_q2") + get(v1, "lambda_k2");
  row("lambda (V1 4 vectors)", 0, v1_lambda, 0);
  row("lambda_proj (V2)", 0, 0, get(v2, "lambda_proj.weight"));
  row("subln.weight (V1)", 0, get(v1, "subln.weight"), 0);
  const index_t tb = total(base), t1 = total(v1), t2 = total(v2);
  std::printf("\nbaseline attention per layer: %lld\n", static_cast<long long>(tb));
  std::printf("DIFF V1 per layer: %lld (%+lld: lambda vectors and the norm weight)\n",
              static_cast<long long>(t1), static_cast<long long>(t1 - tb));
  std::printf("DIFF V2 per layer: %lld (%+lld: doubled query heads and lambda_proj)\n",
              static_cast<long long>(t2), static_cast<long long>(t2 - tb));
  std::printf("over %lld layers: baseline %lld, V1 %lld, V2 %lld\n", static_cast<long long>(layers),
              static_cast<long long>(tb * layers), static_cast<long long>(t1 * layers),
              static_cast<long long>(t2 * layers));
  ok = ok && t1 - tb == 6 * head_dim;                      // 4 d-vectors + a 2d weight
  ok = ok && t2 - tb == heads * head_dim * e + heads * e;  // extra queries + lambda_proj

  // GQA: 32 query heads, 8 KV heads. KV cache per token and layer = keys + values.
  const index_t kv_heads = plan.kv_heads;
  diffattn::DiffAttnV1Config g1 = c1;
  g1.num_kv_heads = kv_heads / 2;  // 4 kv pairs = 8 key heads of 128
  diffattn::DiffAttnV2Config g2 = c2;
  g2.num_kv_heads = kv_heads;
  const Shapes gb = baseline_shapes(e, heads, kv_heads, head_dim);
  const Shapes gv1 = diffattn::MultiheadDiffAttnV1<float>::parameter_shapes(g1);
  const Shapes gv2 = diffattn::MultiheadDiffAttnV2<float>::parameter_shapes(g2);
  auto cache = [](const Shapes& s) {
    return s.at("k_proj.weight")[0] + s.at("v_proj.weight")[0];  // output rows of k and v
  };
  std::printf("\nGQA, %lld query heads and %lld KV heads: KV cache values per token per layer\n",
              static_cast<long long>(heads), static_cast<long long>(kv_heads));
  std::printf("  baseline %lld, DIFF V1 %lld, DIFF V2 %lld\n", static_cast<long long>(cache(gb)),
              static_cast<long long>(cache(gv1)), static_cast<long long>(cache(gv2)));
  std::printf("  = %lld KiB per token over %lld layers in 16-bit floats, for all three\n",
              static_cast<long long>(cache(gb) * 2 * layers / 1024),
              static_cast<long long>(layers));
  std::printf("GQA attention per layer: baseline %lld, DIFF V1 %lld, DIFF V2 %lld\n",
              static_cast<long long>(total(gb)), static_cast<long long>(total(gv1)),
              static_cast<long long>(total(gv2)));
  ok = ok && cache(gv2) == cache(gb) && cache(gv1) == cache(gb);

  // ---- planner: the GQA model above over a context and a batch -----------------
  const double n = static_cast<double>(plan.context), bsz = static_cast<double>(plan.batch);
  const double L = static_cast<double>(layers), hd = static_cast<double>(head_dim);
  const double tokens = n * bsz, pairs = bsz * 0.5 * n * (n + 1);  // causal (query, key) pairs
  const double params[3] = {static_cast<double>(total(gb)), static_cast<double>(total(gv1)),
                            static_cast<double>(total(gv2))};
  const double kv_per_token[3] = {static_cast<double>(cache(gb)), static_cast<double>(cache(gv1)),
                                  static_cast<double>(cache(gv2))};
  // Attention work on visible pairs, as the fused kernels do it: baseline 4 P hd
  // per head (scores, W V); V1 8 P d per DIFF head, H/2 heads of d = hd; V2 6 P hd
  // per DIFF head (two score maps, one W V), H heads.
  const double attn_flops[3] = {4 * pairs * hd * static_cast<double>(heads),
                                8 * pairs * hd * static_cast<double>(heads / 2),
                                6 * pairs * hd * static_cast<double>(heads)};
  std::printf(
      "\nplanner: hidden %lld, %lld heads of %lld, %lld kv heads, %lld layers; context %lld, "
      "batch %lld (attention layers only)\n",
      static_cast<long long>(e), static_cast<long long>(heads), static_cast<long long>(head_dim),
      static_cast<long long>(kv_heads), static_cast<long long>(layers),
      static_cast<long long>(plan.context), static_cast<long long>(plan.batch));
  plan_row("", "baseline", "DIFF V1", "DIFF V2");
  auto row3 = [&](const char* what, auto f) { plan_row(what, f(0), f(1), f(2)); };
  row3("parameters per layer", [&](int i) { return human(params[i], ""); });
  row3("parameters, all layers", [&](int i) { return human(params[i] * L, ""); });
  row3("weights, all layers, bf16", [&](int i) { return bytes_str(2 * params[i] * L); });
  row3("KV cache per token, float", [&](int i) { return bytes_str(4 * kv_per_token[i] * L); });
  row3("KV cache per token, bf16", [&](int i) { return bytes_str(2 * kv_per_token[i] * L); });
  row3("KV cache for context x batch, float",
       [&](int i) { return bytes_str(4 * kv_per_token[i] * L * tokens); });
  row3("KV cache for context x batch, bf16",
       [&](int i) { return bytes_str(2 * kv_per_token[i] * L * tokens); });
  double prefill[3], decode_bytes[3];
  for (int i = 0; i < 3; ++i) {
    prefill[i] = L * (2 * tokens * params[i] + attn_flops[i]);
    // One new token per sequence at the end of the context: every weight once
    // (bf16), every cached key and value once (bf16).
    decode_bytes[i] = L * (2 * params[i] + bsz * 2 * kv_per_token[i] * n);
  }
  row3("attention FLOPs per layer (prefill)", [&](int i) { return human(attn_flops[i], "FLOP"); });
  row3("prefill FLOPs, all layers", [&](int i) { return human(prefill[i], "FLOP"); });
  row3("decode bytes per token step, bf16", [&](int i) { return bytes_str(decode_bytes[i]); });
  std::printf(
      "  prefill = projections (2 FLOPs per parameter per token) + attention on the "
      "causal pairs; decode = weights + the batch's KV cache, read once per step\n");
  std::printf(
      "  V1 vs V2: same KV cache per token (%s float per token over all layers); V2 "
      "reads %+.1f%% more bytes per decode step (its doubled query projection and "
      "lambda_proj) and does %.2fx the baseline's attention FLOPs, V1 %.2fx\n",
      bytes_str(4 * kv_per_token[1] * L).c_str(), 100.0 * (decode_bytes[2] / decode_bytes[1] - 1.0),
      attn_flops[2] / attn_flops[0], attn_flops[1] / attn_flops[0]);
  ok = ok && attn_flops[1] == attn_flops[0];  // V1: half the heads, twice the value width

  if (plan.calibrate) {
    const Speed sp = calibrate(head_dim, plan.threads);
    std::printf(
        "\ncalibration (fused kernels here, float, %s threads, head width %lld): causal "
        "prefill V1 %.0f, V2 %.0f, plain %.0f GFLOP/s; V1 decode reads K and V at %.1f "
        "GB/s\n",
        plan.threads > 0 ? std::to_string(plan.threads).c_str() : "default",
        static_cast<long long>(head_dim), sp.v1_gflops, sp.v2_gflops, sp.plain_gflops,
        sp.decode_gbs);
    const double rate[3] = {sp.plain_gflops, sp.v1_gflops, sp.v2_gflops};
    // Projections run on the same micro-kernel: timed at the plain kernel's rate.
    row3("prefill time here (estimate)", [&](int i) {
      return seconds_str(
          L * (2 * tokens * params[i] / (sp.plain_gflops * 1e9) + attn_flops[i] / (rate[i] * 1e9)));
    });
    row3("decode time per step here (estimate)",
         [&](int i) { return seconds_str(decode_bytes[i] / (sp.decode_gbs * 1e9)); });
    for (double x : {sp.v1_gflops, sp.v2_gflops, sp.plain_gflops, sp.decode_gbs})
      ok = ok && std::isfinite(x) && x > 0;
  }

  std::printf("\n%s\n", ok ? "checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
