// Sharded decoding over MPI: every rank builds the same global caches, runs the
// single-process kvcache kernel on them as the oracle, keeps its own slice of
// every sequence's keys (uneven cuts, a rank with no key of a sequence,
// contiguous or paged, any storage), and checks the sharded result against the
// oracle, bitwise across ranks and thread counts, and that bad input throws on
// every rank. Prints "mpi_decode: <passed> passed, <failed> failed" (summed
// over the ranks) and exits non-zero on any failure.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <diffattn/detail/core/random.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/mpi.hpp>

#include "mpi_check.hpp"
#include <diffattn/quantize.hpp>

using diffattn::AttentionOptions;
using diffattn::bfloat16;
using diffattn::compute_t;
using diffattn::index_t;
using diffattn::KVCacheBatch;
using diffattn::Tensor;
using diffattn::TensorView;

namespace {

using mpi_check::bitwise_equal;
using mpi_check::check;
using mpi_check::g_failed;
using mpi_check::g_passed;
using mpi_check::g_rank;
using mpi_check::g_world;
using mpi_check::rel_error;
using mpi_check::same_on_all_ranks;

enum class Kind { plain, v1, v2 };
const char* kind_name(Kind k) { return k == Kind::plain ? "plain" : k == Kind::v1 ? "v1" : "v2"; }

struct DCase {
  Kind kind;
  index_t B, n, H, Hkv, d;  // H: DIFF heads (plain: query heads)
  bool causal;
  index_t wl = -1, wr = -1;
  bool per_head = false;  // V1: one lambda per DIFF head
  bool paged = false;
  index_t split = 0;  // KVCacheBatch::split_keys
  float softcap = 0;
  bool alibi = false, sinks = false;
  index_t max_len = 40;
};

std::string describe(const DCase& c, const char* types) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s %s B=%ld n=%ld H=%ld Hkv=%ld d=%ld causal=%d window=(%ld,%ld) per_head=%d "
                "paged=%d split=%ld softcap=%g alibi=%d sinks=%d W=%d",
                kind_name(c.kind), types, long(c.B), long(c.n), long(c.H), long(c.Hkv), long(c.d),
                int(c.causal), long(c.wl), long(c.wr), int(c.per_head), int(c.paged), long(c.split),
                double(c.softcap), int(c.alibi), int(c.sinks), g_world);
  return buf;
}

/// The global problem every rank builds alike, and this rank's slice.
template <class T, class KV>
struct Problem {
  using C = compute_t<T>;
  DCase c;
  index_t Hq = 0, Hk = 0, Hv = 0, dv = 0, Hout = 0, Hlse = 0;
  Tensor<T, 4> q;
  Tensor<KV, 4> K, V;                     // global (B, cap, H, D)
  Tensor<float, 3> Ks, Vs;                // 8-bit scales (B, cap, H)
  std::vector<index_t> M;                 // global lengths
  std::vector<std::vector<index_t>> cut;  // cut[b][r]: rank r's first key; cut[b][W] = M[b]
  C lambda = C(0.3);
  Tensor<C, 1> lambda_heads;
  Tensor<T, 3> logit;
  std::vector<float> slopes, sinks;
  // The rank's slice.
  Tensor<KV, 4> k, v;
  Tensor<float, 3> ks, vs;
  std::vector<index_t> len;
  Tensor<index_t, 2> table;
};

template <class KV>
constexpr bool k8() {
  return std::is_same<KV, std::int8_t>::value || std::is_same<KV, diffattn::float8_e4m3>::value;
}

template <class T, class KV>
Problem<T, KV> make_problem(const DCase& c, std::uint64_t seed, int rank, int W) {
  Problem<T, KV> p;
  p.c = c;
  const bool v1 = c.kind == Kind::v1, diff = c.kind != Kind::plain;
  p.Hq = diff ? 2 * c.H : c.H;
  p.Hk = v1 ? 2 * c.Hkv : c.Hkv;
  p.Hv = c.Hkv;
  p.dv = v1 ? 2 * c.d : c.d;
  p.Hout = c.H;
  p.Hlse = p.Hq;
  diffattn::detail::Rng rng(seed);
  p.M.resize(static_cast<std::size_t>(c.B));
  for (index_t b = 0; b < c.B; ++b) {
    const index_t lo = c.n;
    p.M[b] = lo + static_cast<index_t>(rng.uniform() * double(c.max_len - lo + 1));
  }
  if (c.B > 2 && !c.causal) p.M[2] = 0;  // an empty sequence
  const index_t cap = *std::max_element(p.M.begin(), p.M.end()) + 1;
  p.q = Tensor<T, 4>({c.B, c.n, p.Hq, c.d});
  for (index_t i = 0; i < p.q.size(); ++i) p.q.data()[i] = static_cast<T>(rng.normal());
  Tensor<float, 4> kf({c.B, cap, p.Hk, c.d}), vf({c.B, cap, p.Hv, p.dv});
  for (index_t i = 0; i < kf.size(); ++i) kf.data()[i] = static_cast<float>(rng.normal());
  for (index_t i = 0; i < vf.size(); ++i) vf.data()[i] = static_cast<float>(rng.normal());
  p.K = Tensor<KV, 4>(kf.shape());
  p.V = Tensor<KV, 4>(vf.shape());
  if constexpr (k8<KV>()) {
    p.Ks = Tensor<float, 3>({c.B, cap, p.Hk});
    p.Vs = Tensor<float, 3>({c.B, cap, p.Hv});
    diffattn::quantize_rows<float, KV>(kf.view(), p.K.view(), p.Ks.view());
    diffattn::quantize_rows<float, KV>(vf.view(), p.V.view(), p.Vs.view());
  } else {
    for (index_t i = 0; i < kf.size(); ++i) p.K.data()[i] = static_cast<KV>(kf.data()[i]);
    for (index_t i = 0; i < vf.size(); ++i) p.V.data()[i] = static_cast<KV>(vf.data()[i]);
  }
  p.lambda_heads = Tensor<compute_t<T>, 1>({c.H});
  for (index_t h = 0; h < c.H; ++h) p.lambda_heads(h) = static_cast<compute_t<T>>(0.1 + 0.2 * h);
  p.logit = Tensor<T, 3>({c.B, c.n, c.H});
  for (index_t i = 0; i < p.logit.size(); ++i) p.logit.data()[i] = static_cast<T>(rng.normal());
  for (index_t h = 0; h < p.Hq; ++h) {
    p.slopes.push_back(static_cast<float>(0.05 + 0.1 * double(h)));
    p.sinks.push_back(static_cast<float>(rng.normal()));
  }
  // Uneven cuts; rank 1 holds no key of sequence 0.
  p.cut.assign(static_cast<std::size_t>(c.B),
               std::vector<index_t>(static_cast<std::size_t>(W + 1)));
  for (index_t b = 0; b < c.B; ++b) {
    auto& ct = p.cut[b];
    for (int r = 1; r < W; ++r) ct[r] = static_cast<index_t>(rng.uniform() * double(p.M[b] + 1));
    ct[0] = 0;
    ct[W] = p.M[b];
    std::sort(ct.begin(), ct.end());
    if (b == 0 && W > 2) ct[2] = ct[1];
    if (b == 0 && W == 2) ct[1] = 0;  // rank 0 holds none
  }
  // This rank's slice.
  p.len.resize(static_cast<std::size_t>(c.B));
  index_t maxlen = 0;
  for (index_t b = 0; b < c.B; ++b) {
    p.len[b] = p.cut[b][rank + 1] - p.cut[b][rank];
    maxlen = std::max(maxlen, p.len[b]);
  }
  const index_t bs = 3;
  index_t rows_cap = maxlen + 1, nblocks = 0, maxblocks = (maxlen + bs - 1) / bs + 1;
  if (c.paged) {
    for (index_t b = 0; b < c.B; ++b) nblocks += (p.len[b] + bs - 1) / bs;
    nblocks += 1;
    p.table = Tensor<index_t, 2>({c.B, maxblocks});
    std::vector<index_t> ids(static_cast<std::size_t>(nblocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::reverse(ids.begin(), ids.end());  // blocks out of order
    std::size_t next = 0;
    for (index_t b = 0; b < c.B; ++b)
      for (index_t blk = 0; blk < maxblocks; ++blk)
        p.table(b, blk) = blk * bs < p.len[b] ? ids[next++] : -5;  // unused entries: anything
  }
  const std::array<index_t, 4> ksh = c.paged ? std::array<index_t, 4>{nblocks, bs, p.Hk, c.d}
                                             : std::array<index_t, 4>{c.B, rows_cap, p.Hk, c.d};
  const std::array<index_t, 4> vsh = {ksh[0], ksh[1], p.Hv, p.dv};
  p.k = Tensor<KV, 4>(ksh);
  p.v = Tensor<KV, 4>(vsh);
  if constexpr (k8<KV>()) {
    p.ks = Tensor<float, 3>({ksh[0], ksh[1], p.Hk});
    p.vs = Tensor<float, 3>({ksh[0], ksh[1], p.Hv});
    p.ks.fill(1.0f);
    p.vs.fill(1.0f);
  }
  for (index_t b = 0; b < c.B; ++b)
    for (index_t j = 0; j < p.len[b]; ++j) {
      const index_t g = p.cut[b][rank] + j;
      const index_t blk = c.paged ? p.table(b, j / bs) : b, row = c.paged ? j % bs : j;
      for (index_t h = 0; h < p.Hk; ++h) {
        std::copy(&p.K(b, g, h, 0), &p.K(b, g, h, 0) + c.d, &p.k(blk, row, h, 0));
        if constexpr (k8<KV>()) p.ks(blk, row, h) = p.Ks(b, g, h);
      }
      for (index_t h = 0; h < p.Hv; ++h) {
        std::copy(&p.V(b, g, h, 0), &p.V(b, g, h, 0) + p.dv, &p.v(blk, row, h, 0));
        if constexpr (k8<KV>()) p.vs(blk, row, h) = p.Vs(b, g, h);
      }
    }
  return p;
}

template <class T, class KV>
AttentionOptions options_of(const Problem<T, KV>& p, int threads) {
  AttentionOptions o;
  o.causal = p.c.causal;
  o.window_left = p.c.wl;
  o.window_right = p.c.wr;
  o.num_threads = threads;
  o.softcap = p.c.softcap;
  if (p.c.alibi)
    o.alibi_slopes = TensorView<const float, 1>(p.slopes.data(), {index_t(p.slopes.size())});
  if (p.c.sinks) o.sinks = TensorView<const float, 1>(p.sinks.data(), {index_t(p.sinks.size())});
  return o;
}

/// The single-process kernel on the global caches.
template <class T, class KV>
void run_single(const Problem<T, KV>& p, Tensor<T, 4>& out, Tensor<compute_t<T>, 3>& lse) {
  KVCacheBatch cb;
  cb.cache_seqlens = TensorView<const index_t, 1>(p.M.data(), {p.c.B});
  cb.split_keys = p.c.split;
  if constexpr (k8<KV>()) {
    cb.k_scale = p.Ks.view();
    cb.v_scale = p.Vs.view();
  }
  const AttentionOptions o = options_of(p, 0);
  switch (p.c.kind) {
    case Kind::plain:
      diffattn::attention_kvcache<T, KV>(p.q.view(), p.K.view(), p.V.view(), out.view(), lse.view(),
                                         cb, o);
      break;
    case Kind::v1:
      if (p.c.per_head)
        diffattn::diff_attention_v1_kvcache<T, KV>(p.q.view(), p.K.view(), p.V.view(),
                                                   p.lambda_heads.view(), out.view(), lse.view(),
                                                   cb, o);
      else
        diffattn::diff_attention_v1_kvcache<T, KV>(p.q.view(), p.K.view(), p.V.view(), p.lambda,
                                                   out.view(), lse.view(), cb, o);
      break;
    case Kind::v2:
      diffattn::diff_attention_v2_kvcache<T, KV>(p.q.view(), p.K.view(), p.V.view(), p.logit.view(),
                                                 out.view(), lse.view(), cb, o);
      break;
  }
}

/// The sharded kernel on this rank's slice; `tweak` may change the options.
template <class T, class KV>
void run_sharded(MPI_Comm comm, const Problem<T, KV>& p, Tensor<T, 4>& out,
                 Tensor<compute_t<T>, 3>& lse, const AttentionOptions& o,
                 diffattn::detail::nondeduced_view<const T, 4> q,
                 diffattn::detail::nondeduced_t<compute_t<T>> lambda,
                 diffattn::mpi::DecodeStats* stats = nullptr) {
  KVCacheBatch cb;
  cb.cache_seqlens = TensorView<const index_t, 1>(p.len.data(), {p.c.B});
  cb.split_keys = p.c.split;
  if (p.c.paged) cb.block_table = p.table.view();
  if constexpr (k8<KV>()) {
    cb.k_scale = p.ks.view();
    cb.v_scale = p.vs.view();
  }
  switch (p.c.kind) {
    case Kind::plain:
      diffattn::mpi::attention_kvcache<T, KV>(comm, q, p.k.view(), p.v.view(), out.view(),
                                              lse.view(), cb, o, stats);
      break;
    case Kind::v1:
      if (p.c.per_head)
        diffattn::mpi::diff_attention_v1_kvcache<T, KV>(comm, q, p.k.view(), p.v.view(),
                                                        p.lambda_heads.view(), out.view(),
                                                        lse.view(), cb, o, stats);
      else
        diffattn::mpi::diff_attention_v1_kvcache<T, KV>(comm, q, p.k.view(), p.v.view(), lambda,
                                                        out.view(), lse.view(), cb, o, stats);
      break;
    case Kind::v2:
      diffattn::mpi::diff_attention_v2_kvcache<T, KV>(
          comm, q, p.k.view(), p.v.view(), p.logit.view(), out.view(), lse.view(), cb, o, stats);
      break;
  }
}

template <class T, class KV>
void run_case(const DCase& c, std::uint64_t seed, const char* types, double tol, double lse_tol) {
  using C = compute_t<T>;
  const std::string what = describe(c, types);
  Problem<T, KV> p = make_problem<T, KV>(c, seed, g_rank, g_world);
  Tensor<T, 4> ref({c.B, c.n, p.Hout, p.dv}), out(ref.shape()), out1(ref.shape());
  Tensor<C, 3> ref_lse({c.B, p.Hlse, c.n}), lse(ref_lse.shape()), lse1(ref_lse.shape());
  run_single(p, ref, ref_lse);
  diffattn::mpi::DecodeStats st;
  run_sharded(MPI_COMM_WORLD, p, out, lse, options_of(p, 2), p.q.view(), p.lambda, &st);
  const double e = rel_error(out, ref), el = rel_error(lse, ref_lse);
  check(e <= tol, what + ": out rel error " + std::to_string(e));
  check(el <= lse_tol, what + ": lse rel error " + std::to_string(el));
  check(same_on_all_ranks(out, MPI_COMM_WORLD) && same_on_all_ranks(lse, MPI_COMM_WORLD),
        what + ": out and lse bitwise the same on every rank");
  run_sharded(MPI_COMM_WORLD, p, out1, lse1, options_of(p, 1), p.q.view(), p.lambda);
  check(bitwise_equal(out, out1) && bitwise_equal(lse, lse1),
        what + ": 1 and 2 threads give the same bits");
  std::uint64_t keys = 0;
  for (index_t b = 0; b < c.B; ++b) keys += static_cast<std::uint64_t>(p.len[b]);
  check(st.keys_read <= keys && (g_world == 1 || st.state_bytes > 0) &&
            st.seconds >= st.comm_seconds && st.seconds >= st.ready_seconds &&
            st.comm_seconds >= st.exchange_seconds && (g_world == 1 || st.ready_seconds > 0),
        what + ": stats (keys read " + std::to_string(st.keys_read) + " of " +
            std::to_string(keys) + ")");
}

/// Every rank must throw (never hang); returns whether this rank threw.
template <class F>
void expect_throw_everywhere(const std::string& what, const char* needle, F&& f) {
  bool threw = false;
  std::string msg;
  try {
    f();
  } catch (const diffattn::error& e) {
    threw = true;
    msg = e.what();
  }
  check(threw, what + ": throws on every rank");
  if (threw && needle && g_rank == 0)
    check(msg.find(needle) != std::string::npos, what + ": message names " + needle + ": " + msg);
  // All ranks are still in step: one more collective completes.
  int x = 1, sum = 0;
  MPI_Allreduce(&x, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  check(sum == g_world, what + ": ranks in step afterwards");
}

void error_cases() {
  const int last = g_world - 1;
  using T = float;
  DCase c{Kind::v1, 2, 1, 2, 1, 8, true};
  auto p = make_problem<T, T>(c, 991, g_rank, g_world);
  Tensor<T, 4> out({c.B, c.n, p.Hout, p.dv});
  Tensor<T, 3> lse({c.B, p.Hlse, c.n});
  if (g_world > 1) {
    Tensor<T, 4> q2 = Tensor<T, 4>(p.q.shape());
    std::copy(p.q.data(), p.q.data() + p.q.size(), q2.data());
    if (g_rank == last) q2.data()[3] += 1.0f;
    expect_throw_everywhere("a different q on one rank", "q", [&] {
      run_sharded(MPI_COMM_WORLD, p, out, lse, options_of(p, 0), q2.view(), p.lambda);
    });
    expect_throw_everywhere("a different lambda on one rank", "lambda", [&] {
      run_sharded(MPI_COMM_WORLD, p, out, lse, options_of(p, 0), p.q.view(),
                  g_rank == last ? 0.5f : p.lambda);
    });
    AttentionOptions o = options_of(p, 0);
    if (g_rank == last) o.window_left = 4;
    expect_throw_everywhere("different options on one rank", "window_left", [&] {
      run_sharded(MPI_COMM_WORLD, p, out, lse, o, p.q.view(), p.lambda);
    });
  }
  // A length beyond the capacity on one rank only.
  {
    auto bad = p;
    if (g_rank == last) bad.len[0] = bad.k.shape(1) + 1;
    expect_throw_everywhere("cache_seqlens beyond capacity on one rank", "cache_seqlens", [&] {
      run_sharded(MPI_COMM_WORLD, bad, out, lse, options_of(bad, 0), bad.q.view(), bad.lambda);
    });
  }
  // A wrong output shape on rank 0 only.
  {
    Tensor<T, 4> out_bad({c.B, c.n, p.Hout, p.dv + (g_rank == 0 ? 1 : 0)});
    expect_throw_everywhere("a bad out shape on rank 0", "out", [&] {
      run_sharded(MPI_COMM_WORLD, p, out_bad, lse, options_of(p, 0), p.q.view(), p.lambda);
    });
  }
  // Causal with fewer keys in all than new queries (only the sum tells).
  {
    DCase c3{Kind::v2, 1, 3, 2, 1, 8, true};
    c3.max_len = 3;
    auto p3 = make_problem<T, T>(c3, 5, g_rank, g_world);
    for (auto& l : p3.len) l = g_rank == 0 ? 1 : 0;
    Tensor<T, 4> o3({1, 3, 2, 8});
    Tensor<T, 3> l3({1, 4, 3});
    expect_throw_everywhere("causal with 1 key in all for 3 queries", "add up", [&] {
      run_sharded(MPI_COMM_WORLD, p3, o3, l3, options_of(p3, 0), p3.q.view(), p3.lambda);
    });
  }
  // A negative 8-bit scale on the last rank (found during the step).
  {
    DCase c8{Kind::v2, 2, 1, 2, 1, 8, true};
    c8.max_len = 30;
    auto p8 = make_problem<T, std::int8_t>(c8, 77, g_rank, g_world);
    if (g_rank == last) {
      for (index_t b = 0; b < c8.B; ++b)
        if (p8.len[b] > 0) p8.ks(b, 0, 0) = -1.0f;
    }
    bool any = false;
    for (index_t b = 0; b < c8.B; ++b) any = any || p8.len[b] > 0;
    int has = g_rank == last && any ? 1 : 0, some = 0;
    MPI_Allreduce(&has, &some, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (some) {
      Tensor<T, 4> o8({2, 1, 2, 8});
      Tensor<T, 3> l8({2, 4, 1});
      expect_throw_everywhere("a negative scale on one rank", nullptr, [&] {
        run_sharded(MPI_COMM_WORLD, p8, o8, l8, options_of(p8, 0), p8.q.view(), p8.lambda);
      });
    }
  }
  // ALiBi with several non-causal queries: refused alike on every rank.
  {
    DCase ca{Kind::plain, 1, 3, 2, 1, 8, false};
    ca.alibi = true;
    auto pa = make_problem<T, T>(ca, 9, g_rank, g_world);
    Tensor<T, 4> oa({1, 3, 2, 8});
    Tensor<T, 3> la({1, 2, 3});
    expect_throw_everywhere("alibi, 3 non-causal queries", "alibi_slopes", [&] {
      run_sharded(MPI_COMM_WORLD, pa, oa, la, options_of(pa, 0), pa.q.view(), pa.lambda);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  std::uint64_t seed = 4242;
  try {
    std::vector<DCase> cases;
    for (bool causal : {true, false})
      for (index_t n : {1, 3, 7}) {  // 7: the non-decoding path of the kernel
        cases.push_back({Kind::plain, 3, n, 4, 2, 16, causal});
        cases.push_back({Kind::v1, 3, n, 2, 1, 8, causal});
        DCase ph{Kind::v1, 2, n, 4, 2, 8, causal};
        ph.per_head = true;
        cases.push_back(ph);
        cases.push_back({Kind::v2, 3, n, 4, 2, 8, causal});
      }
    // Windows over global positions, with split chunks.
    for (Kind k : {Kind::plain, Kind::v1, Kind::v2}) {
      DCase w{k, 3, 1, 2, 1, 8, true, 9, -1};
      w.split = 4;
      cases.push_back(w);
      DCase w2{k, 2, 3, 2, 1, 8, false, 6, 2};
      cases.push_back(w2);
      DCase w3{k, 2, 1, 2, 2, 8, true, 2, -1};  // most slices wholly outside
      w3.max_len = 60;
      cases.push_back(w3);
    }
    // Paged slices.
    for (Kind k : {Kind::plain, Kind::v1, Kind::v2}) {
      DCase pg{k, 3, 1, 2, 1, 8, true};
      pg.paged = true;
      pg.split = 5;
      cases.push_back(pg);
      DCase pg2{k, 2, 4, 2, 1, 8, true, 7, -1};
      pg2.paged = true;
      cases.push_back(pg2);
    }
    // Score modifiers.
    for (Kind k : {Kind::plain, Kind::v1, Kind::v2})
      for (index_t n : {1, 3}) {
        DCase m{k, 2, n, 2, 1, 8, true};
        m.softcap = 3.0f;
        cases.push_back(m);
        DCase a{k, 2, n, 2, 1, 8, true};
        a.alibi = true;
        a.split = 6;
        cases.push_back(a);
        DCase s{k, 3, n, 2, 1, 8, n == 1 ? false : true};
        s.sinks = true;
        cases.push_back(s);
        DCase all{k, 2, n, 2, 1, 8, true, 11, -1};
        all.softcap = 2.5f;
        all.alibi = true;
        all.sinks = true;
        all.paged = true;
        cases.push_back(all);
      }
    {
      DCase a1{Kind::v2, 2, 1, 2, 1, 8, false};  // ALiBi, one non-causal query
      a1.alibi = true;
      cases.push_back(a1);
    }
    for (const DCase& c : cases) {
      run_case<double, double>(c, seed += 7, "double", 1e-12, 1e-12);
      run_case<float, float>(c, seed += 7, "float", 5e-5, 5e-5);
    }
    // 16-bit and 8-bit storage (the oracle reads the same stored values).
    for (Kind k : {Kind::plain, Kind::v1, Kind::v2})
      for (bool paged : {false, true}) {
        DCase c{k, 3, 1, 2, 1, 8, true};
        c.paged = paged;
        c.split = 7;
        run_case<float, bfloat16>(c, seed += 7, "float/bfloat16", 5e-5, 5e-5);
        run_case<float, diffattn::half>(c, seed += 7, "float/half", 5e-5, 5e-5);
        run_case<bfloat16, bfloat16>(c, seed += 7, "bfloat16", 1.6e-2, 5e-5);
        run_case<float, std::int8_t>(c, seed += 7, "float/int8", 5e-5, 5e-5);
        run_case<float, diffattn::float8_e4m3>(c, seed += 7, "float/e4m3", 5e-5, 5e-5);
        run_case<bfloat16, std::int8_t>(c, seed += 7, "bfloat16/int8", 1.6e-2, 5e-5);
        DCase c3 = c;
        c3.n = 3;
        c3.alibi = true;
        run_case<diffattn::half, diffattn::half>(c3, seed += 7, "half", 4e-3, 5e-5);
      }
    error_cases();
  } catch (const std::exception& e) {
    check(false, std::string("unexpected exception: ") + e.what());
  }
  return mpi_check::finish("mpi_decode");
}
