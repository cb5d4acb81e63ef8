// A downstream program: includes the umbrella header and runs one map.
#include <cmath>
#include <cstdio>

#include <diffattn/diffattn.hpp>

int main() {
  diffattn::Matrix<float> q = diffattn::Matrix<float>::Random(4, 8);
  diffattn::Matrix<float> k = diffattn::Matrix<float>::Random(6, 8);
  const diffattn::Matrix<float> w = diffattn::diff_weights(q, k, k.topRows(4), k, 0.3f);
  const float row_sum = w.row(0).sum();
  std::printf("diffattn %d.%d.%d: row sum %.6f\n", DIFFATTN_VERSION_MAJOR, DIFFATTN_VERSION_MINOR,
              DIFFATTN_VERSION_PATCH, row_sum);
  return std::abs(row_sum - 0.7f) < 1e-5f ? 0 : 1;
}
