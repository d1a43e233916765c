// Agreement rounds where no NCCL call may run: while the program captures a CUDA graph, a round
// issued on its communicator would pair with the program's own calls on a rank that is not
// capturing, and a round recorded into the graph would run at each replay instead of now. The
// ranks of a communicator that all run on this host meet instead on a board: one POSIX
// shared-memory object per communicator, no NCCL, no CUDA, no stream.
//
// A round is what rewrite/ runs through NCCL otherwise: every rank contributes bytes and reads
// every rank's, in rank order. The k-th exchange of every rank meets the k-th of every other, and
// every rank that takes part in round k reads the same outcome (round_board.cc says why).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace magi::ce {

// How a board's name appears in /dev/shm (without the leading '/'): the prefix, then the
// communicator's identity in 16 hex digits.
inline constexpr char kBoardNamePrefix[] = "magice-board-";
std::string board_name(uint64_t identity);

// The largest contribution a board takes, per rank and round.
inline constexpr size_t kMaxBoardContribution = size_t{64} << 20;

struct BoardRound {
  enum class Outcome : uint8_t { Agreed, Abandoned };
  Outcome outcome = Outcome::Abandoned;
  std::vector<uint8_t> all;  // Agreed: every rank's contribution, of one size, in rank order
  std::string why;           // Abandoned: one line for the log ("rank 2 did not come within ...")
};

class RoundBoard {
 public:
  virtual ~RoundBoard() = default;
  // This rank's next round: returns once every rank of the communicator contributed to the same
  // round (Agreed: contributions of one size), or once the round is abandoned: a rank waited past
  // its `deadline` (counted from this call), found a peer gone, or the sizes differ. A round
  // abandoned before this rank came is abandoned for it at once. Never throws for what a peer
  // does; throws Error(Usage) in a forked child (below). One thread at a time.
  virtual BoardRound exchange(std::span<const uint8_t> mine,
                              std::chrono::milliseconds deadline) = 0;
};

// The board of communicator `identity` (equal on all ranks, different between jobs) for `rank`
// of `nranks`, created by the first rank to come and joined by the others. The name is removed
// once every rank joined, or by its creator when its board is destroyed; a rank that comes
// after that makes a board of its own, whose rounds are abandoned at their deadline. Throws
// magi::Error when the board cannot be made or joined (a board of another size under the name,
// the rank already taken).
//
// After fork the child holds the parent's board but may do nothing with it but destroy it,
// which only unmaps it in the child: its rounds are the parent's.
std::unique_ptr<RoundBoard> open_round_board(uint64_t identity, int rank, int nranks);

}  // namespace magi::ce
