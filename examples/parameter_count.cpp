// Parameter budget of one attention layer in a 7B-class model (hidden 4096,
// 32 heads of 128, 32 layers): a baseline Transformer, DIFF V1 and DIFF V2,
// component by component, and the KV cache per token under GQA.
//
// The DIFF numbers come from the layer classes' own parameter shapes
// (parameter_shapes(config) needs no weights, so nothing 4096 wide is built).
#include <cstdio>
#include <diffattn/module.hpp>
#include <map>
#include <string>
#include <vector>

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

}  // namespace

int main() {
  const index_t e = 4096, heads = 32, head_dim = 128, layers = 32;
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
  const index_t kv_heads = 8;
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

  std::printf("\n%s\n", ok ? "checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
