// test_nccl.cc: the CUDA path (opts.memtype T3D_MEM_CUDA, run through NCCL) against the fake NCCL of fake_nccl.c,
// which works on host memory with ranks as threads. Every collective is checked against the same call on the host
// path; then the communicators NCCL gets (lazy, one per group, one per pair), the dtype and op mapping, groups,
// errors, abort, asynchronous errors, streams, splits and timeouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fake_nccl_api.h"
#include "harness.h"

using namespace t3dtest;

namespace {

using Buf = std::vector<unsigned char>;
using Clock = std::chrono::steady_clock;

const unsigned char kFill = 0xA5;
const size_t kSmallCounts[] = {0, 1, 7};
const size_t kBig = 100003;
const char *const kGroupName = "cudatest";

// The fake, opened by the same path that T3D_NCCL_LIBRARY names, so that t3d and the tests share one copy.
FakeNccl &Fake() {
  static FakeNccl fake;
  return fake;
}

class FakeNcclEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    SetEnv("T3D_NCCL_LIBRARY", T3D_FAKE_NCCL_PATH);
    // Every rank here names device 0: the NCCL path is under test, not the staged one that ranks sharing a device
    // would take (test_cudev).
    SetEnv("T3D_CUDA_PATH", "nccl");
    ASSERT_TRUE(Fake().Open(T3D_FAKE_NCCL_PATH)) << Fake().error;
  }
};
::testing::Environment *const kFakeEnv = ::testing::AddGlobalTestEnvironment(new FakeNcclEnvironment);

// Every test leaves no NCCL communicator and no PreMulSum operator alive.
class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    live_ = Fake().comms_live();
    premul_ = Fake().premul_live();
  }
  void TearDown() override {
    EXPECT_EQ(Fake().comms_live(), live_) << "NCCL communicators left alive: t3d_comm_destroy must destroy them";
    EXPECT_EQ(Fake().premul_live(), premul_) << "PreMulSum operators left alive";
  }
  int live_ = 0, premul_ = 0;
};

class NcclWorld : public ::testing::WithParamInterface<int>, public NcclTest {};

std::string WorldName(const ::testing::TestParamInfo<int> &info) { return "n" + std::to_string(info.param); }

#define STOP_IF_FAILED()                       \
  do {                                         \
    if (::testing::Test::HasFailure()) return; \
  } while (0)

Buf Bytes(t3d_dtype_t dt, size_t n) { return Buf(std::max<size_t>(1, n * t3d_dtype_size(dt)), kFill); }

t3d_opts_t HostOpts(t3d_dtype_t dt) {
  t3d_opts_t o{};
  o.premul_scalar = PremulScalar(dt);
  return o;
}

t3d_opts_t CudaOpts(t3d_dtype_t dt, void *stream = nullptr, int device = 0) {
  t3d_opts_t o = HostOpts(dt);
  o.memtype = T3D_MEM_CUDA;
  o.device = device;
  o.stream = stream;
  return o;
}

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

std::string Lower(std::string s) {
  for (char &c : s) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
  return s;
}

bool Contains(const std::string &text, const std::string &word) {
  return Lower(text).find(Lower(word)) != std::string::npos;
}

// Whether text holds n as a whole number.
bool MentionsNumber(const std::string &text, long n) {
  const std::string num = std::to_string(n);
  for (size_t at = text.find(num); at != std::string::npos; at = text.find(num, at + 1)) {
    const bool left = at == 0 || !isdigit(static_cast<unsigned char>(text[at - 1]));
    const size_t end = at + num.size();
    const bool right = end == text.size() || !isdigit(static_cast<unsigned char>(text[end]));
    if (left && right) return true;
  }
  return false;
}

// Whether text names rank r: "rank" followed within a few characters by r as a whole number.
bool MentionsRank(const std::string &text, int r) {
  const std::string lower = Lower(text), num = std::to_string(r);
  for (size_t at = lower.find("rank"); at != std::string::npos; at = lower.find("rank", at + 1)) {
    const size_t end = std::min(lower.size(), at + 24);
    for (size_t i = at + 4; i + num.size() <= end; ++i) {
      if (lower.compare(i, num.size(), num) != 0) continue;
      const bool left = !isdigit(static_cast<unsigned char>(lower[i - 1]));
      const bool right = i + num.size() == lower.size() || !isdigit(static_cast<unsigned char>(lower[i + num.size()]));
      if (left && right) return true;
    }
  }
  return false;
}

t3d_request_t *const kPoison = reinterpret_cast<t3d_request_t *>(static_cast<uintptr_t>(0x10));

// A standalone CUDA call either fails at once (with *req NULL) or returns a request that is already complete.
// Returns the call's error or the request's result; *err gets the communicator's or the request's error text.
t3d_result_t CudaRun(t3d_comm_t *comm, const std::string &what, const IssueFn &issue, std::string *err = nullptr) {
  t3d_request_t *req = kPoison;
  const t3d_result_t r = issue(&req);
  if (r != T3D_OK) {
    EXPECT_EQ(req, nullptr) << Tag(t3d_comm_rank(comm), what) << ": a failed call must set *req to NULL";
    if (err) *err = t3d_comm_last_error(comm);
    return r;
  }
  if (req == nullptr || req == kPoison) {
    ADD_FAILURE() << Tag(t3d_comm_rank(comm), what) << ": T3D_OK without a request";
    return T3D_ERR_INTERNAL;
  }
  const t3d_result_t polled = t3d_test(req);
  EXPECT_NE(polled, T3D_IN_PROGRESS) << Tag(t3d_comm_rank(comm), what)
                                     << ": a standalone CUDA request must be complete when the call returns";
  return Finish(req, err);
}

bool CudaOk(t3d_comm_t *comm, const std::string &what, const IssueFn &issue) {
  std::string err;
  const t3d_result_t r = CudaRun(comm, what, issue, &err);
  if (r == T3D_OK) return true;
  ADD_FAILURE() << Tag(t3d_comm_rank(comm), what) << " -> " << t3d_result_string(r) << ": \"" << err << "\"";
  return false;
}

// The host path's result is the oracle: runs `issue` with host options (`host`, NULL for the defaults) writing into
// `oracle`, then with `cuda` writing into `out`. False, with the failure recorded, when the rank should stop.
using IssueIntoFn = std::function<t3d_result_t(const t3d_opts_t *, void *, t3d_request_t **)>;
bool HostThenCuda(t3d_comm_t *comm, const std::string &what, const t3d_opts_t *host, const t3d_opts_t &cuda,
                  void *oracle, void *out, const IssueIntoFn &issue) {
  return RunOk(comm, what + " (host)", [&](t3d_request_t **r) { return issue(host, oracle, r); }) &&
         CudaOk(comm, what, [&](t3d_request_t **r) { return issue(&cuda, out, r); });
}

void ExpectCudaUnsupported(t3d_comm_t *comm, const std::string &what, const IssueFn &issue) {
  std::string err;
  const t3d_result_t r = CudaRun(comm, what, issue, &err);
  EXPECT_EQ(r, T3D_ERR_UNSUPPORTED) << Tag(t3d_comm_rank(comm), what) << " -> " << t3d_result_string(r) << " ("
                                    << err << ")";
  EXPECT_EQ(t3d_comm_status(comm), T3D_OK) << Tag(t3d_comm_rank(comm), what)
                                           << ": an unsupported call must not break the communicator";
}

bool IsBitwise(t3d_redop_t op) { return op == T3D_BAND || op == T3D_BOR || op == T3D_BXOR; }

// What the CUDA path reduces: what the host does, less bitwise ops on integers and BXOR on bool.
bool CudaSupported(t3d_redop_t op, t3d_dtype_t dt) {
  if (t3d_redop_supported(op, dt) != T3D_OK) return false;
  if (IsInteger(dt) && IsBitwise(op)) return false;
  if (dt == T3D_BOOL && op == T3D_BXOR) return false;
  return true;
}

bool BigCase(t3d_dtype_t dt, t3d_redop_t op) {
  return (dt == T3D_FLOAT32 || dt == T3D_BFLOAT16 || dt == T3D_INT64) && (op == T3D_SUM || op == T3D_AVG);
}

std::vector<size_t> CountsFor(t3d_dtype_t dt, t3d_redop_t op) {
  std::vector<size_t> c(std::begin(kSmallCounts), std::end(kSmallCounts));
  if (BigCase(dt, op)) c.push_back(kBig);
  return c;
}

std::vector<size_t> MoveCounts(t3d_dtype_t dt) {
  std::vector<size_t> c(std::begin(kSmallCounts), std::end(kSmallCounts));
  if (dt == T3D_FLOAT32) c.push_back(kBig);
  return c;
}

RunOptions Named() {
  RunOptions o;
  o.name = kGroupName;
  return o;
}

// Cross-rank counter snapshots: rank 0 reads `read` between host barriers, so that every rank's calls before the
// first barrier are in `before` and every rank's calls before the second are in the value after. One object is
// shared by the ranks of a run (made outside RunRanks).
class Delta {
 public:
  explicit Delta(std::function<long()> read) : read_(std::move(read)) {}
  // Called by every rank.
  bool Start(int rank) {
    if (!HostBarrier()) return false;
    if (rank == 0) before_ = read_();
    return HostBarrier();
  }
  // Called by every rank; returns the change seen by rank 0 (valid on every rank after the second barrier).
  bool Stop(int rank, long *delta) {
    if (!HostBarrier()) return false;
    if (rank == 0) delta_ = read_() - before_;
    if (!HostBarrier()) return false;
    *delta = delta_;
    return HostBarrier();
  }

 private:
  std::function<long()> read_;
  long before_ = 0;
  long delta_ = 0;
};

// ---------- loading ----------

TEST_F(NcclTest, LoadsTheFake) {
  EXPECT_STREQ(t3d_nccl_version_string(), "2.27.5");
  EXPECT_STREQ(t3d_nccl_load_error(), "");
}

// ---------- reductions against the host path ----------

TEST_P(NcclWorld, Allreduce) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t host = HostOpts(dt), cuda = CudaOpts(dt);
        for (size_t count : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          const std::string what = "allreduce " + CaseName(dt, op, count);
          Buf in = Bytes(dt, count), out = Bytes(dt, count), oracle = Bytes(dt, count);
          FillInput(dt, op, rank, in.data(), count);
          if (!CudaSupported(op, dt)) {
            ExpectCudaUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out.data(), count, dt, op, &cuda, r);
            });
            EXPECT_EQ(out, Bytes(dt, count)) << Tag(rank, what) << ": an unsupported call wrote its output";
            continue;
          }
          if (!HostThenCuda(comm, what, &host, cuda, oracle.data(), out.data(),
                            [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                              return t3d_allreduce(comm, in.data(), dst, count, dt, op, opts, r);
                            }))
            return;
          EXPECT_EQ("", CompareBuffers(dt, out.data(), oracle.data(), count, 2 * Tolerance(dt, op)))
              << Tag(rank, what) << " (CUDA vs host)";
          Buf io = in;
          if (!CudaOk(comm, what + " in place", [&](t3d_request_t **r) {
                return t3d_allreduce(comm, io.data(), io.data(), count, dt, op, &cuda, r);
              }))
            return;
          EXPECT_EQ("", ByteDiff(io, out)) << Tag(rank, what) << " (in place vs out of place)";
        }
      }
    }
  });
}

TEST_P(NcclWorld, Reduce) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    size_t k = 0;
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t host = HostOpts(dt), cuda = CudaOpts(dt);
        for (size_t count : CountsFor(dt, op)) {
          // Every root for SUM, a rotating root for the other ops.
          std::vector<int> roots;
          if (op == T3D_SUM && count != kBig) {
            for (int r = 0; r < n; ++r) roots.push_back(r);
          } else {
            roots.push_back(static_cast<int>(k++ % static_cast<size_t>(n)));
          }
          for (int root : roots) {
            STOP_IF_FAILED();
            const std::string what = "reduce root " + std::to_string(root) + " " + CaseName(dt, op, count);
            Buf in = Bytes(dt, count), out = Bytes(dt, count), oracle = Bytes(dt, count);
            FillInput(dt, op, rank, in.data(), count);
            void *recv = rank == root ? out.data() : nullptr;
            if (!CudaSupported(op, dt)) {
              ExpectCudaUnsupported(comm, what, [&](t3d_request_t **r) {
                return t3d_reduce(comm, in.data(), recv, count, dt, op, root, &cuda, r);
              });
              continue;
            }
            if (!HostThenCuda(comm, what, &host, cuda, rank == root ? oracle.data() : nullptr, recv,
                              [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                                return t3d_reduce(comm, in.data(), dst, count, dt, op, root, opts, r);
                              }))
              return;
            if (rank == root) {
              EXPECT_EQ("", CompareBuffers(dt, out.data(), oracle.data(), count, 2 * Tolerance(dt, op)))
                  << Tag(rank, what);
            }
          }
        }
      }
    }
  });
}

TEST_P(NcclWorld, ReduceScatter) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t host = HostOpts(dt), cuda = CudaOpts(dt);
        for (size_t count0 : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
          const size_t total = count * static_cast<size_t>(n);
          const std::string what = "reduce_scatter " + CaseName(dt, op, count);
          Buf in = Bytes(dt, total), out = Bytes(dt, count), oracle = Bytes(dt, count);
          FillInput(dt, op, rank, in.data(), total);
          if (!CudaSupported(op, dt)) {
            ExpectCudaUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_reduce_scatter(comm, in.data(), out.data(), count, dt, op, &cuda, r);
            });
            continue;
          }
          if (!HostThenCuda(comm, what, &host, cuda, oracle.data(), out.data(),
                            [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                              return t3d_reduce_scatter(comm, in.data(), dst, count, dt, op, opts, r);
                            }))
            return;
          EXPECT_EQ("", CompareBuffers(dt, out.data(), oracle.data(), count, 2 * Tolerance(dt, op)))
              << Tag(rank, what);
        }
      }
    }
  });
}

// Unequal blocks, every third rank's empty: NCCL gets one ncclReduce per non-empty block.
TEST_P(NcclWorld, ReduceScatterv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (t3d_redop_t op : {T3D_SUM, T3D_MAX, T3D_AVG, T3D_PREMUL_SUM}) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_opts_t host = HostOpts(dt), cuda = CudaOpts(dt);
        for (size_t base : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          if (base == kBig) base = kBig / static_cast<size_t>(n);
          std::vector<size_t> counts(static_cast<size_t>(n)), offs(static_cast<size_t>(n));
          for (int r = 0; r < n; ++r) counts[r] = (r % 3 == 1) ? 0 : base + static_cast<size_t>(r);
          std::exclusive_scan(counts.begin(), counts.end(), offs.begin(), static_cast<size_t>(0));
          const size_t total = offs.back() + counts.back(), mine = counts[rank];
          const std::string what =
              "reduce_scatterv " + CaseName(dt, op, base) + " (mine " + std::to_string(mine) + ")";
          Buf in = Bytes(dt, total), out = Bytes(dt, mine), oracle = Bytes(dt, mine);
          FillInput(dt, op, rank, in.data(), total);
          if (!CudaSupported(op, dt)) {
            ExpectCudaUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_reduce_scatterv(comm, in.data(), out.data(), counts.data(), dt, op, &cuda, r);
            });
            continue;
          }
          if (!HostThenCuda(comm, what, &host, cuda, oracle.data(), out.data(),
                            [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                              return t3d_reduce_scatterv(comm, in.data(), dst, counts.data(), dt, op, opts, r);
                            }))
            return;
          EXPECT_EQ("", CompareBuffers(dt, out.data(), oracle.data(), mine, 2 * Tolerance(dt, op)))
              << Tag(rank, what);
          if (mine == 0) {
            EXPECT_EQ(out[0], kFill) << Tag(rank, what) << ": wrote into an empty receive";
          }
        }
      }
    }
  });
}

// ---------- data movement against the host path ----------

TEST_P(NcclWorld, AllgatherAndAllgatherv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      const t3d_opts_t cuda = CudaOpts(dt);
      for (size_t count0 : MoveCounts(dt)) {
        STOP_IF_FAILED();
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        const std::string what = "allgather " + std::string(t3d_dtype_name(dt)) + " count=" + std::to_string(count);
        Buf in = Bytes(dt, count), out = Bytes(dt, count * n), oracle = Bytes(dt, count * n);
        FillPattern(dt, rank, in.data(), count);
        if (!HostThenCuda(comm, what, nullptr, cuda, oracle.data(), out.data(),
                          [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                            return t3d_allgather(comm, in.data(), dst, count, dt, opts, r);
                          }))
          return;
        EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what);
        // In place: my block already sits in the output.
        Buf io = Bytes(dt, count * n);
        if (count) memcpy(io.data() + rank * count * es, in.data(), count * es);
        if (!CudaOk(comm, what + " in place", [&](t3d_request_t **r) {
              return t3d_allgather(comm, io.data() + rank * count * es, io.data(), count, dt, &cuda, r);
            }))
          return;
        if (count) {
          EXPECT_EQ("", ByteDiff(io, oracle)) << Tag(rank, what) << " in place";
        }
      }
      for (size_t base : MoveCounts(dt)) {
        STOP_IF_FAILED();
        if (base == kBig) base = kBig / static_cast<size_t>(n);
        std::vector<size_t> counts, displs;
        const size_t at = AllgathervLayout(n, base, &counts, &displs);
        const std::string what = "allgatherv " + std::string(t3d_dtype_name(dt)) + " base=" + std::to_string(base);
        Buf in = Bytes(dt, counts[rank]), out = Bytes(dt, at), oracle = Bytes(dt, at);
        FillPattern(dt, rank, in.data(), counts[rank]);
        if (!HostThenCuda(comm, what, nullptr, cuda, oracle.data(), out.data(),
                          [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                            return t3d_allgatherv(comm, in.data(), counts[rank], dst, counts.data(), displs.data(),
                                                  dt, opts, r);
                          }))
          return;
        EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what) << " (gaps keep their bytes)";
      }
    }
  });
}

TEST_P(NcclWorld, BroadcastEveryRoot) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const t3d_opts_t cuda = CudaOpts(dt);
      for (size_t count : MoveCounts(dt)) {
        for (int root = 0; root < n; ++root) {
          STOP_IF_FAILED();
          const std::string what = "broadcast root " + std::to_string(root) + " " +
                                   std::string(t3d_dtype_name(dt)) + " count=" + std::to_string(count);
          Buf buf = Bytes(dt, count), want = Bytes(dt, count);
          FillPattern(dt, root, want.data(), count, 0, 1);
          if (rank == root) buf = want;
          if (!CudaOk(comm, what, [&](t3d_request_t **r) {
                return t3d_broadcast(comm, buf.data(), count, dt, root, &cuda, r);
              }))
            return;
          EXPECT_EQ("", ByteDiff(buf, want)) << Tag(rank, what);
        }
      }
    }
  });
}

TEST_P(NcclWorld, GatherScatterEveryRoot) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const t3d_opts_t cuda = CudaOpts(dt);
      for (size_t count0 : MoveCounts(dt)) {
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        for (int root = 0; root < n; ++root) {
          STOP_IF_FAILED();
          const std::string suffix = " root " + std::to_string(root) + " " + std::string(t3d_dtype_name(dt)) +
                                     " count=" + std::to_string(count);
          {
            const std::string what = "gather" + suffix;
            Buf in = Bytes(dt, count), out = Bytes(dt, count * n), oracle = Bytes(dt, count * n);
            FillPattern(dt, rank, in.data(), count, 0, 2);
            if (!HostThenCuda(comm, what, nullptr, cuda, rank == root ? oracle.data() : nullptr,
                              rank == root ? out.data() : nullptr,
                              [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                                return t3d_gather(comm, in.data(), dst, count, dt, root, opts, r);
                              }))
              return;
            if (rank == root) {
              EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what);
            }
          }
          {
            const std::string what = "scatter" + suffix;
            Buf in = Bytes(dt, count * n), out = Bytes(dt, count), oracle = Bytes(dt, count);
            if (rank == root) FillPattern(dt, root, in.data(), count * n, 0, 3);
            const void *send = rank == root ? in.data() : nullptr;
            if (!HostThenCuda(comm, what, nullptr, cuda, oracle.data(), out.data(),
                              [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                                return t3d_scatter(comm, send, dst, count, dt, root, opts, r);
                              }))
              return;
            EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what);
          }
        }
      }
    }
  });
}

TEST_P(NcclWorld, AlltoallAndAlltoallv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      const t3d_opts_t cuda = CudaOpts(dt);
      for (size_t count0 : MoveCounts(dt)) {
        STOP_IF_FAILED();
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        const std::string what = "alltoall " + std::string(t3d_dtype_name(dt)) + " count=" + std::to_string(count);
        Buf in = Bytes(dt, count * n), out = Bytes(dt, count * n), oracle = Bytes(dt, count * n);
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, in.data() + p * count * es, count, p * count, 4);
        if (!HostThenCuda(comm, what, nullptr, cuda, oracle.data(), out.data(),
                          [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                            return t3d_alltoall(comm, in.data(), dst, count, dt, opts, r);
                          }))
          return;
        EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what);
      }
      for (size_t base : MoveCounts(dt)) {
        STOP_IF_FAILED();
        if (base == kBig) base = kBig / static_cast<size_t>(n);
        const A2aLayout lay = AlltoallvLayout(n, rank, base);
        const std::vector<size_t> &sc = lay.sc, &sd = lay.sd, &rc = lay.rc, &rd = lay.rd;
        const size_t s_at = lay.s_total, r_at = lay.r_total;
        const std::string what = "alltoallv " + std::string(t3d_dtype_name(dt)) + " base=" + std::to_string(base);
        Buf in = Bytes(dt, s_at), out = Bytes(dt, r_at), oracle = Bytes(dt, r_at);
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, in.data() + sd[p] * es, sc[p], p * 100000, 5);
        if (!HostThenCuda(comm, what, nullptr, cuda, oracle.data(), out.data(),
                          [&](const t3d_opts_t *opts, void *dst, t3d_request_t **r) {
                            return t3d_alltoallv(comm, in.data(), sc.data(), sd.data(), dst, rc.data(), rd.data(), dt,
                                                 opts, r);
                          }))
          return;
        EXPECT_EQ("", ByteDiff(out, oracle)) << Tag(rank, what) << " (gaps keep their bytes)";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(World, NcclWorld, ::testing::Values(1, 2, 3, 4), WorldName);

// ---------- what NCCL is asked to do ----------

// Reductions use the natural NCCL type; bool goes through uint8 MAX/MIN; complex through its real type with twice
// the count; AVG is ncclAvg; data movement is bytes.
TEST_F(NcclTest, DtypeAndOpMapping) {
  struct Row {
    t3d_dtype_t dt;
    t3d_redop_t op;
    int nccl_dt, nccl_op, count_factor;
  };
  const Row rows[] = {
      {T3D_INT8, T3D_SUM, T3D_NCCL_INT8, T3D_NCCL_SUM, 1},
      {T3D_UINT8, T3D_PROD, T3D_NCCL_UINT8, T3D_NCCL_PROD, 1},
      {T3D_INT32, T3D_MIN, T3D_NCCL_INT32, T3D_NCCL_MIN, 1},
      {T3D_INT64, T3D_MAX, T3D_NCCL_INT64, T3D_NCCL_MAX, 1},
      {T3D_FLOAT16, T3D_AVG, T3D_NCCL_FLOAT16, T3D_NCCL_AVG, 1},
      {T3D_BFLOAT16, T3D_SUM, T3D_NCCL_BFLOAT16, T3D_NCCL_SUM, 1},
      {T3D_FLOAT32, T3D_PREMUL_SUM, T3D_NCCL_FLOAT32, T3D_NCCL_NUM_OPS, 1},
      {T3D_FLOAT64, T3D_AVG, T3D_NCCL_FLOAT64, T3D_NCCL_AVG, 1},
      {T3D_INT32, T3D_PREMUL_SUM, T3D_NCCL_INT32, T3D_NCCL_NUM_OPS, 1},
      {T3D_BOOL, T3D_SUM, T3D_NCCL_UINT8, T3D_NCCL_MAX, 1},
      {T3D_BOOL, T3D_MAX, T3D_NCCL_UINT8, T3D_NCCL_MAX, 1},
      {T3D_BOOL, T3D_BOR, T3D_NCCL_UINT8, T3D_NCCL_MAX, 1},
      {T3D_BOOL, T3D_PROD, T3D_NCCL_UINT8, T3D_NCCL_MIN, 1},
      {T3D_BOOL, T3D_MIN, T3D_NCCL_UINT8, T3D_NCCL_MIN, 1},
      {T3D_BOOL, T3D_BAND, T3D_NCCL_UINT8, T3D_NCCL_MIN, 1},
      {T3D_COMPLEX64, T3D_SUM, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, 2},
      {T3D_COMPLEX64, T3D_AVG, T3D_NCCL_FLOAT32, T3D_NCCL_AVG, 2},
      {T3D_COMPLEX128, T3D_PREMUL_SUM, T3D_NCCL_FLOAT64, T3D_NCCL_NUM_OPS, 2},
  };
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const size_t count = 5;
    for (const Row &row : rows) {
      STOP_IF_FAILED();
      const std::string what = "allreduce " + CaseName(row.dt, row.op, count);
      const t3d_opts_t cuda = CudaOpts(row.dt);
      Buf in = Bytes(row.dt, count), out = Bytes(row.dt, count), oracle = Bytes(row.dt, count);
      FillInput(row.dt, row.op, rank, in.data(), count);
      if (!CudaOk(comm, what, [&](t3d_request_t **r) {
            return t3d_allreduce(comm, in.data(), out.data(), count, row.dt, row.op, &cuda, r);
          }))
        return;
      EXPECT_STREQ(f.thread_last_fn(), "ncclAllReduce") << what;
      EXPECT_EQ(f.thread_last_dtype(), row.nccl_dt) << what;
      EXPECT_EQ(f.thread_last_op(), row.nccl_op) << what;
      EXPECT_EQ(f.thread_last_count(), count * row.count_factor) << what;
      ReferenceReduce(row.dt, row.op, 2, oracle.data(), count);
      EXPECT_EQ("", CompareBuffers(row.dt, out.data(), oracle.data(), count, Tolerance(row.dt, row.op))) << what;
    }
    // Data movement: bytes.
    float x[7] = {1, 2, 3, 4, 5, 6, 7};
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    EXPECT_TRUE(CudaOk(comm, "broadcast", [&](t3d_request_t **r) {
      return t3d_broadcast(comm, x, 7, T3D_FLOAT32, 0, &cuda, r);
    }));
    EXPECT_STREQ(f.thread_last_fn(), "ncclBroadcast");
    EXPECT_EQ(f.thread_last_dtype(), T3D_NCCL_INT8);
    EXPECT_EQ(f.thread_last_count(), 28u);
    std::vector<double> all(4);
    const t3d_opts_t cuda64 = CudaOpts(T3D_COMPLEX128);
    EXPECT_TRUE(CudaOk(comm, "allgather", [&](t3d_request_t **r) {
      return t3d_allgather(comm, x, all.data(), 1, T3D_COMPLEX128, &cuda64, r);
    }));
    EXPECT_STREQ(f.thread_last_fn(), "ncclAllGather");
    EXPECT_EQ(f.thread_last_dtype(), T3D_NCCL_INT8);
    EXPECT_EQ(f.thread_last_count(), 16u);
  });
}

// PREMUL_SUM: an operator per call, made from the scalar in the buffer's type and destroyed after the call; an
// integer type needs an integral scalar.
TEST_F(NcclTest, PremulSumScalars) {
  FakeNccl &f = Fake();
  const long created = f.calls("ncclRedOpCreatePreMulSum"), destroyed = f.calls("ncclRedOpDestroy");
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    int32_t xi = rank + 1, yi = 0;
    t3d_opts_t o = CudaOpts(T3D_INT32);
    o.premul_scalar = 3.0;
    EXPECT_TRUE(CudaOk(comm, "premul int32 x3", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &xi, &yi, 1, T3D_INT32, T3D_PREMUL_SUM, &o, r);
    }));
    EXPECT_EQ(yi, 3 * (1 + 2));
    o.premul_scalar = 2.5;
    ExpectCudaUnsupported(comm, "premul int32 x2.5", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &xi, &yi, 1, T3D_INT32, T3D_PREMUL_SUM, &o, r);
    });
    uint16_t h[2] = {FloatToHalf(1.0f + rank), FloatToHalf(-2.0f)}, hy[2] = {0, 0};
    t3d_opts_t oh = CudaOpts(T3D_FLOAT16);
    oh.premul_scalar = 0.25;
    EXPECT_TRUE(CudaOk(comm, "premul half x0.25", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, h, hy, 2, T3D_FLOAT16, T3D_PREMUL_SUM, &oh, r);
    }));
    EXPECT_EQ(HalfToFloat(hy[0]), 0.75f);
    EXPECT_EQ(HalfToFloat(hy[1]), -1.0f);
    float z[2] = {1.0f + rank, 2.0f}, zy[2] = {0, 0};  // complex64: one element
    t3d_opts_t oc = CudaOpts(T3D_COMPLEX64);
    oc.premul_scalar = 0.5;
    EXPECT_TRUE(CudaOk(comm, "premul complex64 x0.5", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, z, zy, 1, T3D_COMPLEX64, T3D_PREMUL_SUM, &oc, r);
    }));
    EXPECT_EQ(zy[0], 1.5f);
    EXPECT_EQ(zy[1], 2.0f);
  });
  // Each rank made one operator per successful call (3) and destroyed each.
  EXPECT_EQ(f.calls("ncclRedOpCreatePreMulSum") - created, 2 * 3);
  EXPECT_EQ(f.calls("ncclRedOpDestroy") - destroyed, 2 * 3);
}

// allgatherv and reduce_scatterv with unequal counts become groups of broadcasts and reduces, one per non-empty
// block; equal counts use ncclAllGather / ncclReduceScatter; v-collectives and gather/scatter never pass an empty
// send or receive to NCCL.
TEST_F(NcclTest, VariableCountsBecomeGroups) {
  const int n = 4;
  FakeNccl &f = Fake();
  Delta bcasts([&] { return f.calls("ncclBroadcast"); }), gathers([&] { return f.calls("ncclAllGather"); });
  Delta reduces([&] { return f.calls("ncclReduce"); }), rscatters([&] { return f.calls("ncclReduceScatter"); });
  Delta zeros([&] { return static_cast<long>(f.zero_count_p2p()); });
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const t3d_opts_t cuda = CudaOpts(T3D_INT32);
    long delta = 0;
    // Counts 3, 0, 5, 0: two non-empty blocks.
    const std::vector<size_t> counts = {3, 0, 5, 0}, displs = {0, 3, 3, 8};
    std::vector<int32_t> in(8, rank + 1), out(8, -1);
    if (!bcasts.Start(rank) || !gathers.Start(rank)) return;
    EXPECT_TRUE(CudaOk(comm, "allgatherv unequal", [&](t3d_request_t **r) {
      return t3d_allgatherv(comm, in.data(), counts[rank], out.data(), counts.data(), displs.data(), T3D_INT32,
                            &cuda, r);
    }));
    EXPECT_EQ(out, std::vector<int32_t>({1, 1, 1, 3, 3, 3, 3, 3}));
    if (!bcasts.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, n * 2) << "one ncclBroadcast per non-empty block on every rank";
    if (!gathers.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 0);
    // Equal counts: one ncclAllGather.
    const std::vector<size_t> eq = {2, 2, 2, 2}, eqd = {0, 2, 4, 6};
    if (!bcasts.Start(rank) || !gathers.Start(rank)) return;
    EXPECT_TRUE(CudaOk(comm, "allgatherv equal", [&](t3d_request_t **r) {
      return t3d_allgatherv(comm, in.data(), 2, out.data(), eq.data(), eqd.data(), T3D_INT32, &cuda, r);
    }));
    EXPECT_EQ(out, std::vector<int32_t>({1, 1, 2, 2, 3, 3, 4, 4}));
    if (!bcasts.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 0);
    if (!gathers.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, n);
    // reduce_scatterv, unequal: one ncclReduce per non-empty block.
    std::vector<int32_t> rin(8), rout(8, -1);
    std::iota(rin.begin(), rin.end(), 10 * rank);
    if (!reduces.Start(rank) || !rscatters.Start(rank)) return;
    EXPECT_TRUE(CudaOk(comm, "reduce_scatterv unequal", [&](t3d_request_t **r) {
      return t3d_reduce_scatterv(comm, rin.data(), rout.data(), counts.data(), T3D_INT32, T3D_SUM, &cuda, r);
    }));
    for (size_t i = 0; i < counts[rank]; ++i) {
      int32_t want = 0;
      for (int q = 0; q < n; ++q) want += static_cast<int32_t>(10 * q + displs[rank] + i);
      EXPECT_EQ(rout[i], want) << "rank " << rank << " element " << i;
    }
    if (counts[rank] == 0) {
      EXPECT_EQ(rout[0], -1);
    }
    if (!reduces.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, n * 2);
    if (!rscatters.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 0);
    // alltoallv and gather with empty blocks: no empty send or receive reaches NCCL.
    if (!zeros.Start(rank)) return;
    std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
    for (int p = 0; p < n; ++p) {
      sc[p] = VCount(1, rank, p);
      rc[p] = VCount(1, p, rank);
    }
    std::exclusive_scan(sc.begin(), sc.end(), sd.begin(), static_cast<size_t>(0));
    std::exclusive_scan(rc.begin(), rc.end(), rd.begin(), static_cast<size_t>(0));
    std::vector<int32_t> a_in(sd.back() + sc.back() + 1, rank), a_out(rd.back() + rc.back() + 1, -1);
    EXPECT_TRUE(CudaOk(comm, "alltoallv with empty blocks", [&](t3d_request_t **r) {
      return t3d_alltoallv(comm, a_in.data(), sc.data(), sd.data(), a_out.data(), rc.data(), rd.data(), T3D_INT32,
                           &cuda, r);
    }));
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < rc[p]; ++i) EXPECT_EQ(a_out[rd[p] + i], p) << "rank " << rank << " from " << p;
    int32_t none = 0;
    EXPECT_TRUE(CudaOk(comm, "gather of nothing", [&](t3d_request_t **r) {
      return t3d_gather(comm, &none, rank == 1 ? &none : nullptr, 0, T3D_INT32, 1, &cuda, r);
    }));
    if (!zeros.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 0) << "empty sends or receives reached NCCL";
  });
}

// ---------- groups ----------

// A t3d group of a ring exchange and an allreduce is held until t3d_group_end, then issued as one NCCL group;
// every CUDA request is complete when t3d_group_end returns. (One rank: the allreduce alone.)
TEST_P(NcclWorld, GroupRingAndAllreduceCompleteOnReturn) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    const bool ring = n >= 2;
    for (int round = 0; round < 3; ++round) {
      STOP_IF_FAILED();
      const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      std::vector<float> to_next(33, static_cast<float>(rank * 100 + round)), from_prev(33, -1.0f);
      std::vector<float> x(9, static_cast<float>(rank + round)), sum(9, -1.0f);
      std::vector<t3d_request_t *> reqs;
      t3d_request_t *q = nullptr;
      const long groups = f.calls("ncclGroupEnd");
      f.thread_expect_stream(nullptr);
      T3D_ASSERT_OK(comm, t3d_group_start(comm));
      if (ring) {
        T3D_EXPECT_OK(comm, t3d_recv(comm, from_prev.data(), 33, T3D_FLOAT32, prev, 0, &cuda, &q));
        reqs.push_back(q);
      }
      T3D_EXPECT_OK(comm, t3d_allreduce(comm, x.data(), sum.data(), 9, T3D_FLOAT32, T3D_SUM, &cuda, &q));
      reqs.push_back(q);
      if (ring) {
        T3D_EXPECT_OK(comm, t3d_send(comm, to_next.data(), 33, T3D_FLOAT32, next, 0, &cuda, &q));
        reqs.push_back(q);
      }
      EXPECT_EQ(f.thread_op_calls(), 0) << Tag(rank, "an operation inside a t3d group reached NCCL before the end");
      EXPECT_EQ(sum[0], -1.0f);
      t3d_request_t *group = nullptr;
      T3D_EXPECT_OK(comm, t3d_group_end(comm, &group));
      for (size_t i = 0; i < reqs.size(); ++i) {
        ASSERT_NE(reqs[i], nullptr);
        EXPECT_EQ(t3d_test(reqs[i]), T3D_OK) << Tag(rank, "grouped request " + std::to_string(i))
                                              << " not complete when t3d_group_end returned: "
                                              << t3d_request_error(reqs[i]);
      }
      ASSERT_NE(group, nullptr);
      // With no host operation in it, the group itself is complete too.
      EXPECT_EQ(t3d_test(group), T3D_OK) << Tag(rank, "group request not complete when t3d_group_end returned");
      for (t3d_request_t *r : reqs) EXPECT_EQ(Finish(r), T3D_OK);
      EXPECT_EQ(Finish(group), T3D_OK) << Tag(rank, "group request");
      if (ring) {
        EXPECT_EQ(from_prev, std::vector<float>(33, static_cast<float>(prev * 100 + round))) << Tag(rank, "ring");
      }
      EXPECT_EQ(sum, std::vector<float>(9, static_cast<float>(n * (n - 1) / 2 + n * round))) << Tag(rank, "sum");
      EXPECT_EQ(f.thread_op_calls(), ring ? 3 : 1) << Tag(rank, "NCCL calls at t3d_group_end");
      EXPECT_GE(f.calls("ncclGroupEnd") - groups, 1) << "the group did not reach NCCL as a group";
    }
  });
}

// An NCCL failure at ncclGroupEnd fails every CUDA request of the group and the group request.
TEST_F(NcclTest, GroupFailureShowsInEveryRequest) {
  RunOptions o = Named();
  o.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const t3d_opts_t cuda = CudaOpts(T3D_INT32);
    int32_t x = rank, y = -1, a = 7, b = -1;
    ASSERT_TRUE(CudaOk(comm, "first allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_INT32, T3D_SUM, &cuda, r);
    }));
    if (!HostBarrier()) return;
    ASSERT_EQ(f.fail_next("ncclGroupEnd", T3D_NCCL_UNHANDLED_CUDA_ERROR), 0);
    std::vector<t3d_request_t *> reqs(3, nullptr);
    T3D_ASSERT_OK(comm, t3d_group_start(comm));
    T3D_EXPECT_OK(comm, t3d_allreduce(comm, &x, &y, 1, T3D_INT32, T3D_SUM, &cuda, &reqs[0]));
    T3D_EXPECT_OK(comm, t3d_send(comm, &a, 1, T3D_INT32, 1 - rank, 0, &cuda, &reqs[1]));
    T3D_EXPECT_OK(comm, t3d_recv(comm, &b, 1, T3D_INT32, 1 - rank, 0, &cuda, &reqs[2]));
    t3d_request_t *group = nullptr;
    const t3d_result_t ge = t3d_group_end(comm, &group);
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (!reqs[i]) continue;
      const t3d_result_t r = t3d_test(reqs[i]);
      EXPECT_LT(r, 0) << Tag(rank, "request " + std::to_string(i)) << " of a failed group: " << t3d_result_string(r);
      EXPECT_NE(std::string(t3d_request_error(reqs[i])), "") << Tag(rank, "request " + std::to_string(i));
      t3d_request_free(reqs[i]);
    }
    if (group) {
      const t3d_result_t r = Finish(group);
      EXPECT_LT(r, 0) << Tag(rank, "group request of a failed group: ") << t3d_result_string(r);
    } else {
      EXPECT_LT(ge, 0) << Tag(rank, "t3d_group_end gave no group request and no error");
    }
    f.fail_next("", 0);
    HostBarrier();
  }, o);
}

// An NCCL failure of a standalone call is returned at once, with a message naming the operation and NCCL's text.
TEST_F(NcclTest, StandaloneNcclFailureIsReturned) {
  RunOptions o = Named();
  o.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    float x = 1, y = 0;
    ASSERT_TRUE(CudaOk(comm, "first allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, r);
    }));
    ASSERT_EQ(f.fail_next("ncclBroadcast", T3D_NCCL_UNHANDLED_CUDA_ERROR), 0);
    std::string err;
    const t3d_result_t r = CudaRun(comm, "failing broadcast", [&](t3d_request_t **q) {
      return t3d_broadcast(comm, &x, 1, T3D_FLOAT32, 0, &cuda, q);
    }, &err);
    EXPECT_LT(r, 0) << t3d_result_string(r);
    EXPECT_TRUE(Contains(err, "broadcast")) << err;
    EXPECT_TRUE(Contains(err, "cuda") || Contains(err, "nccl")) << err;
    HostBarrier();
  }, o);
}

// ---------- NCCL communicators ----------

// A standalone send/recv uses a two-rank NCCL communicator of its pair, made once: rank 2 of 3 takes no part.
TEST_F(NcclTest, StandalonePairUsesTwoRankComm) {
  FakeNccl &f = Fake();
  Delta created([&] { return static_cast<long>(f.comms_created()); });
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    const t3d_opts_t cuda = CudaOpts(T3D_INT64);
    long delta = 0;
    std::vector<int64_t> msg(17), got(17, -1);
    if (!created.Start(rank)) return;
    for (int round = 0; round < 2; ++round) {
      // Round 0: 0 -> 1; round 1: 1 -> 0 over the same pair.
      const int from = round == 0 ? 0 : 1, to = 1 - from;
      std::iota(msg.begin(), msg.end(), 1000 * (round + 1));
      if (rank == from) {
        EXPECT_TRUE(CudaOk(comm, "send", [&](t3d_request_t **r) {
          return t3d_send(comm, msg.data(), 17, T3D_INT64, to, 5, &cuda, r);
        }));
      } else if (rank == to) {
        EXPECT_TRUE(CudaOk(comm, "recv", [&](t3d_request_t **r) {
          return t3d_recv(comm, got.data(), 17, T3D_INT64, from, 5, &cuda, r);
        }));
        EXPECT_EQ(got, msg) << Tag(rank, "round " + std::to_string(round));
      }
      if (!created.Stop(rank, &delta)) return;
      EXPECT_EQ(delta, round == 0 ? 2 : 0) << "round " << round << ": NCCL communicators created";
      if (round == 0 && rank == 2) {
        EXPECT_EQ(f.last_nranks(), 2);
        EXPECT_EQ(f.last_blocking(), 0) << "t3d creates its NCCL communicators nonblocking";
      }
      if (!created.Start(rank)) return;
    }
    // 0 -> 2 is another pair.
    if (rank == 0) {
      EXPECT_TRUE(CudaOk(comm, "send to 2", [&](t3d_request_t **r) {
        return t3d_send(comm, msg.data(), 17, T3D_INT64, 2, 0, &cuda, r);
      }));
    } else if (rank == 2) {
      EXPECT_TRUE(CudaOk(comm, "recv from 0", [&](t3d_request_t **r) {
        return t3d_recv(comm, got.data(), 17, T3D_INT64, 0, 0, &cuda, r);
      }));
      EXPECT_EQ(got, msg);
    }
    if (!created.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 2);
    // The first collective makes the whole group's communicator.
    int64_t one = 1, total = 0;
    if (!created.Start(rank)) return;
    EXPECT_TRUE(CudaOk(comm, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &one, &total, 1, T3D_INT64, T3D_SUM, &cuda, r);
    }));
    EXPECT_EQ(total, 3);
    EXPECT_TRUE(CudaOk(comm, "second allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &one, &total, 1, T3D_INT64, T3D_SUM, &cuda, r);
    }));
    if (!created.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, 3);
  });
}

// Host-only use (CUDA barriers included: they run on the host) makes no NCCL communicator.
TEST_F(NcclTest, HostOnlyMakesNoNcclComm) {
  const int created = Fake().comms_created();
  const long inits = Fake().calls("ncclCommInitRankConfig");
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    float x = static_cast<float>(rank), y = 0;
    EXPECT_TRUE(RunOk(comm, "host allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, nullptr, r);
    }));
    EXPECT_EQ(y, 3.0f);
    int32_t v = rank, w = -1;
    T3D_ASSERT_OK(comm, t3d_group_start(comm));
    t3d_request_t *s = nullptr, *q = nullptr;
    T3D_EXPECT_OK(comm, t3d_send(comm, &v, 1, T3D_INT32, (rank + 1) % 3, 0, nullptr, &s));
    T3D_EXPECT_OK(comm, t3d_recv(comm, &w, 1, T3D_INT32, (rank + 2) % 3, 0, nullptr, &q));
    T3D_EXPECT_OK(comm, t3d_group_end(comm, nullptr));
    EXPECT_EQ(Finish(s), T3D_OK);
    EXPECT_EQ(Finish(q), T3D_OK);
    EXPECT_EQ(w, (rank + 2) % 3);
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(RunOk(comm, "barrier with memtype CUDA", [&](t3d_request_t **r) {
        return t3d_barrier(comm, &cuda, r);
      }));
  });
  EXPECT_EQ(Fake().comms_created(), created);
  EXPECT_EQ(Fake().calls("ncclCommInitRankConfig"), inits);
}

// A split communicator gets its own NCCL communicator at its first CUDA collective; the parent's is separate.
TEST_F(NcclTest, SplitSubCommunicator) {
  const int n = 4;
  FakeNccl &f = Fake();
  Delta created([&] { return static_cast<long>(f.comms_created()); });
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const t3d_opts_t cuda = CudaOpts(T3D_INT32);
    long delta = 0;
    int32_t me = rank, total = -1, pair = -1;
    EXPECT_TRUE(CudaOk(comm, "allreduce on parent", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &me, &total, 1, T3D_INT32, T3D_SUM, &cuda, r);
    }));
    EXPECT_EQ(total, 6);
    t3d_comm_t *sub = nullptr;
    T3D_ASSERT_OK(comm, t3d_comm_split(comm, rank / 2, rank, nullptr, &sub));
    ASSERT_NE(sub, nullptr);
    if (!created.Start(rank)) return;
    EXPECT_TRUE(CudaOk(sub, "allreduce on split", [&](t3d_request_t **r) {
      return t3d_allreduce(sub, &me, &pair, 1, T3D_INT32, T3D_SUM, &cuda, r);
    }));
    EXPECT_EQ(pair, rank / 2 == 0 ? 0 + 1 : 2 + 3);
    if (!created.Stop(rank, &delta)) return;
    EXPECT_EQ(delta, n) << "one two-rank NCCL communicator per split";
    if (rank == 0) {
      EXPECT_EQ(f.last_nranks(), 2);
    }
    // Both still work, in either order.
    EXPECT_TRUE(CudaOk(comm, "allreduce on parent again", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &me, &total, 1, T3D_INT32, T3D_MAX, &cuda, r);
    }));
    EXPECT_EQ(total, 3);
    EXPECT_TRUE(CudaOk(sub, "allreduce on split again", [&](t3d_request_t **r) {
      return t3d_allreduce(sub, &me, &pair, 1, T3D_INT32, T3D_MIN, &cuda, r);
    }));
    EXPECT_EQ(pair, rank / 2 == 0 ? 0 : 2);
    if (!HostBarrier()) return;
    const int live = f.comms_live();
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_destroy(sub), T3D_OK);
    if (!HostBarrier()) return;
    if (rank == 0) {
      EXPECT_EQ(f.comms_live(), live - n) << "destroying the splits destroys their NCCL communicators";
    }
    HostBarrier();
  });
}

// ---------- errors ----------

TEST_F(NcclTest, RejectedCallsNameTheOperation) {
  const int created = Fake().comms_created();
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    // Device 3 throughout: the first CUDA call, even a rejected one, may fix the communicator's device.
    const t3d_opts_t cuda = CudaOpts(T3D_INT32, nullptr, 3);
    int32_t x[4] = {1, 2, 3, 4}, y[4] = {0, 0, 0, 0};
    auto expect = [&](const std::string &what, t3d_result_t want, const std::string &op_word, const IssueFn &issue) {
      std::string err;
      const t3d_result_t r = CudaRun(comm, what, issue, &err);
      EXPECT_EQ(r, want) << Tag(rank, what) << " -> " << t3d_result_string(r) << ": " << err;
      EXPECT_TRUE(Contains(err, op_word)) << Tag(rank, what) << ": the message does not name " << op_word << ": "
                                          << err;
      EXPECT_TRUE(MentionsRank(err, rank)) << Tag(rank, what) << ": the message does not name the rank: " << err;
      EXPECT_TRUE(Contains(err, kGroupName)) << Tag(rank, what) << ": the message does not name the group: " << err;
      EXPECT_EQ(t3d_comm_status(comm), T3D_OK) << Tag(rank, what) << ": a rejected call must not break the comm";
    };
    expect("BAND on int32", T3D_ERR_UNSUPPORTED, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, x, y, 4, T3D_INT32, T3D_BAND, &cuda, r);
    });
    expect("BXOR on int64 reduce", T3D_ERR_UNSUPPORTED, "reduce", [&](t3d_request_t **r) {
      return t3d_reduce(comm, x, y, 2, T3D_INT64, T3D_BXOR, 0, &cuda, r);
    });
    bool b[2] = {true, false}, bo[2];
    expect("BXOR on bool", T3D_ERR_UNSUPPORTED, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, b, bo, 2, T3D_BOOL, T3D_BXOR, &cuda, r);
    });
    expect("recv from any source", T3D_ERR_UNSUPPORTED, "recv", [&](t3d_request_t **r) {
      return t3d_recv(comm, y, 4, T3D_INT32, T3D_ANY_SOURCE, 0, &cuda, r);
    });
    expect("send to self", T3D_ERR_UNSUPPORTED, "send", [&](t3d_request_t **r) {
      return t3d_send(comm, x, 4, T3D_INT32, rank, 0, &cuda, r);
    });
    expect("recv from self", T3D_ERR_UNSUPPORTED, "recv", [&](t3d_request_t **r) {
      return t3d_recv(comm, y, 4, T3D_INT32, rank, 0, &cuda, r);
    });
    if (!HostBarrier()) return;
    EXPECT_EQ(Fake().comms_created(), created) << "calls rejected by argument checks made NCCL communicators";
    if (!HostBarrier()) return;
    // The device of the first CUDA call is the communicator's.
    const t3d_opts_t dev3 = cuda, dev5 = CudaOpts(T3D_INT32, nullptr, 5);
    EXPECT_TRUE(CudaOk(comm, "allreduce on device 3", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, x, y, 4, T3D_INT32, T3D_SUM, &dev3, r);
    }));
    EXPECT_EQ(y[3], 8);
    std::string err;
    const t3d_result_t r = CudaRun(comm, "allreduce on device 5", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, x, y, 4, T3D_INT32, T3D_SUM, &dev5, q);
    }, &err);
    EXPECT_EQ(r, T3D_ERR_INVALID_ARG) << t3d_result_string(r) << ": " << err;
    EXPECT_TRUE(MentionsNumber(err, 3) && MentionsNumber(err, 5)) << "the message must name both devices: " << err;
    EXPECT_TRUE(Contains(err, "device")) << err;
    EXPECT_EQ(t3d_comm_status(comm), T3D_OK);
    // Still usable on its device.
    EXPECT_TRUE(CudaOk(comm, "allreduce on device 3 again", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, x, y, 4, T3D_INT32, T3D_MAX, &dev3, q);
    }));
    EXPECT_EQ(y[0], 1);
  }, [] {
    RunOptions o = Named();
    o.abort_on_failure = false;  // one failed expectation here must not turn the later calls into aborts
    return o;
  }());
}

// ---------- abort, asynchronous errors, destroy ----------

// Abort aborts every NCCL communicator of the t3d communicator (the group's and the pairs'); later CUDA calls fail
// with T3D_ERR_ABORTED, and destroy touches none of them again.
TEST_F(NcclTest, AbortAbortsEveryNcclComm) {
  const int aborts = Fake().aborts();
  RunOptions o;
  o.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    float x = 1, y = 0;
    EXPECT_TRUE(CudaOk(comm, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, r);
    }));
    EXPECT_TRUE(CudaOk(comm, rank == 0 ? "send" : "recv", [&](t3d_request_t **r) {
      return rank == 0 ? t3d_send(comm, &x, 1, T3D_FLOAT32, 1, 0, &cuda, r)
                       : t3d_recv(comm, &y, 1, T3D_FLOAT32, 0, 0, &cuda, r);
    }));
    if (!HostBarrier()) return;
    const int before = f.aborts();
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_abort(comm), T3D_OK);
    if (!HostBarrier()) return;
    EXPECT_EQ(f.aborts() - before, 4) << "two ranks, each with the group's and the pair's NCCL communicator";
    std::string err;
    t3d_result_t r = CudaRun(comm, "allreduce after abort", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, q);
    }, &err);
    EXPECT_EQ(r, T3D_ERR_ABORTED) << t3d_result_string(r) << ": " << err;
    r = CudaRun(comm, "send after abort", [&](t3d_request_t **q) {
      return rank == 0 ? t3d_send(comm, &x, 1, T3D_FLOAT32, 1, 0, &cuda, q)
                       : t3d_recv(comm, &y, 1, T3D_FLOAT32, 0, 0, &cuda, q);
    }, &err);
    EXPECT_EQ(r, T3D_ERR_ABORTED) << t3d_result_string(r) << ": " << err;
    EXPECT_EQ(t3d_comm_status(comm), T3D_ERR_ABORTED);
    HostBarrier();
  }, o);
  EXPECT_EQ(Fake().aborts() - aborts, 4) << "t3d_comm_destroy after an abort must not abort again";
}

// An asynchronous NCCL error breaks the communicator: ncclRemoteError as T3D_ERR_PEER_LOST, others as
// T3D_ERR_TRANSPORT, with a message that mentions NCCL. Destroy then cleans up the broken NCCL communicators.
class NcclAsync : public ::testing::WithParamInterface<std::pair<int, t3d_result_t>>, public NcclTest {};

TEST_P(NcclAsync, AsyncErrorBreaksTheCommunicator) {
  const int injected = GetParam().first;
  const t3d_result_t want = GetParam().second;
  struct Clear {
    ~Clear() { Fake().inject_async_error(0); }
  } clear;
  RunOptions o = Named();
  o.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
    float x = 1, y = 0;
    EXPECT_TRUE(CudaOk(comm, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, r);
    }));
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_status(comm), T3D_OK);
    if (!HostBarrier()) return;
    if (rank == 0) f.inject_async_error(injected);
    if (!HostBarrier()) return;
    const t3d_result_t s = t3d_comm_status(comm);
    EXPECT_EQ(s, want) << t3d_result_string(s);
    const std::string err = t3d_comm_last_error(comm);
    EXPECT_TRUE(Contains(err, "nccl")) << err;
    if (!HostBarrier()) return;
    if (rank == 0) f.inject_async_error(0);
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_status(comm), want) << "a broken communicator stays broken";
    HostBarrier();
  }, o);
}

INSTANTIATE_TEST_SUITE_P(Errors, NcclAsync,
                         ::testing::Values(std::make_pair(static_cast<int>(T3D_NCCL_REMOTE_ERROR), T3D_ERR_PEER_LOST),
                                           std::make_pair(static_cast<int>(T3D_NCCL_SYSTEM_ERROR), T3D_ERR_TRANSPORT),
                                           std::make_pair(static_cast<int>(T3D_NCCL_UNHANDLED_CUDA_ERROR),
                                                          T3D_ERR_TRANSPORT)),
                         [](const ::testing::TestParamInfo<std::pair<int, t3d_result_t>> &i) {
                           return "nccl" + std::to_string(i.param.first);
                         });

// Destroy destroys every NCCL communicator (the fixture checks that the count of live ones is back), also for a
// communicator destroyed right after its first CUDA call.
TEST_F(NcclTest, DestroyReleasesNcclComms) {
  const int live = Fake().comms_live();
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    const t3d_opts_t cuda = CudaOpts(T3D_UINT8);
    uint8_t v = static_cast<uint8_t>(rank), w = 0;
    EXPECT_TRUE(CudaOk(comm, "allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, &v, &w, 1, T3D_UINT8, T3D_MAX, &cuda, r);
    }));
    if (rank < 2) {
      EXPECT_TRUE(CudaOk(comm, "pair", [&](t3d_request_t **r) {
        return rank == 0 ? t3d_send(comm, &v, 1, T3D_UINT8, 1, 0, &cuda, r)
                         : t3d_recv(comm, &w, 1, T3D_UINT8, 0, 0, &cuda, r);
      }));
    }
    if (!HostBarrier()) return;
    if (rank == 0) {
      EXPECT_EQ(Fake().comms_live() - live, 3 + 2);
    }
    HostBarrier();
  });
  EXPECT_EQ(Fake().comms_live(), live);
}

// ---------- streams ----------

// opts.stream reaches every NCCL call unchanged: standalone, inside a t3d group and inside the NCCL groups that
// t3d makes itself.
TEST_F(NcclTest, StreamPassesThrough) {
  const int n = 3;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    FakeNccl &f = Fake();
    void *stream = reinterpret_cast<void *>(static_cast<uintptr_t>(0x5000 + 0x100 * rank));
    const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32, stream);
    auto check = [&](const std::string &what, const IssueFn &issue) {
      f.thread_expect_stream(stream);
      EXPECT_TRUE(CudaOk(comm, what, issue));
      EXPECT_GT(f.thread_op_calls(), 0) << Tag(rank, what) << ": no NCCL call on the calling thread";
      EXPECT_EQ(f.thread_stream_misses(), 0) << Tag(rank, what) << ": an NCCL call got another stream";
      EXPECT_EQ(f.thread_last_stream(), stream) << Tag(rank, what);
    };
    std::vector<float> x(12, 1.0f), y(12 * n, 0.0f);
    check("allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, x.data(), y.data(), 12, T3D_FLOAT32, T3D_SUM, &cuda, r);
    });
    check("broadcast", [&](t3d_request_t **r) { return t3d_broadcast(comm, x.data(), 12, T3D_FLOAT32, 1, &cuda, r); });
    check("reduce", [&](t3d_request_t **r) {
      return t3d_reduce(comm, x.data(), y.data(), 12, T3D_FLOAT32, T3D_AVG, 2, &cuda, r);
    });
    check("premul reduce_scatter", [&](t3d_request_t **r) {
      return t3d_reduce_scatter(comm, y.data(), x.data(), 12, T3D_FLOAT32, T3D_PREMUL_SUM, &cuda, r);
    });
    check("allgather", [&](t3d_request_t **r) {
      return t3d_allgather(comm, x.data(), y.data(), 12, T3D_FLOAT32, &cuda, r);
    });
    check("gather", [&](t3d_request_t **r) {
      return t3d_gather(comm, x.data(), rank == 0 ? y.data() : nullptr, 12, T3D_FLOAT32, 0, &cuda, r);
    });
    check("alltoall", [&](t3d_request_t **r) {
      return t3d_alltoall(comm, x.data(), y.data(), 4, T3D_FLOAT32, &cuda, r);
    });
    if (rank < 2) {
      check("pair", [&](t3d_request_t **r) {
        return rank == 0 ? t3d_send(comm, x.data(), 12, T3D_FLOAT32, 1, 0, &cuda, r)
                         : t3d_recv(comm, x.data(), 12, T3D_FLOAT32, 0, 0, &cuda, r);
      });
    }
    // A t3d group.
    f.thread_expect_stream(stream);
    std::vector<t3d_request_t *> reqs(3, nullptr);
    std::vector<float> from(12, 0.0f);
    T3D_ASSERT_OK(comm, t3d_group_start(comm));
    T3D_EXPECT_OK(comm, t3d_send(comm, x.data(), 12, T3D_FLOAT32, (rank + 1) % n, 0, &cuda, &reqs[0]));
    T3D_EXPECT_OK(comm, t3d_recv(comm, from.data(), 12, T3D_FLOAT32, (rank + n - 1) % n, 0, &cuda, &reqs[1]));
    T3D_EXPECT_OK(comm, t3d_allreduce(comm, x.data(), y.data(), 12, T3D_FLOAT32, T3D_MAX, &cuda, &reqs[2]));
    T3D_EXPECT_OK(comm, t3d_group_end(comm, nullptr));
    for (t3d_request_t *q : reqs) EXPECT_EQ(Finish(q), T3D_OK);
    EXPECT_EQ(f.thread_op_calls(), 3) << Tag(rank, "group: NCCL calls on the thread that ended the group");
    EXPECT_EQ(f.thread_stream_misses(), 0) << Tag(rank, "group");
    // All ranks on one stream value: the process-wide last stream is it.
    if (!HostBarrier()) return;
    void *shared = reinterpret_cast<void *>(static_cast<uintptr_t>(0xbeef00));
    const t3d_opts_t same = CudaOpts(T3D_FLOAT32, shared);
    EXPECT_TRUE(CudaOk(comm, "allreduce on a shared stream", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, x.data(), y.data(), 12, T3D_FLOAT32, T3D_SUM, &same, r);
    }));
    if (!HostBarrier()) return;
    EXPECT_EQ(f.last_stream(), shared);
    HostBarrier();
  });
}

// ---------- timeouts ----------

// Only rank 1 makes the first CUDA collective: it waits in the store for rank 0's unique id and times out.
TEST_F(NcclTest, FirstCollectiveTimesOutWaitingForTheUniqueId) {
  RunOptions o = Named();
  o.comm_timeout_ms = 300;
  o.abort_on_failure = false;
  o.deadline_ms = 20000;
  const int created = Fake().comms_created();
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    if (rank == 1) {
      const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
      float x = 1, y = 0;
      std::string err;
      const auto t0 = Clock::now();
      const t3d_result_t r = CudaRun(comm, "lonely allreduce", [&](t3d_request_t **q) {
        return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, q);
      }, &err);
      const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
      EXPECT_EQ(r, T3D_ERR_TIMEOUT) << t3d_result_string(r) << ": " << err;
      EXPECT_TRUE(Contains(err, "time") || Contains(err, "key") || Contains(err, "store")) << err;
      EXPECT_GE(took, 250) << "gave up before the timeout";
      EXPECT_LT(took, 5000) << "a 300 ms timeout took " << took << " ms";
    }
    HostBarrier();
  }, o);
  EXPECT_EQ(Fake().comms_created(), created);
}

// Only rank 0 makes the first CUDA collective: it publishes the unique id and starts a nonblocking NCCL
// initialization that rank 1 never joins; polling it must give up at the timeout, and the half-made NCCL
// communicator must be released.
TEST_F(NcclTest, FirstCollectiveTimesOutWhileNcclInitPolls) {
  RunOptions o = Named();
  o.comm_timeout_ms = 300;
  o.abort_on_failure = false;
  o.deadline_ms = 20000;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    if (rank == 0) {
      const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
      float x = 1, y = 0;
      std::string err;
      const auto t0 = Clock::now();
      const t3d_result_t r = CudaRun(comm, "lonely allreduce", [&](t3d_request_t **q) {
        return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, q);
      }, &err);
      const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
      EXPECT_EQ(r, T3D_ERR_TIMEOUT) << t3d_result_string(r) << ": " << err;
      EXPECT_LT(took, 5000) << "a 300 ms timeout took " << took << " ms";
    }
    HostBarrier();
  }, o);
}

// t3d_comm_abort works from any thread at any time: also while the first CUDA collective waits, polling NCCL's
// nonblocking initialization, for a peer that does not come. The call ends with T3D_ERR_ABORTED soon after.
TEST_F(NcclTest, AbortInterruptsNcclInitWait) {
  RunOptions o = Named();
  o.comm_timeout_ms = 20000;
  o.abort_on_failure = false;
  o.deadline_ms = 40000;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    if (rank == 0) {
      const t3d_opts_t cuda = CudaOpts(T3D_FLOAT32);
      float x = 1, y = 0;
      std::atomic<int64_t> abort_ms{-1};
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        const auto t0 = Clock::now();
        EXPECT_EQ(t3d_comm_abort(comm), T3D_OK);
        abort_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
      });
      std::string err;
      const auto t0 = Clock::now();
      const t3d_result_t r = CudaRun(comm, "lonely allreduce", [&](t3d_request_t **q) {
        return t3d_allreduce(comm, &x, &y, 1, T3D_FLOAT32, T3D_SUM, &cuda, q);
      }, &err);
      const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
      aborter.join();
      EXPECT_EQ(r, T3D_ERR_ABORTED) << t3d_result_string(r) << ": " << err;
      EXPECT_LT(took, 3000) << "the call ended " << took << " ms after it started; the abort came after 300 ms";
      EXPECT_LT(abort_ms.load(), 1000) << "t3d_comm_abort took " << abort_ms.load() << " ms";
    }
    HostBarrier();
  }, o);
}

}  // namespace
