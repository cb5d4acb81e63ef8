// The synthetic retrieval task of examples/train_focus and examples/analysis:
// data, the baseline softmax layer, the read-out and the training loop. See
// train_focus.cpp for the task.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/diffattn.hpp>

#include "progress.hpp"

namespace focus {

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;
using Views = std::map<std::string, TensorView<float, 1>>;
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Options {
  index_t embed = 64;    // E
  index_t context = 31;  // (key, value) tokens before the query
  index_t keys = 64;
  index_t values = 16;
  index_t batch = 32;
  index_t eval = 512;  // held-out sequences
  int epochs = 8;
  int steps = 200;  // optimizer steps per epoch, each on a fresh batch
  double lr = 1e-2;
  std::uint64_t seed = 1;
  int threads = 1;  // the problem is small: more threads cost more than they save
};

// ---- data ---------------------------------------------------------------------

struct Embeddings {
  Mat key, value;            // (keys, E), (values, E)
  Eigen::RowVectorXf query;  // (E)
};

inline Embeddings make_embeddings(const Options& o, diffattn::detail::Rng& rng) {
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.embed)));
  auto fill = [&](Mat& m) {
    for (index_t i = 0; i < m.size(); ++i) m.data()[i] = s * static_cast<float>(rng.normal());
  };
  Embeddings e{Mat(o.keys, o.embed), Mat(o.values, o.embed), Eigen::RowVectorXf(o.embed)};
  fill(e.key);
  fill(e.value);
  for (index_t j = 0; j < o.embed; ++j) e.query(j) = s * static_cast<float>(rng.normal());
  return e;
}

struct Batch {
  Tensor<float, 3> x;           // (B, N, E), N = context + 1
  std::vector<int> target;      // value at the answer position
  std::vector<index_t> answer;  // the answer position
};

inline Batch make_batch(const Options& o, const Embeddings& emb, diffattn::detail::Rng& rng,
                        index_t count) {
  const index_t n = o.context + 1;
  Batch b{Tensor<float, 3>({count, n, o.embed}), std::vector<int>(count),
          std::vector<index_t>(count)};
  std::vector<index_t> perm(static_cast<std::size_t>(o.keys));
  for (index_t s = 0; s < count; ++s) {
    // Distinct keys: the first `context` of a shuffled permutation.
    for (index_t i = 0; i < o.keys; ++i) perm[i] = i;
    for (index_t i = 0; i < o.context; ++i) {
      const index_t j = i + static_cast<index_t>(rng.uniform() * static_cast<double>(o.keys - i));
      std::swap(perm[i], perm[std::min(j, o.keys - 1)]);
    }
    const index_t answer = static_cast<index_t>(rng.uniform() * static_cast<double>(o.context));
    for (index_t t = 0; t < o.context; ++t) {
      const index_t val = static_cast<index_t>(rng.uniform() * static_cast<double>(o.values));
      for (index_t j = 0; j < o.embed; ++j) b.x(s, t, j) = emb.key(perm[t], j) + emb.value(val, j);
      if (t == answer) b.target[s] = static_cast<int>(val);
    }
    for (index_t j = 0; j < o.embed; ++j)
      b.x(s, o.context, j) = emb.key(perm[answer], j) + emb.query(j);
    b.answer[s] = answer;
  }
  return b;
}

// ---- the baseline layer: plain softmax attention --------------------------------

// y (rows, out) = x (rows, in) w^T
inline void linear(const float* x, index_t rows, index_t in, const float* w, index_t out,
                   float* y) {
  Eigen::Map<Mat>(y, rows, out).noalias() =
      Eigen::Map<const Mat>(x, rows, in) * Eigen::Map<const Mat>(w, out, in).transpose();
}

// dw (out, in) += dy^T x; dx (rows, in) = or += dy w
inline void linear_backward(const float* x, index_t rows, index_t in, const float* w, index_t out,
                            const float* dy, float* dw, float* dx, bool accumulate) {
  Eigen::Map<const Mat> xm(x, rows, in), wm(w, out, in), dym(dy, rows, out);
  Eigen::Map<Mat>(dw, out, in).noalias() += dym.transpose() * xm;
  Eigen::Map<Mat> dxm(dx, rows, in);
  if (accumulate)
    dxm.noalias() += dym * wm;
  else
    dxm.noalias() = dym * wm;
}

/// Multi-head softmax attention with rotary embedding and no biases, the
/// layer a Transformer uses: q, k, v, o projections E -> E, `heads` heads of
/// E / heads. Same interface as the library's layers.
class BaselineAttention {
 public:
  BaselineAttention(index_t embed, index_t heads, std::uint64_t seed)
      : e_(embed), heads_(heads), hd_(embed / heads), threads_(0) {
    diffattn::detail::Rng rng(seed);
    const double bound = 1.0 / std::sqrt(static_cast<double>(e_));
    for (const char* name : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}) {
      std::vector<float>& w = params_[name];
      w.resize(static_cast<std::size_t>(e_ * e_));
      for (float& v : w) v = static_cast<float>(rng.uniform(-bound, bound));
      grads_[name].assign(w.size(), 0.0f);
    }
  }

  Tensor<float, 3> forward(TensorView<const float, 3> x) {
    const index_t b = x.shape(0), n = x.shape(1);
    x_ = contiguous(x);
    project(x_, q_, k_, v_);
    attn_ = Tensor<float, 4>({b, n, heads_, hd_});
    lse_ = Tensor<float, 3>({b, heads_, n});
    diffattn::attention<float>(q_, k_, v_, attn_.view(), lse_.view(), options());
    Tensor<float, 3> y({b, n, e_});
    linear(attn_.data(), b * n, e_, w("o_proj.weight"), e_, y.data());
    return y;
  }

  Tensor<float, 3> backward(TensorView<const float, 3> dy_in) {
    const Tensor<float, 3> dy = contiguous(dy_in);
    const index_t b = dy.shape(0), n = dy.shape(1), rows = b * n;
    Tensor<float, 4> dattn({b, n, heads_, hd_});
    linear_backward(attn_.data(), rows, e_, w("o_proj.weight"), e_, dy.data(), g("o_proj.weight"),
                    dattn.data(), false);
    Tensor<float, 4> dq(q_.shape()), dk(k_.shape()), dv(v_.shape());
    diffattn::attention_backward<float>(q_, k_, v_, attn_, lse_, dattn, dq.view(), dk.view(),
                                        dv.view(), options());
    diffattn::apply_rope_inverse<float>(dq.view());
    diffattn::apply_rope_inverse<float>(dk.view());
    Tensor<float, 3> dx({b, n, e_});
    linear_backward(x_.data(), rows, e_, w("q_proj.weight"), e_, dq.data(), g("q_proj.weight"),
                    dx.data(), false);
    linear_backward(x_.data(), rows, e_, w("k_proj.weight"), e_, dk.data(), g("k_proj.weight"),
                    dx.data(), true);
    linear_backward(x_.data(), rows, e_, w("v_proj.weight"), e_, dv.data(), g("v_proj.weight"),
                    dx.data(), true);
    return dx;
  }

  /// q, k (after rotary) and v of x, each (B, N, heads, E / heads), as forward computes them.
  void qkv(TensorView<const float, 3> x, Tensor<float, 4>& q, Tensor<float, 4>& k,
           Tensor<float, 4>& v) {
    project(contiguous(x), q, k, v);
  }

  Views parameters() { return views(params_); }
  Views gradients() { return views(grads_); }
  void zero_grad() {
    for (auto& kv : grads_) std::fill(kv.second.begin(), kv.second.end(), 0.0f);
  }
  index_t num_parameters() const { return 4 * e_ * e_; }
  void set_num_threads(int n) { threads_ = n; }

  /// softmax(s q_h k_h^T + causal mask) of every head: (B, heads, N, N).
  Tensor<float, 4> attention_maps(TensorView<const float, 3> x) {
    const index_t b = x.shape(0), n = x.shape(1);
    Tensor<float, 4> q, k, v;
    project(contiguous(x), q, k, v);
    Tensor<float, 4> maps({b, heads_, n, n});
    Mat qh(n, hd_), kh(n, hd_);
    for (index_t bi = 0; bi < b; ++bi)
      for (index_t h = 0; h < heads_; ++h) {
        for (index_t i = 0; i < n; ++i)
          for (index_t t = 0; t < hd_; ++t) {
            qh(i, t) = q(bi, i, h, t);
            kh(i, t) = k(bi, i, h, t);
          }
        // lambda = 0: the first map alone is plain softmax attention.
        const Mat a = diffattn::diff_weights<float>(qh, kh, qh, kh, 0.0f, options());
        for (index_t i = 0; i < n; ++i)
          for (index_t j = 0; j < n; ++j) maps(bi, h, i, j) = a(i, j);
      }
    return maps;
  }

 private:
  static Tensor<float, 3> contiguous(TensorView<const float, 3> x) {
    Tensor<float, 3> c(x.shape());
    for (index_t i = 0; i < x.shape(0); ++i)
      for (index_t j = 0; j < x.shape(1); ++j)
        for (index_t t = 0; t < x.shape(2); ++t) c(i, j, t) = x(i, j, t);
    return c;
  }
  void project(const Tensor<float, 3>& x, Tensor<float, 4>& q, Tensor<float, 4>& k,
               Tensor<float, 4>& v) {
    const index_t b = x.shape(0), n = x.shape(1);
    q = Tensor<float, 4>({b, n, heads_, hd_});
    k = Tensor<float, 4>({b, n, heads_, hd_});
    v = Tensor<float, 4>({b, n, heads_, hd_});
    linear(x.data(), b * n, e_, w("q_proj.weight"), e_, q.data());
    linear(x.data(), b * n, e_, w("k_proj.weight"), e_, k.data());
    linear(x.data(), b * n, e_, w("v_proj.weight"), e_, v.data());
    diffattn::apply_rope<float>(q.view());
    diffattn::apply_rope<float>(k.view());
  }
  diffattn::AttentionOptions options() const {
    diffattn::AttentionOptions o;
    o.causal = true;
    o.num_threads = threads_;
    return o;
  }
  float* w(const char* name) { return params_.at(name).data(); }
  float* g(const char* name) { return grads_.at(name).data(); }
  static Views views(std::map<std::string, std::vector<float>>& m) {
    Views out;
    for (auto& kv : m)
      out.emplace(kv.first,
                  TensorView<float, 1>(kv.second.data(), {static_cast<index_t>(kv.second.size())}));
    return out;
  }

  index_t e_, heads_, hd_;
  int threads_;
  std::map<std::string, std::vector<float>> params_, grads_;
  Tensor<float, 3> x_;
  Tensor<float, 4> q_, k_, v_, attn_;
  Tensor<float, 3> lse_;
};

// ---- training -------------------------------------------------------------------

struct Result {
  std::string name;
  index_t params = 0;
  double first_loss = 0, last_loss = 0, accuracy = 0;
  double answer = 0, distractors = 0, abs_distractors = 0, row_sum = 0;
  double best_head_answer = 0;
  double seconds = 0;
};

/// The linear read-out (values, E) + bias of the layer's output at the query.
struct Readout {
  std::vector<float> w, b, gw, gb;
  Readout(index_t values, index_t embed, std::uint64_t seed)
      : w(static_cast<std::size_t>(values * embed)),
        b(static_cast<std::size_t>(values), 0.0f),
        gw(w.size(), 0.0f),
        gb(b.size(), 0.0f) {
    diffattn::detail::Rng rng(seed);
    const double bound = 1.0 / std::sqrt(static_cast<double>(embed));
    for (float& v : w) v = static_cast<float>(rng.uniform(-bound, bound));
  }
};

inline TensorView<float, 1> view1(std::vector<float>& v) {
  return TensorView<float, 1>(v.data(), {static_cast<index_t>(v.size())});
}

/// Cross-entropy of the read-out at the query token; writes dy (B, N, E) (zero
/// except at the query) and adds the read-out's gradients. Returns the mean
/// loss; counts correct predictions.
inline double loss_and_grad(const Tensor<float, 3>& y, const Batch& batch, Readout& r,
                            index_t values, Tensor<float, 3>* dy, int* correct) {
  const index_t bsz = y.shape(0), last = y.shape(1) - 1, e = y.shape(2);
  double loss = 0;
  std::vector<double> logits(static_cast<std::size_t>(values));
  for (index_t s = 0; s < bsz; ++s) {
    const float* h = &y(s, last, 0);
    double mx = -1e300;
    index_t arg = 0;
    for (index_t c = 0; c < values; ++c) {
      double z = r.b[c];
      for (index_t j = 0; j < e; ++j) z += static_cast<double>(r.w[c * e + j]) * h[j];
      logits[c] = z;
      if (z > mx) mx = z, arg = c;
    }
    double sum = 0;
    for (index_t c = 0; c < values; ++c) sum += std::exp(logits[c] - mx);
    const int t = batch.target[s];
    loss += -(logits[t] - mx - std::log(sum));
    if (correct && arg == t) ++*correct;
    if (!dy) continue;
    for (index_t c = 0; c < values; ++c) {
      const double p = std::exp(logits[c] - mx) / sum;
      const float gz = static_cast<float>((p - (c == t ? 1.0 : 0.0)) / static_cast<double>(bsz));
      r.gb[c] += gz;
      for (index_t j = 0; j < e; ++j) {
        r.gw[c * e + j] += gz * h[j];
        (*dy)(s, last, j) += gz * r.w[c * e + j];
      }
    }
  }
  return loss / static_cast<double>(bsz);
}

/// Trains `layer` and a read-out from o.seed; prints one line per epoch (and a
/// progress line on a terminal), measures the query token's attention with
/// attention_maps. The trained read-out goes to *trained when given.
template <class Layer>
Result train(const std::string& name, Layer& layer, const Options& o, const Embeddings& emb,
             const Batch& eval, Readout* trained = nullptr) {
  Result res;
  res.name = name;
  res.params = layer.num_parameters();
  layer.set_num_threads(o.threads);
  Readout readout(o.values, o.embed, o.seed + 7);
  diffattn::AdamWOptions ao;
  ao.lr = o.lr;
  ao.weight_decay = 0.01;
  diffattn::AdamW<float> opt(ao);
  diffattn::detail::Rng rng(o.seed + 100);  // same batches for every model
  const auto t0 = std::chrono::steady_clock::now();
  std::printf("%s (%lld parameters in the layer)\n", name.c_str(),
              static_cast<long long>(res.params));
  Progress progress;
  for (int epoch = 1; epoch <= o.epochs; ++epoch) {
    double loss_sum = 0;
    int correct = 0;
    for (int step = 0; step < o.steps; ++step) {
      if (step > 0)
        progress.update("  %s: epoch %d/%d, step %d/%d, train loss %.4f", name.c_str(), epoch,
                        o.epochs, step, o.steps, loss_sum / step);
      const Batch batch = make_batch(o, emb, rng, o.batch);
      const Tensor<float, 3> y = layer.forward(batch.x);
      Tensor<float, 3> dy(y.shape());
      layer.zero_grad();
      std::fill(readout.gw.begin(), readout.gw.end(), 0.0f);
      std::fill(readout.gb.begin(), readout.gb.end(), 0.0f);
      loss_sum += loss_and_grad(y, batch, readout, o.values, &dy, &correct);
      layer.backward(dy);
      // One optimizer over the layer's named parameters and the read-out's.
      Views params, grads;
      for (auto& kv : layer.parameters()) params.emplace("attn." + kv.first, kv.second);
      for (auto& kv : layer.gradients()) grads.emplace("attn." + kv.first, kv.second);
      params.emplace("readout.weight", view1(readout.w));
      params.emplace("readout.bias", view1(readout.b));
      grads.emplace("readout.weight", view1(readout.gw));
      grads.emplace("readout.bias", view1(readout.gb));
      opt.step(params, grads);
    }
    const double train_loss = loss_sum / o.steps;
    int eval_correct = 0;
    const double eval_loss =
        loss_and_grad(layer.forward(eval.x), eval, readout, o.values, nullptr, &eval_correct);
    if (epoch == 1) res.first_loss = train_loss;
    res.last_loss = train_loss;
    res.accuracy = static_cast<double>(eval_correct) / static_cast<double>(eval.target.size());
    progress.clear();
    std::printf("  epoch %2d  train loss %.4f  acc %.3f  |  held-out loss %.4f  acc %.3f\n", epoch,
                train_loss, static_cast<double>(correct) / static_cast<double>(o.steps * o.batch),
                eval_loss, res.accuracy);
    std::fflush(stdout);
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (trained) *trained = readout;

  // Where the query token looks, per head, with the trained q and k.
  const Tensor<float, 4> maps = layer.attention_maps(eval.x);  // (B, H, N, N)
  const index_t bsz = maps.shape(0), heads = maps.shape(1), last = maps.shape(2) - 1;
  std::vector<double> head_answer(static_cast<std::size_t>(heads), 0.0);
  for (index_t s = 0; s < bsz; ++s)
    for (index_t h = 0; h < heads; ++h) {
      double ans = 0, dis = 0, adis = 0, sum = 0;
      for (index_t j = 0; j <= last; ++j) {
        const double w = maps(s, h, last, j);
        sum += w;
        if (j == eval.answer[s])
          ans = w;
        else if (j < last)
          dis += w, adis += std::abs(w);
      }
      res.answer += ans;
      res.distractors += dis;
      res.abs_distractors += adis;
      res.row_sum += sum;
      head_answer[h] += ans / static_cast<double>(bsz);
    }
  const double count = static_cast<double>(bsz * heads);
  res.answer /= count;
  res.distractors /= count;
  res.abs_distractors /= count;
  res.row_sum /= count;
  res.best_head_answer = *std::max_element(head_answer.begin(), head_answer.end());
  std::printf(
      "  held-out accuracy %.3f; query attention: answer %.3f (best head %.3f), "
      "distractors %.3f (|w| %.3f), row sum %.3f; %.1f s\n\n",
      res.accuracy, res.answer, res.best_head_answer, res.distractors, res.abs_distractors,
      res.row_sum, res.seconds);
  return res;
}

inline bool finite_result(const Result& r) {
  for (double v : {r.first_loss, r.last_loss, r.accuracy, r.answer, r.distractors, r.row_sum})
    if (!std::isfinite(v)) return false;
  return true;
}

}  // namespace focus
