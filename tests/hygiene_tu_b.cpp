#include <diffattn/diffattn.hpp>

double hygiene_b() {
  diffattn::Matrix<double> q = diffattn::Matrix<double>::Identity(3, 4);
  const diffattn::Matrix<double> w = diffattn::diff_weights(q, q, q, q, 0.5);
  return w.sum() + diffattn::lambda_init(3);
}
