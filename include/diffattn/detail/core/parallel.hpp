// The one threading primitive of the kernels: tasks handed out one at a time.
#pragma once

#include <algorithm>
#include <exception>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define DIFFATTN_DETAIL_FORK_GUARD 1
#endif
#endif

#include "../../config.hpp"
#include "fp_mode.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

#ifdef DIFFATTN_DETAIL_FORK_GUARD
/// Fork safety. GNU OpenMP keeps the threads of a thread's last team for its
/// next one and has no fork handler: a process forked by a thread that ran a
/// team holds that bookkeeping but none of the threads, and its first team of
/// two or more, any library's, waits for them forever (Python's
/// multiprocessing forks by default on Linux). So the thread that starts one
/// of the kernels' teams notes it, and in a child forked from such a thread a
/// fork handler sets OpenMP's max-active-levels to 0: every team of the child
/// runs on one thread (slower, never hung), whichever copy of these headers
/// or other library starts it.
inline thread_local bool tl_started_team = false;

/// Before a team starts on this thread: registers the fork handler (once per
/// copy of these headers in the process) and notes the team.
inline void note_team_start() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, [] {
    if (tl_started_team) omp_set_max_active_levels(0);
  });
  (void)registered;
  tl_started_team = true;
}
#endif

/// True where OpenMP runs no team of more than one thread: max-active-levels
/// is 0 (in a child forked after a team, see note_team_start, or as the user
/// set it). The kernels then resolve every call to one thread.
inline bool teams_disabled() noexcept {
#ifdef _OPENMP
  return omp_get_max_active_levels() == 0;
#else
  return false;
#endif
}

/// Threads to use: `requested`, else the OpenMP default (1 without OpenMP or
/// where teams_disabled: in a process forked after a team); never more than
/// there are tasks, never fewer than 1.
inline int resolve_threads(int requested, index_t tasks) {
#ifdef _OPENMP
  index_t n = requested > 0 ? requested : omp_get_max_threads();
  if (teams_disabled()) n = 1;
#else
  index_t n = 1;
  (void)requested;
#endif
  n = std::min(n, tasks);
  return static_cast<int>(std::max<index_t>(n, 1));
}

/// Multiply-adds below which a call runs on one thread: waking a team costs
/// more than the work. Measured on Zen 5 (2 cores), V2 over 8 tokens (8
/// heads of 64; 131k multiply-adds as run_attention counts them) took 24 us
/// on one thread and 25 on two, and 485 us on two next to another process
/// doing the same (OpenMP's waiting threads spin on the cores the other one
/// needs); over 32 tokens (2.1M) two threads were 1.4x faster than one. The
/// projections (linear.hpp) cross over at the same size: one row through a
/// 256 x 256 W (65k) took 5.4 us on one thread and 8.4 on two, through
/// 512 x 512 (262k) 21.2 and 16.1.
constexpr double kMinParallelWork = 262144;

/// resolve_threads for a call of `work` multiply-adds: 1 below
/// kMinParallelWork.
inline int resolve_threads(int requested, index_t tasks, double work) {
  return work < kMinParallelWork ? 1 : resolve_threads(requested, tasks);
}

/// Runs body(t) for every t in [0, tasks) on `threads` threads, handing tasks
/// out one at a time (dynamic schedule: causal tasks differ in cost), then
/// epilogue() once on each participating thread. An exception thrown by a task
/// (say, out of memory) is caught inside the parallel region and rethrown here
/// after every thread has finished; it never escapes an OpenMP region. Each
/// participating thread, the caller's included, runs its tasks and epilogue
/// with denormals flushed (fp_mode.hpp) and is put back in its own mode
/// after them; FlushDenormals = false (the float64 reference) keeps the mode.
template <bool FlushDenormals = true, class Body, class Epilogue>
void parallel_tasks(index_t tasks, int threads, Body&& body, Epilogue&& epilogue) {
  using Mode = std::conditional_t<FlushDenormals, DenormalsFlushed, CallerFpMode>;
#ifdef _OPENMP
  if (threads > 1 && !teams_disabled()) {
#ifdef DIFFATTN_DETAIL_FORK_GUARD
    note_team_start();
#endif
    std::exception_ptr failure;
#pragma omp parallel num_threads(threads)
    {
      Mode mode;
      (void)mode;
#pragma omp for schedule(dynamic, 1)
      for (index_t t = 0; t < tasks; ++t) {
        try {
          body(t);
        } catch (...) {
#pragma omp critical(diffattn_failure)
          if (!failure) failure = std::current_exception();
        }
      }
      epilogue();
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#endif
  (void)threads;
  Mode mode;
  (void)mode;
  for (index_t t = 0; t < tasks; ++t) body(t);
  epilogue();
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
