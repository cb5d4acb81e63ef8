#!/bin/sh
# The README's test command: builds and runs everything that guards a change.
#   1. the release build: tests, examples' smoke tests, consumer projects;
#   2. the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer;
#   3. the libFuzzer targets (clang) over their seed corpora and then for
#      DIFFATTN_FUZZ_SECONDS (default 25) each, DIFFATTN_JOBS at a time.
# DIFFATTN_JOBS sets the build parallelism (default 2).
set -eu
cd "$(dirname "$0")/.."
jobs=${DIFFATTN_JOBS:-2}
fuzz_seconds=${DIFFATTN_FUZZ_SECONDS:-25}

sh cmake/deps.sh --test
start=$(date +%s)
stage_start=$start
stage_name=""
# Each stage prints its own time when the next one starts, and the total at the end.
stage() {
  now=$(date +%s)
  [ -n "$stage_name" ] && echo "== $stage_name: $((now - stage_start)) s"
  stage_name=$1
  stage_start=$now
  [ -n "$1" ] && echo "== $1 ($((now - start)) s in)"
  return 0
}

# ccache, where installed (deps.sh --test installs it), keeps compiled objects
# between runs on this machine: paths are taken relative to the clone
# (CCACHE_BASEDIR), so a fresh clone of an unchanged tree compiles nothing
# again. An object depends on the compilers' versions and on this CPU's
# flags too, since -march=native means another instruction set on another
# machine. DIFFATTN_CCACHE=0 turns it off.
launcher=""
if [ "${DIFFATTN_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  CCACHE_BASEDIR=$(pwd)
  CCACHE_NOHASHDIR=1
  CCACHE_COMPILERCHECK="string:$( (c++ -dumpfullversion; clang++ --version 2>/dev/null | head -n 1;
    grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null) | cksum | cut -d ' ' -f 1)"
  export CCACHE_BASEDIR CCACHE_NOHASHDIR CCACHE_COMPILERCHECK
  launcher="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
  ccache --zero-stats >/dev/null
fi

stage "1/3 release build and tests"
# The per-header unit tests are built once, in stage 2, under the sanitizers:
# here the optimised code they do not reach that way, the kernels of
# diffattn::dispatch once per instruction-set variant (tests/dispatch: the
# forward, backward, decoding, 16-bit and 8-bit tests), the same tests'
# pieces compiled for this machine (*_native), the memory test, the MPI
# tests, the examples, the benchmarks, the Python module, the header checks
# and the consumer projects.
cmake -S . -B build $launcher -DDIFFATTN_UNIT_TESTS=OFF
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"
# The API reference: Doxygen over the public headers; any warning (an
# undocumented public entity, a broken reference) fails the docs target.
cmake --build build --target docs

stage "2/3 tests under AddressSanitizer and UndefinedBehaviorSanitizer"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# Every per-header unit test, header-only with the compiler's default
# instruction set, as a program built without -march would run them.
# test_hygiene (each header compiled alone) is built in stage 1 only.
# -g1 keeps the line tables the sanitizers' reports need and compiles a third
# faster than -g; -Og builds them in about 6.5 minutes on 2 cores against about 9
# with -O1 (test_half.cpp: 50 s against 88), and the tests run as fast (30 s).
cmake -S . -B build-sanitize $launcher -DCMAKE_BUILD_TYPE=Debug -DDIFFATTN_BUILD_BENCH=OFF \
  -DDIFFATTN_BUILD_EXAMPLES=OFF -DDIFFATTN_NATIVE_TESTS=OFF -DDIFFATTN_HEADER_CHECKS=OFF \
  -DDIFFATTN_BUILD_DISPATCH=OFF \
  -DCMAKE_CXX_FLAGS_DEBUG="-Og -g1" \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san"
cmake --build build-sanitize -j"$jobs"
# The memory test measures resident memory, which the sanitizers' shadow inflates;
# the consumer projects build without the sanitizer flags.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-sanitize --output-on-failure -j"$jobs" -E "memory|consumer|mpi"
# OpenMPI keeps allocations of its own until exit, which LeakSanitizer would
# report: the MPI tests run with every other check on but leak detection off.
if ctest --test-dir build-sanitize -N -R mpi | grep -q "Test *#"; then
  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-sanitize --output-on-failure -R mpi
fi

stage "3/3 fuzzing the safetensors reader, the view checks, the KV cache kernels and the layers' caches"
cmake -S . -B build-fuzz $launcher -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDIFFATTN_BUILD_FUZZERS=ON -DDIFFATTN_BUILD_TESTS=OFF -DDIFFATTN_BUILD_EXAMPLES=OFF \
  -DDIFFATTN_BUILD_BENCH=OFF -DDIFFATTN_USE_OPENMP=OFF -DDIFFATTN_BUILD_DISPATCH=OFF
cmake --build build-fuzz -j"$jobs"
ctest --test-dir build-fuzz --output-on-failure
# Each fuzzer runs on one thread: $jobs of them at a time.
rm -f build-fuzz/fuzz_failed
fuzz_one() {
  corpus="build-fuzz/corpus/$1"
  mkdir -p "$corpus"
  (cd build-fuzz && ./tests/fuzz/fuzz_"$1" -max_total_time="$fuzz_seconds" \
    -print_final_stats=1 "corpus/$1" "../tests/fuzz/corpus/$1") >"build-fuzz/fuzz_$1.log" 2>&1 ||
    echo "$1" >>build-fuzz/fuzz_failed
}
running=0
for target in safetensors views kvcache layers; do
  echo "-- fuzz_$target for ${fuzz_seconds}s"
  fuzz_one "$target" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait
    running=0
  fi
done
wait
for target in safetensors views kvcache layers; do
  echo "-- fuzz_$target:"
  grep -E "^Done|stat::number_of_executed_units" "build-fuzz/fuzz_$target.log" || true
done
if [ -s build-fuzz/fuzz_failed ]; then
  for target in $(cat build-fuzz/fuzz_failed); do
    tail -n 60 "build-fuzz/fuzz_$target.log"
    echo "fuzz_$target found a failure (input saved in build-fuzz/)"
  done
  exit 1
fi
stage ""
[ -n "$launcher" ] && ccache --show-stats | grep -E "Hits|Misses|hit|miss" || true
echo "== all checks passed in $(($(date +%s) - start)) s (after the dependencies)"
