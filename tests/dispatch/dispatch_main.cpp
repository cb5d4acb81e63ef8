// Catch2's main for the kernel tests linked with diffattn::dispatch: each runs
// once per variant compiled into the library, the variant forced with
// DIFFATTN_ISA by ctest. A variant this CPU cannot run is skipped (exit 77,
// ctest's SKIP_RETURN_CODE) with the reason printed; one that runs must be
// the one asked for.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>
#include <diffattn/error.hpp>
#include <diffattn/isa.hpp>

int main(int argc, char* argv[]) {
  const char* want = std::getenv("DIFFATTN_ISA");
  if (want && *want && !diffattn::isa_supported(want)) {
    try {
      diffattn::detail::dispatch_check(want);
      std::printf("DIFFATTN_ISA=%s is not supported, yet selecting it did not throw\n", want);
      return 1;
    } catch (const diffattn::error& e) {
      std::printf("skipped: %s\n", e.what());
      return 77;
    }
  }
  const std::string isa(diffattn::isa());
  std::printf("diffattn::dispatch runs the %s variant\n", isa.c_str());
  if (want && *want && isa != want) {
    std::printf("expected the %s variant\n", want);
    return 1;
  }
  return Catch::Session().run(argc, argv);
}
