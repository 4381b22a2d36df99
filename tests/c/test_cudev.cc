// test_cudev.cc: CUDA buffers of ranks that share a device (c_src/cudev/), staged through host memory, against the
// fake CUDA runtime of fake_cudart.c (host memory; a copy lands only when its stream is queried, so a path that
// reads too early sees stale bytes) and the fake NCCL of fake_nccl.c (ranks as threads). Every collective, staged,
// must equal the host path byte for byte (gaps between blocks untouched); point-to-point, standalone and grouped;
// which path a group takes (shared devices, distinct ones, a mix; T3D_CUDA_PATH); and what a failed device copy
// or a missing runtime does. ctest runs it again with T3D_CUDART_LIBRARY naming no file (test_cudev_no_runtime).
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fake_nccl_api.h"
#include "harness.h"

using namespace t3dtest;

namespace {

using Buf = std::vector<unsigned char>;

struct FakeCudart {
  long (*copies_on)(void *) = nullptr;
  long (*pending_on)(void *) = nullptr;
  long (*pinned_live)() = nullptr;
  void *(*thread_last_stream)() = nullptr;
  void (*fail_next)(const char *, void *, int) = nullptr;
  long (*bytes_h2d)() = nullptr;
  long (*bytes_d2h)() = nullptr;
  long (*bytes_d2d)() = nullptr;
  long (*device_live)() = nullptr;
  long (*ipc_open)() = nullptr;
  long (*events_live)() = nullptr;
  int (*enqueue)(void *, void (*)(void *), void *) = nullptr;
  void (*sync)(void *) = nullptr;
  std::string error;
  bool Open(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      error = std::string("dlopen(") + path + ") failed";
      return false;
    }
    bool ok = true;
    auto get = [&](const char *name, void *slot) {
      void *sym = dlsym(lib, name);
      if (!sym) {
        error += std::string(" missing ") + name;
        ok = false;
        return;
      }
      std::memcpy(slot, &sym, sizeof sym);
    };
    get("fake_cudart_copies_on", &copies_on);
    get("fake_cudart_pending_on", &pending_on);
    get("fake_cudart_pinned_live", &pinned_live);
    get("fake_cudart_thread_last_stream", &thread_last_stream);
    get("fake_cudart_fail_next", &fail_next);
    get("fake_cudart_bytes_h2d", &bytes_h2d);
    get("fake_cudart_bytes_d2h", &bytes_d2h);
    get("fake_cudart_bytes_d2d", &bytes_d2d);
    get("fake_cudart_device_live", &device_live);
    get("fake_cudart_ipc_open", &ipc_open);
    get("fake_cudart_events_live", &events_live);
    get("fake_cudart_enqueue", &enqueue);
    get("fake_cudart_sync", &sync);
    return ok;
  }
};

FakeCudart &Cudart() {
  static FakeCudart f;
  return f;
}
FakeNccl &Nccl() {
  static FakeNccl f;
  return f;
}

// Whether this run has no CUDA runtime to load (ctest's test_cudev_no_runtime names a file that does not exist).
bool NoRuntime() {
  const char *v = std::getenv("T3D_CUDART_LIBRARY");
  return v != nullptr && std::strstr(v, "nonexistent") != nullptr;
}

class Env : public ::testing::Environment {
 public:
  void SetUp() override {
    SetEnv("T3D_NCCL_LIBRARY", T3D_FAKE_NCCL_PATH);
    ASSERT_TRUE(Nccl().Open(T3D_FAKE_NCCL_PATH)) << Nccl().error;
    if (!NoRuntime()) {
      SetEnv("T3D_CUDART_LIBRARY", T3D_FAKE_CUDART_PATH);
      ASSERT_TRUE(Cudart().Open(T3D_FAKE_CUDART_PATH)) << Cudart().error;
    }
  }
};
::testing::Environment *const kEnv = ::testing::AddGlobalTestEnvironment(new Env);

void *StreamOf(int rank) { return reinterpret_cast<void *>(static_cast<uintptr_t>(0x5000 + 64 * rank)); }

t3d_opts_t Host(t3d_dtype_t dt) {
  t3d_opts_t o{};
  o.premul_scalar = PremulScalar(dt);
  return o;
}

t3d_opts_t Cuda(t3d_dtype_t dt, int rank, int device) {
  t3d_opts_t o = Host(dt);
  o.memtype = T3D_MEM_CUDA;
  o.device = device;
  o.stream = StreamOf(rank);
  return o;
}

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

// Sets T3D_CUDA_PATH for one scope (read when a communicator is made).
class CudaPath {
 public:
  explicit CudaPath(const char *v) { SetEnv("T3D_CUDA_PATH", v); }
  ~CudaPath() { UnsetEnv("T3D_CUDA_PATH"); }
};

using IssueInto = std::function<t3d_result_t(const t3d_opts_t *, unsigned char *out, t3d_request_t **)>;

// Runs `issue` on the host path into a copy of `init` (the oracle), then on the CUDA path into another copy; the
// CUDA request must name `provider`, leave nothing queued on the rank's stream once complete, and give the same
// bytes (what lies between blocks included).
void Check(t3d_comm_t *comm, int rank, int device, t3d_dtype_t dt, const std::string &what, const Buf &init,
           const IssueInto &issue, const char *provider = "cudev") {
  Buf oracle = init, got = init;
  const t3d_opts_t host = Host(dt), cuda = Cuda(dt, rank, device);
  if (!RunOk(comm, what + " (host)", [&](t3d_request_t **r) { return issue(&host, oracle.data(), r); })) return;
  const long copies = Cudart().copies_on(StreamOf(rank));
  t3d_request_t *req = nullptr;
  ASSERT_EQ(T3D_OK, issue(&cuda, got.data(), &req)) << Tag(rank, what) << ": " << t3d_comm_last_error(comm);
  EXPECT_STREQ(provider, t3d_request_provider(req)) << Tag(rank, what);
  std::string err;
  ASSERT_EQ(T3D_OK, Finish(req, &err)) << Tag(rank, what) << ": " << err;
  EXPECT_EQ(0, Cudart().pending_on(StreamOf(rank))) << Tag(rank, what) << ": completed before its copies ran";
  if (std::strcmp(provider, "cudev") == 0 && init.size() > 64) {
    EXPECT_GT(Cudart().copies_on(StreamOf(rank)), copies) << Tag(rank, what) << ": no copy on the caller's stream";
  }
  EXPECT_EQ("", ByteDiff(got, oracle)) << Tag(rank, what);
}

Buf Filled(t3d_dtype_t dt, int rank, size_t n, t3d_redop_t op = T3D_SUM) {
  Buf b(std::max<size_t>(1, n * t3d_dtype_size(dt)), 0xA5);
  FillInput(dt, op, rank, b.data(), n);
  return b;
}

// How a case is checked: Check (staged: the request completes after its copies) or CheckIpc (the device path).
using CheckFn = std::function<void(t3d_dtype_t, const std::string &, const Buf &, const IssueInto &)>;

// The reductions both paths run: allreduce out of place and in place, reduce (staged only: the device path has
// none), reduce_scatter.
void ReductionCases(t3d_comm_t *comm, int rank, int n, t3d_dtype_t dt, t3d_redop_t op, size_t count, bool reduce,
                    const CheckFn &check) {
  const std::string c = CaseName(dt, op, count);
  const size_t es = t3d_dtype_size(dt);
  const Buf in = Filled(dt, rank, count, op);
  check(dt, "allreduce " + c, Buf(in.size(), 0x5A), [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
    return t3d_allreduce(comm, in.data(), out, count, dt, op, o, r);
  });
  check(dt, "in-place allreduce " + c, in, [&](const t3d_opts_t *o, unsigned char *io, t3d_request_t **r) {
    return t3d_allreduce(comm, io, io, count, dt, op, o, r);
  });
  if (reduce) {
    check(dt, "reduce " + c, Buf(in.size(), 0x5A), [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
      return t3d_reduce(comm, in.data(), out, count, dt, op, n - 1, o, r);
    });
  }
  const Buf big = Filled(dt, rank, count * n, op);
  check(dt, "reduce_scatter " + c, Buf(std::max<size_t>(1, count * es), 0x5A),
        [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
          return t3d_reduce_scatter(comm, big.data(), out, count, dt, op, o, r);
        });
}

// The moves both paths run: broadcast, alltoall, and allgatherv with uneven blocks and a gap after each (the gaps
// must keep their bytes).
void MoveCases(t3d_comm_t *comm, int rank, int n, t3d_dtype_t dt, size_t base, const CheckFn &check) {
  const std::string c = std::string(t3d_dtype_name(dt)) + " x" + std::to_string(base);
  const size_t es = t3d_dtype_size(dt);
  Buf mine(std::max<size_t>(1, base * es));
  FillPattern(dt, rank, mine.data(), base);
  check(dt, "broadcast " + c, mine, [&](const t3d_opts_t *o, unsigned char *io, t3d_request_t **r) {
    return t3d_broadcast(comm, io, base, dt, 1 % n, o, r);
  });
  Buf all(std::max<size_t>(1, base * es * n));
  FillPattern(dt, rank, all.data(), base * n);
  check(dt, "alltoall " + c, Buf(all.size(), 0x5A), [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
    return t3d_alltoall(comm, all.data(), out, base, dt, o, r);
  });
  std::vector<size_t> counts, displs;
  const size_t span = AllgathervLayout(n, base, &counts, &displs);
  Buf part(std::max<size_t>(1, counts[rank] * es));
  FillPattern(dt, rank, part.data(), counts[rank]);
  check(dt, "allgatherv " + c, Buf(std::max<size_t>(1, span * es), 0x5A),
        [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
          return t3d_allgatherv(comm, part.data(), counts[rank], out, counts.data(), displs.data(), dt, o, r);
        });
}

CheckFn Staged(t3d_comm_t *comm, int rank) {
  return [=](t3d_dtype_t dt, const std::string &what, const Buf &init, const IssueInto &issue) {
    Check(comm, rank, 0, dt, what, init, issue);
  };
}

class Shared : public ::testing::TestWithParam<int> {};

TEST_P(Shared, ReductionsMatchTheHostPath) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int n = GetParam();
  const int created = Nccl().comms_created();
  const long pinned = Cudart().pinned_live();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dts[] = {T3D_FLOAT32, T3D_BFLOAT16, T3D_INT64, T3D_COMPLEX64};
    const t3d_redop_t ops[] = {T3D_SUM, T3D_AVG, T3D_MAX, T3D_PREMUL_SUM, T3D_BXOR};
    for (t3d_dtype_t dt : dts) {
      for (t3d_redop_t op : ops) {
        if (t3d_redop_supported(op, dt) != T3D_OK) continue;
        std::vector<size_t> counts = {0, 7};
        if (dt == T3D_FLOAT32 && op == T3D_SUM) counts.push_back(100003);
        for (size_t count : counts) {
          ReductionCases(comm, rank, n, dt, op, count, true, Staged(comm, rank));
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  });
  EXPECT_EQ(created, Nccl().comms_created()) << "ranks that share a device must not reach NCCL";
  EXPECT_EQ(pinned, Cudart().pinned_live()) << "the staging buffer must be freed with its communicator";
}

TEST_P(Shared, MovesMatchTheHostPath) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_INT8}) {
      for (size_t base : {size_t(0), size_t(5), size_t(40000)}) {
        MoveCases(comm, rank, n, dt, base, Staged(comm, rank));
        const std::string c = std::string(t3d_dtype_name(dt)) + " x" + std::to_string(base);
        const size_t es = t3d_dtype_size(dt);
        Buf mine(std::max<size_t>(1, base * es));
        FillPattern(dt, rank, mine.data(), base);
        Check(comm, rank, 0, dt, "gather " + c, Buf(std::max<size_t>(1, base * es * n), 0x5A),
              [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                return t3d_gather(comm, mine.data(), out, base, dt, 0, o, r);
              });
        Buf all(std::max<size_t>(1, base * es * n));
        FillPattern(dt, rank, all.data(), base * n);
        Check(comm, rank, 0, dt, "scatter " + c, Buf(mine.size(), 0x5A),
              [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                return t3d_scatter(comm, all.data(), out, base, dt, n - 1, o, r);
              });
        const A2aLayout a = AlltoallvLayout(n, rank, base);
        Buf send(std::max<size_t>(1, a.s_total * es));
        FillPattern(dt, rank, send.data(), a.s_total);
        Check(comm, rank, 0, dt, "alltoallv " + c, Buf(std::max<size_t>(1, a.r_total * es), 0x5A),
              [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                return t3d_alltoallv(comm, send.data(), a.sc.data(), a.sd.data(), out, a.rc.data(), a.rd.data(), dt,
                                     o, r);
              });
        if (::testing::Test::HasFailure()) return;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Shared, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int> &i) { return "n" + std::to_string(i.param); });

// Sends and receives: a ring shift (standalone: each rank sends first, then receives; the send completes once its
// host send is posted, so this does not deadlock even when the message is too large for a slot), then the same
// inside a group, then a receive into a larger buffer.
TEST(Cudev, PointToPoint) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int n = 3;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const int to = (rank + 1) % n, from = (rank + n - 1) % n;
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    for (size_t count : {size_t(1), size_t(300000)}) {
      std::vector<float> out(count), in(count + 8, -1.0f);
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<float>(rank * 1000003 + i);
      for (int grouped = 0; grouped < 2; ++grouped) {
        const std::string what = (grouped ? "grouped ring shift x" : "ring shift x") + std::to_string(count);
        std::fill(in.begin(), in.end(), -1.0f);
        t3d_request_t *s = nullptr, *r = nullptr, *g = nullptr;
        if (grouped) {
          ASSERT_EQ(T3D_OK, t3d_group_start(comm));
        }
        ASSERT_EQ(T3D_OK, t3d_send(comm, out.data(), count, T3D_FLOAT32, to, 3, &cuda, &s)) << Tag(rank, what);
        ASSERT_EQ(T3D_OK, t3d_recv(comm, in.data(), count + 8, T3D_FLOAT32, from, 3, &cuda, &r)) << Tag(rank, what);
        if (grouped) {
          ASSERT_EQ(T3D_OK, t3d_group_end(comm, &g));
        }
        EXPECT_STREQ("cudev", t3d_request_provider(s)) << Tag(rank, what);
        std::string err;
        if (g != nullptr) {
          ASSERT_EQ(T3D_OK, Finish(g, &err)) << Tag(rank, what) << ": " << err;
        }
        EXPECT_EQ(T3D_OK, t3d_wait(r, TestTimeoutMs())) << Tag(rank, what);
        EXPECT_EQ(from, t3d_request_source(r)) << Tag(rank, what);
        EXPECT_EQ(count, t3d_request_count(r)) << Tag(rank, what);
        t3d_request_free(r);
        ASSERT_EQ(T3D_OK, Finish(s, &err)) << Tag(rank, what) << ": " << err;
        EXPECT_EQ(0, Cudart().pending_on(StreamOf(rank))) << Tag(rank, what);
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(static_cast<float>(from * 1000003 + i), in[i]) << Tag(rank, what) << " at " << i;
        }
        for (size_t i = count; i < count + 8; ++i) ASSERT_EQ(-1.0f, in[i]) << Tag(rank, what) << ": past the message";
        if (!grouped) {
          EXPECT_EQ(StreamOf(rank), Cudart().thread_last_stream()) << Tag(rank, what);
        }
      }
    }
  });
}

// Which path: distinct devices keep NCCL; a mix stages the collectives and the pairs that share a device, and gives
// NCCL the pairs that do not.
TEST(Cudev, DistinctDevicesKeepNccl) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int created = Nccl().comms_created();
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    const Buf in = Filled(T3D_FLOAT32, rank, 64);
    Check(comm, rank, rank, T3D_FLOAT32, "allreduce on distinct devices", Buf(in.size(), 0),
          [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
            return t3d_allreduce(comm, in.data(), out, 64, T3D_FLOAT32, T3D_SUM, o, r);
          }, "nccl");
  });
  EXPECT_GT(Nccl().comms_created(), created);
}

TEST(Cudev, MixedDevicesChooseByPair) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  RunRanks(4, [&](int rank, t3d_comm_t *comm) {
    const int dev = rank / 2; // ranks 0, 1 on device 0; 2, 3 on device 1
    const Buf in = Filled(T3D_FLOAT32, rank, 100);
    Check(comm, rank, dev, T3D_FLOAT32, "allreduce on a mix", Buf(in.size(), 0),
          [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
            return t3d_allreduce(comm, in.data(), out, 100, T3D_FLOAT32, T3D_SUM, o, r);
          });
    // 0 -> 2 crosses devices (NCCL); 1 -> 0 shares one (staged).
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, dev);
    std::vector<float> v(32, static_cast<float>(rank + 1)), got(32, 0.0f);
    t3d_request_t *q = nullptr;
    if (rank == 0 || rank == 1) {
      ASSERT_EQ(T3D_OK, t3d_send(comm, v.data(), 32, T3D_FLOAT32, rank == 0 ? 2 : 0, 1, &cuda, &q));
      EXPECT_STREQ(rank == 0 ? "nccl" : "cudev", t3d_request_provider(q)) << Tag(rank, "send");
      ASSERT_EQ(T3D_OK, Finish(q));
    }
    if (rank == 2 || rank == 0) {
      ASSERT_EQ(T3D_OK, t3d_recv(comm, got.data(), 32, T3D_FLOAT32, rank == 2 ? 0 : 1, 1, &cuda, &q));
      EXPECT_STREQ(rank == 2 ? "nccl" : "cudev", t3d_request_provider(q)) << Tag(rank, "recv");
      ASSERT_EQ(T3D_OK, Finish(q));
      EXPECT_EQ(rank == 2 ? 1.0f : 2.0f, got[31]) << Tag(rank, "recv");
    }
  });
}

TEST(Cudev, CudaPathOverrides) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  {
    CudaPath p("nccl");
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const Buf in = Filled(T3D_FLOAT32, rank, 16);
      Check(comm, rank, 0, T3D_FLOAT32, "T3D_CUDA_PATH=nccl", Buf(in.size(), 0),
            [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out, 16, T3D_FLOAT32, T3D_SUM, o, r);
            }, "nccl");
    });
  }
  {
    CudaPath p("staged");
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const Buf in = Filled(T3D_FLOAT32, rank, 16);
      Check(comm, rank, rank, T3D_FLOAT32, "T3D_CUDA_PATH=staged", Buf(in.size(), 0),
            [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out, 16, T3D_FLOAT32, T3D_SUM, o, r);
            });
    });
  }
  CudaPath p("bogus");
  MemStore store;
  t3d_comm_t *comm = nullptr;
  EXPECT_EQ(T3D_ERR_INVALID_ARG, t3d_comm_init(&comm, 0, 1, store.store(), nullptr));
  EXPECT_EQ(nullptr, comm);
  const std::string err = t3d_thread_last_error();
  EXPECT_NE(std::string::npos, err.find("T3D_CUDA_PATH='bogus'")) << err;
  EXPECT_NE(std::string::npos, err.find("rank 0")) << err;
}

// A device copy that fails on one rank fails its collective with the runtime's words, and breaks the group, so the
// peer's wait ends at once instead of at its timeout.
TEST(Cudev, FailedCopyBreaksTheGroup) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  RunOptions ro;
  ro.comm_timeout_ms = 60000;
  ro.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(1000, 1.0f), out(1000, 0.0f);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    if (rank == 0) Cudart().fail_next("cudaMemcpyAsync", StreamOf(0), 1);
    if (!HostBarrier()) return;
    const auto t0 = std::chrono::steady_clock::now();
    std::string err;
    const t3d_result_t res = RunResult(
        [&](t3d_request_t **r) {
          return t3d_allreduce(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, T3D_SUM, &cuda, r);
        },
        &err);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(T3D_OK, res) << Tag(rank, "allreduce after a failed copy");
    EXPECT_LT(s, 20.0) << Tag(rank, "the failure must reach the peer before its timeout");
    if (rank == 0) {
      EXPECT_EQ(T3D_ERR_TRANSPORT, res) << err;
      EXPECT_NE(std::string::npos, err.find("cudaMemcpyAsync")) << err;
      EXPECT_NE(std::string::npos, err.find("invalid argument")) << err;
      EXPECT_NE(std::string::npos, err.find("rank 0")) << err;
      EXPECT_NE(std::string::npos, err.find("staged")) << err;
    } else {
      EXPECT_NE(std::string::npos, err.find("rank 0")) << err;
    }
  }, ro);
}

// ---------- the device path (T3D_CUDA_PATH=ipc, c_src/cudev/ipc.c) ----------

// The tests' stand-in for reduce_cuda.cu: the same contract, run on the host when the fake stream reaches it.
struct HostReduce {
  void *dst;
  std::vector<const void *> srcs;
  size_t count;
  t3d_dtype_t dt;
  t3d_redop_t op;
  double scalar;
};

float Bf16ToFloat(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T, typename A, typename Get, typename Put>
void ReduceOnHost(const HostReduce &h, Get get, Put put) {
  const int n = static_cast<int>(h.srcs.size());
  for (size_t i = 0; i < h.count; ++i) {
    A acc = get(static_cast<const T *>(h.srcs[0])[i]);
    if (h.op == T3D_PREMUL_SUM) acc = acc * static_cast<A>(h.scalar);
    for (int k = 1; k < n; ++k) {
      const A v = get(static_cast<const T *>(h.srcs[k])[i]);
      switch (h.op) {
        case T3D_PROD: acc = acc * v; break;
        case T3D_MIN: acc = std::min(acc, v); break;
        case T3D_MAX: acc = std::max(acc, v); break;
        case T3D_PREMUL_SUM: acc = acc + v * static_cast<A>(h.scalar); break;
        default: acc = acc + v; break;
      }
    }
    if (h.op == T3D_AVG) acc = acc / static_cast<A>(n);
    static_cast<T *>(h.dst)[i] = put(acc);
  }
}

void RunHostReduce(void *arg) {
  std::unique_ptr<HostReduce> h(static_cast<HostReduce *>(arg));
  switch (h->dt) {
    case T3D_FLOAT32:
      ReduceOnHost<float, float>(*h, [](float v) { return v; }, [](float v) { return v; });
      break;
    case T3D_BFLOAT16:
      ReduceOnHost<uint16_t, float>(*h, Bf16ToFloat, FloatToBf16);
      break;
    default:
      ReduceOnHost<int64_t, int64_t>(*h, [](int64_t v) { return v; }, [](int64_t v) { return v; });
      break;
  }
}

int HostReduceSupported(t3d_dtype_t dt, t3d_redop_t op) {
  if (dt != T3D_FLOAT32 && dt != T3D_BFLOAT16 && dt != T3D_INT64) return 0;
  if (op == T3D_PREMUL_SUM) return dt != T3D_INT64;
  return op == T3D_SUM || op == T3D_PROD || op == T3D_MIN || op == T3D_MAX || op == T3D_AVG;
}

int HostReduceQueue(void *dst, const void *const *srcs, int n, size_t count, t3d_dtype_t dt, t3d_redop_t op,
                    double scalar, void *stream) {
  auto *h = new HostReduce{dst, std::vector<const void *>(srcs, srcs + n), count, dt, op, scalar};
  const int e = Cudart().enqueue(stream, RunHostReduce, h);
  if (e != 0) delete h;
  return e;
}

const t3d_cuda_kernels_t kHostKernels = {HostReduceSupported, HostReduceQueue};

// Sets an environment variable for one scope.
class EnvScope {
 public:
  EnvScope(const char *name, const char *v) : name_(name) { SetEnv(name, v); }
  ~EnvScope() { UnsetEnv(name_); }

 private:
  const char *name_;
};

// Registers the stand-in kernels for one scope.
class Kernels {
 public:
  explicit Kernels(bool on) { t3d_cuda_set_kernels(on ? &kHostKernels : nullptr); }
  ~Kernels() { t3d_cuda_set_kernels(nullptr); }
};

// Check for the device path: the request completes once its work is queued, so the stream is run first (what a
// later kernel on the stream would see), then compared with the host path.
void CheckIpc(t3d_comm_t *comm, int rank, t3d_dtype_t dt, const std::string &what, const Buf &init,
              const IssueInto &issue) {
  Buf oracle = init, got = init;
  const t3d_opts_t host = Host(dt), cuda = Cuda(dt, rank, 0);
  if (!RunOk(comm, what + " (host)", [&](t3d_request_t **r) { return issue(&host, oracle.data(), r); })) return;
  t3d_request_t *req = nullptr;
  ASSERT_EQ(T3D_OK, issue(&cuda, got.data(), &req)) << Tag(rank, what) << ": " << t3d_comm_last_error(comm);
  EXPECT_STREQ("cudev", t3d_request_provider(req)) << Tag(rank, what);
  std::string err;
  ASSERT_EQ(T3D_OK, Finish(req, &err)) << Tag(rank, what) << ": " << err;
  Cudart().sync(StreamOf(rank));
  EXPECT_EQ("", ByteDiff(got, oracle)) << Tag(rank, what);
}

struct Counters {
  long h2d, d2h, d2d, device, ipc, events;
  static Counters Now() {
    return {Cudart().bytes_h2d(), Cudart().bytes_d2h(), Cudart().bytes_d2d(), Cudart().device_live(),
            Cudart().ipc_open(), Cudart().events_live()};
  }
};

// Ranks, and how they wait for each other's device work (T3D_CUDA_IPC_WAIT).
class Ipc : public ::testing::TestWithParam<std::pair<int, const char *>> {};

// Every collective the device path runs, at 2-4 ranks: the same bytes as the host path, nothing staged through
// host memory, and every device buffer, mapping and event released with the communicators.
TEST_P(Ipc, MatchesTheHostPath) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int n = GetParam().first;
  CudaPath path("ipc");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  EnvScope wait("T3D_CUDA_IPC_WAIT", GetParam().second);
  Kernels k(true);
  const Counters before = Counters::Now();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const CheckFn ipc = [=](t3d_dtype_t dt, const std::string &what, const Buf &init, const IssueInto &issue) {
      CheckIpc(comm, rank, dt, what, init, issue);
    };
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_BFLOAT16, T3D_INT64}) {
      for (t3d_redop_t op : {T3D_SUM, T3D_AVG, T3D_MAX, T3D_PREMUL_SUM}) {
        if (t3d_redop_supported(op, dt) != T3D_OK || !HostReduceSupported(dt, op)) continue;
        std::vector<size_t> counts = {0, 7};
        if (dt == T3D_FLOAT32 && op == T3D_SUM) counts.push_back(300007); // past the first buffer: it grows
        for (size_t count : counts) {
          ReductionCases(comm, rank, n, dt, op, count, false, ipc);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
    for (t3d_dtype_t dt : {T3D_FLOAT32, T3D_INT8}) {
      for (size_t base : {size_t(0), size_t(5), size_t(40000)}) {
        MoveCases(comm, rank, n, dt, base, ipc);
        if (::testing::Test::HasFailure()) return;
      }
    }
  });
  const Counters after = Counters::Now();
  EXPECT_EQ(before.h2d, after.h2d) << "the device path must not stage through host memory";
  EXPECT_EQ(before.d2h, after.d2h) << "the device path must not stage through host memory";
  EXPECT_GT(after.d2d, before.d2d) << "no device-to-device copy: the device path did not run";
  EXPECT_EQ(before.device, after.device) << "device buffers must be freed with their communicator";
  EXPECT_EQ(before.ipc, after.ipc) << "IPC mappings must be closed with their communicator";
  EXPECT_EQ(before.events, after.events) << "events must be destroyed with their communicator";
}

INSTANTIATE_TEST_SUITE_P(Ranks, Ipc,
                         ::testing::Values(std::make_pair(2, "device"), std::make_pair(3, "device"),
                                           std::make_pair(4, "device"), std::make_pair(3, "host")),
                         [](const ::testing::TestParamInfo<std::pair<int, const char *>> &i) {
                           return "n" + std::to_string(i.param.first) + "_" + i.param.second;
                         });

// Many collectives queued back to back before any stream runs: each rank's buffer is rewritten by the next one
// only after every peer has read it (the `done` events), and read only after its owner filled it (`copied`).
// Sizes change on the way, so buffers grow while older work still reads the old ones.
class IpcWait : public ::testing::TestWithParam<const char *> {};

TEST_P(IpcWait, BackToBackInStreamOrder) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  const int n = 3;
  CudaPath path("ipc");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  EnvScope wait("T3D_CUDA_IPC_WAIT", GetParam());
  Kernels k(true);
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    const std::vector<size_t> counts = {10, 400000, 3, 700000, 10, 1};
    std::vector<std::vector<float>> in(counts.size()), out(counts.size());
    std::vector<t3d_request_t *> reqs(counts.size(), nullptr);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    for (size_t j = 0; j < counts.size(); ++j) {
      in[j].resize(counts[j]);
      out[j].assign(counts[j], -1.0f);
      for (size_t i = 0; i < counts[j]; ++i) in[j][i] = static_cast<float>((rank + 1) * (j + 1) + i % 97);
      ASSERT_EQ(T3D_OK, t3d_allreduce(comm, in[j].data(), out[j].data(), counts[j], T3D_FLOAT32, T3D_SUM, &cuda,
                                      &reqs[j]));
    }
    for (t3d_request_t *r : reqs) ASSERT_EQ(T3D_OK, Finish(r)) << Tag(rank, "back-to-back allreduce");
    // Every rank has queued everything before any stream runs.
    if (!HostBarrier()) return;
    Cudart().sync(StreamOf(rank));
    for (size_t j = 0; j < counts.size(); ++j) {
      for (size_t i = 0; i < counts[j]; ++i) {
        float want = 0.0f;
        for (int p = 0; p < n; ++p) want += static_cast<float>((p + 1) * (j + 1) + i % 97);
        ASSERT_EQ(want, out[j][i]) << Tag(rank, "allreduce #" + std::to_string(j) + " at " + std::to_string(i));
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Waits, IpcWait, ::testing::Values("device", "host"));

// What the device path cannot run is staged, the same on every rank: reductions without a registered kernel or
// with a (dtype, op) it lacks, and alltoallv with uneven blocks.
TEST(CudevIpc, StagesWhatTheDeviceCannot) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  CudaPath path("ipc");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  for (bool registered : {false, true}) {
    Kernels k(registered);
    const long h2d = Cudart().bytes_h2d();
    RunRanks(3, [&](int rank, t3d_comm_t *comm) {
      const t3d_dtype_t dt = registered ? T3D_INT64 : T3D_FLOAT32;
      const t3d_redop_t op = registered ? T3D_BXOR : T3D_SUM;
      const Buf in = Filled(dt, rank, 50, op);
      Check(comm, rank, 0, dt, std::string(registered ? "BXOR" : "no kernel") + " allreduce", Buf(in.size(), 0),
            [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out, 50, dt, op, o, r);
            });
      const A2aLayout a = AlltoallvLayout(3, rank, 1000);
      Buf send(a.s_total * 4);
      FillPattern(T3D_FLOAT32, rank, send.data(), a.s_total);
      Check(comm, rank, 0, T3D_FLOAT32, "uneven alltoallv", Buf(std::max<size_t>(1, a.r_total * 4), 0x5A),
            [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
              return t3d_alltoallv(comm, send.data(), a.sc.data(), a.sd.data(), out, a.rc.data(), a.rd.data(),
                                   T3D_FLOAT32, o, r);
            });
    });
    EXPECT_GT(Cudart().bytes_h2d(), h2d) << "staged collectives copy through host memory";
  }
}

// Below T3D_CUDA_IPC_MIN_BYTES (1 MiB by default) collectives stay staged, where one call of the device path costs
// more; from there on they run on the device.
TEST(CudevIpc, SmallCollectivesStayStaged) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  CudaPath path("ipc");
  Kernels k(true);
  for (size_t count : {size_t(1000), size_t(300000)}) {
    const bool device = count * 4 >= (1u << 20);
    const Counters before = Counters::Now();
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const Buf in = Filled(T3D_FLOAT32, rank, count);
      const std::string what = "allreduce of " + std::to_string(count * 4) + " bytes";
      const IssueInto issue = [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
        return t3d_allreduce(comm, in.data(), out, count, T3D_FLOAT32, T3D_SUM, o, r);
      };
      if (device) CheckIpc(comm, rank, T3D_FLOAT32, what, Buf(in.size(), 0), issue);
      else Check(comm, rank, 0, T3D_FLOAT32, what, Buf(in.size(), 0), issue);
    });
    const Counters after = Counters::Now();
    EXPECT_EQ(device, after.d2d > before.d2d) << count * 4 << " bytes";
    EXPECT_EQ(!device, after.h2d > before.h2d) << count * 4 << " bytes";
  }
}

// A communicator freed while its device work is still queued first lets that work finish (its reads of the peers'
// buffers, and theirs of its own), so no buffer is freed before the last read of it.
TEST(CudevIpc, FreeWaitsForQueuedReads) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  CudaPath path("ipc");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  Kernels k(true);
  const size_t count = 1000;
  std::vector<std::vector<float>> in(2, std::vector<float>(count)), out(2, std::vector<float>(count, -1.0f));
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    for (size_t i = 0; i < count; ++i) in[rank][i] = static_cast<float>(rank + 1 + i);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    t3d_request_t *r = nullptr;
    ASSERT_EQ(T3D_OK, t3d_allreduce(comm, in[rank].data(), out[rank].data(), count, T3D_FLOAT32, T3D_SUM, &cuda, &r));
    ASSERT_EQ(T3D_OK, Finish(r));
    // No stream is run here: the communicator is freed with the work queued.
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(0, Cudart().pending_on(StreamOf(rank))) << Tag(rank, "work left queued after its communicator");
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(static_cast<float>(3 + 2 * i), out[rank][i]) << Tag(rank, "at " + std::to_string(i));
    }
  }
}

TEST(CudevIpc, UnknownWaitIsRefused) {
  EnvScope wait("T3D_CUDA_IPC_WAIT", "gpu");
  MemStore store;
  t3d_comm_t *comm = nullptr;
  EXPECT_EQ(T3D_ERR_INVALID_ARG, t3d_comm_init(&comm, 0, 1, store.store(), nullptr));
  EXPECT_EQ(nullptr, comm);
  const std::string err = t3d_thread_last_error();
  EXPECT_NE(std::string::npos, err.find("T3D_CUDA_IPC_WAIT='gpu'")) << err;
  EXPECT_NE(std::string::npos, err.find("rank 0")) << err;
}

// A peer's buffer that cannot be mapped fails the collective with the runtime's words and the way out.
TEST(CudevIpc, FailedMappingSaysWhy) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  CudaPath path("ipc");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  Kernels k(true);
  RunOptions ro;
  ro.comm_timeout_ms = 60000;
  ro.abort_on_failure = false;
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(100, 1.0f), out(100, 0.0f);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    if (rank == 0) Cudart().fail_next("cudaIpcOpenMemHandle", nullptr, 1); // the next one, on either rank
    if (!HostBarrier()) return;
    std::string err;
    const t3d_result_t res = RunResult(
        [&](t3d_request_t **r) {
          return t3d_allreduce(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, T3D_SUM, &cuda, r);
        },
        &err);
    EXPECT_NE(T3D_OK, res) << Tag(rank, "allreduce after a failed mapping");
    // What the rank that mapped its peer had queued (its input's copy) runs before the input goes away.
    Cudart().sync(StreamOf(rank));
    // Whichever rank's mapping failed (both map at once), the other's error quotes it: the group is broken.
    EXPECT_NE(std::string::npos, err.find("cudaIpcOpenMemHandle")) << Tag(rank, err);
    EXPECT_NE(std::string::npos, err.find("T3D_CUDA_PATH=staged")) << Tag(rank, err);
    EXPECT_NE(std::string::npos, err.find("device path")) << Tag(rank, err);
  }, ro);
}

// T3D_CUDA_PATH=auto (the default) runs the collectives of ranks that share a device on the device path from
// T3D_CUDA_IPC_MIN_BYTES on; T3D_CUDA_PATH=staged keeps every one of them on the host.
TEST(CudevIpc, AutoTakesTheDevicePathStagedDoesNot) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  Kernels k(true);
  const size_t count = 300000; // 1.2 MB: past the default 1 MiB
  for (const char *name : {"auto", "staged"}) {
    CudaPath path(name);
    const bool device = std::string(name) == "auto";
    const Counters before = Counters::Now();
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const Buf in = Filled(T3D_FLOAT32, rank, count);
      const std::string what = std::string("T3D_CUDA_PATH=") + name + " allreduce";
      const IssueInto issue = [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
        return t3d_allreduce(comm, in.data(), out, count, T3D_FLOAT32, T3D_SUM, o, r);
      };
      if (device) CheckIpc(comm, rank, T3D_FLOAT32, what, Buf(in.size(), 0), issue);
      else Check(comm, rank, 0, T3D_FLOAT32, what, Buf(in.size(), 0), issue);
    });
    const Counters after = Counters::Now();
    EXPECT_EQ(device, after.d2d > before.d2d) << name;
    EXPECT_EQ(!device, after.h2d > before.h2d) << name;
  }
}

// Where CUDA IPC fails on one rank (an event, a handle or a mapping that its runtime refuses), T3D_CUDA_PATH=auto
// stages that collective and every later one of the communicator, on every rank alike, with the right bytes (Check:
// complete means done, as staged), and releases what it had made.
class IpcFails : public ::testing::TestWithParam<const char *> {};

TEST_P(IpcFails, AutoStagesFromThenOn) {
  if (NoRuntime()) GTEST_SKIP() << "no CUDA runtime in this run";
  CudaPath path("auto");
  EnvScope every_size("T3D_CUDA_IPC_MIN_BYTES", "0");
  Kernels k(true);
  const Counters before = Counters::Now();
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    if (rank == 1) Cudart().fail_next(GetParam(), nullptr, 1); // the next such call, on whichever rank
    if (!HostBarrier()) return;
    for (size_t count : {size_t(100), size_t(5000), size_t(7)}) {
      const Buf in = Filled(T3D_FLOAT32, rank, count);
      Check(comm, rank, 0, T3D_FLOAT32, "allreduce of " + std::to_string(count) + " after " + GetParam() + " failed",
            Buf(in.size(), 0), [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
              return t3d_allreduce(comm, in.data(), out, count, T3D_FLOAT32, T3D_SUM, o, r);
            });
      if (::testing::Test::HasFailure()) return;
    }
  });
  const Counters after = Counters::Now();
  EXPECT_GT(after.h2d, before.h2d) << "staged collectives copy through host memory";
  EXPECT_EQ(before.device, after.device) << "device buffers must be freed with their communicator";
  EXPECT_EQ(before.ipc, after.ipc) << "IPC mappings must be closed with their communicator";
  EXPECT_EQ(before.events, after.events) << "events must be destroyed with their communicator";
}

INSTANTIATE_TEST_SUITE_P(Calls, IpcFails,
                         ::testing::Values("cudaEventCreateWithFlags", "cudaIpcGetEventHandle", "cudaIpcGetMemHandle",
                                           "cudaIpcOpenEventHandle", "cudaIpcOpenMemHandle"));

// Without a CUDA runtime (test_cudev_no_runtime): ranks that share a device cannot be told apart, so NCCL gets the
// call (and says what it thinks); T3D_CUDA_PATH=staged fails with the loader's words instead of crashing.
TEST(CudevNoRuntime, FallsBackOrSaysWhy) {
  if (!NoRuntime()) GTEST_SKIP() << "only with T3D_CUDART_LIBRARY naming no file";
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(8, 1.0f), out(8, 0.0f);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    t3d_request_t *r = nullptr;
    ASSERT_EQ(T3D_OK, t3d_allreduce(comm, in.data(), out.data(), 8, T3D_FLOAT32, T3D_SUM, &cuda, &r));
    EXPECT_STREQ("nccl", t3d_request_provider(r));
    ASSERT_EQ(T3D_OK, Finish(r));
  });
  CudaPath p("staged");
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(8, 1.0f), out(8, 0.0f);
    const t3d_opts_t cuda = Cuda(T3D_FLOAT32, rank, 0);
    std::string err;
    const t3d_result_t res = RunResult(
        [&](t3d_request_t **r) { return t3d_allreduce(comm, in.data(), out.data(), 8, T3D_FLOAT32, T3D_SUM, &cuda, r); },
        &err);
    EXPECT_EQ(T3D_ERR_UNSUPPORTED, res) << err;
    EXPECT_NE(std::string::npos, err.find("cannot load the CUDA runtime")) << err;
    EXPECT_NE(std::string::npos, err.find("T3D_CUDART_LIBRARY")) << err;
  });
}

}  // namespace
