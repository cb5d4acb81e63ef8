// One variant's backward kernels: compiled once per instruction set.
#include <diffattn/detail/backward/attention_backward.hpp>

#include "variant.hpp"

#ifndef DIFFATTN_VARIANT
#error "compile with -DDIFFATTN_VARIANT=<name>"
#endif

namespace {

template <class T>
void backward(const diffattn::detail::BackwardProblem<T>& bp,
              const diffattn::AttentionOptions& options) {
  diffattn::detail::run_attention_backward_kernel(bp, options);
}

}  // namespace

#define DIFFATTN_ENTRY(T) \
  reinterpret_cast<diffattn_dispatch::ErasedFn>(diffattn_dispatch::BackwardFn<T>(&backward<T>)),
extern "C" __attribute__((visibility("default"))) const diffattn_dispatch::ErasedFn
    DIFFATTN_BACKWARD_TABLE(DIFFATTN_VARIANT)[diffattn_dispatch::kBackwardSlots] = {
        DIFFATTN_BACKWARD_STORAGE(DIFFATTN_ENTRY)};
