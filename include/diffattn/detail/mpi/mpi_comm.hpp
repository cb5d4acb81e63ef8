// MPI plumbing of the context-parallel kernels: a private duplicate of the
// caller's communicator that returns errors instead of aborting, checked calls,
// the ring neighbours, and the collective agreement on the arguments that
// makes every rank take the same decision before any ring traffic.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "../../config.hpp"
#include "../../error.hpp"
#include "../core/format.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Throws diffattn::error naming the function and MPI's own words for `rc`.
inline void mpi_check(int rc, const char* fn, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) std::strcpy(text, "unknown MPI error");
  fail(fn, what, " failed: ", text, " (MPI error code ", rc, ")");
}

template <class T>
MPI_Datatype mpi_type() {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "diffattn::mpi: float or double storage");
  return std::is_same<T, float>::value ? MPI_FLOAT : MPI_DOUBLE;
}

/// The element count of one message as MPI's int, or an error.
inline int mpi_count(index_t n, const char* fn) {
  if (n < 0 || n > INT_MAX)
    fail(fn, "a message of ", n, " elements exceeds MPI's int count (", INT_MAX,
         "); use more ranks or a smaller batch");
  return static_cast<int>(n);
}

/// Wall-clock seconds.
inline double mpi_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// A duplicate of the caller's communicator with MPI_ERRORS_RETURN, so that a
/// failed call comes back as a code that becomes diffattn::error, and so that
/// our messages never match the caller's. Freed on scope exit.
class RingComm {
 public:
  RingComm(MPI_Comm comm, const char* fn) : fn_(fn) {
    if (comm == MPI_COMM_NULL) fail(fn, "comm is MPI_COMM_NULL");
    int initialized = 0, finalized = 0;
    mpi_check(MPI_Initialized(&initialized), fn, "MPI_Initialized");
    mpi_check(MPI_Finalized(&finalized), fn, "MPI_Finalized");
    if (!initialized || finalized)
      fail(fn, "MPI is not initialised (call MPI_Init first) or already finalised");
    mpi_check(MPI_Comm_dup(comm, &comm_), fn, "MPI_Comm_dup");
    const int rc = MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
      MPI_Comm_free(&comm_);
      mpi_check(rc, fn, "MPI_Comm_set_errhandler");
    }
    mpi_check(MPI_Comm_rank(comm_, &rank_), fn, "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(comm_, &size_), fn, "MPI_Comm_size");
  }
  RingComm(const RingComm&) = delete;
  RingComm& operator=(const RingComm&) = delete;
  ~RingComm() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int left() const { return (rank_ + size_ - 1) % size_; }
  int right() const { return (rank_ + 1) % size_; }
  const char* fn() const { return fn_; }

  template <class T>
  void isend(const T* buf, index_t n, int dest, int tag, MPI_Request* req) {
    mpi_check(MPI_Isend(buf, mpi_count(n, fn_), mpi_type<T>(), dest, tag, comm_, req), fn_,
              "MPI_Isend");
    bytes_sent += static_cast<std::uint64_t>(n) * sizeof(T);
  }
  template <class T>
  void irecv(T* buf, index_t n, int src, int tag, MPI_Request* req) {
    mpi_check(MPI_Irecv(buf, mpi_count(n, fn_), mpi_type<T>(), src, tag, comm_, req), fn_,
              "MPI_Irecv");
  }
  /// Waits for the active requests among `reqs` (null ones are skipped); the
  /// time spent here is time the ring did not hide behind the computation.
  void wait(MPI_Request* reqs, int n) {
    const double t0 = mpi_now();
    std::vector<MPI_Status> st(static_cast<std::size_t>(n));
    const int rc = MPI_Waitall(n, reqs, st.data());
    wait_seconds += mpi_now() - t0;
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& s : st) mpi_check(s.MPI_ERROR, fn_, "MPI_Waitall");
    }
    mpi_check(rc, fn_, "MPI_Waitall");
  }
  /// Lets MPI progress pending transfers between two pieces of computation.
  void poke(MPI_Request* reqs, int n) {
    int flag = 0;
    std::vector<MPI_Status> st(static_cast<std::size_t>(n));
    mpi_check(MPI_Testall(n, reqs, &flag, st.data()), fn_, "MPI_Testall");
  }
  void allreduce_sum(double* x, int n) {
    const double t0 = mpi_now();
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, comm_), fn_, "MPI_Allreduce");
    wait_seconds += mpi_now() - t0;
  }
  /// The sum over every rank of x, added in rank order on each rank (an
  /// MPI_Allgather), so that every rank gets the same bits.
  std::vector<double> allgather_sum(const std::vector<double>& x) {
    const double t0 = mpi_now();
    const int n = static_cast<int>(x.size());
    std::vector<double> all(x.size() * static_cast<std::size_t>(size_));
    mpi_check(MPI_Allgather(x.data(), n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, comm_), fn_,
              "MPI_Allgather");
    wait_seconds += mpi_now() - t0;
    std::vector<double> sum(x.size(), 0.0);
    for (int r = 0; r < size_; ++r)
      for (std::size_t e = 0; e < x.size(); ++e)
        sum[e] += all[static_cast<std::size_t>(r) * x.size() + e];
    return sum;
  }

  /// MPI_Allgather of n elements from every rank into all (rank r's at r n).
  template <class T>
  void allgather(const T* mine, T* all, index_t n) {
    const int c = mpi_count(n, fn_);
    exchange(n * static_cast<index_t>(sizeof(T)), "MPI_Allgather",
             [&] { return MPI_Allgather(mine, c, mpi_type<T>(), all, c, mpi_type<T>(), comm_); });
  }
  /// MPI_Alltoall of n elements per pair of ranks: send's r-th n to rank r,
  /// rank r's n at recv + r n.
  template <class T>
  void alltoall(const T* send, T* recv, index_t n) {
    const int c = mpi_count(n, fn_);
    exchange(n * static_cast<index_t>(sizeof(T)), "MPI_Alltoall",
             [&] { return MPI_Alltoall(send, c, mpi_type<T>(), recv, c, mpi_type<T>(), comm_); });
  }
  double wait_seconds = 0;
  std::uint64_t bytes_sent = 0;

 private:
  /// Runs one collective that sends `bytes` to each other rank: its time
  /// counts as waiting, its bytes as sent.
  template <class F>
  void exchange(index_t bytes, const char* what, F&& call) {
    const double t0 = mpi_now();
    const int rc = call();
    wait_seconds += mpi_now() - t0;
    mpi_check(rc, fn_, what);
    bytes_sent += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(size_ - 1);
  }

  const char* fn_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

/// One named field of the argument header every rank must agree on.
struct HeaderField {
  const char* name;
  std::int64_t value;
};

/// The shape fields the ranks of every collective call compare, after
/// `first`: the batch size, the tokens per rank (named `tokens`), the query
/// heads, the head width, the key heads, the value heads, the value width;
/// then `rest`.
template <class Q, class K, class V>
std::vector<HeaderField> header_with_shapes(std::initializer_list<HeaderField> first,
                                            const char* tokens, const Q& q, const K& k, const V& v,
                                            std::initializer_list<HeaderField> rest) {
  const HeaderField shapes[] = {{"the batch size B", q.shape(0)}, {tokens, q.shape(1)},
                                {"the query heads", q.shape(2)},  {"the head width d", q.shape(3)},
                                {"the key heads", k.shape(2)},    {"the value heads", v.shape(2)},
                                {"the value width", v.shape(3)}};
  std::vector<HeaderField> h;
  h.reserve(first.size() + 7 + rest.size());
  for (const HeaderField& f : first) h.push_back(f);
  for (const HeaderField& f : shapes) h.push_back(f);
  for (const HeaderField& f : rest) h.push_back(f);
  return h;
}

/// Collective agreement, before any ring traffic. Each rank passes whether its
/// own checks passed (and the message if not) and its header; every rank gets
/// the same answer: if any rank failed, all throw (with the failing rank's
/// message), and if any header field differs from rank 0's, all throw naming
/// the field and both values. Never returns on one rank and throws on another.
inline void agree(RingComm& rc, bool ok, const std::string& message,
                  const std::vector<HeaderField>& header) {
  constexpr std::size_t kMsg = 400;
  const std::size_t nf = header.size();
  // Record: status, the fields, then the message bytes.
  const std::size_t words = 1 + nf + kMsg / sizeof(std::int64_t);
  std::vector<std::int64_t> mine(words, 0), all(words * static_cast<std::size_t>(rc.size()), 0);
  mine[0] = ok ? 0 : 1;
  for (std::size_t f = 0; f < nf; ++f) mine[1 + f] = header[f].value;
  std::memcpy(mine.data() + 1 + nf, message.data(), std::min(message.size(), kMsg - 1));
  mpi_check(MPI_Allgather(mine.data(), static_cast<int>(words), MPI_INT64_T, all.data(),
                          static_cast<int>(words), MPI_INT64_T, rc.get()),
            rc.fn(), "MPI_Allgather");
  const auto rec = [&](int r) { return all.data() + static_cast<std::size_t>(r) * words; };
  if (!ok) throw error(message);
  for (int r = 0; r < rc.size(); ++r) {
    if (rec(r)[0] != 0) {
      char text[kMsg] = {0};
      std::memcpy(text, rec(r) + 1 + nf, kMsg - 1);
      fail(rc.fn(), "rank ", r, " of ", rc.size(), " refused its arguments: ", text);
    }
  }
  for (int r = 1; r < rc.size(); ++r)
    for (std::size_t f = 0; f < nf; ++f)
      if (rec(r)[1 + f] != rec(0)[1 + f])
        fail(rc.fn(), "the ranks disagree on ", header[f].name, ": rank 0 has ", rec(0)[1 + f],
             ", rank ", r, " has ", rec(r)[1 + f],
             " (every rank must pass shards of the same shape and the same options)");
}

/// The bits of a double, for comparing scalars across ranks exactly.
inline std::int64_t bits_of(double x) {
  std::int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
