// The layers MultiheadDiffAttnV1 / V2 (float32 and float64) and their KV
// caches. Parameters and gradients come back as numpy views over the layer's
// own storage (writing them changes the layer); outputs are the C++ tensors
// handed to numpy without a copy.
#include "common.hpp"

#include <mutex>
#include <utility>

namespace diffattn_py {
namespace {

using diffattn::DiffAttnV1Config;
using diffattn::DiffAttnV2Config;
using diffattn::KVCache;
using diffattn::MultiheadDiffAttnV1;
using diffattn::MultiheadDiffAttnV2;
using diffattn::PackedSequences;
using diffattn::Tensor;

/// A layer or cache as Python holds it: with a mutex. The methods release the
/// GIL while they run, so calls on one object from several Python threads take
/// turns on it (a layer's forward keeps what its backward needs, a cache's
/// append moves its size) instead of racing on its state.
template <class Base>
struct Shared : Base {
  template <class... A>
  explicit Shared(A&&... a) : Base(std::forward<A>(a)...) {}
  mutable std::mutex busy;
};

/// f() with the GIL released and the objects' mutexes held (a layer, or a
/// layer and its cache: std::scoped_lock takes both without deadlock).
template <class F, class... O>
auto exclusively(F&& f, const O&... objects) {
  py::gil_scoped_release nogil;
  std::scoped_lock hold(objects.busy...);
  return f();
}

/// A new Shared<T> from a T (moved), handed to Python to own.
template <class T>
py::object share(T&& t) {
  return py::cast(new Shared<std::decay_t<T>>(std::forward<T>(t)),
                  py::return_value_policy::take_ownership);
}

/// The tensor as a numpy array that owns it (no copy).
template <class T, std::size_t R>
py::array to_numpy(Tensor<T, R>&& t) {
  if (t.empty()) return new_array<T, R>(t.shape());
  auto* p = new Tensor<T, R>(std::move(t));
  py::capsule owner(p, [](void* q) { delete static_cast<Tensor<T, R>*>(q); });
  std::vector<py::ssize_t> shape(p->shape().begin(), p->shape().end());
  return py::array(np_dtype<T>(), shape, {}, p->data(), owner);
}

/// A view of memory `base` owns, shaped `shape` (row-major) or with `strides`
/// (elements), writable or not.
template <class T>
py::array view_array(T* data, const std::vector<index_t>& shape, const py::handle& base,
                     bool writable, const std::vector<index_t>& strides = {}) {
  std::vector<py::ssize_t> s(shape.begin(), shape.end()), st;
  for (index_t x : strides) st.push_back(static_cast<py::ssize_t>(x * sizeof(T)));
  py::array a(np_dtype<std::remove_const_t<T>>(), s, st,
              const_cast<std::remove_const_t<T>*>(data), base);
  if (!writable) a.attr("flags").attr("writeable") = false;
  return a;
}

template <class S>
void bind_cache(py::module_& m, const char* name) {
  using Cache = Shared<KVCache<S>>;
  auto rows = [](const py::object& self, const diffattn::TensorView<const S, 4>& t) {
    return view_array<const S>(t.data(), {t.shape(0), t.shape(1), t.shape(2), t.shape(3)}, self,
                               false, {t.stride(0), t.stride(1), t.stride(2), t.stride(3)});
  };
  py::class_<Cache>(m, name, "A layer's KV cache (made by its make_cache).")
      .def("size", [](Cache& c) { return exclusively([&] { return c.size(); }, c); },
           "Tokens seen: the position of the next token.")
      .def("capacity", [](const Cache& c) { return c.capacity(); })
      .def("batch", [](const Cache& c) { return c.batch(); })
      .def("stored", [](Cache& c) { return exclusively([&] { return c.stored(); }, c); })
      .def("bytes", [](const Cache& c) { return c.bytes(); })
      .def("clear", [](Cache& c) { exclusively([&] { c.clear(); }, c); })
      .def("keys",
           [rows](const py::object& self) {
             Cache& c = self.cast<Cache&>();
             return rows(self, exclusively([&] { return c.keys(); }, c));
           },
           "The held keys (B, stored, Hk, dk) after rotary: a read-only view.")
      .def("values",
           [rows](const py::object& self) {
             Cache& c = self.cast<Cache&>();
             return rows(self, exclusively([&] { return c.values(); }, c));
           },
           "The held values (B, stored, Hv, dv): a read-only view.")
      .def_property_readonly_static("dtype", [](const py::object&) { return np_dtype<S>(); })
      .def("__repr__", [name](Cache& c) {
        const auto [size, capacity] =
            exclusively([&] { return std::make_pair(c.size(), c.capacity()); }, c);
        return std::string(name) + "(batch=" + std::to_string(c.batch()) +
               ", size=" + std::to_string(size) + ", capacity=" + std::to_string(capacity) + ")";
      });
}

/// make_cache(batch, capacity, dtype): the cache types a layer of T takes.
template <class L>
py::object make_cache(const L& l, index_t batch, index_t capacity, const py::object& dtype) {
  using T = typename L::value_type;
  std::string want = dtype.is_none() ? std::string(py::str(np_dtype<T>().attr("name")).operator std::string())
                                     : std::string(py::str(dtype));
  if (py::isinstance<py::dtype>(dtype) || py::hasattr(dtype, "itemsize"))
    want = py::str(py::dtype::from_args(dtype).attr("name")).operator std::string();
  if (want == "float32" || want == "float64") {
    if (want != py::str(np_dtype<T>().attr("name")).operator std::string())
      fail("make_cache", "a ", py::str(np_dtype<T>().attr("name")).operator std::string(),
           " layer's cache holds its own type, bfloat16, float16",
           std::is_same<T, float>::value ? ", int8 or float8_e4m3" : "", "; got ", want);
    return share(l.template make_cache<T>(batch, capacity));
  }
  if (want == "bfloat16") return share(l.template make_cache<bfloat16>(batch, capacity));
  if (want == "float16") return share(l.template make_cache<half>(batch, capacity));
  if constexpr (std::is_same<T, float>::value) {
    if (want == "int8") return share(l.template make_cache<std::int8_t>(batch, capacity));
    if (want == "float8_e4m3" || want == "e4m3")
      return share(l.template make_cache<float8_e4m3>(batch, capacity));
  }
  fail("make_cache", "dtype must be the layer's own, \"bfloat16\", \"float16\"",
       std::is_same<T, float>::value ? ", \"int8\" or \"float8_e4m3\"" : "", "; got ", want);
}

template <class L, class S>
void def_cached_forward(py::class_<L>& c) {
  using T = typename L::value_type;
  c.def(
      "forward",
      [](L& l, const py::handle& x_, Shared<KVCache<S>>& cache) {
        const py::array x = as_array(x_);
        const auto xv = view_of<const T, 3>("forward", "x", x);
        return to_numpy(exclusively([&] { return l.forward(xv, cache); }, l, cache));
      },
      py::arg("x"), py::arg("cache"));
}

template <class L>
py::class_<L> bind_layer_common(py::module_& m, const char* name) {
  using T = typename L::value_type;
  py::class_<L> c(m, name);
  c.def(
       "forward",
       [](L& l, const py::handle& x_, index_t offset) {
         const py::array x = as_array(x_);
         const auto xv = view_of<const T, 3>("forward", "x", x);
         return to_numpy(exclusively([&] { return l.forward(xv, offset); }, l));
       },
       py::arg("x"), py::arg("position_offset") = 0,
       "y (B, N, E) from x (B, N, E); keeps what backward needs.")
      .def(
          "forward",
          [](L& l, const py::handle& x_, const PackedSequences& seqs) {
            const py::array x = as_array(x_);
            const auto xv = view_of<const T, 3>("forward", "x", x);
            return to_numpy(exclusively([&] { return l.forward(xv, seqs); }, l));
          },
          py::arg("x"), py::arg("seqs"));
  def_cached_forward<L, T>(c);
  def_cached_forward<L, bfloat16>(c);
  def_cached_forward<L, half>(c);
  if constexpr (std::is_same<T, float>::value) {
    def_cached_forward<L, std::int8_t>(c);
    def_cached_forward<L, float8_e4m3>(c);
  }
  c.def(
       "backward",
       [](L& l, const py::handle& dy_) {
         const py::array dy = as_array(dy_);
         const auto v = view_of<const T, 3>("backward", "dy", dy);
         return to_numpy(exclusively([&] { return l.backward(v); }, l));
       },
       py::arg("dy"), "dx from dy = dL/dy after forward; ADDS the parameters' gradients.")
      .def(
          "parameters",
          [](const py::object& self) {
            L& l = self.cast<L&>();
            const auto shapes = l.parameter_shapes();
            py::dict d;
            for (auto& kv : l.parameters())
              d[py::str(kv.first)] = view_array<T>(kv.second.data(), shapes.at(kv.first), self, true);
            return d;
          },
          "Every parameter by its reference state_dict name: writable numpy views over the layer.")
      .def(
          "gradients",
          [](const py::object& self) {
            L& l = self.cast<L&>();
            const auto shapes = l.parameter_shapes();
            py::dict d;
            for (auto& kv : l.gradients())
              d[py::str(kv.first)] = view_array<T>(kv.second.data(), shapes.at(kv.first), self, true);
            return d;
          },
          "The accumulated gradients, keyed and shaped as parameters(): views.")
      .def("zero_grad", [](L& l) { exclusively([&] { l.zero_grad(); }, l); })
      .def("set_num_threads",
           [](L& l, int n) { exclusively([&] { l.set_num_threads(n); }, l); }, py::arg("n"))
      .def("num_parameters", [](const L& l) { return l.num_parameters(); })
      .def("parameter_shapes",
           [](const L& l) {
             py::dict d;
             for (auto& kv : l.parameter_shapes())
               d[py::str(kv.first)] = py::tuple(py::cast(kv.second));
             return d;
           })
      .def(
          "save_safetensors",
          [](L& l, const std::string& path, const std::string& prefix) {
            exclusively([&] { l.save_safetensors(path, prefix); }, l);
          },
          py::arg("path"), py::arg("prefix") = "")
      .def(
          "make_cache",
          [](const L& l, index_t batch, index_t capacity, const py::object& dtype) {
            return make_cache(l, batch, capacity, dtype);
          },
          py::arg("batch"), py::arg("capacity"), py::arg("dtype") = py::none(),
          "A KV cache for batch sequences of up to capacity tokens; dtype: the layer's "
          "(default), \"bfloat16\", \"float16\", or for float32 layers \"int8\" / "
          "\"float8_e4m3\".")
      .def(
          "attention_maps",
          [](const L& l, const py::handle& x_, index_t offset) {
            const py::array x = as_array(x_);
            const auto xv = view_of<const T, 3>("attention_maps", "x", x);
            return to_numpy(exclusively([&] { return l.attention_maps(xv, offset); }, l));
          },
          py::arg("x"), py::arg("position_offset") = 0,
          "The materialised maps W = A1 - lambda A2 (B, H, N, N), for analysis.")
      .def_property_readonly_static("dtype", [](const py::object&) { return np_dtype<T>(); })
      .def_property_readonly("embed_dim", [](const L& l) { return l.config().embed_dim; })
      .def_property_readonly("num_heads", [](const L& l) { return l.config().num_heads; })
      .def_property_readonly("num_kv_heads", [](const L& l) { return l.config().num_kv_heads; })
      .def_property_readonly("head_dim", [](const L& l) { return l.head_dim(); })
      .def_property_readonly("causal", [](const L& l) { return l.config().causal; })
      .def_property_readonly("rope", [](const L& l) { return l.config().rope; })
      .def_property_readonly("window_left", [](const L& l) { return l.config().window_left; })
      .def_property_readonly("window_right", [](const L& l) { return l.config().window_right; });
  return c;
}

template <class T>
void bind_v1(py::module_& m, const char* name) {
  using L = Shared<MultiheadDiffAttnV1<T>>;
  auto c = bind_layer_common<L>(m, name);
  c.def(py::init([](index_t e, int depth, index_t h, index_t hkv, bool causal, bool rope,
                    bool norm_affine, double rope_base, index_t wl, index_t wr, index_t hd,
                    double eps, double softcap, bool alibi, bool sinks, std::uint64_t seed) {
          DiffAttnV1Config cfg;
          cfg.softcap = static_cast<float>(softcap);
          cfg.alibi = alibi;
          cfg.sinks = sinks;
          cfg.embed_dim = e;
          cfg.depth = depth;
          cfg.num_heads = h;
          cfg.num_kv_heads = hkv;
          cfg.causal = causal;
          cfg.rope = rope;
          cfg.norm_affine = norm_affine;
          cfg.rope_base = rope_base;
          cfg.window_left = wl;
          cfg.window_right = wr;
          cfg.head_dim = hd;
          cfg.norm_eps = eps;
          return new L(cfg, seed);
        }),
        py::arg("embed_dim"), py::arg("depth"), py::arg("num_heads"), py::arg("num_kv_heads") = 0,
        py::kw_only(), py::arg("causal") = true, py::arg("rope") = true,
        py::arg("norm_affine") = true, py::arg("rope_base") = 10000.0, py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("head_dim") = 0, py::arg("norm_eps") = 1e-5,
        py::arg("softcap") = 0.0, py::arg("alibi") = false, py::arg("sinks") = false,
        py::arg("seed") = 0)
      .def("lambda_init", [](const L& l) { return l.lambda_init(); })
      .def("lambda_full",
           [](const L& l) {
             return exclusively([&] { return static_cast<double>(l.lambda_full()); }, l);
           })
      .def_property_readonly("depth", [](const L& l) { return l.config().depth; })
      .def(
          "load_safetensors",
          [](L& l, const std::string& path, const std::string& prefix, const std::string& layout) {
            if (layout != "native" && layout != "diffllama")
              fail("MultiheadDiffAttnV1::load_safetensors",
                   "layout must be \"native\" or \"diffllama\", got \"", layout, "\"");
            const auto w = layout == "native" ? diffattn::WeightLayout::native
                                              : diffattn::WeightLayout::diffllama;
            exclusively([&] { l.load_safetensors(path, prefix, w); }, l);
          },
          py::arg("path"), py::arg("prefix") = "", py::arg("layout") = "native");
}

template <class T>
void bind_v2(py::module_& m, const char* name) {
  using L = Shared<MultiheadDiffAttnV2<T>>;
  auto c = bind_layer_common<L>(m, name);
  c.def(py::init([](index_t e, const py::object& /*depth*/, index_t h, index_t hkv, index_t hd,
                    bool causal, bool rope, double rope_base, index_t wl, index_t wr,
                    double softcap, bool alibi, bool sinks, std::uint64_t seed) {
          DiffAttnV2Config cfg;
          cfg.softcap = static_cast<float>(softcap);
          cfg.alibi = alibi;
          cfg.sinks = sinks;
          cfg.embed_dim = e;
          cfg.num_heads = h;
          cfg.num_kv_heads = hkv;
          cfg.head_dim = hd;
          cfg.causal = causal;
          cfg.rope = rope;
          cfg.rope_base = rope_base;
          cfg.window_left = wl;
          cfg.window_right = wr;
          return new L(cfg, seed);
        }),
        py::arg("embed_dim"), py::arg("depth"), py::arg("num_heads"), py::arg("num_kv_heads") = 0,
        py::kw_only(), py::arg("head_dim") = 0, py::arg("causal") = true, py::arg("rope") = true,
        py::arg("rope_base") = 10000.0, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("softcap") = 0.0, py::arg("alibi") = false, py::arg("sinks") = false,
        py::arg("seed") = 0)
      .def(
          "load_safetensors",
          [](L& l, const std::string& path, const std::string& prefix) {
            exclusively([&] { l.load_safetensors(path, prefix); }, l);
          },
          py::arg("path"), py::arg("prefix") = "");
}

}  // namespace

void bind_layers(py::module_& m) {
  bind_cache<float>(m, "KVCache_float32");
  bind_cache<double>(m, "KVCache_float64");
  bind_cache<bfloat16>(m, "KVCache_bfloat16");
  bind_cache<half>(m, "KVCache_float16");
  bind_cache<std::int8_t>(m, "KVCache_int8");
  bind_cache<float8_e4m3>(m, "KVCache_float8_e4m3");
  bind_v1<float>(m, "MultiheadDiffAttnV1_float32");
  bind_v1<double>(m, "MultiheadDiffAttnV1_float64");
  bind_v2<float>(m, "MultiheadDiffAttnV2_float32");
  bind_v2<double>(m, "MultiheadDiffAttnV2_float64");
}

}  // namespace diffattn_py
