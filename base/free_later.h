// What cannot be freed yet, kept until it can: a module table a reader may still hold, an
// agreement round's buffers NCCL may still write into, a set-up whose thread still runs. The
// owner says when an item may go (`ready`) and how it goes (`free`); the list only keeps the
// items in the order they came and never waits. Not thread-safe: the owner's lock guards it.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace magi {

template <class T>
class FreeLater {
 public:
  void add(T item) { items_.push_back(std::move(item)); }
  bool empty() const noexcept { return items_.empty(); }
  size_t size() const noexcept { return items_.size(); }

  // Each item `ready(item&)` says may go now is taken out and handed to `free(T)`, in the order
  // the items came; the others stay, in order. `free` must not throw. Returns how many went.
  template <class Ready, class Free>
  size_t free_ready(Ready&& ready, Free&& free) {
    size_t freed = 0;
    auto kept = items_.begin();
    for (auto it = items_.begin(); it != items_.end(); ++it) {
      if (ready(*it)) {
        T item = std::move(*it);
        free(std::move(item));
        ++freed;
        continue;
      }
      if (kept != it) *kept = std::move(*it);
      ++kept;
    }
    items_.erase(kept, items_.end());
    return freed;
  }

  // Every item, ready or not (the owner's end, a child after fork): the caller decides.
  std::vector<T> take_all() { return std::exchange(items_, {}); }

 private:
  std::vector<T> items_;
};

}  // namespace magi
