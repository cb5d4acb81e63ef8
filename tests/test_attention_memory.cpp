// Extra memory of the fused kernel grows with M, not with N x M: at N = M =
// 16384 the peak resident memory stays within 64 MiB of the inputs and outputs
// (a materialised float map would be 1 GiB per head and map). Its own
// executable, so that no other test raises the process's peak first.
#include <cstdio>
#include <fstream>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>

#if defined(__linux__)
#include <sys/resource.h>
#include <unistd.h>
#endif

#include "attention_support.hpp"

using diffattn::index_t;
using diffattn::Tensor;

#if defined(__linux__)
namespace {
double current_rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}
double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}
}  // namespace

TEST_CASE("V1 at N = M = 16384 needs less than 64 MiB beyond its tensors", "[attention][memory]") {
  const index_t n = 16384, H = 1, d = 64;
  const auto q = test::random_tensor<float, 4>({1, n, 2 * H, d}, 1);
  const auto k = test::random_tensor<float, 4>({1, n, 2 * H, d}, 2);
  const auto v = test::random_tensor<float, 4>({1, n, H, 2 * d}, 3);
  Tensor<float, 4> out({1, n, H, 2 * d});
  Tensor<float, 3> lse({1, 2 * H, n});
  out.fill(1.0f);  // touch every page of the outputs before measuring
  lse.fill(1.0f);
  const double before = current_rss_mib();
  diffattn::AttentionOptions o;
  o.causal = true;
  o.num_threads = 2;
  diffattn::diff_attention_v1<float>(q, k, v, 0.8f, out, lse, o);
  const double extra = peak_rss_mib() - before;
  std::printf("resident before %.1f MiB, extra peak %.1f MiB\n", before, extra);
  CHECK(extra < 64.0);
  CHECK(test::all_finite(out));
}
#else
TEST_CASE("memory check needs Linux's /proc", "[attention][memory]") { WARN("skipped: not Linux"); }
#endif
