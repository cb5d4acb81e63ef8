/// \file
/// MultiheadDiffAttnV2: the differential attention layer with doubled query
/// heads (DIFF V2), with reference-compatible parameters.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.hpp"
#include "attention_backward.hpp"
#include "config.hpp"
#include "detail/core/format.hpp"
#include "detail/core/random.hpp"
#include "detail/layers/module_base.hpp"
#include "detail/layers/module_common.hpp"
#include "diff_weights.hpp"
#include "kvcache_attention.hpp"
#include "lambda.hpp"
#include "norm.hpp"
#include "options.hpp"
#include "packed.hpp"
#include "rope.hpp"
#include "softmax.hpp"
#include "tensor.hpp"
#include "types.hpp"

DIFFATTN_BEGIN_NAMESPACE

/// \addtogroup layers
/// @{

/// Configuration of MultiheadDiffAttnV2.
///
/// q_proj E -> 2H * head_dim, k_proj and v_proj E -> Hkv * head_dim,
/// lambda_proj E -> H, o_proj H * head_dim -> E.
struct DiffAttnV2Config {
  index_t embed_dim = 0;     ///< E
  index_t num_heads = 0;     ///< H, output (DIFF) heads; 2H query heads
  index_t num_kv_heads = 0;  ///< Hkv; 0 means num_heads; H % Hkv == 0 keeps pairs in a group
  index_t head_dim = 0;      ///< width of every q/k/v head; 0 means E / num_heads
  bool causal = true;        ///< causal mask over the sequence
  bool rope = true;          ///< rotary embedding (interleaved pairs) on q and k; head_dim even
  double rope_base = 10000;  ///< rotary base theta
  /// Sliding window, as in DiffAttnV1Config.
  index_t window_left = -1;
  /// See window_left.
  index_t window_right = -1;
  /// Score modifiers (AttentionOptions): soft-capping (0: none); ALiBi with
  /// standard_alibi_slopes(2H), one slope per query head, so both maps of a
  /// DIFF head are covered (usually with rope = false); learned attention
  /// sinks, the parameter `sinks` (2H), initialised to 0.
  float softcap = 0;
  /// ALiBi with standard_alibi_slopes(2H), one slope per query head.
  bool alibi = false;
  /// Learned attention sinks: the parameter `sinks` (2H), initialised to 0.
  bool sinks = false;
};

/// Differential attention layer, V2 (doubled query heads):
///
///   q = rope(x Wq^T) (B, N, 2H, hd),  k = rope(x Wk^T), v = x Wv^T  (B, N, Hkv, hd)
///   lambda_logit = x Wlambda^T                                      (B, N, H)
///   a = diff_attention_v2(q, k, v, lambda_logit)                    (B, N, H, hd)
///     = attn(q_2h) - sigmoid(lambda_logit_h) attn(q_2h+1), both in kv group h / (H / Hkv)
///   y = a reshaped (B, N, H * hd) Wo^T                              (B, N, E)
///
/// No per-head norm. The KV cache per token (2 Hkv hd values) is the
/// baseline's. backward() differentiates through o_proj, the kernel (q, k, v
/// and, through the sigmoid, the lambda logits into lambda_proj.weight and x),
/// the inverse rotary rotation and the projections.
/// T is float or double, or bfloat16 / half for inference, as for
/// MultiheadDiffAttnV1. forward, backward, parameters, make_cache and the
/// other members both layers share are listed in \ref layers.
template <class T>
class MultiheadDiffAttnV2 : public detail::ModuleBase<MultiheadDiffAttnV2<T>, T> {
  using C = compute_t<T>;
  using A = detail::module_act_t<T>;  // activations: C, or bfloat16 for a bfloat16 layer
  using Base = detail::ModuleBase<MultiheadDiffAttnV2<T>, T>;
  friend Base;

 public:
  /// The configuration type, DiffAttnV2Config.
  using config_type = DiffAttnV2Config;

  /// Builds the layer with nn.Linear's default initialisation for all five
  /// projections, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), deterministic from `seed`
  /// (a 16-bit layer: the float layer's values, rounded). Throws
  /// diffattn::error for a bad configuration.
  explicit MultiheadDiffAttnV2(const DiffAttnV2Config& config, std::uint64_t seed = 0)
      : MultiheadDiffAttnV2(config, detail::ModuleNoInit{}) {
    detail::Rng rng(seed);
    for (Tensor<T, 2>* w : {&q_proj_, &k_proj_, &v_proj_, &o_proj_, &lambda_proj_})
      detail::module_init_linear(rng, w->data(), w->shape(0), w->shape(1));
  }

  /// A copy of `other` with every parameter converted to T (rounded to nearest
  /// even when narrower, exact when wider); as MultiheadDiffAttnV1's.
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  explicit MultiheadDiffAttnV2(const MultiheadDiffAttnV2<U>& other)
      : MultiheadDiffAttnV2(other.config(), detail::ModuleNoInit{}) {
    detail::module_convert_params(other.param_list(), param_list());
    num_threads_ = other.num_threads_;
  }

  /// The configuration, num_kv_heads and head_dim resolved (never 0).
  const DiffAttnV2Config& config() const noexcept { return cfg_; }
  /// Width of every query, key and value head.
  index_t head_dim() const noexcept { return cfg_.head_dim; }
  /// forward(x, position_offset), forward(x, packed) and forward(x, cache)
  /// (lambda computed per new token), set_num_threads, backward, gradients,
  /// zero_grad, parameters, num_parameters and save_safetensors, make_cache,
  /// attention_maps: see detail::ModuleBase (as MultiheadDiffAttnV1's). Errors
  /// name MultiheadDiffAttnV2::<method>. The layer's KV cache holds Hkv key
  /// heads (after rotary) and Hkv value heads of head_dim: the baseline's
  /// cache. attention_maps returns W (B, H, N, N), row i of W[b, h] =
  /// A_2h[i] - sigmoid(lambda_logit[b, i, h]) A_2h+1[i] (rows sum to 1 - lambda
  /// of their token).
  using Base::forward;
  using Base::parameter_shapes;

  /// The parameter shapes a layer with `config` would have, without building it,
  /// keyed by the reference's state_dict names as parameters() and gradients()
  /// are: q_proj.weight (2H*hd, E), k_proj.weight and v_proj.weight (Hkv*hd,
  /// E), o_proj.weight (E, H*hd), lambda_proj.weight (H, E). Throws for a bad
  /// configuration.
  static std::map<std::string, std::vector<index_t>> parameter_shapes(
      const DiffAttnV2Config& config) {
    const DiffAttnV2Config c = checked(config);
    const index_t e = c.embed_dim, h = c.num_heads, hkv = c.num_kv_heads, hd = c.head_dim;
    std::map<std::string, std::vector<index_t>> shapes = {{"q_proj.weight", {2 * h * hd, e}},
                                                          {"k_proj.weight", {hkv * hd, e}},
                                                          {"v_proj.weight", {hkv * hd, e}},
                                                          {"o_proj.weight", {e, h * hd}},
                                                          {"lambda_proj.weight", {h, e}}};
    if (c.sinks) shapes["sinks"] = {2 * h};
    return shapes;
  }

  /// Loads every parameter from prefix + name; same rules, conversions (a
  /// 16-bit layer takes its own dtype bit for bit) and errors as
  /// MultiheadDiffAttnV1::load_safetensors (native layout only).
  void load_safetensors(const std::string& path, const std::string& prefix = "") {
    this->load_from(path, prefix, this->load_sources());
  }

 private:
  template <class>
  friend class MultiheadDiffAttnV2;
  static constexpr const char* kName = "MultiheadDiffAttnV2";
  static constexpr int kVersion = 2;  // the kernel: diff_attention_v2
  // Key and value heads per token of the layer's KV cache.
  detail::ModuleCacheHeads cache_heads() const noexcept {
    return {cfg_.num_kv_heads, cfg_.head_dim, cfg_.num_kv_heads, cfg_.head_dim};
  }
  using Base::grads_;
  using Base::num_threads_;
  using Base::options;

  // The uninitialised parameters of a layer with `config`.
  MultiheadDiffAttnV2(const DiffAttnV2Config& config, detail::ModuleNoInit)
      : Base(parameter_shapes(config)),
        cfg_(checked(config)),
        q_proj_({2 * cfg_.num_heads * cfg_.head_dim, cfg_.embed_dim}),
        k_proj_({cfg_.num_kv_heads * cfg_.head_dim, cfg_.embed_dim}),
        v_proj_({cfg_.num_kv_heads * cfg_.head_dim, cfg_.embed_dim}),
        o_proj_({cfg_.embed_dim, cfg_.num_heads * cfg_.head_dim}),
        lambda_proj_({cfg_.num_heads, cfg_.embed_dim}),
        sinks_({cfg_.sinks ? 2 * cfg_.num_heads : 0}),
        mods_(cfg_.softcap, cfg_.alibi, 2 * cfg_.num_heads) {
    std::fill(sinks_.data(), sinks_.data() + sinks_.size(), T(0));
  }

  // dL/d attn from g = dL/dy (B, N, E), through o_proj.
  Tensor<T, 4> output_backward(const Tensor<T, 3>& g) {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads, hd = cfg_.head_dim;
    const index_t b = g.shape(0), n = g.shape(1), rows = b * n;
    Tensor<T, 4> dattn({b, n, h, hd});  // (B, N, H, hd)
    detail::module_linear_backward(saved_.attn.data(), rows, h * hd, o_proj_.data(), e, g.data(),
                                   grads_.at("o_proj.weight"), dattn.data(), false, num_threads_);
    return dattn;
  }

  // The kernel's gradient of the lambda logits (B, N, H), and from it
  // lambda_proj's and x's.
  Tensor<T, 3> lambda_grad(index_t b, index_t n) const {
    return Tensor<T, 3>({b, n, cfg_.num_heads});
  }
  void lambda_backward(const Tensor<T, 3>& dlogit, index_t rows, T* dx) {
    detail::module_linear_backward(saved_.x.data(), rows, cfg_.embed_dim, lambda_proj_.data(),
                                   cfg_.num_heads, dlogit.data(), grads_.at("lambda_proj.weight"),
                                   dx, true, num_threads_);
  }

  // What the last forward keeps for backward besides ModuleSaved's (a 16-bit
  // layer: nothing once forward returns).
  struct Saved : detail::ModuleSaved<T, A> {
    Tensor<A, 3> lambda_logit;  // (B, N, H)
  };

  // The lambda logits, as the kernel takes them.
  static const Tensor<A, 3>& lambda_of(const Saved& s) { return s.lambda_logit; }

  // y (B, N, E) from s.attn, through o_proj.
  Tensor<T, 3> output(Saved& s) const {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads, hd = cfg_.head_dim;
    const index_t rows = s.attn.shape(0) * s.attn.shape(1);
    Tensor<T, 3> y({s.attn.shape(0), s.attn.shape(1), e});  // (B, N, E), rounded once for 16 bits
    detail::module_linear(s.attn.data(), rows, h * hd, o_proj_.data(), e, y.data(), num_threads_);
    return y;
  }

  // attention_maps' W (B, H, N, N) from the projections in s (a bfloat16
  // layer's rounded q, k and logits, widened: what its kernel sees).
  Tensor<C, 4> maps(const Saved& s) const {
    const index_t h = cfg_.num_heads, b = s.q.shape(0), n = s.q.shape(1);
    Tensor<C, 4> w({b, h, n, n});                     // (B, H, N, N)
    const index_t group = 2 * h / cfg_.num_kv_heads;  // query heads per kv head
    const detail::KeyBand band = detail::band_of(options());
    for (index_t bi = 0; bi < b; ++bi)
      for (index_t hi = 0; hi < h; ++hi) {
        const index_t gi = 2 * hi / group;
        const Matrix<C> a1 = detail::module_softmax_map<C>(s.q, s.k, bi, 2 * hi, gi, band);
        Matrix<C> a2 = detail::module_softmax_map<C>(s.q, s.k, bi, 2 * hi + 1, gi, band);
        for (index_t i = 0; i < n; ++i)
          a2.row(i) *= lambda_sigmoid<C>(static_cast<C>(s.lambda_logit(bi, i, hi)));
        detail::module_store_map<C>(a1 - a2, w, bi, hi);
      }
    return w;
  }

  static DiffAttnV2Config checked(DiffAttnV2Config c) {
    constexpr const char* fn = "MultiheadDiffAttnV2";
    detail::module_check_heads(fn, c, "E / num_heads");
    if (c.head_dim == 0) {
      if (c.embed_dim % c.num_heads != 0)
        detail::fail(fn, "embed_dim ", c.embed_dim, " is not divisible by num_heads ", c.num_heads,
                     " (head_dim 0 means E / num_heads)");
      c.head_dim = c.embed_dim / c.num_heads;
    }
    if (c.num_heads % c.num_kv_heads != 0)
      detail::fail(fn, "num_heads ", c.num_heads, " is not a multiple of num_kv_heads ",
                   c.num_kv_heads, " (both query heads of a DIFF head must share a kv group)");
    if (c.rope && c.head_dim % 2 != 0)
      detail::fail(fn, "rope needs an even head_dim, got ", c.head_dim);
    detail::module_check_rest(fn, c);
    return c;
  }

  // s.q (B, N, 2H, hd) and s.k (B, N, Hkv, hd) after rope, s.v (B, N, Hkv, hd)
  // and s.lambda_logit (B, N, H), from the contiguous s.in (B, N, E): computed
  // in C (products of T weights), kept in A (module_project: a bfloat16
  // layer rounds each once, after rotary).
  void project(Saved& s, index_t position_offset, const std::vector<index_t>* cu) const {
    const TensorView<const T, 3> x = s.in;
    const index_t b = x.shape(0), n = x.shape(1), rows = b * n, e = cfg_.embed_dim;
    const index_t h = cfg_.num_heads, hkv = cfg_.num_kv_heads, hd = cfg_.head_dim;
    s.q = Tensor<A, 4>({b, n, 2 * h, hd});
    s.k = Tensor<A, 4>({b, n, hkv, hd});
    s.v = Tensor<A, 4>({b, n, hkv, hd});
    s.lambda_logit = Tensor<A, 3>({b, n, h});
    this->project_qkv(s, position_offset, cu);
    detail::module_linear(x.data(), rows, e, lambda_proj_.data(), h, s.lambda_logit.data(),
                          num_threads_);
  }

  std::vector<detail::ModuleParam<T>> param_list() { return param_list(this); }
  std::vector<detail::ModuleParam<const T>> param_list() const { return param_list(this); }

  // The parameters in parameter_shapes' (name) order, with the storage of
  // self (MultiheadDiffAttnV2 or const MultiheadDiffAttnV2).
  template <class Self>
  static auto param_list(Self* self) {
    using P = std::conditional_t<std::is_const<Self>::value, const T, T>;
    const std::map<std::string, P*> storage = {
        {"q_proj.weight", self->q_proj_.data()},           {"k_proj.weight", self->k_proj_.data()},
        {"v_proj.weight", self->v_proj_.data()},           {"o_proj.weight", self->o_proj_.data()},
        {"lambda_proj.weight", self->lambda_proj_.data()}, {"sinks", self->sinks_.data()}};
    std::vector<detail::ModuleParam<P>> l;
    for (const auto& kv : parameter_shapes(self->cfg_))
      l.push_back({kv.first, kv.second, storage.at(kv.first)});
    return l;
  }

  DiffAttnV2Config cfg_;
  Tensor<T, 2> q_proj_;       // (2H * hd, E)
  Tensor<T, 2> k_proj_;       // (Hkv * hd, E)
  Tensor<T, 2> v_proj_;       // (Hkv * hd, E)
  Tensor<T, 2> o_proj_;       // (E, H * hd)
  Tensor<T, 2> lambda_proj_;  // (H, E)
  Tensor<T, 1> sinks_;        // (2H) learned sinks, or (0)
  detail::ModuleMods mods_;
  Saved saved_;
};

/// @}

DIFFATTN_END_NAMESPACE
