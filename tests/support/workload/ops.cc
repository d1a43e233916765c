// ops --out DIR: every NCCL operation with every datatype (reductions with every reduction op),
// odd counts, in place and out of place, a Send/Recv ring and an all-pairs exchange in groups.
// Each result is checked against reference.h and its bytes are appended to DIR/rank<r>.bin, so
// runs with and without the shim (or with different slot sizes) can be compared byte for byte.
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/reference.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

constexpr ncclDataType_t kAllTypes[] = {ncclInt8,    ncclUint8,    ncclInt32,      ncclUint32,
                                        ncclInt64,   ncclUint64,   ncclFloat16,    ncclFloat32,
                                        ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2};
constexpr ncclRedOp_t kAllOps[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
constexpr size_t kCounts[] = {1, 7, 1000};
constexpr size_t kBigCount = (size_t{1} << 16) + 3;
constexpr unsigned char kUnwritten = 0xa5;  // fills receive buffers, so untouched bytes show

class OpsRun {
 public:
  OpsRun(ncclComm_t comm, int rank, int nranks, const std::string& out_path)
      : comm_(comm), rank_(rank), n_(nranks) {
    out_.reset(std::fopen(out_path.c_str(), "wb"));
    if (!out_) throw ScenarioFailure("cannot write " + out_path);
  }

  void all_reduce(ncclDataType_t dt, ncclRedOp_t op, size_t count, bool in_place) {
    const int id = next_case();
    const auto inputs = all_inputs(dt, id, count);
    Bytes send = inputs[rank_];
    Bytes recv = in_place ? send : unwritten(dt, count);
    WORKLOAD_CHECK(ncclAllReduce(in_place ? recv.data() : send.data(), recv.data(), count, dt, op,
                                 comm_, nullptr));
    if (!in_place) expect_unchanged(send, inputs[rank_], "AllReduce sendbuff");
    verify(what("AllReduce", dt, count, in_place, op), dt, recv,
           reference_reduce(dt, op, inputs, 0, count));
  }

  void reduce(ncclDataType_t dt, ncclRedOp_t op, size_t count, bool in_place) {
    const int id = next_case();
    const int root = id % n_;
    const auto inputs = all_inputs(dt, id, count);
    Bytes send = inputs[rank_];
    Bytes recv = in_place ? send : unwritten(dt, count);
    WORKLOAD_CHECK(ncclReduce(in_place ? recv.data() : send.data(), recv.data(), count, dt, op,
                              root, comm_, nullptr));
    if (rank_ != root) return;  // recvbuff is defined on the root only
    verify(what("Reduce", dt, count, in_place, op, root), dt, recv,
           reference_reduce(dt, op, inputs, 0, count));
  }

  void reduce_scatter(ncclDataType_t dt, ncclRedOp_t op, size_t count, bool in_place) {
    const int id = next_case();
    const auto inputs = all_inputs(dt, id, count * n_);
    Bytes send = inputs[rank_];
    const size_t size = element_bytes(dt);
    Bytes recv = unwritten(dt, count);
    unsigned char* result = in_place ? send.data() + rank_ * count * size : recv.data();
    WORKLOAD_CHECK(ncclReduceScatter(send.data(), result, count, dt, op, comm_, nullptr));
    verify(what("ReduceScatter", dt, count, in_place, op), dt, Bytes(result, result + count * size),
           reference_reduce(dt, op, inputs, rank_ * count, count));
  }

  void all_gather(ncclDataType_t dt, size_t count, bool in_place) {
    const int id = next_case();
    const auto inputs = all_inputs(dt, id, count);
    const size_t bytes = count * element_bytes(dt);
    Bytes send = inputs[rank_];
    Bytes recv = unwritten(dt, count * n_);
    const void* sendbuff = send.data();
    if (in_place) {
      std::memcpy(recv.data() + rank_ * bytes, send.data(), bytes);
      sendbuff = recv.data() + rank_ * bytes;
    }
    WORKLOAD_CHECK(ncclAllGather(sendbuff, recv.data(), count, dt, comm_, nullptr));
    Bytes expected;
    for (const Bytes& in : inputs) expected.insert(expected.end(), in.begin(), in.end());
    verify(what("AllGather", dt, count, in_place), dt, recv, expected);
  }

  void broadcast(ncclDataType_t dt, size_t count, bool in_place, bool bcast) {
    const int id = next_case();
    const int root = id % n_;
    const Bytes root_input = make_input(dt, root, id, count);
    Bytes send = make_input(dt, rank_, id, count);
    Bytes recv = in_place && rank_ == root ? send : unwritten(dt, count);
    if (bcast) {
      WORKLOAD_CHECK(ncclBcast(recv.data(), count, dt, root, comm_, nullptr));
    } else {
      WORKLOAD_CHECK(ncclBroadcast(in_place ? recv.data() : send.data(), recv.data(), count, dt,
                                   root, comm_, nullptr));
    }
    verify(what(bcast ? "Bcast" : "Broadcast", dt, count, in_place, -1, root), dt, recv,
           root_input);
  }

  void all_to_all(ncclDataType_t dt, size_t count) {
    const int id = next_case();
    const auto inputs = all_inputs(dt, id, count * n_);
    const size_t bytes = count * element_bytes(dt);
    Bytes send = inputs[rank_];
    Bytes recv = unwritten(dt, count * n_);
    WORKLOAD_CHECK(ncclAlltoAll(send.data(), recv.data(), count, dt, comm_, nullptr));
    expect_unchanged(send, inputs[rank_], "AlltoAll sendbuff");
    Bytes expected;
    for (const Bytes& in : inputs) {
      expected.insert(expected.end(), in.begin() + rank_ * bytes, in.begin() + (rank_ + 1) * bytes);
    }
    verify(what("AlltoAll", dt, count, false), dt, recv, expected);
  }

  void gather(ncclDataType_t dt, size_t count, bool in_place) {
    const int id = next_case();
    const int root = id % n_;
    const auto inputs = all_inputs(dt, id, count);
    const size_t bytes = count * element_bytes(dt);
    Bytes send = inputs[rank_];
    Bytes recv = unwritten(dt, count * n_);
    const void* sendbuff = send.data();
    if (in_place && rank_ == root) {
      std::memcpy(recv.data() + root * bytes, send.data(), bytes);
      sendbuff = recv.data() + root * bytes;
    }
    // recvbuff matters on the root only; the others pass NULL, as NCCL allows.
    WORKLOAD_CHECK(ncclGather(sendbuff, rank_ == root ? recv.data() : nullptr, count, dt, root,
                              comm_, nullptr));
    if (rank_ != root) return;
    Bytes expected;
    for (const Bytes& in : inputs) expected.insert(expected.end(), in.begin(), in.end());
    verify(what("Gather", dt, count, in_place, -1, root), dt, recv, expected);
  }

  void scatter(ncclDataType_t dt, size_t count, bool in_place) {
    const int id = next_case();
    const int root = id % n_;
    const size_t bytes = count * element_bytes(dt);
    Bytes send = make_input(dt, root, id, count * n_);
    const Bytes root_input = send;
    Bytes recv = unwritten(dt, count);
    unsigned char* result = in_place && rank_ == root ? send.data() + root * bytes : recv.data();
    WORKLOAD_CHECK(ncclScatter(rank_ == root ? send.data() : nullptr, result, count, dt, root,
                               comm_, nullptr));
    verify(what("Scatter", dt, count, in_place, -1, root), dt, Bytes(result, result + bytes),
           Bytes(root_input.begin() + rank_ * bytes, root_input.begin() + (rank_ + 1) * bytes));
  }

  // Each rank sends to the next and receives from the previous, in one group.
  void ring(ncclDataType_t dt, size_t count) {
    const int id = next_case();
    const int next = (rank_ + 1) % n_;
    const int prev = (rank_ + n_ - 1) % n_;
    Bytes send = make_input(dt, rank_, id, count);
    Bytes recv = unwritten(dt, count);
    WORKLOAD_CHECK(ncclGroupStart());
    WORKLOAD_CHECK(ncclSend(send.data(), count, dt, next, comm_, nullptr));
    WORKLOAD_CHECK(ncclRecv(recv.data(), count, dt, prev, comm_, nullptr));
    WORKLOAD_CHECK(ncclGroupEnd());
    verify(what("Send/Recv ring", dt, count, false), dt, recv, make_input(dt, prev, id, count));
  }

  // Every rank sends block p to rank p (itself included) and receives block `rank` from each.
  void all_pairs(ncclDataType_t dt, size_t count) {
    const int id = next_case();
    const auto inputs = all_inputs(dt, id, count * n_);
    const size_t bytes = count * element_bytes(dt);
    Bytes send = inputs[rank_];
    Bytes recv = unwritten(dt, count * n_);
    WORKLOAD_CHECK(ncclGroupStart());
    for (int p = 0; p < n_; ++p) {
      WORKLOAD_CHECK(ncclSend(send.data() + p * bytes, count, dt, p, comm_, nullptr));
      WORKLOAD_CHECK(ncclRecv(recv.data() + p * bytes, count, dt, p, comm_, nullptr));
    }
    WORKLOAD_CHECK(ncclGroupEnd());
    Bytes expected;
    for (const Bytes& in : inputs) {
      expected.insert(expected.end(), in.begin() + rank_ * bytes, in.begin() + (rank_ + 1) * bytes);
    }
    verify(what("Send/Recv all pairs", dt, count, false), dt, recv, expected);
  }

  int cases() const { return case_id_; }

 private:
  int next_case() { return case_id_++; }

  std::vector<Bytes> all_inputs(ncclDataType_t dt, int id, size_t count) const {
    std::vector<Bytes> inputs;
    for (int r = 0; r < n_; ++r) inputs.push_back(make_input(dt, r, id, count));
    return inputs;
  }

  static Bytes unwritten(ncclDataType_t dt, size_t count) {
    return Bytes(count * element_bytes(dt), kUnwritten);
  }

  std::string what(const char* op, ncclDataType_t dt, size_t count, bool in_place, int redop = -1,
                   int root = -1) const {
    std::string text = format("case #%d %s(%s", case_id_ - 1, op, dtype_text(dt));
    if (redop >= 0) text += format(", %s", redop_text(static_cast<ncclRedOp_t>(redop)));
    if (root >= 0) text += format(", root %d", root);
    return text + format(", count %zu, %s)", count, in_place ? "in place" : "out of place");
  }

  void expect_unchanged(const Bytes& now, const Bytes& before, const char* what_buffer) const {
    if (now != before)
      throw ScenarioFailure(format("rank %d: %s was modified", rank_, what_buffer));
  }

  void verify(const std::string& what_op, ncclDataType_t dt, const Bytes& got,
              const Bytes& expected) {
    const size_t size = element_bytes(dt);
    if (got.size() != expected.size()) {
      throw ScenarioFailure(format("rank %d: %s: %zu result bytes, expected %zu", rank_,
                                   what_op.c_str(), got.size(), expected.size()));
    }
    for (size_t i = 0; i < got.size(); i += size) {
      if (std::memcmp(got.data() + i, expected.data() + i, size) != 0) {
        throw ScenarioFailure(format("rank %d: %s: element %zu is %s, expected %s", rank_,
                                     what_op.c_str(), i / size,
                                     element_text(dt, got.data() + i).c_str(),
                                     element_text(dt, expected.data() + i).c_str()));
      }
    }
    if (!got.empty() && std::fwrite(got.data(), 1, got.size(), out_.get()) != got.size()) {
      throw ScenarioFailure("cannot append the result file");
    }
  }

  struct FileCloser {
    void operator()(FILE* f) const { std::fclose(f); }
  };

  ncclComm_t comm_;
  int rank_;
  int n_;
  std::unique_ptr<FILE, FileCloser> out_;
  int case_id_ = 0;
};

}  // namespace

int run_ops(const ScenarioOptions& options) {
  const std::string dir = options.text("out", "");
  if (dir.empty()) throw ScenarioFailure("ops needs --out DIR");
  const Bootstrap boot = bootstrap_from_env();
  OwnedComm comm;
  WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  {
    OpsRun run(comm.get(), boot.rank, boot.nranks,
               dir + "/rank" + std::to_string(boot.rank) + ".bin");
    for (ncclDataType_t dt : kAllTypes) {
      for (size_t count : kCounts) {
        for (bool in_place : {false, true}) {
          for (ncclRedOp_t op : kAllOps) {
            run.all_reduce(dt, op, count, in_place);
            run.reduce(dt, op, count, in_place);
            run.reduce_scatter(dt, op, count, in_place);
          }
          run.all_gather(dt, count, in_place);
          run.broadcast(dt, count, in_place, false);
          run.gather(dt, count, in_place);
          run.scatter(dt, count, in_place);
        }
        run.broadcast(dt, count, true, true);
        run.all_to_all(dt, count);
        run.ring(dt, count);
      }
    }
    run.ring(ncclFloat32, 0);
    run.all_pairs(ncclFloat32, 1000);
    run.all_pairs(ncclInt8, 7);

    // Large enough to move in many chunks under a small STANDIN_SLOT_KIB.
    for (bool in_place : {false, true}) {
      run.all_reduce(ncclFloat32, ncclSum, kBigCount, in_place);
      run.all_reduce(ncclBfloat16, ncclMax, kBigCount, in_place);
      run.reduce(ncclFloat8e5m2, ncclSum, kBigCount, in_place);
      run.reduce_scatter(ncclInt32, ncclSum, kBigCount, in_place);
      run.all_gather(ncclUint8, kBigCount, in_place);
      run.broadcast(ncclFloat64, kBigCount, in_place, false);
      run.gather(ncclFloat16, kBigCount, in_place);
      run.scatter(ncclInt8, kBigCount, in_place);
    }
    run.all_to_all(ncclInt64, kBigCount);
    run.ring(ncclFloat32, kBigCount);
    run.all_pairs(ncclUint8, kBigCount);
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
