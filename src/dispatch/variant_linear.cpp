// One variant's products of the layers' projections (y = x W^T and its
// backward): compiled once per instruction set.
#include <diffattn/detail/layers/linear.hpp>

#include "variant.hpp"

#ifndef DIFFATTN_VARIANT
#error "compile with -DDIFFATTN_VARIANT=<name>"
#endif

namespace {

template <class SX, class SW, class SY>
void product(const SX* x, diffattn::index_t rows, diffattn::index_t in, const SW* w,
             diffattn::index_t out, SY* y, int threads) {
  diffattn::detail::linear_kernel(x, rows, in, w, out, y, threads);
}

template <class T>
void product_backward(const T* x, diffattn::index_t rows, diffattn::index_t in, const T* w,
                      diffattn::index_t out, const T* dy, T* dw, T* dx, bool accumulate_dx,
                      int threads) {
  diffattn::detail::linear_backward_kernel(x, rows, in, w, out, dy, dw, dx, accumulate_dx, threads);
}

}  // namespace

#define DIFFATTN_ENTRY(SX, SW, SY)                \
  reinterpret_cast<diffattn_dispatch::ErasedFn>( \
      diffattn_dispatch::LinearFn<SX, SW, SY>(&product<SX, SW, SY>)),
#define DIFFATTN_BACKWARD_ENTRY(T)                \
  reinterpret_cast<diffattn_dispatch::ErasedFn>( \
      diffattn_dispatch::LinearBackwardFn<T>(&product_backward<T>)),
extern "C" __attribute__((visibility("default"))) const diffattn_dispatch::ErasedFn
    DIFFATTN_LINEAR_TABLE(DIFFATTN_VARIANT)[diffattn_dispatch::kLinearSlots] = {
        DIFFATTN_LINEAR_STORAGE(DIFFATTN_ENTRY)
        DIFFATTN_LINEAR_BACKWARD_STORAGE(DIFFATTN_BACKWARD_ENTRY)};
