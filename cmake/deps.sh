#!/bin/sh
# Installs what diffattn needs to build, test and benchmark, by Debian package
# name. As root it runs apt-get; otherwise it prints the exact line and stops.
# --test adds what the full check needs: clang and its sanitizer and libFuzzer
# runtime, OpenMPI for diffattn::mpi's tests (ranks under mpirun), Doxygen for
# the API reference (its warnings fail the check), ccache, which keeps the
# check's compiled objects between runs, and Python with pybind11, numpy,
# pytest and PyTorch for the Python module's tests.
set -eu
packages="cmake g++ make libeigen3-dev catch2 libbenchmark-dev"
if [ "${1:-}" = "--test" ]; then
  packages="$packages clang libclang-rt-dev libopenmpi-dev openmpi-bin doxygen ccache"
  # libopenblas0-openmp: Debian's torch otherwise multiplies on the reference
  # BLAS (libblas3, about 5 GFLOP/s), which makes the Python example's training
  # smoke test take 4-5x longer.
  packages="$packages python3-dev pybind11-dev python3-numpy python3-pytest python3-torch"
  packages="$packages libopenblas0-openmp"
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps: not a Debian system; make sure these are installed: $packages" >&2
  exit 0
fi

missing=""
for p in $packages; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing="$missing $p"
  fi
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing
else
  echo "deps: missing Debian packages; run:" >&2
  echo "  sudo apt-get install -y$missing" >&2
  exit 1
fi
