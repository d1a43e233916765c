#include "capture/trace_writer.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "base/host.h"
#include "base/spin_lock.h"

namespace magi::capture {

class TraceWriter {
 public:
  TraceWriter(int fd, size_t buffer_bytes) : fd_(fd), capacity_(buffer_bytes) {
    active_.reserve(capacity_);
    spare_.reserve(capacity_);
  }

  void append(trace::RecordType type, const void* payload, uint32_t payload_bytes, const void* tail,
              uint32_t tail_bytes) {
    const uint32_t bytes = trace::record_bytes(payload_bytes, tail_bytes);
    if (bytes > capacity_) return;  // cannot happen with the record types we write
    std::lock_guard<SpinLock> guard(lock_);
    if (closed_) return;
    if (active_.size() + bytes > capacity_ && !swap_locked()) {
      ++dropped_;
      return;
    }
    if (dropped_ != 0 && active_.size() + bytes + kDroppedBytes <= capacity_) put_dropped_locked();
    put_locked(type, payload, payload_bytes, tail, tail_bytes);
  }

  // Hands over the active buffer and waits until the writer has written everything.
  void flush() {
    {
      std::lock_guard<SpinLock> guard(lock_);
      if (closed_) return;
      // Drops not yet counted in the file go out now: the last records before a flush (or the
      // close at exit) may have been the dropped ones, with no later record to carry the count.
      if (dropped_ != 0) {
        if (active_.size() + kDroppedBytes > capacity_) {
          wait_for_spare_locked();
          swap_locked();
        }
        put_dropped_locked();
      }
      if (!active_.empty()) {
        wait_for_spare_locked();
        swap_locked();
      }
    }
    std::unique_lock<std::mutex> lk(mutex_);
    idle_.wait(lk, [&] { return !pending_ && !writing_; });
  }

  void close() {
    flush();
    {
      std::lock_guard<SpinLock> guard(lock_);
      closed_ = true;
    }
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // After fork(): the writer thread does not exist in the child. Touch neither it nor the locks
  // (another parent thread may have held them); just let go of the inherited descriptor.
  void abandon() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  void write_header(const trace::FileHeader& header) {
    std::lock_guard<SpinLock> guard(lock_);
    const auto* p = reinterpret_cast<const char*>(&header);
    active_.insert(active_.end(), p, p + sizeof(header));
  }

 private:
  void put_locked(trace::RecordType type, const void* payload, uint32_t payload_bytes,
                  const void* tail, uint32_t tail_bytes) {
    const size_t at = active_.size();
    active_.resize(at + trace::record_bytes(payload_bytes, tail_bytes));  // reserved: no allocation
    trace::encode_record(active_.data() + at, type, payload, payload_bytes, tail, tail_bytes);
  }

  static constexpr size_t kDroppedBytes =
      sizeof(trace::RecordHeader) + sizeof(trace::DroppedRecord);

  void put_dropped_locked() {
    const trace::DroppedRecord lost{dropped_};
    dropped_ = 0;
    put_locked(trace::RecordType::Dropped, &lost, sizeof(lost), nullptr, 0);
  }

  // Gives the active buffer to the writer if the spare is free; false if the writer is busy.
  bool swap_locked() {
    if (spare_busy_.load(std::memory_order_acquire)) return false;
    active_.swap(spare_);
    active_.clear();
    spare_busy_.store(true, std::memory_order_release);
    start_thread_once();
    {
      std::lock_guard<std::mutex> lk(mutex_);
      pending_ = true;
    }
    wake_.notify_one();
    return true;
  }

  void wait_for_spare_locked() {
    while (spare_busy_.load(std::memory_order_acquire)) std::this_thread::yield();
  }

  void start_thread_once() {
    if (thread_.joinable()) return;
    thread_ = std::thread([this] { run(); });
  }

  void run() {
    pthread_setname_np(pthread_self(), "magice-trace");
    std::unique_lock<std::mutex> lk(mutex_);
    for (;;) {
      wake_.wait(lk, [&] { return pending_ || stopping_; });
      if (pending_) {
        // Taken before the write: a caller may hand over the next buffer as soon as
        // write_spare() frees the spare, and clearing pending_ after it would lose that buffer
        // (and hang the next flush, which waits for a spare that is never written).
        pending_ = false;
        writing_ = true;
        lk.unlock();
        write_spare();
        lk.lock();
        writing_ = false;
        idle_.notify_all();
        continue;
      }
      if (stopping_) return;
    }
  }

  void write_spare() {
    const char* p = spare_.data();
    size_t left = spare_.size();
    while (left > 0 && !failed_) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        failed_ = true;
        MAGI_WARN(Trace, "writing the trace failed (%s); tracing stops here, the program goes on",
                  n < 0 ? std::strerror(errno) : "no progress");
        break;
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    spare_.clear();
    spare_busy_.store(false, std::memory_order_release);
  }

  int fd_;
  const size_t capacity_;
  SpinLock lock_;             // held only for one memcpy of a record
  std::vector<char> active_;  // guarded by lock_
  std::vector<char> spare_;   // owned by the writer while spare_busy_
  std::atomic<bool> spare_busy_{false};
  uint64_t dropped_ = 0;  // guarded by lock_
  bool closed_ = false;   // guarded by lock_
  bool failed_ = false;   // writer thread only

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  bool pending_ = false;   // guarded by mutex_: a buffer was handed over, not yet taken
  bool writing_ = false;   // guarded by mutex_: the writer is writing one
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;
};

namespace {

std::atomic<TraceWriter*> g_writer{nullptr};
std::atomic<bool> g_tried{false};
std::mutex g_open_mutex;

// O_EXCL and O_NOFOLLOW: never follow a planted symlink, never append to another run's file.
int open_trace_file(const std::string& dir, std::string& path) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return -1;
  const std::string base = dir + "/magice." + short_host_name() + "." + std::to_string(getpid());
  for (int attempt = 0; attempt < 100; ++attempt) {
    path = base + (attempt == 0 ? "" : "." + std::to_string(attempt)) + ".trace";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

trace::FileHeader make_header() {
  trace::FileHeader h{};
  std::memcpy(h.magic, trace::kMagic, sizeof(h.magic));
  h.version = trace::kVersion;
  h.header_bytes = sizeof(trace::FileHeader);
  h.pid = static_cast<uint64_t>(getpid());
  h.start_monotonic_ns = clock_ns(CLOCK_MONOTONIC);
  h.start_realtime_ns = clock_ns(CLOCK_REALTIME);
  snprintf(h.host, sizeof(h.host), "%s", short_host_name());
  char exe[sizeof(h.program)] = {};
  if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) > 0) {
    const char* slash = std::strrchr(exe, '/');
    snprintf(h.program, sizeof(h.program), "%s", slash ? slash + 1 : exe);
  }
  return h;
}

// The child starts a trace file of its own on its first record. The parent's writer object is
// leaked on purpose: its thread and locks belong to the parent.
// In a forked child: the parent's writer, kept reachable (so leak checkers see it is held on
// purpose) and never used. Atomic, so the store is not optimised away as never read.
std::atomic<TraceWriter*> g_parents_writer{nullptr};

TraceWriter* create_writer() {
  const Options& options = Options::get();
  if (options.trace_dir.empty()) return nullptr;
  std::string path;
  const int fd = open_trace_file(options.trace_dir, path);
  if (fd < 0) {
    MAGI_WARN(Trace, "MAGI_TRACE_DIR=%s: cannot create a trace file there (%s); tracing is off",
              options.trace_dir.c_str(), std::strerror(errno));
    return nullptr;
  }
  auto* writer = new TraceWriter(fd, static_cast<size_t>(options.trace_buffer_bytes));
  writer->write_header(make_header());
  MAGI_INFO(Trace, "tracing to %s", path.c_str());
  return writer;
}

// g_tried is set only once g_writer holds the outcome: a thread that sees it set on the fast
// path must find the writer, not a null that reads as "tracing is off" and loses its record.
TraceWriter* open_writer() {
  std::lock_guard<std::mutex> lk(g_open_mutex);
  if (g_tried.load()) return g_writer.load();
  TraceWriter* writer = create_writer();
  g_writer.store(writer, std::memory_order_release);
  g_tried.store(true, std::memory_order_release);
  return writer;
}

}  // namespace

TraceWriter* trace_writer() {
  if (__builtin_expect(g_tried.load(std::memory_order_acquire), 1))
    return g_writer.load(std::memory_order_acquire);
  return open_writer();
}

void trace_append(TraceWriter* writer, trace::RecordType type, const void* payload,
                  uint32_t payload_bytes, const void* tail, uint32_t tail_bytes) {
  if (writer != nullptr) writer->append(type, payload, payload_bytes, tail, tail_bytes);
}

void trace_flush(TraceWriter* writer) {
  if (writer != nullptr) writer->flush();
}

void trace_flush_if_open() {
  if (TraceWriter* w = g_writer.load(std::memory_order_acquire)) w->flush();
}

void trace_close() {
  if (TraceWriter* w = g_writer.load(std::memory_order_acquire)) w->close();
}

void trace_forget_in_child() {
  if (TraceWriter* w = g_writer.exchange(nullptr)) {
    w->abandon();
    g_parents_writer.store(w, std::memory_order_relaxed);
  }
  new (&g_open_mutex) std::mutex();  // a parent thread may have held it at fork
  g_tried.store(false);
}

}  // namespace magi::capture
