// A/B comparison of two versions of the decoding step in one process: the
// steps of build a (a revision's headers) and build b (the working tree's)
// alternate step by step, each in turn first, each on its own cold copies of
// the caches, so that a shared host's neighbours hit both alike. Separate
// benchmark runs minutes apart differ by more than most kernel changes are
// worth (the 2-thread read rate of the Zen 5 VM moved between 26 and 96 GB/s).
//
//   ab_decode [M] [B] [threads] [rounds] [layers] [copies]
//
// M keys per sequence (32768), B sequences (1), threads (2), rounds of about
// 2 GB of K/V each per build (7), layers: names to run, e.g. "V2,GQA8" (all),
// copies of each layer's caches (0: at least 2, and more than 4x the
// last-level cache together, so that a step never reads what the step
// before it left in the cache; 1: one copy, read warm from the caches). Prints each round's
// b-over-a speed ratio, their median, and the largest difference of the two
// builds' outputs; exits 3 if they differ by more than float rounding (a
// variant built only to measure a bound, with wrong results, does). Built
// and run by ab_decode.sh.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ab_step.h"

namespace {

/// The last-level cache one core sees: sysfs' index3, else 32 MiB;
/// DIFFATTN_BENCH_LLC_MIB overrides it.
std::size_t llc_bytes() {
  if (const char* e = std::getenv("DIFFATTN_BENCH_LLC_MIB"))
    return std::strtoull(e, nullptr, 10) << 20;
  std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::size_t kib = 0;
  if (f >> kib && kib > 0) return kib << 10;
  return std::size_t(32) << 20;
}

struct Buffer {
  float* p = nullptr;
  explicit Buffer(std::size_t n) {
    // Page-aligned, as diffattn::Tensor's large buffers: 16 bytes off a line
    // the step runs up to 0.75x as fast.
    if (posix_memalign(reinterpret_cast<void**>(&p), 4096, std::max<std::size_t>(n, 1) * 4) != 0)
      std::abort();
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

}  // namespace

int main(int argc, char** argv) {
  const AbLayer layers[] = {{"V1", 1, 16, 16, 8, 64, 128},       {"V2", 2, 16, 8, 8, 64, 64},
                            {"GQA8", 0, 8, 8, 8, 64, 64},        {"GQA16", 0, 16, 8, 8, 64, 64},
                            {"GQA4x128", 0, 32, 8, 8, 128, 128}, {"MQA", 0, 8, 1, 1, 128, 128}};
  const std::ptrdiff_t M = argc > 1 ? std::atol(argv[1]) : 32768;
  const std::ptrdiff_t B = argc > 2 ? std::atol(argv[2]) : 1;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 7;
  const std::string only = argc > 5 ? argv[5] : "";
  const int copies_arg = argc > 6 ? std::atoi(argv[6]) : 0;
  if (M < 1 || B < 1 || threads < 0 || rounds < 1 || copies_arg < 0) {
    std::fprintf(stderr,
                 "usage: ab_decode [M >= 1] [B >= 1] [threads] [rounds >= 1] [layers] [copies]\n");
    return 2;
  }
  std::printf("M = %td, B = %td, %d threads, %d rounds; b's speed over a's\n", M, B, threads,
              rounds);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1, 1);
  void (*const step[2])(const AbStep*) = {ab_step_a, ab_step_b};
  int status = 0;
  for (const AbLayer& L : layers) {
    if (!only.empty() &&
        ("," + only + ",").find("," + std::string(L.name) + ",") == std::string::npos)
      continue;
    const std::size_t kn = std::size_t(B * M * L.kh * L.d), vn = std::size_t(B * M * L.vh * L.dv);
    const std::size_t bytes = (kn + vn) * 4;
    const std::size_t copies = copies_arg > 0
                                   ? std::size_t(copies_arg)
                                   : std::max<std::size_t>(2, (4 * llc_bytes()) / bytes + 1);
    std::vector<std::unique_ptr<Buffer>> ks, vs;
    for (std::size_t c = 0; c < copies; ++c) {
      ks.emplace_back(new Buffer(kn));
      vs.emplace_back(new Buffer(vn));
      for (std::size_t i = 0; i < kn; ++i) ks.back()->p[i] = uniform(rng);
      for (std::size_t i = 0; i < vn; ++i) vs.back()->p[i] = uniform(rng);
    }
    std::vector<float> q(std::size_t(B * L.qh * L.d)), logit(std::size_t(B * L.qh));
    std::vector<float> out[2] = {std::vector<float>(std::size_t(B * L.qh * 2 * L.dv)),
                                 std::vector<float>(std::size_t(B * L.qh * 2 * L.dv))};
    for (float& x : q) x = uniform(rng);
    for (float& x : logit) x = uniform(rng);
    const std::vector<std::ptrdiff_t> lens(std::size_t(B), M);
    AbStep s{L, M, B, threads, nullptr, nullptr, q.data(), logit.data(), nullptr, lens.data()};
    const int steps = std::max(8, static_cast<int>(2e9 / double(bytes)));
    std::vector<double> ratio;
    double gbs[2] = {0, 0};
    std::size_t c = 0;
    for (int r = 0; r < rounds; ++r) {
      double t[2] = {0, 0};
      for (int i = 0; i < steps; ++i)
        for (int w = 0; w < 2; ++w) {
          const int which = (i + r) % 2 ? 1 - w : w;
          s.k = ks[c % copies]->p;
          s.v = vs[c % copies]->p;
          ++c;
          s.out = out[which].data();
          const auto t0 = std::chrono::steady_clock::now();
          step[which](&s);
          t[which] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
      ratio.push_back(t[0] / t[1]);
      for (int w = 0; w < 2; ++w) gbs[w] += double(bytes) * steps / t[w] / 1e9 / rounds;
    }
    double diff = 0;
    for (int w = 0; w < 2; ++w) {
      s.k = ks[0]->p;
      s.v = vs[0]->p;
      s.out = out[w].data();
      step[w](&s);
    }
    double amax = 0;
    for (std::size_t i = 0; i < out[0].size(); ++i) {
      diff = std::max(diff, double(std::fabs(out[0][i] - out[1][i])));
      amax = std::max(amax, double(std::fabs(out[0][i])));
    }
    // Both builds compute the same step: they may differ by float rounding
    // (sums in another order), never by more, and never in a NaN.
    const bool agree = std::isfinite(amax) && diff <= 1e-4 * std::max(1.0, amax);
    status = agree ? status : 3;
    std::vector<double> sorted = ratio;
    std::sort(sorted.begin(), sorted.end());
    std::printf("%-9s %zu copies, a %.1f GB/s, b %.1f GB/s: median %.3f, rounds", L.name, copies,
                gbs[0], gbs[1], sorted[sorted.size() / 2]);
    for (double x : ratio) std::printf(" %.3f", x);
    std::printf("; max |a - b| %.1e%s\n", diff, agree ? "" : " (the builds' outputs differ)");
    std::fflush(stdout);
  }
  return status;
}
