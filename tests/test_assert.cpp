// Internal invariants go through DIFFATTN_ASSERT, which a program may define
// before its first include: here it throws, so that the tests can see it fire.
#include <stdexcept>

struct assert_failure : std::logic_error {
  using std::logic_error::logic_error;
};
#define DIFFATTN_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : throw assert_failure("DIFFATTN_ASSERT(" #cond ")"))

#include <catch2/catch.hpp>
#include <diffattn/tensor.hpp>

TEST_CASE("DIFFATTN_ASSERT can be turned into a throw: out-of-range indices", "[assert]") {
  float buf[6] = {0, 1, 2, 3, 4, 5};
  diffattn::TensorView<float, 2> v(buf, {2, 3});
  CHECK(v(1, 2) == 5.0f);
  CHECK_THROWS_AS(v(2, 0), assert_failure);
  CHECK_THROWS_AS(v(0, 3), assert_failure);
  CHECK_THROWS_AS(v(-1, 0), assert_failure);
  diffattn::Tensor<double, 1> t({4});
  CHECK_THROWS_AS(t(4), assert_failure);
  CHECK_NOTHROW(t(3));
}
