// NCCL 2.28's device API (nccl_device.h): device communicators, teams, and the requirements of
// barriers and LL all-to-alls. Programs built against NCCL 2.28 link these names (PyTorch's
// libtorch_cuda.so does), so a library without them cannot stand in for NCCL at all. The stand-in
// has no device-side communicator: creating one, or a requirement that only a device
// communicator could use, fails with ncclInvalidUsage and one line on stderr. What is plain
// arithmetic on a communicator's ranks answers honestly: every rank of the stand-in shares memory
// with every other (one host), so the LSA team is the world and the rail team is one rank.
#include <nccl.h>
#include <nccl_device.h>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/export.h"
#include "tests/support/standin/report.h"

namespace {

ncclResult_t unsupported(const char* entry_point) {
  const std::string message =
      standin::format("%s: device communicators are not supported by the stand-in", entry_point);
  standin::set_last_error(message);
  standin::report("%s", message.c_str());
  return ncclInvalidUsage;
}

ncclTeam_t team(int nranks, int rank, int stride) {
  ncclTeam_t t;
  t.nRanks = nranks;
  t.rank = rank;
  t.stride = stride;
  return t;
}

}  // namespace

STANDIN_API ncclResult_t pncclDevCommCreate(ncclComm_t, ncclDevCommRequirements_t const*,
                                            ncclDevComm_t*) {
  return unsupported("ncclDevCommCreate");
}
STANDIN_ALIAS(ncclDevCommCreate)

STANDIN_API ncclResult_t pncclDevCommDestroy(ncclComm_t, ncclDevComm_t const*) {
  return unsupported("ncclDevCommDestroy");
}
STANDIN_ALIAS(ncclDevCommDestroy)

STANDIN_API ncclResult_t pncclLsaBarrierCreateRequirement(ncclTeam_t, int, ncclLsaBarrierHandle_t*,
                                                          ncclDevResourceRequirements_t*) {
  return unsupported("ncclLsaBarrierCreateRequirement");
}
STANDIN_ALIAS(ncclLsaBarrierCreateRequirement)

STANDIN_API ncclResult_t pncclGinBarrierCreateRequirement(ncclComm_t, ncclTeam_t, int,
                                                          ncclGinBarrierHandle_t*,
                                                          ncclDevResourceRequirements_t*) {
  return unsupported("ncclGinBarrierCreateRequirement");
}
STANDIN_ALIAS(ncclGinBarrierCreateRequirement)

STANDIN_API ncclResult_t pncclLLA2ACreateRequirement(int, int, ncclLLA2AHandle_t*,
                                                     ncclDevResourceRequirements_t*) {
  return unsupported("ncclLLA2ACreateRequirement");
}
STANDIN_ALIAS(ncclLLA2ACreateRequirement)

// NCCL's own arithmetic: a slot holds 8 bytes of an element.
STANDIN_API int pncclLLA2ACalcSlots(int maxElts, int maxEltSize) {
  return maxElts * ((maxEltSize + 7) / 8);
}
STANDIN_ALIAS(ncclLLA2ACalcSlots)

STANDIN_API ncclTeam_t pncclTeamWorld(ncclComm_t comm) {
  return comm == nullptr ? team(0, 0, 1) : team(comm->nranks, comm->rank, 1);
}
STANDIN_ALIAS(ncclTeamWorld)

STANDIN_API ncclTeam_t pncclTeamLsa(ncclComm_t comm) { return pncclTeamWorld(comm); }
STANDIN_ALIAS(ncclTeamLsa)

// The outer factor of the LSA team, which is the world: one rank, of stride nranks.
STANDIN_API ncclTeam_t pncclTeamRail(ncclComm_t comm) {
  return comm == nullptr ? team(0, 0, 1) : team(1, 0, comm->nranks);
}
STANDIN_ALIAS(ncclTeamRail)

STANDIN_API int pncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t tm, int rank) {
  return comm == nullptr ? -1 : comm->rank + (rank - tm.rank) * tm.stride;
}
STANDIN_ALIAS(ncclTeamRankToWorld)

// The LSA team is the world, so a rank's LSA rank is its world rank.
STANDIN_API int pncclTeamRankToLsa(ncclComm_t comm, ncclTeam_t tm, int rank) {
  return pncclTeamRankToWorld(comm, tm, rank);
}
STANDIN_ALIAS(ncclTeamRankToLsa)

// NCCL rereads NCCL_DEBUG here; the stand-in reads no debug settings, so there is nothing to
// reset. (nccl.h marks the name deprecated; NCCL still exports it, and its tests call the
// internal one.)
STANDIN_API void pncclResetDebugInit() {}
extern "C" __attribute__((visibility("default"), alias("pncclResetDebugInit"))) void
ncclResetDebugInit();
extern "C" __attribute__((visibility("default"))) void ncclResetDebugInitInternal() {}
