// bench_dispatch's "v3" build: header-only, compiled with the flags
// set on this file (bench/CMakeLists.txt), in its own inline namespace.
#undef DIFFATTN_DISPATCH
#define DIFFATTN_INLINE_NAMESPACE bench_v3
#define BENCH_BUILD_FN v3_build
#define BENCH_DETAIL BENCH_FLAGS
#include "cases.inc"
