// ModuleBase: what the layer classes share (threads, the forward driver for
// the whole-sequence, packed and cached forward passes, the backward driver,
// attention_maps' prologue, the gradient buffers, make_cache, the parameter
// maps and saving), written once over a Derived layer (CRTP, as Eigen's
// MatrixBase). The layers' own headers keep what differs: configuration,
// projections, lambda, what follows the kernel (V1's norm), loading and the
// maps' loop.
#pragma once

#include <cmath>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../attention.hpp"
#include "../../attention_backward.hpp"
#include "../../config.hpp"
#include "../../float8.hpp"
#include "../../kv_cache.hpp"
#include "../../kvcache_attention.hpp"
#include "../../options.hpp"
#include "../../packed.hpp"
#include "../../tensor.hpp"
#include "../../types.hpp"
#include "../core/format.hpp"
#include "module_common.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Key and value heads per token of a layer's KV cache.
struct ModuleCacheHeads {
  index_t key_heads, key_dim, value_heads, value_dim;
};

/// What both layers' forward keeps for backward; a layer's Saved adds its
/// own (V1: lambda and the norm's, V2: the lambda logits). Activations in A
/// (module_act_t<T>: C, unrounded, or bfloat16 for a bfloat16 layer, which
/// keeps nothing once forward returns), lse in C.
template <class T, class A, class C = compute_t<T>>
struct ModuleSaved {
  Tensor<T, 3> x;  // (B, N, E) the input, contiguous (for backward, or a strided x's copy)
  TensorView<const T, 3> in;  // (B, N, E) what project reads: x, or the caller's contiguous x
  Tensor<A, 4> q, k, v;       // (B, N, 2H, dq), (B, N, Hk, dq) after rope; (B, N, Hkv, dv)
  Tensor<A, 4> attn;          // (B, N, H, dv) kernel output
  Tensor<C, 3> lse;           // (B, 2H, N) log-sum-exp of each query head's map
  index_t position_offset = 0;
  bool packed = false;  // a packed batch: B = 1, sequences in `seqs`
  PackedSequences seqs;
  bool valid = false;
};

/// The first checks of a layer's configuration c (fn names the layer):
/// widths and head counts, num_kv_heads 0 resolved to num_heads;
/// head_dim_zero says what head_dim 0 means.
template <class Config>
void module_check_heads(const char* fn, Config& c, const char* head_dim_zero) {
  if (c.embed_dim < 1) fail(fn, "embed_dim must be >= 1, got ", c.embed_dim);
  if (c.num_heads < 1) fail(fn, "num_heads must be >= 1, got ", c.num_heads);
  if (c.num_kv_heads < 0)
    fail(fn, "num_kv_heads must be >= 0 (0: num_heads), got ", c.num_kv_heads);
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.head_dim < 0) fail(fn, "head_dim must be >= 0 (0: ", head_dim_zero, "), got ", c.head_dim);
}

/// The last checks of a layer's configuration: rotary base, window, softcap.
template <class Config>
void module_check_rest(const char* fn, const Config& c) {
  if (!std::isfinite(c.rope_base) || c.rope_base <= 0)
    fail(fn, "rope_base must be finite and > 0, got ", c.rope_base);
  module_check_window(fn, c.causal, c.window_left, c.window_right);
  module_check_softcap(fn, c.softcap);
}

/// The forms of a layer's kernel the shared driver runs.
enum class ModuleKernel { dense, varlen, kvcache, backward, varlen_backward };

/// A layer's lambda argument as the kernel takes it: V1's lambda_full (a
/// scalar, or its gradient, a scalar reference) as it is, V2's lambda logits
/// (B, N, H) as a view: whole, without the batch (a packed batch) or rows
/// [a, a + np) (a cached forward's piece).
template <class L>
decltype(auto) module_lambda(L& l) {
  if constexpr (std::is_arithmetic<L>::value) {
    return (l);
  } else {
    return l.view();
  }
}
/// See module_lambda.
template <class L>
decltype(auto) module_lambda_packed(L& l) {
  if constexpr (std::is_arithmetic<L>::value) {
    return (l);
  } else {
    return drop_batch(l.view());
  }
}
/// See module_lambda.
template <class L>
decltype(auto) module_lambda_rows(L& l, index_t a, index_t np) {
  if constexpr (std::is_arithmetic<L>::value) {
    return (l);
  } else {
    return module_rows(l, a, np);
  }
}
/// A layer's lambda argument in C: V1's scalar as it is, V2's logits (a
/// bfloat16 layer's) widened into a new tensor.
template <class C, class L>
auto module_lambda_as(const L& l) {
  if constexpr (std::is_arithmetic<L>::value) {
    return l;
  } else {
    return module_converted<C>(l);
  }
}

struct ModuleAccess;

/// The members MultiheadDiffAttnV1 and MultiheadDiffAttnV2 share. Derived
/// provides, as friends of this class may call them:
///   static constexpr const char* kName;                 // "MultiheadDiffAttnV1"
///   static constexpr int kVersion;                      // 1 or 2: the kernel
///   const config_type& config() const;                  // embed_dim, num_heads, causal, window,
///                                                       // sinks
///   ModuleCacheHeads cache_heads() const;               // what its KV cache holds
///   static shapes parameter_shapes(const config_type&); // name -> PyTorch shape
///   std::vector<ModuleParam<T>> param_list();           // and a const overload
///   struct Saved : ModuleSaved<T, A>;                   // what forward keeps (A: activations)
///   void project(Saved& s, position_offset, cu) const;  // s.q, s.k, s.v, lambda from s.in
///   lambda_of(const Saved&);                            // the kernel's lambda argument
///   Tensor<T, 3> output(Saved& s) const;                // y from s.attn
///   Tensor<T, 4> output_backward(g);                    // dL/d attn from dL/dy
///   lambda_grad(b, n); lambda_backward(dlambda, rows, dx);  // lambda's gradient
///   Tensor<C, 4> maps(const Saved&) const;              // attention_maps' loop
///   saved_; mods_, sinks_ (the score modifiers); q_proj_, k_proj_, v_proj_
template <class Derived, class T>
class ModuleBase {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value ||
                    is_half_storage_v<T>,
                "a layer's T is float, double, bfloat16 or half");
  static constexpr bool kTrainable = !is_half_storage_v<T>;
  using Act = module_act_t<T>;  // the activations' storage (see compute_type)

 public:
  /// Storage of the parameters, of x and of y. A bfloat16 or half layer keeps
  /// its parameters in half the bytes and runs forward only (backward,
  /// gradients() and zero_grad() do not compile for it).
  using value_type = T;
  /// What the layer computes in: T for float and double, float for the 16-bit
  /// layers. Projections, rotary, lambda, the norm and the kernel's
  /// accumulators run in it. A float, double or half layer also keeps the
  /// activations between them (q, k, v, the lambda logits, the attention
  /// output) in it, so a half layer rounds only its output y (and keys and
  /// values as they enter a 16-bit KV cache). A bfloat16 layer keeps them in
  /// bfloat16, as a PyTorch bf16 module does, each computed in float and
  /// rounded once when stored: q and k after rotary, v, V2's lambda logits,
  /// the attention output, V1's normed output (out_proj's input), and y. Its
  /// attention kernel and both projections then run on bf16 data (bf16 dot
  /// products where the build targets AVX512-BF16). V1's lambda_full stays a
  /// float scalar.
  using compute_type = compute_t<T>;

  /// Threads of the attention kernel and the projections (0: the OpenMP
  /// default); results are bitwise identical for any count.
  void set_num_threads(int n) {
    if (n < 0) fail_in("set_num_threads", "n must be >= 0, got ", n);
    num_threads_ = n;
  }
  /// The threads set by set_num_threads (0: the OpenMP default).
  int num_threads() const noexcept { return num_threads_; }

  /// Runs the layer on x (B, N, E) (any strides) and returns y (B, N, E),
  /// contiguous. Tokens sit at positions position_offset .. position_offset + N - 1
  /// for the rotary embedding (a block of new tokens after N0 earlier ones uses
  /// offset N0); keys and values come from x alone. The causal mask, when on,
  /// lets token i see tokens j <= i. Keeps what backward needs (the
  /// projections, the kernel's log-sum-exp and, in V1, the norm statistics:
  /// O(B N E), never N x N); a 16-bit layer keeps nothing. Throws
  /// diffattn::error when x's last extent is not E or the offset is negative.
  Tensor<T, 3> forward(TensorView<const T, 3> x, index_t position_offset = 0) {
    check_input("forward", x);
    if (position_offset < 0)
      fail_in("forward", "position_offset must be >= 0, got ", position_offset);
    return derived().run_forward(x, position_offset, nullptr);
  }

  /// Runs the layer on a packed batch: x (1, T, E) holds seqs.size()
  /// sequences back to back (token rows [cu_seqlens_q[s], cu_seqlens_q[s + 1])),
  /// each attending only to itself (causal and window per sequence), its
  /// rotary positions starting at 0. Equals forward on each sequence alone;
  /// backward(dy) follows it as it follows forward. cu_seqlens_k must be empty
  /// or equal to cu_seqlens_q.
  Tensor<T, 3> forward(TensorView<const T, 3> x, const PackedSequences& seqs) {
    check_input("forward", x);
    module_check_packed(qualified("forward").c_str(), x, seqs.cu_seqlens_q, seqs.cu_seqlens_k);
    return derived().run_forward(x, 0, &seqs);
  }

  /// Runs the layer on n >= 1 new tokens per sequence, x (B, n, E), after the
  /// cache.size() tokens the cache holds: rotates the new queries and keys at
  /// positions cache.size() .. cache.size() + n - 1, appends the new keys and
  /// values, attends causally (and within the window) over everything cached,
  /// and returns y (B, n, E). Prefill then token-by-token decoding gives what
  /// forward gives on the whole sequence; V2 computes lambda per new token.
  /// Keeps nothing for backward (a later backward throws until the next
  /// forward). Throws, changing nothing, when the cache is full, was made for
  /// another layer or another batch size. A 16-bit cache
  /// (make_cache<bfloat16>, or a 16-bit layer's make_cache()) is read by the
  /// kernel in compute_type, the new keys and values rounded to S when
  /// appended (a bfloat16 layer's are bfloat16 already: its own cache runs
  /// its bfloat16 kernel, a float cache the float kernel on its queries
  /// widened); an 8-bit one (make_cache<std::int8_t>, make_cache<float8_e4m3>)
  /// gets them quantized per row with their scales, and a non-finite key or
  /// value throws, changing nothing.
  template <class S>
  Tensor<T, 3> forward(TensorView<const T, 3> x, KVCache<S>& cache) {
    check_cache(x, cache);
    derived().saved_ = typename Derived::Saved{};
    typename Derived::Saved s;  // this call's activations, dropped on return
    s.in = module_contiguous(x, s.x);
    derived().project(s, cache.size(), nullptr);
    const index_t b = x.shape(0), n = x.shape(1), h = derived().config().num_heads;
    s.attn = Tensor<Act, 4>({b, n, h, s.v.shape(3)});  // (B, n, H, dv)
    const auto& lambda = derived().lambda_of(s);
    const AttentionOptions o = options();
    // The kernels take keys and values of the queries' type, of a 16-bit
    // type, or 8-bit under float or 16-bit queries; a bfloat16 layer's float
    // cache (make_cache<float>) is read by the float kernel on its queries
    // and lambda logits widened, the output rounded to bfloat16.
    constexpr bool wide = !std::is_same<S, Act>::value && !is_half_storage_v<S> &&
                          !is_8bit_storage_v<S> && !std::is_same<Act, compute_type>::value;
    module_cache_append(cache, s.k, s.v, [&](index_t a, index_t np, auto keys, auto values) {
      const auto q = module_rows(s.q, a, np);
      const auto out = module_rows(s.attn, a, np);
      if constexpr (std::is_same<S, Act>::value) {
        kernel<ModuleKernel::dense>(q, keys, values, module_lambda_rows(lambda, a, np), out, o);
      } else if constexpr (wide) {
        static_assert(std::is_same<S, compute_type>::value, "a float cache");
        Tensor<compute_type, 4> qw({b, np, q.shape(2), q.shape(3)}), ow(out.shape());
        for (index_t i = 0; i < b; ++i)
          convert_row(&q(i, 0, 0, 0), np * q.shape(2) * q.shape(3), &qw(i, 0, 0, 0));
        auto lw = module_lambda_as<compute_type>(lambda);
        const FullCache full(b, cache, np);
        if constexpr (Derived::kVersion == 1)
          diff_attention_v1_kvcache<compute_type, S>(qw, keys, values, lw, ow.view(), {},
                                                     full.batch, o);
        else
          diff_attention_v2_kvcache<compute_type, S>(qw, keys, values, module_rows(lw, a, np),
                                                     ow.view(), {}, full.batch, o);
        for (index_t i = 0; i < b; ++i)
          convert_row(&ow(i, 0, 0, 0), np * out.shape(2) * out.shape(3), &out(i, 0, 0, 0));
      } else {  // every sequence holds all of keys: the cache kernel reads S rows
        const FullCache full(b, cache, np);
        kernel<ModuleKernel::kvcache, S>(q, keys, values, module_lambda_rows(lambda, a, np), out,
                                         TensorView<compute_type, 3>(), full.batch, o);
      }
    });
    return derived().output(s);
  }

  /// The differential attention maps of x (B, N, E), materialised for
  /// analysis: W (B, H, N, N), row i of W[b, h] the weights token i puts on
  /// tokens 0 .. N - 1 through DIFF head h (the layer's class comment gives
  /// the formula; masked entries 0). O(B H N^2) memory; the state kept for
  /// backward is untouched. Same arguments and errors as forward, and throws
  /// with softcap, alibi or sinks. In compute_type (float for a 16-bit layer).
  Tensor<compute_type, 4> attention_maps(TensorView<const T, 3> x,
                                         index_t position_offset = 0) const {
    check_input("attention_maps", x);
    if (position_offset < 0)
      fail_in("attention_maps", "position_offset must be >= 0, got ", position_offset);
    if (derived().mods_.any(derived().config().sinks))
      fail_in("attention_maps", "not available with softcap, alibi or sinks (issue 37)");
    typename Derived::Saved s;
    s.in = module_contiguous(x, s.x);
    derived().project(s, position_offset, nullptr);
    return derived().maps(s);
  }

  /// Backward of the last forward: takes dy = dL/dy (B, N, E) (any strides)
  /// and returns dx = dL/dx (B, N, E), contiguous, and ADDS dL/dparameter to
  /// every gradient buffer (see gradients()), through every step of the
  /// forward pass (the layer's class comment lists them). The forward's state
  /// is kept: a second backward after one forward adds the same gradients
  /// again. Parameters must not change between forward and backward. An empty
  /// batch or sequence returns an empty dx and adds nothing. Throws
  /// diffattn::error when no forward ran yet or dy's shape is not the forward
  /// output's. Not for a 16-bit layer (a compile-time error): train in float
  /// and convert.
  Tensor<T, 3> backward(TensorView<const T, 3> dy) {
    static_assert(kTrainable,
                  "backward: a bfloat16 / half layer runs forward only; train in float, then "
                  "convert");
    if constexpr (kTrainable) {
      const auto& saved = derived().saved_;
      if (!saved.valid) fail_in("backward", "backward called before forward");
      if (dy.shape() != saved.x.shape())
        fail_in("backward", "dy has shape ", shape_str(dy.shape()), ", expected ",
                shape_str(saved.x.shape()), " (the output of the last forward)");
      return run_backward(dy);
    } else {
      return {};
    }
  }

  /// The accumulated gradient of every parameter, keyed and flattened exactly
  /// as parameters() (same names, sizes and order), so an optimizer pairs them
  /// by name. The views write through; zero_grad() clears them. Float and
  /// double layers only.
  std::map<std::string, TensorView<T, 1>> gradients() {
    static_assert(kTrainable,
                  "gradients: a bfloat16 / half layer runs forward only; train in float, then "
                  "convert");
    return grads_.views();
  }
  /// Sets every gradient to zero (backward adds to them). Float and double
  /// layers only.
  void zero_grad() {
    static_assert(kTrainable,
                  "zero_grad: a bfloat16 / half layer runs forward only; train in float, then "
                  "convert");
    grads_.zero();
  }

  /// Every parameter by its reference state_dict name, flattened row-major as
  /// PyTorch stores it (the layer's parameter_shapes lists them). The views
  /// write through to the layer.
  std::map<std::string, TensorView<T, 1>> parameters() {
    std::map<std::string, TensorView<T, 1>> out;
    for (const auto& p : derived().param_list())
      out.emplace(p.name, TensorView<T, 1>(p.data, {p.numel()}));
    return out;
  }
  /// The PyTorch shape of every parameter, keyed as parameters().
  std::map<std::string, std::vector<index_t>> parameter_shapes() const {
    return Derived::parameter_shapes(derived().config());
  }
  /// Total number of parameters.
  index_t num_parameters() const { return module_count(parameter_shapes()); }

  /// A KV cache for this layer: `batch` sequences of up to `capacity` tokens,
  /// its keys after rotary and its values (the layer's class comment says how
  /// many heads of what width). With a sliding window it keeps at most 2W
  /// rows (see KVCache). Throws for a non-causal layer: token-by-token
  /// decoding equals the whole sequence only under the causal mask. S is the
  /// cache's storage: T, or bfloat16 / half (make_cache<bfloat16>(...)) for a
  /// cache of half the bytes, the keys and values rounded to S as they are
  /// appended (a float layer's queries are not), or compute_type (a float cache for a
  /// 16-bit layer). A layer computing in float also takes std::int8_t or
  /// float8_e4m3 (make_cache<std::int8_t>(...)): an 8-bit cache, a quarter of
  /// float's bytes plus a float scale per (token, head), its keys (after
  /// rotary) and values quantized per row as they are appended (quantize_rows).
  template <class S = T>
  KVCache<S> make_cache(index_t batch, index_t capacity) const {
    static_assert(std::is_same<S, T>::value || std::is_same<S, compute_type>::value ||
                      is_half_storage_v<S> ||
                      (is_8bit_storage_v<S> && std::is_same<compute_type, float>::value),
                  "make_cache: the cache holds T, compute_type, bfloat16 or half, or (layers "
                  "computing in float) std::int8_t or float8_e4m3");
    if (!derived().config().causal)
      fail_in("make_cache", "a KV cache needs a causal layer (config.causal = true)");
    const ModuleCacheHeads h = derived().cache_heads();
    return KVCache<S>(batch, capacity, h.key_heads, h.key_dim, h.value_heads, h.value_dim,
                      derived().config().window_left);
  }

  /// Writes every parameter as prefix + name in T's dtype (F32, F64, BF16 or
  /// F16, bit for bit), in the native layout, with metadata {"format": "pt"}:
  /// the file loads with safetensors.torch.load_file into the reference
  /// module's state_dict.
  void save_safetensors(const std::string& path, const std::string& prefix = "") const {
    module_save<T>(path, prefix, derived().param_list());
  }

 protected:
  explicit ModuleBase(const std::map<std::string, std::vector<index_t>>& shapes) : grads_(shapes) {}

  Derived& derived() { return static_cast<Derived&>(*this); }
  const Derived& derived() const { return static_cast<const Derived&>(*this); }

  /// "<Derived>::<method>", the name errors of that method carry.
  static std::string qualified(const char* method) { return cat(Derived::kName, "::", method); }
  /// Throws diffattn::error("<Derived>::<method>: <message pieces>").
  template <class... Args>
  [[noreturn]] static void fail_in(const char* method, const Args&... args) {
    fail(qualified(method).c_str(), args...);
  }

  /// The kernel options of the layer: mask, window, threads, score modifiers.
  AttentionOptions options() const {
    const auto& c = derived().config();
    AttentionOptions o = module_options(c.causal, c.window_left, c.window_right, num_threads_);
    const auto& sinks = derived().sinks_;
    derived().mods_.apply(o, c.sinks ? sinks.data() : static_cast<const T*>(nullptr), sinks.size());
    return o;
  }

  /// Derived's kernel (diff_attention_v1 or _v2) in form F on the arguments a;
  /// S is a KV cache's storage.
  template <ModuleKernel F, class S = detail::module_act_t<T>, class... A>
  static void kernel(A&&... a) {
    using C = detail::module_act_t<T>;  // the kernel's storage: the activations'
    constexpr bool v1 = Derived::kVersion == 1;
    if constexpr (F == ModuleKernel::dense) {
      if constexpr (v1) diff_attention_v1<C>(std::forward<A>(a)...);
      if constexpr (!v1) diff_attention_v2<C>(std::forward<A>(a)...);
    } else if constexpr (F == ModuleKernel::varlen) {
      if constexpr (v1) diff_attention_v1_varlen<C>(std::forward<A>(a)...);
      if constexpr (!v1) diff_attention_v2_varlen<C>(std::forward<A>(a)...);
    } else if constexpr (F == ModuleKernel::kvcache) {
      if constexpr (v1) diff_attention_v1_kvcache<C, S>(std::forward<A>(a)...);
      if constexpr (!v1) diff_attention_v2_kvcache<C, S>(std::forward<A>(a)...);
    } else if constexpr (F == ModuleKernel::backward) {
      if constexpr (v1) diff_attention_v1_backward<T>(std::forward<A>(a)...);
      if constexpr (!v1) diff_attention_v2_backward<T>(std::forward<A>(a)...);
    } else {
      if constexpr (v1) diff_attention_v1_varlen_backward<T>(std::forward<A>(a)...);
      if constexpr (!v1) diff_attention_v2_varlen_backward<T>(std::forward<A>(a)...);
    }
  }

  /// s.q, s.k and s.v (shaped by the layer's project) from s.in through
  /// q_proj_, k_proj_ and v_proj_, q and k rotated at position_offset (or
  /// per packed sequence, cu) when the layer has rotary: module_project.
  template <class SavedT>
  void project_qkv(SavedT& s, index_t position_offset, const std::vector<index_t>* cu) const {
    const auto& d = derived();
    const auto& c = d.config();
    const index_t rows = s.in.shape(0) * s.in.shape(1), e = c.embed_dim;
    const T* x = s.in.data();
    module_project<compute_type>(x, rows, e, d.q_proj_.data(), s.q, c.rope, position_offset, cu,
                                 c.rope_base, num_threads_);
    module_project<compute_type>(x, rows, e, d.k_proj_.data(), s.k, c.rope, position_offset, cu,
                                 c.rope_base, num_threads_);
    module_project<compute_type>(x, rows, e, d.v_proj_.data(), s.v, false, 0, nullptr, c.rope_base,
                                 num_threads_);
  }

  /// The forward pass; seqs (a packed batch) or position_offset place the
  /// tokens for the rotary embedding. Keeps what backward needs in saved_.
  Tensor<T, 3> run_forward(TensorView<const T, 3> x, index_t position_offset,
                           const PackedSequences* seqs) {
    auto& s = derived().saved_;
    s = typename Derived::Saved{};
    if (seqs) {
      s.packed = true;
      s.seqs.cu_seqlens_q = seqs->cu_seqlens_q;
    }
    if constexpr (kTrainable) {
      s.x = module_contiguous_copy<T>(x);  // (B, N, E), kept for backward
      s.in = s.x.cview();
    } else {
      s.in = module_contiguous(x, s.x);  // no backward: x itself when contiguous
    }
    derived().project(s, position_offset, seqs ? &s.seqs.cu_seqlens_q : nullptr);
    const index_t b = x.shape(0), n = x.shape(1), h = derived().config().num_heads;
    s.attn = Tensor<Act, 4>({b, n, h, s.v.shape(3)});  // (B, N, H, dv)
    if constexpr (kTrainable)  // a 16-bit layer has no backward: no lse (an empty view)
      s.lse = Tensor<compute_type, 3>({b, 2 * h, n});  // (B, 2H, N)
    const auto& lambda = derived().lambda_of(s);
    if (seqs) {
      kernel<ModuleKernel::varlen>(drop_batch(s.q.cview()), drop_batch(s.k.cview()),
                                   drop_batch(s.v.cview()), module_lambda_packed(lambda),
                                   drop_batch(s.attn.view()), drop_batch(s.lse.view()), s.seqs,
                                   options());
    } else {
      kernel<ModuleKernel::dense>(s.q, s.k, s.v, module_lambda(lambda), s.attn.view(), s.lse.view(),
                                  options());
    }
    Tensor<T, 3> y = derived().output(s);  // (B, N, E), rounded once for a 16-bit layer
    s.position_offset = position_offset;
    s.valid = true;
    if constexpr (!kTrainable) s = typename Derived::Saved{};  // no backward: keep nothing
    return y;
  }

  /// Backward once backward() has checked dy against the kept state.
  Tensor<T, 3> run_backward(TensorView<const T, 3> dy) {
    const auto& s = derived().saved_;
    const auto& c = derived().config();
    const index_t e = c.embed_dim, h = c.num_heads;
    const index_t b = dy.shape(0), n = dy.shape(1), rows = b * n;
    if (rows == 0) return Tensor<T, 3>({b, n, e});            // no tokens: no gradient to add
    const Tensor<T, 3> g = module_contiguous_copy<T>(dy);     // (B, N, E)
    const Tensor<T, 4> dattn = derived().output_backward(g);  // (B, N, H, dv)
    Tensor<T, 4> dq(s.q.shape()), dk(s.k.shape()), dv(s.v.shape());
    auto dlambda = derived().lambda_grad(b, n);
    Tensor<T, 1> dsinks({c.sinks ? 2 * h : 0});  // (2H) or (0): no sinks
    const auto& lambda = derived().lambda_of(s);
    if (s.packed) {
      kernel<ModuleKernel::varlen_backward>(
          drop_batch(s.q.cview()), drop_batch(s.k.cview()), drop_batch(s.v.cview()),
          module_lambda_packed(lambda), drop_batch(s.attn.cview()), drop_batch(s.lse.cview()),
          drop_batch(dattn.cview()), drop_batch(dq.view()), drop_batch(dk.view()),
          drop_batch(dv.view()), module_lambda_packed(dlambda), s.seqs, options(), dsinks.view());
    } else {
      kernel<ModuleKernel::backward>(s.q, s.k, s.v, module_lambda(lambda), s.attn, s.lse, dattn,
                                     dq.view(), dk.view(), dv.view(), module_lambda(dlambda),
                                     options(), dsinks.view());
    }
    if (c.sinks) module_add(grads_.at("sinks"), dsinks.data(), 2 * h);
    // A rotation is orthogonal: its gradient is the inverse rotation.
    if (c.rope) {
      const auto* cu = s.packed ? &s.seqs.cu_seqlens_q : nullptr;
      module_rope<T>(dq.view(), s.position_offset, cu, c.rope_base, true);
      module_rope<T>(dk.view(), s.position_offset, cu, c.rope_base, true);
    }
    Tensor<T, 3> dx({b, n, e});  // (B, N, E)
    const T* xs = s.x.data();
    const Derived& l = derived();
    module_linear_backward(xs, rows, e, l.q_proj_.data(), dq.shape(2) * dq.shape(3), dq.data(),
                           grads_.at("q_proj.weight"), dx.data(), false, num_threads_);
    module_linear_backward(xs, rows, e, l.k_proj_.data(), dk.shape(2) * dk.shape(3), dk.data(),
                           grads_.at("k_proj.weight"), dx.data(), true, num_threads_);
    module_linear_backward(xs, rows, e, l.v_proj_.data(), dv.shape(2) * dv.shape(3), dv.data(),
                           grads_.at("v_proj.weight"), dx.data(), true, num_threads_);
    derived().lambda_backward(dlambda, rows, dx.data());
    return dx;
  }

  /// Where load_safetensors reads each parameter by default: prefix + its own
  /// name, as stored.
  std::map<std::string, ModuleSource> load_sources() const {
    std::map<std::string, ModuleSource> src;
    for (const auto& p : derived().param_list()) src[p.name] = ModuleSource{p.name, true, 1, {}};
    return src;
  }
  /// Loads every parameter from prefix + its source in `src` (see module_load).
  void load_from(const std::string& path, const std::string& prefix,
                 const std::map<std::string, ModuleSource>& src) {
    module_load<T>(qualified("load_safetensors").c_str(), path, prefix, derived().param_list(),
                   src);
  }

  /// Throws unless x is (B, N, E).
  void check_input(const char* method, const TensorView<const T, 3>& x) const {
    const index_t e = derived().config().embed_dim;
    if (x.shape(2) != e)
      fail_in(method, "x has shape ", shape_str(x.shape()), ", expected (B, N, ", e, ")");
  }

  /// Throws unless x (B, n, E) can run against `cache`: a causal layer, a
  /// cache made by this layer's make_cache for batch B, room for n tokens.
  template <class S>
  void check_cache(const TensorView<const T, 3>& x, const KVCache<S>& cache) const {
    check_input("forward", x);
    const auto& c = derived().config();
    if (!c.causal) fail_in("forward", "a KV cache needs a causal layer (config.causal = true)");
    const ModuleCacheHeads h = derived().cache_heads();
    module_check_cache(qualified("forward").c_str(), cache, x, h.key_heads, h.key_dim,
                       h.value_heads, h.value_dim, c.window_left);
  }

  /// The cached forward around an attention call the caller makes
  /// (diffattn::mpi::forward, whose ranks each hold a slice of the cache):
  /// projects x (B, n, E) with its tokens at positions position ..
  /// position + n - 1, calls attend(q, k, v, lambda, out, options) on the new
  /// tokens' q, k, v (B, n, heads, width, compute_type), the kernel's lambda
  /// argument (a scalar for V1, the (B, n, H) logits for V2), out (B, n, H,
  /// dv) to fill and the layer's kernel options, then returns y (B, n, E).
  /// Keeps nothing for backward. check_cache_shape(x, cache) first. A
  /// bfloat16 layer's q, k, v and lambda logits (bfloat16) are widened for
  /// attend, and its out rounded to bfloat16.
  template <class Attend>
  Tensor<T, 3> forward_around(TensorView<const T, 3> x, index_t position, Attend&& attend) {
    derived().saved_ = typename Derived::Saved{};
    typename Derived::Saved s;
    s.in = module_contiguous(x, s.x);
    derived().project(s, position, nullptr);
    const index_t b = x.shape(0), n = x.shape(1), h = derived().config().num_heads;
    s.attn = Tensor<Act, 4>({b, n, h, s.v.shape(3)});  // (B, n, H, dv)
    if constexpr (std::is_same<Act, compute_type>::value) {
      attend(s.q, s.k, s.v, derived().lambda_of(s), s.attn, options());
    } else {
      using C = compute_type;
      Tensor<C, 4> out(s.attn.shape());
      attend(module_converted<C>(s.q), module_converted<C>(s.k), module_converted<C>(s.v),
             module_lambda_as<C>(derived().lambda_of(s)), out, options());
      convert_row(out.data(), out.size(), s.attn.data());
    }
    return derived().output(s);
  }
  /// check_cache without the room for x's tokens (a sharded step appends them
  /// to one rank's cache only).
  template <class S>
  void check_cache_shape(const TensorView<const T, 3>& x, const KVCache<S>& cache) const {
    check_cache(TensorView<const T, 3>(x.data(), {x.shape(0), 0, x.shape(2)}, x.strides()), cache);
  }
  friend struct ModuleAccess;

  ModuleGrads<T> grads_;  // one buffer per parameter, keyed as parameters()
  int num_threads_ = 0;
};

/// The layers' hooks for diffattn::mpi::forward (ModuleBase's private
/// forward_around and check_cache_shape).
struct ModuleAccess {
  template <class Layer, class... A>
  static auto forward_around(Layer& layer, A&&... a) {
    return layer.forward_around(std::forward<A>(a)...);
  }
  template <class Layer, class... A>
  static void check_cache_shape(const Layer& layer, A&&... a) {
    layer.check_cache_shape(std::forward<A>(a)...);
  }
};

}  // namespace detail
DIFFATTN_END_NAMESPACE
