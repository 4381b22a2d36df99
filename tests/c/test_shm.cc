// test_shm.cc: the same-host shared-memory collectives (c_src/shm): every collective against a serial reference over
// sizes {0, 1, 7, 4097, 3 MiB + odd} x world sizes {2, 3, 4, 8}, with the default segment and with a tiny one
// (many steps, chunked paths for small sizes, non-temporal stores everywhere); in place; uneven counts with zeros;
// two communicators at once; a rank that never arrives; and no segment left in /dev/shm.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

using Buf = std::vector<unsigned char>;
const unsigned char kFill = 0xA5;

// Warnings (the text of a failed init) go to a file the tests can read; set before the library reads T3D_DEBUG.
const std::string kLogPath = "/tmp/t3d-test-shm-log";
const bool kLogSet = [] {
  if (getenv("T3D_DEBUG") == nullptr) {
    SetEnv("T3D_DEBUG", "WARN");
    SetEnv("T3D_DEBUG_FILE", kLogPath.c_str());
  }
  return true;
}();

Buf Bytes(t3d_dtype_t dt, size_t n) { return Buf(std::max<size_t>(1, n * t3d_dtype_size(dt)), kFill); }

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

#define STOP_IF_FAILED()                       \
  do {                                         \
    if (::testing::Test::HasFailure()) return; \
  } while (0)

// 0, 1, 7, 4097 and 3 MiB + 13 elements.
std::vector<size_t> Sizes(t3d_dtype_t dt, bool big) {
  std::vector<size_t> v = {0, 1, 7, 4097};
  if (big) v.push_back((static_cast<size_t>(3) << 20) / t3d_dtype_size(dt) + 13);
  return v;
}

struct Case {
  t3d_dtype_t dt;
  t3d_redop_t op;
  bool big;
};
const Case kCases[] = {
    {T3D_FLOAT32, T3D_SUM, true},  {T3D_BFLOAT16, T3D_AVG, true}, {T3D_INT64, T3D_SUM, true},
    {T3D_FLOAT64, T3D_MAX, false}, {T3D_INT32, T3D_BXOR, false},  {T3D_INT8, T3D_PROD, false},
    {T3D_UINT8, T3D_MIN, false},   {T3D_FLOAT32, T3D_PREMUL_SUM, false}, {T3D_COMPLEX64, T3D_SUM, false},
};

t3d_opts_t Opts(t3d_dtype_t dt) {
  t3d_opts_t o{};
  o.timeout_ms = 0;
  o.premul_scalar = PremulScalar(dt);
  return o;
}

void ExpectSameOnAllRanks(int rank, const std::string &what, const Buf &mine) {
  std::vector<Buf> &slots = HostSlots();
  slots[rank] = mine;
  if (!HostBarrier()) return;
  if (rank != 0) {
    EXPECT_TRUE(slots[rank] == slots[0]) << Tag(rank, what) << ": differs bitwise from rank 0's";
  }
  HostBarrier();
}

// Entries of /dev/shm this process created.
std::vector<std::string> OurSegments() {
  std::vector<std::string> found;
  const std::string prefix = "t3d-" + std::to_string(getpid()) + "-";
  if (DIR *d = opendir("/dev/shm")) {
    while (struct dirent *e = readdir(d))
      if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) found.push_back(e->d_name);
    closedir(d);
  }
  return found;
}

// ---------- parameters: world size x segment tuning ----------

struct Param {
  int n;
  bool tiny;    // T3D_SHM_BYTES=128 KiB, no one-shot, non-temporal stores from 1 byte
  bool direct;  // T3D_SHM_DIRECT_BYTES=1 and T3D_SHM_BCAST_DIRECT_BYTES=1: allgatherv and alltoallv read every
                // block they can from its owner, broadcasts up to 16 MiB skip the segment (the 3 MiB one too)
};

class Shm : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (GetParam().tiny) {
      SetEnv("T3D_SHM_BYTES", "131072");
      SetEnv("T3D_SHM_ONESHOT_BYTES", "0");
      SetEnv("T3D_SHM_NT_BYTES", "1");
    }
    if (GetParam().direct) {
      SetEnv("T3D_SHM_DIRECT_BYTES", "1");
      SetEnv("T3D_SHM_BCAST_DIRECT_BYTES", "1");
    }
  }
  void TearDown() override {
    UnsetEnv("T3D_SHM_BYTES");
    UnsetEnv("T3D_SHM_ONESHOT_BYTES");
    UnsetEnv("T3D_SHM_NT_BYTES");
    UnsetEnv("T3D_SHM_DIRECT_BYTES");
    UnsetEnv("T3D_SHM_BCAST_DIRECT_BYTES");
  }
};

std::string ParamName(const ::testing::TestParamInfo<Param> &info) {
  return "n" + std::to_string(info.param.n) + (info.param.tiny ? "_tiny" : "") + (info.param.direct ? "_direct" : "");
}

TEST_P(Shm, UsesSharedMemoryAndLeavesNoFile) {
  RunRanks(GetParam().n, [&](int rank, t3d_comm_t *comm) {
    EXPECT_STREQ(t3d_comm_transport(comm), HasUcx() ? "shm+ucx" : "shm") << Tag(rank, "transport");
    if (!HostBarrier()) return;
    // Every rank is past init: the segment is mapped everywhere and its name already gone.
    EXPECT_TRUE(OurSegments().empty()) << Tag(rank, "a segment is still in /dev/shm after init: ")
                                       << OurSegments()[0];
  });
  EXPECT_TRUE(OurSegments().empty()) << "a segment is still in /dev/shm after destroy";
}

TEST_P(Shm, Allreduce) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (const Case &c : kCases) {
      const t3d_opts_t opts = Opts(c.dt);
      for (size_t count : Sizes(c.dt, c.big)) {
        STOP_IF_FAILED();
        const std::string what = "allreduce " + CaseName(c.dt, c.op, count);
        Buf in = Bytes(c.dt, count), out = Bytes(c.dt, count), expect = Bytes(c.dt, count);
        FillInput(c.dt, c.op, rank, in.data(), count);
        const Buf in_copy = in;
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out.data(), count, c.dt, c.op, &opts, r);
            }))
          return;
        ReferenceReduce(c.dt, c.op, n, expect.data(), count);
        EXPECT_EQ("", CompareBuffers(c.dt, out.data(), expect.data(), count, Tolerance(c.dt, c.op)))
            << Tag(rank, what);
        EXPECT_TRUE(in == in_copy) << Tag(rank, what) << ": the send buffer changed";
        ExpectSameOnAllRanks(rank, what, out);
        Buf io = in_copy;
        if (!RunOk(comm, what + " in place", [&](t3d_request_t **r) {
              return t3d_allreduce(comm, io.data(), io.data(), count, c.dt, c.op, &opts, r);
            }))
          return;
        EXPECT_EQ("", CompareBuffers(c.dt, io.data(), expect.data(), count, Tolerance(c.dt, c.op)))
            << Tag(rank, what + " in place");
        ExpectSameOnAllRanks(rank, what + " in place", io);
      }
    }
  });
}

TEST_P(Shm, Reduce) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (const Case &c : kCases) {
      const t3d_opts_t opts = Opts(c.dt);
      // The large size for float32 sum only: reduce shares allreduce's paths, which the cases above cover.
      for (size_t count : Sizes(c.dt, c.big && c.dt == T3D_FLOAT32)) {
        for (int root : {0, n - 1}) {
          for (bool in_place : {false, true}) {
            STOP_IF_FAILED();
            const std::string what = "reduce " + CaseName(c.dt, c.op, count) + " root " + std::to_string(root) +
                                     (in_place ? " in place" : "");
            Buf in = Bytes(c.dt, count), out = Bytes(c.dt, count), expect = Bytes(c.dt, count);
            FillInput(c.dt, c.op, rank, in.data(), count);
            void *recv = rank == root ? (in_place ? in.data() : out.data()) : nullptr;
            if (!RunOk(comm, what, [&](t3d_request_t **r) {
                  return t3d_reduce(comm, in.data(), recv, count, c.dt, c.op, root, &opts, r);
                }))
              return;
            if (rank != root) continue;
            ReferenceReduce(c.dt, c.op, n, expect.data(), count);
            EXPECT_EQ("", CompareBuffers(c.dt, static_cast<unsigned char *>(recv), expect.data(), count,
                                         Tolerance(c.dt, c.op)))
                << Tag(rank, what);
          }
        }
      }
    }
  });
}

TEST_P(Shm, ReduceScatterv) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (const Case &c : kCases) {
      const t3d_opts_t opts = Opts(c.dt);
      for (size_t base : Sizes(c.dt, c.big)) {
        for (int mode = 0; mode < 3; ++mode) {  // 0: separate output, 1: in place at the start, 2: own block
          STOP_IF_FAILED();
          if (mode > 0 && base > 4097 && c.dt != T3D_FLOAT32) continue;
          // Uneven, every third rank gets nothing.
          std::vector<size_t> counts(n), offs(n);
          for (int r = 0; r < n; ++r) counts[r] = (r % 3 == 1) ? 0 : base + static_cast<size_t>(r) * 3;
          std::exclusive_scan(counts.begin(), counts.end(), offs.begin(), static_cast<size_t>(0));
          const size_t total = offs.back() + counts.back(), mine = counts[rank];
          const size_t es = t3d_dtype_size(c.dt);
          const std::string what = "reduce_scatterv " + CaseName(c.dt, c.op, base) + " mode " + std::to_string(mode);
          Buf in = Bytes(c.dt, total), out = Bytes(c.dt, mine), expect = Bytes(c.dt, mine);
          FillInput(c.dt, c.op, rank, in.data(), total);
          unsigned char *recv = mode == 0 ? out.data() : mode == 1 ? in.data() : in.data() + offs[rank] * es;
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_reduce_scatterv(comm, in.data(), recv, counts.data(), c.dt, c.op, &opts, r);
              }))
            return;
          ReferenceReduce(c.dt, c.op, n, expect.data(), mine, offs[rank]);
          EXPECT_EQ("", CompareBuffers(c.dt, recv, expect.data(), mine, Tolerance(c.dt, c.op))) << Tag(rank, what);
          if (mode == 0 && mine == 0) {
            EXPECT_EQ(out[0], kFill) << Tag(rank, what) << ": wrote an empty receive";
          }
        }
      }
    }
  });
}

TEST_P(Shm, Broadcast) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_UINT8, T3D_COMPLEX128}) {
      for (size_t count : Sizes(dt, dt != T3D_COMPLEX128)) {
        for (int root = 0; root < n; root += std::max(1, n - 1)) {
          STOP_IF_FAILED();
          const std::string what = "broadcast " + std::string(t3d_dtype_name(dt)) + " x" + std::to_string(count) +
                                   " root " + std::to_string(root);
          Buf buf = Bytes(dt, count), expect = Bytes(dt, count);
          FillPattern(dt, root, expect.data(), count, 0, 3);
          if (rank == root) buf = expect;
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_broadcast(comm, buf.data(), count, dt, root, nullptr, r);
              }))
            return;
          EXPECT_TRUE(buf == expect) << Tag(rank, what);
        }
      }
    }
  });
}

// The root issues 70 broadcasts without waiting while the other ranks start theirs 30 ms later: small ones run
// ahead through the small slots (more of them than there are slots, so the root must wait for slots to free), with
// a broadcast through the halves, an allreduce and a barrier in between every so often. Each buffer must end up
// with its own broadcast's data.
TEST_P(Shm, SmallBroadcastsRunAheadOfLateReaders) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const int kOps = 70;
    std::vector<std::vector<uint32_t>> bufs(kOps);
    std::vector<t3d_request_t *> reqs(kOps, nullptr);
    std::vector<float> ar_in(5, 1.0f), ar_out(5, 0.0f);
    if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    for (int i = 0; i < kOps; ++i) {
      const size_t count = i % 17 == 16 ? 40000 : static_cast<size_t>(1 + (i * 37) % 4000);  // 160 kB or <= 16 kB
      bufs[i].assign(count, 0u);
      if (rank == 0)
        for (size_t k = 0; k < count; ++k) bufs[i][k] = static_cast<uint32_t>(i * 100003 + k);
      t3d_result_t r = T3D_OK;
      if (i % 23 == 22)
        r = t3d_allreduce(comm, ar_in.data(), ar_out.data(), 5, T3D_FLOAT32, T3D_SUM, nullptr, &reqs[i]);
      else if (i % 29 == 28)
        r = t3d_barrier(comm, nullptr, &reqs[i]);
      else
        r = t3d_broadcast(comm, bufs[i].data(), count, T3D_INT32, 0, nullptr, &reqs[i]);
      ASSERT_EQ(r, T3D_OK) << Tag(rank, "issue " + std::to_string(i));
    }
    for (int i = 0; i < kOps; ++i) {
      std::string err;
      ASSERT_EQ(Complete(T3D_OK, reqs[i], &err), T3D_OK) << Tag(rank, "op " + std::to_string(i)) << ": " << err;
      if (i % 23 == 22 || i % 29 == 28) continue;
      for (size_t k = 0; k < bufs[i].size(); ++k) {
        ASSERT_EQ(bufs[i][k], static_cast<uint32_t>(i * 100003 + k)) << Tag(rank, "broadcast " + std::to_string(i));
      }
    }
    EXPECT_EQ(ar_out[0], static_cast<float>(n)) << Tag(rank, "allreduce between the broadcasts");
  });
}

TEST_P(Shm, Allgatherv) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_INT8}) {
      const size_t es = t3d_dtype_size(dt);
      for (size_t base : Sizes(dt, true)) {
        for (int mode = 0; mode < 3; ++mode) {  // 0: separate send buffer, 1: recvbuf (in place), 2: own block
          STOP_IF_FAILED();
          if (base > 4097) base /= static_cast<size_t>(n);
          // Uneven with zeros, blocks in reverse rank order with one-element gaps.
          std::vector<size_t> counts(n), displs(n);
          size_t at = 0;
          for (int p = n - 1; p >= 0; --p) {
            counts[p] = (p % 3 == 2) ? 0 : base + static_cast<size_t>(p);
            displs[p] = at;
            at += counts[p] + 1;
          }
          const std::string what = "allgatherv " + std::string(t3d_dtype_name(dt)) + " base " +
                                   std::to_string(base) + " mode " + std::to_string(mode);
          Buf send = Bytes(dt, counts[rank]), out = Bytes(dt, at), expect = Bytes(dt, at);
          FillPattern(dt, rank, send.data(), counts[rank], 0, 1);
          for (int p = 0; p < n; ++p) FillPattern(dt, p, expect.data() + displs[p] * es, counts[p], 0, 1);
          const void *sb = send.data();
          if (mode == 1) {
            memcpy(out.data() + displs[rank] * es, send.data(), counts[rank] * es);
            sb = out.data();
          } else if (mode == 2) {
            memcpy(out.data() + displs[rank] * es, send.data(), counts[rank] * es);
            sb = out.data() + displs[rank] * es;
          }
          if (!RunOk(comm, what, [&](t3d_request_t **r) {
                return t3d_allgatherv(comm, sb, counts[rank], out.data(), counts.data(), displs.data(), dt, nullptr,
                                      r);
              }))
            return;
          EXPECT_TRUE(out == expect) << Tag(rank, what) << " (gaps must keep their old bytes)";
        }
      }
    }
  });
}

TEST_P(Shm, Alltoallv) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_UINT8}) {
      const size_t es = t3d_dtype_size(dt);
      for (size_t base : Sizes(dt, true)) {
        STOP_IF_FAILED();
        if (base > 4097) base /= static_cast<size_t>(n);
        const A2aLayout lay = AlltoallvLayout(n, rank, base);
        const std::vector<size_t> &sc = lay.sc, &sd = lay.sd, &rc = lay.rc, &rd = lay.rd;
        const size_t s_at = lay.s_total, r_at = lay.r_total;
        const std::string what = "alltoallv " + std::string(t3d_dtype_name(dt)) + " base " + std::to_string(base);
        Buf in = Bytes(dt, s_at), out = Bytes(dt, r_at), expect = Bytes(dt, r_at);
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, in.data() + sd[p] * es, sc[p], p * 100000, 5);
        for (int p = 0; p < n; ++p) FillPattern(dt, p, expect.data() + rd[p] * es, rc[p], rank * 100000, 5);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_alltoallv(comm, in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(), dt,
                                   nullptr, r);
            }))
          return;
        EXPECT_TRUE(out == expect) << Tag(rank, what);
        // Equal blocks in place.
        const size_t m = base;
        Buf io = Bytes(dt, m * n), exp2 = Bytes(dt, m * n);
        for (int p = 0; p < n; ++p) FillPattern(dt, rank, io.data() + p * m * es, m, p * 100000, 6);
        for (int p = 0; p < n; ++p) FillPattern(dt, p, exp2.data() + p * m * es, m, rank * 100000, 6);
        if (!RunOk(comm, what + " in place", [&](t3d_request_t **r) {
              return t3d_alltoall(comm, io.data(), io.data(), m, dt, nullptr, r);
            }))
          return;
        EXPECT_TRUE(io == exp2) << Tag(rank, what + " in place");
      }
    }
  });
}

// One rank sends large blocks, the others small ones: every rank must run the steps (or the single-copy reads)
// the largest block needs, not only those its own or its peers' blocks need.
TEST_P(Shm, AlltoallvOneLargeSender) {
  const int n = GetParam().n;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (size_t big : {static_cast<size_t>(300000), static_cast<size_t>(5)}) {
      STOP_IF_FAILED();
      for (int sender = 0; sender < n; sender += n - 1) {
        auto count = [&](int from, int to) { return from == to ? 3 : (from == sender ? big + to : 2 + to); };
        std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
        size_t s_at = 0, r_at = 0;
        for (int p = 0; p < n; ++p) {
          sc[p] = count(rank, p), sd[p] = s_at, s_at += sc[p];
          rc[p] = count(p, rank), rd[p] = r_at, r_at += rc[p];
        }
        std::vector<int32_t> in(s_at), out(r_at, -1), expect(r_at);
        for (int p = 0; p < n; ++p)
          for (size_t i = 0; i < sc[p]; ++i) in[sd[p] + i] = static_cast<int32_t>(rank * 1000003 + p * 7919 + i);
        for (int p = 0; p < n; ++p)
          for (size_t i = 0; i < rc[p]; ++i) expect[rd[p] + i] = static_cast<int32_t>(p * 1000003 + rank * 7919 + i);
        const std::string what = "alltoallv, rank " + std::to_string(sender) + " sends " + std::to_string(big);
        if (!RunOk(comm, what, [&](t3d_request_t **r) {
              return t3d_alltoallv(comm, in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data(), T3D_INT32,
                                   nullptr, r);
            }))
          return;
        EXPECT_TRUE(out == expect) << Tag(rank, what);
      }
    }
  });
}

TEST_P(Shm, BarrierAndMixedPipeline) {
  const int n = GetParam().n;
  std::atomic<int> arrived{0};
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (int it = 0; it < 20; ++it) {
      STOP_IF_FAILED();
      arrived.fetch_add(1);
      if (!RunOk(comm, "barrier", [&](t3d_request_t **r) { return t3d_barrier(comm, nullptr, r); })) return;
      EXPECT_GE(arrived.load(), n * (it + 1)) << Tag(rank, "left a barrier before every rank arrived");
    }
    // Many operations of different kinds in flight, finished in reverse order.
    const int k = 10;
    std::vector<Buf> ins(k), outs(k);
    std::vector<t3d_request_t *> reqs(k);
    for (int i = 0; i < k; ++i) {
      const size_t count = static_cast<size_t>(1 + 40013 * i);
      ins[i] = Bytes(T3D_FLOAT32, count);
      outs[i] = Bytes(T3D_FLOAT32, count * (i % 2 ? n : 1));
      FillInput(T3D_FLOAT32, T3D_SUM, rank, ins[i].data(), count);
      t3d_result_t r = i % 2 ? t3d_allgather(comm, ins[i].data(), outs[i].data(), count, T3D_FLOAT32, nullptr, &reqs[i])
                             : t3d_allreduce(comm, ins[i].data(), outs[i].data(), count, T3D_FLOAT32, T3D_SUM,
                                             nullptr, &reqs[i]);
      ASSERT_EQ(r, T3D_OK) << t3d_comm_last_error(comm);
    }
    for (int i = k; i-- > 0;) {
      std::string err;
      EXPECT_EQ(Finish(reqs[i], &err), T3D_OK) << Tag(rank, "pipelined " + std::to_string(i)) << ": " << err;
    }
    for (int i = 0; i < k; i += 2) {
      const size_t count = static_cast<size_t>(1 + 40013 * i);
      Buf expect = Bytes(T3D_FLOAT32, count);
      ReferenceReduce(T3D_FLOAT32, T3D_SUM, n, expect.data(), count);
      EXPECT_EQ("", CompareBuffers(T3D_FLOAT32, outs[i].data(), expect.data(), count, 0.0))
          << Tag(rank, "pipelined allreduce " + std::to_string(i));
    }
  });
}

// Two communicators over the same ranks (the second in reverse rank order), operations interleaved on both without
// waiting in between. (Made with t3d_comm_init rather than t3d_comm_split: split passes the parent's transport
// name, "ucx", to the child, which turns shared memory off.)
TEST_P(Shm, TwoCommunicatorsAtOnce) {
  const int n = GetParam().n;
  MemStore store;
  const std::string pa = UniqueName("two-a"), pb = UniqueName("two-b");
  RunOptions o;
  o.store = store.store();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    t3d_comm_t *a = nullptr, *b = nullptr;
    t3d_config_t cfg;
    t3d_config_init(&cfg);
    cfg.timeout_ms = TestTimeoutMs();
    cfg.key_prefix = pa.c_str();
    T3D_ASSERT_OK(comm, t3d_comm_init(&a, rank, n, store.store(), &cfg));
    cfg.key_prefix = pb.c_str();
    T3D_ASSERT_OK(comm, t3d_comm_init(&b, n - 1 - rank, n, store.store(), &cfg));
    ASSERT_STREQ(t3d_comm_transport(a), HasUcx() ? "shm+ucx" : "shm");
    ASSERT_STREQ(t3d_comm_transport(b), HasUcx() ? "shm+ucx" : "shm");
    const int rb = t3d_comm_rank(b);
    const size_t count = (static_cast<size_t>(1) << 19) + 7;
    std::vector<Buf> ina(4), outa(4), inb(4), outb(4);
    std::vector<t3d_request_t *> reqs;
    for (int i = 0; i < 4; ++i) {
      ina[i] = Bytes(T3D_FLOAT32, count);
      outa[i] = Bytes(T3D_FLOAT32, count);
      inb[i] = Bytes(T3D_INT32, count);
      outb[i] = Bytes(T3D_INT32, count);
      FillInput(T3D_FLOAT32, T3D_SUM, rank, ina[i].data(), count, i);
      FillInput(T3D_INT32, T3D_MAX, rb, inb[i].data(), count, i);
      t3d_request_t *r1 = nullptr, *r2 = nullptr;
      T3D_ASSERT_OK(a, t3d_allreduce(a, ina[i].data(), outa[i].data(), count, T3D_FLOAT32, T3D_SUM, nullptr, &r1));
      T3D_ASSERT_OK(b, t3d_allreduce(b, inb[i].data(), outb[i].data(), count, T3D_INT32, T3D_MAX, nullptr, &r2));
      reqs.push_back(r1);
      reqs.push_back(r2);
    }
    for (t3d_request_t *r : reqs) {
      std::string err;
      EXPECT_EQ(Finish(r, &err), T3D_OK) << Tag(rank, err);
    }
    for (int i = 0; i < 4; ++i) {
      Buf ea = Bytes(T3D_FLOAT32, count), eb = Bytes(T3D_INT32, count);
      ReferenceReduce(T3D_FLOAT32, T3D_SUM, n, ea.data(), count, i);
      ReferenceReduce(T3D_INT32, T3D_MAX, n, eb.data(), count, i);
      EXPECT_EQ("", CompareBuffers(T3D_FLOAT32, outa[i].data(), ea.data(), count, 0.0)) << Tag(rank, "comm a");
      EXPECT_EQ("", CompareBuffers(T3D_INT32, outb[i].data(), eb.data(), count, 0.0)) << Tag(rank, "comm b");
    }
    HostBarrier();  // nobody destroys a communicator a peer still reads
    EXPECT_EQ(t3d_comm_destroy(a), T3D_OK);
    EXPECT_EQ(t3d_comm_destroy(b), T3D_OK);
  }, o);
}

INSTANTIATE_TEST_SUITE_P(World, Shm,
                         ::testing::Values(Param{2, false, false}, Param{3, false, false}, Param{4, false, false},
                                           Param{8, false, false}, Param{2, true, false}, Param{3, true, false},
                                           Param{8, true, false}, Param{2, false, true}, Param{3, true, true},
                                           Param{8, false, true}),
                         ParamName);

// ---------- requests of inline collectives ----------

// Small collectives that finish on the caller's thread hand out one shared, finished request (t3d__submit_prepared):
// each behaves as a request of its own: done, T3D_OK, no error text, a callback runs at once, and freeing it (any
// number of times, in any order with the others) frees nothing (AddressSanitizer would see a double free). Ops of
// every inline kind, issued back to back without waiting, all give the right results; one whose peers are late
// (rank 1 sleeps first) is handed to the progress thread on a request of its own and finishes there.
TEST(ShmRequests, InlineCallsThatFinishShareOneRequest) {
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    const int n = 3;
    std::vector<float> in(8, static_cast<float>(rank + 1)), out(8 * 40, 0.0f);
    std::vector<t3d_request_t *> reqs;
    for (int i = 0; i < 40; ++i) {
      t3d_request_t *r = nullptr;
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, in.data(), out.data() + 8 * i, 8, T3D_FLOAT32, T3D_SUM, nullptr, &r));
      ASSERT_NE(r, nullptr) << Tag(rank, "allreduce " + std::to_string(i));
      reqs.push_back(r);
    }
    std::vector<int32_t> b(4, rank == 1 ? 7 : 0), g(4 * n, -1);
    int32_t mine = 100 + rank;
    t3d_request_t *rb = nullptr, *rg = nullptr, *rbar = nullptr;
    T3D_ASSERT_OK(comm, t3d_broadcast(comm, b.data(), 4, T3D_INT32, 1, nullptr, &rb));
    T3D_ASSERT_OK(comm, t3d_allgather(comm, &mine, g.data(), 1, T3D_INT32, nullptr, &rg));
    T3D_ASSERT_OK(comm, t3d_barrier(comm, nullptr, &rbar));
    reqs.push_back(rb);
    reqs.push_back(rg);
    reqs.push_back(rbar);
    int called = 0;
    t3d_result_t seen = T3D_ERR_INTERNAL;
    for (t3d_request_t *r : reqs) {
      EXPECT_EQ(t3d_wait(r, -1), T3D_OK) << Tag(rank, t3d_request_error(r));
      EXPECT_EQ(t3d_test(r), T3D_OK) << Tag(rank, "t3d_test");
      if (t3d_test(r) == T3D_OK) {
        EXPECT_STREQ(t3d_request_error(r), "") << Tag(rank, "error text");
      }
    }
    // A callback set on a finished request runs at once, with its result.
    struct Seen {
      int *called;
      t3d_result_t *res;
    } arg{&called, &seen};
    EXPECT_EQ(t3d_request_set_callback(reqs[0], [](void *a, t3d_result_t res) {
      auto *s = static_cast<Seen *>(a);
      ++*s->called;
      *s->res = res;
    }, &arg), T3D_OK);
    EXPECT_EQ(called, 1) << Tag(rank, "callback on a finished request");
    EXPECT_EQ(seen, T3D_OK) << Tag(rank, "callback result");
    for (size_t i = reqs.size(); i-- > 0;) t3d_request_free(reqs[i]);
    for (int i = 0; i < 40; ++i)
      for (int k = 0; k < 8; ++k) ASSERT_EQ(out[8 * i + k], 6.0f) << Tag(rank, "allreduce " + std::to_string(i));
    for (int k = 0; k < 4; ++k) EXPECT_EQ(b[k], 7) << Tag(rank, "broadcast");
    for (int p = 0; p < n; ++p) EXPECT_EQ(g[p], 100 + p) << Tag(rank, "allgather");
    // Peers late: rank 1 sleeps, so the others' inline start gives up waiting and the progress thread finishes.
    if (!HostBarrier()) return;
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<float> late(8, 0.0f);
    t3d_request_t *r = nullptr;
    T3D_ASSERT_OK(comm, t3d_allreduce(comm, in.data(), late.data(), 8, T3D_FLOAT32, T3D_SUM, nullptr, &r));
    EXPECT_EQ(t3d_wait(r, -1), T3D_OK) << Tag(rank, t3d_request_error(r));
    t3d_request_free(r);
    for (int k = 0; k < 8; ++k) EXPECT_EQ(late[k], 6.0f) << Tag(rank, "late allreduce");
  });
}

// T3D_FLAG_BLOCKING: the call runs the whole collective on the caller's thread, so the request it returns is done
// already, with the right result: small and large (past the inline start's limit and a half) allreduce, broadcast,
// allgather, reduce_scatter, alltoall and barrier, and a small and a large allreduce whose peer comes 50 ms late
// (without the flag, the small one would go on in the background, and a large one never starts inline).
TEST(ShmRequests, BlockingCallsFinishOnTheCallersThread) {
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    t3d_opts_t o{};
    o.flags = T3D_FLAG_BLOCKING;
    auto done_now = [&](t3d_request_t *r, const std::string &what) {
      ASSERT_NE(r, nullptr) << Tag(rank, what);
      EXPECT_EQ(t3d_test(r), T3D_OK) << Tag(rank, what + ": done when the call returns; " + t3d_request_error(r));
      t3d_request_free(r);
    };
    for (size_t count : {size_t{4}, size_t{3} << 20}) {  // 16 B and 12 MiB (more than a half: several steps)
      std::string sz = " of " + std::to_string(count) + " floats";
      std::vector<float> in(count), out(count, 0.0f), all(2 * count, 0.0f);
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((i % 1000) + rank);
      t3d_request_t *r = nullptr;
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, in.data(), out.data(), count, T3D_FLOAT32, T3D_SUM, &o, &r));
      done_now(r, "allreduce" + sz);
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(out[i], 2.0f * (i % 1000) + 1.0f) << Tag(rank, "allreduce");
      std::vector<float> b(count, rank == 1 ? 3.0f : 0.0f);
      T3D_ASSERT_OK(comm, t3d_broadcast(comm, b.data(), count, T3D_FLOAT32, 1, &o, &r));
      done_now(r, "broadcast" + sz);
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(b[i], 3.0f) << Tag(rank, "broadcast");
      T3D_ASSERT_OK(comm, t3d_allgather(comm, in.data(), all.data(), count, T3D_FLOAT32, &o, &r));
      done_now(r, "allgather" + sz);
      for (size_t i = 0; i < count; i += 997) {
        ASSERT_EQ(all[i], static_cast<float>(i % 1000)) << Tag(rank, "allgather");
        ASSERT_EQ(all[count + i], static_cast<float>(i % 1000) + 1.0f) << Tag(rank, "allgather");
      }
      std::vector<float> half(count / 2, 0.0f);
      T3D_ASSERT_OK(comm, t3d_reduce_scatter(comm, in.data(), half.data(), count / 2, T3D_FLOAT32, T3D_SUM, &o, &r));
      done_now(r, "reduce_scatter" + sz);
      for (size_t i = 0; i < count / 2; i += 997) {
        size_t j = rank * (count / 2) + i;
        ASSERT_EQ(half[i], 2.0f * (j % 1000) + 1.0f) << Tag(rank, "reduce_scatter");
      }
      T3D_ASSERT_OK(comm, t3d_alltoall(comm, in.data(), out.data(), count / 2, T3D_FLOAT32, &o, &r));
      done_now(r, "alltoall" + sz);
      for (size_t i = 0; i < count / 2; i += 997) {
        // Block p of the output is block `rank` of rank p's input.
        for (int p = 0; p < 2; ++p) {
          size_t j = rank * (count / 2) + i;
          ASSERT_EQ(out[p * (count / 2) + i], static_cast<float>((j % 1000) + p)) << Tag(rank, "alltoall");
        }
      }
      T3D_ASSERT_OK(comm, t3d_barrier(comm, &o, &r));
      done_now(r, "barrier");
      // The peer comes late: the blocking call waits for it on this thread.
      if (!HostBarrier()) return;
      if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::fill(out.begin(), out.end(), 0.0f);
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, in.data(), out.data(), count, T3D_FLOAT32, T3D_SUM, &o, &r));
      done_now(r, "late allreduce" + sz);
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(out[i], 2.0f * (i % 1000) + 1.0f) << Tag(rank, "late");
    }
  });
}

// The owner's path (core/submit.c): the thread that made the communicator starts small collectives without the
// engine's mutex while it alone issues. Checked on every result: (1) the owner's blocking small broadcasts and
// allreduces right behind a large allreduce it queued (not blocking, so the progress thread runs it: the small ones
// must wait for it, not overtake it); (2) another thread issuing on the same communicator, handed over in order,
// blocking and not, small and queued, which turns the path off for good; (3) the owner again, now through the mutex.
TEST(ShmRequests, OwnerPathWaitsForQueuedWorkAndHandsOverToAnotherThread) {
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    t3d_opts_t blocking{};
    blocking.flags = T3D_FLAG_BLOCKING;
    const size_t big = size_t{3} << 20;  // 12 MiB: queued for the progress thread
    std::vector<float> in(big), out(big, 0.0f);
    for (size_t i = 0; i < big; ++i) in[i] = static_cast<float>((i % 1000) + rank);
    auto small_round = [&](int k, const std::string &who) {
      float v[4] = {0, 0, 0, 0}, s[4];
      if (rank == k % 2) std::fill(v, v + 4, static_cast<float>(k));
      t3d_request_t *r = nullptr;
      T3D_ASSERT_OK(comm, t3d_broadcast(comm, v, 4, T3D_FLOAT32, k % 2, &blocking, &r));
      EXPECT_EQ(t3d_wait(r, -1), T3D_OK) << Tag(rank, who + ": " + t3d_request_error(r));
      t3d_request_free(r);
      for (int j = 0; j < 4; ++j) ASSERT_EQ(v[j], static_cast<float>(k)) << Tag(rank, who + " broadcast");
      std::fill(s, s + 4, static_cast<float>(rank + k));
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, s, s, 4, T3D_FLOAT32, T3D_SUM, nullptr, &r));
      EXPECT_EQ(t3d_wait(r, -1), T3D_OK) << Tag(rank, who + ": " + t3d_request_error(r));
      t3d_request_free(r);
      for (int j = 0; j < 4; ++j) ASSERT_EQ(s[j], static_cast<float>(2 * k + 1)) << Tag(rank, who + " allreduce");
    };
    auto queued_then_small = [&](int k, const std::string &who) {
      std::fill(out.begin(), out.end(), 0.0f);
      t3d_request_t *big_req = nullptr;
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, in.data(), out.data(), big, T3D_FLOAT32, T3D_SUM, nullptr, &big_req));
      small_round(k, who + " behind the queued allreduce");
      EXPECT_EQ(t3d_wait(big_req, -1), T3D_OK) << Tag(rank, who + ": " + t3d_request_error(big_req));
      t3d_request_free(big_req);
      for (size_t i = 0; i < big; i += 997) ASSERT_EQ(out[i], 2.0f * (i % 1000) + 1.0f) << Tag(rank, who + " big");
    };
    for (int k = 0; k < 100; ++k) small_round(k, "owner");
    for (int k = 0; k < 3; ++k) queued_then_small(k, "owner");
    std::thread other([&] {
      for (int k = 0; k < 50; ++k) small_round(k, "other thread");
      for (int k = 0; k < 2; ++k) queued_then_small(k, "other thread");
    });
    other.join();
    for (int k = 0; k < 50; ++k) small_round(k, "owner after the other thread");
    queued_then_small(7, "owner after the other thread");
  });
}

// Ranks that run one broadcast on different paths must agree on its steps: here each rank alternates between
// T3D_FLAG_BLOCKING (the whole broadcast on its thread) and the default (for what fits the inline start: the root
// publishes and returns, the others copy out later), and one rank comes late now and then, for sizes past a small
// slot, up to and past a half. Every byte is checked.
TEST(ShmRequests, BroadcastPathsAgree) {
  const int n = 3;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    int it = 0;
    for (size_t bytes : {size_t{16385}, size_t{20000}, size_t{49152}, size_t{65536}, size_t{200000},
                         size_t{1} << 20, (size_t{5} << 19) + 77}) {
      for (int root = 0; root < n; ++root, ++it) {
        STOP_IF_FAILED();
        const std::string what = "broadcast of " + std::to_string(bytes) + " B from " + std::to_string(root);
        std::vector<uint8_t> buf(bytes, 0), expect(bytes);
        for (size_t i = 0; i < bytes; ++i) expect[i] = static_cast<uint8_t>(i * 7 + root * 13 + it);
        if (rank == root) buf = expect;
        t3d_opts_t o{};
        if ((rank + it) % 2 == 0) o.flags = T3D_FLAG_BLOCKING;
        if (rank == it % n && it % 3 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        t3d_request_t *r = nullptr;
        T3D_ASSERT_OK(comm, t3d_broadcast(comm, buf.data(), bytes, T3D_UINT8, root, &o, &r));
        EXPECT_EQ(t3d_wait(r, -1), T3D_OK) << Tag(rank, what + ": " + t3d_request_error(r));
        t3d_request_free(r);
        EXPECT_TRUE(buf == expect) << Tag(rank, what);
      }
    }
  });
}

// ---------- waiting ----------

// A rank that arrives late is waited for asleep (a futex on its flag), not by polling: while rank 1 sleeps 300 ms
// before each allreduce (small: started inline then handed to the progress thread; large: chunked, on the progress
// thread), the process makes few voluntary context switches (polling with naps made one per ~70 us, thousands)
// and uses a small part of a core.
TEST(ShmWaiting, LateRankIsAwaitedAsleep) {
  const size_t counts[] = {16, static_cast<size_t>(1) << 20};
  std::vector<std::vector<float>> in(2), out(2);
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    for (size_t count : counts) {
      STOP_IF_FAILED();
      in[rank].assign(count, static_cast<float>(rank + 1));
      out[rank].assign(count, 0.0f);
      if (!HostBarrier()) return;
      struct rusage r0;
      getrusage(RUSAGE_SELF, &r0);
      const auto t0 = std::chrono::steady_clock::now();
      if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      const std::string what = "late allreduce x" + std::to_string(count);
      if (!RunOk(comm, what, [&](t3d_request_t **r) {
            return t3d_allreduce(comm, in[rank].data(), out[rank].data(), count, T3D_FLOAT32, T3D_SUM, nullptr, r);
          }))
        return;
      EXPECT_EQ(out[rank][0], 3.0f) << Tag(rank, what);
      EXPECT_EQ(out[rank][count - 1], 3.0f) << Tag(rank, what);
      if (rank == 0) {
        struct rusage r1;
        getrusage(RUSAGE_SELF, &r1);
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double cpu = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) +
                           1e-6 * ((r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) +
                                   (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec));
        const long switches = r1.ru_nvcsw - r0.ru_nvcsw;
        EXPECT_LT(switches, 2000) << Tag(rank, what) << ": " << switches << " voluntary switches in " << wall << " s";
        EXPECT_LT(cpu, 0.25 * wall) << Tag(rank, what) << ": " << cpu << " s of CPU in " << wall << " s";
      }
      if (!HostBarrier()) return;
    }
  });
}

// ---------- failures ----------

// The last rank never issues the collective: the others fail with T3D_ERR_TIMEOUT within twice the timeout, the
// message naming the collective and that rank, and none before the timeout has passed since the first of them
// started (the deadline is set when first needed: a wait that backs off). A rank fails by its own deadline or by
// that of a peer that started before it and told the group ("broke the group"): on a loaded host the ranks start
// milliseconds apart, so a rank's own time may be that much shorter.
void ExpectTimeoutNaming(int n, const std::string &opname,
                         const std::function<t3d_result_t(t3d_comm_t *, int, t3d_request_t **)> &issue) {
  const int64_t timeout_ms = 1000;
  RunOptions o;
  o.comm_timeout_ms = timeout_ms;
  o.abort_on_failure = false;
  using std::chrono::steady_clock;
  const auto ns_now = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(steady_clock::now().time_since_epoch()).count();
  };
  std::vector<std::atomic<int64_t>> started(static_cast<size_t>(n));  // each rank's start, ns (0: not yet)
  for (auto &s : started) s.store(0);
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    if (rank == n - 1) {
      HostBarrier();  // until the others have their errors
      return;
    }
    const int64_t t0 = ns_now();
    started[static_cast<size_t>(rank)].store(t0);
    std::string err;
    t3d_request_t *req = nullptr;
    const t3d_result_t call = issue(comm, rank, &req);
    t3d_result_t r = Complete(call, req, &err);
    const int64_t t1 = ns_now();
    int64_t first = t0;
    for (const auto &s : started) {
      const int64_t v = s.load();
      if (v != 0 && v < first) first = v;
    }
    EXPECT_EQ(r, T3D_ERR_TIMEOUT) << Tag(rank, opname) << ": " << err;
    EXPECT_GE((t1 - first) / 1000000, timeout_ms) << Tag(rank, opname) << ": failed " << (t1 - first) / 1000000
                                                  << " ms after the first rank started: " << err;
    EXPECT_LE((t1 - t0) / 1000000, 2 * timeout_ms) << Tag(rank, opname);
    EXPECT_NE(err.find(opname), std::string::npos) << Tag(rank, err);
    EXPECT_NE(err.find(std::to_string(n - 1)), std::string::npos) << Tag(rank, "does not name the rank: " + err);
    EXPECT_NE(err.find("rank(s)"), std::string::npos) << Tag(rank, err);
    EXPECT_EQ(t3d_comm_status(comm), T3D_ERR_TIMEOUT);
    HostBarrier();
  }, o);
}

TEST(ShmFailure, MissingRankTimesOutSmallAllreduce) {
  std::vector<float> in(100, 1.0f), out(100);
  ExpectTimeoutNaming(3, "allreduce", [&](t3d_comm_t *c, int, t3d_request_t **r) {
    return t3d_allreduce(c, in.data(), out.data(), 100, T3D_FLOAT32, T3D_SUM, nullptr, r);
  });
}

TEST(ShmFailure, MissingRankTimesOutLargeAllreduce) {
  const size_t count = static_cast<size_t>(3) << 20;
  std::vector<std::vector<float>> in(4, std::vector<float>(count, 1.0f)), out(4, std::vector<float>(count));
  ExpectTimeoutNaming(4, "allreduce", [&](t3d_comm_t *c, int rank, t3d_request_t **r) {
    return t3d_allreduce(c, in[rank].data(), out[rank].data(), count, T3D_FLOAT32, T3D_SUM, nullptr, r);
  });
}

TEST(ShmFailure, MissingRootTimesOutBroadcast) {
  std::vector<std::vector<char>> buf(3, std::vector<char>(5 << 20));
  ExpectTimeoutNaming(3, "broadcast", [&](t3d_comm_t *c, int rank, t3d_request_t **r) {
    return t3d_broadcast(c, buf[rank].data(), buf[rank].size(), T3D_UINT8, 2, nullptr, r);
  });
}

TEST(ShmFailure, MissingRankTimesOutBarrier) {
  ExpectTimeoutNaming(8, "barrier", [&](t3d_comm_t *c, int, t3d_request_t **r) { return t3d_barrier(c, nullptr, r); });
}

// Ranks that disagree on the size fail with T3D_ERR_MISMATCH (or time out), never with wrong data or a hang. The
// pairs cover each way a one-shot vector travels (in the info line up to 40 bytes, in the half above) and pairs
// across them, with the larger vector on either rank.
TEST(ShmFailure, SizeMismatchIsReported) {
  RunOptions o;
  o.comm_timeout_ms = 1000;
  o.abort_on_failure = false;
  const size_t pairs[][2] = {{5, 8}, {20, 30}, {30, 20}, {8, 20}, {40, 60}, {60, 40}, {100, 200}};
  for (const auto &pair : pairs) {
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const size_t count = pair[rank];
      std::vector<float> in(count, 1.0f), out(count);
      std::string err;
      t3d_request_t *req = nullptr;
      const t3d_result_t call =
          t3d_allreduce(comm, in.data(), out.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, &req);
      t3d_result_t r = Complete(call, req, &err);
      EXPECT_TRUE(r == T3D_ERR_MISMATCH || r == T3D_ERR_TIMEOUT)
          << Tag(rank, t3d_result_string(r)) << " " << err << " (counts " << pair[0] << ", " << pair[1] << ")";
      if (r == T3D_ERR_MISMATCH) {
        EXPECT_NE(err.find("disagree"), std::string::npos) << err;
      }
    }, o);
  }
}

// t3d_alltoall on ranks that disagree on the block size fails with T3D_ERR_MISMATCH (or times out), never with wrong
// data or a hang: pairs within each way small equal blocks travel (in the sender's info line up to 40 bytes, packed
// in its half up to 16 KiB, the steps above) and across them, the larger block on either rank; and a rank that calls
// t3d_alltoall against one that calls t3d_alltoallv with the same blocks (which take the steps).
TEST(ShmFailure, AlltoallBlockMismatchIsReported) {
  RunOptions o;
  o.comm_timeout_ms = 1000;
  o.abort_on_failure = false;
  const size_t pairs[][2] = {{4, 8}, {8, 100}, {100, 8}, {100, 120}, {1000, 5000}, {5000, 1000}};
  for (const auto &pair : pairs) {
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const size_t count = pair[rank];
      std::vector<float> in(2 * count, 1.0f), out(2 * count, -1.0f);
      std::string err;
      t3d_request_t *req = nullptr;
      const t3d_result_t call = t3d_alltoall(comm, in.data(), out.data(), count, T3D_FLOAT32, nullptr, &req);
      t3d_result_t r = Complete(call, req, &err);
      EXPECT_TRUE(r == T3D_ERR_MISMATCH || r == T3D_ERR_TIMEOUT)
          << Tag(rank, t3d_result_string(r)) << " " << err << " (blocks " << pair[0] << ", " << pair[1] << ")";
    }, o);
  }
  for (size_t count : {size_t{8}, size_t{100}}) {
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      std::vector<float> in(2 * count, 1.0f), out(2 * count, -1.0f);
      std::vector<size_t> counts = {count, count}, displs = {0, count};
      std::string err;
      t3d_request_t *req = nullptr;
      const t3d_result_t call =
          rank == 0 ? t3d_alltoall(comm, in.data(), out.data(), count, T3D_FLOAT32, nullptr, &req)
                    : t3d_alltoallv(comm, in.data(), counts.data(), displs.data(), out.data(), counts.data(),
                                    displs.data(), T3D_FLOAT32, nullptr, &req);
      t3d_result_t r = Complete(call, req, &err);
      EXPECT_TRUE(r == T3D_ERR_MISMATCH || r == T3D_ERR_TIMEOUT)
          << Tag(rank, t3d_result_string(r)) << " " << err << " (alltoall against alltoallv, " << count << ")";
    }, o);
  }
}

// An alltoallv whose ranks disagree on a split (rank 0 sends 5 elements to rank 1, which expects 6) fails on the
// receiver with a mismatch naming the sender and both lengths, whether the blocks go through the segment or are read
// from the sender (single copy). The sender's own blocks all arrive as it expects: it may complete.
TEST(ShmFailure, AlltoallvSplitMismatchIsReported) {
  for (const char *direct : {"0", "1"}) {
    SetEnv("T3D_SHM_DIRECT_BYTES", direct);
    RunOptions o;
    o.comm_timeout_ms = 1000;
    o.abort_on_failure = false;
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      std::vector<size_t> sc = {4, rank == 0 ? size_t{5} : size_t{4}}, rc = {4, 4}, sd = {0, 4}, rd = {0, 4};
      if (rank == 1) rc[0] = 6, rd[1] = 6;
      std::vector<float> in(9, 1.0f), out(10);
      std::string err;
      t3d_request_t *req = nullptr;
      const t3d_result_t call = t3d_alltoallv(comm, in.data(), sc.data(), sd.data(), out.data(), rc.data(),
                                              rd.data(), T3D_FLOAT32, nullptr, &req);
      t3d_result_t r = Complete(call, req, &err);
      if (rank == 1) {
        EXPECT_EQ(r, T3D_ERR_MISMATCH) << "direct " << direct << ": " << err;
        EXPECT_NE(err.find("rank 0 sends 20 bytes to this rank, which expects 24"), std::string::npos) << err;
      } else {
        EXPECT_TRUE(r == T3D_OK || r == T3D_ERR_MISMATCH || r == T3D_ERR_TIMEOUT)
            << Tag(rank, t3d_result_string(r)) << " " << err;
      }
    }, o);
  }
  UnsetEnv("T3D_SHM_DIRECT_BYTES");
}

// A segment larger than /dev/shm can hold fails init at once with T3D_ERR_NO_MEMORY and a reason naming /dev/shm and
// T3D_SHM_BYTES (rank 0), and a matching failure on the other rank; nothing is left in /dev/shm.
TEST(ShmFailure, SegmentTooLargeFailsInitClearly) {
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) != 0 || fs.f_blocks == 0) GTEST_SKIP() << "/dev/shm has no size limit to exceed";
  const unsigned long long limit = static_cast<unsigned long long>(fs.f_blocks) * fs.f_frsize;
  if (limit > (1ull << 42)) GTEST_SKIP() << "/dev/shm is too large to exceed safely";
  // tmpfs refuses an fallocate beyond its size up front, before reserving anything.
  SetEnv("T3D_SHM_BYTES", std::to_string(limit).c_str());
  MemStore store;
  const std::string prefix = UniqueName("shm-too-large");
  t3d_result_t res[2] = {T3D_OK, T3D_OK};
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      t3d_config_t cfg;
      t3d_config_init(&cfg);
      cfg.timeout_ms = 10000;
      cfg.key_prefix = prefix.c_str();
      t3d_comm_t *c = nullptr;
      res[r] = t3d_comm_init(&c, r, 2, store.store(), &cfg);
      if (c) t3d_comm_destroy(c);
    });
  }
  for (auto &t : ts) t.join();
  UnsetEnv("T3D_SHM_BYTES");
  EXPECT_EQ(res[0], T3D_ERR_NO_MEMORY) << t3d_result_string(res[0]);
  EXPECT_NE(res[1], T3D_OK);
  EXPECT_TRUE(OurSegments().empty());
  // The reason went to the warning log (T3D_DEBUG=WARN, T3D_DEBUG_FILE set above) unless the user chose otherwise.
  if (getenv("T3D_DEBUG_FILE") && kLogPath == getenv("T3D_DEBUG_FILE")) {
    const std::string path = kLogPath + "." + std::to_string(getpid());
    std::string log;
    if (FILE *f = fopen(path.c_str(), "r")) {
      char chunk[4096];
      size_t got;
      while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) log.append(chunk, got);
      fclose(f);
    }
    EXPECT_NE(log.find("/dev/shm"), std::string::npos) << log;
    EXPECT_NE(log.find("T3D_SHM_BYTES"), std::string::npos) << log;
  }
}

}  // namespace
