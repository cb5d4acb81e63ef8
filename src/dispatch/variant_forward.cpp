// One variant's forward kernels (fused prefill, decoding steps, split-KV,
// paged caches, packed batches): compiled once per instruction set.
#include <diffattn/detail/kernel/attention_kernel.hpp>

#include "variant.hpp"

#ifndef DIFFATTN_VARIANT
#error "compile with -DDIFFATTN_VARIANT=<name>"
#endif

namespace {

template <class T, class KV>
void forward(const diffattn::detail::AttentionProblem<T, KV>& p,
             const diffattn::AttentionOptions& options) {
  diffattn::detail::run_attention_kernel(p, options);
}

}  // namespace

#define DIFFATTN_ENTRY(T, KV) \
  reinterpret_cast<diffattn_dispatch::ErasedFn>(diffattn_dispatch::ForwardFn<T, KV>(&forward<T, KV>)),
extern "C" __attribute__((visibility("default"))) const diffattn_dispatch::ErasedFn
    DIFFATTN_FORWARD_TABLE(DIFFATTN_VARIANT)[diffattn_dispatch::kForwardSlots] = {
        DIFFATTN_FORWARD_STORAGE(DIFFATTN_ENTRY)};
