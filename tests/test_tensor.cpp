#include <cstdint>
#include <limits>
#include <type_traits>

#include <catch2/catch.hpp>
#include <diffattn/tensor.hpp>

#include "support.hpp"

using diffattn::index_t;
using diffattn::Tensor;
using diffattn::TensorView;

TEST_CASE("TensorView: row-major strides and indexing", "[tensor]") {
  float buf[2 * 3 * 4];
  for (int i = 0; i < 24; ++i) buf[i] = static_cast<float>(i);
  TensorView<float, 3> v(buf, {2, 3, 4});
  CHECK(v.strides() == std::array<index_t, 3>{12, 4, 1});
  CHECK(v.shape(1) == 3);
  CHECK(v.extent(2) == 4);
  CHECK(v.size() == 24);
  CHECK(v.is_contiguous());
  CHECK(v(1, 2, 3) == 23.0f);
  CHECK(v(0, 1, 2) == 6.0f);
  v(1, 0, 0) = -1.0f;
  CHECK(buf[12] == -1.0f);
  CHECK(v.span_end() - v.span_begin() == 24 * sizeof(float));
}

TEST_CASE("TensorView: strided (B, H, N, D) memory seen as (B, N, H, D)", "[tensor]") {
  const index_t B = 2, H = 3, N = 5, D = 4;
  std::vector<double> mem(B * H * N * D);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<double>(i);
  TensorView<const double, 4> bnhd(mem.data(), {B, N, H, D}, {H * N * D, D, N * D, 1});
  CHECK_FALSE(bnhd.is_contiguous());
  for (index_t b = 0; b < B; ++b)
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < D; ++d)
          REQUIRE(bnhd(b, n, h, d) == mem[((b * H + h) * N + n) * D + d]);
}

TEST_CASE("TensorView: converts to a view of const", "[tensor]") {
  int x[6] = {0, 1, 2, 3, 4, 5};
  TensorView<int, 2> v(x, {2, 3});
  TensorView<const int, 2> c = v;
  CHECK(c.data() == x);
  CHECK(c(1, 2) == 5);
  STATIC_REQUIRE_FALSE(std::is_convertible<TensorView<const int, 2>, TensorView<int, 2>>::value);
}

TEST_CASE("TensorView: bad shapes and strides throw diffattn::error", "[tensor]") {
  float f = 0;
  test::require_error(
      [&] {
        TensorView<float, 2>(&f, {2, -1});
      },
      {"TensorView", "negative extent", "(2, -1)"});
  test::require_error(
      [&] {
        TensorView<float, 2>(&f, {2, 2}, {-2, 1});
      },
      {"TensorView", "negative stride", "(-2, 1)", "(2, 2)"});
  const index_t big = index_t(1) << 40;
  test::require_error([&] { TensorView<float, 3>(&f, {big, big, 2}); }, {"TensorView", "overflow"});
  test::require_error(
      [&] {
        TensorView<float, 2>(&f, {2, 2}, {std::numeric_limits<index_t>::max(), 1});
      },
      {"TensorView", "overflow"});
  test::require_error([&] { TensorView<float, 1>(nullptr, {3}); },
                      {"TensorView", "null data", "(3)"});
  // Zero extents are allowed, with or without data.
  TensorView<float, 2> empty(nullptr, {0, 5});
  CHECK(empty.empty());
  CHECK(empty.span_begin() == empty.span_end());
}

TEST_CASE("Tensor: zero-initialised, aligned, deep copies", "[tensor]") {
  Tensor<float, 3> t({3, 5, 7});
  REQUIRE(t.size() == 105);
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  for (index_t i = 0; i < t.size(); ++i) REQUIRE(t.data()[i] == 0.0f);
  t(2, 4, 6) = 3.5f;
  CHECK(t.data()[104] == 3.5f);
  Tensor<float, 3> c = t;
  c(2, 4, 6) = 1.0f;
  CHECK(t(2, 4, 6) == 3.5f);
  Tensor<float, 3> m = std::move(c);
  CHECK(m(2, 4, 6) == 1.0f);
  CHECK(c.empty());
  TensorView<const float, 3> v = t.view();
  CHECK(v(2, 4, 6) == 3.5f);
  CHECK(v.is_contiguous());
  t.fill(2.0f);
  CHECK(t(0, 0, 0) == 2.0f);
  test::require_error([] { Tensor<double, 2>({-1, 3}); }, {"Tensor", "negative extent", "(-1, 3)"});
  const index_t big = std::numeric_limits<index_t>::max() / 4;
  test::require_error([&] { Tensor<double, 1>({big}); }, {"Tensor", "too large"});
  Tensor<double, 2> empty({0, 3});
  CHECK(empty.empty());
  CHECK(empty.view().size() == 0);
}

TEST_CASE("Tensor: buffers of 1 MiB and more start on a page, through copies and moves",
          "[tensor]") {
  const auto offset = [](const void* p, std::size_t a) {
    return reinterpret_cast<std::uintptr_t>(p) % a;
  };
  // Just below the threshold: 64-byte aligned; at and above it: page aligned,
  // several times over, so that a 64-byte aligned allocation cannot pass by chance.
  for (int rep = 0; rep < 8; ++rep) {
    Tensor<float, 2> small({1023, 256});  // 1 MiB - 1 KiB
    CHECK(offset(small.data(), 64) == 0);
    Tensor<float, 2> big({1024, 256 + rep});  // 1 MiB and more
    REQUIRE(offset(big.data(), 4096) == 0);
    big(1023, 255) = 1.5f;
    Tensor<float, 2> copy = big;
    CHECK(offset(copy.data(), 4096) == 0);
    CHECK(copy(1023, 255) == 1.5f);
    Tensor<float, 2> moved = std::move(copy);
    moved = Tensor<float, 2>({2048, 512});  // frees the page-aligned buffer it held
    CHECK(offset(moved.data(), 4096) == 0);
    moved = Tensor<float, 2>({2, 2});  // and a small one after a big one
    CHECK(offset(moved.data(), 64) == 0);
  }
  CHECK(Tensor<float, 1>::page_aligned_bytes == std::size_t(1) << 20);
  {
    // 2 MiB or more: on a huge page (transparent huge pages where Linux
    // grants them), zero-filled like any other.
    Tensor<float, 1> big({(index_t(1) << 19) + 3});
    CHECK(offset(big.data(), std::size_t(2) << 20) == 0);
    CHECK(big(0) == 0.0f);
    CHECK(big((index_t(1) << 19) + 2) == 0.0f);
    Tensor<float, 1> copy = big;
    CHECK(offset(copy.data(), std::size_t(2) << 20) == 0);
    CHECK(copy.size() == big.size());
    Tensor<float, 1> just_below({(index_t(1) << 19) - 1});
    CHECK(offset(just_below.data(), 4096) == 0);
  }
}
