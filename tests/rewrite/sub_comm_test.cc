// The inter-machine sub-communicator's life over a fake real NCCL: its id, a non-blocking
// formation polled to its end, a failure or an injected fault that ends what began, a plan dropped
// while it forms, and its end with the plan (destroyed) or with an aborted parent (aborted once).
#include "rewrite/sub_comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "base/check.h"

namespace magi::rewrite {
namespace {

// What the fake NCCL saw and how it answers; one test at a time.
struct FakeNccl {
  int polls_until_formed = 0;  // ncclCommGetAsyncError answers ncclInProgress this many times
  ncclResult_t formed_as = ncclSuccess;
  std::atomic<int> polls{0};
  int inits = 0, destroys = 0, aborts = 0;
  int init_nranks = -1, init_rank = -1, blocking = -1;
  ncclUniqueId init_id{};
};
FakeNccl g_fake;
ncclComm_t const kComm = reinterpret_cast<ncclComm_t>(0x5ca1ab1e);

ncclResult_t fake_unique_id(ncclUniqueId* id) {
  std::memset(id, 0, sizeof(*id));
  std::memcpy(id->internal, "fake-id", 7);
  return ncclSuccess;
}
ncclResult_t fake_init(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                       ncclConfig_t* config) {
  ++g_fake.inits;
  g_fake.init_nranks = nranks;
  g_fake.init_rank = rank;
  g_fake.init_id = id;
  g_fake.blocking = config ? config->blocking : -1;
  *comm = kComm;
  return g_fake.polls_until_formed > 0 ? ncclInProgress : g_fake.formed_as;
}
ncclResult_t fake_async_error(ncclComm_t, ncclResult_t* error) {
  *error = ++g_fake.polls <= g_fake.polls_until_formed ? ncclInProgress : g_fake.formed_as;
  return ncclSuccess;
}
ncclResult_t fake_destroy(ncclComm_t) {
  ++g_fake.destroys;
  return ncclSuccess;
}
ncclResult_t fake_abort(ncclComm_t) {
  ++g_fake.aborts;
  return ncclSuccess;
}
ncclResult_t no_all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) {
  return ncclInternalError;
}
ncclResult_t no_group() { return ncclSuccess; }

RealNcclCalls fake_nccl() {
  g_fake.polls_until_formed = 0;
  g_fake.formed_as = ncclSuccess;
  g_fake.polls = 0;
  g_fake.inits = g_fake.destroys = g_fake.aborts = 0;
  g_fake.init_nranks = g_fake.init_rank = g_fake.blocking = -1;
  return RealNcclCalls{no_all_gather, no_group,         no_group,     fake_unique_id,
                       fake_init,     fake_async_error, fake_destroy, fake_abort};
}

TEST(SubComm, FormsNonBlockingFromItsFirstMembersIdAndIsDestroyedWithThePlan) {
  const RealNcclCalls nccl = fake_nccl();
  g_fake.polls_until_formed = 3;
  {
    SubComm sub(nccl);
    const std::vector<uint8_t> id = sub.make_id();
    ASSERT_EQ(id.size(), sizeof(ncclUniqueId));
    EXPECT_EQ(sub.comm(), nullptr);
    sub.form(id, 4, 2, false);
    EXPECT_EQ(sub.comm(), kComm);
    EXPECT_EQ(g_fake.blocking, 0);  // polled: a dropped plan can stop waiting
    EXPECT_EQ(g_fake.init_nranks, 4);
    EXPECT_EQ(g_fake.init_rank, 2);
    EXPECT_EQ(std::memcmp(g_fake.init_id.internal, "fake-id", 7), 0);
    EXPECT_EQ(g_fake.polls.load(), 4);
  }
  EXPECT_EQ(g_fake.destroys, 1);
  EXPECT_EQ(g_fake.aborts, 0);
}

TEST(SubComm, AFormationThatFailsOrIsInjectedEndsWhatBeganAndThrows) {
  {
    const RealNcclCalls nccl = fake_nccl();
    g_fake.formed_as = ncclRemoteError;
    g_fake.polls_until_formed = 1;
    SubComm sub(nccl);
    EXPECT_THROW(sub.form(sub.make_id(), 2, 0, false), Error);
    EXPECT_EQ(sub.comm(), nullptr);
  }
  EXPECT_EQ(g_fake.aborts, 1);
  EXPECT_EQ(g_fake.destroys, 0);
  {
    // MAGI_INJECT_FAULT=subcomm: it joins (its peers' formation completes), then gives up.
    const RealNcclCalls nccl = fake_nccl();
    SubComm sub(nccl);
    try {
      sub.form(sub.make_id(), 2, 1, true);
      ADD_FAILURE() << "an injected failure did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("injected by MAGI_INJECT_FAULT"), std::string::npos);
    }
    EXPECT_EQ(g_fake.inits, 1);
    EXPECT_EQ(sub.comm(), nullptr);
  }
  EXPECT_EQ(g_fake.aborts, 1);
  EXPECT_EQ(g_fake.destroys, 0);
}

// A plan dropped while its sub-communicator forms (a peer never joins): the formation gives up
// from another thread's cancel(), aborting what began, instead of waiting for ever.
TEST(SubComm, APlanDroppedWhileItFormsStopsTheWait) {
  const RealNcclCalls nccl = fake_nccl();
  g_fake.polls_until_formed = 1 << 30;  // never
  SubComm sub(nccl);
  const std::vector<uint8_t> id = sub.make_id();
  std::atomic<bool> threw{false};
  std::thread forming([&] {
    try {
      sub.form(id, 2, 0, false);
    } catch (const Error&) {
      threw = true;
    }
  });
  while (g_fake.polls.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  sub.cancel(false);
  forming.join();
  EXPECT_TRUE(threw.load());
  EXPECT_EQ(sub.comm(), nullptr);
  EXPECT_EQ(g_fake.aborts, 1);
}

// The parent aborted: a formed sub-communicator is aborted at once (a call blocked in it
// returns), and only once.
TEST(SubComm, AnAbortedParentAbortsTheFormedSubCommunicatorOnce) {
  const RealNcclCalls nccl = fake_nccl();
  {
    SubComm sub(nccl);
    sub.form(sub.make_id(), 2, 0, false);
    sub.cancel(true);
    EXPECT_EQ(g_fake.aborts, 1);
    sub.cancel(true);
  }
  EXPECT_EQ(g_fake.aborts, 1);
  EXPECT_EQ(g_fake.destroys, 0);
}

TEST(SubComm, ARealNcclWithoutTheCallsItNeedsRefusesAlike) {
  RealNcclCalls nccl = fake_nccl();
  nccl.get_unique_id = nullptr;
  nccl.comm_init_rank_config = nullptr;
  SubComm sub(nccl);
  EXPECT_THROW(sub.make_id(), Error);
  EXPECT_THROW(sub.form(std::vector<uint8_t>(sizeof(ncclUniqueId)), 2, 0, false), Error);
  EXPECT_THROW(SubComm(fake_nccl()).form(std::vector<uint8_t>(3), 2, 0, false), Error);
}

}  // namespace
}  // namespace magi::rewrite
