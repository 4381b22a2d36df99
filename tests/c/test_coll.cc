// test_coll.cc: every collective over dtype x op x count x world size (ranks as threads), checked against a serial
// reference; one communicator per world size and collective family carries all of its cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

const size_t kSmallCounts[] = {0, 1, 7};
const size_t kBig = (static_cast<size_t>(1) << 18) + 3;  // 1 MiB+ of float32
const unsigned char kFill = 0xA5;

#define STOP_IF_FAILED()                          \
  do {                                            \
    if (::testing::Test::HasFailure()) return;    \
  } while (0)

using Buf = std::vector<unsigned char>;

// At least one byte, so that a zero count still passes a valid pointer.
Buf Bytes(t3d_dtype_t dt, size_t n) { return Buf(std::max<size_t>(1, n * t3d_dtype_size(dt)), kFill); }

t3d_opts_t Opts(t3d_dtype_t dt) {
  t3d_opts_t o{};
  o.timeout_ms = 0;
  o.premul_scalar = PremulScalar(dt);
  return o;
}

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

// The first byte where got and expect differ, as an element index, or "" when equal.
std::string ByteDiff(t3d_dtype_t dt, const Buf &got, const Buf &expect) {
  if (got.size() != expect.size()) return "size differs";
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] != expect[b]) {
      const size_t es = t3d_dtype_size(dt);
      return "first difference at element " + std::to_string(b / es) + " (byte " + std::to_string(b) +
             "): got byte " + std::to_string(got[b]) + ", expected " + std::to_string(expect[b]);
    }
  }
  return "";
}

void ExpectUnsupported(t3d_comm_t *comm, const std::string &what, const IssueFn &issue) {
  std::string err;
  t3d_result_t r = RunResult(issue, &err);
  EXPECT_EQ(r, T3D_ERR_UNSUPPORTED) << Tag(t3d_comm_rank(comm), what) << " -> " << t3d_result_string(r) << " ("
                                    << err << ")";
  EXPECT_EQ(t3d_comm_status(comm), T3D_OK) << Tag(t3d_comm_rank(comm), what)
                                           << ": an unsupported call must not break the communicator";
}

bool Supported(t3d_redop_t op, t3d_dtype_t dt) { return t3d_redop_supported(op, dt) == T3D_OK; }

// The subset that also runs at kBig elements.
bool BigCase(t3d_dtype_t dt, t3d_redop_t op) {
  return (dt == T3D_FLOAT32 || dt == T3D_BFLOAT16 || dt == T3D_INT64) && (op == T3D_SUM || op == T3D_AVG);
}

std::vector<size_t> CountsFor(t3d_dtype_t dt, t3d_redop_t op) {
  std::vector<size_t> c(std::begin(kSmallCounts), std::end(kSmallCounts));
  if (BigCase(dt, op)) c.push_back(kBig);
  return c;
}

// Cross-rank check that every rank's bytes equal rank 0's (allreduce results must be bitwise identical).
void ExpectSameOnAllRanks(int rank, const std::string &what, const Buf &mine) {
  std::vector<Buf> &slots = HostSlots();
  slots[rank] = mine;
  if (!HostBarrier()) return;
  if (rank != 0) {
    EXPECT_TRUE(slots[rank] == slots[0]) << Tag(rank, what) << ": result differs bitwise from rank 0's";
  }
  HostBarrier();
}

class Coll : public ::testing::TestWithParam<int> {};

std::string WorldName(const ::testing::TestParamInfo<int> &info) { return "n" + std::to_string(info.param); }

// ---------- non-distributed facts ----------

TEST(CollFacts, RedopSupportedTable) {
  for (size_t d = 0; d < kNumDtypes; ++d) {
    t3d_dtype_t dt = kAllDtypes[d];
    EXPECT_EQ(t3d_redop_supported(T3D_SUM, dt), T3D_OK) << t3d_dtype_name(dt);
    for (t3d_redop_t op : {T3D_BAND, T3D_BOR, T3D_BXOR}) {
      t3d_result_t want = (IsInteger(dt) || dt == T3D_BOOL) ? T3D_OK : T3D_ERR_UNSUPPORTED;
      EXPECT_EQ(t3d_redop_supported(op, dt), want) << t3d_dtype_name(dt) << " " << t3d_redop_name(op);
    }
    if (IsComplex(dt)) {
      for (t3d_redop_t op : {T3D_PROD, T3D_MIN, T3D_MAX})
        EXPECT_EQ(t3d_redop_supported(op, dt), T3D_ERR_UNSUPPORTED) << t3d_dtype_name(dt) << " " << t3d_redop_name(op);
      EXPECT_EQ(t3d_redop_supported(T3D_AVG, dt), T3D_OK);
      EXPECT_EQ(t3d_redop_supported(T3D_PREMUL_SUM, dt), T3D_OK);
    } else if (dt != T3D_BOOL) {
      for (t3d_redop_t op : {T3D_PROD, T3D_MIN, T3D_MAX, T3D_AVG, T3D_PREMUL_SUM})
        EXPECT_EQ(t3d_redop_supported(op, dt), T3D_OK) << t3d_dtype_name(dt) << " " << t3d_redop_name(op);
    }
  }
  EXPECT_EQ(t3d_redop_supported(T3D_SUM, T3D_DTYPE_COUNT), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(T3D_REDOP_COUNT, T3D_FLOAT32), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_redop_supported(static_cast<t3d_redop_t>(-1), T3D_FLOAT32), T3D_ERR_INVALID_ARG);
}

TEST(CollFacts, DtypeSizesAndNames) {
  const size_t sizes[] = {1, 1, 4, 8, 2, 2, 4, 8, 1, 8, 16};
  for (size_t d = 0; d < kNumDtypes; ++d) {
    EXPECT_EQ(t3d_dtype_size(kAllDtypes[d]), sizes[d]) << d;
    ASSERT_NE(t3d_dtype_name(kAllDtypes[d]), nullptr);
    EXPECT_STRNE(t3d_dtype_name(kAllDtypes[d]), "");
  }
  EXPECT_EQ(t3d_dtype_size(T3D_DTYPE_COUNT), 0u);
  for (size_t o = 0; o < kNumOps; ++o) ASSERT_NE(t3d_redop_name(kAllOps[o]), nullptr);
  EXPECT_STREQ(t3d_result_string(T3D_OK), "T3D_OK");
  EXPECT_STREQ(t3d_result_string(T3D_ERR_TIMEOUT), "T3D_ERR_TIMEOUT");
  EXPECT_NE(t3d_result_string(static_cast<t3d_result_t>(-12345)), nullptr);
  ASSERT_NE(t3d_version_string(), nullptr);
  EXPECT_NE(std::string(t3d_version_string()).find("0.1.0"), std::string::npos) << t3d_version_string();
}

// ---------- reductions ----------

TEST_P(Coll, Allreduce) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t opts = Opts(dt);
        for (size_t count : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          const std::string what = "allreduce " + CaseName(dt, op, count);
          Buf in = Bytes(dt, count), out = Bytes(dt, count);
          FillInput(dt, op, rank, in.data(), count);
          if (!Supported(op, dt)) {
            ExpectUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out.data(), count, dt, op, &opts, r);
            });
            continue;
          }
          const Buf in_copy = in;
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_allreduce(comm, in.data(), out.data(), count, dt, op, &opts, r);
              }))
            return;
          Buf expect = Bytes(dt, count);
          ReferenceReduce(dt, op, n, expect.data(), count);
          EXPECT_EQ("", CompareBuffers(dt, out.data(), expect.data(), count, Tolerance(dt, op))) << Tag(rank, what);
          EXPECT_TRUE(in == in_copy) << Tag(rank, what) << ": the send buffer changed";
          ExpectSameOnAllRanks(rank, what, out);

          const std::string what_ip = what + " (in place)";
          Buf io = in_copy;
          if (!RunOk(comm, what_ip, [&](t3d_request_t **r) {
                return t3d_allreduce(comm, io.data(), io.data(), count, dt, op, &opts, r);
              }))
            return;
          EXPECT_EQ("", CompareBuffers(dt, io.data(), expect.data(), count, Tolerance(dt, op))) << Tag(rank, what_ip);
          ExpectSameOnAllRanks(rank, what_ip, io);
        }
      }
    }
  });
}

TEST_P(Coll, Reduce) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    size_t k = 0;
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t opts = Opts(dt);
        // Every root for a few pairs, a rotating root for the rest.
        const bool all_roots = op == T3D_SUM && (dt == T3D_FLOAT32 || dt == T3D_INT32 || dt == T3D_BFLOAT16 ||
                                                 dt == T3D_COMPLEX64);
        for (size_t count : CountsFor(dt, op)) {
          std::vector<int> roots;
          if (all_roots && count != kBig) {
            for (int r = 0; r < n; ++r) roots.push_back(r);
          } else {
            roots.push_back(static_cast<int>(k++ % static_cast<size_t>(n)));
          }
          for (int root : roots) {
            STOP_IF_FAILED();
            const std::string what = "reduce root " + std::to_string(root) + " " + CaseName(dt, op, count);
            Buf in = Bytes(dt, count), out = Bytes(dt, count);
            FillInput(dt, op, rank, in.data(), count);
            // Non-roots pass NULL: the header allows it.
            void *recv = rank == root ? out.data() : nullptr;
            if (!Supported(op, dt)) {
              ExpectUnsupported(comm, what, [&](t3d_request_t **r) {
                return t3d_reduce(comm, in.data(), recv, count, dt, op, root, &opts, r);
              });
              continue;
            }
            if (!RunOk(comm, what, [&](t3d_request_t **r) {
                  return t3d_reduce(comm, in.data(), recv, count, dt, op, root, &opts, r);
                }))
              return;
            if (rank == root) {
              Buf expect = Bytes(dt, count);
              ReferenceReduce(dt, op, n, expect.data(), count);
              EXPECT_EQ("", CompareBuffers(dt, out.data(), expect.data(), count, Tolerance(dt, op)))
                  << Tag(rank, what);
            }
          }
        }
      }
    }
    // In place at the root.
    const t3d_dtype_t dt = T3D_FLOAT32;
    const size_t count = 7;
    for (int root = 0; root < n; ++root) {
      STOP_IF_FAILED();
      const std::string what = "reduce in place at root " + std::to_string(root);
      Buf io = Bytes(dt, count);
      FillInput(dt, T3D_SUM, rank, io.data(), count);
      if (!RunOk(comm, what, [&](t3d_request_t **r) {
            return t3d_reduce(comm, io.data(), rank == root ? io.data() : nullptr, count, dt, T3D_SUM, root, nullptr,
                              r);
          }))
        return;
      if (rank == root) {
        Buf expect = Bytes(dt, count);
        ReferenceReduce(dt, T3D_SUM, n, expect.data(), count);
        EXPECT_EQ("", CompareBuffers(dt, io.data(), expect.data(), count, 0.0)) << Tag(rank, what);
      }
    }
  });
}

TEST_P(Coll, ReduceScatter) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t opts = Opts(dt);
        for (size_t count0 : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
          const std::string what = "reduce_scatter " + CaseName(dt, op, count);
          const size_t total = count * static_cast<size_t>(n);
          Buf in = Bytes(dt, total), out = Bytes(dt, count);
          FillInput(dt, op, rank, in.data(), total);
          if (!Supported(op, dt)) {
            ExpectUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_reduce_scatter(comm, in.data(), out.data(), count, dt, op, &opts, r);
            });
            continue;
          }
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_reduce_scatter(comm, in.data(), out.data(), count, dt, op, &opts, r);
              }))
            return;
          Buf expect = Bytes(dt, count);
          ReferenceReduce(dt, op, n, expect.data(), count, static_cast<size_t>(rank) * count);
          EXPECT_EQ("", CompareBuffers(dt, out.data(), expect.data(), count, Tolerance(dt, op))) << Tag(rank, what);
        }
      }
    }
  });
}

TEST_P(Coll, ReduceScatterv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      for (size_t o = 0; o < kNumOps; ++o) {
        const t3d_dtype_t dt = kAllDtypes[d];
        const t3d_redop_t op = kAllOps[o];
        const t3d_opts_t opts = Opts(dt);
        for (size_t base : CountsFor(dt, op)) {
          STOP_IF_FAILED();
          if (base == kBig) base = kBig / static_cast<size_t>(n);
          // Uneven, every third rank gets nothing.
          std::vector<size_t> counts(static_cast<size_t>(n)), offs(static_cast<size_t>(n));
          for (int r = 0; r < n; ++r) counts[r] = (r % 3 == 1) ? 0 : base + static_cast<size_t>(r);
          std::exclusive_scan(counts.begin(), counts.end(), offs.begin(), static_cast<size_t>(0));
          const size_t total = offs.back() + counts.back();
          const size_t mine = counts[rank];
          const std::string what = "reduce_scatterv " + CaseName(dt, op, base) + " (mine " + std::to_string(mine) + ")";
          Buf in = Bytes(dt, total), out = Bytes(dt, mine);
          FillInput(dt, op, rank, in.data(), total);
          if (!Supported(op, dt)) {
            ExpectUnsupported(comm, what, [&](t3d_request_t **r) {
              return t3d_reduce_scatterv(comm, in.data(), out.data(), counts.data(), dt, op, &opts, r);
            });
            continue;
          }
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_reduce_scatterv(comm, in.data(), out.data(), counts.data(), dt, op, &opts, r);
              }))
            return;
          Buf expect = Bytes(dt, mine);
          ReferenceReduce(dt, op, n, expect.data(), mine, offs[rank]);
          EXPECT_EQ("", CompareBuffers(dt, out.data(), expect.data(), mine, Tolerance(dt, op))) << Tag(rank, what);
          if (mine == 0) {
            EXPECT_EQ(out[0], kFill) << Tag(rank, what) << ": wrote into an empty receive";
          }
        }
      }
    }
  });
}

// ---------- data movement ----------

std::vector<size_t> MoveCounts(t3d_dtype_t dt) {
  std::vector<size_t> c(std::begin(kSmallCounts), std::end(kSmallCounts));
  if (dt == T3D_FLOAT32 || dt == T3D_BFLOAT16) c.push_back(kBig);
  return c;
}

TEST_P(Coll, Allgather) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      for (size_t count0 : MoveCounts(dt)) {
        STOP_IF_FAILED();
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        const std::string what = "allgather " + std::string(t3d_dtype_name(dt)) + " count=" + std::to_string(count);
        Buf in = Bytes(dt, count), out = Bytes(dt, count * n), expect = Bytes(dt, count * n);
        FillPattern(dt, rank, in.data(), count);
        for (int r = 0; r < n; ++r) FillPattern(dt, r, expect.data() + r * count * es, count);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_allgather(comm, in.data(), out.data(), count, dt, nullptr, r);
            }))
          return;
        EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what);
      }
    }
  });
}

TEST_P(Coll, Allgatherv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      for (size_t base : MoveCounts(dt)) {
        STOP_IF_FAILED();
        if (base == kBig) base = kBig / static_cast<size_t>(n);
        std::vector<size_t> counts, displs;
        const size_t total = AllgathervLayout(n, base, &counts, &displs);
        const std::string what =
            "allgatherv " + std::string(t3d_dtype_name(dt)) + " base=" + std::to_string(base);
        Buf in = Bytes(dt, counts[rank]), out = Bytes(dt, total), expect = Bytes(dt, total);
        FillPattern(dt, rank, in.data(), counts[rank]);
        for (int r = 0; r < n; ++r) FillPattern(dt, r, expect.data() + displs[r] * es, counts[r]);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_allgatherv(comm, in.data(), counts[rank], out.data(), counts.data(), displs.data(), dt,
                                    nullptr, r);
            }))
          return;
        EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what) << " (gaps must keep their old bytes)";
      }
    }
  });
}

TEST_P(Coll, Broadcast) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      for (size_t count : MoveCounts(dt)) {
        for (int root = 0; root < n; ++root) {
          if (count == kBig && root != 0 && root != n - 1) continue;
          STOP_IF_FAILED();
          const std::string what = "broadcast root " + std::to_string(root) + " " + std::string(t3d_dtype_name(dt)) +
                                   " count=" + std::to_string(count);
          Buf buf = Bytes(dt, count), expect = Bytes(dt, count);
          FillPattern(dt, root, expect.data(), count, 0, 1);
          if (rank == root) buf = expect;
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_broadcast(comm, buf.data(), count, dt, root, nullptr, r);
              }))
            return;
          EXPECT_EQ("", ByteDiff(dt, buf, expect)) << Tag(rank, what);
        }
      }
    }
  });
}

// Broadcasts large enough for several rounds of the UCX tree's pipeline (8 chunks of 256 KiB each) with a short
// last chunk, and, on shared memory, past the single-copy range's end; every byte checked on every rank.
TEST_P(Coll, LargeBroadcasts) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t bytes : {(size_t{5} << 20) + 13, (size_t{9} << 20) + 1}) {
      for (int root : {0, n - 1, n / 2}) {
        STOP_IF_FAILED();
        const std::string what = "broadcast of " + std::to_string(bytes) + " B from " + std::to_string(root);
        std::vector<uint8_t> buf(bytes, 0), expect(bytes);
        for (size_t i = 0; i < bytes; ++i) expect[i] = static_cast<uint8_t>(i * 31 + i / 4093 + root);
        if (rank == root) buf = expect;
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_broadcast(comm, buf.data(), bytes, T3D_UINT8, root, nullptr, r);
            }))
          return;
        EXPECT_TRUE(buf == expect) << Tag(rank, what);
      }
    }
  });
}

TEST_P(Coll, GatherScatter) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      for (size_t count0 : MoveCounts(dt)) {
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        for (int root = 0; root < n; ++root) {
          if (count0 == kBig && root != n - 1) continue;
          STOP_IF_FAILED();
          const std::string suffix = " root " + std::to_string(root) + " " + std::string(t3d_dtype_name(dt)) +
                                     " count=" + std::to_string(count);
          // gather: non-roots pass NULL as recvbuf.
          {
            const std::string what = "gather" + suffix;
            Buf in = Bytes(dt, count), out = Bytes(dt, count * n), expect = Bytes(dt, count * n);
            FillPattern(dt, rank, in.data(), count, 0, 2);
            for (int r = 0; r < n; ++r) FillPattern(dt, r, expect.data() + r * count * es, count, 0, 2);
            if (!RunOk(comm, what, [&](t3d_request_t **r) {
                  return t3d_gather(comm, in.data(), rank == root ? out.data() : nullptr, count, dt, root, nullptr, r);
                }))
              return;
            if (rank == root) {
              EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what);
            }
          }
          // scatter: non-roots pass NULL as sendbuf.
          {
            const std::string what = "scatter" + suffix;
            Buf in = Bytes(dt, count * n), out = Bytes(dt, count), expect = Bytes(dt, count);
            if (rank == root) FillPattern(dt, root, in.data(), count * n, 0, 3);
            FillPattern(dt, root, expect.data(), count, static_cast<size_t>(rank) * count, 3);
            if (!RunOk(comm, what, [&](t3d_request_t **r) {
                  return t3d_scatter(comm, rank == root ? in.data() : nullptr, out.data(), count, dt, root, nullptr, r);
                }))
              return;
            EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what);
          }
        }
      }
    }
  });
}

TEST_P(Coll, Alltoall) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      for (size_t count0 : MoveCounts(dt)) {
        STOP_IF_FAILED();
        const size_t count = count0 == kBig ? kBig / static_cast<size_t>(n) + 1 : count0;
        const std::string what = "alltoall " + std::string(t3d_dtype_name(dt)) + " count=" + std::to_string(count);
        Buf in = Bytes(dt, count * n), out = Bytes(dt, count * n), expect = Bytes(dt, count * n);
        // Block p of rank q's input: pattern of q at logical offset p * count.
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, in.data() + p * count * es, count, p * count, 4);
        for (int q = 0; q < n; ++q) FillPattern(dt, q, expect.data() + q * count * es, count, rank * count, 4);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_alltoall(comm, in.data(), out.data(), count, dt, nullptr, r);
            }))
          return;
        EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what);
      }
    }
  });
}

TEST_P(Coll, Alltoallv) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t d = 0; d < kNumDtypes; ++d) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const size_t es = t3d_dtype_size(dt);
      for (size_t base : MoveCounts(dt)) {
        STOP_IF_FAILED();
        if (base == kBig) base = kBig / static_cast<size_t>(n);
        const A2aLayout lay = AlltoallvLayout(n, rank, base);
        const std::vector<size_t> &sc = lay.sc, &sd = lay.sd, &rc = lay.rc, &rd = lay.rd;
        const size_t s_at = lay.s_total, r_at = lay.r_total;
        const std::string what = "alltoallv " + std::string(t3d_dtype_name(dt)) + " base=" + std::to_string(base);
        Buf in = Bytes(dt, s_at), out = Bytes(dt, r_at), expect = Bytes(dt, r_at);
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, in.data() + sd[p] * es, sc[p], p * 100000, 5);
        for (int p = 0; p < n; ++p) FillPattern(dt, p, expect.data() + rd[p] * es, rc[p], rank * 100000, 5);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_alltoallv(comm, in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(), dt,
                                   nullptr, r);
            }))
          return;
        EXPECT_EQ("", ByteDiff(dt, out, expect)) << Tag(rank, what) << " (gaps must keep their old bytes)";
      }
    }
  });
}

TEST_P(Coll, Barrier) {
  const int n = GetParam();
  std::atomic<int> arrived{0};
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (int it = 0; it < 30; ++it) {
      STOP_IF_FAILED();
      arrived.fetch_add(1);
      const std::string what = "barrier " + std::to_string(it);
      if (!RunOk(comm, what, [&](t3d_request_t **r) { return t3d_barrier(comm, nullptr, r); })) return;
      // Everyone has arrived at barrier `it`; nobody can be past barrier it + 1.
      const int seen = arrived.load();
      EXPECT_GE(seen, n * (it + 1)) << Tag(rank, what) << ": left the barrier before every rank arrived";
      EXPECT_LE(seen, n * (it + 2)) << Tag(rank, what);
    }
  });
}

// Many collectives in flight at once, finished in reverse order; t3d_test polls one of them.
TEST_P(Coll, Pipelined) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const int k = 12;
    std::vector<Buf> ins(k), outs(k), bcast(k);
    std::vector<t3d_request_t *> reqs;
    std::vector<std::string> names;
    const t3d_dtype_t dts[] = {T3D_FLOAT32, T3D_INT32, T3D_BFLOAT16, T3D_FLOAT64};
    for (int i = 0; i < k; ++i) {
      const t3d_dtype_t dt = dts[i % 4];
      const size_t count = static_cast<size_t>(1 + 997 * i);
      ins[i] = Bytes(dt, count);
      outs[i] = Bytes(dt, count);
      FillInput(dt, T3D_SUM, rank, ins[i].data(), count);
      t3d_request_t *req = nullptr;
      t3d_result_t r = t3d_allreduce(comm, ins[i].data(), outs[i].data(), count, dt, T3D_SUM, nullptr, &req);
      ASSERT_EQ(r, T3D_OK) << Tag(rank, "pipelined allreduce " + std::to_string(i)) << ": "
                           << t3d_comm_last_error(comm);
      reqs.push_back(req);
      names.push_back("allreduce " + std::to_string(i));
      bcast[i] = Bytes(T3D_UINT8, 33);
      if (rank == i % n) FillPattern(T3D_UINT8, i, bcast[i].data(), 33);
      req = nullptr;
      r = t3d_broadcast(comm, bcast[i].data(), 33, T3D_UINT8, i % n, nullptr, &req);
      ASSERT_EQ(r, T3D_OK) << Tag(rank, "pipelined broadcast " + std::to_string(i)) << ": "
                           << t3d_comm_last_error(comm);
      reqs.push_back(req);
      names.push_back("broadcast " + std::to_string(i));
    }
    t3d_result_t polled = t3d_test(reqs[0]);
    EXPECT_TRUE(polled == T3D_OK || polled == T3D_IN_PROGRESS) << t3d_result_string(polled);
    for (size_t j = reqs.size(); j-- > 0;) {
      std::string err;
      t3d_result_t r = Finish(reqs[j], &err);
      EXPECT_EQ(r, T3D_OK) << Tag(rank, names[j]) << ": " << err;
    }
    for (int i = 0; i < k; ++i) {
      const t3d_dtype_t dt = dts[i % 4];
      const size_t count = static_cast<size_t>(1 + 997 * i);
      Buf expect = Bytes(dt, count);
      ReferenceReduce(dt, T3D_SUM, n, expect.data(), count);
      EXPECT_EQ("", CompareBuffers(dt, outs[i].data(), expect.data(), count, 0.0)) << Tag(rank, names[2 * i]);
      Buf bexp = Bytes(T3D_UINT8, 33);
      FillPattern(T3D_UINT8, i, bexp.data(), 33);
      EXPECT_EQ("", ByteDiff(T3D_UINT8, bcast[i], bexp)) << Tag(rank, names[2 * i + 1]);
    }
  });
}

// Vector forms issued back to back without waiting: a call that cannot finish at once is kept past its return, with
// the counts and displacements it was given (small groups pass them in the calling frame, which the next call
// reuses), so each must still run with its own layout.
TEST_P(Coll, PipelinedVectorForms) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const int k = 6;
    std::vector<Buf> ins(k), outs(k), expects(k);
    std::vector<t3d_request_t *> reqs;
    for (int i = 0; i < k; ++i) {
      const size_t base = static_cast<size_t>(1 + 5 * i);
      std::vector<size_t> counts, displs;
      const size_t total = AllgathervLayout(n, base, &counts, &displs);
      ins[i] = Bytes(T3D_INT32, counts[rank]);
      outs[i] = Bytes(T3D_INT32, i % 2 ? total : counts[rank]);
      FillPattern(T3D_INT32, rank + 10 * i, ins[i].data(), counts[rank]);
      t3d_request_t *req = nullptr;
      t3d_result_t r;
      if (i % 2) {  // allgatherv with this round's layout
        expects[i] = Bytes(T3D_INT32, total);
        for (int q = 0; q < n; ++q) FillPattern(T3D_INT32, q + 10 * i, expects[i].data() + displs[q] * 4, counts[q]);
        r = t3d_allgatherv(comm, ins[i].data(), counts[rank], outs[i].data(), counts.data(), displs.data(),
                           T3D_INT32, nullptr, &req);
      } else {  // reduce_scatterv of a vector of `total` elements into blocks of this round's counts
        const size_t sum = std::accumulate(counts.begin(), counts.end(), static_cast<size_t>(0));
        const size_t at = std::accumulate(counts.begin(), counts.begin() + rank, static_cast<size_t>(0));
        ins[i] = Bytes(T3D_INT32, sum);
        FillInput(T3D_INT32, T3D_SUM, rank, ins[i].data(), sum);
        Buf all = Bytes(T3D_INT32, sum);
        ReferenceReduce(T3D_INT32, T3D_SUM, n, all.data(), sum);
        expects[i] = Buf(all.begin() + static_cast<long>(at * 4), all.begin() + static_cast<long>((at + counts[rank]) * 4));
        if (expects[i].empty()) expects[i] = Bytes(T3D_INT32, 0);
        r = t3d_reduce_scatterv(comm, ins[i].data(), outs[i].data(), counts.data(), T3D_INT32, T3D_SUM, nullptr,
                                &req);
      }
      ASSERT_EQ(r, T3D_OK) << Tag(rank, "pipelined vector form " + std::to_string(i)) << ": "
                           << t3d_comm_last_error(comm);
      std::fill(counts.begin(), counts.end(), static_cast<size_t>(1) << 40);  // the caller's arrays are gone
      std::fill(displs.begin(), displs.end(), static_cast<size_t>(1) << 40);
      reqs.push_back(req);
    }
    for (int i = 0; i < k; ++i) {
      std::string err;
      t3d_result_t r = Finish(reqs[i], &err);
      EXPECT_EQ(r, T3D_OK) << Tag(rank, "pipelined vector form " + std::to_string(i)) << ": " << err;
      EXPECT_EQ("", ByteDiff(T3D_INT32, outs[i], expects[i]))
          << Tag(rank, "pipelined vector form " + std::to_string(i));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(World, Coll, ::testing::Values(1, 2, 3, 4, 8), WorldName);

}  // namespace
