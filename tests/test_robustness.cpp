// Defined numerics on hostile values, and safety under concurrent callers.
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/attention_backward.hpp>
#include <diffattn/detail/core/fp_mode.hpp>
#include <diffattn/detail/core/parallel.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/module.hpp>
#include <diffattn/reference.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::Tensor;
using test::random_tensor;

namespace {
AttentionOptions causal_options(int threads = 0) {
  AttentionOptions o;
  o.causal = true;
  o.num_threads = threads;
  return o;
}

bool row_finite(const Tensor<float, 4>& t, index_t b, index_t i, index_t h) {
  for (index_t c = 0; c < t.shape(3); ++c)
    if (!std::isfinite(t(b, i, h, c))) return false;
  return true;
}
bool row_nan(const Tensor<float, 4>& t, index_t b, index_t i, index_t h) {
  for (index_t c = 0; c < t.shape(3); ++c)
    if (!std::isnan(t(b, i, h, c))) return false;
  return true;
}
}  // namespace

TEST_CASE("NaN in an input reaches only the output rows that read it", "[robustness][nan]") {
  // N = M = 70 spans two query blocks and many register tiles.
  const index_t N = 70, H = 2, d = 8;
  const auto q0 = random_tensor<float, 4>({1, N, 2 * H, d}, 1);
  const auto k0 = random_tensor<float, 4>({1, N, 2 * H, d}, 2);
  const auto v0 = random_tensor<float, 4>({1, N, H, 2 * d}, 3);
  Tensor<float, 4> clean({1, N, H, 2 * d}), out({1, N, H, 2 * d});
  diffattn::diff_attention_v1<float>(q0, k0, v0, 0.8f, clean, causal_options());
  const float nan = std::numeric_limits<float>::quiet_NaN();

  SECTION("a query row") {
    auto q = q0;
    q(0, 33, 1, 4) = nan;  // map 2 of DIFF head 0, query 33
    diffattn::diff_attention_v1<float>(q, k0, v0, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      CHECK(row_finite(out, 0, i, 1));
      if (i == 33)
        CHECK(row_nan(out, 0, i, 0));
      else
        CHECK(row_finite(out, 0, i, 0));
    }
  }
  SECTION("a key row: causal rows before it are untouched") {
    auto k = k0;
    k(0, 40, 0, 2) = nan;  // map 1 key of kv pair 0
    diffattn::diff_attention_v1<float>(q0, k, v0, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      if (i >= 40)
        CHECK(row_nan(out, 0, i, 0));
      else
        CHECK(row_finite(out, 0, i, 0));
    }
  }
  SECTION("a value row: causal rows before it are untouched") {
    auto v = v0;
    for (index_t j : {41, 42, 43}) v(0, j, 0, 5) = nan;  // inside one register tile of queries
    diffattn::diff_attention_v1<float>(q0, k0, v, 0.8f, out, causal_options());
    for (index_t i = 0; i < N; ++i) {
      INFO("row " << i);
      if (i >= 41)
        CHECK(std::isnan(out(0, i, 0, 5)));
      else {
        CHECK(row_finite(out, 0, i, 0));
        CHECK(out(0, i, 0, 5) == clean(0, i, 0, 5));
      }
      CHECK(row_finite(out, 0, i, 1));
    }
  }
}

TEST_CASE("logits of 1e4 in float do not overflow", "[robustness]") {
  const index_t N = 9, M = 13, d = 4;
  // Scores s q.k reach about 1e4.
  auto qf = random_tensor<float, 4>({1, N, 2, d}, 11, 70.0);
  auto kf = random_tensor<float, 4>({1, M, 2, d}, 12, 70.0);
  const auto vf = random_tensor<float, 4>({1, M, 1, 2 * d}, 13);
  Tensor<float, 4> out({1, N, 1, 2 * d});
  Tensor<float, 3> lse({1, 2, N});
  diffattn::diff_attention_v1<float>(qf, kf, vf, 0.5f, out, lse);
  CHECK(test::all_finite(out));
  CHECK(test::all_finite(lse));
  float max_lse = 0;
  for (index_t i = 0; i < lse.size(); ++i) max_lse = std::max(max_lse, std::abs(lse.data()[i]));
  CHECK(max_lse > 1000.0f);  // the logits really are large
  Tensor<double, 4> ref({1, N, 1, 2 * d});
  diffattn::reference::diff_attention_v1<double>(test::cast<double>(qf), test::cast<double>(kf),
                                                 test::cast<double>(vf), 0.5, ref);
  CHECK(test::rel_error(out, ref) < 1e-3);
}

TEST_CASE("lambda far outside [0, 1] still gives rows summing to 1 - lambda", "[robustness]") {
  const index_t N = 17, M = 23, H = 1, d = 8;
  const auto q = random_tensor<double, 4>({1, N, 2 * H, d}, 21);
  const auto k = random_tensor<double, 4>({1, M, 2 * H, d}, 22);
  Tensor<double, 4> ones({1, M, H, 2 * d});
  ones.fill(1.0);  // the output then reads out each row's sum of weights
  Tensor<double, 4> out({1, N, H, 2 * d});
  for (double lambda : {-50.0, -3.0, 7.5, 1e3}) {
    diffattn::diff_attention_v1<double>(q, k, ones, lambda, out, causal_options());
    for (index_t i = 0; i < N; ++i) REQUIRE(out(0, i, 0, 3) == Approx(1.0 - lambda).epsilon(1e-12));
  }
}

TEST_CASE("kernels are safe to call from several threads at once", "[robustness][threads]") {
  const index_t N = 97, H = 2, d = 16;
  std::vector<Tensor<float, 4>> qs, ks, vs, expect;
  for (std::uint64_t s = 0; s < 4; ++s) {
    qs.push_back(random_tensor<float, 4>({1, N, 2 * H, d}, 100 + s));
    ks.push_back(random_tensor<float, 4>({1, N, 2 * H, d}, 200 + s));
    vs.push_back(random_tensor<float, 4>({1, N, H, 2 * d}, 300 + s));
    expect.emplace_back(std::array<index_t, 4>{1, N, H, 2 * d});
    diffattn::diff_attention_v1<float>(qs[s], ks[s], vs[s], 0.7f, expect[s], causal_options(1));
  }
  std::vector<Tensor<float, 4>> got(4, Tensor<float, 4>({1, N, H, 2 * d}));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep)
        diffattn::diff_attention_v1<float>(qs[t], ks[t], vs[t], 0.7f, got[t],
                                           causal_options(t % 2 + 1));
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) CHECK(test::bitwise_equal(got[t], expect[t]));
}

TEST_CASE("a process forked after a two-thread call runs its calls, on one thread",
          "[robustness][threads][fork]") {
#if defined(_OPENMP) && defined(__unix__)
  // GNU OpenMP keeps the parent's team in the child's bookkeeping without its
  // threads: without the fork handler the child's first two-thread call waits
  // for them forever. The child's alarm turns such a hang into a failure. A
  // plain OpenMP team of the child's (another library's) runs too.
  const index_t N = 257, H = 2, d = 32;
  const auto q = random_tensor<float, 4>({1, N, 2 * H, d}, 31);
  const auto k = random_tensor<float, 4>({1, N, 2 * H, d}, 32);
  const auto v = random_tensor<float, 4>({1, N, H, 2 * d}, 33);
  Tensor<float, 4> expect({1, N, H, 2 * d});
  diffattn::diff_attention_v1<float>(q, k, v, 0.7f, expect, causal_options(2));
  REQUIRE_FALSE(diffattn::detail::teams_disabled());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::alarm(60);
    Tensor<float, 4> got({1, N, H, 2 * d});
    diffattn::diff_attention_v1<float>(q, k, v, 0.7f, got, causal_options(2));
    int members = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp atomic
      ++members;
    }
    const bool ok = diffattn::detail::teams_disabled() &&
                    diffattn::detail::resolve_threads(2, 8) == 1 && members == 1 &&
                    test::bitwise_equal(got, expect);
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO("child status " << status << (WIFSIGNALED(status) ? " (killed: hung or crashed)" : ""));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // The parent keeps its threads.
  CHECK(diffattn::detail::resolve_threads(2, 8) == 2);
#else
  WARN("skipped: needs OpenMP and fork()");
#endif
}

TEST_CASE("layers: forward and gradients bitwise identical for 1 and 2 threads",
          "[robustness][threads]") {
  diffattn::DiffAttnV1Config c;
  c.embed_dim = 64;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  const auto x = random_tensor<float, 3>({2, 130, 64}, 31);  // 260 rows: the packed product path
  const auto dy = random_tensor<float, 3>({2, 130, 64}, 32);
  diffattn::MultiheadDiffAttnV1<float> a(c, 5), b(c, 5);
  a.set_num_threads(1);
  b.set_num_threads(2);
  const Tensor<float, 3> ya = a.forward(x), yb = b.forward(x);
  CHECK(test::bitwise_equal(ya, yb));
  const Tensor<float, 3> dxa = a.backward(dy), dxb = b.backward(dy);
  CHECK(test::bitwise_equal(dxa, dxb));
  const auto ga = a.gradients(), gb = b.gradients();
  for (const auto& kv : ga) {
    const auto& other = gb.at(kv.first);
    bool same = true;
    for (index_t i = 0; i < kv.second.size(); ++i) same = same && kv.second(i) == other(i);
    INFO(kv.first);
    CHECK(same);
  }
}

#if DIFFATTN_DETAIL_FLUSH_MXCSR
namespace {
constexpr unsigned kFlush = diffattn::detail::kMxcsrFlushDenormals;
/// MXCSR without its six exception flags: rounding, masks, FTZ, DAZ.
unsigned mxcsr_mode() { return _mm_getcsr() & ~0x3Fu; }

/// A score functor that counts the scores it sees computed outside the
/// flushed mode, and throws at one (b, h, i, j) when asked to.
struct ModeProbe {
  std::atomic<int>* unflushed;
  std::atomic<int>* calls;
  index_t throw_at_i = -1;
  float score(float s, index_t, index_t h, index_t i, index_t j) const {
    calls->fetch_add(1, std::memory_order_relaxed);
    if ((_mm_getcsr() & kFlush) != kFlush) unflushed->fetch_add(1, std::memory_order_relaxed);
    if (i == throw_at_i && h == 0 && j == 0) throw std::runtime_error("probe");
    return s;
  }
  float dscore(float, index_t, index_t, index_t, index_t) const { return 1.0f; }
};

/// Every OpenMP thread of a team of `threads`: its MXCSR mode bits.
std::vector<unsigned> team_modes(int threads) {
  std::vector<unsigned> modes(static_cast<std::size_t>(threads), 0u);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  modes[static_cast<std::size_t>(omp_get_thread_num())] = mxcsr_mode();
#else
  for (auto& m : modes) m = mxcsr_mode();
#endif
  return modes;
}
}  // namespace

TEST_CASE("kernels run with denormals flushed and give every thread its mode back",
          "[robustness][denormals]") {
  // Peaked scores (q 30 N(0, 1), d = 16: s of standard deviation 30), so that
  // many exps land in the denormal range (s - max in (-104, -87)).
  const index_t N = 70, M = 70, H = 2, d = 16;
  const auto q = random_tensor<float, 4>({1, N, 2 * H, d}, 41, 30.0);
  const auto k = random_tensor<float, 4>({1, M, H, d}, 42);
  const auto v = random_tensor<float, 4>({1, M, H, d}, 43);
  const auto logit = random_tensor<float, 3>({1, N, H}, 44);
  const auto dout = random_tensor<float, 4>({1, N, H, d}, 45);
  Tensor<float, 4> out({1, N, H, d}), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse({1, 2 * H, N}), dlogit(logit.shape());
  std::atomic<int> unflushed{0}, calls{0};
  const unsigned caller = mxcsr_mode();
  const std::vector<unsigned> before = team_modes(2);

  // The caller's own mode: as the test runner left it, FTZ alone, DAZ alone, both.
  for (unsigned own : {0u, 0x8000u, 0x0040u, kFlush}) {
    _mm_setcsr((_mm_getcsr() & ~kFlush) | own);
    const unsigned mode = mxcsr_mode();
    for (int threads : {1, 2}) {
      INFO("caller FTZ/DAZ bits " << own << ", threads " << threads);
      const auto o = causal_options(threads);
      const ModeProbe probe{&unflushed, &calls};
      diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o, probe);
      CHECK(mxcsr_mode() == mode);
      diffattn::diff_attention_v2_backward<float>(q, k, v, logit, out, lse, dout, dq, dk, dv, dlogit,
                                                  o, diffattn::TensorView<float, 1>(), probe);
      CHECK(mxcsr_mode() == mode);
      // A decoding step: one query against the 70 keys as a cache.
      Tensor<index_t, 1> lens(std::array<index_t, 1>{1});
      lens(0) = M;
      diffattn::KVCacheBatch cache;
      cache.cache_seqlens = lens;
      const auto q1 = random_tensor<float, 4>({1, 1, 2 * H, d}, 46, 30.0);
      const auto logit1 = random_tensor<float, 3>({1, 1, H}, 47);
      Tensor<float, 4> out1({1, 1, H, d});
      diffattn::diff_attention_v2_kvcache<float>(q1, k, v, logit1, out1, {}, cache, o, probe);
      CHECK(mxcsr_mode() == mode);
      // A task that throws: the exception reaches the caller, the modes come back.
      ModeProbe thrower{&unflushed, &calls};
      thrower.throw_at_i = N / 2;
      CHECK_THROWS_AS(diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o, thrower),
                      std::runtime_error);
      CHECK(mxcsr_mode() == mode);
    }
  }
  _mm_setcsr((_mm_getcsr() & ~kFlush) | (caller & kFlush));
  CHECK(mxcsr_mode() == caller);
  CHECK(calls.load() > 0);
  CHECK(unflushed.load() == 0);  // every score the kernels computed, they computed flushed
  CHECK(team_modes(2) == before);  // the OpenMP workers are back in their own mode
}

TEST_CASE("peaked scores: denormal weights flushed, results within the float bound",
          "[robustness][denormals]") {
  // Forward and backward on scores of standard deviation 30 against the float64
  // reference on the same float inputs; the naive float reference (IEEE, no
  // flush) sets the scale of float rounding, as in test_attention_backward.
  const index_t N = 83, M = 97, H = 2, Hkv = 1, d = 16;
  const auto qd = random_tensor<double, 4>({1, N, 2 * H, d}, 51, 30.0);
  const auto kd = random_tensor<double, 4>({1, M, Hkv, d}, 52);
  const auto vd = random_tensor<double, 4>({1, M, Hkv, d}, 53);
  const auto ld = random_tensor<double, 3>({1, N, H}, 54);
  const auto dd = random_tensor<double, 4>({1, N, H, d}, 55);
  const auto q = test::cast<float>(qd), k = test::cast<float>(kd), v = test::cast<float>(vd),
             dout = test::cast<float>(dd);
  const auto logit = test::cast<float>(ld);
  const auto q64 = test::cast<double>(q), k64 = test::cast<double>(k), v64 = test::cast<double>(v),
             d64 = test::cast<double>(dout);
  const auto l64 = test::cast<double>(logit);
  const auto o = causal_options(2);

  Tensor<float, 4> out({1, N, H, d}), naive_out({1, N, H, d});
  Tensor<float, 3> lse({1, 2 * H, N}), naive_lse({1, 2 * H, N});
  Tensor<double, 4> ref_out({1, N, H, d});
  Tensor<double, 3> ref_lse({1, 2 * H, N});
  diffattn::diff_attention_v2<float>(q, k, v, logit, out, lse, o);
  diffattn::reference::diff_attention_v2<float>(q, k, v, logit, naive_out, naive_lse, o);
  diffattn::reference::diff_attention_v2<double>(q64, k64, v64, l64, ref_out, ref_lse, o);
  const double floor = 2e-5;
  INFO("out: fused " << test::rel_error(out, ref_out) << ", naive "
                     << test::rel_error(naive_out, ref_out));
  CHECK(test::rel_error(out, ref_out) <= std::max(2 * test::rel_error(naive_out, ref_out), floor));
  CHECK(test::rel_error(lse, ref_lse) <= std::max(2 * test::rel_error(naive_lse, ref_lse), floor));

  Tensor<float, 4> dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 4> ndq(q.shape()), ndk(k.shape()), ndv(v.shape());
  Tensor<double, 4> rdq(q.shape()), rdk(k.shape()), rdv(v.shape());
  Tensor<float, 3> dl(logit.shape()), ndl(logit.shape());
  Tensor<double, 3> rdl(logit.shape());
  diffattn::diff_attention_v2_backward<float>(q, k, v, logit, out, lse, dout, dq, dk, dv, dl, o);
  diffattn::reference::diff_attention_v2_backward<float>(q, k, v, logit, naive_out, naive_lse,
                                                         dout, ndq, ndk, ndv, ndl, o);
  diffattn::reference::diff_attention_v2_backward<double>(q64, k64, v64, l64, ref_out, ref_lse,
                                                          d64, rdq, rdk, rdv, rdl, o);
  const double backward_floor = 5e-5;
  auto check = [&](const char* name, double fused, double naive) {
    INFO(name << ": fused " << fused << ", naive " << naive);
    CHECK(fused <= std::max(2 * naive, backward_floor));
  };
  check("dq", test::rel_error(dq, rdq), test::rel_error(ndq, rdq));
  check("dk", test::rel_error(dk, rdk), test::rel_error(ndk, rdk));
  check("dv", test::rel_error(dv, rdv), test::rel_error(ndv, rdv));
  check("dlogit", test::rel_error(dl, rdl), test::rel_error(ndl, rdl));
  // The data does reach the denormal range: some row's weights span more than 87.
  double widest = 0;
  for (index_t h = 0; h < 2 * H; ++h)
    for (index_t i = 0; i < N; ++i) {
      double lo = 0;
      for (index_t j = 0; j <= i + M - N && j < M; ++j) {
        double s = 0;
        for (index_t c = 0; c < d; ++c) s += q64(0, i, h, c) * k64(0, j, 0, c);
        lo = std::min(lo, s / std::sqrt(static_cast<double>(d)) - ref_lse(0, h, i));
      }
      widest = std::max(widest, -lo);
    }
  CHECK(widest > 104.0);
}
#endif
