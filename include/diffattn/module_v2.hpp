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
  bool alibi = false;
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
  using Base = detail::ModuleBase<MultiheadDiffAttnV2<T>, T>;
  friend Base;
  static constexpr bool kTrainable = !is_half_storage_v<T>;

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
  /// forward(x, position_offset) and forward(x, packed), set_num_threads,
  /// backward, gradients, zero_grad, parameters, num_parameters and
  /// save_safetensors, make_cache: see detail::ModuleBase (as
  /// MultiheadDiffAttnV1's). Errors name MultiheadDiffAttnV2::<method>. The
  /// layer's KV cache holds Hkv key heads (after rotary) and Hkv value heads of
  /// head_dim: the baseline's cache.
  using Base::forward;
  using Base::parameter_shapes;

  /// Runs the layer on n >= 1 new tokens per sequence after those the cache
  /// holds; lambda is computed per new token. As MultiheadDiffAttnV1's
  /// forward(x, cache), for a cache of T or of a 16-bit S.
  template <class S>
  Tensor<T, 3> forward(TensorView<const T, 3> x, KVCache<S>& cache) {
    this->check_cache(x, cache);
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads, hd = cfg_.head_dim;
    const index_t b = x.shape(0), n = x.shape(1), rows = b * n;
    saved_ = Saved{};
    Tensor<C, 4> q, k, v;
    Tensor<C, 3> logit;
    project(detail::module_contiguous_copy<T>(x), cache.size(), nullptr, q, k, v, logit);
    Tensor<C, 4> attn({b, n, h, hd});  // (B, n, H, hd)
    const AttentionOptions o = options();
    detail::module_cache_append(cache, k, v, [&](index_t a, index_t np, auto keys, auto values) {
      if constexpr (std::is_same<S, C>::value) {
        diff_attention_v2<C>(detail::module_rows(q, a, np), keys, values,
                             detail::module_rows(logit, a, np), detail::module_rows(attn, a, np),
                             o);
      } else {  // every sequence holds all of keys: the cache kernel reads S rows
        const detail::FullCache full(b, cache, np);
        diff_attention_v2_kvcache<C, S>(detail::module_rows(q, a, np), keys, values,
                                        detail::module_rows(logit, a, np),
                                        detail::module_rows(attn, a, np), {}, full.batch, o);
      }
    });
    Tensor<T, 3> y({b, n, e});  // (B, n, E), rounded once for a 16-bit layer
    detail::module_linear(attn.data(), rows, h * hd, o_proj_.data(), e, y.data(), num_threads_);
    return y;
  }

  /// The differential attention maps of x (B, N, E), materialised for analysis:
  /// W (B, H, N, N), row i of W[b, h] = A_2h[i] - sigmoid(lambda_logit[b, i, h]) A_2h+1[i]
  /// (rows sum to 1 - lambda of their token). O(B H N^2) memory; the state kept
  /// for backward is untouched. Same arguments and errors as forward. In
  /// compute_type (float for a 16-bit layer).
  Tensor<C, 4> attention_maps(TensorView<const T, 3> x, index_t position_offset = 0) const {
    const index_t h = cfg_.num_heads;
    this->check_input("attention_maps", x);
    if (position_offset < 0)
      this->fail_in("attention_maps", "position_offset must be >= 0, got ", position_offset);
    const index_t b = x.shape(0), n = x.shape(1);
    Tensor<C, 4> q, k, v;
    Tensor<C, 3> logit;
    if (mods_.any(cfg_.sinks))
      this->fail_in("attention_maps", "not available with softcap, alibi or sinks (issue 37)");
    project(detail::module_contiguous_copy<T>(x), position_offset, nullptr, q, k, v, logit);
    Tensor<C, 4> w({b, h, n, n});                     // (B, H, N, N)
    const index_t group = 2 * h / cfg_.num_kv_heads;  // query heads per kv head
    const detail::KeyBand band = detail::band_of(options());
    for (index_t bi = 0; bi < b; ++bi)
      for (index_t hi = 0; hi < h; ++hi) {
        const index_t gi = 2 * hi / group;
        const Matrix<C> a1 = detail::module_softmax_map<C>(q, k, bi, 2 * hi, gi, band);
        Matrix<C> a2 = detail::module_softmax_map<C>(q, k, bi, 2 * hi + 1, gi, band);
        for (index_t i = 0; i < n; ++i) a2.row(i) *= lambda_sigmoid<C>(logit(bi, i, hi));
        detail::module_store_map<C>(a1 - a2, w, bi, hi);
      }
    return w;
  }

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
    std::map<std::string, detail::ModuleSource> src;
    for (const auto& p : param_list()) src[p.name] = detail::ModuleSource{p.name, true, 1, {}};
    detail::module_load<T>("MultiheadDiffAttnV2::load_safetensors", path, prefix, param_list(),
                           src);
  }

 private:
  template <class>
  friend class MultiheadDiffAttnV2;
  static constexpr const char* kName = "MultiheadDiffAttnV2";
  // Key and value heads per token of the layer's KV cache.
  detail::ModuleCacheHeads cache_heads() const noexcept {
    return {cfg_.num_kv_heads, cfg_.head_dim, cfg_.num_kv_heads, cfg_.head_dim};
  }
  using Base::grads_;
  using Base::num_threads_;

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

  // Backward once ModuleBase::backward has checked dy against the kept state.
  Tensor<T, 3> run_backward(TensorView<const T, 3> dy) {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads, hkv = cfg_.num_kv_heads;
    const index_t hd = cfg_.head_dim;
    const index_t b = dy.shape(0), n = dy.shape(1), rows = b * n;
    if (rows == 0) return Tensor<T, 3>({b, n, e});                 // no tokens: no gradient to add
    const Tensor<T, 3> g = detail::module_contiguous_copy<T>(dy);  // (B, N, E)

    Tensor<T, 4> dattn({b, n, h, hd});  // (B, N, H, hd)
    detail::module_linear_backward(saved_.attn.data(), rows, h * hd, o_proj_.data(), e, g.data(),
                                   grads_.at("o_proj.weight"), dattn.data(), false, num_threads_);
    Tensor<T, 4> dq(saved_.q.shape()), dk(saved_.k.shape()), dv(saved_.v.shape());
    Tensor<T, 3> dlogit({b, n, h});  // (B, N, H)
    Tensor<T, 1> dsinks({cfg_.sinks ? 2 * h : 0});  // (2H) or (0): no sinks
    if (saved_.packed) {
      using detail::drop_batch;
      diff_attention_v2_varlen_backward<T>(
          drop_batch(saved_.q.cview()), drop_batch(saved_.k.cview()), drop_batch(saved_.v.cview()),
          drop_batch(saved_.lambda_logit.cview()), drop_batch(saved_.attn.cview()),
          drop_batch(saved_.lse.cview()), drop_batch(dattn.cview()), drop_batch(dq.view()),
          drop_batch(dk.view()), drop_batch(dv.view()), drop_batch(dlogit.view()), saved_.seqs,
          options(), dsinks.view());
    } else {
      diff_attention_v2_backward<T>(saved_.q, saved_.k, saved_.v, saved_.lambda_logit, saved_.attn,
                                    saved_.lse, dattn, dq.view(), dk.view(), dv.view(),
                                    dlogit.view(), options(), dsinks.view());
    }
    if (cfg_.sinks) detail::module_add(grads_.at("sinks"), dsinks.data(), 2 * h);
    // A rotation is orthogonal: its gradient is the inverse rotation.
    if (cfg_.rope) {
      const auto* cu = saved_.packed ? &saved_.seqs.cu_seqlens_q : nullptr;
      detail::module_rope<T>(dq.view(), saved_.position_offset, cu, cfg_.rope_base, true);
      detail::module_rope<T>(dk.view(), saved_.position_offset, cu, cfg_.rope_base, true);
    }
    Tensor<T, 3> dx({b, n, e});  // (B, N, E)
    const T* xs = saved_.x.data();
    detail::module_linear_backward(xs, rows, e, q_proj_.data(), 2 * h * hd, dq.data(),
                                   grads_.at("q_proj.weight"), dx.data(), false, num_threads_);
    detail::module_linear_backward(xs, rows, e, k_proj_.data(), hkv * hd, dk.data(),
                                   grads_.at("k_proj.weight"), dx.data(), true, num_threads_);
    detail::module_linear_backward(xs, rows, e, v_proj_.data(), hkv * hd, dv.data(),
                                   grads_.at("v_proj.weight"), dx.data(), true, num_threads_);
    detail::module_linear_backward(xs, rows, e, lambda_proj_.data(), h, dlogit.data(),
                                   grads_.at("lambda_proj.weight"), dx.data(), true, num_threads_);
    return dx;
  }

  // What the last forward keeps for backward (a 16-bit layer: nothing once
  // forward returns). Activations in C, unrounded.
  struct Saved {
    Tensor<T, 3> x;        // (B, N, E)
    Tensor<C, 4> q, k, v;  // (B, N, 2H, hd) after rope, (B, N, Hkv, hd) after rope, (B, N, Hkv, hd)
    Tensor<C, 3> lambda_logit;  // (B, N, H)
    Tensor<C, 4> attn;          // (B, N, H, hd) o_proj's input
    Tensor<C, 3> lse;           // (B, 2H, N)
    index_t position_offset = 0;
    bool packed = false;  // a packed batch: B = 1, sequences in `seqs`
    PackedSequences seqs;
    bool valid = false;
  };


  // The forward pass; seqs (a packed batch) or position_offset place the
  // tokens for the rotary embedding.
  Tensor<T, 3> run_forward(TensorView<const T, 3> x, index_t position_offset,
                           const PackedSequences* seqs) {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads, hd = cfg_.head_dim;
    const index_t b = x.shape(0), n = x.shape(1), rows = b * n;
    saved_ = Saved{};
    if (seqs) {
      saved_.packed = true;
      saved_.seqs.cu_seqlens_q = seqs->cu_seqlens_q;
    }
    saved_.x = detail::module_contiguous_copy<T>(x);  // (B, N, E)
    project(saved_.x, position_offset, seqs ? &saved_.seqs.cu_seqlens_q : nullptr, saved_.q,
            saved_.k, saved_.v, saved_.lambda_logit);
    saved_.attn = Tensor<C, 4>({b, n, h, hd});  // (B, N, H, hd)
    saved_.lse = Tensor<C, 3>({b, 2 * h, n});   // (B, 2H, N)
    if (seqs) {
      using detail::drop_batch;
      diff_attention_v2_varlen<C>(
          drop_batch(saved_.q.cview()), drop_batch(saved_.k.cview()), drop_batch(saved_.v.cview()),
          drop_batch(saved_.lambda_logit.cview()), drop_batch(saved_.attn.view()),
          drop_batch(saved_.lse.view()), saved_.seqs, options());
    } else {
      diff_attention_v2<C>(saved_.q, saved_.k, saved_.v, saved_.lambda_logit, saved_.attn.view(),
                           saved_.lse.view(), options());
    }
    Tensor<T, 3> y({b, n, e});  // (B, N, E), rounded once for a 16-bit layer
    detail::module_linear(saved_.attn.data(), rows, h * hd, o_proj_.data(), e, y.data(),
                          num_threads_);
    saved_.position_offset = position_offset;
    saved_.valid = true;
    if constexpr (!kTrainable) saved_ = Saved{};  // no backward: keep nothing
    return y;
  }

  static DiffAttnV2Config checked(DiffAttnV2Config c) {
    constexpr const char* fn = "MultiheadDiffAttnV2";
    if (c.embed_dim < 1) detail::fail(fn, "embed_dim must be >= 1, got ", c.embed_dim);
    if (c.num_heads < 1) detail::fail(fn, "num_heads must be >= 1, got ", c.num_heads);
    if (c.num_kv_heads < 0)
      detail::fail(fn, "num_kv_heads must be >= 0 (0: num_heads), got ", c.num_kv_heads);
    if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
    if (c.head_dim < 0)
      detail::fail(fn, "head_dim must be >= 0 (0: E / num_heads), got ", c.head_dim);
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
    if (!std::isfinite(c.rope_base) || c.rope_base <= 0)
      detail::fail(fn, "rope_base must be finite and > 0, got ", c.rope_base);
    detail::module_check_window(fn, c.causal, c.window_left, c.window_right);
    detail::module_check_softcap(fn, c.softcap);
    return c;
  }

  AttentionOptions options() const {
    AttentionOptions o =
        detail::module_options(cfg_.causal, cfg_.window_left, cfg_.window_right, num_threads_);
    mods_.apply(o, cfg_.sinks ? sinks_.data() : static_cast<const T*>(nullptr), sinks_.size());
    return o;
  }

  // q (B, N, 2H, hd) and k (B, N, Hkv, hd) after rope, v (B, N, Hkv, hd) and
  // lambda_logit (B, N, H), from the contiguous x (B, N, E): in C, from T
  // weights widened as they are packed.
  void project(const Tensor<T, 3>& x, index_t position_offset, const std::vector<index_t>* cu,
               Tensor<C, 4>& q, Tensor<C, 4>& k, Tensor<C, 4>& v,
               Tensor<C, 3>& lambda_logit) const {
    const index_t b = x.shape(0), n = x.shape(1), rows = b * n, e = cfg_.embed_dim;
    const index_t h = cfg_.num_heads, hkv = cfg_.num_kv_heads, hd = cfg_.head_dim;
    q = Tensor<C, 4>({b, n, 2 * h, hd});
    k = Tensor<C, 4>({b, n, hkv, hd});
    v = Tensor<C, 4>({b, n, hkv, hd});
    lambda_logit = Tensor<C, 3>({b, n, h});
    detail::module_linear(x.data(), rows, e, q_proj_.data(), 2 * h * hd, q.data(), num_threads_);
    detail::module_linear(x.data(), rows, e, k_proj_.data(), hkv * hd, k.data(), num_threads_);
    detail::module_linear(x.data(), rows, e, v_proj_.data(), hkv * hd, v.data(), num_threads_);
    detail::module_linear(x.data(), rows, e, lambda_proj_.data(), h, lambda_logit.data(),
                          num_threads_);
    if (cfg_.rope) {
      detail::module_rope<C>(q.view(), position_offset, cu, cfg_.rope_base, false);
      detail::module_rope<C>(k.view(), position_offset, cu, cfg_.rope_base, false);
    }
  }

  std::vector<detail::ModuleParam<T>> param_list() { return param_list(this); }
  std::vector<detail::ModuleParam<const T>> param_list() const { return param_list(this); }

  // The parameters in parameter_shapes' (name) order, with the storage of
  // self (MultiheadDiffAttnV2 or const MultiheadDiffAttnV2).
  template <class Self>
  static auto param_list(Self* self) {
    using P = std::conditional_t<std::is_const<Self>::value, const T, T>;
    const std::map<std::string, P*> storage = {{"q_proj.weight", self->q_proj_.data()},
                                               {"k_proj.weight", self->k_proj_.data()},
                                               {"v_proj.weight", self->v_proj_.data()},
                                               {"o_proj.weight", self->o_proj_.data()},
                                               {"lambda_proj.weight", self->lambda_proj_.data()},
                                               {"sinks", self->sinks_.data()}};
    std::vector<detail::ModuleParam<P>> l;
    for (const auto& kv : parameter_shapes(self->cfg_))
      l.push_back({kv.first, kv.second, storage.at(kv.first)});
    return l;
  }

  DiffAttnV2Config cfg_;
  Tensor<T, 2> q_proj_;           // (2H * hd, E)
  Tensor<T, 2> k_proj_;           // (Hkv * hd, E)
  Tensor<T, 2> v_proj_;           // (Hkv * hd, E)
  Tensor<T, 2> o_proj_;           // (E, H * hd)
  Tensor<T, 2> lambda_proj_;  // (H, E)
  Tensor<T, 1> sinks_;        // (2H) learned sinks, or (0)
  detail::ModuleMods mods_;
  Saved saved_;
};

/// @}

DIFFATTN_END_NAMESPACE
