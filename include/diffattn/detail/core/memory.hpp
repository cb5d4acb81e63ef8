// Large zero-filled buffers on transparent huge pages.
//
// A fresh 4 KiB page costs a fault on first touch: about 10 us on the
// virtual machines of the README's tables, so zero-filling a new 64 MiB
// buffer took 175 ms there, 40% of a 2-rank DIFF V1 call that gathers its
// keys (N = 16384) and more than its computation on some calls. Buffers of
// huge_page_bytes or more start on a huge page and ask Linux for transparent
// huge pages (madvise MADV_HUGEPAGE, which takes effect where
// /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always"): one
// fault per 2 MiB, the same 64 MiB then zero-filled in 5-10 ms. Elsewhere
// (other systems, THP "never", a refused request) the buffer is the same,
// on 4 KiB pages.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Size of a transparent huge page on x86-64 and aarch64 (4 KiB base pages).
constexpr std::size_t huge_page_bytes = std::size_t(2) << 20;

/// Alignment allocate_zeroed uses for `bytes`: `align`, or a huge page for a
/// buffer of huge_page_bytes or more.
inline std::size_t zeroed_alignment(std::size_t bytes, std::size_t align) noexcept {
  return bytes >= huge_page_bytes && align < huge_page_bytes ? huge_page_bytes : align;
}

/// `bytes` (> 0), uninitialised, aligned to zeroed_alignment(bytes, align);
/// free with ::operator delete(p, std::align_val_t(zeroed_alignment(bytes,
/// align))).
inline void* allocate_uninitialized(std::size_t bytes, std::size_t align) {
  const std::size_t a = zeroed_alignment(bytes, align);
  void* p = ::operator new(bytes, std::align_val_t(a));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (a == huge_page_bytes) (void)::madvise(p, bytes & ~(huge_page_bytes - 1), MADV_HUGEPAGE);
#endif
  return p;
}

/// allocate_uninitialized, then zero-filled.
inline void* allocate_zeroed(std::size_t bytes, std::size_t align) {
  void* p = allocate_uninitialized(bytes, align);
  std::memset(p, 0, bytes);
  return p;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
