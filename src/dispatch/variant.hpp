// What one variant of diffattn::dispatch exports: its kernels for every
// storage combination of detail/kernel/dispatch.hpp, as tables of type-erased
// function pointers in the order of DIFFATTN_FORWARD_STORAGE,
// DIFFATTN_BACKWARD_STORAGE, DIFFATTN_LINEAR_STORAGE (then
// DIFFATTN_LINEAR_BACKWARD_STORAGE) and DIFFATTN_ANALYSIS_STORAGE. Private to
// the library (not installed).
//
// Each variant is compiled from variant_forward.cpp, variant_backward.cpp,
// variant_linear.cpp and variant_analysis.cpp with its own instruction-set
// flags and DIFFATTN_VARIANT=<name>; the objects are linked into one
// relocatable object and every symbol except the four tables is made local to it
// (src/CMakeLists.txt), so no inline function compiled for one instruction
// set can be picked by the linker for another.
#pragma once

#include <type_traits>

#include <diffattn/detail/kernel/dispatch.hpp>

namespace diffattn_dispatch {

using ErasedFn = void (*)();

template <class T, class KV>
using ForwardFn = void (*)(const diffattn::detail::AttentionProblem<T, KV>&,
                           const diffattn::AttentionOptions&);
template <class T>
using BackwardFn = void (*)(const diffattn::detail::BackwardProblem<T>&,
                            const diffattn::AttentionOptions&);

/// The slot of (T, KV) in a variant's forward table.
template <class T, class KV>
constexpr int forward_slot() {
  int slot = 0, found = -1;
#define DIFFATTN_SLOT(A, B) \
  if (std::is_same<T, A>::value && std::is_same<KV, B>::value) found = slot; \
  ++slot;
  DIFFATTN_FORWARD_STORAGE(DIFFATTN_SLOT)
#undef DIFFATTN_SLOT
  return found;
}

/// The slot of T in a variant's backward table.
template <class T>
constexpr int backward_slot() {
  int slot = 0, found = -1;
#define DIFFATTN_SLOT(A) \
  if (std::is_same<T, A>::value) found = slot; \
  ++slot;
  DIFFATTN_BACKWARD_STORAGE(DIFFATTN_SLOT)
#undef DIFFATTN_SLOT
  return found;
}

template <class SX, class SW, class SY>
using LinearFn = void (*)(const SX*, diffattn::index_t, diffattn::index_t, const SW*,
                          diffattn::index_t, SY*, int);
template <class T>
using LinearBackwardFn = void (*)(const T*, diffattn::index_t, diffattn::index_t, const T*,
                                  diffattn::index_t, const T*, T*, T*, bool, int);

/// The slot of (SX, SW, SY) in a variant's linear table: the products first,
/// in the order of DIFFATTN_LINEAR_STORAGE.
template <class SX, class SW, class SY>
constexpr int linear_slot() {
  int slot = 0, found = -1;
#define DIFFATTN_SLOT(A, B, C)                                                   \
  if (std::is_same<SX, A>::value && std::is_same<SW, B>::value &&              \
      std::is_same<SY, C>::value)                                              \
    found = slot;                                                              \
  ++slot;
  DIFFATTN_LINEAR_STORAGE(DIFFATTN_SLOT)
#undef DIFFATTN_SLOT
  return found;
}

#define DIFFATTN_COUNT_LINEAR(A, B, C) +1
constexpr int kLinearForwardSlots = 0 DIFFATTN_LINEAR_STORAGE(DIFFATTN_COUNT_LINEAR);
#undef DIFFATTN_COUNT_LINEAR

/// The slot of T's backward in a variant's linear table: after the products,
/// in the order of DIFFATTN_LINEAR_BACKWARD_STORAGE.
template <class T>
constexpr int linear_backward_slot() {
  int slot = kLinearForwardSlots, found = -1;
#define DIFFATTN_SLOT(A) \
  if (std::is_same<T, A>::value) found = slot; \
  ++slot;
  DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_SLOT)
#undef DIFFATTN_SLOT
  return found;
}

#define DIFFATTN_COUNT_LINEAR_BACKWARD(A) +1
constexpr int kLinearSlots =
    kLinearForwardSlots DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_COUNT_LINEAR_BACKWARD);
#undef DIFFATTN_COUNT_LINEAR_BACKWARD

template <class T>
using AnalysisFn = void (*)(const diffattn::detail::AttentionProblem<T, T>&,
                            const diffattn::detail::AnalysisSpec&,
                            const diffattn::AttentionOptions&, double*);

/// The slot of T in a variant's analysis table.
template <class T>
constexpr int analysis_slot() {
  int slot = 0, found = -1;
#define DIFFATTN_SLOT(A) \
  if (std::is_same<T, A>::value) found = slot; \
  ++slot;
  DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_SLOT)
#undef DIFFATTN_SLOT
  return found;
}

#define DIFFATTN_COUNT_ANALYSIS(A) +1
constexpr int kAnalysisSlots = 0 DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_COUNT_ANALYSIS);
#undef DIFFATTN_COUNT_ANALYSIS

#define DIFFATTN_COUNT_FORWARD(A, B) +1
#define DIFFATTN_COUNT_BACKWARD(A) +1
constexpr int kForwardSlots = 0 DIFFATTN_FORWARD_STORAGE(DIFFATTN_COUNT_FORWARD);
constexpr int kBackwardSlots = 0 DIFFATTN_BACKWARD_STORAGE(DIFFATTN_COUNT_BACKWARD);
#undef DIFFATTN_COUNT_FORWARD
#undef DIFFATTN_COUNT_BACKWARD

}  // namespace diffattn_dispatch

#define DIFFATTN_PASTE_(a, b) a##b
#define DIFFATTN_PASTE(a, b) DIFFATTN_PASTE_(a, b)
/// The exported tables of variant NAME: diffattn_forward_NAME,
/// diffattn_backward_NAME ...
#define DIFFATTN_FORWARD_TABLE(name) DIFFATTN_PASTE(diffattn_forward_, name)
#define DIFFATTN_BACKWARD_TABLE(name) DIFFATTN_PASTE(diffattn_backward_, name)
/// ... its table of the layers' projections, diffattn_linear_NAME, and of the
/// analysis kernel, diffattn_analysis_NAME.
#define DIFFATTN_LINEAR_TABLE(name) DIFFATTN_PASTE(diffattn_linear_, name)
#define DIFFATTN_ANALYSIS_TABLE(name) DIFFATTN_PASTE(diffattn_analysis_, name)
