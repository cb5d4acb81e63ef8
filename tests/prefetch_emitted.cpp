// Compiled to assembly only (tests/CMakeLists.txt, -S) and searched by
// check_prefetch.cmake: the decoding step must still contain its prefetches
// (detail::prefetch_decode: prefetchnta on AMD processors, prefetcht1
// elsewhere, both in the code since the vendor is read at run time). Under GCC 12 at -O3 they were once
// gone without any test failing: prefetch_row was left out of line, and the
// interprocedural mod/ref analysis, finding the call free of side effects,
// deleted it, so the step ran without prefetch (on Zen 5, V2's step 1.16x and
// MQA's 1.31x slower than with the prefetch then in the code).
#include <diffattn/kvcache_attention.hpp>

void decode_step(diffattn::TensorView<const float, 4> q, diffattn::TensorView<const float, 4> k,
                 diffattn::TensorView<const float, 4> v, diffattn::TensorView<float, 4> out,
                 const diffattn::KVCacheBatch& cache) {
  diffattn::attention_kvcache<float>(q, k, v, out, {}, cache);
}
