// The stand-in must export every NCCL name the real libnccl.so.2 exports: a program linked against
// NCCL (PyTorch's libtorch_cuda.so needs ncclDevCommCreate since NCCL 2.28) will not load with
// the stand-in as its NCCL otherwise. Read from the ELF files' dynamic symbol tables, so the next
// NCCL version's new names fail here, on a machine without a GPU. The shim, preloaded in front,
// exports only names the real NCCL has: the rest resolve past it to the NCCL behind it.
#include <dlfcn.h>
#include <elf.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "build";
}

// The real NCCL: TEST_REAL_NCCL, else the one in CUDA_HOME (/usr/local/cuda by default), whose
// nccl.h the stand-in is built against.
std::string real_nccl_path() {
  if (const char* path = std::getenv("TEST_REAL_NCCL"); path != nullptr && *path != '\0')
    return path;
  const char* home = std::getenv("CUDA_HOME");
  return std::string(home != nullptr && *home != '\0' ? home : "/usr/local/cuda") +
         "/lib64/libnccl.so.2";
}

// `bytes` bytes of `in` from `offset`; empty when the file is shorter.
std::string read_at(std::ifstream& in, uint64_t offset, uint64_t bytes) {
  std::string data(bytes, '\0');
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(data.data(), static_cast<std::streamsize>(bytes));
  if (!in || static_cast<uint64_t>(in.gcount()) != bytes) return {};
  return data;
}

// The names starting with "nccl" or "pnccl" that `path` defines and exports (global or weak,
// default visibility), from its .dynsym; `error` says why none could be read. Only the headers
// and the two tables are read: the real NCCL is some 200 MB.
std::set<std::string> exported_nccl_names(const std::string& path, std::string& error) {
  std::set<std::string> names;
  std::ifstream in(path, std::ios::binary);
  const std::string head = read_at(in, 0, sizeof(Elf64_Ehdr));
  if (head.empty()) {
    error = path + ": not readable, or not an ELF file";
    return names;
  }
  Elf64_Ehdr header;
  std::memcpy(&header, head.data(), sizeof header);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_shentsize != sizeof(Elf64_Shdr)) {
    error = path + ": not a 64-bit ELF file with section headers";
    return names;
  }
  const std::string table = read_at(in, header.e_shoff, header.e_shnum * sizeof(Elf64_Shdr));
  if (table.empty()) {
    error = path + ": its section headers lie past the end of the file";
    return names;
  }
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  std::memcpy(sections.data(), table.data(), table.size());
  for (const Elf64_Shdr& symbols : sections) {
    if (symbols.sh_type != SHT_DYNSYM || symbols.sh_link >= sections.size()) continue;
    const Elf64_Shdr& strings = sections[symbols.sh_link];
    const std::string symbol_bytes = read_at(in, symbols.sh_offset, symbols.sh_size);
    const std::string string_bytes = read_at(in, strings.sh_offset, strings.sh_size);
    if (symbol_bytes.size() != symbols.sh_size || string_bytes.size() != strings.sh_size) {
      error = path + ": a dynamic symbol table past the end of the file";
      return names;
    }
    for (size_t at = 0; at + sizeof(Elf64_Sym) <= symbol_bytes.size(); at += sizeof(Elf64_Sym)) {
      Elf64_Sym symbol;
      std::memcpy(&symbol, symbol_bytes.data() + at, sizeof symbol);
      const int binding = ELF64_ST_BIND(symbol.st_info);
      if (symbol.st_shndx == SHN_UNDEF || symbol.st_name >= string_bytes.size() ||
          (binding != STB_GLOBAL && binding != STB_WEAK) ||
          ELF64_ST_VISIBILITY(symbol.st_other) != STV_DEFAULT)
        continue;
      const char* name = string_bytes.c_str() + symbol.st_name;
      if (std::strncmp(name, "nccl", 4) == 0 || std::strncmp(name, "pnccl", 5) == 0)
        names.insert(name);
    }
  }
  if (names.empty()) error = path + ": exports no nccl* name";
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : " ") + name;
  return text;
}

TEST(StandInExports, EveryNameTheRealNcclExportsAndTheShimOnlyNamesOfIt) {
  const std::string real_path = real_nccl_path();
  if (!std::ifstream(real_path).good())
    GTEST_SKIP() << "no real NCCL at " << real_path << " (TEST_REAL_NCCL or CUDA_HOME)";
  std::string error;
  const std::set<std::string> real = exported_nccl_names(real_path, error);
  ASSERT_FALSE(real.empty()) << error;
  // The device API of NCCL 2.28, which PyTorch 2.11 links: present in the real library, or this
  // test compares with an NCCL older than the stand-in's header.
  EXPECT_TRUE(real.count("ncclDevCommCreate") == 1) << real_path << " is older than NCCL 2.28";

  const std::set<std::string> standin =
      exported_nccl_names(build_dir() + "/tests/support/libnccl.so.2", error);
  ASSERT_FALSE(standin.empty()) << error;
  std::vector<std::string> missing;
  for (const std::string& name : real)
    if (standin.count(name) == 0) missing.push_back(name);
  EXPECT_TRUE(missing.empty()) << "the stand-in lacks " << missing.size() << " of the "
                               << real.size() << " names " << real_path
                               << " exports: " << joined(missing);

  const std::set<std::string> shim = exported_nccl_names(build_dir() + "/libmagice.so", error);
  ASSERT_FALSE(shim.empty()) << error;
  std::vector<std::string> foreign;
  for (const std::string& name : shim)
    if (real.count(name) == 0) foreign.push_back(name);
  EXPECT_TRUE(foreign.empty()) << "the shim exports names NCCL does not: " << joined(foreign);
  // The device API is left to the NCCL behind the shim (found through the global scope).
  for (const char* name : {"ncclDevCommCreate", "ncclDevCommDestroy", "ncclTeamWorld"})
    EXPECT_EQ(shim.count(name), 0u) << "the shim exports " << name;
}

// What a device-API name does in the stand-in: refuses a device communicator with
// ncclInvalidUsage, and computes what is only arithmetic as NCCL does.
TEST(StandInExports, TheDeviceApiRefusesDeviceCommunicatorsAndComputesSlots) {
  const std::string path = build_dir() + "/tests/support/libnccl.so.2";
  void* standin = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(standin, nullptr) << ::dlerror();
  using Create = ncclResult_t (*)(ncclComm_t, const void*, void*);
  using Slots = int (*)(int, int);
  const auto create = reinterpret_cast<Create>(::dlsym(standin, "ncclDevCommCreate"));
  const auto slots = reinterpret_cast<Slots>(::dlsym(standin, "ncclLLA2ACalcSlots"));
  ASSERT_NE(create, nullptr);
  ASSERT_NE(slots, nullptr);
  char dev_comm[256] = {};
  testing::internal::CaptureStderr();
  EXPECT_EQ(create(nullptr, nullptr, dev_comm), ncclInvalidUsage);
  EXPECT_NE(testing::internal::GetCapturedStderr().find(
                "ncclDevCommCreate: device communicators are not supported by the stand-in"),
            std::string::npos);
  EXPECT_EQ(slots(10, 12), 20);  // 12-byte elements take two 8-byte slots each
  EXPECT_EQ(slots(3, 8), 3);
  ::dlclose(standin);
}

}  // namespace
