// Training with the backward pass: does a differential attention layer learn to
// focus on the one token that matters, and a softmax layer less so?
//
// Task (synthetic retrieval): a sequence holds --context (key, value) tokens,
// the keys distinct, drawn from --keys keys, the values from --values values;
// the last token is a query carrying one of those keys. The model must output
// the value stored with it. Token embeddings are fixed random vectors:
//   context token = key_emb[key] + value_emb[value],  query = key_emb[key] + query_emb.
// The answer is the context position whose key matches; the other context
// tokens are distractors.
//
// Model: one attention layer (causal, rotary) and a linear read-out of the
// layer's output at the query token into --values logits; cross-entropy loss,
// AdamW over every parameter by name. Three layers of one parameter budget
// are trained from the same seed on the same batches:
//   baseline  softmax attention, 4 heads of 16 (q, k, v, o: E x E), written
//             below with diffattn::attention / attention_backward
//   DIFF V1   MultiheadDiffAttnV1, 2 DIFF heads (d 16, values 32)
//   DIFF V2   MultiheadDiffAttnV2, 4 DIFF heads of 16 from 8 query heads,
//             2 kv heads (GQA keeps the budget: the query projection doubles)
//
// After training it measures, with the layer's own q and k (attention_maps),
// where the query token's attention goes: the weight on the answer position
// and the summed weight on the distractors, averaged over heads and held-out
// sequences (for a DIFF head the row W = A1 - lambda A2, which sums to
// 1 - lambda). --quick runs a short schedule; the program exits non-zero if a
// loss fails to fall or a number is not finite.
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "focus_task.hpp"

using namespace focus;  // NOLINT: the example is one file over the task header

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_focus: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      o.epochs = 3;
      o.steps = 80;
      o.eval = 128;
    } else if (a == "--epochs") {
      o.epochs = std::atoi(next());
    } else if (a == "--steps") {
      o.steps = std::atoi(next());
    } else if (a == "--lr") {
      o.lr = std::atof(next());
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(std::atoll(next()));
    } else if (a == "--context") {
      o.context = std::atoll(next());
    } else if (a == "--threads") {
      o.threads = std::atoi(next());
    } else {
      std::fprintf(stderr,
                   "usage: train_focus [--quick] [--epochs E] [--steps S] [--lr LR] [--seed S] "
                   "[--context C] [--threads T]\n");
      return 2;
    }
  }
  if (o.epochs < 1 || o.steps < 1 || o.context < 1 || o.context > o.keys || !(o.lr > 0) ||
      o.threads < 0) {
    std::fprintf(
        stderr,
        "train_focus: need epochs, steps >= 1, 1 <= context <= %lld, lr > 0, threads >= 0\n",
        static_cast<long long>(o.keys));
    return 2;
  }
  if (o.threads > 0) Eigen::setNbThreads(o.threads);

  diffattn::detail::Rng data_rng(o.seed);
  const Embeddings emb = make_embeddings(o, data_rng);
  diffattn::detail::Rng eval_rng(o.seed + 1000);
  const Batch eval = make_batch(o, emb, eval_rng, o.eval);
  std::printf(
      "retrieval: %lld (key, value) tokens + 1 query, %lld keys, %lld values (chance "
      "%.3f); E %lld, batch %lld, %d epochs x %d steps, AdamW lr %g, seed %llu\n\n",
      static_cast<long long>(o.context), static_cast<long long>(o.keys),
      static_cast<long long>(o.values), 1.0 / static_cast<double>(o.values),
      static_cast<long long>(o.embed), static_cast<long long>(o.batch), o.epochs, o.steps, o.lr,
      static_cast<unsigned long long>(o.seed));

  std::vector<Result> results;
  {
    BaselineAttention layer(o.embed, 4, o.seed);
    results.push_back(train("baseline", layer, o, emb, eval));
  }
  {
    diffattn::DiffAttnV1Config c;
    c.embed_dim = o.embed;
    c.num_heads = 2;
    diffattn::MultiheadDiffAttnV1<float> layer(c, o.seed);
    results.push_back(train("DIFF V1", layer, o, emb, eval));
  }
  {
    diffattn::DiffAttnV2Config c;
    c.embed_dim = o.embed;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    diffattn::MultiheadDiffAttnV2<float> layer(c, o.seed);
    results.push_back(train("DIFF V2", layer, o, emb, eval));
  }

  std::printf("%-9s %8s %10s %10s %9s %8s %12s %8s %7s\n", "model", "params", "loss first",
              "loss last", "accuracy", "answer", "distractors", "row sum", "time");
  bool ok = true;
  for (const Result& r : results) {
    std::printf("%-9s %8lld %10.4f %10.4f %9.3f %8.3f %12.3f %8.3f %6.1fs\n", r.name.c_str(),
                static_cast<long long>(r.params), r.first_loss, r.last_loss, r.accuracy, r.answer,
                r.distractors, r.row_sum, r.seconds);
    if (!finite_result(r) || !(r.last_loss < r.first_loss)) {
      std::printf("FAILED: %s: loss did not fall or a number is not finite\n", r.name.c_str());
      ok = false;
    }
  }
  std::printf(
      "answer / distractors: attention weight of the query token on the answer position "
      "and summed over the %lld distractors, mean over heads and %lld held-out "
      "sequences\n",
      static_cast<long long>(o.context - 1), static_cast<long long>(o.eval));
  if (ok) std::printf("checks passed\n");
  return ok ? 0 : 1;
}
