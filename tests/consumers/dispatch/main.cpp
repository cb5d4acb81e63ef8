// A downstream program built with default flags, linking diffattn::dispatch:
// a V1 forward through the library's variant for this CPU, checked against
// the single-head map of diff_weights.
#include <cmath>
#include <cstdio>
#include <string>

#include <diffattn/diffattn.hpp>

int main() {
  using diffattn::index_t;
  const index_t N = 9, M = 13, d = 16;
  diffattn::Tensor<float, 4> q({1, N, 2, d}), k({1, M, 2, d}), v({1, M, 1, 2 * d}),
      out({1, N, 1, 2 * d});
  for (index_t i = 0; i < q.size(); ++i) q.data()[i] = std::sin(0.37f * float(i));
  for (index_t i = 0; i < k.size(); ++i) k.data()[i] = std::cos(0.21f * float(i));
  for (index_t i = 0; i < v.size(); ++i) v.data()[i] = std::sin(0.11f * float(i) + 1.f);
  const float lambda = 0.3f;
  diffattn::diff_attention_v1<float>(q.view(), k.view(), v.view(), lambda, out.view());

  diffattn::Matrix<float> q1(N, d), q2(N, d), k1(M, d), k2(M, d), vm(M, 2 * d);
  for (index_t i = 0; i < N; ++i)
    for (index_t t = 0; t < d; ++t) q1(i, t) = q(0, i, 0, t), q2(i, t) = q(0, i, 1, t);
  for (index_t j = 0; j < M; ++j) {
    for (index_t t = 0; t < d; ++t) k1(j, t) = k(0, j, 0, t), k2(j, t) = k(0, j, 1, t);
    for (index_t t = 0; t < 2 * d; ++t) vm(j, t) = v(0, j, 0, t);
  }
  const diffattn::Matrix<float> ref = diffattn::diff_weights(q1, k1, q2, k2, lambda) * vm;
  float worst = 0;
  for (index_t i = 0; i < N; ++i)
    for (index_t t = 0; t < 2 * d; ++t) worst = std::fmax(worst, std::abs(ref(i, t) - out(0, i, 0, t)));
  const std::string isa(diffattn::isa());
  std::printf("diffattn::dispatch %d.%d.%d, variant %s: V1 max |difference| %.2e, %s\n",
              DIFFATTN_VERSION_MAJOR, DIFFATTN_VERSION_MINOR, DIFFATTN_VERSION_PATCH, isa.c_str(),
              double(worst), worst < 1e-5f ? "agrees" : "DISAGREES");
  return worst < 1e-5f && isa != "native" ? 0 : 1;
}
