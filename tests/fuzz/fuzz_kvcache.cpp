// libFuzzer target: the kernels over KV caches (*_kvcache) on fuzzed batches
// of caches (per-sequence lengths, paged pools and block tables, split_keys,
// windows, head counts that may not fit), and a layer cache's row-level calls
// (KVCache: reserve, key_rows, value_rows, keys_with, commit, clear) in fuzzed
// order. Every call must run or throw diffattn::error; the sanitizers check
// that nothing undefined runs. A kernel call that runs is checked three ways:
// its outputs are finite (the inputs are), the same call without splitting
// (split_keys past every length) agrees to rounding, and a contiguous call
// agrees with the float64 reference on each sequence's keys, a paged one with
// the same rows gathered into contiguous caches, which agree with the
// reference in turn. A disagreement traps. Head
// widths are 0-4 or, now and then, 16-128, where the decoding step takes its
// vector paths (this target is built for the machine's instruction set).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include <diffattn/kv_cache.hpp>
#include <diffattn/kvcache_attention.hpp>
#include <diffattn/reference.hpp>

#include "fuzz_input.hpp"

namespace {

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;

using fuzz::Input;

/// A small value in [-4, 4).
float value(Input& in) { return static_cast<float>(static_cast<int>(in.u8()) - 128) / 32.0f; }

/// A tensor of values from the input, one byte each; or, with `wide` (head
/// widths of 16 and more), of the same small values drawn by a generator
/// seeded from one byte, so that a wide problem does not take thousands of
/// the input's bytes.
template <std::size_t R>
Tensor<float, R> filled(Input& in, std::array<index_t, R> shape, bool wide = false) {
  for (auto& s : shape) s = std::max<index_t>(s, 0);
  Tensor<float, R> t(shape);
  if (!wide) {
    for (index_t i = 0; i < t.size(); ++i) t.data()[i] = value(in);
    return t;
  }
  std::uint32_t state = 0x9e3779b9u * (1u + in.u8());
  for (index_t i = 0; i < t.size(); ++i) {
    state = state * 1664525u + 1013904223u;
    t.data()[i] = static_cast<float>(static_cast<int>(state >> 24) - 128) / 32.0f;
  }
  return t;
}

enum Kind { kV1, kV2, kPlain };

/// One fuzzed problem: the views of a kernel call and what it needs besides.
struct Problem {
  Kind kind = kPlain;
  Tensor<float, 4> q, k, v, out;
  Tensor<float, 3> logit, lse;
  float lambda = 0.5f;
  Tensor<index_t, 1> lens;
  Tensor<index_t, 2> table;
  diffattn::KVCacheBatch cache;
  diffattn::AttentionOptions opt;
};

/// Runs the problem's kernel on caches k, v with `split` keys per chunk.
void run(Problem& p, const Tensor<float, 4>& k, const Tensor<float, 4>& v, bool paged,
         index_t split, Tensor<float, 4>& out, Tensor<float, 3>& lse) {
  diffattn::KVCacheBatch c = p.cache;
  if (!paged) c.block_table = {};
  c.split_keys = split;
  switch (p.kind) {
    case kV1:
      diffattn::diff_attention_v1_kvcache<float>(p.q, k, v, p.lambda, out, lse, c, p.opt);
      break;
    case kV2:
      diffattn::diff_attention_v2_kvcache<float>(p.q, k, v, p.logit, out, lse, c, p.opt);
      break;
    default:
      diffattn::attention_kvcache<float>(p.q, k, v, out, lse, c, p.opt);
  }
}

/// |a - b| <= 1e-4 (1 + |b|) everywhere, lse's -inf included.
template <std::size_t R>
bool agree(const Tensor<float, R>& a, const Tensor<float, R>& b) {
  if (a.shape() != b.shape()) return false;
  for (index_t i = 0; i < a.size(); ++i) {
    const float x = a.data()[i], y = b.data()[i];
    if (x == y) continue;
    if (!(std::fabs(x - y) <= 1e-4f * (1.0f + std::fabs(y)))) return false;
  }
  return true;
}

void check(bool ok) {
  if (!ok) __builtin_trap();
}

/// Sequence b of a call that ran on contiguous caches k, v (the problem's, or a
/// paged problem's rows gathered) with outputs out, lse, against the float64
/// reference kernel on its keys [0, lens(b)) (the kvcache kernels' contract). The
/// values are multiples of 1/32 in [-4, 4), so every dot product is exact in
/// float; the scale's rounding moves a score (at most 4 * 4 * 128 / sqrt(128))
/// by about 1e-5, each weight by as much relative, and an output by about
/// 1e-5 (|o_1| + |lambda| |o_2|) <= 2e-4: the bound 1e-3 (1 + |ref|) holds
/// with room, cancellation between the maps included.
void check_reference(const Problem& p, const Tensor<float, 4>& pk, const Tensor<float, 4>& pv,
                     const Tensor<float, 4>& pout, const Tensor<float, 3>& plse, index_t b) {
  const index_t m = p.lens(b);
  if (m <= 0 || pout.size() == 0) return;  // an empty cache: zero rows, checked above as finite
  const index_t n = p.q.shape(1), qh = p.q.shape(2), d = p.q.shape(3);
  const index_t kh = pk.shape(2), hv = pv.shape(2), dv = pv.shape(3), H = pout.shape(2);
  Tensor<double, 4> q({1, n, qh, d}), k({1, m, kh, d}), v({1, m, hv, dv}), out({1, n, H, dv});
  Tensor<double, 3> lse({1, qh, n}), logit({1, n, H});
  for (index_t i = 0; i < q.size(); ++i) q.data()[i] = p.q.data()[b * q.size() + i];
  for (index_t i = 0; i < k.size(); ++i) k.data()[i] = pk.data()[b * pk.view().stride(0) + i];
  for (index_t i = 0; i < v.size(); ++i) v.data()[i] = pv.data()[b * pv.view().stride(0) + i];
  for (index_t i = 0; i < logit.size(); ++i) logit.data()[i] = p.logit.data()[b * logit.size() + i];
  switch (p.kind) {
    case kV1:
      diffattn::reference::diff_attention_v1<double>(q, k, v, p.lambda, out, lse, p.opt);
      break;
    case kV2:
      diffattn::reference::diff_attention_v2<double>(q, k, v, logit, out, lse, p.opt);
      break;
    default:
      diffattn::reference::attention<double>(q, k, v, out, lse, p.opt);
  }
  for (index_t i = 0; i < out.size(); ++i) {
    const double want = out.data()[i], got = pout.data()[b * out.size() + i];
    check(std::fabs(got - want) <= 1e-3 * (1 + std::fabs(want)));
  }
  for (index_t h = 0; plse.size() > 0 && h < qh; ++h)
    for (index_t i = 0; i < n; ++i) {
      const double want = lse(0, h, i), got = plse(b, h, i);
      check(want == got || std::fabs(got - want) <= 1e-3 * (1 + std::fabs(want)));
    }
}

void fuzz_kernel(Input& in) {
  Problem p;
  p.kind = static_cast<Kind>(in.u8() % 3);
  const index_t B = in.u8() % 4, n = in.u8() % 8;
  // Widths 0-4, and now and then the usual ones, whose decoding steps take the
  // vector paths of the build's instruction set (with AVX-512, several kv
  // heads of a row read together).
  const index_t H = in.u8() % 4, Hkv = in.u8() % 4;
  const std::uint8_t width = in.u8();
  const index_t d = width >= 224 ? index_t(16) << (width % 4) : width % 5;
  const bool wide = d >= 16;
  const std::uint8_t mode = in.u8();
  const bool paged = mode & 1, with_lse = mode & 2;
  p.opt.causal = mode & 4;
  p.opt.num_threads = 1 + ((mode >> 3) & 1);
  // One extent off by one now and then, so that the checks get their turn.
  const index_t skew = (mode & 0x30) == 0x30 ? 1 : 0;
  auto window = [&](std::uint8_t b) -> index_t { return b == 255 ? -2 : b % 9 - 1; };
  p.opt.window_left = window(in.u8());
  p.opt.window_right = window(in.u8());
  const index_t block_size = 1 + in.u8() % 4, num_blocks = in.u8() % 7;
  const index_t blocks_per_seq = in.u8() % 4;
  const index_t capacity = paged ? blocks_per_seq * block_size : in.u8() % 9;
  const index_t split = static_cast<index_t>(in.u8() % 6) - 1;  // -1 refused, 0 the default

  // Heads and widths by kind: V1 2H query and 2Hkv key heads of d, Hkv value
  // heads of 2d; V2 2H query heads and Hkv of d; plain H query heads.
  const index_t qh = p.kind == kPlain ? H : 2 * H, kh = p.kind == kV1 ? 2 * Hkv : Hkv;
  const index_t dv = p.kind == kV1 ? 2 * d : d;
  const index_t rows = paged ? num_blocks : B, cap = paged ? block_size : capacity;
  p.q = filled<4>(in, {B, n, qh, d + skew}, wide);
  p.k = filled<4>(in, {rows, cap, kh, d}, wide);
  p.v = filled<4>(in, {rows, cap, Hkv, dv}, wide);
  p.out = Tensor<float, 4>({B, n, H, dv});
  p.logit = filled<3>(in, {B, n, H});
  if (with_lse) p.lse = Tensor<float, 3>({B, qh, n});
  p.lambda = static_cast<float>(static_cast<int>(in.u8()) - 128) / 64.0f;
  p.lens = Tensor<index_t, 1>({B});
  for (index_t b = 0; b < B; ++b) p.lens(b) = static_cast<index_t>(in.u8() % (capacity + 3)) - 1;
  p.table = Tensor<index_t, 2>({paged ? B : 0, blocks_per_seq});
  for (index_t i = 0; i < p.table.size(); ++i)
    p.table.data()[i] = static_cast<index_t>(in.u8() % (num_blocks + 2)) - 1;
  p.cache.cache_seqlens = p.lens;
  p.cache.block_table = p.table;

  try {
    run(p, p.k, p.v, paged, split, p.out, p.lse);
  } catch (const diffattn::error&) {
    return;
  }
  // It ran: finite outputs, lse finite or -inf (a row that sees no key).
  for (index_t i = 0; i < p.out.size(); ++i) check(std::isfinite(p.out.data()[i]));
  for (index_t i = 0; i < p.lse.size(); ++i)
    check(std::isfinite(p.lse.data()[i]) || p.lse.data()[i] == -INFINITY);
  // Without splitting: the same to rounding.
  const index_t whole = std::max<index_t>(capacity, 1);
  Tensor<float, 4> out1(p.out.shape());
  Tensor<float, 3> lse1(p.lse.shape());
  run(p, p.k, p.v, paged, whole, out1, lse1);
  check(agree(out1, p.out) && agree(lse1, p.lse));
  if (!paged) {
    for (index_t b = 0; b < B; ++b) check_reference(p, p.k, p.v, p.out, p.lse, b);
    return;
  }
  // Paged: the rows each sequence reads, gathered into contiguous caches.
  Tensor<float, 4> kc({B, capacity, kh, d}), vc({B, capacity, Hkv, dv});
  for (index_t b = 0; b < B; ++b)
    for (index_t j = 0; j < p.lens(b); ++j) {
      const index_t blk = p.table(b, j / block_size), r = j % block_size;
      for (index_t h = 0; h < kh; ++h)
        for (index_t c = 0; c < d; ++c) kc(b, j, h, c) = p.k(blk, r, h, c);
      for (index_t h = 0; h < Hkv; ++h)
        for (index_t c = 0; c < dv; ++c) vc(b, j, h, c) = p.v(blk, r, h, c);
    }
  Tensor<float, 4> out2(p.out.shape());
  Tensor<float, 3> lse2(p.lse.shape());
  run(p, kc, vc, false, split, out2, lse2);
  check(agree(out2, p.out) && agree(lse2, p.lse));
  for (index_t b = 0; b < B; ++b) check_reference(p, kc, vc, out2, lse2, b);
}

/// A layer cache driven by fuzzed row-level calls; a refused call changes
/// nothing, and the counts stay within the storage.
void fuzz_cache(Input& in) {
  const index_t batch = in.u8() % 3, capacity = in.u8() % 9;
  const index_t keep = static_cast<index_t>(in.u8() % 5) - 1;
  diffattn::KVCache<float> cache(batch, capacity, 1 + in.u8() % 2, 1 + in.u8() % 3, 1, 2, keep);
  const index_t storage = keep < 0 ? capacity : std::min(capacity, 2 * (keep + 1));
  for (int op = 0; op < 24 && in.n; ++op) {
    const std::uint8_t code = in.u8();
    const index_t a = static_cast<index_t>(in.u8() % 12) - 2;
    const index_t b = static_cast<index_t>(in.u8() % 12) - 2;
    const index_t size = cache.size(), stored = cache.stored();
    bool refused = false;
    try {
      switch (code % 6) {
        case 0:
          cache.reserve(a);
          break;
        case 1: {  // every element written, for the sanitizer
          TensorView<float, 4> rows = cache.key_rows(a, b);
          for (index_t s = 0; s < rows.shape(0); ++s)
            for (index_t r = 0; r < rows.shape(1); ++r)
              for (index_t h = 0; h < rows.shape(2); ++h)
                for (index_t c = 0; c < rows.shape(3); ++c)
                  rows(s, r, h, c) = static_cast<float>(r);
          break;
        }
        case 2: {
          TensorView<float, 4> rows = cache.value_rows(a, b);
          if (rows.size() > 0) rows(rows.shape(0) - 1, rows.shape(1) - 1, 0, 1) = 1.0f;
          break;
        }
        case 3: {
          const TensorView<const float, 4> keys = cache.keys_with(a);
          check(keys.shape(1) == stored + a);
          if (keys.size() > 0) (void)keys(keys.shape(0) - 1, keys.shape(1) - 1, 0, 0);
          break;
        }
        case 4:
          cache.commit(a);
          break;
        default:
          cache.clear();
      }
    } catch (const diffattn::error&) {
      refused = true;
    }
    if (refused) check(cache.size() == size && cache.stored() == stored);
    check(cache.size() <= capacity && cache.stored() <= storage);
    check(cache.keys().shape(1) == cache.stored());
    check(keep < 0 ? cache.stored() == cache.size() : cache.stored() <= keep);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  if (in.u8() & 1)
    fuzz_cache(in);
  else
    fuzz_kernel(in);
  return 0;
}
