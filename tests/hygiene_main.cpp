// Two translation units that include everything (hygiene_tu_a.cpp and
// hygiene_tu_b.cpp) plus one TU per public header link into this program:
// a missing `inline` or an ODR clash fails the link.
#include <cstdio>

double hygiene_a();
double hygiene_b();

int main() {
  const double a = hygiene_a(), b = hygiene_b();
  if (a != b) {
    std::printf("the two translation units disagree: %.17g vs %.17g\n", a, b);
    return 1;
  }
  std::printf("hygiene ok (%.6f)\n", a);
  return 0;
}
