// The machine's name, read once: log lines, trace and flight-recorder file names, and the key
// that tells processes on one machine apart from those on another all use the same reading.
#pragma once

namespace magi {

// As gethostname(2) gives it ("" if it fails); read at the first call, under the thread-safe
// initialisation of a local static, and kept in storage that needs no destructor, so a line
// logged while the process exits still has it.
const char* host_name() noexcept;
// The same up to its first dot ("node7" for "node7.cluster.example"): what names files and lines.
const char* short_host_name() noexcept;
// What tells processes on one machine from those on another: MAGI_INJECT_HOST where a test set
// it (ranks on one host then act as ranks of several machines), else host_name(). Reads the
// options: never from the options' own parsing or logging.
const char* machine_name() noexcept;

}  // namespace magi
