// The library's base vocabulary, and the face of shim/: options (shim/options.h), logging
// (shim/log.h) and the error family (shim/check.h). Every folder may include this header.
//
// shim/ itself is where the host program enters: the exported NCCL entry points
// (shim/exports.cc) find the real NCCL (shim/real_nccl.h), hand each call to capture/, and
// forward it. Nothing in shim/ beyond this header is meant for other folders.
#pragma once

#include "shim/check.h"
#include "shim/log.h"
#include "shim/options.h"
