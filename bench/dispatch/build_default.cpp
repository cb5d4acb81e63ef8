// bench_dispatch's "default" build: header-only, compiled with the flags
// set on this file (bench/CMakeLists.txt), in its own inline namespace.
#undef DIFFATTN_DISPATCH
#define DIFFATTN_INLINE_NAMESPACE bench_default
#define BENCH_BUILD_FN default_build
#define BENCH_DETAIL BENCH_FLAGS
#include "cases.inc"
