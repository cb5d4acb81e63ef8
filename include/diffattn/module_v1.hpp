/// \file
/// MultiheadDiffAttnV1: the differential attention layer with split heads
/// (Ye et al., ICLR 2025), with reference-compatible parameters.
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

/// Configuration of MultiheadDiffAttnV1.
///
/// With embedding width E and H DIFF heads each query/key half is d wide
/// (E / (2H) unless head_dim says otherwise) and each value 2d: q_proj
/// E -> 2H d, k_proj and v_proj E -> 2Hkv d, out_proj 2H d -> E. With
/// d = E / (2H): the parameter count of a baseline layer with 2H heads.
struct DiffAttnV1Config {
  index_t embed_dim = 0;     ///< E; divisible by 2 * num_heads unless head_dim is set
  index_t num_heads = 0;     ///< H, DIFF heads (half a baseline's heads)
  index_t num_kv_heads = 0;  ///< Hkv, KV pairs for GQA; 0 means num_heads; H % Hkv == 0
  int depth = 0;             ///< 0-based layer index; lambda_init(depth)
  bool causal = true;        ///< causal mask over the sequence
  bool rope = true;          ///< rotary embedding (interleaved pairs) on q and k; d even
  bool norm_affine = true;   ///< learnable 2d weight of the per-head RMSNorm (subln.weight)
  double rope_base = 10000;  ///< rotary base theta
  /// Sliding window, as AttentionOptions::window_left / window_right (-1: no
  /// limit): a causal layer whose tokens see the last W tokens, themselves
  /// included, uses window_left = W - 1.
  index_t window_left = -1;
  /// See window_left.
  index_t window_right = -1;
  /// d, the width of one query/key half (DiffLlama's head_dim); 0 means
  /// E / (2H).
  index_t head_dim = 0;
  /// Epsilon of the per-head RMSNorm (DiffLlama's rms_norm_eps).
  double norm_eps = 1e-5;
  /// Score modifiers, as DiffAttnV2Config's: softcap (0: none), ALiBi with
  /// standard_alibi_slopes(2H) (both maps' query heads), learned sinks, the
  /// parameter `sinks` (2H), initialised to 0.
  float softcap = 0;
  /// ALiBi with standard_alibi_slopes(2H), one slope per query head.
  bool alibi = false;
  /// Learned attention sinks: the parameter `sinks` (2H), initialised to 0.
  bool sinks = false;
};

/// Order of the rows of q_proj / k_proj / v_proj in a checkpoint.
enum class WeightLayout {
  /// The Diff Transformer reference (microsoft/unilm): DIFF head h uses query
  /// heads 2h and 2h+1, kv pair g key heads 2g and 2g+1 and value head g (2d
  /// wide); rotary on interleaved feature pairs (2i, 2i+1). What save writes.
  native,
  /// Hugging Face transformers' DiffLlama (self_attn of DiffLlamaForCausalLM,
  /// num_attention_heads = 2H, num_key_value_heads = 2Hkv, head_dim = d): the
  /// two maps of DIFF head h are query heads h and h + H (first and second half
  /// of the heads), keys g and g + Hkv, the value of pair g is heads g and
  /// g + Hkv concatenated; rotary rotates feature i with i + d/2 (rotate-half).
  /// Loading permutes the rows of q_proj, k_proj and v_proj into the native
  /// order (the layer then computes exactly DiffLlama's attention), reads the
  /// output projection from `o_proj.weight`, and, DiffLlama's groupnorm having
  /// no weight, sets subln.weight to ones. Configure the layer with depth =
  /// layer_idx and rope_base = rope_theta; checkpoints with attention_bias are
  /// refused (the layer has no biases).
  diffllama,
};

/// Differential attention layer, V1 (split heads; Ye et al., ICLR 2025):
///
///   q = rope(x Wq^T) (B, N, 2H, d),  k = rope(x Wk^T) (B, N, 2Hkv, d),  v = x Wv^T (B, N, Hkv, 2d)
///   a = diff_attention_v1(q, k, v, lambda_full)                          (B, N, H, 2d)
///   y = ((1 - lambda_init) * RMSNorm_2d(a)) reshaped (B, N, E) Wout^T    (B, N, E)
///
/// lambda_full = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init(depth).
/// backward() differentiates through out_proj, the (1 - lambda_init) scale and
/// the per-head RMSNorm (input and subln.weight), the kernel (q, k, v and
/// lambda_full, and from lambda_full into the four lambda vectors), the
/// inverse rotary rotation and the projections. Parameters carry the
/// reference's state_dict names and shapes (nn.Linear weights are
/// (out_features, in_features)); T is float or double, or bfloat16 / half for
/// inference (see value_type and compute_type in detail::ModuleBase).
/// forward, backward, parameters, make_cache and the other members both layers
/// share are listed in \ref layers.
template <class T>
class MultiheadDiffAttnV1 : public detail::ModuleBase<MultiheadDiffAttnV1<T>, T> {
  using C = compute_t<T>;
  using A = detail::module_act_t<T>;  // activations: C, or bfloat16 for a bfloat16 layer
  using Base = detail::ModuleBase<MultiheadDiffAttnV1<T>, T>;
  friend Base;

 public:
  /// The configuration type, DiffAttnV1Config.
  using config_type = DiffAttnV1Config;

  /// Builds the layer and initialises it as the reference does, deterministically
  /// from `seed`: projections U(-1/sqrt(E), 1/sqrt(E)) (nn.Linear's default),
  /// the four lambda vectors N(0, 0.1^2), subln.weight ones (a 16-bit layer:
  /// the float layer's values, rounded). Throws diffattn::error for a bad
  /// configuration.
  explicit MultiheadDiffAttnV1(const DiffAttnV1Config& config, std::uint64_t seed = 0)
      : MultiheadDiffAttnV1(config, detail::ModuleNoInit{}) {
    detail::Rng rng(seed);
    const index_t e = cfg_.embed_dim;
    detail::module_init_linear(rng, q_proj_.data(), q_width(), e);
    detail::module_init_linear(rng, k_proj_.data(), kv_width(), e);
    detail::module_init_linear(rng, v_proj_.data(), kv_width(), e);
    detail::module_init_linear(rng, out_proj_.data(), e, q_width());
    for (Tensor<T, 1>* l : {&lambda_q1_, &lambda_k1_, &lambda_q2_, &lambda_k2_})
      detail::module_init_normal(rng, l->data(), d_, 0.1);
    subln_weight_.fill(T(1));
  }

  /// A copy of `other` with every parameter converted to T: rounded to
  /// nearest even when T is narrower (float -> bfloat16 or half; from double
  /// through float, as safetensors::convert), exact when it is wider
  /// (bfloat16 -> float or double). The configuration and thread count are
  /// copied; gradients start at zero and nothing is kept for backward.
  ///
  ///   MultiheadDiffAttnV1<bfloat16> small(trained);  // half the parameter bytes
  ///   MultiheadDiffAttnV1<double> twin(small);       // small's values, exactly
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  explicit MultiheadDiffAttnV1(const MultiheadDiffAttnV1<U>& other)
      : MultiheadDiffAttnV1(other.config(), detail::ModuleNoInit{}) {
    detail::module_convert_params(other.param_list(), param_list());
    num_threads_ = other.num_threads_;
  }

  /// The configuration, num_kv_heads resolved (never 0).
  const DiffAttnV1Config& config() const noexcept { return cfg_; }
  /// d, the width of one query/key half (values are 2d wide): config head_dim,
  /// or E / (2H).
  index_t head_dim() const noexcept { return d_; }
  /// lambda_init(depth), fixed by the configuration.
  double lambda_init() const noexcept { return lambda_init_; }
  /// The current lambda_full from the four lambda vectors (throws if not finite).
  C lambda_full() const {
    return static_cast<C>(
        lambda_terms<T>(lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_, lambda_init_).value());
  }
  /// forward(x, position_offset), forward(x, packed) and forward(x, cache),
  /// set_num_threads, backward, gradients, zero_grad, parameters,
  /// num_parameters and save_safetensors, make_cache, attention_maps: see
  /// detail::ModuleBase. Errors name MultiheadDiffAttnV1::<method>. The
  /// layer's KV cache holds keys (2Hkv heads of d) after rotary and values
  /// (Hkv heads of 2d). attention_maps returns W (B, H, N, N) with
  /// W[b, h] = A1 - lambda_full A2 of DIFF head h (rows sum to 1 - lambda_full).
  using Base::forward;
  using Base::parameter_shapes;

  /// The parameter shapes a layer with `config` would have, without building it
  /// (for sizing a large model), keyed by the reference's state_dict names as
  /// parameters() and gradients() are: q_proj.weight (2H d, E), k_proj.weight
  /// and v_proj.weight (2Hkv d, E), out_proj.weight (E, 2H d), lambda_q1,
  /// lambda_k1, lambda_q2, lambda_k2 (d), and subln.weight (2d) only when
  /// norm_affine. Throws for a bad configuration.
  static std::map<std::string, std::vector<index_t>> parameter_shapes(
      const DiffAttnV1Config& config) {
    std::map<std::string, std::vector<index_t>> out;
    for (auto& p : param_list(checked(config), nullptr)) out[p.name] = p.shape;
    return out;
  }

  /// Loads every parameter from the tensors prefix + name of a safetensors file
  /// (F32, F64, F16 or BF16, converted to T: a 16-bit layer takes BF16 or F16
  /// of its own type bit for bit and rounds any other to nearest even), e.g.
  /// prefix "model.layers.3.self_attn.". Extra tensors are ignored. When a
  /// tensor is missing, has another shape or a non-float dtype, or the file is
  /// unreadable or corrupt, diffattn::error names the file and the tensors
  /// (with both shapes) and no parameter is changed. `layout` selects the row
  /// order and names of the checkpoint (see WeightLayout).
  void load_safetensors(const std::string& path, const std::string& prefix = "",
                        WeightLayout layout = WeightLayout::native) {
    auto src = this->load_sources();
    if (layout == WeightLayout::diffllama) {
      src["q_proj.weight"].row_perm = detail::module_diffllama_qk_perm(2 * cfg_.num_heads, d_);
      src["k_proj.weight"].row_perm = detail::module_diffllama_qk_perm(2 * cfg_.num_kv_heads, d_);
      src["v_proj.weight"].row_perm = detail::module_diffllama_v_perm(cfg_.num_kv_heads, d_);
      src["out_proj.weight"].file_name = "o_proj.weight";
      if (cfg_.norm_affine) src["subln.weight"] = detail::ModuleSource{"", false, 1, {}};
    }
    this->load_from(path, prefix, src);
  }

 private:
  template <class>
  friend class MultiheadDiffAttnV1;
  static constexpr const char* kName = "MultiheadDiffAttnV1";
  static constexpr int kVersion = 1;  // the kernel: diff_attention_v1
  // Key and value heads per token of the layer's KV cache.
  detail::ModuleCacheHeads cache_heads() const noexcept {
    return {2 * cfg_.num_kv_heads, d_, cfg_.num_kv_heads, 2 * d_};
  }
  using Base::grads_;
  using Base::num_threads_;
  using Base::options;

  // The uninitialised parameters of a layer with `config`.
  MultiheadDiffAttnV1(const DiffAttnV1Config& config, detail::ModuleNoInit)
      : Base(parameter_shapes(config)),
        cfg_(checked(config)),
        d_(cfg_.head_dim),
        lambda_init_(diffattn::lambda_init(cfg_.depth)),
        q_proj_({q_width(), cfg_.embed_dim}),
        k_proj_({kv_width(), cfg_.embed_dim}),
        v_proj_({kv_width(), cfg_.embed_dim}),
        out_proj_({cfg_.embed_dim, q_width()}),
        lambda_q1_({d_}),
        lambda_k1_({d_}),
        lambda_q2_({d_}),
        lambda_k2_({d_}),
        subln_weight_({cfg_.norm_affine ? 2 * d_ : 0}),
        sinks_({cfg_.sinks ? 2 * cfg_.num_heads : 0}),
        mods_(cfg_.softcap, cfg_.alibi, 2 * cfg_.num_heads) {
    std::fill(sinks_.data(), sinks_.data() + sinks_.size(), T(0));
  }

  // dL/d attn from g = dL/dy (B, N, E): through out_proj, the (1 - lambda_init)
  // scale and the per-head RMSNorm (adding subln.weight's gradient).
  Tensor<T, 4> output_backward(const Tensor<T, 3>& g) {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads;
    const index_t b = g.shape(0), n = g.shape(1), rows = b * n;
    Tensor<T, 4> dnormed({b, n, h, 2 * d_});  // (B, N, H, 2d)
    detail::module_linear_backward(saved_.normed.data(), rows, q_width(), out_proj_.data(), e,
                                   g.data(), grads_.at("out_proj.weight"), dnormed.data(), false,
                                   num_threads_);
    Tensor<T, 4> dattn({b, n, h, 2 * d_});                 // (B, N, H, 2d)
    Tensor<T, 1> dsubln({cfg_.norm_affine ? 2 * d_ : 0});  // (2d) or (0)
    rms_norm_backward<T>(saved_.attn, subln_weight_, saved_.inv_rms, dnormed, dattn.view(),
                         dsubln.view(), 1.0 - lambda_init_);
    if (cfg_.norm_affine) detail::module_add(grads_.at("subln.weight"), dsubln.data(), 2 * d_);
    return dattn;
  }

  // The kernel's gradient of lambda_full, and from it the lambda vectors'.
  static T lambda_grad(index_t, index_t) { return 0; }
  void lambda_backward(T dlambda, index_t, T*) {
    // lambda_full = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init.
    const double g1 = static_cast<double>(dlambda) * saved_.lambda.e1;
    const double g2 = -static_cast<double>(dlambda) * saved_.lambda.e2;
    T* dq1 = grads_.at("lambda_q1");
    T* dk1 = grads_.at("lambda_k1");
    T* dq2 = grads_.at("lambda_q2");
    T* dk2 = grads_.at("lambda_k2");
    for (index_t i = 0; i < d_; ++i) {
      dq1[i] += static_cast<T>(g1 * static_cast<double>(lambda_k1_(i)));
      dk1[i] += static_cast<T>(g1 * static_cast<double>(lambda_q1_(i)));
      dq2[i] += static_cast<T>(g2 * static_cast<double>(lambda_k2_(i)));
      dk2[i] += static_cast<T>(g2 * static_cast<double>(lambda_q2_(i)));
    }
  }

  // What the last forward keeps for the backward pass besides ModuleSaved's
  // (a 16-bit layer: nothing once forward returns).
  struct Saved : detail::ModuleSaved<T, A> {
    Tensor<A, 4> normed;   // (B, N, H, 2d) out_proj's input
    Tensor<C, 3> inv_rms;  // (B, N, H)
    LambdaTerms lambda;
  };

  // lambda_full, as the kernel takes it.
  static C lambda_of(const Saved& s) { return static_cast<C>(s.lambda.value()); }

  // y (B, N, E) from s.attn: the per-head RMSNorm scaled by (1 - lambda_init)
  // (kept in s for backward), then out_proj. A bfloat16 layer's norm reads
  // its bfloat16 s.attn, computes in float and rounds the normed output once
  // to bfloat16 (module_rms_norm_round), out_proj's input.
  Tensor<T, 3> output(Saved& s) const {
    const index_t e = cfg_.embed_dim, h = cfg_.num_heads;
    const index_t b = s.attn.shape(0), n = s.attn.shape(1), rows = b * n;
    s.normed = Tensor<A, 4>({b, n, h, 2 * d_});  // (B, N, H, 2d)
    Tensor<C, 1> wbuf;
    const auto weight = detail::module_compute_view(subln_weight_, wbuf);
    if constexpr (std::is_same<A, C>::value) {
      s.inv_rms = Tensor<C, 3>({b, n, h});  // (B, N, H)
      rms_norm<C>(s.attn, weight, s.normed.view(), cfg_.norm_eps, 1.0 - lambda_init_,
                  s.inv_rms.view());
    } else  // no backward: no inv_rms
      detail::module_rms_norm_round(s.attn, weight, s.normed, cfg_.norm_eps, 1.0 - lambda_init_,
                                    num_threads_);
    Tensor<T, 3> y({b, n, e});  // (B, N, E), rounded once for a 16-bit layer
    detail::module_linear(s.normed.data(), rows, q_width(), out_proj_.data(), e, y.data(),
                          num_threads_);
    return y;
  }

  // attention_maps' W (B, H, N, N) from the projections in s.
  Tensor<C, 4> maps(const Saved& s) const {
    const index_t h = cfg_.num_heads, b = s.q.shape(0), n = s.q.shape(1);
    const C lambda = lambda_of(s);
    Tensor<C, 4> w({b, h, n, n});  // (B, H, N, N)
    const index_t group = h / cfg_.num_kv_heads;
    const detail::KeyBand band = detail::band_of(options());
    for (index_t bi = 0; bi < b; ++bi)
      for (index_t hi = 0; hi < h; ++hi) {
        const index_t gi = hi / group;
        const Matrix<C> a1 = detail::module_softmax_map<C>(s.q, s.k, bi, 2 * hi, 2 * gi, band);
        const Matrix<C> a2 =
            detail::module_softmax_map<C>(s.q, s.k, bi, 2 * hi + 1, 2 * gi + 1, band);
        detail::module_store_map<C>(a1 - lambda * a2, w, bi, hi);
      }
    return w;
  }

  static DiffAttnV1Config checked(DiffAttnV1Config c) {
    constexpr const char* fn = "MultiheadDiffAttnV1";
    detail::module_check_heads(fn, c, "E / (2 num_heads)");
    const bool derived = c.head_dim == 0;
    if (derived) {
      if (c.embed_dim % (2 * c.num_heads) != 0)
        detail::fail(fn, "embed_dim ", c.embed_dim,
                     " is not divisible by 2 * num_heads = ", 2 * c.num_heads,
                     " (head_dim 0 means d = E / (2H))");
      c.head_dim = c.embed_dim / (2 * c.num_heads);
    }
    if (!(c.norm_eps > 0) || !std::isfinite(c.norm_eps))
      detail::fail(fn, "norm_eps must be finite and > 0, got ", c.norm_eps);
    if (c.num_heads % c.num_kv_heads != 0)
      detail::fail(fn, "num_heads ", c.num_heads, " is not a multiple of num_kv_heads ",
                   c.num_kv_heads);
    if (c.depth < 0) detail::fail(fn, "depth must be >= 0 (0-based layer index), got ", c.depth);
    if (c.rope && c.head_dim % 2 != 0)
      detail::fail(fn, "rope needs an even head width, got ",
                   derived ? "d = E / (2H) = " : "head_dim d = ", c.head_dim);
    detail::module_check_rest(fn, c);
    return c;
  }

  index_t kv_width() const noexcept { return 2 * cfg_.num_kv_heads * d_; }  // k_proj rows
  index_t q_width() const noexcept { return 2 * cfg_.num_heads * d_; }      // q_proj rows

  // s.q (B, N, 2H, d) and s.k (B, N, 2Hkv, d) after rope, s.v (B, N, Hkv, 2d)
  // and s.lambda, from the contiguous s.in (B, N, E): computed in C (products
  // of T weights), kept in A (module_project: a bfloat16 layer rounds each
  // once, after rotary).
  void project(Saved& s, index_t position_offset, const std::vector<index_t>* cu) const {
    const TensorView<const T, 3> x = s.in;
    const index_t b = x.shape(0), n = x.shape(1);
    s.q = Tensor<A, 4>({b, n, 2 * cfg_.num_heads, d_});
    s.k = Tensor<A, 4>({b, n, 2 * cfg_.num_kv_heads, d_});
    s.v = Tensor<A, 4>({b, n, cfg_.num_kv_heads, 2 * d_});
    this->project_qkv(s, position_offset, cu);
    s.lambda = lambda_terms<T>(lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_, lambda_init_);
  }

  std::vector<detail::ModuleParam<T>> param_list() { return param_list(cfg_, this); }
  std::vector<detail::ModuleParam<const T>> param_list() const {
    std::vector<detail::ModuleParam<const T>> l;
    for (const auto& p : param_list(cfg_, const_cast<MultiheadDiffAttnV1*>(this)))
      l.push_back({p.name, p.shape, p.data});
    return l;
  }

  // The parameters of a layer with the checked config c; data pointers are those
  // of `self`, or null when only the shapes are wanted.
  static std::vector<detail::ModuleParam<T>> param_list(const DiffAttnV1Config& c,
                                                        MultiheadDiffAttnV1* self) {
    const index_t e = c.embed_dim, d = c.head_dim;
    const index_t kv = 2 * c.num_kv_heads * d, qw = 2 * c.num_heads * d;
    auto ptr = [self](Tensor<T, 2> MultiheadDiffAttnV1::*w) {
      return self ? (self->*w).data() : nullptr;
    };
    auto vptr = [self](Tensor<T, 1> MultiheadDiffAttnV1::*w) {
      return self ? (self->*w).data() : nullptr;
    };
    std::vector<detail::ModuleParam<T>> l = {
        {"q_proj.weight", {qw, e}, ptr(&MultiheadDiffAttnV1::q_proj_)},
        {"k_proj.weight", {kv, e}, ptr(&MultiheadDiffAttnV1::k_proj_)},
        {"v_proj.weight", {kv, e}, ptr(&MultiheadDiffAttnV1::v_proj_)},
        {"out_proj.weight", {e, qw}, ptr(&MultiheadDiffAttnV1::out_proj_)},
        {"lambda_q1", {d}, vptr(&MultiheadDiffAttnV1::lambda_q1_)},
        {"lambda_k1", {d}, vptr(&MultiheadDiffAttnV1::lambda_k1_)},
        {"lambda_q2", {d}, vptr(&MultiheadDiffAttnV1::lambda_q2_)},
        {"lambda_k2", {d}, vptr(&MultiheadDiffAttnV1::lambda_k2_)}};
    if (c.norm_affine)
      l.push_back({"subln.weight", {2 * d}, vptr(&MultiheadDiffAttnV1::subln_weight_)});
    if (c.sinks) l.push_back({"sinks", {2 * c.num_heads}, vptr(&MultiheadDiffAttnV1::sinks_)});
    return l;
  }

  DiffAttnV1Config cfg_;
  index_t d_;
  double lambda_init_;
  Tensor<T, 2> q_proj_;                                         // (2H d, E)
  Tensor<T, 2> k_proj_;                                         // (2Hkv d, E)
  Tensor<T, 2> v_proj_;                                         // (2Hkv d, E)
  Tensor<T, 2> out_proj_;                                       // (E, 2H d)
  Tensor<T, 1> lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_;  // (d)
  Tensor<T, 1> subln_weight_;                                   // (2d), or (0) without norm_affine
  Tensor<T, 1> sinks_;                                          // (2H) learned sinks, or (0)
  detail::ModuleMods mods_;
  Saved saved_;
};

/// @}

DIFFATTN_END_NAMESPACE
