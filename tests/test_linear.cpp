// The projections' products (detail/layers/linear.hpp) against float64 loops;
// built again with DIFFATTN_DISPATCH (tests/dispatch), once per variant.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/kernel/bf16_dot.hpp>
#include <diffattn/detail/layers/linear.hpp>
#include <diffattn/detail/core/random.hpp>
#include <diffattn/types.hpp>

using diffattn::index_t;

namespace {
std::vector<double> random_vec(index_t n, std::uint64_t seed) {
  diffattn::detail::Rng rng(seed);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = rng.normal();
  return v;
}
template <class T>
std::vector<T> as(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}
// Whether linear runs bfloat16 x and W on bf16 dot products: where this unit
// compiles it (its instruction set), or (DIFFATTN_DISPATCH, tests/dispatch)
// where diffattn::dispatch's variant for bfloat16 products does.
bool bf16_dots() {
#ifdef DIFFATTN_DISPATCH
  return std::strcmp(diffattn::detail::dispatch_bf16_isa(), "avx512bf16") == 0;
#else
  return diffattn::detail::kHasBf16Dot;
#endif
}
double max_rel(const std::vector<double>& ref, const std::vector<float>& got) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(ref[i] - got[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return num / den;
}
}  // namespace

TEST_CASE("linear and linear_backward match float64 loops", "[linear]") {
  struct Shape {
    index_t rows, in, out;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{7, 5, 3}, Shape{61, 300, 17}, Shape{130, 64, 96},
                        Shape{5, 513, 40}}) {
    INFO("rows " << s.rows << " in " << s.in << " out " << s.out);
    const auto x = random_vec(s.rows * s.in, 1), w = random_vec(s.out * s.in, 2);
    const auto dy = random_vec(s.rows * s.out, 3), dw0 = random_vec(s.out * s.in, 4);
    const auto dx0 = random_vec(s.rows * s.in, 5);
    std::vector<double> y(s.rows * s.out, 0.0), dw(dw0), dx(s.rows * s.in, 0.0);
    for (index_t r = 0; r < s.rows; ++r)
      for (index_t o = 0; o < s.out; ++o)
        for (index_t i = 0; i < s.in; ++i) {
          y[r * s.out + o] += x[r * s.in + i] * w[o * s.in + i];
          dw[o * s.in + i] += dy[r * s.out + o] * x[r * s.in + i];
          dx[r * s.in + i] += dy[r * s.out + o] * w[o * s.in + i];
        }
    // double: tight; float: a few ulps of the depth's sum.
    std::vector<double> yd(y.size()), dwd(dw0), dxd(dx.size());
    diffattn::detail::linear<double>(x.data(), s.rows, s.in, w.data(), s.out, yd.data());
    diffattn::detail::linear_backward<double>(x.data(), s.rows, s.in, w.data(), s.out, dy.data(),
                                              dwd.data(), dxd.data(), false);
    for (std::size_t i = 0; i < y.size(); ++i) REQUIRE(yd[i] == Approx(y[i]).margin(1e-12));
    for (std::size_t i = 0; i < dw.size(); ++i) REQUIRE(dwd[i] == Approx(dw[i]).margin(1e-12));
    for (std::size_t i = 0; i < dx.size(); ++i) REQUIRE(dxd[i] == Approx(dx[i]).margin(1e-12));
    // Accumulating dx.
    std::vector<double> dxa(dx0);
    std::vector<double> dw_scratch(dw0);
    diffattn::detail::linear_backward<double>(x.data(), s.rows, s.in, w.data(), s.out, dy.data(),
                                              dw_scratch.data(), dxa.data(), true);
    for (std::size_t i = 0; i < dx.size(); ++i)
      REQUIRE(dxa[i] == Approx(dx0[i] + dx[i]).margin(1e-12));

    const auto xf = as<float>(x), wf = as<float>(w);
    std::vector<float> yf(y.size()), y2(y.size());
    diffattn::detail::linear<float>(xf.data(), s.rows, s.in, wf.data(), s.out, yf.data(), 1);
    diffattn::detail::linear<float>(xf.data(), s.rows, s.in, wf.data(), s.out, y2.data(), 2);
    CHECK(max_rel(y, yf) < 1e-5);
    CHECK(yf == y2);  // bitwise, any thread count
  }
}

TEST_CASE("16-bit x, W and y: the float product of the widened values, rounded once",
          "[linear][half]") {
  using diffattn::bfloat16;
  using diffattn::half;
  // Few rows (dot products); 100 rows (packed panels); 96 rows with in = 8192,
  // where a 16-bit W is packed in slabs of 128 outputs (two here, the second
  // of 8): each output sums over the depth as in one slab.
  REQUIRE(diffattn::detail::linear_slab_outputs<float>(8192) == 128);
  struct Shape {
    index_t rows, in, out;
  };
  for (const Shape s : {Shape{7, 300, 70}, Shape{5, 33, 19}, Shape{100, 64, 50}, Shape{101, 77, 45},
                        Shape{96, 8192, 136}}) {
    INFO("rows " << s.rows << " in " << s.in << " out " << s.out);
    const bool small = s.in < 1000;
    const auto xd = random_vec(s.rows * s.in, 6), wd = random_vec(s.out * s.in, 7);
    const std::vector<bfloat16> xb(xd.begin(), xd.end()), wb(wd.begin(), wd.end());
    // the float product on the widened values
    const std::vector<float> xf(xb.begin(), xb.end()), wbf(wb.begin(), wb.end());
    std::vector<float> ref(static_cast<std::size_t>(s.rows * s.out)), yf(ref.size());
    diffattn::detail::linear(xf.data(), s.rows, s.in, wbf.data(), s.out, ref.data(), 2);
    if (bf16_dots()) {
      // bfloat16 x and W under AVX512-BF16: the products run on bf16 dot
      // products, a float sum of the same exact products in another order:
      // within gamma_in sum_t |x_t w_t| of the exact sum, the same bits for
      // any thread count, and a bfloat16 y is that float y rounded once.
      const double u = std::ldexp(1.0, -24), gamma = s.in * u / (1 - s.in * u);
      std::vector<float> y1(ref.size()), y2(ref.size());
      diffattn::detail::linear(xb.data(), s.rows, s.in, wb.data(), s.out, y1.data(), 1);
      diffattn::detail::linear(xb.data(), s.rows, s.in, wb.data(), s.out, y2.data(), 2);
      CHECK(y1 == y2);
      bool within = true;
      for (index_t r = 0; r < s.rows; ++r)
        for (index_t o = 0; o < s.out; ++o) {
          double exact = 0, mag = 0;
          for (index_t t = 0; t < s.in; ++t) {
            const double p = double(xf[r * s.in + t]) * double(wbf[o * s.in + t]);
            exact += p;
            mag += std::abs(p);
          }
          within = within && std::abs(y1[r * s.out + o] - exact) <= gamma * mag + 1e-30;
        }
      CHECK(within);
      ref = y1;
    }
    // 16-bit y: that product rounded once
    std::vector<bfloat16> yb(ref.size());
    diffattn::detail::linear(xb.data(), s.rows, s.in, wb.data(), s.out, yb.data(), 2);
    bool rounded_once = true;
    for (std::size_t i = 0; i < yb.size(); ++i) {
      const bfloat16 want(ref[i]);
      rounded_once = rounded_once && std::memcmp(&yb[i], &want, sizeof want) == 0;
    }
    CHECK(rounded_once);
    if (!small) continue;
    // float y from 16-bit x and W, one thread or two: bitwise the float product
    diffattn::detail::linear(xb.data(), s.rows, s.in, wb.data(), s.out, yf.data(), 1);
    CHECK(yf == ref);
    const std::vector<half> wh(wd.begin(), wd.end());
    const std::vector<float> whf(wh.begin(), wh.end());
    std::vector<float> ref_h(ref.size());
    diffattn::detail::linear(xf.data(), s.rows, s.in, whf.data(), s.out, ref_h.data(), 2);
    diffattn::detail::linear(xf.data(), s.rows, s.in, wh.data(), s.out, yf.data(), 2);
    CHECK(yf == ref_h);
  }
}

namespace {
// The unit roundoff of a storage type.
template <class S>
double unit_roundoff() {
  if (std::is_same<S, double>::value) return std::ldexp(1.0, -53);
  if (std::is_same<S, float>::value) return std::ldexp(1.0, -24);
  if (std::is_same<S, diffattn::half>::value) return std::ldexp(1.0, -11);
  return std::ldexp(1.0, -8);  // bfloat16
}

// y = x W^T for one (x, W, y) storage triple, against float64 sums of the
// stored (exactly widened) values: the compute type's sum is within
// gamma_in sum_t |x_t w_t| of it, and y rounds that once more.
template <class SX, class SW, class SY>
void check_triple(index_t rows, index_t in, index_t out) {
  INFO("rows " << rows << " in " << in << " out " << out << ", x " << sizeof(SX) << " bytes, W "
               << sizeof(SW) << ", y " << sizeof(SY));
  const auto xd = random_vec(rows * in, 11), wd = random_vec(out * in, 12);
  const std::vector<SX> x(xd.begin(), xd.end());
  const std::vector<SW> w(wd.begin(), wd.end());
  std::vector<SY> y1(static_cast<std::size_t>(rows * out)), y2(y1.size());
  diffattn::detail::linear(x.data(), rows, in, w.data(), out, y1.data(), 1);
  diffattn::detail::linear(x.data(), rows, in, w.data(), out, y2.data(), 2);
  CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(SY)) == 0);
  using C = diffattn::compute_t<SW>;
  const double uc = unit_roundoff<C>(), gamma = in * uc / (1 - in * uc);
  bool within = true;
  double worst = 0;
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) {
      double exact = 0, mag = 0;
      for (index_t t = 0; t < in; ++t) {
        const double p = double(x[r * in + t]) * double(w[o * in + t]);
        exact += p;
        mag += std::abs(p);
      }
      const double got = double(y1[r * out + o]), err = std::abs(got - exact);
      const double bound = gamma * mag + unit_roundoff<SY>() * (std::abs(exact) + gamma * mag);
      within = within && err <= bound * 1.0000001 + 1e-300;
      worst = std::max(worst, err / bound);
    }
  INFO("largest error / bound " << worst);
  CHECK(within);
}
}  // namespace

TEST_CASE("every storage triple of the layers' projections is within its rounding bound",
          "[linear][half]") {
  using diffattn::bfloat16;
  using diffattn::half;
  // Under DIFFATTN_DISPATCH (tests/dispatch) each triple goes through its own
  // slot of the variant's table: a slot mixed up would fail here.
  for (const index_t rows : {index_t(3), index_t(100)}) {
    check_triple<float, float, float>(rows, 70, 33);
    check_triple<double, double, double>(rows, 70, 33);
    check_triple<bfloat16, bfloat16, bfloat16>(rows, 70, 33);
    check_triple<bfloat16, bfloat16, float>(rows, 70, 33);
    check_triple<float, bfloat16, bfloat16>(rows, 70, 33);
    check_triple<float, bfloat16, float>(rows, 70, 33);
    check_triple<half, half, half>(rows, 70, 33);
    check_triple<half, half, float>(rows, 70, 33);
    check_triple<float, half, half>(rows, 70, 33);
    check_triple<float, half, float>(rows, 70, 33);
  }
}

TEST_CASE("linear_backward in float: dW accumulated, dx set, added or skipped", "[linear]") {
  const index_t rows = 37, in = 45, out = 29;
  const auto xd = random_vec(rows * in, 21), wd = random_vec(out * in, 22),
             dyd = random_vec(rows * out, 23), dw0d = random_vec(out * in, 24),
             dx0d = random_vec(rows * in, 25);
  const auto x = as<float>(xd), w = as<float>(wd), dy = as<float>(dyd), dw0 = as<float>(dw0d),
             dx0 = as<float>(dx0d);
  // float64 sums of the float values, and of their magnitudes for the bound.
  std::vector<double> dw(dw0.begin(), dw0.end()), dx(static_cast<std::size_t>(rows * in), 0.0),
      dw_mag(dw.size(), 0.0), dx_mag(dx.size(), 0.0);
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o)
      for (index_t i = 0; i < in; ++i) {
        const double pw = double(dy[r * out + o]) * double(x[r * in + i]),
                     px = double(dy[r * out + o]) * double(w[o * in + i]);
        dw[o * in + i] += pw;
        dw_mag[o * in + i] += std::abs(pw);
        dx[r * in + i] += px;
        dx_mag[r * in + i] += std::abs(px);
      }
  const double u = std::ldexp(1.0, -24);
  auto within = [&](const std::vector<float>& got, const std::vector<double>& want,
                    const std::vector<double>& mag, const std::vector<float>& start, index_t depth) {
    const double gamma = (depth + 1) * u / (1 - (depth + 1) * u);
    for (std::size_t i = 0; i < got.size(); ++i)
      if (std::abs(double(got[i]) - want[i]) > gamma * (mag[i] + std::abs(double(start[i]))) + 1e-30)
        return false;
    return true;
  };
  const std::vector<float> zeros(dx.size(), 0.0f);
  for (const int threads : {1, 2}) {
    INFO("threads " << threads);
    std::vector<float> dwg(dw0), dxg(dx.size(), 7.0f);
    diffattn::detail::linear_backward<float>(x.data(), rows, in, w.data(), out, dy.data(),
                                             dwg.data(), dxg.data(), false, threads);
    CHECK(within(dwg, dw, dw_mag, dw0, rows));
    CHECK(within(dxg, dx, dx_mag, zeros, out));
    // dx added to what it held
    std::vector<float> dwa(dw0), dxa(dx0);
    diffattn::detail::linear_backward<float>(x.data(), rows, in, w.data(), out, dy.data(),
                                             dwa.data(), dxa.data(), true, threads);
    CHECK(dwa == dwg);
    std::vector<double> dx_plus(dx);
    for (std::size_t i = 0; i < dx.size(); ++i) dx_plus[i] += double(dx0[i]);
    CHECK(within(dxa, dx_plus, dx_mag, dx0, out));
    // no dx: dW alone, the same bits
    std::vector<float> dwn(dw0);
    diffattn::detail::linear_backward<float>(x.data(), rows, in, w.data(), out, dy.data(),
                                             dwn.data(), nullptr, false, threads);
    CHECK(dwn == dwg);
  }
}
