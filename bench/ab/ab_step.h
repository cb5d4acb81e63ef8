// The interface between ab_decode.cpp and the two builds of ab_step.cpp:
// plain C types only, so that neither side needs the other's headers.
#pragma once

#include <cstddef>

struct AbLayer {
  const char* name;
  int kind;                   // 0 plain, 1 DIFF V1, 2 DIFF V2
  std::ptrdiff_t qh, kh, vh;  // query, key and value heads
  std::ptrdiff_t d, dv;       // query/key and value widths
};

struct AbStep {
  AbLayer layer;
  std::ptrdiff_t M, B;
  int threads;
  const float *k, *v, *q, *logit;
  float* out;
  const std::ptrdiff_t* lens;  // (B) keys each sequence holds: M
};

extern "C" void ab_step_a(const AbStep*);
extern "C" void ab_step_b(const AbStep*);
