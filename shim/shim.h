// shim/: the NCCL face of the library. The face of the folder.
//
// The exported NCCL entry points (shim/exports.cc) are where the host program enters. They find
// the real NCCL (shim/real_nccl.h), keep one record per communicator (shim/communicators.h),
// hand each call to capture/ and rewrite/, and forward what stays on NCCL. Nothing in shim/ is
// meant for other folders: data flows shim -> capture -> rewrite -> ce_transport, with base/
// below them all.
#pragma once

#include "shim/real_nccl.h"
