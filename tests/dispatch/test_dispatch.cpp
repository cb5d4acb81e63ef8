// diffattn::dispatch's selection: the best variant this CPU runs, judged
// independently from the kernel's flags in /proc/cpuinfo; DIFFATTN_ISA names
// refused with the reason; every variant's forward kernel agreeing with the
// float64 reference is the job of the *_dispatch_<variant> tests.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <diffattn/attention.hpp>
#include <diffattn/isa.hpp>

namespace {

// The flags of the first processor in /proc/cpuinfo (empty where absent).
std::set<std::string> cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  return flags;
}

bool has_all(const std::set<std::string>& flags, std::initializer_list<const char*> names) {
  return std::all_of(names.begin(), names.end(), [&](const char* n) { return flags.count(n) > 0; });
}

// The variant the kernel's flags call for (the kernel reports only what the
// operating system enables, so its flags already account for XCR0).
std::string expected_variant(const std::vector<std::string_view>& compiled) {
  const std::set<std::string> f = cpuinfo_flags();
  const bool v2 = has_all(f, {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"});
  // (LZCNT, "abm", is left out: some kernels omit it from the list while CPUID has it.)
  const bool v3 = v2 && has_all(f, {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"});
  const bool v4 = v3 && has_all(f, {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"});
  const bool bf16 = v4 && has_all(f, {"avx512_bf16", "avx512_vnni"});
  const std::pair<const char*, bool> ladder[] = {
      {"avx512bf16", bf16}, {"avx512", v4}, {"avx2", v3}, {"sse4", v2}, {"generic", true}};
  for (const auto& [name, ok] : ladder)
    if (ok && std::find(compiled.begin(), compiled.end(), name) != compiled.end()) return name;
  return std::string(compiled.front());
}

}  // namespace

TEST_CASE("dispatch: the variants compiled in, and the one selected", "[dispatch]") {
  const std::vector<std::string_view> compiled = diffattn::isa_variants();
  REQUIRE(!compiled.empty());
  CHECK(compiled.front() == "generic");
  CHECK(diffattn::isa_supported("generic"));
  CHECK_FALSE(diffattn::isa_supported("native"));
  CHECK_FALSE(diffattn::isa_supported("avx1024"));
#if defined(__x86_64__)
  if (cpuinfo_flags().empty()) {
    WARN("no /proc/cpuinfo: the selection is not checked against the CPU's flags");
  } else {
    const std::string best = expected_variant(compiled);
    INFO("compiled in: " << compiled.size() << " variants; /proc/cpuinfo calls for " << best);
    CHECK(diffattn::detail::dispatch_check("") == best);
    for (std::string_view v : compiled) {
      const bool runs = diffattn::isa_supported(v);
      // Every variant up to the best one runs; none beyond it.
      const auto pos = std::find(compiled.begin(), compiled.end(), v) - compiled.begin();
      const auto best_pos = std::find(compiled.begin(), compiled.end(), best) - compiled.begin();
      CHECK(runs == (pos <= best_pos));
    }
  }
#endif
  // Unset DIFFATTN_ISA in this test's environment (ctest): the best one runs.
  CHECK(diffattn::isa() == diffattn::detail::dispatch_check(""));
}

TEST_CASE("dispatch: DIFFATTN_ISA names are checked", "[dispatch]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(diffattn::detail::dispatch_check("avx1024"),
                    Contains("DIFFATTN_ISA=avx1024 is not a variant of this library") &&
                        Contains("generic"));
  for (std::string_view v : diffattn::isa_variants()) {
    if (diffattn::isa_supported(v)) {
      CHECK(diffattn::detail::dispatch_check(v) == v);
    } else {
      CHECK_THROWS_WITH(diffattn::detail::dispatch_check(v),
                        Contains("this CPU (or its operating system) lacks"));
      WARN("this CPU does not run the " << v << " variant: its refusal is checked");
    }
  }
}

TEST_CASE("dispatch: a forward call runs through the selected variant", "[dispatch]") {
  // One V1 head against the single-head map of diff_weights-style math in
  // double: the library's kernels are reached and give the right answer.
  const diffattn::index_t N = 5, M = 7, d = 4;
  diffattn::Tensor<double, 4> q({1, N, 2, d}), k({1, M, 2, d}), v({1, M, 1, 2 * d}),
      out({1, N, 1, 2 * d});
  for (diffattn::index_t i = 0; i < q.size(); ++i) q.data()[i] = std::sin(0.7 * double(i));
  for (diffattn::index_t i = 0; i < k.size(); ++i) k.data()[i] = std::cos(0.3 * double(i));
  for (diffattn::index_t i = 0; i < v.size(); ++i) v.data()[i] = std::sin(1.3 * double(i) + 1);
  const double lambda = 0.4;
  diffattn::diff_attention_v1<double>(q.view(), k.view(), v.view(), lambda, out.view());
  double worst = 0;
  for (diffattn::index_t i = 0; i < N; ++i) {
    double w[2][M], z[2] = {0, 0};
    for (int m = 0; m < 2; ++m) {
      double mx = -1e300;
      for (diffattn::index_t j = 0; j < M; ++j) {
        double s = 0;
        for (diffattn::index_t t = 0; t < d; ++t) s += q(0, i, m, t) * k(0, j, m, t);
        w[m][j] = s / std::sqrt(double(d));
        mx = std::max(mx, w[m][j]);
      }
      for (diffattn::index_t j = 0; j < M; ++j) z[m] += (w[m][j] = std::exp(w[m][j] - mx));
    }
    for (diffattn::index_t t = 0; t < 2 * d; ++t) {
      double o = 0;
      for (diffattn::index_t j = 0; j < M; ++j)
        o += (w[0][j] / z[0] - lambda * w[1][j] / z[1]) * v(0, j, 0, t);
      worst = std::max(worst, std::abs(o - out(0, i, 0, t)));
    }
  }
  INFO("variant " << diffattn::isa());
  CHECK(worst < 1e-13);
}

TEST_CASE("dispatch: the variant of the bfloat16 kernels", "[dispatch]") {
  // Without DIFFATTN_ISA (ctest's environment here), the bfloat16 forward and
  // backward run on the selected variant, or on avx512 where that is
  // avx512bf16 and this CPU's vdpbf16ps does fewer flops a second than its
  // FMAs. Which of the two this CPU gets is its probe's call; what else could
  // happen is checked.
  const std::string all(diffattn::isa()), bf16(diffattn::detail::dispatch_bf16_isa());
  if (all != "avx512bf16") {
    CHECK(bf16 == all);
  } else {
    CHECK((bf16 == "avx512bf16" || bf16 == "avx512"));
    WARN("the bfloat16 kernels run on the " << bf16 << " variant ("
                                            << (bf16 == "avx512" ? "vdpbf16ps slower than FMA here"
                                                                 : "vdpbf16ps pays here")
                                            << ")");
  }
}
