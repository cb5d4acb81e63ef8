// Packed variable-length batches: one call over sequences concatenated along
// the token axis equals a separate call per sequence, forward and backward.
#include <cmath>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/packed.hpp>

#include "attention_support.hpp"
#include "support.hpp"

using diffattn::AttentionOptions;
using diffattn::index_t;
using diffattn::PackedSequences;
using diffattn::Tensor;
using diffattn::TensorView;
using test::random_tensor;

namespace {

enum class Kind { v1, v2, plain };

/// Rows [r0, r0 + n) of a packed (T, H, D) tensor as a (1, n, H, D) view.
template <class T>
TensorView<T, 4> rows4(T* data, index_t r0, index_t n, index_t h, index_t d) {
  return TensorView<T, 4>(data + r0 * h * d, {1, n, h, d});
}
/// Columns [c0, c0 + n) of a packed (H, T) lse as a (1, H, n) view.
template <class T>
TensorView<T, 3> lse_cols(T* data, index_t total, index_t c0, index_t n, index_t h) {
  return TensorView<T, 3>(data + c0, {1, h, n}, {h * total, total, 1});
}

struct Dims {
  index_t H, Hkv, d;
  index_t qheads(Kind k) const { return k == Kind::plain ? H : 2 * H; }
  index_t kheads(Kind k) const { return k == Kind::v1 ? 2 * Hkv : Hkv; }
  index_t dv(Kind k) const { return k == Kind::v1 ? 2 * d : (k == Kind::plain ? d + 1 : d); }
};

/// Packed forward (and backward) against per-sequence calls of the unpacked kernels.
template <class T>
void check(Kind kind, const Dims& dm, const PackedSequences& seqs, const AttentionOptions& o,
           std::uint64_t seed) {
  const std::vector<index_t>& cq = seqs.cu_seqlens_q;
  const std::vector<index_t>& ck = seqs.cu_seqlens_k.empty() ? cq : seqs.cu_seqlens_k;
  const index_t S = seqs.size(), Tq = cq.back(), Tk = ck.back();
  INFO("kind " << int(kind) << " S=" << S << " Tq=" << Tq << " Tk=" << Tk << " causal=" << o.causal
               << " window=(" << o.window_left << ", " << o.window_right << ")");
  const index_t qh = dm.qheads(kind), kh = dm.kheads(kind), dv = dm.dv(kind), H = dm.H;
  const index_t lh = kind == Kind::plain ? H : 2 * H;
  const auto q = random_tensor<T, 3>({Tq, qh, dm.d}, seed);
  const auto k = random_tensor<T, 3>({Tk, kh, dm.d}, seed + 1);
  const auto v = random_tensor<T, 3>({Tk, dm.Hkv, dv}, seed + 2);
  const auto logit = random_tensor<T, 2>({Tq, H}, seed + 3);
  const auto dout = random_tensor<T, 3>({Tq, H, dv}, seed + 4);
  const T lambda = T(0.65);
  Tensor<T, 3> out({Tq, H, dv});
  Tensor<T, 2> lse({lh, Tq});
  if (kind == Kind::v1)
    diffattn::diff_attention_v1_varlen<T>(q, k, v, lambda, out, lse, seqs, o);
  else if (kind == Kind::v2)
    diffattn::diff_attention_v2_varlen<T>(q, k, v, logit, out, lse, seqs, o);
  else
    diffattn::attention_varlen<T>(q, k, v, out, lse, seqs, o);

  Tensor<T, 3> dq({Tq, qh, dm.d}), dk({Tk, kh, dm.d}), dv_({Tk, dm.Hkv, dv});
  Tensor<T, 2> dlogit({Tq, H});
  T dlambda = 0;
  if (kind == Kind::v1)
    diffattn::diff_attention_v1_varlen_backward<T>(q, k, v, lambda, out, lse, dout, dq, dk, dv_,
                                                   dlambda, seqs, o);
  else if (kind == Kind::v2)
    diffattn::diff_attention_v2_varlen_backward<T>(q, k, v, logit, out, lse, dout, dq, dk, dv_,
                                                   dlogit, seqs, o);
  else
    diffattn::attention_varlen_backward<T>(q, k, v, out, lse, dout, dq, dk, dv_, seqs, o);

  double dlambda_sum = 0;
  for (index_t s = 0; s < S; ++s) {
    const index_t q0 = cq[s], n = cq[s + 1] - q0, k0 = ck[s], m = ck[s + 1] - k0;
    INFO("sequence " << s << ": n=" << n << " m=" << m);
    const auto qs = rows4<const T>(q.data(), q0, n, qh, dm.d);
    const auto ks = rows4<const T>(k.data(), k0, m, kh, dm.d);
    const auto vs = rows4<const T>(v.data(), k0, m, dm.Hkv, dv);
    const TensorView<const T, 3> ls(logit.data() + q0 * H, {1, n, H});
    const auto dos = rows4<const T>(dout.data(), q0, n, H, dv);
    Tensor<T, 4> o1({1, n, H, dv});
    Tensor<T, 3> l1({1, lh, n});
    if (kind == Kind::v1)
      diffattn::diff_attention_v1<T>(qs, ks, vs, lambda, o1, l1, o);
    else if (kind == Kind::v2)
      diffattn::diff_attention_v2<T>(qs, ks, vs, ls, o1, l1, o);
    else
      diffattn::attention<T>(qs, ks, vs, o1, l1, o);
    // Bitwise: the packed call runs the same tasks on the same data.
    const auto packed_out = rows4<const T>(out.data(), q0, n, H, dv);
    const auto packed_lse = lse_cols<const T>(lse.data(), Tq, q0, n, lh);
    bool same = true;
    for (index_t i = 0; i < n; ++i)
      for (index_t h = 0; h < H; ++h)
        for (index_t c = 0; c < dv; ++c) same = same && packed_out(0, i, h, c) == o1(0, i, h, c);
    for (index_t h = 0; h < lh; ++h)
      for (index_t i = 0; i < n; ++i) {
        const T a = packed_lse(0, h, i), b = l1(0, h, i);
        same = same && (a == b || (std::isnan(a) && std::isnan(b)));
      }
    CHECK(same);

    Tensor<T, 4> gq({1, n, qh, dm.d}), gk({1, m, kh, dm.d}), gv({1, m, dm.Hkv, dv});
    Tensor<T, 3> gl({1, n, H});
    T glam = 0;
    if (kind == Kind::v1)
      diffattn::diff_attention_v1_backward<T>(qs, ks, vs, lambda, o1, l1, dos, gq, gk, gv, glam, o);
    else if (kind == Kind::v2)
      diffattn::diff_attention_v2_backward<T>(qs, ks, vs, ls, o1, l1, dos, gq, gk, gv, gl, o);
    else
      diffattn::attention_backward<T>(qs, ks, vs, o1, l1, dos, gq, gk, gv, o);
    dlambda_sum += static_cast<double>(glam);
    auto same4 = [](const TensorView<const T, 4>& a, const Tensor<T, 4>& b) {
      for (index_t i = 0; i < b.shape(1); ++i)
        for (index_t h = 0; h < b.shape(2); ++h)
          for (index_t c = 0; c < b.shape(3); ++c)
            if (a(0, i, h, c) != b(0, i, h, c)) return false;
      return true;
    };
    CHECK(same4(rows4<const T>(dq.data(), q0, n, qh, dm.d), gq));
    CHECK(same4(rows4<const T>(dk.data(), k0, m, kh, dm.d), gk));
    CHECK(same4(rows4<const T>(dv_.data(), k0, m, dm.Hkv, dv), gv));
    if (kind == Kind::v2) {
      bool same_l = true;
      for (index_t i = 0; i < n; ++i)
        for (index_t h = 0; h < H; ++h) same_l = same_l && dlogit(q0 + i, h) == gl(0, i, h);
      CHECK(same_l);
    }
  }
  if (kind == Kind::v1)
    CHECK(static_cast<double>(dlambda) ==
          Approx(dlambda_sum).epsilon(std::is_same<T, float>::value ? 1e-5 : 1e-12).margin(1e-9));
}

/// Random lengths in [0, max_len], some of them 0 or 1.
std::vector<index_t> random_lengths(index_t count, index_t max_len, std::uint64_t seed) {
  diffattn::detail::Rng rng(seed);
  std::vector<index_t> l(static_cast<std::size_t>(count));
  for (auto& x : l) x = static_cast<index_t>(rng.uniform() * static_cast<double>(max_len + 1));
  if (count > 2) {
    l[1] = 0;
    l[2] = 1;
  }
  return l;
}

AttentionOptions opts(bool causal, index_t left = -1, index_t right = -1, int threads = 0) {
  AttentionOptions o;
  o.causal = causal;
  o.window_left = left;
  o.window_right = right;
  o.num_threads = threads;
  return o;
}

}  // namespace

TEST_CASE("packed self-attention equals per-sequence calls", "[packed]") {
  std::uint64_t seed = 8000;
  const auto seqs = PackedSequences::from_lengths(random_lengths(6, 130, 8001));
  for (Kind kind : {Kind::v1, Kind::v2, Kind::plain}) {
    for (const AttentionOptions& o : {opts(false), opts(true), opts(true, 13), opts(false, 4, 9)}) {
      check<float>(kind, {2, 1, 8}, seqs, o, seed += 10);
      check<double>(kind, {2, 2, 4}, seqs, o, seed += 10);
    }
  }
}

TEST_CASE("packed batches with other key lengths (cross attention, decoding)", "[packed]") {
  std::uint64_t seed = 8500;
  // Each sequence decodes a few tokens against a longer cache.
  const auto seqs = PackedSequences::from_lengths({1, 3, 0, 70, 2}, {40, 9, 5, 71, 2});
  for (Kind kind : {Kind::v1, Kind::v2, Kind::plain}) {
    check<float>(kind, {4, 2, 8}, seqs, opts(true), seed += 10);
    check<double>(kind, {2, 1, 8}, seqs, opts(false), seed += 10);
    check<float>(kind, {2, 1, 16}, seqs, opts(true, 6), seed += 10);
  }
}

TEST_CASE("packed results do not depend on the thread count", "[packed][threads]") {
  const auto seqs = PackedSequences::from_lengths({61, 7, 130, 1});
  const index_t T = 199;
  const auto q = random_tensor<float, 3>({T, 4, 8}, 8601);
  const auto k = random_tensor<float, 3>({T, 4, 8}, 8602);
  const auto v = random_tensor<float, 3>({T, 2, 16}, 8603);
  Tensor<float, 3> a({T, 2, 16}), b({T, 2, 16});
  Tensor<float, 2> la({4, T}), lb({4, T});
  diffattn::diff_attention_v1_varlen<float>(q, k, v, 0.5f, a, la, seqs, opts(true, -1, -1, 1));
  diffattn::diff_attention_v1_varlen<float>(q, k, v, 0.5f, b, lb, seqs, opts(true, -1, -1, 2));
  CHECK(test::bitwise_equal(a, b));
  CHECK(test::bitwise_equal(la, lb));
}

TEST_CASE("packed offsets are checked", "[packed][errors]") {
  const auto q = random_tensor<float, 3>({10, 4, 8}, 8701);
  const auto k = random_tensor<float, 3>({10, 4, 8}, 8702);
  const auto v = random_tensor<float, 3>({10, 2, 16}, 8703);
  Tensor<float, 3> out({10, 2, 16});
  auto call = [&](const PackedSequences& s) {
    diffattn::diff_attention_v1_varlen<float>(q, k, v, 0.5f, out, {}, s);
  };
  PackedSequences s;
  test::require_error([&] { call(s); }, {"diff_attention_v1_varlen", "cu_seqlens_q is empty"});
  s.cu_seqlens_q = {0, 6, 4, 10};
  test::require_error(
      [&] { call(s); },
      {"diff_attention_v1_varlen", "cu_seqlens_q[2] = 4 < cu_seqlens_q[1] = 6", "non-decreasing"});
  s.cu_seqlens_q = {0, 4, 9};
  test::require_error([&] { call(s); },
                      {"diff_attention_v1_varlen", "cu_seqlens_q[2] = 9", "10 tokens of q"});
  s.cu_seqlens_q = {1, 4, 10};
  test::require_error([&] { call(s); }, {"cu_seqlens_q[0] must be 0, got 1"});
  s.cu_seqlens_q = {0, 4, 10};
  s.cu_seqlens_k = {0, 10};
  test::require_error([&] { call(s); }, {"cu_seqlens_k has 2 offsets", "cu_seqlens_q 3"});
  s.cu_seqlens_k = {0, 3, 11};
  test::require_error([&] { call(s); }, {"cu_seqlens_k[2] = 11", "10 tokens of k and v"});
  test::require_error(
      [&] {
        PackedSequences::from_lengths({3, -1});
      },
      {"from_lengths", "q_lengths[1] = -1"});
  // Shape errors name the varlen entry point.
  Tensor<float, 3> out_bad({10, 2, 8});
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_varlen<float>(q, k, v, 0.5f, out_bad, {},
                                                  PackedSequences::from_lengths({10}));
      },
      {"diff_attention_v1_varlen", "out has shape (1, 10, 2, 8)"});
  // Backward needs lse.
  Tensor<float, 3> dq({10, 4, 8}), dk({10, 4, 8}), dv({10, 2, 16});
  float dl = 0;
  test::require_error(
      [&] {
        diffattn::diff_attention_v1_varlen_backward<float>(q, k, v, 0.5f, out, {}, out, dq, dk, dv,
                                                           dl, PackedSequences::from_lengths({10}));
      },
      {"diff_attention_v1_varlen_backward", "lse is required"});
}
