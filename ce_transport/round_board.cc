// The round board: one POSIX shared-memory object per communicator, `/magice-board-<identity>`,
// mapped by every rank of it on this host.
//
//   [ head | one set of words per rank | rank 0's two buffers | rank 1's two buffers | ... ]
//
// The object is sized once for every buffer at its largest, and only the pages a rank reserves
// (posix_fallocate, as its contributions grow) take memory; every rank maps it whole, so a peer's
// larger contribution never needs a new mapping.
//
// Why every rank reads one outcome. A round's outcome is one word, `decision`: (round, state),
// changed only by compare-and-swap. A rank installs round k there when it comes first (over the
// decided round before it), and the round is decided once, from Undecided: to Agreed by a rank
// that finds every rank's `contributed` word at k (the last to come, or any waiter that sees it
// first), to Abandoned by a rank giving up (its deadline, a peer gone, sizes that differ, a failure
// of its own). Whoever loses a CAS reads the winner's word. A rank skips round k (Abandoned at
// once) only after reading the word past Undecided for k, and says nothing of k: so a rank that
// sees every `contributed` word at k and then wins the CAS knows every rank did contribute to k.
// The word moves on to round k + 1 while a rank that took part in k may not have read it yet:
// such a rank reads `last_agreed` instead, which whoever replaces an Agreed round raises to it
// before the CAS that replaces it. No later round can be agreed without that rank, so
// `last_agreed` is k exactly when k was agreed.
//
// Why no byte is read stale or overwritten while read. A rank writes its contribution to round k
// into its buffer k % 2, then its size, then `contributed` = k (release); the rank that agrees
// acquired every `contributed` word before its CAS, and readers acquire the decision. A buffer is
// written again two rounds later; when the round that last used it was agreed, the writer first
// waits until every peer's `finished` word says it read that round (or the peer is gone).
//
// Why nothing hangs. Every wait ends at the caller's deadline, and gives up sooner on a peer that
// left the board or whose process is gone (process.h's rule, asked every 20 ms); waits spin
// briefly, then sleep in steps growing to 1 ms.
#include "ce_transport/round_board.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>

#include "base/base.h"
#include "base/spin_lock.h"
#include "ce_transport/process.h"

namespace magi::ce {
namespace {

constexpr size_t kLine = 64;
constexpr uint64_t kReadyMark = 0x6d61676963652d62;  // "magice-b"
constexpr int kMaxRanks = 4095;                      // a rank fits in 12 bits of the decision
constexpr size_t kDataAlignment = size_t{2} << 20;
constexpr size_t kFirstReservation = size_t{64} << 10;
constexpr uint64_t kLivenessPeriodNs = 20'000'000;
constexpr uint64_t kJoinLimitNs = 10'000'000'000;     // a creator that never finishes its board
constexpr int64_t kLongestWaitMs = int64_t{1} << 40;  // 35 years: no overflow in nanoseconds

struct alignas(kLine) Word {
  std::atomic<uint64_t> value{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "words are shared between processes");

struct BoardHead {
  Word ready;         // kReadyMark once the creator has made every word
  Word nranks;        // so a rank of another size refuses the board
  Word joined;        // ranks that joined; the one completing the count removes the name
  Word name_removed;  // 1 once a rank took the name's removal on itself (only one removes it)
  Word decision;      // the latest round installed and its state (Decision)
  Word last_agreed;   // round + 1 of the latest agreed round a later one replaced (only rises)
  Word replaced;      // the latest abandoned decision a later round replaced: its why
};
struct RankWords {
  Word pid;          // the rank's process, once it joined
  Word left;         // 1 once the rank destroyed its board: it comes to no later round
  Word contributed;  // round + 1 of its latest contribution, published after its bytes
  Word finished;     // round + 1 of the latest round it is done with (bytes copied)
  Word size[2];      // the bytes of its contribution in each of its buffers
};
constexpr size_t kRanksOffset = sizeof(BoardHead);

// Why a round is abandoned; `by` decided it, `about` names the rank it is about.
enum class State : uint64_t {
  Undecided = 0,
  Agreed,
  TimedOut,     // `about` did not come before `by`'s deadline
  PeerGone,     // `about`'s process is gone
  PeerLeft,     // `about` destroyed its board
  SizesDiffer,  // `about` contributed another size than rank 0
  Refused,      // `by` could not contribute (a failure of its own)
  ReaderLate,   // `about` had not read a buffer `by` must write before `by`'s deadline
};
struct Decision {
  uint64_t round1 = 0;  // round + 1; 0 before the first round
  State state = State::Undecided;
  int by = 0;
  int about = 0;
};
// [ round + 1 : 36 | state : 4 | by : 12 | about : 12 ]
uint64_t pack(const Decision& d) {
  return d.round1 << 28 | static_cast<uint64_t>(d.state) << 24 | static_cast<uint64_t>(d.by) << 12 |
         static_cast<uint64_t>(d.about);
}
Decision unpack(uint64_t word) {
  return {word >> 28, static_cast<State>(word >> 24 & 0xf), static_cast<int>(word >> 12 & 0xfff),
          static_cast<int>(word & 0xfff)};
}

size_t data_offset(int nranks) {
  const size_t words = kRanksOffset + static_cast<size_t>(nranks) * sizeof(RankWords);
  return (words + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
}
size_t board_bytes(int nranks) {
  return data_offset(nranks) + static_cast<size_t>(nranks) * 2 * kMaxBoardContribution;
}

// Spins a few microseconds (a peer on another core is usually that close), yields a little
// (ranks may outnumber cores), then sleeps in doubling steps up to 1 ms.
class Backoff {
 public:
  void pause() {
    if (polls_ < kSpins) {
      ++polls_;
      cpu_relax();
      return;
    }
    if (polls_ < kSpins + kYields) {
      ++polls_;
      sched_yield();
      return;
    }
    const timespec nap{0, static_cast<long>(nap_ns_)};
    nanosleep(&nap, nullptr);
    nap_ns_ = std::min<uint64_t>(nap_ns_ * 2, 1'000'000);
  }

 private:
  static constexpr int kSpins = 256;
  static constexpr int kYields = 16;
  int polls_ = 0;
  uint64_t nap_ns_ = 2'000;
};

// Raises `word` to `value` unless it is higher already.
void raise_to(std::atomic<uint64_t>& word, uint64_t value) {
  uint64_t seen = word.load(std::memory_order_acquire);
  while (seen < value && !word.compare_exchange_weak(seen, value, std::memory_order_acq_rel,
                                                     std::memory_order_acquire)) {}
}

[[noreturn]] void fail(const std::string& what, int err) {
  throw Error(ErrorKind::System, what + ": " + std::strerror(err));
}

class SharedBoard final : public RoundBoard {
 public:
  SharedBoard(uint64_t identity, int rank, int nranks)
      : identity_(identity),
        rank_(rank),
        nranks_(nranks),
        pid_(getpid()),
        name_("/" + board_name(identity)),
        bytes_(board_bytes(nranks)) {}

  ~SharedBoard() override {
    // A forked child only unmaps: the words and the name are its parent's.
    if (base_ != nullptr && getpid() == pid_) {
      if (joined_) own().left.value.store(1, std::memory_order_release);
      // Once a rank left, no later round of this board can be agreed: nobody needs the name.
      if (joined_ || created_) remove_name();
    }
    if (base_ != nullptr) munmap(base_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  // Creates the board, or joins the one a peer made (which may be removed meanwhile: then
  // creates it afresh).
  void open() {
    const uint64_t give_up = clock_ns() + kJoinLimitNs;
    for (;;) {
      fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd_ >= 0) {
        create();
        break;
      }
      if (errno != EEXIST) fail("creating round board " + name_, errno);
      fd_ = shm_open(name_.c_str(), O_RDWR, 0);
      if (fd_ >= 0) {
        join_made(give_up);
        break;
      }
      if (errno != ENOENT) fail("opening round board " + name_, errno);
    }
    RankWords& mine = own();
    uint64_t nobody = 0;
    if (!mine.pid.value.compare_exchange_strong(nobody, static_cast<uint64_t>(pid_),
                                                std::memory_order_acq_rel))
      throw Error(ErrorKind::Usage, "rank " + std::to_string(rank_) + " of round board " + name_ +
                                        " is taken by pid " + std::to_string(nobody));
    joined_ = true;
    const uint64_t joined = head().joined.value.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (joined == static_cast<uint64_t>(nranks_)) remove_name();
    MAGI_INFO(Transport, "comm %012llx: round board %s %s (rank %d of %d)", short_id(identity_),
              name_.c_str(), created_ ? "made" : "joined", rank_, nranks_);
  }

  BoardRound exchange(std::span<const uint8_t> mine, std::chrono::milliseconds deadline) override {
    if (getpid() != pid_)
      throw Error(ErrorKind::Usage, "round board " + name_ + " used in a forked child");
    const uint64_t round1 = ++rounds_;
    const uint64_t start = clock_ns();
    const uint64_t wait_ms =
        static_cast<uint64_t>(std::clamp<int64_t>(deadline.count(), 0, kLongestWaitMs));
    const Round round{round1, start + wait_ms * 1'000'000, start, wait_ms};
    BoardRound result = take_part(round, mine);
    own().finished.value.store(round1, std::memory_order_release);
    return result;
  }

 private:
  struct Round {
    uint64_t round1;
    uint64_t deadline_ns;
    uint64_t start_ns;
    uint64_t wait_ms;
    int buffer() const { return static_cast<int>(round1 % 2); }
  };

  BoardHead& head() const { return *std::launder(static_cast<BoardHead*>(base_)); }
  RankWords& words(int rank) const {
    return *std::launder(
        reinterpret_cast<RankWords*>(static_cast<uint8_t*>(base_) + kRanksOffset +
                                     static_cast<size_t>(rank) * sizeof(RankWords)));
  }
  RankWords& own() const { return words(rank_); }
  size_t buffer_offset(int rank, int buffer) const {
    return data_offset(nranks_) +
           (static_cast<size_t>(rank) * 2 + static_cast<size_t>(buffer)) * kMaxBoardContribution;
  }
  uint8_t* buffer_at(int rank, int buffer) const {
    return static_cast<uint8_t*>(base_) + buffer_offset(rank, buffer);
  }
  std::atomic<uint64_t>& decision() const { return head().decision.value; }

  void map() {
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (base == MAP_FAILED) fail("mapping round board " + name_, errno);
    base_ = base;
  }

  void create() {
    created_ = true;
    if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
      const int err = errno;
      remove_name_now();
      fail("sizing round board " + name_, err);
    }
    try {
      map();
    } catch (...) {
      remove_name_now();
      throw;
    }
    ::new (base_) BoardHead{};
    for (int r = 0; r < nranks_; ++r) ::new (&words(r)) RankWords{};
    head().nranks.value.store(static_cast<uint64_t>(nranks_), std::memory_order_relaxed);
    head().ready.value.store(kReadyMark, std::memory_order_release);
  }

  // A peer made the board: waits until it is sized, then until its words are made.
  void join_made(uint64_t give_up) {
    Backoff backoff;
    struct stat st {};
    for (;;) {
      if (fstat(fd_, &st) != 0) fail("inspecting round board " + name_, errno);
      if (st.st_size != 0) break;
      if (clock_ns() > give_up)
        throw Error(ErrorKind::System, "round board " + name_ + " was never sized by its maker");
      backoff.pause();
    }
    if (static_cast<uint64_t>(st.st_size) != bytes_)
      throw Error(ErrorKind::Usage, "round board " + name_ + " holds " +
                                        std::to_string(st.st_size) + " bytes, not the " +
                                        std::to_string(bytes_) + " of " + std::to_string(nranks_) +
                                        " ranks");
    map();
    while (head().ready.value.load(std::memory_order_acquire) != kReadyMark) {
      if (clock_ns() > give_up)
        throw Error(ErrorKind::System, "round board " + name_ + " was never made ready");
      backoff.pause();
    }
    const uint64_t nranks = head().nranks.value.load(std::memory_order_relaxed);
    if (nranks != static_cast<uint64_t>(nranks_))
      throw Error(ErrorKind::Usage, "round board " + name_ + " is of " + std::to_string(nranks) +
                                        " ranks, not " + std::to_string(nranks_));
  }

  // The name goes once: whoever first takes it on removes it, so a board made afresh under the
  // same name is never removed for an older one.
  void remove_name() {
    if (head().name_removed.value.exchange(1, std::memory_order_acq_rel) == 0) remove_name_now();
  }
  void remove_name_now() { shm_unlink(name_.c_str()); }

  // ---- a round -------------------------------------------------------------------------------

  BoardRound take_part(const Round& round, std::span<const uint8_t> mine) {
    if (std::optional<Decision> made = enter(round.round1))
      return read_outcome(round, *made, false);
    if (mine.size() > kMaxBoardContribution)
      return give_up(round, State::Refused, rank_,
                     "a contribution of " + std::to_string(mine.size()) +
                         " bytes is larger than a round board takes (" +
                         std::to_string(kMaxBoardContribution) + ")");
    if (std::optional<Decision> made = wait_for_readers(round))
      return read_outcome(round, *made, false);
    if (std::optional<std::string> failed = reserve(round.buffer(), mine.size()))
      return give_up(round, State::Refused, rank_, *failed);
    RankWords& me = own();
    if (!mine.empty()) std::memcpy(buffer_at(rank_, round.buffer()), mine.data(), mine.size());
    me.size[round.buffer()].value.store(mine.size(), std::memory_order_relaxed);
    me.contributed.value.store(round.round1, std::memory_order_release);
    return read_outcome(round, wait_for_decision(round), true);
  }

  // Installs the round unless it is decided already (a rank that did not come in time); returns
  // that decision then.
  std::optional<Decision> enter(uint64_t round1) {
    uint64_t word = decision().load(std::memory_order_acquire);
    for (;;) {
      const Decision d = unpack(word);
      if (d.round1 > round1 || (d.round1 == round1 && d.state != State::Undecided)) return d;
      if (d.round1 == round1) return std::nullopt;
      // An earlier round, decided: whoever took part in it and has not read it yet reads what
      // replaces it (the file's top).
      if (d.state == State::Agreed) {
        raise_to(head().last_agreed.value, d.round1);
      } else if (d.round1 != 0) {
        head().replaced.value.store(word, std::memory_order_release);
      }
      if (decision().compare_exchange_weak(word, pack({round1, State::Undecided, 0, 0}),
                                           std::memory_order_acq_rel, std::memory_order_acquire))
        return std::nullopt;
    }
  }

  // Decides the round from Undecided; false when another rank decided first.
  bool decide(uint64_t& word, uint64_t round1, State state, int by, int about) {
    return decision().compare_exchange_strong(word, pack({round1, state, by, about}),
                                              std::memory_order_acq_rel, std::memory_order_acquire);
  }

  // This rank abandons the round for a reason only it knows (`why`), unless it was decided.
  BoardRound give_up(const Round& round, State state, int about, const std::string& why) {
    uint64_t word = pack({round.round1, State::Undecided, 0, 0});
    if (decide(word, round.round1, state, rank_, about)) {
      MAGI_WARN(Transport, "comm %012llx: round %llu of the round board abandoned: %s",
                short_id(identity_), static_cast<unsigned long long>(round.round1 - 1),
                why.c_str());
      return {BoardRound::Outcome::Abandoned, {}, why};
    }
    return read_outcome(round, unpack(word), false);
  }

  // Before writing a buffer again: every peer that read the agreed round it last held is done
  // with it (or left, or gone). Returns the round's decision if it was made meanwhile without
  // this rank.
  std::optional<Decision> wait_for_readers(const Round& round) {
    uint64_t& agreed = agreed_in_[round.buffer()];
    if (agreed == 0) return std::nullopt;
    Backoff backoff;
    uint64_t next_look = round.start_ns + kLivenessPeriodNs / 2;
    std::vector<bool> gone(static_cast<size_t>(nranks_), false);
    for (;;) {
      int reading = -1;
      for (int r = 0; r < nranks_ && reading < 0; ++r)
        if (r != rank_ && !gone[static_cast<size_t>(r)] &&
            words(r).finished.value.load(std::memory_order_acquire) < agreed &&
            words(r).left.value.load(std::memory_order_acquire) == 0)
          reading = r;
      if (reading < 0) {
        agreed = 0;
        return std::nullopt;
      }
      uint64_t word = decision().load(std::memory_order_acquire);
      const Decision d = unpack(word);
      if (d.round1 != round.round1 || d.state != State::Undecided) return d;
      const uint64_t now = clock_ns();
      if (now >= round.deadline_ns) {
        decide(word, round.round1, State::ReaderLate, rank_, reading);
        continue;
      }
      if (now >= next_look) {
        next_look = now + kLivenessPeriodNs;
        for (int r = 0; r < nranks_; ++r)
          if (r != rank_ && !gone[static_cast<size_t>(r)]) gone[static_cast<size_t>(r)] = !alive(r);
        continue;
      }
      backoff.pause();
    }
  }

  // False once the rank joined and its process is gone (process.h's rule).
  bool alive(int rank) const {
    const uint64_t pid = words(rank).pid.value.load(std::memory_order_acquire);
    return pid == 0 || process_alive(static_cast<pid_t>(pid));
  }

  // Pages for a contribution of `bytes` in this rank's buffer, reserved now so that a full
  // /dev/shm is a refusal here, not a SIGBUS at the copy. Doubling, so a round rarely reserves.
  std::optional<std::string> reserve(int buffer, size_t bytes) {
    size_t& reserved = reserved_[buffer];
    if (bytes <= reserved) return std::nullopt;
    const size_t want =
        std::min(kMaxBoardContribution, std::bit_ceil(std::max(bytes, kFirstReservation)));
    const int err = posix_fallocate(fd_, static_cast<off_t>(buffer_offset(rank_, buffer)),
                                    static_cast<off_t>(want));
    if (err != 0)
      return "reserving " + std::to_string(want) + " bytes of /dev/shm for round board " + name_ +
             ": " + std::strerror(err);
    reserved = want;
    return std::nullopt;
  }

  // Waits, contributed, until the round is decided, deciding it when this rank can.
  Decision wait_for_decision(const Round& round) {
    Backoff backoff;
    uint64_t next_look = round.start_ns + kLivenessPeriodNs / 2;
    const int buffer = round.buffer();
    for (;;) {
      uint64_t word = decision().load(std::memory_order_acquire);
      const Decision d = unpack(word);
      if (d.round1 != round.round1 || d.state != State::Undecided) return d;
      int missing = -1;
      for (int r = 0; r < nranks_ && missing < 0; ++r)
        if (words(r).contributed.value.load(std::memory_order_acquire) != round.round1) missing = r;
      if (missing < 0) {
        const uint64_t first = words(0).size[buffer].value.load(std::memory_order_relaxed);
        int differs = -1;
        for (int r = 1; r < nranks_ && differs < 0; ++r)
          if (words(r).size[buffer].value.load(std::memory_order_relaxed) != first) differs = r;
        if (differs < 0) {
          decide(word, round.round1, State::Agreed, rank_, 0);
        } else {
          decide(word, round.round1, State::SizesDiffer, rank_, differs);
        }
        continue;
      }
      const uint64_t now = clock_ns();
      if (now >= round.deadline_ns) {
        decide(word, round.round1, State::TimedOut, rank_, missing);
        continue;
      }
      if (now >= next_look) {
        next_look = now + kLivenessPeriodNs;
        for (int r = 0; r < nranks_; ++r) {
          if (words(r).contributed.value.load(std::memory_order_acquire) == round.round1) continue;
          State why = State::Undecided;
          if (words(r).left.value.load(std::memory_order_acquire) != 0) {
            why = State::PeerLeft;
          } else if (!alive(r)) {
            why = State::PeerGone;
          }
          if (why == State::Undecided) continue;
          decide(word, round.round1, why, rank_, r);
          break;
        }
      }
      backoff.pause();
    }
  }

  // What the decision `d` (the round's, or a later round's) means for this rank.
  BoardRound read_outcome(const Round& round, const Decision& d, bool contributed) {
    Decision of_round = d;
    if (d.round1 > round.round1) {
      // Replaced by a later round: agreed exactly when last_agreed names it (the file's top).
      if (contributed && head().last_agreed.value.load(std::memory_order_acquire) == round.round1) {
        of_round = {round.round1, State::Agreed, 0, 0};
      } else {
        const Decision replaced = unpack(head().replaced.value.load(std::memory_order_acquire));
        if (replaced.round1 != round.round1 || replaced.state == State::Agreed) {
          return {BoardRound::Outcome::Abandoned,
                  {},
                  "round " + std::to_string(round.round1 - 1) + " was over before rank " +
                      std::to_string(rank_) + " came"};
        }
        of_round = replaced;
      }
    }
    if (of_round.state == State::Agreed) {
      BoardRound agreed{BoardRound::Outcome::Agreed, {}, {}};
      const int buffer = round.buffer();
      const size_t size = words(0).size[buffer].value.load(std::memory_order_relaxed);
      agreed.all.resize(size * static_cast<size_t>(nranks_));
      for (int r = 0; r < nranks_; ++r)
        if (size != 0)
          std::memcpy(agreed.all.data() + size * static_cast<size_t>(r), buffer_at(r, buffer),
                      size);
      agreed_in_[buffer] = round.round1;
      return agreed;
    }
    return {BoardRound::Outcome::Abandoned, {}, why(of_round, round)};
  }

  // One line for an abandoned round: what its deciding rank saw, with this rank's own deadline
  // when this rank decided (no other process holds its rank on the board).
  std::string why(const Decision& d, const Round& round) const {
    const bool decided_here = d.by == rank_;
    const std::string about = "rank " + std::to_string(d.about);
    const std::string by = "rank " + std::to_string(d.by);
    switch (d.state) {
      case State::TimedOut:
        return about + " did not come within " +
               (decided_here ? std::to_string(round.wait_ms) + " ms" : by + "'s deadline");
      case State::PeerGone:
        return about + " (pid " +
               std::to_string(words(d.about).pid.value.load(std::memory_order_acquire)) +
               ") is gone";
      case State::PeerLeft: return about + " left the round board";
      case State::SizesDiffer:
        return about + " contributed " +
               std::to_string(
                   words(d.about).size[round.buffer()].value.load(std::memory_order_relaxed)) +
               " bytes, rank 0 " +
               std::to_string(words(0).size[round.buffer()].value.load(std::memory_order_relaxed));
      case State::Refused: return by + " could not contribute";
      case State::ReaderLate:
        return about + " had not finished reading an earlier round within " +
               (decided_here ? std::to_string(round.wait_ms) + " ms" : by + "'s deadline");
      case State::Agreed:
      case State::Undecided: break;
    }
    return "round " + std::to_string(d.round1 - 1) + " was abandoned";
  }

  const uint64_t identity_;
  const int rank_;
  const int nranks_;
  const pid_t pid_;  // the process that opened the board; a forked child's differs
  const std::string name_;
  const size_t bytes_;
  int fd_ = -1;
  void* base_ = nullptr;
  bool created_ = false;
  bool joined_ = false;
  uint64_t rounds_ = 0;             // this rank's rounds so far
  size_t reserved_[2] = {0, 0};     // pages reserved in each of this rank's buffers
  uint64_t agreed_in_[2] = {0, 0};  // round + 1 of the agreed round a buffer last held, unread
};

}  // namespace

std::string board_name(uint64_t identity) {
  char name[48];
  std::snprintf(name, sizeof(name), "%s%016llx", kBoardNamePrefix,
                static_cast<unsigned long long>(identity));
  return name;
}

std::unique_ptr<RoundBoard> open_round_board(uint64_t identity, int rank, int nranks) {
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
    throw Error(ErrorKind::Usage,
                "a round board for rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  auto board = std::make_unique<SharedBoard>(identity, rank, nranks);
  board->open();
  return board;
}

}  // namespace magi::ce
