// The paper's measurements on trained layers, with diffattn/analysis.hpp.
//
// Trains the three layers of examples/train_focus (baseline softmax attention,
// DIFF V1, DIFF V2; one parameter budget, same seed and batches) on its
// retrieval task, then measures each trained layer with its own q, k and v on
// held-out sequences:
//   - needle allocation: the query token's attention on the answer position
//     (the needle) and on the rest of the context, per sequence
//     (diff_attention_v1_stats & co. with that sequence's needle span);
//   - the largest attention logit, the mean row entropy and the context RMS
//     (RMS of the attention output) over every token;
//   - the attention output and the task accuracy when the attention logits are
//     quantised to 4, 6 or 8 bits (per row, symmetric) before the softmax.
// It checks its own numbers: finite, rows summing to 1 - lambda, the needle
// mass agreeing with the layers' materialised attention_maps, the rebuilt
// layer output agreeing with forward, the 8-bit error below the 4-bit one.
// Which model is better is printed as measured, never assumed.
//
//   ./build/examples/analysis [--quick] [--seed S] [--threads T]
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <diffattn/analysis.hpp>

#include "focus_task.hpp"

using namespace focus;  // NOLINT: the example is one file over the task header

namespace {

enum class Kind { plain, v1, v2 };

/// A trained layer seen as attention inputs, and the way back from the
/// attention output to the layer output.
struct Model {
  std::string name;
  Kind kind = Kind::plain;
  Tensor<float, 4> q, k, v;                                         // the layer's own, after rotary
  Tensor<float, 3> logit;                                           // V2: lambda_logit (B, N, H)
  float lambda = 0;                                                 // V1: lambda_full
  std::function<Tensor<float, 3>(const Tensor<float, 4>&)> finish;  // attention out -> y
  Tensor<float, 3> y;                                               // layer.forward(x)
  Readout readout{1, 1, 0};
  Result trained;
  index_t out_dim() const { return kind == Kind::v1 ? 2 * q.shape(3) : v.shape(3); }
  index_t heads() const { return kind == Kind::plain ? q.shape(2) : q.shape(2) / 2; }
};

Tensor<float, 4> linear4(const Tensor<float, 3>& x, const float* w, index_t heads, index_t width) {
  Tensor<float, 4> y({x.shape(0), x.shape(1), heads, width});
  linear(x.data(), x.shape(0) * x.shape(1), x.shape(2), w, heads * width, y.data());
  return y;
}

Tensor<float, 3> linear3(const float* x, index_t b, index_t n, index_t in, const float* w,
                         index_t out) {
  Tensor<float, 3> y({b, n, out});
  linear(x, b * n, in, w, out, y.data());
  return y;
}

TensorView<const float, 4> slice(const Tensor<float, 4>& t, index_t s) {
  const auto v = t.view();
  return TensorView<const float, 4>(t.data() + s * v.strides()[0],
                                    {1, t.shape(1), t.shape(2), t.shape(3)}, v.strides());
}
TensorView<const float, 3> slice(const Tensor<float, 3>& t, index_t s) {
  const auto v = t.view();
  return TensorView<const float, 3>(t.data() + s * v.strides()[0], {1, t.shape(1), t.shape(2)},
                                    v.strides());
}

diffattn::AttentionStats measure(const Model& m, TensorView<const float, 4> q,
                                 TensorView<const float, 4> k, TensorView<const float, 4> v,
                                 TensorView<const float, 3> logit, TensorView<float, 4> out,
                                 const diffattn::AttentionOptions& o,
                                 const diffattn::AnalysisOptions& a) {
  const bool want_out = !out.empty();
  switch (m.kind) {
    case Kind::v1:
      return want_out ? diffattn::diff_attention_v1_stats<float>(q, k, v, m.lambda, out, o, a)
                      : diffattn::diff_attention_v1_stats<float>(q, k, v, m.lambda, o, a);
    case Kind::v2:
      return want_out ? diffattn::diff_attention_v2_stats<float>(q, k, v, logit, out, o, a)
                      : diffattn::diff_attention_v2_stats<float>(q, k, v, logit, o, a);
    default:
      return want_out ? diffattn::attention_stats<float>(q, k, v, out, o, a)
                      : diffattn::attention_stats<float>(q, k, v, o, a);
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Needle {
  double answer = 0, context = 0, context_abs = 0, negative = 0, row_sum = 0, expected_sum = 0;
  double best_head = 0;
};

struct Quant {
  int bits = 0;
  double error = 0, accuracy = 0;
};

struct Measured {
  Needle needle;
  double top_logit = 0, entropy = 0, context_rms = 0, forward_diff = 0;
  std::vector<Quant> quant;  // exact first
};

double accuracy_of(Model& m, const Tensor<float, 4>& attn, const Batch& eval, index_t values) {
  int correct = 0;
  loss_and_grad(m.finish(attn), eval, m.readout, values, nullptr, &correct);
  return static_cast<double>(correct) / static_cast<double>(eval.target.size());
}

Measured analyse(Model& m, const Batch& eval, const Options& o, Progress& progress) {
  Measured r;
  diffattn::AttentionOptions ao;
  ao.causal = true;
  ao.num_threads = o.threads;
  const index_t bsz = m.q.shape(0), n = m.q.shape(1), H = m.heads();

  // 1. Needle allocation: the query token (last row); the needle is this
  // sequence's answer position, so one call per sequence.
  std::vector<double> head_answer(static_cast<std::size_t>(H), 0.0);
  for (index_t s = 0; s < bsz; ++s) {
    progress.update("  %s: needle allocation, sequence %lld/%lld", m.name.c_str(),
                    static_cast<long long>(s + 1), static_cast<long long>(bsz));
    diffattn::AnalysisOptions a;
    a.needle_begin = eval.answer[s];
    a.needle_end = eval.answer[s] + 1;
    a.query_begin = n - 1;
    const auto st = measure(m, slice(m.q, s), slice(m.k, s), slice(m.v, s),
                            m.kind == Kind::v2 ? slice(m.logit, s) : TensorView<const float, 3>(),
                            TensorView<float, 4>(), ao, a);
    r.needle.answer += diffattn::AttentionStats::mean(st.needle_mass);
    r.needle.context += diffattn::AttentionStats::mean(st.context_mass);
    r.needle.context_abs += diffattn::AttentionStats::mean(st.context_abs_mass);
    r.needle.negative += diffattn::AttentionStats::mean(st.negative_mass);
    for (index_t h = 0; h < H; ++h) head_answer[h] += st.needle_mass[h] / static_cast<double>(bsz);
    double expected = 1;
    if (m.kind == Kind::v1) expected = 1 - m.lambda;
    if (m.kind == Kind::v2) {
      expected = 0;
      for (index_t h = 0; h < H; ++h) expected += 1 - sigmoid(m.logit(s, n - 1, h));
      expected /= static_cast<double>(H);
    }
    r.needle.expected_sum += expected;
  }
  for (double* x : {&r.needle.answer, &r.needle.context, &r.needle.context_abs, &r.needle.negative,
                    &r.needle.expected_sum})
    *x /= static_cast<double>(bsz);
  r.needle.row_sum = r.needle.answer + r.needle.context;
  r.needle.best_head = *std::max_element(head_answer.begin(), head_answer.end());

  // 2. Every token: top logit, entropy, context RMS; exact output.
  progress.update("  %s: logits, entropy, context RMS", m.name.c_str());
  Tensor<float, 4> exact({bsz, n, H, m.out_dim()});
  const auto all = measure(m, m.q, m.k, m.v, m.logit, exact.view(), ao, {});
  r.top_logit = diffattn::AttentionStats::max(all.max_abs_logit);
  r.entropy = diffattn::AttentionStats::mean(all.entropy);
  r.context_rms = diffattn::AttentionStats::mean(all.context_rms);
  const Tensor<float, 3> y = m.finish(exact);
  double num = 0, den = 0;
  for (index_t i = 0; i < y.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(y.data()[i] - m.y.data()[i])));
    den = std::max(den, std::abs(static_cast<double>(m.y.data()[i])));
  }
  r.forward_diff = num / den;
  r.quant.push_back({0, 0.0, accuracy_of(m, exact, eval, o.values)});

  // 3. Quantised logits.
  for (int bits : {8, 6, 4}) {
    progress.update("  %s: %d-bit logits", m.name.c_str(), bits);
    Tensor<float, 4> out({bsz, n, H, m.out_dim()});
    diffattn::AnalysisOptions a;
    a.logit_bits = bits;
    measure(m, m.q, m.k, m.v, m.logit, out.view(), ao, a);
    double e2 = 0, x2 = 0;
    for (index_t i = 0; i < out.size(); ++i) {
      const double d = static_cast<double>(out.data()[i]) - exact.data()[i];
      e2 += d * d;
      x2 += static_cast<double>(exact.data()[i]) * exact.data()[i];
    }
    r.quant.push_back({bits, std::sqrt(e2 / x2), accuracy_of(m, out, eval, o.values)});
  }
  progress.clear();
  return r;
}

bool finite(const Measured& r) {
  for (double x : {r.needle.answer, r.needle.context, r.needle.context_abs, r.needle.negative,
                   r.top_logit, r.entropy, r.context_rms, r.forward_diff})
    if (!std::isfinite(x)) return false;
  for (const Quant& q : r.quant)
    if (!std::isfinite(q.error) || !std::isfinite(q.accuracy)) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "analysis: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      o.epochs = 3;
      o.steps = 80;
      o.eval = 128;
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(std::atoll(next()));
    } else if (a == "--threads") {
      o.threads = std::atoi(next());
    } else {
      std::fprintf(stderr, "usage: analysis [--quick] [--seed S] [--threads T]\n");
      return 2;
    }
  }
  if (o.threads < 0) {
    std::fprintf(stderr, "analysis: threads must be >= 0\n");
    return 2;
  }
  if (o.threads > 0) Eigen::setNbThreads(o.threads);

  diffattn::detail::Rng data_rng(o.seed);
  const Embeddings emb = make_embeddings(o, data_rng);
  diffattn::detail::Rng eval_rng(o.seed + 1000);
  const Batch eval = make_batch(o, emb, eval_rng, o.eval);
  const index_t n = o.context + 1;
  std::printf(
      "retrieval (examples/train_focus): %lld (key, value) tokens + 1 query; %d epochs x %d "
      "steps, seed %llu; measured on %lld held-out sequences\n\n",
      static_cast<long long>(o.context), o.epochs, o.steps, static_cast<unsigned long long>(o.seed),
      static_cast<long long>(o.eval));

  std::vector<Model> models(3);
  {
    Model& m = models[0];
    m.name = "baseline";
    BaselineAttention layer(o.embed, 4, o.seed);
    m.trained = train(m.name, layer, o, emb, eval, &m.readout);
    layer.qkv(eval.x, m.q, m.k, m.v);
    m.y = layer.forward(eval.x);
    const std::vector<float> wo(layer.parameters().at("o_proj.weight").data(),
                                layer.parameters().at("o_proj.weight").data() + o.embed * o.embed);
    const index_t e = o.embed;
    m.finish = [wo, e](const Tensor<float, 4>& attn) {
      return linear3(attn.data(), attn.shape(0), attn.shape(1), e, wo.data(), e);
    };
  }
  {
    Model& m = models[1];
    m.name = "DIFF V1";
    m.kind = Kind::v1;
    diffattn::DiffAttnV1Config c;
    c.embed_dim = o.embed;
    c.num_heads = 2;
    diffattn::MultiheadDiffAttnV1<float> layer(c, o.seed);
    m.trained = train(m.name, layer, o, emb, eval, &m.readout);
    const auto& cfg = layer.config();
    const index_t d = layer.head_dim(), h = cfg.num_heads, hkv = cfg.num_kv_heads, e = o.embed;
    auto p = layer.parameters();
    const Tensor<float, 3>& x = eval.x;
    m.q = linear4(x, p.at("q_proj.weight").data(), 2 * h, d);
    m.k = linear4(x, p.at("k_proj.weight").data(), 2 * hkv, d);
    m.v = linear4(x, p.at("v_proj.weight").data(), hkv, 2 * d);
    diffattn::apply_rope<float>(m.q.view(), 0, cfg.rope_base);
    diffattn::apply_rope<float>(m.k.view(), 0, cfg.rope_base);
    m.lambda = layer.lambda_full();
    m.y = layer.forward(eval.x);
    const std::vector<float> wo(p.at("out_proj.weight").data(),
                                p.at("out_proj.weight").data() + e * e);
    const std::vector<float> subln(p.at("subln.weight").data(),
                                   p.at("subln.weight").data() + 2 * d);
    const double scale = 1.0 - layer.lambda_init();
    m.finish = [wo, subln, scale, e](const Tensor<float, 4>& attn) {
      Tensor<float, 4> normed(attn.shape());
      diffattn::rms_norm<float>(attn, TensorView<const float, 1>(subln.data(), {attn.shape(3)}),
                                normed.view(), 1e-5, scale);
      return linear3(normed.data(), attn.shape(0), attn.shape(1), e, wo.data(), e);
    };
  }
  {
    Model& m = models[2];
    m.name = "DIFF V2";
    m.kind = Kind::v2;
    diffattn::DiffAttnV2Config c;
    c.embed_dim = o.embed;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    diffattn::MultiheadDiffAttnV2<float> layer(c, o.seed);
    m.trained = train(m.name, layer, o, emb, eval, &m.readout);
    const auto& cfg = layer.config();
    const index_t hd = cfg.head_dim, h = cfg.num_heads, hkv = cfg.num_kv_heads, e = o.embed;
    auto p = layer.parameters();
    const Tensor<float, 3>& x = eval.x;
    m.q = linear4(x, p.at("q_proj.weight").data(), 2 * h, hd);
    m.k = linear4(x, p.at("k_proj.weight").data(), hkv, hd);
    m.v = linear4(x, p.at("v_proj.weight").data(), hkv, hd);
    diffattn::apply_rope<float>(m.q.view(), 0, cfg.rope_base);
    diffattn::apply_rope<float>(m.k.view(), 0, cfg.rope_base);
    m.logit = linear3(x.data(), x.shape(0), n, e, p.at("lambda_proj.weight").data(), h);
    m.y = layer.forward(eval.x);
    const std::vector<float> wo(p.at("o_proj.weight").data(),
                                p.at("o_proj.weight").data() + e * h * hd);
    const index_t in = h * hd;
    m.finish = [wo, in, e](const Tensor<float, 4>& attn) {
      return linear3(attn.data(), attn.shape(0), attn.shape(1), in, wo.data(), e);
    };
  }

  Progress progress;
  std::vector<Measured> res;
  for (Model& m : models) res.push_back(analyse(m, eval, o, progress));

  bool ok = true;
  auto fail = [&ok](const std::string& what) {
    std::printf("FAILED: %s\n", what.c_str());
    ok = false;
  };

  std::printf(
      "needle allocation: the query token's attention on the answer (needle) and on the other "
      "%lld tokens (context, the query itself included); mean over heads and sequences\n",
      static_cast<long long>(n - 1));
  std::printf("%-9s %8s %8s %12s %9s %8s %10s %9s\n", "model", "answer", "context", "context |w|",
              "negative", "row sum", "best head", "accuracy");
  for (std::size_t i = 0; i < models.size(); ++i) {
    const Needle& nd = res[i].needle;
    std::printf("%-9s %8.3f %8.3f %12.3f %9.3f %8.3f %10.3f %9.3f\n", models[i].name.c_str(),
                nd.answer, nd.context, nd.context_abs, nd.negative, nd.row_sum, nd.best_head,
                res[i].quant[0].accuracy);
  }
  std::printf("answer / (answer + context |w|):");
  for (std::size_t i = 0; i < models.size(); ++i)
    std::printf(" %s %.3f%s", models[i].name.c_str(),
                res[i].needle.answer / (res[i].needle.answer + res[i].needle.context_abs),
                i + 1 < models.size() ? "," : "\n");

  std::printf("\nlogits and outputs over all %lld tokens of every sequence\n",
              static_cast<long long>(n));
  std::printf("%-9s %12s %14s %12s\n", "model", "top |logit|", "entropy (nat)", "context RMS");
  for (std::size_t i = 0; i < models.size(); ++i)
    std::printf("%-9s %12.2f %14.3f %12.4f\n", models[i].name.c_str(), res[i].top_logit,
                res[i].entropy, res[i].context_rms);

  std::printf(
      "\nlow-bit attention logits (per-row symmetric quantisation before the softmax): relative "
      "RMS error of the attention output, task accuracy\n");
  std::printf("%-6s", "bits");
  for (const Model& m : models) std::printf(" %10s error %8s", m.name.c_str(), "accuracy");
  std::printf("\n");
  for (std::size_t b = 0; b < res[0].quant.size(); ++b) {
    if (res[0].quant[b].bits == 0)
      std::printf("%-6s", "exact");
    else
      std::printf("%-6d", res[0].quant[b].bits);
    for (const Measured& r : res)
      std::printf(" %16.4f %8.3f", r.quant[b].error, r.quant[b].accuracy);
    std::printf("\n");
  }
  // Derived from the run: the fewest bits (of 4, 6, 8) that keep the accuracy
  // within 0.01 of exact logits.
  std::printf("fewest bits within 0.01 of exact accuracy:");
  for (std::size_t i = 0; i < models.size(); ++i) {
    int best = 0;
    for (const Quant& q : res[i].quant)
      if (q.bits > 0 && q.accuracy >= res[i].quant[0].accuracy - 0.01 &&
          (best == 0 || q.bits < best))
        best = q.bits;
    if (best > 0)
      std::printf(" %s %d%s", models[i].name.c_str(), best, i + 1 < models.size() ? "," : "\n");
    else
      std::printf(" %s none%s", models[i].name.c_str(), i + 1 < models.size() ? "," : "\n");
  }

  // The program's own claims.
  std::printf("\n");
  for (std::size_t i = 0; i < models.size(); ++i) {
    const Model& m = models[i];
    const Measured& r = res[i];
    if (!finite(r)) fail(m.name + ": a number is not finite");
    if (std::abs(r.needle.row_sum - r.needle.expected_sum) > 1e-4)
      fail(m.name + ": answer + context does not equal the row sum 1 - lambda");
    if (std::abs(r.needle.answer - m.trained.answer) > 1e-4)
      fail(m.name + ": needle mass differs from the materialised attention_maps");
    if (r.forward_diff > 1e-4) fail(m.name + ": rebuilt layer output differs from forward");
    if (!(r.quant[1].error < r.quant[3].error))  // 8 bits vs 4 bits
      fail(m.name + ": 8-bit logits are not closer to exact than 4-bit ones");
    if (m.kind == Kind::plain && r.needle.negative != 0.0)
      fail(m.name + ": a softmax map has negative weights");
  }
  if (ok) {
    std::printf(
        "rows sum to 1 - lambda; needle mass agrees with attention_maps; rebuilt outputs "
        "agree with forward; 8-bit error below 4-bit error\n");
    std::printf("all checks passed\n");
  }
  return ok ? 0 : 1;
}
