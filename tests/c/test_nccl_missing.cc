// test_nccl_missing.cc: a CUDA call when NCCL cannot be loaded (ctest sets T3D_NCCL_LIBRARY to a file that does not
// exist): T3D_ERR_UNSUPPORTED naming the library path, an empty version string, and a communicator that still works
// on the host. Its own executable because t3d tries to load NCCL once per process.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "harness.h"

using namespace t3dtest;

namespace {

const char *const kMissing = "/nonexistent/libnccl.so.2";

// Run by hand, the binary sets the variable itself (ctest already did; an existing value is kept).
const int kSetEnv = setenv("T3D_NCCL_LIBRARY", kMissing, 0);

std::string LibraryPath() {
  const char *p = getenv("T3D_NCCL_LIBRARY");
  return p ? p : "";
}

TEST(NcclMissing, CudaCallsAreUnsupportedAndNameTheLibrary) {
  ASSERT_EQ(kSetEnv, 0);
  const std::string path = LibraryPath();
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    t3d_opts_t cuda{};
    cuda.memtype = T3D_MEM_CUDA;
    float x[3] = {1, 2, 3}, y[3] = {0, 0, 0};
    struct Case {
      const char *what;
      IssueFn issue;
    };
    const Case cases[] = {
        {"allreduce", [&](t3d_request_t **r) { return t3d_allreduce(comm, x, y, 3, T3D_FLOAT32, T3D_SUM, &cuda, r); }},
        {"broadcast", [&](t3d_request_t **r) { return t3d_broadcast(comm, x, 3, T3D_FLOAT32, 0, &cuda, r); }},
        {rank == 0 ? "send" : "recv",
         [&](t3d_request_t **r) {
           return rank == 0 ? t3d_send(comm, x, 3, T3D_FLOAT32, 1, 0, &cuda, r)
                            : t3d_recv(comm, y, 3, T3D_FLOAT32, 0, 0, &cuda, r);
         }},
    };
    for (const Case &c : cases) {
      t3d_request_t *req = reinterpret_cast<t3d_request_t *>(static_cast<uintptr_t>(0x10));
      const t3d_result_t r = c.issue(&req);
      EXPECT_EQ(r, T3D_ERR_UNSUPPORTED) << "rank " << rank << ": " << c.what << " -> " << t3d_result_string(r);
      if (r != T3D_OK) {
        EXPECT_EQ(req, nullptr) << c.what << ": a failed call must set *req to NULL";
      } else if (req) {
        Finish(req);
      }
      const std::string err = t3d_comm_last_error(comm);
      EXPECT_NE(err.find(path), std::string::npos) << c.what << ": the message must name " << path << ": " << err;
      EXPECT_NE(err.find("No such file"), std::string::npos) << c.what << ": the message must say why: " << err;
      EXPECT_EQ(t3d_comm_status(comm), T3D_OK) << c.what << ": a missing NCCL must not break the communicator";
    }
    // The host path is unaffected.
    EXPECT_TRUE(RunOk(comm, "host allreduce", [&](t3d_request_t **r) {
      return t3d_allreduce(comm, x, y, 3, T3D_FLOAT32, T3D_SUM, nullptr, r);
    }));
    EXPECT_EQ(y[2], 6.0f);
  });
  EXPECT_STREQ(t3d_nccl_version_string(), "");
  const std::string why = t3d_nccl_load_error();
  EXPECT_NE(why.find(path), std::string::npos) << why;
  EXPECT_NE(why.find("No such file"), std::string::npos) << "the reason (dlerror's text) is missing: " << why;
}

}  // namespace
