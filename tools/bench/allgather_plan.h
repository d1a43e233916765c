// The arithmetic of the all-gather benchmark (tools/bench/allgather_bench.cc), apart from any
// NCCL or CUDA so a unit test can pin it (tests/tools/bench_allgather_test.cc):
//   - nccl-tests' sizes and buffer shifts: all_gather_perf allocates one send and one receive
//     buffer of the largest size and, for call `iter` of a size, shifts both by a whole number of
//     messages inside them ("to avoid cache effects"), so a send buffer comes back only after
//     max / size calls; in place, the send buffer is the receive buffer + rank * send bytes;
//   - the FSDP-like program's pool: each step's copy-in and output buffers are carved from frame
//     step % frames of one allocation, so they differ from one step to the next.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace magi::bench {

// "4096", "4K", "256M", "1G" (binary units, either case), as nccl-tests' -b and -e read them.
inline std::optional<size_t> parse_size(std::string_view text) {
  if (text.empty()) return std::nullopt;
  size_t unit = 1;
  switch (text.back()) {
    case 'k':
    case 'K': unit = size_t{1} << 10; break;
    case 'm':
    case 'M': unit = size_t{1} << 20; break;
    case 'g':
    case 'G': unit = size_t{1} << 30; break;
    default: break;
  }
  if (unit != 1) text.remove_suffix(1);
  if (text.empty() || text.size() > 15) return std::nullopt;
  size_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<size_t>(c - '0');
  }
  return value * unit;
}

// The sizes nccl-tests visits: min, min * factor, ... while <= max (factor >= 2), or min alone
// when min == max. Empty when the range is empty or the factor cannot grow it.
inline std::vector<size_t> size_sequence(size_t min, size_t max, size_t factor) {
  std::vector<size_t> sizes;
  if (min == 0 || min > max) return sizes;
  if (factor < 2) return min == max ? std::vector<size_t>{min} : sizes;
  for (size_t size = min; size <= max; size *= factor) {
    sizes.push_back(size);
    if (size > max / factor) break;  // the next would overflow or pass max
  }
  return sizes;
}

// One all-gather of `size` bytes in all (nccl-tests' size column), `element` bytes an element.
struct GatherLayout {
  size_t count = 0;       // elements each rank sends
  size_t send_bytes = 0;  // count * element
  size_t recv_bytes = 0;  // send_bytes * nranks: the message, and the shift unit
};

inline GatherLayout gather_layout(size_t size, size_t element, int nranks) {
  GatherLayout layout;
  layout.count = size / element / static_cast<size_t>(nranks);
  layout.send_bytes = layout.count * element;
  layout.recv_bytes = layout.send_bytes * static_cast<size_t>(nranks);
  return layout;
}

// Where call `iter` of a size starts in buffers of `max_bytes` (nccl-tests: the message size
// times iter modulo how many messages fit). 0 for the largest size: it never shifts.
inline size_t call_shift(const GatherLayout& layout, size_t max_bytes, int iter) {
  if (layout.recv_bytes == 0) return 0;
  const size_t slots = std::max<size_t>(max_bytes / layout.recv_bytes, 1);
  return layout.recv_bytes * (static_cast<size_t>(iter) % slots);
}

// How many different send buffers `iters` calls of one size use.
inline size_t distinct_buffers(const GatherLayout& layout, size_t max_bytes, int iters) {
  if (layout.recv_bytes == 0 || iters <= 0) return 0;
  return std::min<size_t>(static_cast<size_t>(iters),
                          std::max<size_t>(max_bytes / layout.recv_bytes, 1));
}

// Offsets of the send and receive buffers of one call inside the two allocations. In place
// (nccl-tests' sendInplaceOffset), the send buffer is this rank's part of the receive buffer.
struct CallBuffers {
  bool send_in_recv = false;  // the send offset is into the receive allocation
  size_t send_offset = 0;
  size_t recv_offset = 0;
};

inline CallBuffers call_buffers(const GatherLayout& layout, size_t max_bytes, int iter, int rank,
                                bool in_place) {
  const size_t shift = call_shift(layout, max_bytes, iter);
  CallBuffers b;
  b.recv_offset = shift;
  b.send_in_recv = in_place;
  b.send_offset = in_place ? shift + layout.send_bytes * static_cast<size_t>(rank) : shift;
  return b;
}

// ---- the FSDP-like program ------------------------------------------------------------------

inline constexpr size_t kPoolAlignment = 512;  // what PyTorch's caching allocator rounds to
inline size_t pool_aligned(size_t bytes) {
  return (bytes + kPoolAlignment - 1) / kPoolAlignment * kPoolAlignment;
}

// Per-rank shard bytes of each layer: an embedding twice the size of a block, identical
// transformer blocks, and a head of one and a half (as FSDP wraps a transformer: one unit per
// block, one each for the embedding and the head). `layers` >= 1.
inline std::vector<size_t> fsdp_shard_bytes(int layers, size_t block_bytes) {
  std::vector<size_t> shards(static_cast<size_t>(std::max(layers, 1)), block_bytes);
  shards.front() = 2 * block_bytes;
  if (shards.size() > 1) shards.back() = block_bytes + block_bytes / 2;
  return shards;
}

// Where each layer's buffers lie in one frame of the pool. In place (FSDP2's all_gather_copy_in),
// the copy-in buffer is this rank's part of the output; otherwise (FSDP1 with a staged input) a
// buffer of its own before the output.
struct PoolLayout {
  struct Layer {
    size_t copy_in = 0;  // offset in the frame
    size_t output = 0;
  };
  std::vector<Layer> layers;
  size_t frame_bytes = 0;
  int frames = 1;
  size_t total_bytes() const { return frame_bytes * static_cast<size_t>(frames); }
  // Offset of step `step`'s frame: frame step % frames, so consecutive steps never share one
  // (frames >= 2) and each buffer comes back every `frames` steps.
  size_t frame_offset(int step) const {
    return frame_bytes * (static_cast<size_t>(step) % static_cast<size_t>(frames));
  }
};

inline PoolLayout pool_layout(const std::vector<size_t>& shard_bytes, int nranks, int rank,
                              bool in_place, int frames) {
  PoolLayout pool;
  pool.frames = std::max(frames, 1);
  size_t at = 0;
  for (const size_t shard : shard_bytes) {
    PoolLayout::Layer layer;
    if (!in_place) {
      layer.copy_in = at;
      at += pool_aligned(shard);
    }
    layer.output = at;
    if (in_place) layer.copy_in = at + shard * static_cast<size_t>(rank);
    at += pool_aligned(shard * static_cast<size_t>(nranks));
    pool.layers.push_back(layer);
  }
  pool.frame_bytes = at;
  return pool;
}

}  // namespace magi::bench
