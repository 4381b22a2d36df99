// test_mem.cc: registered memory (t3d_mem_alloc) and the collectives that read and write the peers' buffers in
// place when every rank's buffers are in it (c_src/shm/mapped.c): results against the serial reference for every
// op of the mapped path, in place and not, odd sizes, dtypes on the vector and the tiled kernels; that the path ran
// (the peers' allocations show up mapped in this process); that a rank whose buffer is not t3d memory sends everyone
// through the segment with the same results; the API's errors; and ranks as real processes.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

// Mappings of t3d memory in this process (its own allocations and the peers' it mapped).
int MemMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += line.find("t3d-mem") != std::string::npos;
  return n;
}

// A buffer from t3d_mem_alloc (or, with registered false, from the heap), freed at scope end.
class Buffer {
 public:
  Buffer(size_t bytes, bool registered) : registered_(registered) {
    if (registered) {
      if (t3d_mem_alloc(bytes, &p_) != T3D_OK) p_ = nullptr;
    } else {
      p_ = malloc(bytes);
    }
    if (p_ != nullptr) memset(p_, 0, bytes);
  }
  ~Buffer() { registered_ ? (void)t3d_mem_free(p_) : free(p_); }
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;
  char *get() const { return static_cast<char *>(p_); }

 private:
  void *p_ = nullptr;
  bool registered_;
};

struct Case {
  t3d_dtype_t dt;
  t3d_redop_t op;
};
// float32/float64 sum: the vector kernel that writes every output at once; the others: the tiled one.
const Case kCases[] = {{T3D_FLOAT32, T3D_SUM}, {T3D_FLOAT64, T3D_SUM}, {T3D_INT32, T3D_MAX},
                       {T3D_INT8, T3D_SUM},    {T3D_FLOAT32, T3D_PROD}};
const size_t kCounts[] = {5000, 40003};  // both from T3D_SHM_MAPPED_BYTES=4096 (int8 too), not whole lines per rank

class Mem : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SetEnv("T3D_SHM_MAPPED_BYTES", "4096"); }
  void TearDown() override { UnsetEnv("T3D_SHM_MAPPED_BYTES"); }
};

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

// Every reducing and moving op of the mapped path on buffers from t3d_mem_alloc (every rank, or all but rank 1
// when `mixed`), checked against the reference.
void RunAllOps(int n, int rank, t3d_comm_t *comm, bool mixed) {
  const bool reg = !(mixed && rank == 1);
  for (const Case &c : kCases) {
    for (size_t count : kCounts) {
      const size_t es = t3d_dtype_size(c.dt), bytes = count * es;
      const std::string name = CaseName(c.dt, c.op, count);
      std::vector<unsigned char> expect(bytes * n);
      // allreduce, out of place and in place
      Buffer in(bytes, reg), out(bytes, reg);
      FillInput(c.dt, c.op, rank, in.get(), count);
      ReferenceReduce(c.dt, c.op, n, expect.data(), count);
      if (!RunOk(comm, "allreduce " + name, [&](t3d_request_t **r) {
            return t3d_allreduce(comm, in.get(), out.get(), count, c.dt, c.op, nullptr, r);
          }))
        return;
      // Ranks are threads of this process: each rank's two buffers and, on the mapped path, one more mapping of
      // each (the peers of a process share their views); no second mapping when rank 1's buffers are plain.
      if (!HostBarrier()) return;
      if (rank == 0) {
        EXPECT_EQ(MemMappings(), mixed ? 2 * (n - 1) : 4 * n)
            << "allreduce " << name << (mixed ? ": a rank mapped a peer's buffer although rank 1's are plain"
                                              : ": the ranks did not map each other's buffers (the segment ran)");
      }
      if (!HostBarrier()) return;
      EXPECT_EQ("", CompareBuffers(c.dt, out.get(), expect.data(), count, 0)) << Tag(rank, "allreduce " + name);
      if (!RunOk(comm, "allreduce in place " + name, [&](t3d_request_t **r) {
            return t3d_allreduce(comm, in.get(), in.get(), count, c.dt, c.op, nullptr, r);
          }))
        return;
      EXPECT_EQ("", CompareBuffers(c.dt, in.get(), expect.data(), count, 0))
          << Tag(rank, "allreduce in place " + name);
      // reduce_scatter: rank q's block is elements [q * count, (q + 1) * count) of the logical input
      Buffer rin(bytes * n, reg), rout(bytes, reg);
      FillInput(c.dt, c.op, rank, rin.get(), count * n);
      ReferenceReduce(c.dt, c.op, n, expect.data(), count, count * rank);
      if (!RunOk(comm, "reduce_scatter " + name, [&](t3d_request_t **r) {
            return t3d_reduce_scatter(comm, rin.get(), rout.get(), count, c.dt, c.op, nullptr, r);
          }))
        return;
      EXPECT_EQ("", CompareBuffers(c.dt, rout.get(), expect.data(), count, 0))
          << Tag(rank, "reduce_scatter " + name);
      char *own = rin.get() + bytes * rank;  // the output is the own block of the input
      if (!RunOk(comm, "reduce_scatter own block " + name, [&](t3d_request_t **r) {
            return t3d_reduce_scatter(comm, rin.get(), own, count, c.dt, c.op, nullptr, r);
          }))
        return;
      EXPECT_EQ("", CompareBuffers(c.dt, own, expect.data(), count, 0))
          << Tag(rank, "reduce_scatter own block " + name);
      if (c.op != T3D_SUM) continue;  // the moving ops once per dtype
      // allgather, out of place and in place (the own block already in the output)
      Buffer gin(bytes, reg), gout(bytes * n, reg);
      FillPattern(c.dt, rank, gin.get(), count);
      for (int q = 0; q < n; ++q) FillPattern(c.dt, q, expect.data() + bytes * q, count);
      if (!RunOk(comm, "allgather " + name, [&](t3d_request_t **r) {
            return t3d_allgather(comm, gin.get(), gout.get(), count, c.dt, nullptr, r);
          }))
        return;
      EXPECT_EQ(0, memcmp(gout.get(), expect.data(), bytes * n)) << Tag(rank, "allgather " + name);
      memset(gout.get(), 0, bytes * n);
      FillPattern(c.dt, rank, gout.get() + bytes * rank, count);
      if (!RunOk(comm, "allgather in place " + name, [&](t3d_request_t **r) {
            return t3d_allgather(comm, gout.get() + bytes * rank, gout.get(), count, c.dt, nullptr, r);
          }))
        return;
      EXPECT_EQ(0, memcmp(gout.get(), expect.data(), bytes * n)) << Tag(rank, "allgather in place " + name);
      // alltoall: block q of rank p's input carries pattern (p, salt q) and lands as block p of rank q's output
      Buffer ain(bytes * n, reg), aout(bytes * n, reg);
      for (int q = 0; q < n; ++q) FillPattern(c.dt, rank, ain.get() + bytes * q, count, 0, q);
      for (int p = 0; p < n; ++p) FillPattern(c.dt, p, expect.data() + bytes * p, count, 0, rank);
      if (!RunOk(comm, "alltoall " + name, [&](t3d_request_t **r) {
            return t3d_alltoall(comm, ain.get(), aout.get(), count, c.dt, nullptr, r);
          }))
        return;
      EXPECT_EQ(0, memcmp(aout.get(), expect.data(), bytes * n)) << Tag(rank, "alltoall " + name);
      // broadcast from every root
      for (int root = 0; root < n; ++root) {
        Buffer b(bytes, reg);
        FillPattern(c.dt, rank == root ? root : 99, b.get(), count);
        FillPattern(c.dt, root, expect.data(), count);
        if (!RunOk(comm, "broadcast " + name, [&](t3d_request_t **r) {
              return t3d_broadcast(comm, b.get(), count, c.dt, root, nullptr, r);
            }))
          return;
        EXPECT_EQ(0, memcmp(b.get(), expect.data(), bytes)) << Tag(rank, "broadcast " + name) << " root " << root;
      }
    }
  }
}

TEST_P(Mem, EveryOpOnRegisteredBuffers) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) { RunAllOps(n, rank, comm, false); });
  EXPECT_EQ(MemMappings(), 0) << "freeing an allocation unmaps it, and this process's views of it";
}

TEST_P(Mem, OneRankWithoutRegisteredBuffersSendsAllThroughTheSegment) {
  const int n = GetParam();
  RunRanks(n, [&](int rank, t3d_comm_t *comm) { RunAllOps(n, rank, comm, true); });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Mem, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int> &i) { return "n" + std::to_string(i.param); });

// Point-to-point: a receiver maps a sender's buffer in t3d memory and copies from it (no agreement needed: the
// message says where the buffer is); a plain send buffer is read with process_vm_readv as before.
TEST(MemP2p, ReceiversMapSendersInT3dMemory) {
  SetEnv("T3D_SHM_MAPPED_BYTES", "4096");
  const int n = 3;
  const size_t count = 100003;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (bool reg : {false, true}) {
      Buffer send(count * 4, reg), recv(count * 4, false);
      FillPattern(T3D_FLOAT32, rank, send.get(), count);
      const int to = (rank + 1) % n, from = (rank + n - 1) % n;
      t3d_request_t *reqs[2] = {nullptr, nullptr};
      T3D_ASSERT_OK(comm, t3d_send(comm, send.get(), count, T3D_FLOAT32, to, 7, nullptr, &reqs[0]));
      T3D_ASSERT_OK(comm, t3d_recv(comm, recv.get(), count, T3D_FLOAT32, from, 7, nullptr, &reqs[1]));
      for (t3d_request_t *r : reqs) ASSERT_EQ(Finish(r), T3D_OK);
      std::vector<unsigned char> want(count * 4);
      FillPattern(T3D_FLOAT32, from, want.data(), count);
      EXPECT_EQ(0, memcmp(recv.get(), want.data(), count * 4)) << "rank " << rank << (reg ? " t3d memory" : "");
      if (!HostBarrier()) return;
      // every rank's send buffer, and its receiver's mapping of it
      if (rank == 0) {
        EXPECT_EQ(MemMappings(), reg ? 2 * n : 0) << "the receivers did not map their senders' buffers";
      }
      if (!HostBarrier()) return;
    }
  });
  UnsetEnv("T3D_SHM_MAPPED_BYTES");
}

TEST(MemApi, ErrorsAndOwnership) {
  void *p = reinterpret_cast<void *>(1);
  EXPECT_EQ(t3d_mem_alloc(0, &p), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(t3d_mem_alloc(16, nullptr), T3D_ERR_INVALID_ARG);
  ASSERT_EQ(t3d_mem_alloc(10000, &p), T3D_OK);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u) << "page aligned";
  EXPECT_EQ(t3d_mem_owns(p, 10000), 1);
  EXPECT_EQ(t3d_mem_owns(static_cast<char *>(p) + 100, 9000), 1);
  EXPECT_EQ(t3d_mem_owns(p, 1 << 20), 0) << "past the allocation's pages";
  int local = 0;
  EXPECT_EQ(t3d_mem_owns(&local, sizeof local), 0);
  EXPECT_EQ(t3d_mem_free(static_cast<char *>(p) + 64), T3D_ERR_INVALID_ARG) << "not a pointer t3d_mem_alloc returned";
  EXPECT_EQ(t3d_mem_free(p), T3D_OK);
  EXPECT_EQ(t3d_mem_owns(p, 1), 0);
  EXPECT_EQ(t3d_mem_free(p), T3D_ERR_INVALID_ARG) << "freed twice";
  EXPECT_EQ(t3d_mem_free(nullptr), T3D_OK);
}

// fork(): the child's copy of t3d memory is its own. Before, the pages were a shared file's in both processes: the
// child's write showed in the parent's buffer and its free marked the parent's allocation freed for the peers.
// Now the child maps what it inherited privately: its writes stay its own, it does not offer the allocation to
// peers (t3d_mem_owns 0), it can still free it, and what it allocates after the fork is t3d memory as usual.
TEST(MemFork, ChildWritesAndFreesItsOwnCopy) {
  const size_t bytes = (4u << 20) + 123;
  char *p = nullptr;
  ASSERT_EQ(t3d_mem_alloc(bytes, reinterpret_cast<void **>(&p)), T3D_OK);
  memset(p, 1, bytes);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(60);
    if (p[0] != 1 || p[bytes - 1] != 1) _exit(2);  // inherited contents
    if (t3d_mem_owns(p, bytes) != 0) _exit(3);      // never offered from here
    memset(p, 7, bytes);                            // the child's write
    if (p[12345] != 7) _exit(4);
    if (t3d_mem_free(p) != T3D_OK) _exit(5);
    char *q = nullptr;
    if (t3d_mem_alloc(1 << 20, reinterpret_cast<void **>(&q)) != T3D_OK || t3d_mem_owns(q, 1 << 20) != 1) _exit(6);
    q[0] = 3;
    _exit(t3d_mem_free(q) == T3D_OK ? 0 : 7);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "child: " << (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                         : "signal " + std::to_string(WTERMSIG(status)));
  size_t changed = 0;
  for (size_t i = 0; i < bytes; ++i) changed += p[i] != 1;
  EXPECT_EQ(changed, 0u) << "the child's write reached the parent's t3d memory";
  EXPECT_EQ(t3d_mem_owns(p, bytes), 1);
  // The child's free left the allocation live for the peers: the header's freed flag, a page before the bytes.
  const uint32_t freed = *reinterpret_cast<const uint32_t *>(p - 4096 + 24);
  EXPECT_EQ(freed, 0u) << "the child's free marked the parent's allocation freed";
  EXPECT_EQ(t3d_mem_free(p), T3D_OK);
}

// Ranks as processes: each maps the others' allocations through /proc/<pid>/fd. Exit code 0, or 1 + what failed.
TEST(MemFork, ThreeProcessesAllreduceAllgatherBroadcast) {
  const int n = 3;
  const std::string dir = "/tmp/" + UniqueName("t3d-mem");
  FileStore store(dir);
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(120);  // a hang ends the child
      SetEnv("T3D_SHM_MAPPED_BYTES", "4096");
      FileStore s(dir);
      t3d_config_t cfg;
      t3d_config_init(&cfg);
      cfg.key_prefix = "mem";
      cfg.timeout_ms = 60000;
      t3d_comm_t *comm = nullptr;
      if (t3d_comm_init(&comm, rank, n, s.store(), &cfg) != T3D_OK) _exit(2);
      const size_t count = 300001;
      float *in = nullptr, *out = nullptr;
      if (t3d_mem_alloc(count * 4 * n, reinterpret_cast<void **>(&in)) != T3D_OK ||
          t3d_mem_alloc(count * 4 * n, reinterpret_cast<void **>(&out)) != T3D_OK)
        _exit(3);
      const int own = MemMappings();
      for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 7);
      // The call first, then its request (both in one argument list would leave their order to the compiler).
      t3d_request_t *req = nullptr;
      auto done = [rank, &req](t3d_result_t r) {
        if (r == T3D_OK) r = t3d_wait(req, 60000);
        if (r != T3D_OK)
          fprintf(stderr, "rank %d: %s: %s\n", rank, t3d_result_string(r), req ? t3d_request_error(req) : t3d_thread_last_error());
        if (req != nullptr) t3d_request_free(req);
        req = nullptr;
        return r == T3D_OK;
      };
      if (!done(t3d_allreduce(comm, in, out, count, T3D_FLOAT32, T3D_SUM, nullptr, &req))) _exit(4);
      for (size_t i = 0; i < count; ++i) {
        if (out[i] != 6.0f * static_cast<float>(i % 7)) _exit(5);
      }
      if (!done(t3d_allgather(comm, in, out, count, T3D_FLOAT32, nullptr, &req))) _exit(6);
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < count; i += 97) {
          if (out[q * count + i] != static_cast<float>(q + 1) * static_cast<float>(i % 7)) _exit(7);
        }
      }
      if (rank != 2) memset(out, 0, count * 4);  // rank 2 sends what it gathered first: rank 0's block
      if (!done(t3d_broadcast(comm, out, count, T3D_FLOAT32, 2, nullptr, &req))) _exit(8);
      for (size_t i = 0; i < count; i += 97) {
        if (out[i] != static_cast<float>(i % 7)) _exit(9);
      }
      if (MemMappings() <= own) _exit(10);  // the peers' buffers were never mapped here
      t3d_mem_free(in);
      t3d_mem_free(out);
      _exit(t3d_comm_destroy(comm) == T3D_OK ? 0 : 11);
    }
    pids.push_back(pid);
  }
  for (int rank = 0; rank < n; ++rank) {
    int status = 0;
    waitpid(pids[rank], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << ": " << (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                                                         : "signal " + std::to_string(WTERMSIG(status)));
  }
  store.Remove();
}

}  // namespace
