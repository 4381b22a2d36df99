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
#include <string>
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
        const size_t es = t3d_dtype_size(dt);
        for (size_t count : counts) {
          const std::string c = CaseName(dt, op, count);
          const Buf in = Filled(dt, rank, count, op);
          Check(comm, rank, 0, dt, "allreduce " + c, Buf(in.size(), 0x5A),
                [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                  return t3d_allreduce(comm, in.data(), out, count, dt, op, o, r);
                });
          Check(comm, rank, 0, dt, "in-place allreduce " + c, in,
                [&](const t3d_opts_t *o, unsigned char *io, t3d_request_t **r) {
                  return t3d_allreduce(comm, io, io, count, dt, op, o, r);
                });
          Check(comm, rank, 0, dt, "reduce " + c, Buf(in.size(), 0x5A),
                [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                  return t3d_reduce(comm, in.data(), out, count, dt, op, n - 1, o, r);
                });
          const Buf big = Filled(dt, rank, count * n, op);
          Check(comm, rank, 0, dt, "reduce_scatter " + c, Buf(std::max<size_t>(1, count * es), 0x5A),
                [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                  return t3d_reduce_scatter(comm, big.data(), out, count, dt, op, o, r);
                });
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
        const std::string c = std::string(t3d_dtype_name(dt)) + " x" + std::to_string(base);
        const size_t es = t3d_dtype_size(dt);
        Buf mine(std::max<size_t>(1, base * es));
        FillPattern(dt, rank, mine.data(), base);
        Check(comm, rank, 0, dt, "broadcast " + c, mine,
              [&](const t3d_opts_t *o, unsigned char *io, t3d_request_t **r) {
                return t3d_broadcast(comm, io, base, dt, 1 % n, o, r);
              });
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
        Check(comm, rank, 0, dt, "alltoall " + c, Buf(all.size(), 0x5A),
              [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                return t3d_alltoall(comm, all.data(), out, base, dt, o, r);
              });
        // Uneven blocks with a gap after each: the gaps must keep their bytes.
        std::vector<size_t> counts, displs;
        const size_t span = AllgathervLayout(n, base, &counts, &displs);
        Buf part(std::max<size_t>(1, counts[rank] * es));
        FillPattern(dt, rank, part.data(), counts[rank]);
        Check(comm, rank, 0, dt, "allgatherv " + c, Buf(std::max<size_t>(1, span * es), 0x5A),
              [&](const t3d_opts_t *o, unsigned char *out, t3d_request_t **r) {
                return t3d_allgatherv(comm, part.data(), counts[rank], out, counts.data(), displs.data(), dt, o, r);
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
