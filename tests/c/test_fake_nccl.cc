// test_fake_nccl.cc: the fake NCCL on its own, without t3d: every collective over NCCL's ten data types and five
// operators plus PreMulSum, groups of sends and receives, nonblocking initialization, argument and agreement errors,
// abort waking a blocked peer, and the hooks. test_nccl trusts these semantics when it uses the fake as NCCL.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fake_nccl_api.h"
#include "harness.h"

using namespace t3dtest;

namespace {

// Waits for peers give up after 1 s here, so that the test of that finishes quickly.
const int kWaitEnv = setenv("FAKE_NCCL_WAIT_MS", "1000", 1);

FakeNccl &F() {
  static FakeNccl fake;
  static bool opened = fake.Open(T3D_FAKE_NCCL_PATH);
  if (!opened) ADD_FAILURE() << fake.error;
  return fake;
}

using Comm = t3d_nccl_comm_t;
using Buf = std::vector<unsigned char>;
const int kDtypes = 10;

size_t Size(int dt) {
  static const size_t s[kDtypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return s[dt];
}
bool Signed(int dt) { return dt != T3D_NCCL_UINT8 && dt != T3D_NCCL_UINT32 && dt != T3D_NCCL_UINT64; }
bool Floating(int dt) { return dt >= T3D_NCCL_FLOAT16; }

void Put(int dt, void *buf, size_t i, double v) {
  unsigned char *p = static_cast<unsigned char *>(buf) + i * Size(dt);
  switch (dt) {
    case T3D_NCCL_INT8: { int8_t x = static_cast<int8_t>(v); memcpy(p, &x, 1); break; }
    case T3D_NCCL_UINT8: { uint8_t x = static_cast<uint8_t>(v); memcpy(p, &x, 1); break; }
    case T3D_NCCL_INT32: { int32_t x = static_cast<int32_t>(v); memcpy(p, &x, 4); break; }
    case T3D_NCCL_UINT32: { uint32_t x = static_cast<uint32_t>(v); memcpy(p, &x, 4); break; }
    case T3D_NCCL_INT64: { int64_t x = static_cast<int64_t>(v); memcpy(p, &x, 8); break; }
    case T3D_NCCL_UINT64: { uint64_t x = static_cast<uint64_t>(v); memcpy(p, &x, 8); break; }
    case T3D_NCCL_FLOAT16: { uint16_t x = FloatToHalf(static_cast<float>(v)); memcpy(p, &x, 2); break; }
    case T3D_NCCL_FLOAT32: { float x = static_cast<float>(v); memcpy(p, &x, 4); break; }
    case T3D_NCCL_FLOAT64: memcpy(p, &v, 8); break;
    case T3D_NCCL_BFLOAT16: { uint16_t x = FloatToBf16(static_cast<float>(v)); memcpy(p, &x, 2); break; }
    default: break;
  }
}

double Get(int dt, const void *buf, size_t i) {
  const unsigned char *p = static_cast<const unsigned char *>(buf) + i * Size(dt);
  switch (dt) {
    case T3D_NCCL_INT8: { int8_t x; memcpy(&x, p, 1); return x; }
    case T3D_NCCL_UINT8: { uint8_t x; memcpy(&x, p, 1); return x; }
    case T3D_NCCL_INT32: { int32_t x; memcpy(&x, p, 4); return x; }
    case T3D_NCCL_UINT32: { uint32_t x; memcpy(&x, p, 4); return x; }
    case T3D_NCCL_INT64: { int64_t x; memcpy(&x, p, 8); return static_cast<double>(x); }
    case T3D_NCCL_UINT64: { uint64_t x; memcpy(&x, p, 8); return static_cast<double>(x); }
    case T3D_NCCL_FLOAT16: { uint16_t x; memcpy(&x, p, 2); return HalfToFloat(x); }
    case T3D_NCCL_FLOAT32: { float x; memcpy(&x, p, 4); return x; }
    case T3D_NCCL_FLOAT64: { double x; memcpy(&x, p, 8); return x; }
    case T3D_NCCL_BFLOAT16: { uint16_t x; memcpy(&x, p, 2); return Bf16ToFloat(x); }
    default: return 0;
  }
}

// Small values that keep every result exact in every type: [-4, 4] (unsigned [0, 8]); PROD gets 1, 2 and -1.
double In(int dt, int op, int rank, size_t i) {
  if (op == T3D_NCCL_PROD) {
    if ((i + static_cast<size_t>(rank)) % 3 == 0) return 2;
    return (Signed(dt) && (i + 2 * static_cast<size_t>(rank)) % 4 == 0) ? -1 : 1;
  }
  const double h = static_cast<double>((7 * i + 5 * static_cast<size_t>(rank)) % 9);
  return Signed(dt) ? h - 4 : h;
}
// Each rank's own PreMulSum factor.
double Scalar(int dt, int rank) { return Floating(dt) ? 0.5 * (rank + 1) : rank + 1; }

double Reference(int dt, int op, int n, size_t i) {
  double acc = 0;
  for (int r = 0; r < n; ++r) {
    const double x = In(dt, op, r, i);
    switch (op) {
      case T3D_NCCL_SUM: case T3D_NCCL_AVG: acc = r ? acc + x : x; break;
      case T3D_NCCL_PROD: acc = r ? acc * x : x; break;
      case T3D_NCCL_MAX: acc = r ? std::max(acc, x) : x; break;
      case T3D_NCCL_MIN: acc = r ? std::min(acc, x) : x; break;
      default: acc = r ? acc + x * Scalar(dt, r) : x * Scalar(dt, r); break;
    }
  }
  if (op == T3D_NCCL_AVG) acc = Floating(dt) ? acc / n : std::trunc(acc / n);
  return acc;
}

// n threads, each with its rank's communicator over one fresh unique id; destroyed after fn.
void RunFake(int n, const std::function<void(int, Comm)> &fn, bool blocking = true) {
  FakeNccl &f = F();
  t3d_nccl_unique_id_t id;
  ASSERT_EQ(f.api.GetUniqueId(&id), T3D_NCCL_SUCCESS);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      t3d_nccl_config_t cfg;
      memset(&cfg, 0, sizeof cfg);
      cfg.size = sizeof cfg;
      cfg.magic = T3D_NCCL_CONFIG_MAGIC;
      cfg.version = T3D_NCCL_CONFIG_VERSION;
      cfg.blocking = blocking ? 1 : 0;
      cfg.cga_cluster_size = cfg.min_ctas = cfg.max_ctas = T3D_NCCL_CONFIG_UNDEF_INT;
      Comm c = nullptr;
      t3d_nccl_result_t res = f.api.CommInitRankConfig(&c, n, id, r, &cfg);
      if (!blocking) {
        EXPECT_EQ(res, T3D_NCCL_IN_PROGRESS);
        t3d_nccl_result_t state = T3D_NCCL_IN_PROGRESS;
        while (state == T3D_NCCL_IN_PROGRESS) {
          ASSERT_EQ(f.api.CommGetAsyncError(c, &state), T3D_NCCL_SUCCESS);
          std::this_thread::yield();
        }
        res = state;
      }
      ASSERT_EQ(res, T3D_NCCL_SUCCESS) << f.api.GetLastError(c);
      fn(r, c);
      EXPECT_EQ(f.api.CommDestroy(c), T3D_NCCL_SUCCESS);
    });
  }
  for (auto &t : threads) t.join();
}

// A blocking communicator's call returns SUCCESS; a nonblocking one's IN_PROGRESS after doing the work.
void ExpectDone(t3d_nccl_result_t res, bool blocking, const std::string &what) {
  EXPECT_EQ(res, blocking ? T3D_NCCL_SUCCESS : T3D_NCCL_IN_PROGRESS) << what << ": " << F().api.GetLastError(nullptr);
}

std::string Diff(int dt, const void *got, const void *want, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (memcmp(static_cast<const unsigned char *>(got) + i * Size(dt),
               static_cast<const unsigned char *>(want) + i * Size(dt), Size(dt)) != 0)
      return "dtype " + std::to_string(dt) + " element " + std::to_string(i) + ": got " +
             std::to_string(Get(dt, got, i)) + ", want " + std::to_string(Get(dt, want, i));
  return "";
}

TEST(FakeNccl, VersionAndIds) {
  FakeNccl &f = F();
  int v = 0;
  ASSERT_EQ(f.api.GetVersion(&v), T3D_NCCL_SUCCESS);
  EXPECT_EQ(v, 22705);
  t3d_nccl_unique_id_t a, b;
  ASSERT_EQ(f.api.GetUniqueId(&a), T3D_NCCL_SUCCESS);
  ASSERT_EQ(f.api.GetUniqueId(&b), T3D_NCCL_SUCCESS);
  EXPECT_NE(memcmp(&a, &b, sizeof a), 0);
  EXPECT_STREQ(f.api.GetErrorString(T3D_NCCL_SUCCESS), "no error");
  EXPECT_NE(std::string(f.api.GetErrorString(T3D_NCCL_REMOTE_ERROR)).find("remote"), std::string::npos);
  EXPECT_EQ(f.calls("ncclNoSuchFunction"), -1);
  EXPECT_GE(f.calls("ncclGetVersion"), 1);
}

class FakeWorld : public ::testing::TestWithParam<int> {};

TEST_P(FakeWorld, AllReduceEveryTypeAndOp) {
  const int n = GetParam();
  FakeNccl &f = F();
  const int premul_before = f.premul_live();
  RunFake(n, [&](int rank, Comm c) {
    for (int dt = 0; dt < kDtypes; ++dt) {
      for (int op = 0; op <= T3D_NCCL_NUM_OPS; ++op) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{1000}}) {
          const std::string what = "dtype " + std::to_string(dt) + " op " + std::to_string(op) + " count " +
                                   std::to_string(count) + " rank " + std::to_string(rank);
          Buf in(count * Size(dt) + 1), out(count * Size(dt) + 1, 0xA5), want(count * Size(dt) + 1, 0xA5);
          for (size_t i = 0; i < count; ++i) {
            Put(dt, in.data(), i, In(dt, op, rank, i));
            Put(dt, want.data(), i, Reference(dt, op, n, i));
          }
          t3d_nccl_redop_t redop = op;
          if (op == T3D_NCCL_NUM_OPS) {  // PreMulSum with this rank's factor, in the buffer's type
            Buf s(8);
            Put(dt, s.data(), 0, Scalar(dt, rank));
            ASSERT_EQ(f.api.RedOpCreatePreMulSum(&redop, s.data(), dt, T3D_NCCL_SCALAR_HOST_IMMEDIATE, c),
                      T3D_NCCL_SUCCESS);
            EXPECT_GE(redop, T3D_NCCL_NUM_OPS);
            memset(s.data(), 0, s.size());  // an immediate scalar is read at creation
          }
          ASSERT_EQ(f.api.AllReduce(in.data(), out.data(), count, dt, redop, c, nullptr), T3D_NCCL_SUCCESS)
              << what << ": " << f.api.GetLastError(c);
          EXPECT_EQ("", Diff(dt, out.data(), want.data(), count)) << what;
          EXPECT_EQ(out[count * Size(dt)], 0xA5) << what << ": wrote past the end";
          // In place.
          ASSERT_EQ(f.api.AllReduce(in.data(), in.data(), count, dt, redop, c, nullptr), T3D_NCCL_SUCCESS) << what;
          EXPECT_EQ("", Diff(dt, in.data(), want.data(), count)) << what << " (in place)";
          if (redop >= T3D_NCCL_NUM_OPS) {
            EXPECT_EQ(f.api.RedOpDestroy(redop, c), T3D_NCCL_SUCCESS);
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  });
  EXPECT_EQ(f.premul_live(), premul_before);
}

TEST_P(FakeWorld, RootedAndGatheringCollectives) {
  const int n = GetParam();
  FakeNccl &f = F();
  RunFake(n, [&](int rank, Comm c) {
    for (int dt : {T3D_NCCL_INT8, T3D_NCCL_UINT32, T3D_NCCL_FLOAT16, T3D_NCCL_FLOAT64}) {
      const size_t count = 37, es = Size(dt);
      for (int root = 0; root < n; ++root) {
        const std::string what = "dtype " + std::to_string(dt) + " root " + std::to_string(root);
        // Broadcast: a non-root's sendbuf is never read (NULL here).
        Buf buf(count * es, 0), want(count * es);
        for (size_t i = 0; i < count; ++i) Put(dt, want.data(), i, In(dt, T3D_NCCL_SUM, root, i));
        if (rank == root) buf = want;
        ASSERT_EQ(f.api.Broadcast(rank == root ? buf.data() : nullptr, buf.data(), count, dt, root, c, nullptr),
                  T3D_NCCL_SUCCESS) << what;
        EXPECT_EQ("", Diff(dt, buf.data(), want.data(), count)) << what << " broadcast";
        // Reduce: a non-root's recvbuf is never written (NULL here).
        Buf in(count * es), out(count * es, 0), sum(count * es);
        for (size_t i = 0; i < count; ++i) {
          Put(dt, in.data(), i, In(dt, T3D_NCCL_MAX, rank, i));
          Put(dt, sum.data(), i, Reference(dt, T3D_NCCL_MAX, n, i));
        }
        ASSERT_EQ(f.api.Reduce(in.data(), rank == root ? out.data() : nullptr, count, dt, T3D_NCCL_MAX, root, c,
                               nullptr),
                  T3D_NCCL_SUCCESS) << what;
        if (rank == root) {
          EXPECT_EQ("", Diff(dt, out.data(), sum.data(), count)) << what << " reduce";
        }
      }
      // AllGather, in place: my block already sits at rank * count.
      Buf all(n * count * es, 0), want(n * count * es);
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i) Put(dt, want.data(), r * count + i, In(dt, T3D_NCCL_SUM, r, i));
      memcpy(all.data() + rank * count * es, want.data() + rank * count * es, count * es);
      ASSERT_EQ(f.api.AllGather(all.data() + rank * count * es, all.data(), count, dt, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ("", Diff(dt, all.data(), want.data(), n * count)) << "allgather";
      // ReduceScatter: block r of every rank's input, summed, lands on rank r.
      Buf rin(n * count * es), rout(count * es), rwant(count * es);
      for (size_t i = 0; i < n * count; ++i) Put(dt, rin.data(), i, In(dt, T3D_NCCL_SUM, rank, i));
      for (size_t i = 0; i < count; ++i) Put(dt, rwant.data(), i, Reference(dt, T3D_NCCL_SUM, n, rank * count + i));
      ASSERT_EQ(f.api.ReduceScatter(rin.data(), rout.data(), count, dt, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ("", Diff(dt, rout.data(), rwant.data(), count)) << "reduce_scatter";
    }
  });
}

// Sends and receives in a group: a ring both ways, two messages to the same peer in order, and one to oneself;
// then a collective recorded in the same group runs after them. Nonblocking communicators report IN_PROGRESS.
TEST_P(FakeWorld, GroupedPointToPoint) {
  const int n = GetParam();
  FakeNccl &f = F();
  for (bool blocking : {true, false}) {
    RunFake(n, [&](int rank, Comm c) {
      const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      int32_t to_next[2] = {rank * 10, rank * 10 + 1}, to_prev = rank * 100, to_self = rank + 7;
      int32_t from_prev[2] = {-1, -1}, from_next = -1, from_self = -1;
      int32_t x = rank + 1, sum = 0;
      ASSERT_EQ(f.api.GroupStart(), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.AllReduce(&x, &sum, 1, T3D_NCCL_INT32, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.GroupStart(), T3D_NCCL_SUCCESS);  // nested
      EXPECT_EQ(f.api.Recv(&from_prev[0], 1, T3D_NCCL_INT32, prev, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Recv(&from_prev[1], 1, T3D_NCCL_INT32, prev, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Send(&to_next[0], 1, T3D_NCCL_INT32, next, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Send(&to_next[1], 1, T3D_NCCL_INT32, next, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.GroupEnd(), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Send(&to_prev, 1, T3D_NCCL_INT32, prev, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Recv(&from_next, 1, T3D_NCCL_INT32, next, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Recv(&from_self, 1, T3D_NCCL_INT32, rank, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(f.api.Send(&to_self, 1, T3D_NCCL_INT32, rank, c, nullptr), T3D_NCCL_SUCCESS);
      EXPECT_EQ(sum, 0) << "a grouped collective ran before ncclGroupEnd";
      ExpectDone(f.api.GroupEnd(), blocking, "group end");
      if (n == 1) {  // every message went to rank 0 itself; the FIFO order per pair still holds
        EXPECT_EQ(from_prev[0], 0);
        EXPECT_EQ(from_prev[1], 1);
      } else {
        EXPECT_EQ(from_prev[0], prev * 10);
        EXPECT_EQ(from_prev[1], prev * 10 + 1);
        EXPECT_EQ(from_next, next * 100);
      }
      EXPECT_EQ(from_self, rank + 7);
      EXPECT_EQ(sum, n * (n + 1) / 2);
      // Standalone pairs (a group of one each): even ranks send first.
      if (n >= 2 && rank < 2) {
        int64_t out = 1000 + rank, got = -1;
        const int peer = 1 - rank;
        if (rank == 0) {
          ExpectDone(f.api.Send(&out, 1, T3D_NCCL_INT64, peer, c, nullptr), blocking, "send");
          ExpectDone(f.api.Recv(&got, 1, T3D_NCCL_INT64, peer, c, nullptr), blocking, "recv");
        } else {
          ExpectDone(f.api.Recv(&got, 1, T3D_NCCL_INT64, peer, c, nullptr), blocking, "recv");
          ExpectDone(f.api.Send(&out, 1, T3D_NCCL_INT64, peer, c, nullptr), blocking, "send");
        }
        EXPECT_EQ(got, 1000 + peer);
      }
    }, blocking);
  }
}

INSTANTIATE_TEST_SUITE_P(Fake, FakeWorld, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int> &i) { return "n" + std::to_string(i.param); });

// Halves round to nearest even once, after accumulating in float; integer AVG truncates toward zero.
TEST(FakeNccl, RoundingAndTruncation) {
  FakeNccl &f = F();
  RunFake(2, [&](int rank, Comm c) {
    const float h_in[2][2] = {{2048, 2048}, {1, 3}};
    uint16_t h[2], hb[2], out[2];
    for (int i = 0; i < 2; ++i) h[i] = FloatToHalf(h_in[rank][i]);
    ASSERT_EQ(f.api.AllReduce(h, out, 2, T3D_NCCL_FLOAT16, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(HalfToFloat(out[0]), 2048.0f);  // 2049 ties to the even 2048
    EXPECT_EQ(HalfToFloat(out[1]), 2052.0f);  // 2051 ties to the even 2052
    const float b_in[2][2] = {{256, 256}, {1, 3}};
    for (int i = 0; i < 2; ++i) hb[i] = FloatToBf16(b_in[rank][i]);
    ASSERT_EQ(f.api.AllReduce(hb, out, 2, T3D_NCCL_BFLOAT16, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(Bf16ToFloat(out[0]), 256.0f);
    EXPECT_EQ(Bf16ToFloat(out[1]), 260.0f);
    int32_t v[2] = {rank == 0 ? -4 : -3, rank == 0 ? 4 : 3}, avg[2];
    ASSERT_EQ(f.api.AllReduce(v, avg, 2, T3D_NCCL_INT32, T3D_NCCL_AVG, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(avg[0], -3);
    EXPECT_EQ(avg[1], 3);
    int8_t w = rank == 0 ? 100 : 100, ws = 0;  // int8 SUM wraps; AVG sums in 64 bits first
    ASSERT_EQ(f.api.AllReduce(&w, &ws, 1, T3D_NCCL_INT8, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(ws, static_cast<int8_t>(-56));
    ASSERT_EQ(f.api.AllReduce(&w, &ws, 1, T3D_NCCL_INT8, T3D_NCCL_AVG, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(ws, 100);
  });
}

// Nonblocking initialization: IN_PROGRESS until every rank has joined; a call before that is refused.
TEST(FakeNccl, NonblockingInitNeedsEveryRank) {
  FakeNccl &f = F();
  t3d_nccl_unique_id_t id;
  ASSERT_EQ(f.api.GetUniqueId(&id), T3D_NCCL_SUCCESS);
  t3d_nccl_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  cfg.magic = T3D_NCCL_CONFIG_MAGIC;
  cfg.version = T3D_NCCL_CONFIG_VERSION;
  cfg.blocking = 0;
  const int created = f.comms_created(), live = f.comms_live();
  Comm c0 = nullptr, c1 = nullptr;
  ASSERT_EQ(f.api.CommInitRankConfig(&c0, 2, id, 0, &cfg), T3D_NCCL_IN_PROGRESS);
  EXPECT_EQ(f.last_blocking(), 0);
  EXPECT_EQ(f.last_nranks(), 2);
  t3d_nccl_result_t state = T3D_NCCL_SUCCESS;
  ASSERT_EQ(f.api.CommGetAsyncError(c0, &state), T3D_NCCL_SUCCESS);
  EXPECT_EQ(state, T3D_NCCL_IN_PROGRESS);
  float x = 1, y = 0;
  EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c0, nullptr), T3D_NCCL_INVALID_USAGE);
  EXPECT_NE(std::string(f.api.GetLastError(c0)).find("initializing"), std::string::npos) << f.api.GetLastError(c0);
  ASSERT_EQ(f.api.CommInitRankConfig(&c1, 2, id, 1, &cfg), T3D_NCCL_IN_PROGRESS);
  ASSERT_EQ(f.api.CommGetAsyncError(c0, &state), T3D_NCCL_SUCCESS);
  EXPECT_EQ(state, T3D_NCCL_SUCCESS);
  EXPECT_EQ(f.comms_created(), created + 2);
  EXPECT_EQ(f.comms_live(), live + 2);
  // The id formed a communicator: using it again is an error, as is a bad config.
  Comm c2 = nullptr;
  EXPECT_EQ(f.api.CommInitRankConfig(&c2, 2, id, 0, &cfg), T3D_NCCL_INVALID_USAGE);
  t3d_nccl_unique_id_t fresh;
  ASSERT_EQ(f.api.GetUniqueId(&fresh), T3D_NCCL_SUCCESS);
  t3d_nccl_config_t bad = cfg;
  bad.magic = 0;
  EXPECT_EQ(f.api.CommInitRankConfig(&c2, 1, fresh, 0, &bad), T3D_NCCL_INVALID_ARGUMENT);
  // Finalize: IN_PROGRESS, then the state settles; no operation afterwards; then destroy.
  EXPECT_EQ(f.api.CommFinalize(c0), T3D_NCCL_IN_PROGRESS);
  state = T3D_NCCL_IN_PROGRESS;
  int polls = 0;
  while (state == T3D_NCCL_IN_PROGRESS && polls < 100) {
    ASSERT_EQ(f.api.CommGetAsyncError(c0, &state), T3D_NCCL_SUCCESS);
    ++polls;
  }
  EXPECT_EQ(state, T3D_NCCL_SUCCESS);
  EXPECT_GE(polls, 2) << "a nonblocking finalize reports IN_PROGRESS at least once";
  EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c0, nullptr), T3D_NCCL_INVALID_USAGE);
  EXPECT_EQ(f.api.CommFinalize(c0), T3D_NCCL_INVALID_USAGE);
  EXPECT_EQ(f.api.CommDestroy(c0), T3D_NCCL_SUCCESS);
  EXPECT_EQ(f.api.CommAbort(c1), T3D_NCCL_SUCCESS);
  EXPECT_EQ(f.comms_live(), live);
}

// Ranks that disagree on a collective's arguments all get ncclInvalidUsage and a text saying what differed.
TEST(FakeNccl, DisagreementIsInvalidUsage) {
  FakeNccl &f = F();
  RunFake(3, [&](int rank, Comm c) {
    float x[4] = {1, 2, 3, 4}, y[4];
    const size_t count = rank == 2 ? 3 : 4;
    EXPECT_EQ(f.api.AllReduce(x, y, count, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_INVALID_USAGE);
    EXPECT_NE(std::string(f.api.GetLastError(c)).find("count"), std::string::npos) << f.api.GetLastError(c);
    EXPECT_EQ(f.api.Broadcast(x, x, 4, T3D_NCCL_FLOAT32, rank == 0 ? 1 : 0, c, nullptr), T3D_NCCL_INVALID_USAGE);
    EXPECT_NE(std::string(f.api.GetLastError(c)).find("root"), std::string::npos) << f.api.GetLastError(c);
    // The communicator still works afterwards.
    EXPECT_EQ(f.api.AllReduce(x, y, 4, T3D_NCCL_FLOAT32, T3D_NCCL_MAX, c, nullptr), T3D_NCCL_SUCCESS);
    // Argument checks.
    EXPECT_EQ(f.api.AllReduce(x, y, 4, 10, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_INVALID_ARGUMENT);
    EXPECT_EQ(f.api.AllReduce(x, y, 4, T3D_NCCL_FLOAT32, 42, c, nullptr), T3D_NCCL_INVALID_ARGUMENT);
    EXPECT_EQ(f.api.Broadcast(x, x, 4, T3D_NCCL_FLOAT32, 3, c, nullptr), T3D_NCCL_INVALID_ARGUMENT);
    EXPECT_EQ(f.api.AllReduce(nullptr, y, 4, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_INVALID_ARGUMENT);
    EXPECT_EQ(f.api.RedOpDestroy(T3D_NCCL_NUM_OPS + 17, c), T3D_NCCL_INVALID_ARGUMENT);
    EXPECT_EQ(f.api.RedOpDestroy(T3D_NCCL_SUM, c), T3D_NCCL_INVALID_ARGUMENT);
    // A send to oneself outside a group could never complete.
    EXPECT_EQ(f.api.Send(x, 1, T3D_NCCL_FLOAT32, rank, c, nullptr), T3D_NCCL_INVALID_USAGE);
    EXPECT_EQ(f.api.GroupEnd(), T3D_NCCL_INVALID_USAGE);  // no group open
  });
}

// A receive of a different size than the send fails on both sides, and a group of other messages still completes.
TEST(FakeNccl, SizeMismatchFailsBothSides) {
  FakeNccl &f = F();
  RunFake(2, [&](int rank, Comm c) {
    int32_t a[3] = {1, 2, 3}, b[3] = {0, 0, 0};
    ASSERT_EQ(f.api.GroupStart(), T3D_NCCL_SUCCESS);
    if (rank == 0) {
      f.api.Send(a, 3, T3D_NCCL_INT32, 1, c, nullptr);
    } else {
      f.api.Recv(b, 2, T3D_NCCL_INT32, 0, c, nullptr);
    }
    EXPECT_EQ(f.api.GroupEnd(), T3D_NCCL_INVALID_USAGE);
    EXPECT_NE(std::string(f.api.GetLastError(c)).find("bytes"), std::string::npos) << f.api.GetLastError(c);
  });
}

// A PreMulSum operator may be destroyed as soon as the call that uses it returns, even inside a group.
TEST(FakeNccl, PremulDestroyedBeforeGroupEnd) {
  FakeNccl &f = F();
  RunFake(2, [&](int rank, Comm c) {
    double s = rank + 2.0, x = 1.0, y = 0;
    t3d_nccl_redop_t op;
    ASSERT_EQ(f.api.RedOpCreatePreMulSum(&op, &s, T3D_NCCL_FLOAT64, T3D_NCCL_SCALAR_HOST_IMMEDIATE, c),
              T3D_NCCL_SUCCESS);
    ASSERT_EQ(f.api.GroupStart(), T3D_NCCL_SUCCESS);
    EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT64, op, c, nullptr), T3D_NCCL_SUCCESS);
    EXPECT_EQ(f.api.RedOpDestroy(op, c), T3D_NCCL_SUCCESS);
    EXPECT_EQ(f.api.GroupEnd(), T3D_NCCL_SUCCESS);
    EXPECT_EQ(y, 5.0);
  });
}

// An abort wakes a peer blocked in a collective; the peer's communicator then reports ncclRemoteError.
TEST(FakeNccl, AbortWakesBlockedPeer) {
  FakeNccl &f = F();
  const int live = f.comms_live();
  // Two raw ranks: rank 0 blocks in an allreduce that rank 1 never joins; rank 1 aborts instead.
  t3d_nccl_unique_id_t id;
  ASSERT_EQ(f.api.GetUniqueId(&id), T3D_NCCL_SUCCESS);
  Comm c0 = nullptr, c1 = nullptr;
  std::thread t0([&] { EXPECT_EQ(f.api.CommInitRankConfig(&c0, 2, id, 0, nullptr), T3D_NCCL_SUCCESS); });
  ASSERT_EQ(f.api.CommInitRankConfig(&c1, 2, id, 1, nullptr), T3D_NCCL_SUCCESS);
  t0.join();
  t3d_nccl_result_t got = T3D_NCCL_SUCCESS;
  std::thread blocked([&] {
    float x = 1, y = 0;
    got = f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c0, nullptr);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const int before = f.aborts();
  EXPECT_EQ(f.api.CommAbort(c1), T3D_NCCL_SUCCESS);
  blocked.join();
  EXPECT_EQ(got, T3D_NCCL_REMOTE_ERROR);
  t3d_nccl_result_t state = T3D_NCCL_SUCCESS;
  EXPECT_EQ(f.api.CommGetAsyncError(c0, &state), T3D_NCCL_SUCCESS);
  EXPECT_EQ(state, T3D_NCCL_REMOTE_ERROR);
  EXPECT_EQ(f.aborts(), before + 1);
  EXPECT_EQ(f.api.CommDestroy(c0), T3D_NCCL_SUCCESS);
  EXPECT_EQ(f.comms_live(), live);
}

// A rank whose peers never come gets an error naming them after FAKE_NCCL_WAIT_MS, instead of hanging.
TEST(FakeNccl, WaitsForPeersTimeOut) {
  ASSERT_EQ(kWaitEnv, 0);
  FakeNccl &f = F();
  std::atomic<bool> done{false};
  RunFake(3, [&](int rank, Comm c) {
    if (rank != 0) {  // alive but absent: a destroyed peer would fail rank 0 at once instead
      while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    float x = 1, y = 0;
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, nullptr), T3D_NCCL_REMOTE_ERROR);
    const std::string err = f.api.GetLastError(c);
    EXPECT_NE(err.find("FAKE_NCCL_WAIT_MS"), std::string::npos) << err;
    EXPECT_NE(err.find("rank(s) 1 2"), std::string::npos) << err;
    EXPECT_EQ(f.api.Recv(&y, 1, T3D_NCCL_FLOAT32, 2, c, nullptr), T3D_NCCL_REMOTE_ERROR);
    EXPECT_NE(std::string(f.api.GetLastError(c)).find("from rank 2"), std::string::npos) << f.api.GetLastError(c);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    EXPECT_GE(took.count(), 2 * 1000 - 100);
    EXPECT_LT(took.count(), 2 * 1000 + 3000);
    done.store(true);
  });
}

// The hooks: streams, injected asynchronous errors, injected call failures, zero-count sends.
TEST(FakeNccl, Hooks) {
  FakeNccl &f = F();
  RunFake(2, [&](int rank, Comm c) {
    void *stream = reinterpret_cast<void *>(static_cast<uintptr_t>(0x1000 + rank));
    float x = 1, y = 0;
    ASSERT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, stream), T3D_NCCL_SUCCESS);
    EXPECT_EQ(f.thread_last_stream(), stream);
    const int zero = f.zero_count_p2p();
    ASSERT_EQ(f.api.GroupStart(), T3D_NCCL_SUCCESS);
    f.api.Send(&x, 0, T3D_NCCL_FLOAT32, 1 - rank, c, stream);
    f.api.Recv(&y, 0, T3D_NCCL_FLOAT32, 1 - rank, c, stream);
    EXPECT_EQ(f.api.GroupEnd(), T3D_NCCL_SUCCESS);
    EXPECT_GE(f.zero_count_p2p(), zero + 2);
    EXPECT_EQ(f.fail_next("ncclAllReduce", T3D_NCCL_UNHANDLED_CUDA_ERROR), 0);
    EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, stream), T3D_NCCL_UNHANDLED_CUDA_ERROR);
    EXPECT_EQ(f.api.AllReduce(&x, &y, 1, T3D_NCCL_FLOAT32, T3D_NCCL_SUM, c, stream), T3D_NCCL_SUCCESS);
  });
  RunFake(1, [&](int, Comm c) {
    f.inject_async_error(T3D_NCCL_REMOTE_ERROR);
    t3d_nccl_result_t state = T3D_NCCL_SUCCESS;
    EXPECT_EQ(f.api.CommGetAsyncError(c, &state), T3D_NCCL_SUCCESS);
    EXPECT_EQ(state, T3D_NCCL_REMOTE_ERROR);
    f.inject_async_error(0);
    EXPECT_EQ(f.api.CommGetAsyncError(c, &state), T3D_NCCL_SUCCESS);
    EXPECT_EQ(state, T3D_NCCL_SUCCESS);
  });
}

}  // namespace
