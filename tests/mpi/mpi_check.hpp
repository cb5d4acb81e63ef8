// What the MPI test programs share: each rank's pass and fail counts, the
// summary over all ranks that decides the exit code, and byte comparisons of
// results across ranks and between runs.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <diffattn/tensor.hpp>

namespace mpi_check {

inline int g_rank = 0, g_world = 1;
inline int g_passed = 0, g_failed = 0;

/// Counts one check on this rank; prints the failed ones with the rank.
inline void check(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("[rank %d] FAILED: %s\n", g_rank, what.c_str());
    std::fflush(stdout);
  }
}

/// A tensor's bytes are the same on every rank of comm.
template <class T, std::size_t R>
bool same_on_all_ranks(const diffattn::Tensor<T, R>& t, MPI_Comm comm = MPI_COMM_WORLD) {
  int W = 1;
  MPI_Comm_size(comm, &W);
  const int bytes = static_cast<int>(t.size() * static_cast<diffattn::index_t>(sizeof(T)));
  std::vector<unsigned char> all(static_cast<std::size_t>(bytes) * static_cast<std::size_t>(W));
  MPI_Allgather(t.data(), bytes, MPI_BYTE, all.data(), bytes, MPI_BYTE, comm);
  if (bytes == 0) return true;
  for (int r = 1; r < W; ++r)
    if (std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * bytes,
                    static_cast<std::size_t>(bytes)) != 0)
      return false;
  return true;
}

/// Same shape and the same bytes.
template <class T, std::size_t R>
bool bitwise_equal(const diffattn::Tensor<T, R>& a, const diffattn::Tensor<T, R>& b) {
  // An empty tensor has no data pointer, which memcmp must not be given.
  return a.shape() == b.shape() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0);
}

/// max |a - b| / max(1e-30, max |b|) over finite entries; infinities must
/// match exactly, and a NaN on either side is an infinite error.
template <class T, std::size_t R>
double rel_error(const diffattn::Tensor<T, R>& a, const diffattn::Tensor<T, R>& b) {
  if (a.shape() != b.shape()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (diffattn::index_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a.data()[i]), y = static_cast<double>(b.data()[i]);
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(x - y));
    den = std::max(den, std::abs(y));
  }
  return num / std::max(den, 1e-30);
}

/// Prints "<name>: P passed, F failed (W ranks)" on rank 0, finalizes MPI and
/// returns the exit code: non-zero when any rank failed a check, or when
/// nothing was checked (ctest judges these runs by exit code).
inline int finish(const char* name) {
  int counts[2] = {g_passed, g_failed}, total[2] = {0, 0};
  MPI_Reduce(counts, total, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  int failed_any = 0;
  MPI_Allreduce(&g_failed, &failed_any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("%s: %d passed, %d failed (%d ranks)\n", name, total[0], total[1], g_world);
  MPI_Finalize();
  return failed_any || (g_rank == 0 && total[0] == 0) ? 1 : 0;
}

}  // namespace mpi_check
