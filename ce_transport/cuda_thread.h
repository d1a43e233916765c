// The calling thread's CUDA state, set for the life of an object and given back after: the
// transport's own CUDA calls run on threads of the program's (its watchdog's, the one capturing a
// graph) as on its own, and must leave them as they found them. Private to the CUDA files of
// ce_transport/.
#pragma once

namespace magi::ce {

// For its life, the calling thread's current device is `device` (when known); the thread's own
// is given back after: a thread of the program's (its watchdog's) keeps the device it chose.
class ThreadDevice {
 public:
  explicit ThreadDevice(int device);
  ~ThreadDevice();
  ThreadDevice(const ThreadDevice&) = delete;
  ThreadDevice& operator=(const ThreadDevice&) = delete;

 private:
  int saved_ = -1;
};

// The calling thread's capture mode made relaxed: its CUDA calls for the transport itself (a
// window's set-up or release, on the program's thread or the set-up's) are not taken for part
// of a CUDA graph that a thread of the program is capturing. Under the default (global) mode, a
// cudaMalloc or a cudaStreamSynchronize made while any thread captures would be refused, and on
// the capturing thread would end its capture. Returns the mode to give back
// (restore_capture_mode), or -1: nothing to give back.
int relax_capture_mode();
void restore_capture_mode(int saved);

// relax_capture_mode() for its life.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() : saved_(relax_capture_mode()) {}
  ~RelaxedCaptureMode() { restore_capture_mode(saved_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  int saved_;
};

}  // namespace magi::ce
