// Per-thread scratch memory of the fused kernels, reused across calls.
//
// Fresh pages cost a fault each on first touch, so every thread keeps its
// buffers between calls (thread_local: concurrent callers never share one).
// Buffers above kRetainBytes are released at the end of the call that needed
// them, so one very long call does not pin its memory for the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

#include "../../config.hpp"
#include "memory.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

/// Grow-only, 64-byte aligned, uninitialised buffer; from 2 MiB on transparent
/// huge pages (allocate_uninitialized).
template <class T>
class ScratchBuffer {
 public:
  T* get(index_t n) {
    if (n > capacity_) {
      data_.reset();
      const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(T);
      data_ = std::unique_ptr<T, Delete>(static_cast<T*>(allocate_uninitialized(bytes, 64)),
                                         Delete{zeroed_alignment(bytes, 64)});
      capacity_ = n;
    }
    return data_.get();
  }
  std::size_t bytes() const { return static_cast<std::size_t>(capacity_) * sizeof(T); }
  void release() {
    data_.reset();
    capacity_ = 0;
  }

 private:
  struct Delete {
    std::size_t align = 64;
    void operator()(T* p) const noexcept { ::operator delete(p, std::align_val_t(align)); }
  };
  std::unique_ptr<T, Delete> data_;
  index_t capacity_ = 0;
};

template <class T>
struct Workspace {
  static constexpr std::size_t kRetainBytes = std::size_t(32) << 20;

  ScratchBuffer<T> q[2];  // scaled query block of each map      (kBlockM, d)
  ScratchBuffer<T> k[2];  // key panels of each map              (keys, d) packed
  ScratchBuffer<T> s[2];  // score rows; s[0] becomes W          (kBlockM, keys)
  ScratchBuffer<T> v;     // values of the packed keys, column panels (keys, dv)
  ScratchBuffer<T> o;     // output accumulator                  (kBlockM, dv)
  ScratchBuffer<T> lse;   // decoding: log-sum-exp of each query row's state (rows)
  ScratchBuffer<T> row;   // decoding: one 16-bit K, V or output row widened to T (d or dv)
  // bf16 dot products (bf16_dot.hpp): q and k as pairs of bf16 per word, in place of q, k.
  ScratchBuffer<std::uint32_t> q_pairs[2];  // (kBlockM, d / 2)
  ScratchBuffer<std::uint32_t> k_pairs[2];  // (keys, d / 2) packed
  // W V on bf16 dot products (bf16_wv.hpp): values and W as pairs of keys per word, in place of v.
  ScratchBuffer<std::uint32_t> v_pairs;  // (keys / 2, dv) packed
  ScratchBuffer<std::uint32_t> w_pairs;  // (kBlockM, keys / 2)

  // Which keys k[] and v hold, [packed_begin, packed_end) of one sequence and kv
  // group, so that consecutive blocks of one head skip repacking.
  std::uint64_t packed_call = 0;
  index_t packed_seq = -1, packed_group = -1, packed_begin = 0, packed_end = 0;

  void trim() {
    ScratchBuffer<T>* all[] = {&q[0], &q[1], &k[0], &k[1], &s[0], &s[1], &v, &o, &lse, &row};
    ScratchBuffer<std::uint32_t>* pairs[] = {&q_pairs[0], &q_pairs[1], &k_pairs[0],
                                             &k_pairs[1], &v_pairs,    &w_pairs};
    std::size_t total = 0;
    for (auto* b : all) total += b->bytes();
    for (auto* b : pairs) total += b->bytes();
    if (total > kRetainBytes) {
      for (auto* b : all) b->release();
      for (auto* b : pairs) b->release();
      packed_call = 0;
    }
  }
};

/// This thread's workspace for scalar T.
template <class T>
inline Workspace<T>& thread_workspace() {
  static thread_local Workspace<T> ws;
  return ws;
}

}  // namespace detail
DIFFATTN_END_NAMESPACE
