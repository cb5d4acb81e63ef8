// bench_dispatch's "native" build: header-only, compiled with the flags
// set on this file (bench/CMakeLists.txt), in its own inline namespace.
#undef DIFFATTN_DISPATCH
#define DIFFATTN_INLINE_NAMESPACE bench_native
#define BENCH_BUILD_FN native_build
#define BENCH_DETAIL BENCH_FLAGS
#include "cases.inc"
