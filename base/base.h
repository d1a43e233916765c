// base/: the library's ground. The face of the folder.
//
// Errors (base/check.h), logging (base/log.h), options (base/options.h), and the few helpers
// every folder needs (clocks, byte sizes, how identities are shown). The CUDA driver layer
// (base/cuda_driver.h) is included only where CUDA is used, to keep its headers out of the rest.
// The agreement's words and the trace records that carry them (base/agreement_records.h) lie
// here too: rewrite decides in them and capture writes them, and neither may hold the other's.
// Every folder may include this header; base/ includes nothing of the project's above it, so no
// folder cycle can pass through it.
#pragma once

#include "base/check.h"
#include "base/clock.h"
#include "base/ids.h"
#include "base/log.h"
#include "base/options.h"
#include "base/sizes.h"
