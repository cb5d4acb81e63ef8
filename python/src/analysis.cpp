// The statistics of diffattn/analysis.hpp: the fused kernel's block task with
// each row measured (largest logit, entropy, mass on a needle span and on the
// rest, negative mass, context RMS), returned as a dict of numpy arrays.
#include "common.hpp"

namespace diffattn_py {
namespace {

using diffattn::AnalysisOptions;
using diffattn::AttentionStats;

/// The stats as a dict: "heads", "maps", "rows" (ints); per map (heads, maps)
/// "max_abs_logit", "entropy", "map_needle_mass"; per head (heads)
/// "needle_mass", "context_mass", "context_abs_mass", "negative_mass",
/// "context_rms".
py::dict stats_dict(const AttentionStats& s) {
  auto arr = [](const std::vector<double>& v, index_t heads, index_t maps) {
    py::array a = maps > 0 ? new_array<double, 2>({heads, maps}) : new_array<double, 1>({heads});
    std::copy(v.begin(), v.end(), static_cast<double*>(a.mutable_data()));
    return a;
  };
  py::dict d;
  d["heads"] = s.heads;
  d["maps"] = s.maps;
  d["rows"] = s.rows;
  d["max_abs_logit"] = arr(s.max_abs_logit, s.heads, s.maps);
  d["entropy"] = arr(s.entropy, s.heads, s.maps);
  d["map_needle_mass"] = arr(s.map_needle_mass, s.heads, s.maps);
  d["needle_mass"] = arr(s.needle_mass, s.heads, 0);
  d["context_mass"] = arr(s.context_mass, s.heads, 0);
  d["context_abs_mass"] = arr(s.context_abs_mass, s.heads, 0);
  d["negative_mass"] = arr(s.negative_mass, s.heads, 0);
  d["context_rms"] = arr(s.context_rms, s.heads, 0);
  return d;
}

AnalysisOptions analysis_options(index_t needle_begin, index_t needle_end, index_t query_begin,
                                 index_t query_end, int logit_bits) {
  AnalysisOptions a;
  a.needle_begin = needle_begin;
  a.needle_end = needle_end;
  a.query_begin = query_begin;
  a.query_end = query_end;
  a.logit_bits = logit_bits;
  return a;
}

/// Calls f(Tag<T>{}) for float32 or float64 q, or fails naming fn.
template <class F>
py::object visit_stats(const char* fn, DType t, F&& f) {
  if (t == DType::f32) return f(Tag<float>{});
  if (t == DType::f64) return f(Tag<double>{});
  fail(fn, "q has dtype ", dtype_name(t), ", expected float32 or float64 (the statistics run on "
       "float or double storage)");
}

/// Runs `call(out view or null)` for T, with out= given, a new array when
/// return_out, or none; returns the dict, or (dict, out).
template <class T, class Call>
py::object with_out(const char* fn, const py::object& out_, bool return_out,
                    const std::array<index_t, 4>& shape, Call&& call) {
  const bool want = return_out || !out_.is_none();
  AttentionStats s;
  if (want) {
    py::array out = output<T, 4>(fn, "out", out_, shape);
    const auto ov = view_of<T, 4>(fn, "out", out);
    {
      py::gil_scoped_release nogil;
      s = call(&ov);
    }
    return py::make_tuple(stats_dict(s), out);
  }
  {
    py::gil_scoped_release nogil;
    s = call(static_cast<const TensorView<T, 4>*>(nullptr));
  }
  return std::move(stats_dict(s));
}

#define DIFFATTN_PY_STATS_ARGS                                                              \
  py::arg("causal") = false, py::arg("window_left") = -1, py::arg("window_right") = -1,   \
      py::arg("scale") = 0.0, py::arg("num_threads") = 0, py::arg("needle_begin") = 0,     \
      py::arg("needle_end") = 0, py::arg("query_begin") = 0, py::arg("query_end") = -1,    \
      py::arg("logit_bits") = 0, py::arg("out") = py::none(), py::arg("return_out") = false

#define DIFFATTN_PY_STATS_DOC                                                               \
  "\n\nMeasures every row of the attention as the fused kernel computes it (no N x M\n"     \
  "map): returns a dict with \"rows\" (measured rows that see a key), per map\n"            \
  "(heads, maps) \"max_abs_logit\", \"entropy\", \"map_needle_mass\", and per head\n"     \
  "\"needle_mass\", \"context_mass\", \"context_abs_mass\", \"negative_mass\",\n"         \
  "\"context_rms\"; means over the rows [query_begin, query_end) (-1: N), the needle\n"     \
  "the keys [needle_begin, needle_end). logit_bits (2..16) quantises each row's\n"        \
  "logits first. With out= or return_out=True returns (stats, out)."

}  // namespace

void bind_analysis(py::module_& m) {
  m.def(
      "diff_attention_v1_stats",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, double lambda,
         bool causal, index_t wl, index_t wr, double scale, int nt, index_t nb, index_t ne,
         index_t qb, index_t qe, int bits, const py::object& out_, bool return_out) {
        constexpr const char* fn = "diff_attention_v1_stats";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const auto o = make_options(causal, wl, wr, scale, nt);
        const AnalysisOptions a = analysis_options(nb, ne, qb, qe, bits);
        return visit_stats(fn, dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          const T lam = static_cast<T>(lambda);
          return with_out<T>(fn, out_, return_out,
                             {qv.shape(0), qv.shape(1), qv.shape(2) / 2, vv.shape(3)},
                             [&](const TensorView<T, 4>* ov) {
                               return ov ? diffattn::diff_attention_v1_stats<T>(qv, kv, vv, lam,
                                                                                *ov, o, a)
                                         : diffattn::diff_attention_v1_stats<T>(qv, kv, vv, lam,
                                                                                o, a);
                             });
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_"), py::kw_only(),
      DIFFATTN_PY_STATS_ARGS,
      "Statistics of differential attention V1 (shapes as diff_attention_v1; lambda_ a "
      "number)." DIFFATTN_PY_STATS_DOC);

  m.def(
      "diff_attention_v2_stats",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, const py::handle& l_,
         bool causal, index_t wl, index_t wr, double scale, int nt, index_t nb, index_t ne,
         index_t qb, index_t qe, int bits, const py::object& out_, bool return_out) {
        constexpr const char* fn = "diff_attention_v2_stats";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_), l = as_array(l_);
        const auto o = make_options(causal, wl, wr, scale, nt);
        const AnalysisOptions a = analysis_options(nb, ne, qb, qe, bits);
        return visit_stats(fn, dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          const auto lv = view_of<const T, 3>(fn, "lambda_logit", l);
          return with_out<T>(fn, out_, return_out,
                             {qv.shape(0), qv.shape(1), qv.shape(2) / 2, vv.shape(3)},
                             [&](const TensorView<T, 4>* ov) {
                               return ov ? diffattn::diff_attention_v2_stats<T>(qv, kv, vv, lv,
                                                                                *ov, o, a)
                                         : diffattn::diff_attention_v2_stats<T>(qv, kv, vv, lv,
                                                                                o, a);
                             });
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lambda_logit"), py::kw_only(),
      DIFFATTN_PY_STATS_ARGS,
      "Statistics of differential attention V2 (shapes as diff_attention_v2)." DIFFATTN_PY_STATS_DOC);

  m.def(
      "attention_stats",
      [](const py::handle& q_, const py::handle& k_, const py::handle& v_, bool causal,
         index_t wl, index_t wr, double scale, int nt, index_t nb, index_t ne, index_t qb,
         index_t qe, int bits, const py::object& out_, bool return_out) {
        constexpr const char* fn = "attention_stats";
        const py::array q = as_array(q_), k = as_array(k_), v = as_array(v_);
        const auto o = make_options(causal, wl, wr, scale, nt);
        const AnalysisOptions a = analysis_options(nb, ne, qb, qe, bits);
        return visit_stats(fn, dtype_of(q), [&](auto tag) -> py::object {
          using T = typename decltype(tag)::type;
          const auto qv = view_of<const T, 4>(fn, "q", q);
          const auto kv = view_of<const T, 4>(fn, "k", k);
          const auto vv = view_of<const T, 4>(fn, "v", v);
          return with_out<T>(
              fn, out_, return_out, {qv.shape(0), qv.shape(1), qv.shape(2), vv.shape(3)},
              [&](const TensorView<T, 4>* ov) {
                return ov ? diffattn::attention_stats<T>(qv, kv, vv, *ov, o, a)
                          : diffattn::attention_stats<T>(qv, kv, vv, o, a);
              });
        });
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), DIFFATTN_PY_STATS_ARGS,
      "Statistics of plain softmax attention (shapes as attention; one map per head, "
      "negative_mass 0)." DIFFATTN_PY_STATS_DOC);
}

}  // namespace diffattn_py
