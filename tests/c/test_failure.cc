// test_failure.cc: a failure on one rank ends the other ranks' waits on the same host at once, whatever their
// timeouts: ranks that call different collectives all get T3D_ERR_MISMATCH saying what each side called, and a rank
// whose collective timed out tells the others, whose errors quote it. Errors are compared word for word. (A rank
// whose process dies: test_fork and tests/python/test_failure.py.)
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(Failure, DesynchronisedCollectivesFailOnEveryRank) {
  RunOptions o;
  o.comm_timeout_ms = 60000;  // far longer than the test allows
  o.name = "desync";
  o.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> x(16, 1.0f);
    const auto t0 = Clock::now();
    t3d_request_t *r = nullptr;
    t3d_result_t res = rank == 0 ? t3d_allreduce(comm, x.data(), x.data(), x.size(), T3D_FLOAT32, T3D_SUM, nullptr, &r)
                                 : t3d_broadcast(comm, x.data(), x.size(), T3D_FLOAT32, 0, nullptr, &r);
    std::string err;
    res = Complete(res, r, &err);
    EXPECT_EQ(T3D_ERR_MISMATCH, res) << "rank " << rank << ": " << err;
    EXPECT_LT(SecondsSince(t0), 10.0) << "rank " << rank;
    const std::string own = rank == 0 ? "allreduce" : "broadcast";
    const std::string finding =
        "(rank 0 runs allreduce( #1| of 64 bytes \\(float32, sum\\)) where this rank runs broadcast of 64 bytes"
        "( \\(float32, root 0\\))?|rank 1 runs broadcast( #1| of 64 bytes \\(float32, root 0\\)) where this rank "
        "runs allreduce of 64 bytes( \\(float32, sum\\))?) \\(ranks disagree on the operation";
    // Either this rank found the mismatch, or the other one did and this rank quotes it.
    const std::regex found("^t3d: " + own + " #1 on group 'desync' \\(rank " + std::to_string(rank) + " of 2\\): " +
                           finding);
    const std::regex told("^t3d: " + own + " #1 on group 'desync' \\(rank " + std::to_string(rank) +
                          " of 2\\) failed: rank " + std::to_string(1 - rank) + " broke the group: t3d: " +
                          (rank == 0 ? "broadcast" : "allreduce") + " #1 on group 'desync' \\(rank " +
                          std::to_string(1 - rank) + " of 2\\): " + finding);
    EXPECT_TRUE(std::regex_search(err, found) || std::regex_search(err, told)) << "rank " << rank << ": " << err;
  }, o);
}

// Two ranks that each name themselves the root of one broadcast read nothing of each other's: the later one finds
// the other's line in the same step (a small slot at 64 B, a half at 64 KiB, or the step of a single-copy
// broadcast, whose roots wait for their readers), fails, and breaks the group, so the earlier one fails in its next
// call, or in this one if it still waits there. Neither may return normally from both calls.
TEST(Failure, TwoRootsOfOneBroadcastAreFound) {
  struct Way {
    size_t n;
    const char *direct;  // T3D_SHM_BCAST_DIRECT_BYTES
  };
  for (const Way &w : {Way{16, "0"}, Way{16384, "0"}, Way{16384, "1"}}) {
    const size_t n = w.n;
    SetEnv("T3D_SHM_BCAST_DIRECT_BYTES", w.direct);
    RunOptions o;
    o.comm_timeout_ms = 60000;
    o.name = "roots";
    o.abort_on_failure = false;
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      std::vector<float> x(n, float(rank + 1));
      const auto t0 = Clock::now();
      t3d_request_t *r = nullptr;
      std::string err;
      t3d_result_t res = t3d_broadcast(comm, x.data(), n, T3D_FLOAT32, rank, nullptr, &r);
      res = Complete(res, r, &err);
      const std::string bytes = std::to_string(n * 4);
      const std::string finding = "rank " + std::to_string(1 - rank) + " runs broadcast of " + bytes +
                                  " bytes \\(float32, root " + std::to_string(1 - rank) +
                                  "\\) where this rank runs broadcast of " + bytes + " bytes \\(float32, root " +
                                  std::to_string(rank) + "\\) \\(ranks disagree on its dtype, reduce op or root\\)";
      if (res == T3D_OK) {
        // The earlier root: told in its next call.
        r = nullptr;
        res = t3d_barrier(comm, nullptr, &r);
        res = Complete(res, r, &err);
        EXPECT_EQ(T3D_ERR_MISMATCH, res) << "rank " << rank << ", " << n << " floats: " << err;
        EXPECT_NE(err.find("rank " + std::to_string(1 - rank) + " broke the group"), std::string::npos) << err;
      } else {
        EXPECT_EQ(T3D_ERR_MISMATCH, res) << "rank " << rank << ", " << n << " floats: " << err;
        const std::string theirs = "rank " + std::to_string(rank) + " runs broadcast of " + bytes +
                                   " bytes \\(float32, root " + std::to_string(rank) +
                                   "\\) where this rank runs broadcast of " + bytes + " bytes \\(float32, root " +
                                   std::to_string(1 - rank) + "\\)";
        const std::string told = "failed: rank " + std::to_string(1 - rank) + " broke the group: .*" + theirs;
        EXPECT_TRUE(std::regex_search(err, std::regex(finding)) || std::regex_search(err, std::regex(told)))
            << "rank " << rank << ": " << err;
      }
      EXPECT_LT(SecondsSince(t0), 10.0) << "rank " << rank;
    }, o);
  }
  UnsetEnv("T3D_SHM_BCAST_DIRECT_BYTES");
}

TEST(Failure, ATimeoutOnOneRankEndsTheOthersWaits) {
  RunOptions o;
  o.comm_timeout_ms = 60000;
  o.name = "told";
  o.abort_on_failure = false;
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    if (rank == 2) return;  // never joins
    std::vector<float> x(1024, 1.0f);
    t3d_opts_t opts{};
    opts.timeout_ms = rank == 0 ? 500 : 60000;
    const auto t0 = Clock::now();
    t3d_request_t *r = nullptr;
    std::string err;
    t3d_result_t res = t3d_allreduce(comm, x.data(), x.data(), x.size(), T3D_FLOAT32, T3D_SUM, &opts, &r);
    res = Complete(res, r, &err);
    EXPECT_EQ(T3D_ERR_TIMEOUT, res) << "rank " << rank << ": " << err;
    const std::string timed_out =
        "t3d: allreduce #1 on group 'told' (rank 0 of 3) timed out (timeout 500 ms); still waiting for rank(s) 2 "
        "(shared memory)";
    if (rank == 0) {
      EXPECT_EQ(timed_out, err);
    } else {
      // Told by rank 0 long before its own timeout.
      EXPECT_LT(SecondsSince(t0), 10.0);
      EXPECT_EQ("t3d: allreduce #1 on group 'told' (rank 1 of 3) failed: rank 0 broke the group: " + timed_out, err);
    }
  }, o);
}

}  // namespace
