// Whether a peer process is still there: how a waiting rank tells a slow peer from a dead one.
#pragma once

#include <sys/types.h>

namespace magi::ce {

// False once `pid` has exited, including while it is an unreaped zombie.
bool process_alive(pid_t pid);

}  // namespace magi::ce
