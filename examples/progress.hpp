// One updating terminal line for long-running examples: "\r<text>  <elapsed>",
// redrawn at most every 0.1 s and cleared when done. Silent when stdout is
// not a terminal (a log file or ctest), so captured output stays clean.
#pragma once

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <string>

#ifdef _WIN32
#include <io.h>
#define DIFFATTN_EXAMPLE_ISATTY(f) _isatty(_fileno(f))
#else
#include <unistd.h>
#define DIFFATTN_EXAMPLE_ISATTY(f) isatty(fileno(f))
#endif

class Progress {
 public:
  Progress() : enabled_(DIFFATTN_EXAMPLE_ISATTY(stdout) != 0), t0_(Clock::now()) {}

  /// Redraws the line with printf-style text followed by the elapsed time.
  void update(const char* fmt, ...) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (drawn_ && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    char text[160];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    const double s = std::chrono::duration<double>(now - t0_).count();
    const int len = std::printf("\r%s  %.1f s", text, s);
    if (len < width_) std::printf("%*s", width_ - len, "");
    width_ = len;
    drawn_ = true;
    std::fflush(stdout);
  }

  /// Erases the line, so that the next printf starts on a clean one.
  void clear() {
    if (!enabled_ || !drawn_) return;
    std::printf("\r%*s\r", width_, "");
    std::fflush(stdout);
    drawn_ = false;
    width_ = 0;
  }

  ~Progress() { clear(); }

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  bool drawn_ = false;
  int width_ = 0;
  Clock::time_point t0_, last_;
};
