#include "tools/magice-trace/symbols.h"

#include <cxxabi.h>
#include <dwarf.h>
#include <elfutils/libdw.h>
#include <elfutils/libdwfl.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "tools/magice-trace/describe.h"

namespace magi::tool {
namespace {

bool g_enabled = true;

struct DwflDeleter {
  void operator()(Dwfl* dwfl) const { dwfl_end(dwfl); }
};

// One session per module: each is reported at load base 0, so a frame's offset (address minus
// the load base) is its address there, plus the bias libdwfl reports for the file.
struct Binary {
  std::unique_ptr<Dwfl, DwflDeleter> dwfl;
  Dwfl_Module* module = nullptr;
  GElf_Addr bias = 0;
};

std::string_view basename_of(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// Null when the binary is not on this machine or is another build than the one that ran.
std::unique_ptr<Binary> open_binary(const std::string& path, const std::string& build_id) {
  static const Dwfl_Callbacks kCallbacks = {dwfl_build_id_find_elf, dwfl_standard_find_debuginfo,
                                            dwfl_offline_section_address, nullptr};
  if (path.empty() || path.front() == '[') return nullptr;
  auto binary = std::make_unique<Binary>();
  binary->dwfl.reset(dwfl_begin(&kCallbacks));
  if (!binary->dwfl) return nullptr;
  binary->module = dwfl_report_elf(binary->dwfl.get(), std::string(basename_of(path)).c_str(),
                                   path.c_str(), -1, 0, false);
  dwfl_report_end(binary->dwfl.get(), nullptr, nullptr);
  if (binary->module == nullptr) return nullptr;
  if (dwfl_module_getelf(binary->module, &binary->bias) == nullptr) return nullptr;
  if (!build_id.empty()) {
    const unsigned char* bits = nullptr;
    GElf_Addr where = 0;
    const int length = dwfl_module_build_id(binary->module, &bits, &where);
    if (length != static_cast<int>(build_id.size()) ||
        std::memcmp(bits, build_id.data(), build_id.size()) != 0)
      return nullptr;
  }
  return binary;
}

std::string demangled(const char* name) {
  int status = 0;
  char* text = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || text == nullptr) return name;
  std::string out(text);
  std::free(text);
  return out;
}

// The innermost function at the address: an inlined one from DWARF, so that the name and the
// line (which libdw gives for the inlined code) belong together; else the ELF symbol, whose
// mangled name carries the class and namespace that a member's DWARF name may not.
std::string function_name(const Binary& binary, GElf_Addr address) {
  Dwarf_Addr cu_bias = 0;
  if (Dwarf_Die* cu = dwfl_module_addrdie(binary.module, address, &cu_bias)) {
    Dwarf_Die* scopes = nullptr;
    const int count = dwarf_getscopes(cu, address - cu_bias, &scopes);
    std::string name;
    for (int i = 0; i < count && name.empty(); ++i) {
      const int tag = dwarf_tag(&scopes[i]);
      if (tag == DW_TAG_subprogram) break;  // not inlined: the symbol names it best
      if (tag != DW_TAG_inlined_subroutine) continue;
      Dwarf_Attribute attribute;
      const char* linkage =
          dwarf_formstring(dwarf_attr_integrate(&scopes[i], DW_AT_linkage_name, &attribute));
      if (linkage == nullptr)
        linkage =
            dwarf_formstring(dwarf_attr_integrate(&scopes[i], DW_AT_MIPS_linkage_name, &attribute));
      if (linkage != nullptr) {
        name = demangled(linkage);
      } else if (const char* plain = dwarf_diename(&scopes[i])) {
        name = plain;
      }
    }
    std::free(scopes);
    if (!name.empty()) return name;
  }
  if (const char* symbol = dwfl_module_addrname(binary.module, address)) {
    std::string_view name(symbol);
    name = name.substr(0, name.find('@'));  // "__libc_start_main@@GLIBC_2.34": the version goes
    return demangled(std::string(name).c_str());
  }
  // No symbol (a stripped binary with debug info elsewhere, a local function): DWARF's name.
  if (Dwarf_Die* cu = dwfl_module_addrdie(binary.module, address, &cu_bias)) {
    Dwarf_Die* scopes = nullptr;
    const int count = dwarf_getscopes(cu, address - cu_bias, &scopes);
    std::string name;
    for (int i = 0; i < count && name.empty(); ++i)
      if (dwarf_tag(&scopes[i]) == DW_TAG_subprogram)
        if (const char* plain = dwarf_diename(&scopes[i])) name = plain;
    std::free(scopes);
    if (!name.empty()) return name;
  }
  return "";
}

bool in_described_function(const Binary& binary, GElf_Addr address) {
  Dwarf_Addr cu_bias = 0;
  Dwarf_Die* cu = dwfl_module_addrdie(binary.module, address, &cu_bias);
  if (cu == nullptr) return false;
  Dwarf_Die* scopes = nullptr;
  const int count = dwarf_getscopes(cu, address - cu_bias, &scopes);
  bool found = false;
  for (int i = 0; i < count && !found; ++i) {
    const int tag = dwarf_tag(&scopes[i]);
    found = tag == DW_TAG_subprogram || tag == DW_TAG_inlined_subroutine;
  }
  std::free(scopes);
  return found;
}

std::string name_frame(const Binary& binary, const trace::Trace& trace, const trace::Frame& frame) {
  const GElf_Addr address = frame.offset + binary.bias;
  const std::string function = function_name(binary, address);
  if (function.empty()) return frame_text(trace, frame);
  int line = 0;
  const char* file = nullptr;
  // Only inside a function DWARF describes: for code it does not (crt1's _start, say) the line
  // table would answer with a neighbouring unit's last line.
  Dwfl_Line* entry =
      in_described_function(binary, address) ? dwfl_module_getsrc(binary.module, address) : nullptr;
  if (entry != nullptr) file = dwfl_lineinfo(entry, nullptr, &line, nullptr, nullptr, nullptr);
  if (file == nullptr || line <= 0) return function + " (" + frame_text(trace, frame) + ")";
  std::string text =
      function + " (" + std::string(basename_of(file)) + ":" + std::to_string(line) + ")";
  // An inlined function has no frame of its own: name the function it was inlined into.
  const char* symbol = dwfl_module_addrname(binary.module, address);
  if (symbol != nullptr) {
    std::string_view outer(symbol);
    const std::string caller = demangled(std::string(outer.substr(0, outer.find('@'))).c_str());
    if (caller != function) text += " inlined in " + caller;
  }
  return text;
}

// The tool reads a handful of files in one thread: binaries and names are kept for its run.
std::unordered_map<uint64_t, std::unique_ptr<Binary>> g_binaries;
std::map<std::pair<uint64_t, uint64_t>, std::string> g_names;

const Binary* binary_for(const trace::Trace& trace, uint64_t module) {
  const auto known = g_binaries.find(module);
  if (known != g_binaries.end()) return known->second.get();
  const auto path = trace.modules.find(module);
  const auto build_id = trace.module_build_ids.find(module);
  auto binary =
      path == trace.modules.end()
          ? nullptr
          : open_binary(path->second, build_id == trace.module_build_ids.end() ? std::string()
                                                                               : build_id->second);
  return g_binaries.emplace(module, std::move(binary)).first->second.get();
}

}  // namespace

void set_symbols_enabled(bool enabled) { g_enabled = enabled; }
bool symbols_enabled() { return g_enabled; }

std::string frame_line(const trace::Trace& trace, const trace::Frame& frame) {
  if (!g_enabled || frame.module == 0) return frame_text(trace, frame);
  const auto key = std::make_pair(frame.module, frame.offset);
  const auto named = g_names.find(key);
  if (named != g_names.end()) return named->second;
  const Binary* binary = binary_for(trace, frame.module);
  std::string line = binary ? name_frame(*binary, trace, frame) : frame_text(trace, frame);
  g_names.emplace(key, line);
  return line;
}

std::string python_frame_line(const trace::PyFrameText& frame) {
  return frame.file + ":" + std::to_string(frame.line) + " in " + frame.function;
}

std::string python_line(const trace::Trace& trace, const trace::CallRecord& call) {
  const auto site = trace.py_calls.find({call.comm_id, call.seq, call.rank});
  if (site == trace.py_calls.end()) return "";
  const auto frames = trace.py_callsites.find(site->second);
  if (frames == trace.py_callsites.end() || frames->second.empty()) return "";
  return python_frame_line(frames->second.front());
}

std::string call_site_line(const trace::Trace& trace, const trace::CallRecord& call) {
  std::string line = python_line(trace, call);
  return line.empty() ? top_frame_text(trace, call.callsite) : line;
}

}  // namespace magi::tool
