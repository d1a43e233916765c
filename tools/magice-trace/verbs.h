// The verbs of magice-trace. Each takes the arguments after its name and returns the exit
// status; main.cc dispatches to them.
#pragma once

#include <span>
#include <string>

namespace magi::tool {

int dump_main(std::span<const std::string> args);
int skeleton_main(std::span<const std::string> args);
int diff_main(std::span<const std::string> args);
int export_main(std::span<const std::string> args);
int decisions_main(std::span<const std::string> args);
int hang_main(std::span<const std::string> args);

}  // namespace magi::tool
