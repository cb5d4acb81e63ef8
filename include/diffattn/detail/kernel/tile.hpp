// Tile configuration of the fused kernels, and why the sizes are what they are.
#pragma once

#include <Eigen/Core>

#include "../../config.hpp"

DIFFATTN_BEGIN_NAMESPACE
namespace detail {

template <class T>
struct TileConfig {
  /// Eigen's widest packet for T on this target: 8 floats with AVX, 4 with
  /// SSE or NEON, 1 when vectorisation is off. The kernels are written once on
  /// Eigen's packet math and need no -march flag.
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int kPacket = Eigen::internal::unpacket_traits<Packet>::size;

  /// Register tile of the micro-kernel: kMR rows x kNR columns. 6 x 2 packets
  /// hold 12 accumulators, plus 2 loads and 1 broadcast: 15 of the 16 vector
  /// registers of x86-64 (AVX2) and well within NEON's 32. Per step it issues
  /// 12 FMAs against 8 loads, so the FMA units, not the loads, set the pace.
  static constexpr int kMR = 6;
  static constexpr int kNR = 2 * kPacket;

  /// Queries per block: 10 register tiles. The block's scaled queries
  /// (60 x d, 15 KiB at d = 64 in float) stay in L1 while key panels stream
  /// past, and every key and value row loaded is used by 60 queries. The score
  /// rows of the block against all its visible keys (60 x M per map) are the
  /// kernel's only large buffer: linear in M, independent of N.
  static constexpr index_t kBlockM = 60;

  /// Keys per chunk of the W V product: a packed value chunk (256 x 2d, 128 KiB
  /// at 2d = 128 in float) stays in L2 while every row tile of the block
  /// consumes it, and a W row chunk (256 floats, 1 KiB) in L1.
  static constexpr index_t kBlockN = 256;

  /// Blocks of keys packed ahead under a sliding window: the keys of the
  /// next 8 blocks to the left are packed with the current block's, so K is
  /// packed about once per 8 blocks instead of once per block. (Without a
  /// window the first block packs every key and nothing is ever repacked.)
  static constexpr index_t kPackAhead = 8;

  /// Vector registers of the target: 32 with AVX-512 and on AArch64, 16
  /// with AVX2 / SSE. The decoding step sizes its register blocks by it.
#if defined(__AVX512F__) || defined(__aarch64__)
  static constexpr int kVectorRegisters = 32;
#else
  static constexpr int kVectorRegisters = 16;
#endif

  static_assert(kBlockM % kMR == 0, "query blocks are whole register tiles");
};

/// Keys per chunk of a split decoding step. A decoding step (fewer than kMR
/// new queries) of a sequence whose visible keys exceed this is split into
/// chunks of this many keys, each a task that leaves a softmax state per map
/// and query row, merged in chunk order. The count follows from the problem
/// alone (never from the thread count), so results do not depend on the
/// threads. 1024 keys give a 4k cache of one sequence four tasks, keep the
/// score rows of 16 query heads in L2 (16 x 1024 floats = 64 KiB), and make
/// the merge (dv + 1 values per row and chunk) negligible next to the 1024 K
/// and V rows a chunk reads.
constexpr index_t kSplitKeys = 1024;

/// Smallest multiple of `m` that is >= x (x >= 0, m > 0).
constexpr index_t round_up(index_t x, index_t m) noexcept { return (x + m - 1) / m * m; }

}  // namespace detail
DIFFATTN_END_NAMESPACE
