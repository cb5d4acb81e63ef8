// The kernels: fused forward and backward, KV caches, packed batches, states,
// the materialised map and row quantization. Each wrapper converts its
// arguments to views (no copy), allocates the outputs it was not given,
// releases the GIL and calls the C++ entry point of the same name.
#include "common.hpp"

namespace diffattn_py {
namespace {

using diffattn::compute_t;
using diffattn::KVCacheBatch;
using diffattn::PackedSequences;

/// Calls f(Tag<T>{}, Tag<KV>{}) for a (query, cache) storage pair the
/// library compiles (DIFFATTN_FORWARD_STORAGE), or fails.
template <class F>
py::object visit_pair(const char* fn, DType tq, DType tk, F&& f) {
#define DIFFATTN_PY_PAIR(T, KV) \
  if (tq == dtype_v<T> && tk == dtype_v<KV>) return f(Tag<T>{}, Tag<KV>{});
  DIFFATTN_FORWARD_STORAGE(DIFFATTN_PY_PAIR)
#undef DIFFATTN_PY_PAIR
  fail(fn, "no kernel for q of dtype ", dtype_name(tq), " over a cache of dtype ", dtype_name(tk),
       ": the cache holds q's type, bfloat16 or float16 (any float query), or int8 or "
       "float8_e4m3 (float32, bfloat16 or float16 queries)");
}

/// lambda of the V1 kernels: a number (one for every head) or an array (H).
struct Lambda {
  bool scalar = true;
  double value = 0;
  py::array per_head;
};

template <class C>
Lambda lambda_arg(const char* fn, const py::object& lam) {
  Lambda l;
  const py::array a = as_array(lam);
  if (a.ndim() == 0) {
    l.value = py::cast<double>(py::float_(lam));
    return l;
  }
  l.scalar = false;
  l.per_head = py::array_t<C, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!l.per_head) fail(fn, "lambda_ must be a number or a 1-D array (H) of numbers");
  return l;
}

template <class T, std::size_t R>
std::array<index_t, R> shape_of(const TensorView<const T, R>& t) {
  return t.shape();
}

/// What every backward binding takes and gives: views of q, k, v, out (rank
/// R), lse (rank R - 1, compute_t<T>: float for 16-bit storage) and dout, and
/// dq, dk, dv (the arrays given, or new ones of q's, k's and v's shapes, in
/// T) with views over them.
template <class T, std::size_t R>
struct BackwardArgs {
  TensorView<const T, R> q, k, v, out;
  TensorView<const compute_t<T>, R - 1> lse;
  TensorView<const T, R> dout;
  py::array dq, dk, dv;
  TensorView<T, R> dqv, dkv, dvv;

  BackwardArgs(const char* fn, const py::array& q_, const py::array& k_, const py::array& v_,
               const py::array& out_, const py::array& lse_, const py::array& dout_,
               const py::object& dq_ = py::none(), const py::object& dk_ = py::none(),
               const py::object& dv_ = py::none())
      : q(view_of<const T, R>(fn, "q", q_)),
        k(view_of<const T, R>(fn, "k", k_)),
        v(view_of<const T, R>(fn, "v", v_)),
        out(view_of<const T, R>(fn, "out", out_)),
        lse(view_of<const compute_t<T>, R - 1>(fn, "lse", lse_)),
        dout(view_of<const T, R>(fn, "dout", dout_)),
        dq(output<T, R>(fn, "dq", dq_, q.shape())),
        dk(output<T, R>(fn, "dk", dk_, k.shape())),
        dv(output<T, R>(fn, "dv", dv_, v.shape())),
        dqv(view_of<T, R>(fn, "dq", dq)),
        dkv(view_of<T, R>(fn, "dk", dk)),
        dvv(view_of<T, R>(fn, "dv", dv)) {}
};

/// The seqs argument of the packed kernels: a PackedSequences, or the
/// cumulative query offsets (cu_seqlens_q) with cu_seqlens_k optional.
PackedSequences seqs_arg(const char* fn, const py::object& seqs, const py::object& cu_k) {
  if (py::isinstance<PackedSequences>(seqs)) {
    if (!cu_k.is_none()) fail(fn, "cu_seqlens_k is given with a PackedSequences (it holds both)");
    return seqs.cast<PackedSequences>();
  }
  PackedSequences p;
  p.cu_seqlens_q = int_vector(fn, "cu_seqlens_q", seqs);
  if (!cu_k.is_none()) p.cu_seqlens_k = int_vector(fn, "cu_seqlens_k", cu_k);
  return p;
}

void bind_fused(py::module_& m) {
  m.def(
      "diff_attention_v1",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& lam,
         bool causal, index_t wl, index_t wr, double scale, int nt, double softcap,
         const py::object& alibi, const py::object& sinks, const py::object& out_,
         const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v1";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          const index_t b = qv.shape(0), n = qv.shape(1), h = qv.shape(2) / 2;
          py::array out = output<T, 4>(fn, "out", out_, {b, n, h, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, 2 * h, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          const Lambda l = lambda_arg<C>(fn, lam);
          if (l.scalar) {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1<T>(qv, kv, vv, static_cast<C>(l.value), ov, lv, o);
          } else {
            const auto lh = view_of<const C, 1>(fn, "lambda_", l.per_head);
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1<T>(qv, kv, vv, lh, ov, lv, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_"), py::kw_only(),
      DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(Differential attention, V1 split heads: returns (out, lse).

q (B, N, 2H, d), k (B, M, 2Hkv, d), v (B, M, Hkv, 2d); lambda_ a number or (H);
out (B, N, H, 2d), lse (B, 2H, N) in float32 for 16-bit storage.)doc");

  m.def(
      "diff_attention_v2",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& logit_,
         bool causal, index_t wl, index_t wr, double scale, int nt, double softcap,
         const py::object& alibi, const py::object& sinks, const py::object& out_,
         const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v2";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_),
                        logit = as_array(logit_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          const auto gv = view_of<const T, 3>(fn, "lambda_logit", logit);
          const index_t b = qv.shape(0), n = qv.shape(1), h = qv.shape(2) / 2;
          py::array out = output<T, 4>(fn, "out", out_, {b, n, h, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, 2 * h, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v2<T>(qv, kv, vv, gv, ov, lv, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_logit"), py::kw_only(),
      DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(Differential attention, V2 doubled query heads: returns (out, lse).

q (B, N, 2H, d), k, v (B, M, Hkv, d), lambda_logit (B, N, H) (sigmoid inside);
out (B, N, H, d), lse (B, 2H, N).)doc");

  m.def(
      "attention",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, bool causal, index_t wl,
         index_t wr, double scale, int nt, double softcap, const py::object& alibi,
         const py::object& sinks, const py::object& out_, const py::object& lse_) {
        constexpr const char* fn = "attention";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          const index_t b = qv.shape(0), n = qv.shape(1), hq = qv.shape(2);
          py::array out = output<T, 4>(fn, "out", out_, {b, n, hq, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, hq, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::attention<T>(qv, kv, vv, ov, lv, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), DIFFATTN_PY_OPTION_ARGS,
      py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(Plain softmax attention with GQA: returns (out, lse).

q (B, N, Hq, d), k (B, M, Hkv, d), v (B, M, Hkv, dv); out (B, N, Hq, dv), lse (B, Hq, N).)doc");
}

/// The dsinks= output of a backward (empty when not given).
template <class C>
diffattn::TensorView<C, 1> dsinks_view(const char* fn, const py::object& dsinks) {
  if (dsinks.is_none()) return diffattn::TensorView<C, 1>();
  return view_of<C, 1>(fn, "dsinks", as_array(dsinks));
}

void bind_backward(py::module_& m) {
  m.def(
      "diff_attention_v1_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& lam,
         const py::handle& out_, const py::handle& lse_, const py::handle& dout_, bool causal,
         index_t wl, index_t wr, double scale, int nt, double softcap, const py::object& alibi,
         const py::object& sinks, const py::object& dq_, const py::object& dk_,
         const py::object& dv_, const py::object& dsinks_) {
        constexpr const char* fn = "diff_attention_v1_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_), out = as_array(out_),
                        lse = as_array(lse_), dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const BackwardArgs<T, 4> a(fn, q, k, v, out, lse, dout, dq_, dk_, dv_);
          const auto dsv = dsinks_view<C>(fn, dsinks_);
          const Lambda l = lambda_arg<C>(fn, lam);
          if (l.scalar) {
            C dl = 0;
            {
              py::gil_scoped_release nogil;
              diffattn::diff_attention_v1_backward<T>(a.q, a.k, a.v, static_cast<C>(l.value), a.out,
                                                      a.lse, a.dout, a.dqv, a.dkv, a.dvv, dl, o,
                                                      dsv);
            }
            return py::make_tuple(a.dq, a.dk, a.dv, py::float_(static_cast<double>(dl)));
          }
          const auto lh = view_of<const C, 1>(fn, "lambda_", l.per_head);
          py::array dl = new_array<C, 1>(lh.shape());
          const auto dlv = view_of<C, 1>(fn, "dlambda", dl);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_backward<T>(a.q, a.k, a.v, lh, a.out, a.lse, a.dout, a.dqv,
                                                    a.dkv, a.dvv, dlv, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv, dl);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::kw_only(), DIFFATTN_PY_OPTION_ARGS, py::arg("dq") = py::none(),
      py::arg("dk") = py::none(), py::arg("dv") = py::none(), py::arg("dsinks") = py::none(),
      R"doc(Backward of diff_attention_v1: returns (dq, dk, dv, dlambda).

Takes the forward's arguments, its out and lse, and dout = dL/dout. dlambda is a
float for a scalar lambda_, an array (H) for one lambda per head. With 16-bit
storage (bfloat16 as uint16 bits, float16) q, k, v, out, dout and the returned
dq, dk, dv are 16-bit; lse, lambda_, dlambda and dsinks float32.)doc");

  m.def(
      "diff_attention_v2_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& logit_,
         const py::handle& out_, const py::handle& lse_, const py::handle& dout_, bool causal,
         index_t wl, index_t wr, double scale, int nt, double softcap, const py::object& alibi,
         const py::object& sinks, const py::object& dq_, const py::object& dk_,
         const py::object& dv_, const py::object& dsinks_) {
        constexpr const char* fn = "diff_attention_v2_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_),
                        logit = as_array(logit_), out = as_array(out_), lse = as_array(lse_),
                        dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const BackwardArgs<T, 4> a(fn, q, k, v, out, lse, dout, dq_, dk_, dv_);
          const auto gl = view_of<const T, 3>(fn, "lambda_logit", logit);
          py::array dlog = new_array<T, 3>(gl.shape());
          const auto dsv = dsinks_view<C>(fn, dsinks_);
          const auto dlv = view_of<T, 3>(fn, "dlambda_logit", dlog);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v2_backward<T>(a.q, a.k, a.v, gl, a.out, a.lse, a.dout, a.dqv,
                                                    a.dkv, a.dvv, dlv, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv, dlog);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_logit"), py::arg("out"),
      py::arg("lse"), py::arg("dout"), py::kw_only(), DIFFATTN_PY_OPTION_ARGS,
      py::arg("dq") = py::none(), py::arg("dk") = py::none(), py::arg("dv") = py::none(),
      py::arg("dsinks") = py::none(),
      R"doc(Backward of diff_attention_v2: returns (dq, dk, dv, dlambda_logit).)doc");

  m.def(
      "attention_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& out_,
         const py::handle& lse_, const py::handle& dout_, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& dq_, const py::object& dk_, const py::object& dv_,
         const py::object& dsinks_) {
        constexpr const char* fn = "attention_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_), out = as_array(out_),
                        lse = as_array(lse_), dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const BackwardArgs<T, 4> a(fn, q, k, v, out, lse, dout, dq_, dk_, dv_);
          const auto dsv = dsinks_view<C>(fn, dsinks_);
          {
            py::gil_scoped_release nogil;
            diffattn::attention_backward<T>(a.q, a.k, a.v, a.out, a.lse, a.dout, a.dqv, a.dkv,
                                            a.dvv, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"),
      py::kw_only(), DIFFATTN_PY_OPTION_ARGS, py::arg("dq") = py::none(),
      py::arg("dk") = py::none(), py::arg("dv") = py::none(), py::arg("dsinks") = py::none(),
      R"doc(Backward of attention: returns (dq, dk, dv).)doc");
}

/// The KVCacheBatch of a call; keeps the integer arrays it views alive.
struct CacheArgs {
  py::array_t<index_t, py::array::c_style | py::array::forcecast> lens, table;
  py::array k_scale, v_scale;
  KVCacheBatch batch;
};

void fill_cache(const char* fn, CacheArgs& c, const py::handle& lens, const py::object& table,
                const py::object& ks, const py::object& vs, index_t split_keys) {
  c.lens = int_array(fn, "cache_seqlens", lens);
  c.batch.cache_seqlens = int_view<1>(fn, "cache_seqlens", c.lens);
  if (!table.is_none()) {
    c.table = int_array(fn, "block_table", table);
    c.batch.block_table = int_view<2>(fn, "block_table", c.table);
  }
  if (!ks.is_none()) {
    c.k_scale = as_array(ks);
    c.batch.k_scale = view_of<const float, 3>(fn, "k_scale", c.k_scale);
  }
  if (!vs.is_none()) {
    c.v_scale = as_array(vs);
    c.batch.v_scale = view_of<const float, 3>(fn, "v_scale", c.v_scale);
  }
  c.batch.split_keys = split_keys;
}

void bind_kvcache(py::module_& m) {
  m.def(
      "diff_attention_v1_kvcache",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& lam,
         const py::handle& lens, const py::object& table, const py::object& ks,
         const py::object& vs, index_t split_keys, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& out_, const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v1_kvcache";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        CacheArgs c;
        fill_cache(fn, c, lens, table, ks, vs, split_keys);
        return visit_pair(fn, dtype_of(q), dtype_of(k), [&](auto tt, auto tk) -> py::object {
          using T = typename decltype(tt)::type;
          using KV = typename decltype(tk)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const KV, 4>(fn, "k_cache", k);
          const auto vv = view_of<const KV, 4>(fn, "v_cache", v);
          const index_t b = qv.shape(0), n = qv.shape(1), h = qv.shape(2) / 2;
          py::array out = output<T, 4>(fn, "out", out_, {b, n, h, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, 2 * h, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          const Lambda l = lambda_arg<C>(fn, lam);
          if (l.scalar) {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_kvcache<T, KV>(qv, kv, vv, static_cast<C>(l.value), ov, lv,
                                                       c.batch, o);
          } else {
            const auto lh = view_of<const C, 1>(fn, "lambda_", l.per_head);
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_kvcache<T, KV>(qv, kv, vv, lh, ov, lv, c.batch, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("lambda_"),
      py::arg("cache_seqlens"), py::kw_only(), py::arg("block_table") = py::none(),
      py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("split_keys") = 0,
      DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(diff_attention_v1 over KV caches: returns (out, lse).

q (B, n, 2H, d); k_cache (B, capacity, 2Hkv, d), v_cache (B, capacity, Hkv, 2d), or
pools (num_blocks, block_size, ...) with block_table (B, max_blocks_per_seq);
cache_seqlens (B) keys per sequence (new keys already appended). Caches of q's
dtype, bfloat16 (uint16 bits), float16, int8 or float8_e4m3 (uint8 bits; 8-bit
caches take k_scale / v_scale (B, capacity, H) float32).)doc");

  m.def(
      "diff_attention_v2_kvcache",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& logit_,
         const py::handle& lens, const py::object& table, const py::object& ks,
         const py::object& vs, index_t split_keys, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& out_, const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v2_kvcache";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_),
                        logit = as_array(logit_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        CacheArgs c;
        fill_cache(fn, c, lens, table, ks, vs, split_keys);
        return visit_pair(fn, dtype_of(q), dtype_of(k), [&](auto tt, auto tk) -> py::object {
          using T = typename decltype(tt)::type;
          using KV = typename decltype(tk)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const KV, 4>(fn, "k_cache", k);
          const auto vv = view_of<const KV, 4>(fn, "v_cache", v);
          const auto gv = view_of<const T, 3>(fn, "lambda_logit", logit);
          const index_t b = qv.shape(0), n = qv.shape(1), h = qv.shape(2) / 2;
          py::array out = output<T, 4>(fn, "out", out_, {b, n, h, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, 2 * h, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v2_kvcache<T, KV>(qv, kv, vv, gv, ov, lv, c.batch, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("lambda_logit"),
      py::arg("cache_seqlens"), py::kw_only(), py::arg("block_table") = py::none(),
      py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("split_keys") = 0,
      DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(diff_attention_v2 over KV caches: returns (out, lse). As diff_attention_v1_kvcache,
with k_cache, v_cache (B, capacity, Hkv, d) and lambda_logit (B, n, H).)doc");

  m.def(
      "attention_kvcache",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& lens,
         const py::object& table, const py::object& ks, const py::object& vs, index_t split_keys,
         bool causal, index_t wl, index_t wr, double scale, int nt, double softcap,
         const py::object& alibi, const py::object& sinks, const py::object& out_,
         const py::object& lse_) {
        constexpr const char* fn = "attention_kvcache";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        CacheArgs c;
        fill_cache(fn, c, lens, table, ks, vs, split_keys);
        return visit_pair(fn, dtype_of(q), dtype_of(k), [&](auto tt, auto tk) -> py::object {
          using T = typename decltype(tt)::type;
          using KV = typename decltype(tk)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const KV, 4>(fn, "k_cache", k);
          const auto vv = view_of<const KV, 4>(fn, "v_cache", v);
          const index_t b = qv.shape(0), n = qv.shape(1), hq = qv.shape(2);
          py::array out = output<T, 4>(fn, "out", out_, {b, n, hq, vv.shape(3)});
          py::array lse = output<C, 3>(fn, "lse", lse_, {b, hq, n});
          const auto ov = view_of<T, 4>(fn, "out", out);
          const auto lv = view_of<C, 3>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::attention_kvcache<T, KV>(qv, kv, vv, ov, lv, c.batch, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_seqlens"), py::kw_only(),
      py::arg("block_table") = py::none(), py::arg("k_scale") = py::none(),
      py::arg("v_scale") = py::none(), py::arg("split_keys") = 0, DIFFATTN_PY_OPTION_ARGS,
      py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(Plain attention over KV caches: returns (out, lse).)doc");
}

void bind_varlen(py::module_& m) {
  py::class_<PackedSequences>(m, "PackedSequences",
                              "The sequences of a packed batch by cumulative offsets.")
      .def(py::init([](const py::object& q, const py::object& k) {
             return seqs_arg("PackedSequences", q, k);
           }),
           py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k") = py::none())
      .def_static("from_lengths", &PackedSequences::from_lengths, py::arg("q_lengths"),
                  py::arg("k_lengths") = std::vector<index_t>{})
      .def_readwrite("cu_seqlens_q", &PackedSequences::cu_seqlens_q)
      .def_readwrite("cu_seqlens_k", &PackedSequences::cu_seqlens_k)
      .def("size", &PackedSequences::size)
      .def("__len__", &PackedSequences::size)
      .def("__repr__", [](const PackedSequences& p) {
        return std::string(py::str("PackedSequences(cu_seqlens_q={}, cu_seqlens_k={})")
                               .format(p.cu_seqlens_q, p.cu_seqlens_k));
      });

  m.def(
      "diff_attention_v1_varlen",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& lam,
         const py::object& seqs_, const py::object& cu_k, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& out_, const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v1_varlen";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 3>(fn, "q", q);
          const auto kv = view_of<const T, 3>(fn, "k", k);
          const auto vv = view_of<const T, 3>(fn, "v", v);
          const index_t t = qv.shape(0), h = qv.shape(1) / 2;
          py::array out = output<T, 3>(fn, "out", out_, {t, h, vv.shape(2)});
          py::array lse = output<C, 2>(fn, "lse", lse_, {2 * h, t});
          const auto ov = view_of<T, 3>(fn, "out", out);
          const auto lv = view_of<C, 2>(fn, "lse", lse);
          const Lambda l = lambda_arg<C>(fn, lam);
          if (l.scalar) {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_varlen<T>(qv, kv, vv, static_cast<C>(l.value), ov, lv, seqs,
                                                  o);
          } else {
            const auto lh = view_of<const C, 1>(fn, "lambda_", l.per_head);
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_varlen<T>(qv, kv, vv, lh, ov, lv, seqs, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_"), py::arg("seqs"), py::kw_only(),
      py::arg("cu_seqlens_k") = py::none(), DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(),
      py::arg("lse") = py::none(),
      R"doc(diff_attention_v1 over a packed batch: returns (out, lse).

q (T, 2H, d), k (T_k, 2Hkv, d), v (T_k, Hkv, 2d); seqs a PackedSequences or the
offsets cu_seqlens_q (then cu_seqlens_k= for other key lengths); out (T, H, 2d),
lse (2H, T).)doc");

  m.def(
      "diff_attention_v2_varlen",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& logit_,
         const py::object& seqs_, const py::object& cu_k, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& out_, const py::object& lse_) {
        constexpr const char* fn = "diff_attention_v2_varlen";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_),
                        logit = as_array(logit_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 3>(fn, "q", q);
          const auto kv = view_of<const T, 3>(fn, "k", k);
          const auto vv = view_of<const T, 3>(fn, "v", v);
          const auto gv = view_of<const T, 2>(fn, "lambda_logit", logit);
          const index_t t = qv.shape(0), h = qv.shape(1) / 2;
          py::array out = output<T, 3>(fn, "out", out_, {t, h, vv.shape(2)});
          py::array lse = output<C, 2>(fn, "lse", lse_, {2 * h, t});
          const auto ov = view_of<T, 3>(fn, "out", out);
          const auto lv = view_of<C, 2>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v2_varlen<T>(qv, kv, vv, gv, ov, lv, seqs, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_logit"), py::arg("seqs"),
      py::kw_only(), py::arg("cu_seqlens_k") = py::none(), DIFFATTN_PY_OPTION_ARGS,
      py::arg("out") = py::none(), py::arg("lse") = py::none(),
      R"doc(diff_attention_v2 over a packed batch: returns (out, lse); lambda_logit (T, H).)doc");

  m.def(
      "attention_varlen",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& seqs_,
         const py::object& cu_k, bool causal, index_t wl, index_t wr, double scale, int nt,
         double softcap, const py::object& alibi, const py::object& sinks, const py::object& out_,
         const py::object& lse_) {
        constexpr const char* fn = "attention_varlen";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const auto qv = view_of<const T, 3>(fn, "q", q);
          const auto kv = view_of<const T, 3>(fn, "k", k);
          const auto vv = view_of<const T, 3>(fn, "v", v);
          const index_t t = qv.shape(0), hq = qv.shape(1);
          py::array out = output<T, 3>(fn, "out", out_, {t, hq, vv.shape(2)});
          py::array lse = output<C, 2>(fn, "lse", lse_, {hq, t});
          const auto ov = view_of<T, 3>(fn, "out", out);
          const auto lv = view_of<C, 2>(fn, "lse", lse);
          {
            py::gil_scoped_release nogil;
            diffattn::attention_varlen<T>(qv, kv, vv, ov, lv, seqs, o);
          }
          return py::make_tuple(out, lse);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("seqs"), py::kw_only(),
      py::arg("cu_seqlens_k") = py::none(), DIFFATTN_PY_OPTION_ARGS, py::arg("out") = py::none(),
      py::arg("lse") = py::none(),
      R"doc(Plain attention over a packed batch: returns (out, lse).)doc");

  m.def(
      "diff_attention_v1_varlen_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::object& lam,
         const py::handle& out_, const py::handle& lse_, const py::handle& dout_,
         const py::object& seqs_, const py::object& cu_k, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& dsinks_) {
        constexpr const char* fn = "diff_attention_v1_varlen_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_), out = as_array(out_),
                        lse = as_array(lse_), dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          using C = compute_t<T>;
          const BackwardArgs<T, 3> a(fn, q, k, v, out, lse, dout);
          const auto dsv = dsinks_view<C>(fn, dsinks_);
          const Lambda l = lambda_arg<C>(fn, lam);
          if (l.scalar) {
            C dl = 0;
            {
              py::gil_scoped_release nogil;
              diffattn::diff_attention_v1_varlen_backward<T>(a.q, a.k, a.v, static_cast<C>(l.value),
                                                             a.out, a.lse, a.dout, a.dqv, a.dkv,
                                                             a.dvv, dl, seqs, o, dsv);
            }
            return py::make_tuple(a.dq, a.dk, a.dv, py::float_(static_cast<double>(dl)));
          }
          const auto lh = view_of<const C, 1>(fn, "lambda_", l.per_head);
          py::array dl = new_array<C, 1>(lh.shape());
          const auto dlv = view_of<C, 1>(fn, "dlambda", dl);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v1_varlen_backward<T>(a.q, a.k, a.v, lh, a.out, a.lse, a.dout,
                                                           a.dqv, a.dkv, a.dvv, dlv, seqs, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv, dl);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_"), py::arg("out"), py::arg("lse"),
      py::arg("dout"), py::arg("seqs"), py::kw_only(), py::arg("cu_seqlens_k") = py::none(),
      DIFFATTN_PY_OPTION_ARGS, py::arg("dsinks") = py::none(),
      R"doc(Backward of diff_attention_v1_varlen: returns (dq, dk, dv, dlambda); dsinks= (2H)
receives the sinks' gradient.)doc");

  m.def(
      "diff_attention_v2_varlen_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& logit_,
         const py::handle& out_, const py::handle& lse_, const py::handle& dout_,
         const py::object& seqs_, const py::object& cu_k, bool causal, index_t wl, index_t wr,
         double scale, int nt, double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& dsinks_) {
        constexpr const char* fn = "diff_attention_v2_varlen_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_),
                        logit = as_array(logit_), out = as_array(out_), lse = as_array(lse_),
                        dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const BackwardArgs<T, 3> a(fn, q, k, v, out, lse, dout);
          const auto dsv = dsinks_view<compute_t<T>>(fn, dsinks_);
          const auto gl = view_of<const T, 2>(fn, "lambda_logit", logit);
          py::array dlog = new_array<T, 2>(gl.shape());
          const auto dlv = view_of<T, 2>(fn, "dlambda_logit", dlog);
          {
            py::gil_scoped_release nogil;
            diffattn::diff_attention_v2_varlen_backward<T>(a.q, a.k, a.v, gl, a.out, a.lse, a.dout,
                                                           a.dqv, a.dkv, a.dvv, dlv, seqs, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv, dlog);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_logit"), py::arg("out"),
      py::arg("lse"), py::arg("dout"), py::arg("seqs"), py::kw_only(),
      py::arg("cu_seqlens_k") = py::none(), DIFFATTN_PY_OPTION_ARGS, py::arg("dsinks") = py::none(),
      R"doc(Backward of diff_attention_v2_varlen: returns (dq, dk, dv, dlambda_logit); dsinks= (2H)
receives the sinks' gradient.)doc");

  m.def(
      "attention_varlen_backward",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& out_,
         const py::handle& lse_, const py::handle& dout_, const py::object& seqs_,
         const py::object& cu_k, bool causal, index_t wl, index_t wr, double scale, int nt,
         double softcap, const py::object& alibi, const py::object& sinks,
         const py::object& dsinks_) {
        constexpr const char* fn = "attention_varlen_backward";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_), out = as_array(out_),
                        lse = as_array(lse_), dout = as_array(dout_);
        const OptionsHolder oh = make_options(causal, wl, wr, scale, nt, softcap, alibi, sinks);
        const diffattn::AttentionOptions& o = oh.options;
        const PackedSequences seqs = seqs_arg(fn, seqs_, cu_k);
        return visit_float(fn, "q", dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const BackwardArgs<T, 3> a(fn, q, k, v, out, lse, dout);
          const auto dsv = dsinks_view<compute_t<T>>(fn, dsinks_);
          {
            py::gil_scoped_release nogil;
            diffattn::attention_varlen_backward<T>(a.q, a.k, a.v, a.out, a.lse, a.dout, a.dqv,
                                                   a.dkv, a.dvv, seqs, o, dsv);
          }
          return py::make_tuple(a.dq, a.dk, a.dv);
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"),
      py::arg("seqs"), py::kw_only(), py::arg("cu_seqlens_k") = py::none(), DIFFATTN_PY_OPTION_ARGS,
      py::arg("dsinks") = py::none(),
      R"doc(Backward of attention_varlen: returns (dq, dk, dv); dsinks= (Hq) receives the
sinks' gradient.)doc");
}

template <class T>
using RowMap = Eigen::Map<const diffattn::Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class T>
RowMap<T> matrix_of(const char* fn, const char* name, const py::array& a) {
  const auto v = view_of<const T, 2>(fn, name, a);
  if (v.shape(1) > 1 && v.stride(1) != 1)
    fail(fn, name, " has a column stride of ", v.stride(1),
         " elements: its rows must be contiguous");
  return RowMap<T>(v.data(), v.shape(0), v.shape(1),
                   Eigen::OuterStride<>(v.shape(0) > 1 ? v.stride(0) : v.shape(1)));
}

void bind_misc(py::module_& m) {
  m.def(
      "merge_states",
      [](const py::handle& oa_, const py::handle& la_, const py::handle& ob_, const py::handle& lb_,
         int nt) {
        constexpr const char* fn = "merge_states";
        const py::array oa = as_array(oa_), la = as_array(la_), ob = as_array(ob_),
                        lb = as_array(lb_);
        return visit_float<false>(fn, "o_a", dtype_of(oa), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto oav = view_of<T, 4>(fn, "o_a", oa);
          const auto lav = view_of<T, 3>(fn, "lse_a", la);
          const auto obv = view_of<const T, 4>(fn, "o_b", ob);
          const auto lbv = view_of<const T, 3>(fn, "lse_b", lb);
          {
            py::gil_scoped_release nogil;
            diffattn::merge_states<T>(oav, lav, obv, lbv, nt);
          }
          return py::make_tuple(oa, la);
        });
      },
      py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::kw_only(),
      py::arg("num_threads") = 0,
      R"doc(Merges the softmax state (o_b, lse_b) into (o_a, lse_a), in place; returns (o_a, lse_a).

o (B, N, Hq, dv), lse (B, Hq, N), float32 or float64.)doc");

  m.def(
      "diff_weights",
      [](const py::handle& q1_, const py::handle& k1_, const py::handle& q2_, const py::handle& k2_,
         double lambda, bool causal, index_t wl, index_t wr, double scale, bool return_lse) {
        constexpr const char* fn = "diff_weights";
        const py::array q1 = as_array(q1_), k1 = as_array(k1_), q2 = as_array(q2_),
                        k2 = as_array(k2_);
        const auto o = make_options(causal, wl, wr, scale, 0);
        return visit_float<false>(fn, "q1", dtype_of(q1), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const RowMap<T> a = matrix_of<T>(fn, "q1", q1), b = matrix_of<T>(fn, "k1", k1),
                          c = matrix_of<T>(fn, "q2", q2), d = matrix_of<T>(fn, "k2", k2);
          diffattn::Matrix<T> w;
          diffattn::Vector<T> lse1, lse2;
          {
            py::gil_scoped_release nogil;
            w = diffattn::diff_weights<T>(a, b, c, d, static_cast<T>(lambda), o, &lse1, &lse2);
          }
          py::array wa = new_array<T, 2>({w.rows(), w.cols()});
          std::copy(w.data(), w.data() + w.size(), static_cast<T*>(wa.mutable_data()));
          if (!return_lse) return std::move(wa);
          py::array l1 = new_array<T, 1>({lse1.size()}), l2 = new_array<T, 1>({lse2.size()});
          std::copy(lse1.data(), lse1.data() + lse1.size(), static_cast<T*>(l1.mutable_data()));
          std::copy(lse2.data(), lse2.data() + lse2.size(), static_cast<T*>(l2.mutable_data()));
          return py::make_tuple(wa, l1, l2);
        });
      },
      py::arg("q1"), py::arg("k1"), py::arg("q2"), py::arg("k2"), py::arg("lambda_"), py::kw_only(),
      py::arg("causal") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,
      py::arg("scale") = 0.0, py::arg("return_lse") = false,
      R"doc(The materialised single-head map W = A1 - lambda A2 (N, M).

q1, q2 (N, d); k1, k2 (M, d); float32 or float64. With return_lse=True returns
(W, lse1, lse2).)doc");

  m.def(
      "quantize_rows",
      [](const py::handle& src_, const std::string& dtype, const py::object& out_,
         const py::object& scale_) {
        constexpr const char* fn = "quantize_rows";
        const py::array src = as_array(src_);
        const bool e4m3 = dtype == "float8_e4m3" || dtype == "e4m3" || dtype == "float8_e4m3fn";
        if (!e4m3 && dtype != "int8")
          fail(fn, "dtype must be \"int8\" or \"float8_e4m3\", got \"", dtype, "\"");
        const index_t rank = src.ndim();
        if (rank < 2 || rank > 4)
          fail(fn, "src has ", rank, " dimensions, expected (H, d), (N, H, d) or (B, N, H, d)");
        auto run = [&](auto ts, auto tq, auto rank_c) -> py::object {
          using S = typename decltype(ts)::type;
          using Q = typename decltype(tq)::type;
          constexpr std::size_t R = decltype(rank_c)::value;
          const auto sv = view_of<const S, R>(fn, "src", src);
          std::array<index_t, R - 1> ss{};
          for (std::size_t i = 0; i + 1 < R; ++i) ss[i] = sv.shape(i);
          py::array dst = output<Q, R>(fn, "out", out_, sv.shape());
          py::array scale = output<float, R - 1>(fn, "scale", scale_, ss);
          const auto dv = view_of<Q, R>(fn, "out", dst);
          const auto cv = view_of<float, R - 1>(fn, "scale", scale);
          {
            py::gil_scoped_release nogil;
            diffattn::detail::quantize_rows_impl<S, Q, R>(sv, dv, cv);
          }
          return py::make_tuple(dst, scale);
        };
        auto by_rank = [&](auto ts, auto tq) -> py::object {
          if (rank == 2) return run(ts, tq, std::integral_constant<std::size_t, 2>{});
          if (rank == 3) return run(ts, tq, std::integral_constant<std::size_t, 3>{});
          return run(ts, tq, std::integral_constant<std::size_t, 4>{});
        };
        auto by_dst = [&](auto ts) -> py::object {
          if (e4m3) return by_rank(ts, Tag<float8_e4m3>{});
          return by_rank(ts, Tag<std::int8_t>{});
        };
        switch (dtype_of(src)) {
          case DType::f32:
            return by_dst(Tag<float>{});
          case DType::bf16:
            return by_dst(Tag<bfloat16>{});
          case DType::f16:
            return by_dst(Tag<half>{});
          default:
            fail(fn, "src has dtype ", dtype_name(dtype_of(src)),
                 ", expected float32, float16 or bfloat16 (its bits as uint16)");
        }
      },
      py::arg("src"), py::arg("dtype") = "int8", py::kw_only(), py::arg("out") = py::none(),
      py::arg("scale") = py::none(),
      R"doc(Quantizes rows to 8 bits with one float32 scale per row: returns (dst, scale).

src (.., H, d) float32, float16 or bfloat16 bits; dtype "int8" (dst int8) or
"float8_e4m3" (dst uint8 holding E4M3FN bits); scale (.., H).)doc");
}

}  // namespace

void bind_kernels(py::module_& m) {
  bind_fused(m);
  bind_backward(m);
  bind_kvcache(m);
  bind_varlen(m);
  bind_misc(m);
}

}  // namespace diffattn_py
