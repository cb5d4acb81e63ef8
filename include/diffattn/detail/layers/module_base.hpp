// ModuleBase: what the layer classes share word for word (threads, the
// whole-sequence and packed forward entry points, the checks of a cached
// forward and of backward, the gradient buffers, make_cache, the parameter
// maps and saving), written once over a Derived layer (CRTP, as Eigen's
// MatrixBase). The layers' own headers keep what differs: configuration,
// projections, the kernel they call, loading and the cached forward's body.
#pragma once

#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../float8.hpp"
#include "../../kv_cache.hpp"
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

/// The members MultiheadDiffAttnV1 and MultiheadDiffAttnV2 share. Derived
/// provides, as friends of this class may call them:
///   static constexpr const char* kName;                 // "MultiheadDiffAttnV1"
///   const config_type& config() const;                  // embed_dim, causal, window_left
///   ModuleCacheHeads cache_heads() const;               // what its KV cache holds
///   static shapes parameter_shapes(const config_type&); // name -> PyTorch shape
///   std::vector<ModuleParam<T>> param_list();           // and a const overload
///   Tensor<T, 3> run_forward(x, position_offset, const PackedSequences*);
///   Tensor<T, 3> run_backward(dy);                      // dy checked
///   saved_, what forward keeps: .valid, .x (the input)
template <class Derived, class T>
class ModuleBase {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value ||
                    is_half_storage_v<T>,
                "a layer's T is float, double, bfloat16 or half");
  static constexpr bool kTrainable = !is_half_storage_v<T>;

 public:
  /// Storage of the parameters, of x and of y. A bfloat16 or half layer keeps
  /// its parameters in half the bytes and runs forward only (backward,
  /// gradients() and zero_grad() do not compile for it).
  using value_type = T;
  /// What the layer computes in: T for float and double, float for the 16-bit
  /// layers. Projections, rotary, lambda, the norm and the kernel's
  /// accumulators run in it, and the activations between them (q, k, v, the
  /// lambda logits, the attention output) are kept in it, so a 16-bit layer
  /// rounds only where a bfloat16 engine must: its output y, and keys and
  /// values as they enter a 16-bit KV cache.
  using compute_type = compute_t<T>;

  /// Threads of the attention kernel and the projections (0: the OpenMP
  /// default); results are bitwise identical for any count.
  void set_num_threads(int n) {
    if (n < 0) fail_in("set_num_threads", "n must be >= 0, got ", n);
    num_threads_ = n;
  }

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
    if (position_offset < 0) fail_in("forward", "position_offset must be >= 0, got ", position_offset);
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
      return derived().run_backward(dy);
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
  /// appended (the queries are not), or compute_type (a float cache for a
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
  explicit ModuleBase(const std::map<std::string, std::vector<index_t>>& shapes)
      : grads_(shapes) {}

  Derived& derived() { return static_cast<Derived&>(*this); }
  const Derived& derived() const { return static_cast<const Derived&>(*this); }

  /// "<Derived>::<method>", the name errors of that method carry.
  static std::string qualified(const char* method) { return cat(Derived::kName, "::", method); }
  /// Throws diffattn::error("<Derived>::<method>: <message pieces>").
  template <class... Args>
  [[noreturn]] static void fail_in(const char* method, const Args&... args) {
    fail(qualified(method).c_str(), args...);
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

  ModuleGrads<T> grads_;  // one buffer per parameter, keyed as parameters()
  int num_threads_ = 0;
};

}  // namespace detail
DIFFATTN_END_NAMESPACE
