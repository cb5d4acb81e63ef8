// The projections' products (detail/linear.hpp) against float64 loops.
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/detail/linear.hpp>
#include <diffattn/detail/random.hpp>

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
