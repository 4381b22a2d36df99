// test_provider.cc: which provider the engine chooses (core/select.c): shared memory for a same-host group's host
// collectives and point-to-point, UCX with T3D_TRANSPORT=ucx and for gather / scatter, and what T3D_PROVIDERS
// changes. ctest runs this binary twice: as is, and with T3D_PROVIDERS=ucx (test_provider_ucx_only); each case
// reads the variable to know which answer is right.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

bool UcxOnly() {
  const char *v = std::getenv("T3D_PROVIDERS");
  return v != nullptr && std::strcmp(v, "ucx") == 0;
}

// Issues op, checks the provider its request names, waits for it.
template <typename Fn>
void Expect(const char *want, const std::string &what, int rank, Fn op) {
  t3d_request_t *r = nullptr;
  ASSERT_EQ(T3D_OK, op(&r)) << what << " on rank " << rank;
  EXPECT_STREQ(want, t3d_request_provider(r)) << what << " on rank " << rank;
  std::string err;
  EXPECT_EQ(T3D_OK, Finish(r, &err)) << what << " on rank " << rank << ": " << err;
}

TEST(Provider, SameHostGroupChoosesByKind) {
  if (UcxOnly() && !HasUcx()) GTEST_SKIP() << "T3D_PROVIDERS=ucx needs UCX";
  const char *coll = UcxOnly() ? "ucx" : "shm";
  // Gather and scatter move each block once over UCX; without UCX the segment carries them.
  const char *rooted = UcxOnly() || HasUcx() ? "ucx" : "shm";
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(1 << 16, 1.0f), out(in.size() * 3);
    Expect(coll, "allreduce", rank, [&](t3d_request_t **r) {
      return t3d_allreduce(comm, in.data(), in.data(), in.size(), T3D_FLOAT32, T3D_SUM, nullptr, r);
    });
    EXPECT_EQ(3.0f, in[0]);
    Expect(coll, "allgather", rank, [&](t3d_request_t **r) {
      return t3d_allgather(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, nullptr, r);
    });
    Expect(rooted, "gather", rank, [&](t3d_request_t **r) {
      return t3d_gather(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, 0, nullptr, r);
    });
    Expect(rooted, "scatter", rank, [&](t3d_request_t **r) {
      return t3d_scatter(comm, out.data(), in.data(), in.size(), T3D_FLOAT32, 1, nullptr, r);
    });
    // A small allreduce may finish on the caller's thread; its shared done request still names the provider.
    Expect(coll, "small allreduce", rank, [&](t3d_request_t **r) {
      return t3d_allreduce(comm, in.data(), in.data(), 4, T3D_FLOAT32, T3D_MAX, nullptr, r);
    });
    const int to = (rank + 1) % 3, from = (rank + 2) % 3;
    t3d_request_t *s = nullptr, *rv = nullptr;
    ASSERT_EQ(T3D_OK, t3d_recv(comm, out.data(), 16, T3D_FLOAT32, from, 7, nullptr, &rv));
    ASSERT_EQ(T3D_OK, t3d_send(comm, in.data(), 16, T3D_FLOAT32, to, 7, nullptr, &s));
    EXPECT_STREQ(coll, t3d_request_provider(s));
    EXPECT_STREQ(coll, t3d_request_provider(rv));
    EXPECT_EQ(T3D_OK, Finish(s, nullptr));
    EXPECT_EQ(T3D_OK, Finish(rv, nullptr));
    t3d_request_t *g = nullptr;
    ASSERT_EQ(T3D_OK, t3d_group_start(comm));
    ASSERT_EQ(T3D_OK, t3d_barrier(comm, nullptr, &s));
    ASSERT_EQ(T3D_OK, t3d_group_end(comm, &g));
    EXPECT_STREQ("", t3d_request_provider(g));
    EXPECT_STREQ(coll, t3d_request_provider(s));
    EXPECT_EQ(T3D_OK, Finish(g, nullptr));
    EXPECT_EQ(T3D_OK, Finish(s, nullptr));
  });
}

TEST(Provider, CudaBuffersWithoutNcclProviderFailNamingTheRank) {
  if (!UcxOnly()) GTEST_SKIP() << "only with T3D_PROVIDERS=ucx, which leaves nccl out";
  RunRanks(1, [&](int rank, t3d_comm_t *comm) {
    float x = 1.0f;
    t3d_opts_t o;
    std::memset(&o, 0, sizeof o);
    o.memtype = T3D_MEM_CUDA;
    t3d_request_t *r = nullptr;
    EXPECT_EQ(T3D_ERR_UNSUPPORTED, t3d_allreduce(comm, &x, &x, 1, T3D_FLOAT32, T3D_SUM, &o, &r));
    EXPECT_EQ(nullptr, r);
    const std::string err = t3d_comm_last_error(comm);
    EXPECT_NE(std::string::npos, err.find("no provider")) << err;
    EXPECT_NE(std::string::npos, err.find("rank " + std::to_string(rank))) << err;
  });
}

}  // namespace
