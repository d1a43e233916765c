// Python call sites (capture/py_callsite.h).
//
// Per call, with the GIL held: PyEval_GetFrame, then up to kWalk frames outward through
// PyFrame_GetBack, reading each frame's code object's co_filename and co_name (interned
// attribute names, so the lookup allocates nothing of ours) until kFrames frames outside torch
// are found. Their texts are hashed in place; only a fingerprint seen for the first time is
// copied out, into one PyCallsite record built on the stack.
//
// The strings stay valid while the code objects are held: each holds its co_filename and
// co_name. Every reference taken is given back before returning.
#include "capture/py_callsite.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/base.h"
#include "capture/flight_recorder.h"

namespace magi::capture {
namespace {

constexpr int kFrames = 3;     // innermost Python frames outside torch that are recorded
constexpr int kWalk = 256;     // frames looked at, at most, to find them
constexpr size_t kText = 240;  // bytes kept of a file name (its end) or a function name
constexpr char kSkipped[] = "/torch/";

struct PyObject;  // opaque: only pointers to it are handled

// The C API functions used, declared here so no Python headers are needed. Each has kept its
// signature since 3.9, the first version with PyFrame_GetBack and PyFrame_GetCode.
struct PythonApi {
  int (*is_initialized)();
  int (*gil_check)();                      // 1: this thread holds the GIL
  PyObject* (*eval_get_frame)();           // borrowed
  PyObject* (*frame_get_back)(PyObject*);  // new reference
  PyObject* (*frame_get_code)(PyObject*);  // new reference
  int (*frame_get_line)(PyObject*);
  PyObject* (*get_attr)(PyObject*, PyObject*);  // new reference
  const char* (*as_utf8)(PyObject*);            // borrowed from the string
  PyObject* (*intern)(const char*);             // new reference
  void (*dec_ref)(PyObject*);
  void (*err_clear)();
  const char* (*version)();
  void* (*this_thread_state)();  // PyGILState_GetThisThreadState: null if Python never ran here
  int (*gil_ensure)();           // PyGILState_Ensure: a PyGILState_STATE, an enum
  void (*gil_release)(int);
};

enum class ApiState : int { Unresolved, Ready, Absent };
std::atomic<ApiState> g_state{ApiState::Unresolved};
PythonApi g_api;
std::mutex g_resolve_mutex;  // taken only until the state is known

template <typename F>
bool resolve(F& out, const char* name) {
  out = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
  return out != nullptr;
}

// "3.11.2 (main, ...)": at least 3.9.
bool version_supported(const char* text) {
  int major = 0, minor = 0;
  return text != nullptr && std::sscanf(text, "%d.%d", &major, &minor) == 2 &&
         (major > 3 || (major == 3 && minor >= 9));
}

ApiState resolve_api() {
  std::lock_guard<std::mutex> lock(g_resolve_mutex);
  ApiState state = g_state.load(std::memory_order_acquire);
  if (state != ApiState::Unresolved) return state;
  PythonApi& a = g_api;
  const bool found =
      resolve(a.is_initialized, "Py_IsInitialized") && resolve(a.gil_check, "PyGILState_Check") &&
      resolve(a.eval_get_frame, "PyEval_GetFrame") &&
      resolve(a.frame_get_back, "PyFrame_GetBack") &&
      resolve(a.frame_get_code, "PyFrame_GetCode") &&
      resolve(a.frame_get_line, "PyFrame_GetLineNumber") &&
      resolve(a.get_attr, "PyObject_GetAttr") && resolve(a.as_utf8, "PyUnicode_AsUTF8") &&
      resolve(a.intern, "PyUnicode_InternFromString") && resolve(a.dec_ref, "Py_DecRef") &&
      resolve(a.err_clear, "PyErr_Clear") && resolve(a.version, "Py_GetVersion") &&
      resolve(a.this_thread_state, "PyGILState_GetThisThreadState") &&
      resolve(a.gil_ensure, "PyGILState_Ensure") && resolve(a.gil_release, "PyGILState_Release");
  if (!found) {
    state = ApiState::Absent;  // the common case: a program with no interpreter
  } else if (!version_supported(a.version())) {
    MAGI_INFO(Capture, "MAGI_PY_CALLSITES: Python %.8s is older than 3.9; no Python call sites",
              a.version());
    state = ApiState::Absent;
  } else {
    MAGI_INFO(Capture,
              "MAGI_PY_CALLSITES: Python %.8s found; calls made holding the GIL carry "
              "their Python call site",
              a.version());
    state = ApiState::Ready;
  }
  g_state.store(state, std::memory_order_release);
  return state;
}

// Made under the GIL, which serialises their creation; kept for the life of the process.
std::atomic<PyObject*> g_co_filename{nullptr};
std::atomic<PyObject*> g_co_name{nullptr};

PyObject* interned(std::atomic<PyObject*>& slot, const char* text) {
  PyObject* name = slot.load(std::memory_order_acquire);
  if (name != nullptr) return name;
  name = g_api.intern(text);
  if (name == nullptr) {
    g_api.err_clear();
    return nullptr;
  }
  slot.store(name, std::memory_order_release);
  return name;
}

struct FrameText {
  PyObject* code;  // held: keeps the texts below alive
  const char* file;
  size_t file_bytes;
  const char* function;
  size_t function_bytes;
  int32_t line;
};

// A string attribute of a code object, borrowed from the code object that holds it.
const char* code_text(PyObject* code, PyObject* attribute, size_t& bytes) {
  PyObject* value = g_api.get_attr(code, attribute);
  const char* text = value != nullptr ? g_api.as_utf8(value) : nullptr;
  if (value != nullptr) g_api.dec_ref(value);
  if (text == nullptr) {
    g_api.err_clear();
    bytes = 0;
    return "";
  }
  bytes = std::strlen(text);
  return text;
}

// Fingerprints already described, one set per destination (the trace, the recorder's file); a
// direct-mapped set, so a collision only costs writing the same description twice.
constexpr size_t kSeen = 1024;
std::atomic<uint64_t> g_seen_trace[kSeen];
std::atomic<uint64_t> g_seen_recorder[kSeen];

bool first_sighting(std::atomic<uint64_t>* seen, uint64_t key) {
  std::atomic<uint64_t>& slot = seen[key % kSeen];
  if (slot.load(std::memory_order_relaxed) == key) return false;
  return slot.exchange(key, std::memory_order_relaxed) != key;
}

void describe(TraceWriter* writer, bool recorder, uint64_t key, const FrameText* frames,
              int count) {
  char record[sizeof(trace::PyCallsiteRecord) + kFrames * sizeof(trace::PyFrameEntry) +
              kFrames * 2 * kText];
  char* text = record + sizeof(trace::PyCallsiteRecord) + count * sizeof(trace::PyFrameEntry);
  size_t text_bytes = 0;
  for (int i = 0; i < count; ++i) {
    // A long path keeps its end (the file's name); a long function name its start.
    const size_t file_bytes = std::min(frames[i].file_bytes, kText);
    const size_t function_bytes = std::min(frames[i].function_bytes, kText);
    const trace::PyFrameEntry entry{frames[i].line, static_cast<uint16_t>(file_bytes),
                                    static_cast<uint16_t>(function_bytes)};
    std::memcpy(record + sizeof(trace::PyCallsiteRecord) + i * sizeof(entry), &entry,
                sizeof(entry));
    std::memcpy(text + text_bytes, frames[i].file + frames[i].file_bytes - file_bytes, file_bytes);
    std::memcpy(text + text_bytes + file_bytes, frames[i].function, function_bytes);
    text_bytes += file_bytes + function_bytes;
  }
  const trace::PyCallsiteRecord header{key, static_cast<uint32_t>(count),
                                       static_cast<uint32_t>(text_bytes)};
  std::memcpy(record, &header, sizeof(header));
  const auto tail = static_cast<uint32_t>(count * sizeof(trace::PyFrameEntry) + text_bytes);
  if (writer != nullptr)
    trace_append(writer, trace::RecordType::PyCallsite, record, sizeof(header),
                 record + sizeof(header), tail);
  if (recorder)
    flight_add_site(trace::RecordType::PyCallsite, record, sizeof(header), record + sizeof(header),
                    tail);
}

uint64_t walk_frames(TraceWriter* writer, bool recorder) {
  const PythonApi& api = g_api;
  PyObject* co_filename = interned(g_co_filename, "co_filename");
  PyObject* co_name = interned(g_co_name, "co_name");
  if (co_filename == nullptr || co_name == nullptr) return 0;

  FrameText frames[kFrames];
  int count = 0;
  PyObject* frame = api.eval_get_frame();  // borrowed; later frames are owned
  bool owned = false;
  for (int walked = 0; frame != nullptr && walked < kWalk && count < kFrames; ++walked) {
    if (PyObject* code = api.frame_get_code(frame)) {
      FrameText& f = frames[count];
      f.code = code;
      f.file = code_text(code, co_filename, f.file_bytes);
      if (std::strstr(f.file, kSkipped) != nullptr) {
        api.dec_ref(code);
      } else {
        f.function = code_text(code, co_name, f.function_bytes);
        f.line = api.frame_get_line(frame);
        ++count;
      }
    }
    PyObject* back = api.frame_get_back(frame);
    if (owned) api.dec_ref(frame);
    frame = back;
    owned = true;
  }
  if (owned && frame != nullptr) api.dec_ref(frame);

  uint64_t key = 0;
  for (int i = 0; i < count; ++i) {
    key = XXH3_64bits_withSeed(frames[i].file, frames[i].file_bytes, key);
    key = XXH3_64bits_withSeed(frames[i].function, frames[i].function_bytes, key);
    key = XXH3_64bits_withSeed(&frames[i].line, sizeof(frames[i].line), key);
  }
  if (count != 0 && key == 0) key = 1;  // 0 means "none"
  if (key != 0) {
    TraceWriter* to_trace =
        writer != nullptr && first_sighting(g_seen_trace, key) ? writer : nullptr;
    const bool to_recorder = recorder && first_sighting(g_seen_recorder, key);
    if (to_trace != nullptr || to_recorder) describe(to_trace, to_recorder, key, frames, count);
  }
  for (int i = 0; i < count; ++i) api.dec_ref(frames[i].code);
  return key;
}

}  // namespace

void python_callsites_forget_in_child() {
  for (auto& slot : g_seen_trace) slot.store(0, std::memory_order_relaxed);
  for (auto& slot : g_seen_recorder) slot.store(0, std::memory_order_relaxed);
}

uint64_t python_callsite(TraceWriter* writer, bool recorder, PythonGil gil) {
  ApiState state = g_state.load(std::memory_order_acquire);
  if (__builtin_expect(state == ApiState::Unresolved, 0)) state = resolve_api();
  if (state != ApiState::Ready) return 0;
  const PythonApi& api = g_api;
  if (!api.is_initialized() || api.this_thread_state() == nullptr) return 0;
  // Without the GIL no frame may be touched: the interpreter may be running them elsewhere.
  if (api.gil_check() == 1) return walk_frames(writer, recorder);
  if (gil != PythonGil::Take) {
    // Say once why the Python lines are missing: with PyTorch this is every collective.
    static std::atomic<bool> said{false};
    if (!said.exchange(true, std::memory_order_relaxed))
      MAGI_WARN(Capture,
                "MAGI_PY_CALLSITES=1: a Python thread calls NCCL without holding the GIL "
                "(PyTorch releases it around its collectives); such calls carry no Python line. "
                "MAGI_PY_CALLSITES=2 takes the GIL back for the walk");
    return 0;
  }
  const int taken = api.gil_ensure();
  const uint64_t key = walk_frames(writer, recorder);
  api.gil_release(taken);
  return key;
}

}  // namespace magi::capture
