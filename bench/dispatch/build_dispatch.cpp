// bench_dispatch's "dispatch" build: default flags, the kernels run by
// diffattn::dispatch (DIFFATTN_DISPATCH comes with the target).
#define BENCH_BUILD_FN dispatch_build
#define BENCH_DETAIL std::string(diffattn::isa())
#include "cases.inc"
