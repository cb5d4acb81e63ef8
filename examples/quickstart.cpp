// The paper's illustration in C++: one differential head over 6 tokens.
//
// Two softmax maps over the same keys are subtracted, W = A1 - lambda * A2.
// Every row of W then sums to 1 - lambda (0.2 here) and some weights are
// negative: neither can happen in a softmax map. The head's output is W V.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include <diffattn/diffattn.hpp>
#include <diffattn/detail/core/random.hpp>

int main() {
  using diffattn::Matrix;
  const int n = 6, d = 8;  // 6 tokens, head width 8; values are 2d wide
  const float lambda = 0.8f;

  diffattn::detail::Rng rng(2025);
  auto random = [&](int rows, int cols) {
    Matrix<float> m(rows, cols);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) m(i, j) = static_cast<float>(rng.normal());
    return m;
  };
  const Matrix<float> q1 = random(n, d), k1 = random(n, d);
  const Matrix<float> q2 = random(n, d), k2 = random(n, d);
  const Matrix<float> v = random(n, 2 * d);

  const Matrix<float> w = diffattn::diff_weights(q1, k1, q2, k2, lambda);
  const Matrix<float> out = w * v;  // (n, 2d)

  std::printf("differential attention, %d tokens, head width %d, lambda %.2f\n\n", n, d, lambda);
  std::printf("W = A1 - lambda * A2:\n");
  int negative = 0;
  double deviation = 0;  // largest |row sum - (1 - lambda)|
  for (int i = 0; i < n; ++i) {
    std::printf("  row %d:", i);
    for (int j = 0; j < n; ++j) {
      std::printf(" %+.3f", w(i, j));
      negative += w(i, j) < 0;
    }
    std::printf("   sum %.2f\n", w.row(i).sum());
    deviation = std::max(deviation, std::abs(static_cast<double>(w.row(i).sum()) - (1.0 - lambda)));
  }
  std::printf("\nevery row sums to 1 - lambda = %.2f (largest deviation %.1e)\n", 1.0f - lambda,
              deviation);
  std::printf("%d of %d weights are negative\n\n", negative, n * n);
  std::printf("output rows O = W V (first 6 of %d features):\n", 2 * d);
  for (int i = 0; i < n; ++i) {
    std::printf("  row %d:", i);
    for (int j = 0; j < 6; ++j) std::printf(" %+.3f", out(i, j));
    std::printf(" ...\n");
  }
  return deviation < 1e-5 && negative > 0 ? 0 : 1;
}
