#include "tools/magice-trace/json_writer.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace magi::tool {
namespace {

// Length of the valid UTF-8 sequence starting at text[i], or 0 if it is not one.
size_t utf8_sequence(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length;
  uint32_t code;
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2, code = lead & 0x1fu;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3, code = lead & 0x0fu;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4, code = lead & 0x07u;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xc0u) != 0x80u) return 0;
    code = code << 6 | (byte(i + k) & 0x3fu);
  }
  const bool overlong = (length == 3 && code < 0x800) || (length == 4 && code < 0x10000);
  const bool surrogate = code >= 0xd800 && code <= 0xdfff;
  if (overlong || surrogate || code > 0x10ffff) return 0;
  return length;
}

}  // namespace

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x80) {
      out += static_cast<char>(c);
    } else if (const size_t n = c >= 0x80 ? utf8_sequence(text, i) : 0; n != 0) {
      out.append(text.substr(i, n));
      i += n;
      continue;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    }
    ++i;
  }
  return out + "\"";
}

void append_micros(std::string& out, int64_t ns) {
  if (ns < 0) out += '-';
  const uint64_t magnitude = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  append_integer(out, magnitude / 1000);
  const auto fraction = static_cast<unsigned>(magnitude % 1000);
  const char decimals[4] = {'.', static_cast<char>('0' + fraction / 100),
                            static_cast<char>('0' + fraction / 10 % 10),
                            static_cast<char>('0' + fraction % 10)};
  out.append(decimals, sizeof(decimals));
}

JsonOutput::JsonOutput(const std::string& path)
    : path_(path), file_(path == "-" ? stdout : std::fopen(path.c_str(), "w")) {
  if (file_ == nullptr) {
    throw std::runtime_error(path + ": cannot create: " + std::strerror(errno));
  }
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
}

JsonOutput::~JsonOutput() {
  if (file_ != nullptr && file_ != stdout) std::fclose(file_);
}

void JsonOutput::write(std::string_view text) { std::fwrite(text.data(), 1, text.size(), file_); }

void JsonOutput::close() {
  if (file_ == nullptr) return;
  std::FILE* file = std::exchange(file_, nullptr);
  bool ok = std::ferror(file) == 0 && std::fflush(file) == 0;
  int error = errno;
  if (file != stdout && std::fclose(file) != 0 && ok) {
    ok = false;
    error = errno;
  }
  if (!ok) throw std::runtime_error(path_ + ": cannot write: " + std::strerror(error));
}

}  // namespace magi::tool
