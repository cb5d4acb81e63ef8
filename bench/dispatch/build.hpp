// One build of the headers as bench_dispatch measures it: the same five
// cases compiled with other flags (or through diffattn::dispatch), each
// build's code in its own inline namespace (DIFFATTN_INLINE_NAMESPACE).
#pragma once

#include <benchmark/benchmark.h>

#include <functional>
#include <string>
#include <vector>

namespace bench_dispatch {

/// The cases, in the order of Build::run and Build::output.
inline const char* const kCases[] = {"V1Prefill_f32", "V1Prefill_bf16", "V2Decode_bf16cache",
                                     "V2Layer_f32", "V1Stats_f32"};
constexpr int kCaseCount = 5;

struct Build {
  std::string name;    // "native", "x86-64-v3", "default", "dispatch"
  std::string detail;  // the flags, or the variant diffattn::dispatch runs
  std::function<void(benchmark::State&, int)> run;       // case index; threads in range(0)
  std::function<std::vector<double>(int)> output;        // one call's output of a case
};

Build native_build();
Build v3_build();
Build default_build();
Build dispatch_build();

}  // namespace bench_dispatch
