// test_placement.cc: the placement probe of two-rank groups (c_src/shm/sync.c, t3d__shm_far). Allgather, alltoall
// (equal blocks) and allreduce from T3D_SHM_PLACEMENT_BYTES on, broadcast from 512 KiB, first time a few rounds
// between the two ranks, and write their halves of the segment with non-temporal stores where the rounds were slow
// (broadcast's root: with plain stores where they were fast). A binary of its own: a
// group with more ranks than cores anywhere in the process turns the probes off for good (t3d__oversubscribed).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"
#include "harness_shm.h"

using namespace t3dtest;

namespace {

struct Probes {
  uint64_t count = 0;
  int far = 0;
};

Probes ReadProbes(t3d_comm_t *comm) {
  Probes p;
  EXPECT_TRUE(t3dtest_shm_placement(comm, &p.count, &p.far)) << "the group has no shared-memory segment";
  return p;
}

float Value(int rank, size_t i) { return static_cast<float>(rank * 1000 + static_cast<int>(i % 97)); }

// Elements of got that differ from want(index).
template <typename Want>
size_t Wrong(const std::vector<float> &got, Want want) {
  size_t n = 0;
  for (size_t i = 0; i < got.size(); ++i) n += got[i] != want(i);
  return n;
}

using EnvVars = std::vector<std::pair<const char *, const char *>>;

class EnvGuard {
 public:
  explicit EnvGuard(EnvVars vars) : vars_(std::move(vars)) {
    for (auto &v : vars_) SetEnv(v.first, v.second);
  }
  ~EnvGuard() {
    for (auto &v : vars_) UnsetEnv(v.first);
  }

 private:
  EnvVars vars_;
};

// Element counts either side of a 4 KiB threshold: the allreduce of 1024 floats probes, the one of 1023 does not;
// allgather and alltoall move 2 x count floats, so from 512 on; broadcast from 131072 (single copy, which does not
// probe, is off). 300003 floats take many steps of a tiny segment. From 8 MiB every operation probes
// (T3D_SHM_PROBE_EACH_BYTES): 1048576 floats are 4 MiB for allreduce, reduce and broadcast, 8 MiB for the others;
// 2097152 floats 8 MiB and more for all.
const size_t kCounts[] = {100, 511, 512, 1023, 1024, 1025, 40003, 131071, 131072, 300003, 1048576, 2097152};

// Runs allreduce (also in place), reduce, reduce_scatter, allgather, broadcast and alltoall at every count, checks
// the results, and that probes ran exactly at the first of the operations that qualify and at every 16th after it
// (sync.c's PROBE_EVERY), and at every one of 8 MiB or more (which the count of the others leaves out), finding
// `want_far`.
void RunAll(int rank, t3d_comm_t *comm, int want_far) {
  const size_t kThreshold = 4096;
  uint64_t qualified = 0;  // operations so far that could probe
  const size_t kEach = 8u << 20;
  // Runs one operation of op_bytes; checks that it probed exactly when it qualifies and is the first or a 16th
  // such, or at least kEach bytes, and what it found. Returns whether it succeeded.
  auto run = [&](const std::string &what, bool qualifies, size_t op_bytes, const IssueFn &issue) {
    const Probes before = ReadProbes(comm);
    if (!RunOk(comm, what, issue)) return false;
    const Probes after = ReadProbes(comm);
    const uint64_t want = qualifies && (op_bytes >= kEach || qualified++ % 16 == 0) ? 1u : 0u;
    EXPECT_EQ(after.count - before.count, want) << "rank " << rank << ": " << what;
    if (qualifies) {
      EXPECT_EQ(after.far, want_far) << "rank " << rank << ": " << what;
    }
    return true;
  };
  for (size_t count : kCounts) {
    const std::string at = " of " + std::to_string(count) + " floats";
    const size_t bytes = count * sizeof(float);
    // allreduce
    std::vector<float> in(count), out(count, -1.0f);
    for (size_t i = 0; i < count; ++i) in[i] = Value(rank, i);
    if (!run("allreduce" + at, bytes >= kThreshold, bytes, [&](t3d_request_t **r) {
          return t3d_allreduce(comm, in.data(), out.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, r);
        }))
      return;
    EXPECT_EQ(Wrong(out, [](size_t i) { return Value(0, i) + Value(1, i); }), 0u)
        << "rank " << rank << ": allreduce" << at;
    // allreduce in place, and reduce to rank count % 2 (whose output alone is written)
    std::vector<float> io = in;
    if (!run("allreduce in place" + at, bytes >= kThreshold, bytes, [&](t3d_request_t **r) {
          return t3d_allreduce(comm, io.data(), io.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, r);
        }))
      return;
    EXPECT_TRUE(io == out) << "rank " << rank << ": allreduce in place" << at;
    const int root = static_cast<int>(count % 2);
    std::vector<float> red(count, -1.0f);
    if (!run("reduce" + at, bytes >= kThreshold, bytes, [&](t3d_request_t **r) {
          return t3d_reduce(comm, in.data(), red.data(), count, T3D_FLOAT32, T3D_SUM, root, nullptr, r);
        }))
      return;
    if (rank == root) {
      EXPECT_TRUE(red == out) << "rank " << rank << ": reduce" << at;
    }
    // reduce_scatter: blocks of count floats, block q of rank p holds Value(p, i) + 500 q
    std::vector<float> blocks(2 * count);
    for (int q = 0; q < 2; ++q)
      for (size_t i = 0; i < count; ++i) blocks[q * count + i] = Value(rank, i) + 500.0f * static_cast<float>(q);
    std::vector<float> mine(count, -1.0f);
    if (!run("reduce_scatter" + at, 2 * bytes >= kThreshold, 2 * bytes, [&](t3d_request_t **r) {
          return t3d_reduce_scatter(comm, blocks.data(), mine.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, r);
        }))
      return;
    EXPECT_EQ(Wrong(mine, [&](size_t i) { return out[i] + 1000.0f * static_cast<float>(rank); }), 0u)
        << "rank " << rank << ": reduce_scatter" << at;
    // allgather: each rank's block of count floats
    out.assign(2 * count, -1.0f);
    if (!run("allgather" + at, 2 * bytes >= kThreshold, 2 * bytes, [&](t3d_request_t **r) {
          return t3d_allgather(comm, in.data(), out.data(), count, T3D_FLOAT32, nullptr, r);
        }))
      return;
    EXPECT_EQ(Wrong(out, [&](size_t j) { return Value(static_cast<int>(j / count), j % count); }), 0u)
        << "rank " << rank << ": allgather" << at;
    // broadcast from rank count % 2: probes from 512 KiB (broadcast.c), whatever T3D_SHM_PLACEMENT_BYTES says
    std::vector<float> buf(count, -1.0f);
    if (rank == root) buf = in;
    if (!run("broadcast" + at, bytes >= 512 * 1024, bytes, [&](t3d_request_t **r) {
          return t3d_broadcast(comm, buf.data(), count, T3D_FLOAT32, root, nullptr, r);
        }))
      return;
    EXPECT_EQ(Wrong(buf, [&](size_t i) { return Value(root, i); }), 0u) << "rank " << rank << ": broadcast" << at;
    // alltoall: the same blocks
    out.assign(2 * count, -1.0f);
    if (!run("alltoall" + at, 2 * bytes >= kThreshold, 2 * bytes, [&](t3d_request_t **r) {
          return t3d_alltoall(comm, blocks.data(), out.data(), count, T3D_FLOAT32, nullptr, r);
        }))
      return;
    const float shift = 500.0f * static_cast<float>(rank);
    EXPECT_EQ(Wrong(out, [&](size_t j) { return Value(static_cast<int>(j / count), j % count) + shift; }), 0u)
        << "rank " << rank << ": alltoall" << at;
  }
}

}  // namespace

// T3D_SHM_FAR_NS=0: every probe finds the ranks far apart, and the halves are written with non-temporal stores;
// a threshold no round reaches: never. Both give the reference results, on a tiny segment (many steps), sizes
// either side of the threshold (those below may start on the caller's thread, those above never do). The one-shot
// allreduce and single copy are off: they do not use the halves that way, and do not probe.
TEST(ShmPlacement, ProbesFromTheThresholdAndBothWritesAgree) {
  for (const char *far_ns : {"0", "10000000000"}) {
    EnvGuard env(EnvVars{{"T3D_SHM_PLACEMENT_BYTES", "4096"},
                         {"T3D_SHM_BYTES", "131072"},
                         {"T3D_SHM_ONESHOT_BYTES", "0"},
                         {"T3D_SHM_DIRECT_BYTES", "0"},
                         {"T3D_SHM_BCAST_DIRECT_BYTES", "0"},
                         {"T3D_SHM_FAR_NS", far_ns}});
    const int want_far = strcmp(far_ns, "0") == 0;
    RunRanks(2, [&](int rank, t3d_comm_t *comm) { RunAll(rank, comm, want_far); });
  }
}

// Broadcasts probe one in 16 from 512 KiB, each one from 8 MiB as the other operations do (measured: no cost at
// 8-64 MiB, docs/benchmarks/broadcast-probe-each-2ranks.txt). 16 broadcasts of 4 MiB probe once (the group's first
// operation that may probe), the 3 of 8 MiB after them three times, and the next 16 of 4 MiB once more, at the
// first (the 17th of 4 MiB): the large ones leave the count of the others alone.
TEST(ShmPlacement, BroadcastsProbeEachFromEightMiB) {
  EnvGuard env(EnvVars{{"T3D_SHM_PLACEMENT_BYTES", "4096"}, {"T3D_SHM_BCAST_DIRECT_BYTES", "0"}});
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> buf(2u << 20);  // 8 MiB of floats
    int k = 0;
    auto bcast = [&](size_t count) {
      for (size_t i = 0; i < count; i += 4099) buf[i] = rank == 0 ? Value(k, i) : -1.0f;
      const std::string what = "broadcast " + std::to_string(k) + " of " + std::to_string(count) + " floats";
      if (!RunOk(comm, what, [&](t3d_request_t **r) {
            return t3d_broadcast(comm, buf.data(), count, T3D_FLOAT32, 0, nullptr, r);
          }))
        return false;
      EXPECT_EQ(buf[4099 * 7], Value(k, 4099 * 7)) << "rank " << rank << ": " << what;
      ++k;
      return true;
    };
    for (int j = 0; j < 16; ++j)
      if (!bcast(1u << 20)) return;
    EXPECT_EQ(ReadProbes(comm).count, 1u) << "rank " << rank << ": after 16 broadcasts of 4 MiB";
    for (int j = 0; j < 3; ++j)
      if (!bcast(2u << 20)) return;
    EXPECT_EQ(ReadProbes(comm).count, 4u) << "rank " << rank << ": after 3 broadcasts of 8 MiB";
    if (!bcast(1u << 20)) return;
    EXPECT_EQ(ReadProbes(comm).count, 5u) << "rank " << rank << ": after the 17th broadcast of 4 MiB";
    for (int j = 0; j < 15; ++j)
      if (!bcast(1u << 20)) return;
    EXPECT_EQ(ReadProbes(comm).count, 5u) << "rank " << rank << ": after 15 more of 4 MiB";
  });
}

// T3D_SHM_PLACEMENT_BYTES=0: no probes at all.
TEST(ShmPlacement, ZeroTurnsTheProbesOff) {
  EnvGuard env(EnvVars{{"T3D_SHM_PLACEMENT_BYTES", "0"}});
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(1 << 20, 1.0f), out(1 << 20);
    if (!RunOk(comm, "allreduce of 4 MiB", [&](t3d_request_t **r) {
          return t3d_allreduce(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, T3D_SUM, nullptr, r);
        }))
      return;
    EXPECT_EQ(ReadProbes(comm).count, 0u) << "rank " << rank;
    EXPECT_EQ(out[12345], 2.0f) << "rank " << rank;
  });
}

// T3D_SHM_PLACEMENT_BYTES unset: a 2-rank group probes at its first 1 MiB allreduce, except on an Intel CPU, whose
// cores share one L3 (copy.c, t3d__shm_llc_may_split): there it never probes and writes its halves with plain
// stores.
TEST(ShmPlacement, UnsetProbesWhereCoresMaySplitTheL3) {
  UnsetEnv("T3D_SHM_PLACEMENT_BYTES");
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const uint64_t want = __builtin_cpu_is("intel") ? 0u : 1u;
#else
  const uint64_t want = 1u;
#endif
  RunRanks(2, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(1 << 18, 1.0f), out(1 << 18);
    if (!RunOk(comm, "allreduce of 1 MiB", [&](t3d_request_t **r) {
          return t3d_allreduce(comm, in.data(), out.data(), in.size(), T3D_FLOAT32, T3D_SUM, nullptr, r);
        }))
      return;
    const Probes p = ReadProbes(comm);
    EXPECT_EQ(p.count, want) << "rank " << rank;
    if (want == 0) {
      EXPECT_EQ(p.far, 0) << "rank " << rank;
    }
    EXPECT_EQ(out[12345], 2.0f) << "rank " << rank;
  });
}

// Ranks that disagree on the size, one above the threshold (it probes) and one below (it does not), fail with
// T3D_ERR_MISMATCH or time out: never a hang or wrong data.
TEST(ShmPlacement, SizesEitherSideOfTheThresholdFailCleanly) {
  EnvGuard env(EnvVars{{"T3D_SHM_PLACEMENT_BYTES", "4096"}});
  for (int probing_rank : {0, 1}) {
    RunOptions o;
    o.comm_timeout_ms = 1000;
    o.abort_on_failure = false;
    RunRanks(2, [&](int rank, t3d_comm_t *comm) {
      const size_t count = rank == probing_rank ? 2048 : 100;
      std::vector<float> in(count, 1.0f), out(2 * count);
      std::string err;
      t3d_request_t *req = nullptr;
      const t3d_result_t call = t3d_allgather(comm, in.data(), out.data(), count, T3D_FLOAT32, nullptr, &req);
      const t3d_result_t r = Complete(call, req, &err);
      EXPECT_TRUE(r == T3D_ERR_MISMATCH || r == T3D_ERR_TIMEOUT)
          << "rank " << rank << ": " << t3d_result_string(r) << " " << err << " (probing rank " << probing_rank
          << ")";
    }, o);
  }
}

// Three ranks never probe (the rounds pair two ranks). Last: with more ranks than cores it turns the probes off
// for the rest of the process.
TEST(ShmPlacement, OnlyTwoRankGroupsProbe) {
  EnvGuard env(EnvVars{{"T3D_SHM_PLACEMENT_BYTES", "4096"}});
  RunRanks(3, [&](int rank, t3d_comm_t *comm) {
    std::vector<float> in(3 * 4096, 1.0f), out(3 * 4096);
    if (!RunOk(comm, "allgather of 48 KiB", [&](t3d_request_t **r) {
          return t3d_allgather(comm, in.data(), out.data(), 4096, T3D_FLOAT32, nullptr, r);
        }))
      return;
    EXPECT_EQ(ReadProbes(comm).count, 0u) << "rank " << rank;
  });
}
