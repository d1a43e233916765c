// Call-site fingerprints that are equal on every rank running the same code.
//
// unw_backtrace gives raw return addresses; ASLR makes them differ between processes. Each is
// normalised to (module key, offset from the module's load base) through a cached table of loaded
// modules; the module key is XXH3 of the module's GNU build-id (or of its file name when it has
// none), so the same binary gives the same key wherever it is mapped. The fingerprint is XXH3
// over the normalised frames above the library's own.
//
// The module table is an immutable snapshot swapped atomically: readers take no lock. It is
// rebuilt when the dynamic loader's load/unload counters change (dl_iterate_phdr's dlpi_adds and
// dlpi_subs), so a library loaded or unloaded later is seen correctly.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "capture/trace_format.h"

namespace magi::capture {

// Normalises one instruction address. False when no loaded module contains it (JIT code, say):
// the frame is then hashed as (0, 0), which stays equal across ranks.
bool normalize_address(uintptr_t address, trace::Frame& out);

// The file name of a module key seen by normalize_address ("" if unknown).
std::string module_name(uint64_t module_key);

// What an offline reader needs to find the module's binary again: the path it was loaded from
// (as the loader names it) and its GNU build-id (raw bytes; empty when it has none). Read from
// the loader's list when the module table is built, never per call.
struct ModuleIdentity {
  std::string name;  // file name
  std::string path;
  std::string build_id;
};
ModuleIdentity module_identity(uint64_t module_key);

// Fingerprint of the caller's native call site: up to `depth` frames above the frames that
// belong to the module containing this function (the library itself). `frames_out`, if not
// empty, receives the normalised frames and `*frame_count` their number.
uint64_t callsite_fingerprint(int depth, std::span<trace::Frame> frames_out = {},
                              int* frame_count = nullptr);

}  // namespace magi::capture
