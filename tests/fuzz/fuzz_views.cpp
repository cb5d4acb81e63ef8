// libFuzzer target: view construction and the kernels' boundary checks on
// fuzzed extents, strides, aliasing and scalars. Every call must either run or
// throw diffattn::error; the sanitizers check that nothing undefined runs.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include <diffattn/attention.hpp>
#include <diffattn/packed.hpp>
#include <diffattn/attention_backward.hpp>

#include "fuzz_input.hpp"

namespace {

using diffattn::index_t;
using diffattn::TensorView;
using fuzz::Input;

/// A small tensor with fuzzed layout over its own buffer (large enough for its
/// strides: the views never promise more memory than they have).
struct Buffer {
  std::vector<float> mem;
  std::array<index_t, 4> shape{}, strides{};

  Buffer(Input& in, std::array<index_t, 4> s, std::uint8_t mode) : shape(s) {
    // mode bit 0: heads outer ((B, H, S, D) memory); bit 1: gaps between rows;
    // bit 2: a non-contiguous head dimension.
    const index_t last = (mode & 4) ? 2 : 1;
    const index_t gap = (mode & 2) ? in.u8() % 3 : 0;
    const index_t row = s[3] * last + gap;
    if (mode & 1) {
      strides = {s[1] * s[2] * row, row, s[1] * row, last};
    } else {
      strides = {s[1] * s[2] * row, s[2] * row, row, last};
    }
    index_t span = 1;
    for (int r = 0; r < 4; ++r) span += s[r] > 0 ? (s[r] - 1) * strides[r] : 0;
    mem.assign(static_cast<std::size_t>(std::max<index_t>(span, 1)), 0.0f);
    for (std::size_t i = 0; i < mem.size(); ++i)
      mem[i] = static_cast<float>(static_cast<int>(in.u8()) - 128) / 32.0f;
  }
  TensorView<float, 4> view() { return TensorView<float, 4>(mem.data(), shape, strides); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  // Raw views: any 64-bit shape and strides must be accepted or refused cleanly.
  {
    static float one[1];
    const std::array<index_t, 3> shape = {in.i64(), in.i64(), in.i64()};
    const std::array<index_t, 3> strides = {in.i64(), in.i64(), in.i64()};
    try {
      TensorView<float, 3> v(one, shape, strides);
      (void)v.size();
      (void)v.span_end();
    } catch (const diffattn::error&) {
    }
    try {
      TensorView<float, 3> v(one, shape);
      (void)v.is_contiguous();
    } catch (const diffattn::error&) {
    }
  }
  // A kernel call with small fuzzed extents.
  const int kind = in.u8() % 3;
  const index_t B = in.u8() % 3, N = in.u8() % 9, M = in.u8() % 9;
  const index_t qh = in.u8() % 7, kh = in.u8() % 7, d = in.u8() % 6, vw = in.u8() % 11;
  const index_t oh = in.u8() % 5, ow = in.u8() % 11;
  const std::uint8_t mode = in.u8();
  const bool causal = mode & 8, alias = (mode & 0xf0) == 0xa0, backward = mode & 16;
  const float lambda = (mode & 32) ? in.f32() : 0.5f;
  diffattn::AttentionOptions opt;
  opt.causal = causal;
  opt.num_threads = 1 + (mode & 64 ? 1 : 0);
  if (mode & 128) opt.scale = static_cast<double>(in.f32());

  Buffer q(in, {B, N, qh, d}, in.u8()), k(in, {B, M, kh, d}, in.u8()),
      v(in, {B, M, kh, vw}, in.u8());
  Buffer out(in, {B, N, oh, ow}, in.u8());
  diffattn::Tensor<float, 3> lse({B, std::max<index_t>(qh, 0), N});
  diffattn::Tensor<float, 3> logit({B, N, oh});
  // Windows: 0 means no limit, 255 an invalid -2, else 0 .. 9.
  auto window = [&](std::uint8_t b) -> index_t { return b == 255 ? -2 : b % 11 - 1; };
  opt.window_left = window(in.u8());
  opt.window_right = window(in.u8());
  TensorView<float, 4> out_view =
      alias ? TensorView<float, 4>(q.mem.data(), out.shape, out.strides) : out.view();
  if (alias && q.mem.size() < out.mem.size()) out_view = out.view();
  try {
    if (kind == 0) {
      diffattn::diff_attention_v1<float>(q.view(), k.view(), v.view(), lambda, out_view, lse, opt);
      if (backward) {
        Buffer dq(in, q.shape, 0), dk(in, k.shape, 0), dv(in, v.shape, 0);
        float dl = 0;
        diffattn::diff_attention_v1_backward<float>(q.view(), k.view(), v.view(), lambda, out_view,
                                                    lse, out.view(), dq.view(), dk.view(),
                                                    dv.view(), dl, opt);
      }
    } else if (kind == 1) {
      diffattn::diff_attention_v2<float>(q.view(), k.view(), v.view(), logit, out_view, lse, opt);
    } else {
      diffattn::attention<float>(q.view(), k.view(), v.view(), out_view, lse, opt);
      if (backward) {
        Buffer dq(in, q.shape, 0), dk(in, k.shape, 0), dv(in, v.shape, 0);
        diffattn::attention_backward<float>(q.view(), k.view(), v.view(), out_view, lse, out.view(),
                                            dq.view(), dk.view(), dv.view(), opt);
      }
    }
  } catch (const diffattn::error&) {
  }
  // A packed batch over q's and k's first batch entry with fuzzed offsets
  // (any order, any end): accepted and computed, or refused cleanly.
  if (B > 0 && (mode & 4)) {
    diffattn::PackedSequences seqs;
    const int S = in.u8() % 4;
    for (int i = 0; i <= S; ++i) seqs.cu_seqlens_q.push_back(static_cast<index_t>(in.u8() % 11) - 1);
    if (in.u8() & 1)
      for (int i = 0; i <= S; ++i) seqs.cu_seqlens_k.push_back(static_cast<index_t>(in.u8() % 11) - 1);
    auto first = [](Buffer& b) {
      return TensorView<const float, 3>(b.mem.data(), {b.shape[1], b.shape[2], b.shape[3]},
                                        {b.strides[1], b.strides[2], b.strides[3]});
    };
    diffattn::Tensor<float, 3> pout({N, std::max<index_t>(oh, 0), std::max<index_t>(ow, 0)});
    try {
      diffattn::attention_varlen<float>(first(q), first(k), first(v), pout, {}, seqs, opt);
    } catch (const diffattn::error&) {
    }
  }
  return 0;
}
