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
template <class SX, class SW, class SY>
using LinearFn = void (*)(const SX*, diffattn::index_t, diffattn::index_t, const SW*,
                          diffattn::index_t, SY*, int);
template <class T>
using LinearBackwardFn = void (*)(const T*, diffattn::index_t, diffattn::index_t, const T*,
                                  diffattn::index_t, const T*, T*, T*, bool, int);
template <class T>
using AnalysisFn = void (*)(const diffattn::detail::AttentionProblem<T, T>&,
                            const diffattn::detail::AnalysisSpec&,
                            const diffattn::AttentionOptions&, double*);

/// One storage combination: the key of a table slot.
template <class... Ts>
struct Key {};

/// The combinations of one table, in its order.
template <class... Keys>
struct Slots {
  static constexpr int count = static_cast<int>(sizeof...(Keys));
  /// The slot of key K, or -1 where the table lacks it.
  template <class K>
  static constexpr int of() {
    int slot = 0, found = -1;
    ((found = std::is_same<K, Keys>::value ? slot : found, ++slot), ...);
    return found;
  }
};
/// Slots from an X-macro's ", Key<...>" entries after a leading void.
template <class Void, class... Keys>
using SlotsOf = Slots<Keys...>;

#define DIFFATTN_KEY(...) , Key<__VA_ARGS__>
using ForwardSlots = SlotsOf<void DIFFATTN_FORWARD_STORAGE(DIFFATTN_KEY)>;
using BackwardSlots = SlotsOf<void DIFFATTN_BACKWARD_STORAGE(DIFFATTN_KEY)>;
using LinearSlots = SlotsOf<void DIFFATTN_LINEAR_STORAGE(DIFFATTN_KEY)>;
using LinearBackwardSlots = SlotsOf<void DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_KEY)>;
using AnalysisSlots = SlotsOf<void DIFFATTN_ANALYSIS_STORAGE(DIFFATTN_KEY)>;
#undef DIFFATTN_KEY

/// The slot of (T, KV) in a variant's forward table.
template <class T, class KV>
constexpr int forward_slot() {
  return ForwardSlots::of<Key<T, KV>>();
}
/// The slot of T in a variant's backward table.
template <class T>
constexpr int backward_slot() {
  return BackwardSlots::of<Key<T>>();
}
/// The slot of (SX, SW, SY) in a variant's linear table: the products first ...
template <class SX, class SW, class SY>
constexpr int linear_slot() {
  return LinearSlots::of<Key<SX, SW, SY>>();
}
/// ... then the backward of T.
template <class T>
constexpr int linear_backward_slot() {
  const int slot = LinearBackwardSlots::of<Key<T>>();
  return slot < 0 ? -1 : LinearSlots::count + slot;
}
/// The slot of T in a variant's analysis table.
template <class T>
constexpr int analysis_slot() {
  return AnalysisSlots::of<Key<T>>();
}

constexpr int kForwardSlots = ForwardSlots::count;
constexpr int kBackwardSlots = BackwardSlots::count;
constexpr int kLinearSlots = LinearSlots::count + LinearBackwardSlots::count;
constexpr int kAnalysisSlots = AnalysisSlots::count;

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
