// Speed of the kernels by how the program is built, in one process:
//   native     header-only, -O3 -march=native (diffattn::native)
//   x86-64-v3  header-only, -O3 -march=x86-64-v3 (AVX2, FMA: a binary for most machines since 2015)
//   default    header-only, -O3 without -march (SSE2: CMake's Release flags)
//   dispatch   -O3 without -march, linking diffattn::dispatch (the variant for this CPU)
// Five cases (bench/dispatch/cases.inc), each build's run beside the others.
// After Google Benchmark's own output, a table gives each build's speed
// relative to native (native time / build time, medians over repetitions)
// and its output's largest difference from native's, relative to max |o|.
//
//   ./build/bench/bench_dispatch [--threads=2] [Google Benchmark flags]
// e.g. --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "build.hpp"

namespace {

using bench_dispatch::Build;

/// Keeps every run's time per benchmark name, and prints as the console does.
class Collector : public benchmark::ConsoleReporter {
 public:
  Collector() : ConsoleReporter(isatty(1) ? OO_ColorTabular : OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs)
      if (r.run_type == Run::RT_Iteration && r.error_occurred == false)
        times[r.benchmark_name()].push_back(r.GetAdjustedRealTime());
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, std::vector<double>> times;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double max_rel_difference(const std::vector<double>& a, const std::vector<double>& ref) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0)
      threads = std::atoi(argv[i] + 10);
    else
      args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  const std::vector<Build> builds = {bench_dispatch::native_build(), bench_dispatch::v3_build(),
                                     bench_dispatch::default_build(), bench_dispatch::dispatch_build()};
  const char* names[] = {"native", "x86-64-v3", "default", "dispatch"};
  for (int c = 0; c < bench_dispatch::kCaseCount; ++c)
    for (std::size_t b = 0; b < builds.size(); ++b)
      benchmark::RegisterBenchmark((std::string(bench_dispatch::kCases[c]) + "/" + names[b]).c_str(),
                                   [&builds, b, c](benchmark::State& s) { builds[b].run(s, c); })
          ->Arg(threads)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&n, args.data());
  Collector collector;
  benchmark::RunSpecifiedBenchmarks(&collector);

  std::printf("\nbuild        what runs the kernels          ");
  for (int c = 0; c < bench_dispatch::kCaseCount; ++c) std::printf("%22s", bench_dispatch::kCases[c]);
  std::printf("\n");
  bool agree = true;
  std::vector<std::vector<double>> reference;
  for (int c = 0; c < bench_dispatch::kCaseCount; ++c) reference.push_back(builds[0].output(c));
  for (std::size_t b = 0; b < builds.size(); ++b) {
    std::printf("%-12s %-30s ", names[b], builds[b].detail.c_str());
    for (int c = 0; c < bench_dispatch::kCaseCount; ++c) {
      const std::string base = std::string(bench_dispatch::kCases[c]) + "/";
      const auto mine = collector.times.find(base + names[b] + "/" + std::to_string(threads) + "/real_time");
      const auto ref = collector.times.find(base + "native/" + std::to_string(threads) + "/real_time");
      const double diff = max_rel_difference(builds[b].output(c), reference[static_cast<std::size_t>(c)]);
      // float cases to float rounding; the bfloat16 ones to bfloat16's
      agree = agree && diff < (c == 1 || c == 2 ? 1e-2 : 1e-5);
      if (mine == collector.times.end() || ref == collector.times.end())
        std::printf("%11s diff %.0e", "-", diff);
      else
        std::printf("%10.3fx diff %.0e", median(ref->second) / median(mine->second), diff);
    }
    std::printf("\n");
  }
  std::printf("%-43s ", "native median time");
  for (int c = 0; c < bench_dispatch::kCaseCount; ++c) {
    const auto ref = collector.times.find(std::string(bench_dispatch::kCases[c]) + "/native/" +
                                          std::to_string(threads) + "/real_time");
    if (ref == collector.times.end())
      std::printf("%22s", "-");
    else
      std::printf("%19.2f ms", median(ref->second));  // in the unit set below: ms
  }
  std::printf("\n(speed relative to native, %d threads; diff: max |o - o_native| / max |o_native|)\n",
              threads);
  if (!agree) std::printf("the builds' outputs differ beyond rounding\n");
  return agree ? 0 : 1;
}
