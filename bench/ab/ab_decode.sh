#!/bin/sh
# Builds ab_decode: the decoding step of revision REV's headers (build a) and
# of the working tree's (build b) in one binary, each in its own inline
# namespace, then runs it with the remaining arguments (see ab_decode.cpp).
#   sh bench/ab/ab_decode.sh HEAD 32768 1 2 7 V2,GQA8
# Flags as bench_decode's: -O3 -march=native (CXXFLAGS_AB overrides them,
# e.g. "-O3 -mavx2 -mfma -mf16c" for the AVX2 build), CXX the compiler (c++),
# AB_OUT the folder it builds in (build-ab).
set -eu
cd "$(dirname "$0")/../.."
rev=${1:?usage: ab_decode.sh REV [ab_decode arguments]}
shift
out=${AB_OUT:-build-ab}
cxx=${CXX:-c++}
rm -rf "$out/a" "$out/b"
mkdir -p "$out/a" "$out/b"
git archive "$rev" include | tar -x -C "$out/a"
cp -R include "$out/b/"
# Revisions since DIFFATTN_INLINE_NAMESPACE take the name from the command line;
# older ones have it written in config.hpp.
for w in a b; do
  sed -i "s/inline namespace v0 {/inline namespace ab_$w {/" "$out/$w/include/diffattn/config.hpp"
  grep -q -e "inline namespace ab_$w {" -e "DIFFATTN_INLINE_NAMESPACE" \
    "$out/$w/include/diffattn/config.hpp" ||
    { echo "ab_decode.sh: the namespace of $w's config.hpp is not diffattn::v0" >&2; exit 1; }
done
flags=${CXXFLAGS_AB:-"-O3 -march=native"}
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
pids=""
for w in a b; do
  # shellcheck disable=SC2086
  "$cxx" -std=c++17 $flags -fopenmp -DNDEBUG $eigen -I"$out/$w/include" -DDIFFATTN_INLINE_NAMESPACE=ab_$w -DAB_STEP=ab_step_$w \
    -c bench/ab/ab_step.cpp -o "$out/step_$w.o" &
  pids="$pids $!"
done
"$cxx" -std=c++17 -O2 -c bench/ab/ab_decode.cpp -o "$out/ab_decode.o"
for pid in $pids; do wait "$pid"; done
"$cxx" -fopenmp "$out/ab_decode.o" "$out/step_a.o" "$out/step_b.o" -o "$out/ab_decode"
exec "$out/ab_decode" "$@"
