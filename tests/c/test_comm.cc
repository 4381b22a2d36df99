// test_comm.cc: communicator life cycle: init and its failures, split, two communicators used concurrently, argument
// checking with named errors, operation timeouts, and abort from another thread.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Whether text names rank r: the word "rank" followed, within a few tokens, by r as a whole number.
bool MentionsRank(const std::string &text, int r) {
  const std::string num = std::to_string(r);
  std::string lower(text);
  for (char &c : lower) c = static_cast<char>(tolower(static_cast<unsigned char>(c)));
  for (size_t at = lower.find("rank"); at != std::string::npos; at = lower.find("rank", at + 1)) {
    const size_t end = std::min(lower.size(), at + 24);
    for (size_t i = at + 4; i + num.size() <= end; ++i) {
      if (lower.compare(i, num.size(), num) != 0) continue;
      const bool left_ok = !isdigit(static_cast<unsigned char>(lower[i - 1]));
      const bool right_ok = i + num.size() == lower.size() || !isdigit(static_cast<unsigned char>(lower[i + num.size()]));
      if (left_ok && right_ok) return true;
    }
  }
  return false;
}

TEST(CommHelpers, MentionsRank) {
  EXPECT_TRUE(MentionsRank("still waiting for rank(s) 1", 1));
  EXPECT_TRUE(MentionsRank("on rank 3 of group", 3));
  EXPECT_FALSE(MentionsRank("on rank 13 of group", 3));
  EXPECT_FALSE(MentionsRank("no such word 1", 1));
}

// ---------- init ----------

TEST(Comm, BasicProperties) {
  for (int n : {1, 3}) {
    RunRanks(n, [n](int rank, t3d_comm_t *comm) {
      EXPECT_EQ(t3d_comm_rank(comm), rank);
      EXPECT_EQ(t3d_comm_size(comm), n);
      EXPECT_EQ(t3d_comm_status(comm), T3D_OK);
      ASSERT_NE(t3d_comm_last_error(comm), nullptr);
      EXPECT_STREQ(t3d_comm_last_error(comm), "");
      ASSERT_NE(t3d_comm_transport(comm), nullptr);
      EXPECT_STRNE(t3d_comm_transport(comm), "");
    });
  }
}

// Threads of this process named `name` (/proc/self/task/*/comm).
int ThreadsNamed(const std::string &name) {
  int n = 0;
  DIR *d = opendir("/proc/self/task");
  if (d == nullptr) return -1;
  for (dirent *e = readdir(d); e != nullptr; e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string comm;
    if (std::getline(f, comm) && comm == name) n++;
  }
  closedir(d);
  return n;
}

// Each communicator's progress thread carries a name that top, perf and gdb show (scripts/profile-step.sh counts
// it as the backend's). The thread names itself when it starts: wait for it a little.
TEST(Comm, ProgressThreadIsNamed) {
  const int before = ThreadsNamed("t3d_progress");
  ASSERT_GE(before, 0) << "no /proc/self/task";
  RunRanks(2, [before](int rank, t3d_comm_t *comm) {
    (void)comm;
    if (rank != 0) return;
    int n = 0;
    for (int i = 0; i < 200 && (n = ThreadsNamed("t3d_progress")) < before + 2; i++) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_GE(n, before + 2) << "expected a thread named t3d_progress per communicator (2 ranks in this process)";
  });
}

TEST(Comm, ConfigDefaults) {
  t3d_config_t cfg;
  memset(&cfg, 0x7f, sizeof cfg);
  t3d_config_init(&cfg);
  EXPECT_EQ(cfg.name, nullptr);
  EXPECT_EQ(cfg.key_prefix, nullptr);
  EXPECT_EQ(cfg.transport, nullptr);
  EXPECT_LE(cfg.timeout_ms, 0);
}

TEST(Comm, InitBadArguments) {
  MemStore store;
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = 1000;
  t3d_comm_t *comm = nullptr;
  EXPECT_EQ(t3d_comm_init(&comm, 0, 2, nullptr, &cfg), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_comm_init(&comm, 2, 2, store.store(), &cfg), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_comm_init(&comm, -1, 2, store.store(), &cfg), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_comm_init(&comm, 0, 0, store.store(), &cfg), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_comm_init(nullptr, 0, 1, store.store(), &cfg), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(comm, nullptr);
}

// One of two ranks never shows up: init gives up after the configured timeout instead of hanging.
TEST(Comm, InitTimesOutWhenAPeerIsMissing) {
  MemStore store;
  t3d_config_t cfg;
  t3d_config_init(&cfg);
  cfg.timeout_ms = 1000;
  const std::string prefix = UniqueName("lonely");
  cfg.key_prefix = prefix.c_str();
  t3d_comm_t *comm = nullptr;
  const auto t0 = Clock::now();
  t3d_result_t r = t3d_comm_init(&comm, 0, 2, store.store(), &cfg);
  const int64_t took = MsSince(t0);
  EXPECT_EQ(r, T3D_ERR_TIMEOUT) << t3d_result_string(r);
  EXPECT_LT(took, 2 * cfg.timeout_ms + 500) << "init took " << took << " ms";
  if (comm) t3d_comm_destroy(comm);
}

// ---------- what needs UCX ----------

// A store that puts every rank on a host of its own: each host identity read at init ("<prefix>/host/<rank>")
// comes back changed.
class OtherHostsStore {
 public:
  OtherHostsStore() {
    store_.ctx = this;
    store_.set = [](void *ctx, const char *key, const void *value, size_t len) {
      const t3d_store_t *in = static_cast<OtherHostsStore *>(ctx)->inner_.store();
      return in->set(in->ctx, key, value, len);
    };
    store_.get = [](void *ctx, const char *key, void **value, size_t *len, int64_t timeout_ms) {
      const t3d_store_t *in = static_cast<OtherHostsStore *>(ctx)->inner_.store();
      t3d_result_t r = in->get(in->ctx, key, value, len, timeout_ms);
      if (r != T3D_OK || strstr(key, "/host/") == nullptr || *len == 0) return r;
      const std::string moved = std::string(static_cast<const char *>(*value), *len - 1) + "-elsewhere";
      free(*value);
      *value = strdup(moved.c_str());
      *len = moved.size() + 1;
      return *value ? T3D_OK : T3D_ERR_NO_MEMORY;
    };
  }
  const t3d_store_t *store() const { return &store_; }

 private:
  MemStore inner_;
  t3d_store_t store_;
};

// Each of n ranks (threads) runs t3d_comm_init alone; returns each rank's result and error text, and destroys the
// communicators made.
std::vector<std::pair<t3d_result_t, std::string>> InitEach(int n, const t3d_store_t *store, const char *transport) {
  std::vector<std::pair<t3d_result_t, std::string>> out(n);
  std::vector<t3d_comm_t *> comms(n, nullptr);
  const std::string prefix = UniqueName("needs-ucx");
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      t3d_config_t cfg;
      t3d_config_init(&cfg);
      cfg.timeout_ms = 20000;
      cfg.key_prefix = prefix.c_str();
      cfg.name = "needs-ucx";
      cfg.transport = transport;
      out[r].first = t3d_comm_init(&comms[r], r, n, store, &cfg);
      out[r].second = t3d_thread_last_error();
    });
  }
  for (auto &t : threads) t.join();
  for (t3d_comm_t *c : comms)
    if (c) t3d_comm_destroy(c);
  return out;
}

// A build without UCX refuses, at init and on every rank, what only UCX could carry, with one line that says so,
// names the rank and says what needed UCX; a build with UCX serves the same configurations (except a segment that
// cannot be made, which fails there too).
TEST(Comm, WhatNeedsUcxFailsAtInitWithoutIt) {
  struct Case {
    std::string what, env;
    const char *transport, *reason;
    bool other_hosts, fails_with_ucx;
  };
  std::vector<Case> cases = {
      {"transport ucx in the config", "", "ucx", "its transport is 'ucx'", false, false},
      {"T3D_TRANSPORT=ucx", "T3D_TRANSPORT=ucx", nullptr, "its transport is 'ucx'", false, false},
      {"T3D_SHM_P2P=0", "T3D_SHM_P2P=0", nullptr, "(T3D_SHM_P2P=0)", false, false},
      {"ranks on other hosts", "", nullptr, "is on another host than rank", true, false},
  };
  struct statvfs fs;  // a segment larger than /dev/shm (as ShmFailure.SegmentTooLargeFailsInitClearly)
  if (statvfs("/dev/shm", &fs) == 0 && fs.f_blocks > 0 && fs.f_blocks * fs.f_frsize <= (1ull << 42)) {
    cases.push_back({"a segment too large for /dev/shm",
                     "T3D_SHM_BYTES=" + std::to_string(static_cast<unsigned long long>(fs.f_blocks) * fs.f_frsize),
                     nullptr, "the shared-memory segment cannot be used", false, true});
  }
  for (const Case &c : cases) {
    SCOPED_TRACE(c.what);
    const size_t eq = c.env.find('=');
    if (!c.env.empty()) SetEnv(c.env.substr(0, eq).c_str(), c.env.substr(eq + 1).c_str());
    MemStore mem;
    OtherHostsStore other;
    const auto results = InitEach(2, c.other_hosts ? other.store() : mem.store(), c.transport);
    if (!c.env.empty()) UnsetEnv(c.env.substr(0, eq).c_str());
    for (int r = 0; r < 2; ++r) {
      const std::string &text = results[r].second;
      if (c.fails_with_ucx) {
        EXPECT_NE(results[r].first, T3D_OK) << "rank " << r;
      } else {
        EXPECT_EQ(results[r].first, HasUcx() ? T3D_OK : T3D_ERR_UNSUPPORTED) << "rank " << r << ": " << text;
      }
      if (HasUcx()) continue;
      EXPECT_NE(text.find("this build of t3d has no UCX"), std::string::npos) << text;
      EXPECT_NE(text.find(c.reason), std::string::npos) << text;
      EXPECT_TRUE(MentionsRank(text, r)) << text;
      EXPECT_EQ(text.find('\n'), std::string::npos) << text;
    }
  }
}

// Without UCX a group of one still sends to itself and gathers: it gets a segment too.
TEST(Comm, GroupOfOneSendsToItself) {
  RunRanks(1, [](int, t3d_comm_t *comm) {
    if (!HasUcx()) {
      EXPECT_STREQ(t3d_comm_transport(comm), "shm");
    }
    int32_t out[3] = {7, 8, 9}, in[3] = {0, 0, 0};
    t3d_request_t *rq = nullptr, *sq = nullptr;
    T3D_ASSERT_OK(comm, t3d_recv(comm, in, 3, T3D_INT32, 0, 5, nullptr, &rq));
    T3D_ASSERT_OK(comm, t3d_send(comm, out, 3, T3D_INT32, 0, 5, nullptr, &sq));
    T3D_EXPECT_OK(comm, Finish(sq));
    T3D_EXPECT_OK(comm, Finish(rq));
    EXPECT_EQ(in[0] + in[1] + in[2], 24);
    int32_t g[3] = {0, 0, 0};
    EXPECT_TRUE(RunOk(comm, "gather", [&](t3d_request_t **q) {
      return t3d_gather(comm, out, g, 3, T3D_INT32, 0, nullptr, q);
    }));
    EXPECT_EQ(g[2], 9);
  });
}

// Gather and scatter in place at the root (as MPI_IN_PLACE: the whole buffer, or the root's own block), over
// UCX's algorithms or, in a build without UCX, through the segment.
TEST(Comm, GatherScatterInPlaceAtRoot) {
  const int n = 3, root = 1, count = 5;
  RunRanks(n, [&](int rank, t3d_comm_t *comm) {
    for (int how = 1; how < 3; ++how) {
      std::vector<int32_t> all(n * count, -1), mine(count);
      for (int i = 0; i < count; ++i) mine[i] = 100 * rank + i;
      int32_t *own = all.data() + root * count;
      if (rank == root) std::copy(mine.begin(), mine.end(), own);
      const void *send = rank != root ? mine.data() : how == 1 ? all.data() : own;
      EXPECT_TRUE(RunOk(comm, "gather in place " + std::to_string(how), [&](t3d_request_t **q) {
        return t3d_gather(comm, send, rank == root ? all.data() : nullptr, count, T3D_INT32, root, nullptr, q);
      }));
      if (rank == root) {
        for (int i = 0; i < n * count; ++i) EXPECT_EQ(all[i], 100 * (i / count) + i % count) << "how " << how;
      }
      std::vector<int32_t> got(count, -1);
      void *recv = rank != root ? got.data() : how == 1 ? all.data() : own;
      EXPECT_TRUE(RunOk(comm, "scatter in place " + std::to_string(how), [&](t3d_request_t **q) {
        return t3d_scatter(comm, rank == root ? all.data() : nullptr, recv, count, T3D_INT32, root, nullptr, q);
      }));
      const int32_t *check = rank == root ? own : got.data();
      for (int i = 0; i < count; ++i) EXPECT_EQ(check[i], 100 * rank + i) << "how " << how;
    }
  });
}

// ---------- split ----------

TEST(Comm, SplitColorsKeysAndNoColor) {
  const int n = 7;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    // Colors 0..2 by rank % 3, rank 6 opts out; keys reverse the order inside each color.
    const int color = rank == 6 ? T3D_SPLIT_NOCOLOR : rank % 3;
    t3d_comm_t *sub = nullptr;
    T3D_ASSERT_OK(comm, t3d_comm_split(comm, color, -rank, nullptr, &sub));
    if (color == T3D_SPLIT_NOCOLOR) {
      EXPECT_EQ(sub, nullptr);
      HostBarrier();  // the others meet here before destroying their children
      return;
    }
    ASSERT_NE(sub, nullptr);
    std::vector<int> members;
    for (int r = n - 2; r >= 0; --r)
      if (r % 3 == color) members.push_back(r);  // sorted by key = -r
    const int want_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    EXPECT_EQ(t3d_comm_size(sub), static_cast<int>(members.size())) << "color " << color;
    EXPECT_EQ(t3d_comm_rank(sub), want_rank) << "parent rank " << rank;
    // The new communicator works: sum of parent ranks, and gather shows the order.
    int64_t mine = rank, sum = -1;
    EXPECT_TRUE(RunOk(sub, "allreduce on split", [&](t3d_request_t **q) {
      return t3d_allreduce(sub, &mine, &sum, 1, T3D_INT64, T3D_SUM, nullptr, q);
    }));
    int64_t want_sum = 0;
    for (int m : members) want_sum += m;
    EXPECT_EQ(sum, want_sum);
    std::vector<int32_t> order(members.size(), -1);
    int32_t me = rank;
    EXPECT_TRUE(RunOk(sub, "allgather on split", [&](t3d_request_t **q) {
      return t3d_allgather(sub, &me, order.data(), 1, T3D_INT32, nullptr, q);
    }));
    for (size_t i = 0; i < members.size(); ++i) EXPECT_EQ(order[i], members[i]) << "position " << i;
    // Equal keys: ordered by parent rank. Split the split.
    t3d_config_t cfg;
    t3d_config_init(&cfg);
    cfg.name = "subsub";
    t3d_comm_t *subsub = nullptr;
    T3D_ASSERT_OK(sub, t3d_comm_split(sub, 0, 0, &cfg, &subsub));
    ASSERT_NE(subsub, nullptr);
    EXPECT_EQ(t3d_comm_size(subsub), t3d_comm_size(sub));
    std::vector<int32_t> order2(members.size(), -1);
    EXPECT_TRUE(RunOk(subsub, "allgather on split of split", [&](t3d_request_t **q) {
      return t3d_allgather(subsub, &me, order2.data(), 1, T3D_INT32, nullptr, q);
    }));
    // sub ranks are in members order, so equal keys keep that order.
    for (size_t i = 0; i < members.size(); ++i) EXPECT_EQ(order2[i], members[i]) << "position " << i;
    // The parent still works while the children exist.
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_destroy(subsub), T3D_OK);
    EXPECT_EQ(t3d_comm_destroy(sub), T3D_OK);
  });
}

TEST(Comm, ParentUsableAfterSplit) {
  const int n = 4;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    t3d_comm_t *sub = nullptr;
    T3D_ASSERT_OK(comm, t3d_comm_split(comm, rank / 2, rank, nullptr, &sub));
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(t3d_comm_size(sub), 2);
    int32_t one = 1, total = 0, pair = 0;
    EXPECT_TRUE(RunOk(comm, "allreduce on parent", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, &one, &total, 1, T3D_INT32, T3D_SUM, nullptr, q);
    }));
    EXPECT_TRUE(RunOk(sub, "allreduce on child", [&](t3d_request_t **q) {
      return t3d_allreduce(sub, &one, &pair, 1, T3D_INT32, T3D_SUM, nullptr, q);
    }));
    EXPECT_EQ(total, n);
    EXPECT_EQ(pair, 2);
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_destroy(sub), T3D_OK);
  });
}

// Two communicators over the same ranks, collectives issued on both before either is waited for, in opposite
// orders on even and odd ranks: each communicator has its own sequence, so nothing crosses or deadlocks.
// Collectives on three communicators over the same ranks, issued in different orders on different ranks: every
// call is non-blocking, so they all complete, with small allreduces started inline (the default) or all queued
// (inline_bytes -1; the splits inherit the setting).
class CommOrder : public ::testing::TestWithParam<int64_t> {};

TEST_P(CommOrder, ConcurrentCollectivesOnThreeCommsInAnyOrder) {
  const int n = 4;
  const int64_t inline_bytes = GetParam();
  MemStore second_store;
  const std::string prefix = UniqueName("second");
  RunRanks(n, [&](int rank, t3d_comm_t *world) {
    t3d_config_t cfg;
    t3d_config_init(&cfg);
    cfg.key_prefix = prefix.c_str();
    cfg.name = "second";
    cfg.timeout_ms = TestTimeoutMs();
    cfg.inline_bytes = inline_bytes;
    t3d_comm_t *b = nullptr;
    T3D_ASSERT_OK(nullptr, t3d_comm_init(&b, rank, n, second_store.store(), &cfg));
    t3d_config_t first;
    t3d_config_init(&first);
    first.inline_bytes = inline_bytes;
    t3d_comm_t *a = nullptr;
    T3D_ASSERT_OK(world, t3d_comm_split(world, 0, rank, &first, &a));
    t3d_comm_t *c = nullptr;
    T3D_ASSERT_OK(a, t3d_comm_split(a, 0, n - rank, nullptr, &c));  // same ranks, reversed order
    for (int it = 0; it < 20; ++it) {
      const size_t count = 1 + static_cast<size_t>(it) * 1531;
      std::vector<float> ia(count, 1.0f), ib(count, static_cast<float>(rank)), ic(count, 2.0f);
      std::vector<float> oa(count), ob(count), oc(count);
      t3d_request_t *qa = nullptr, *qb = nullptr, *qc = nullptr;
      auto issue_a = [&] {
        T3D_EXPECT_OK(a, t3d_allreduce(a, ia.data(), oa.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, &qa));
      };
      auto issue_b = [&] {
        T3D_EXPECT_OK(b, t3d_allreduce(b, ib.data(), ob.data(), count, T3D_FLOAT32, T3D_SUM, nullptr, &qb));
      };
      auto issue_c = [&] {
        T3D_EXPECT_OK(c, t3d_allreduce(c, ic.data(), oc.data(), count, T3D_FLOAT32, T3D_MAX, nullptr, &qc));
      };
      if (rank % 2 == 0) {
        issue_a();
        issue_b();
        issue_c();
      } else {
        issue_c();
        issue_b();
        issue_a();
      }
      std::string err;
      EXPECT_EQ(Finish(qc, &err), T3D_OK) << "comm c: " << err;
      EXPECT_EQ(Finish(qa, &err), T3D_OK) << "comm a: " << err;
      EXPECT_EQ(Finish(qb, &err), T3D_OK) << "comm b: " << err;
      const float want_b = static_cast<float>(n * (n - 1) / 2);
      for (size_t i = 0; i < count; i += 97) {
        ASSERT_EQ(oa[i], static_cast<float>(n)) << "iteration " << it << " element " << i;
        ASSERT_EQ(ob[i], want_b) << "iteration " << it << " element " << i;
        ASSERT_EQ(oc[i], 2.0f) << "iteration " << it << " element " << i;
      }
      if (::testing::Test::HasFailure()) break;
    }
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_destroy(c), T3D_OK);
    EXPECT_EQ(t3d_comm_destroy(a), T3D_OK);
    EXPECT_EQ(t3d_comm_destroy(b), T3D_OK);
  });
}

INSTANTIATE_TEST_SUITE_P(Inline, CommOrder, ::testing::Values(T3D_INLINE_DEFAULT, -1),
                         [](const ::testing::TestParamInfo<int64_t> &i) {
                           return std::string(i.param == -1 ? "Queued" : "InlineDefault");
                         });

// With the default (inline) setting, small collectives (allreduce, barrier, broadcast, allgather, reduce_scatter) on
// an idle communicator are done when the call returns, and collectives on two communicators over the same ranks,
// issued in the same order everywhere, interleave correctly, as do queued (large) and inline (small) ones on one
// communicator.
TEST(Comm, SmallCollectivesRunInline) {
  const int n = 4;
  // Peers get all the time they need to arrive, so that "done on return" does not depend on scheduling. Read when
  // a communicator is created: the split below sees it, the other tests do not.
  SetEnv("T3D_INLINE_WAIT_NS", "600000000000");
  RunRanks(n, [&](int rank, t3d_comm_t *a) {
    if (std::string(t3d_comm_transport(a)).find("shm") == std::string::npos) GTEST_SKIP() << "no shared memory";
    t3d_comm_t *b = nullptr;
    T3D_ASSERT_OK(a, t3d_comm_split(a, 0, rank, nullptr, &b));
    for (int it = 0; it < 50; ++it) {
      const size_t small = 1 + static_cast<size_t>(it), large = 300000;  // large: above 64 KiB, queued
      std::vector<float> s1(small, 1.0f), r1(small), s2(small, static_cast<float>(rank)), r2(small);
      std::vector<float> sl(large, 0.5f), rl(large);
      t3d_request_t *q1 = nullptr, *q2 = nullptr, *ql = nullptr, *q3 = nullptr;
      T3D_EXPECT_OK(a, t3d_allreduce(a, s1.data(), r1.data(), small, T3D_FLOAT32, T3D_SUM, nullptr, &q1));
      EXPECT_EQ(t3d_test(q1), T3D_OK) << "a small allreduce on an idle communicator should be done on return";
      // So are a barrier and a small broadcast (the root of which does not wait at all).
      t3d_request_t *qb = nullptr, *qc = nullptr;
      T3D_EXPECT_OK(a, t3d_barrier(a, nullptr, &qb));
      EXPECT_EQ(t3d_test(qb), T3D_OK) << "a barrier on an idle communicator should be done on return";
      std::vector<int32_t> bc(small, rank == it % n ? it : -1);
      T3D_EXPECT_OK(a, t3d_broadcast(a, bc.data(), small, T3D_INT32, it % n, nullptr, &qc));
      EXPECT_EQ(t3d_test(qc), T3D_OK) << "a small broadcast on an idle communicator should be done on return";
      t3d_request_t *qg = nullptr;
      std::vector<int32_t> mine(small, rank), all(small * n, -1);
      T3D_EXPECT_OK(a, t3d_allgather(a, mine.data(), all.data(), small, T3D_INT32, nullptr, &qg));
      EXPECT_EQ(t3d_test(qg), T3D_OK) << "a small allgather on an idle communicator should be done on return";
      t3d_request_t *qr = nullptr;
      std::vector<float> rsin(small * n, static_cast<float>(rank + 1)), rsout(small, -1.0f);
      T3D_EXPECT_OK(a, t3d_reduce_scatter(a, rsin.data(), rsout.data(), small, T3D_FLOAT32, T3D_AVG, nullptr, &qr));
      EXPECT_EQ(t3d_test(qr), T3D_OK) << "a small reduce_scatter on an idle communicator should be done on return";
      // An alltoall with uneven blocks (rank p sends q a block of p + q + it % 3 elements, some empty at it % 3 = 0
      // for p = q = 0).
      t3d_request_t *qa = nullptr;
      std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
      for (int q = 0; q < n; ++q) {
        sc[q] = static_cast<size_t>(rank + q + it % 3);
        rc[q] = static_cast<size_t>(q + rank + it % 3);
        sd[q] = q == 0 ? 0 : sd[q - 1] + sc[q - 1];
        rd[q] = q == 0 ? 0 : rd[q - 1] + rc[q - 1];
      }
      std::vector<int32_t> as(sd[n - 1] + sc[n - 1]), ar(rd[n - 1] + rc[n - 1], -1);
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < sc[q]; ++i) as[sd[q] + i] = 1000 * rank + 100 * q + static_cast<int32_t>(i);
      T3D_EXPECT_OK(a, t3d_alltoallv(a, as.data(), sc.data(), sd.data(), ar.data(), rc.data(), rd.data(),
                                     T3D_INT32, nullptr, &qa));
      EXPECT_EQ(t3d_test(qa), T3D_OK) << "a small alltoall on an idle communicator should be done on return";
      std::string berr;
      EXPECT_EQ(Finish(qb, &berr), T3D_OK) << berr;
      EXPECT_EQ(Finish(qc, &berr), T3D_OK) << berr;
      EXPECT_EQ(Finish(qg, &berr), T3D_OK) << berr;
      EXPECT_EQ(Finish(qr, &berr), T3D_OK) << berr;
      EXPECT_EQ(Finish(qa, &berr), T3D_OK) << berr;
      for (int p = 0; p < n; ++p)
        for (size_t i = 0; i < rc[p]; ++i)
          ASSERT_EQ(ar[rd[p] + i], 1000 * p + 100 * rank + static_cast<int32_t>(i)) << "iteration " << it;
      ASSERT_EQ(rsout[small - 1], (n + 1) / 2.0f) << "iteration " << it;
      ASSERT_EQ(bc[small - 1], it) << "iteration " << it;
      for (int p = 0; p < n; ++p) ASSERT_EQ(all[p * small + small - 1], p) << "iteration " << it;
      T3D_EXPECT_OK(b, t3d_allreduce(b, s2.data(), r2.data(), small, T3D_FLOAT32, T3D_MAX, nullptr, &q2));
      T3D_EXPECT_OK(a, t3d_allreduce(a, sl.data(), rl.data(), large, T3D_FLOAT32, T3D_SUM, nullptr, &ql));
      // Queued behind the large one: must not overtake it.
      T3D_EXPECT_OK(a, t3d_allreduce(a, r1.data(), r1.data(), small, T3D_FLOAT32, T3D_SUM, nullptr, &q3));
      std::string err;
      EXPECT_EQ(Finish(q1, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(q2, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(ql, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(q3, &err), T3D_OK) << err;
      ASSERT_EQ(r1[small - 1], static_cast<float>(n * n)) << "iteration " << it;
      ASSERT_EQ(r2[0], static_cast<float>(n - 1)) << "iteration " << it;
      ASSERT_EQ(rl[large - 1], 0.5f * n) << "iteration " << it;
    }
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_comm_destroy(b), T3D_OK);
  });
  UnsetEnv("T3D_INLINE_WAIT_NS");
}

// Allgather and alltoall blocks, and broadcasts, that are read straight from their owner (single copy;
// T3D_SHM_DIRECT_BYTES=1 and T3D_SHM_BCAST_DIRECT_BYTES=1 put every size up to their maximum in that range) start on
// the caller's thread too: small non-blocking ones on an idle communicator are done on return, with every rank's
// block read (the owner returns only once its readers are done), with new data on every iteration.
TEST(Comm, SmallSingleCopyCollectivesRunInline) {
  const int n = 3;
  SetEnv("T3D_INLINE_WAIT_NS", "600000000000");
  SetEnv("T3D_SHM_DIRECT_BYTES", "1");
  SetEnv("T3D_SHM_BCAST_DIRECT_BYTES", "1");
  RunRanks(n, [&](int rank, t3d_comm_t *c) {
    if (std::string(t3d_comm_transport(c)).find("shm") == std::string::npos) GTEST_SKIP() << "no shared memory";
    for (int it = 0; it < 50; ++it) {
      const size_t m = 1 + static_cast<size_t>(it) * 37;  // 1 .. 1814 elements per block
      std::vector<int32_t> mine(m), all(m * n, -1), sendv(m * n), recvv(m * n, -1);
      for (size_t i = 0; i < m; ++i) mine[i] = 1000000 * rank + 1000 * it + static_cast<int32_t>(i % 997);
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < m; ++i)
          sendv[q * m + i] = 1000000 * rank + 10000 * q + it * 10 + static_cast<int32_t>(i % 7);
      t3d_request_t *qg = nullptr, *qa = nullptr;
      T3D_EXPECT_OK(c, t3d_allgather(c, mine.data(), all.data(), m, T3D_INT32, nullptr, &qg));
      EXPECT_EQ(t3d_test(qg), T3D_OK) << "a small single-copy allgather on an idle communicator should be done on "
                                         "return, iteration " << it;
      std::string err;
      EXPECT_EQ(Finish(qg, &err), T3D_OK) << err;
      T3D_EXPECT_OK(c, t3d_alltoall(c, sendv.data(), recvv.data(), m, T3D_INT32, nullptr, &qa));
      EXPECT_EQ(t3d_test(qa), T3D_OK) << "a small single-copy alltoall on an idle communicator should be done on "
                                         "return, iteration " << it;
      EXPECT_EQ(Finish(qa, &err), T3D_OK) << err;
      const int root = it % n;
      std::vector<int32_t> bc(m * 8, -1);  // up to 58 kB (T3D_INLINE_BYTES)
      if (rank == root)
        for (size_t i = 0; i < bc.size(); ++i) bc[i] = 1000 * it + static_cast<int32_t>(i % 991);
      t3d_request_t *qb = nullptr;
      T3D_EXPECT_OK(c, t3d_broadcast(c, bc.data(), bc.size(), T3D_INT32, root, nullptr, &qb));
      EXPECT_EQ(t3d_test(qb), T3D_OK) << "a single-copy broadcast on an idle communicator should be done on "
                                         "return, iteration " << it;
      EXPECT_EQ(Finish(qb, &err), T3D_OK) << err;
      for (size_t i = 0; i < bc.size(); ++i)
        ASSERT_EQ(bc[i], 1000 * it + static_cast<int32_t>(i % 991)) << "broadcast, iteration " << it << ", element " << i;
      for (int p = 0; p < n; ++p) {
        for (size_t i = 0; i < m; ++i) {
          ASSERT_EQ(all[p * m + i], 1000000 * p + 1000 * it + static_cast<int32_t>(i % 997))
              << "allgather, iteration " << it << ", block of rank " << p;
          ASSERT_EQ(recvv[p * m + i], 1000000 * p + 10000 * rank + it * 10 + static_cast<int32_t>(i % 7))
              << "alltoall, iteration " << it << ", block from rank " << p;
        }
      }
    }
  });
  UnsetEnv("T3D_SHM_DIRECT_BYTES");
  UnsetEnv("T3D_SHM_BCAST_DIRECT_BYTES");
  UnsetEnv("T3D_INLINE_WAIT_NS");
}

// ---------- argument checking ----------

struct BadCall {
  std::string what;      // for messages
  std::string argument;  // the name the error text must contain
  IssueFn issue;
};

TEST(Comm, BadArgumentsAreNamed) {
  const int n = 2;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    float f[8] = {0};
    float g[8] = {0};
    size_t counts[2] = {1, 1}, displs[2] = {0, 1};
    size_t wrong_counts[2] = {3, 3};
    std::vector<BadCall> calls = {
        {"allreduce NULL sendbuf", "sendbuf",
         [&](t3d_request_t **q) { return t3d_allreduce(comm, nullptr, g, 4, T3D_FLOAT32, T3D_SUM, nullptr, q); }},
        {"allreduce NULL recvbuf", "recvbuf",
         [&](t3d_request_t **q) { return t3d_allreduce(comm, f, nullptr, 4, T3D_FLOAT32, T3D_SUM, nullptr, q); }},
        {"allreduce bad dtype", "dtype",
         [&](t3d_request_t **q) {
           return t3d_allreduce(comm, f, g, 4, static_cast<t3d_dtype_t>(T3D_DTYPE_COUNT), T3D_SUM, nullptr, q);
         }},
        {"allreduce negative dtype", "dtype",
         [&](t3d_request_t **q) {
           return t3d_allreduce(comm, f, g, 4, static_cast<t3d_dtype_t>(-3), T3D_SUM, nullptr, q);
         }},
        {"allreduce bad op", "op",
         [&](t3d_request_t **q) {
           return t3d_allreduce(comm, f, g, 4, T3D_FLOAT32, static_cast<t3d_redop_t>(T3D_REDOP_COUNT), nullptr, q);
         }},
        {"broadcast root = size", "root",
         [&](t3d_request_t **q) { return t3d_broadcast(comm, f, 4, T3D_FLOAT32, n, nullptr, q); }},
        {"broadcast root = -1", "root",
         [&](t3d_request_t **q) { return t3d_broadcast(comm, f, 4, T3D_FLOAT32, -1, nullptr, q); }},
        {"broadcast NULL buf", "buf",
         [&](t3d_request_t **q) { return t3d_broadcast(comm, nullptr, 4, T3D_FLOAT32, 0, nullptr, q); }},
        {"reduce root = size", "root",
         [&](t3d_request_t **q) { return t3d_reduce(comm, f, g, 4, T3D_FLOAT32, T3D_SUM, n, nullptr, q); }},
        {"gather root = size + 3", "root",
         [&](t3d_request_t **q) { return t3d_gather(comm, f, g, 1, T3D_FLOAT32, n + 3, nullptr, q); }},
        {"scatter root = -2", "root",
         [&](t3d_request_t **q) { return t3d_scatter(comm, f, g, 1, T3D_FLOAT32, -2, nullptr, q); }},
        {"allgather NULL recvbuf", "recvbuf",
         [&](t3d_request_t **q) { return t3d_allgather(comm, f, nullptr, 2, T3D_FLOAT32, nullptr, q); }},
        {"allgatherv sendcount != recvcounts[rank]", "sendcount",
         [&](t3d_request_t **q) {
           return t3d_allgatherv(comm, f, 2, g, counts, displs, T3D_FLOAT32, nullptr, q);
         }},
        {"allgatherv NULL recvcounts", "recvcounts",
         [&](t3d_request_t **q) { return t3d_allgatherv(comm, f, 1, g, nullptr, displs, T3D_FLOAT32, nullptr, q); }},
        {"reduce_scatterv NULL recvcounts", "recvcounts",
         [&](t3d_request_t **q) {
           return t3d_reduce_scatterv(comm, f, g, nullptr, T3D_FLOAT32, T3D_SUM, nullptr, q);
         }},
        {"alltoallv NULL sendcounts", "sendcounts",
         [&](t3d_request_t **q) {
           return t3d_alltoallv(comm, f, nullptr, displs, g, counts, displs, T3D_FLOAT32, nullptr, q);
         }},
        {"alltoall NULL sendbuf", "sendbuf",
         [&](t3d_request_t **q) { return t3d_alltoall(comm, nullptr, g, 2, T3D_FLOAT32, nullptr, q); }},
        {"send peer = size", "peer",
         [&](t3d_request_t **q) { return t3d_send(comm, f, 1, T3D_FLOAT32, n, 0, nullptr, q); }},
        {"send peer = ANY_SOURCE", "peer",
         [&](t3d_request_t **q) { return t3d_send(comm, f, 1, T3D_FLOAT32, T3D_ANY_SOURCE, 0, nullptr, q); }},
        {"recv peer = -5", "peer",
         [&](t3d_request_t **q) { return t3d_recv(comm, f, 1, T3D_FLOAT32, -5, 0, nullptr, q); }},
        {"send NULL buf", "buf",
         [&](t3d_request_t **q) { return t3d_send(comm, nullptr, 1, T3D_FLOAT32, 1 - rank, 0, nullptr, q); }},
        {"send tag > T3D_MAX_TAG", "tag",
         [&](t3d_request_t **q) { return t3d_send(comm, f, 1, T3D_FLOAT32, 1 - rank, T3D_MAX_TAG + 1, nullptr, q); }},
        {"recv negative tag", "tag",
         [&](t3d_request_t **q) { return t3d_recv(comm, f, 1, T3D_FLOAT32, 1 - rank, -1, nullptr, q); }},
        {"send bad dtype", "dtype",
         [&](t3d_request_t **q) {
           return t3d_send(comm, f, 1, static_cast<t3d_dtype_t>(99), 1 - rank, 0, nullptr, q);
         }},
    };
    (void)wrong_counts;
    for (const BadCall &c : calls) {
      std::string err;
      t3d_result_t r = RunResult(c.issue, &err);
      EXPECT_EQ(r, T3D_ERR_INVALID_ARG) << "rank " << rank << ": " << c.what << " -> " << t3d_result_string(r);
      const std::string text = t3d_comm_last_error(comm);
      EXPECT_NE(text.find(c.argument), std::string::npos)
          << "rank " << rank << ": " << c.what << ": last error does not name '" << c.argument << "': " << text;
      EXPECT_TRUE(MentionsRank(text, rank)) << "rank " << rank << ": " << c.what << ": last error does not name the rank: "
                                            << text;
      EXPECT_EQ(t3d_comm_status(comm), T3D_OK) << c.what << ": a bad argument must not break the communicator";
    }
    // A NULL request pointer, and NULL buffers with a zero count (allowed).
    EXPECT_EQ(t3d_allreduce(comm, f, g, 1, T3D_FLOAT32, T3D_SUM, nullptr, nullptr), T3D_ERR_INVALID_ARG);
    EXPECT_EQ(t3d_allreduce(nullptr, f, g, 1, T3D_FLOAT32, T3D_SUM, nullptr, nullptr), T3D_ERR_INVALID_ARG);
    EXPECT_TRUE(RunOk(comm, "allreduce of 0 elements with NULL buffers", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, nullptr, nullptr, 0, T3D_FLOAT32, T3D_SUM, nullptr, q);
    }));
    // The sequence stayed in step: a real collective still matches across ranks.
    float one = 1.0f, sum = 0.0f;
    EXPECT_TRUE(RunOk(comm, "allreduce after bad arguments", [&](t3d_request_t **q) {
      return t3d_allreduce(comm, &one, &sum, 1, T3D_FLOAT32, T3D_SUM, nullptr, q);
    }));
    EXPECT_EQ(sum, static_cast<float>(n));
  });
}

TEST(Comm, NullRequestHandles) {
  EXPECT_EQ(t3d_test(nullptr), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_wait(nullptr, 0), T3D_ERR_INVALID_ARG);
  t3d_request_free(nullptr);  // must be a no-op
  EXPECT_EQ(t3d_comm_destroy(nullptr), T3D_ERR_INVALID_ARG);
}

// ---------- timeouts ----------

// Rank 1 never joins the allreduce: rank 0's request fails with T3D_ERR_TIMEOUT within twice the configured
// timeout, and the text names the collective and rank 1.
TEST(Comm, CollectiveTimesOutNamingMissingRank) {
  RunOptions o;
  o.comm_timeout_ms = 1000;
  o.abort_on_failure = false;
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    if (rank == 0) {
      float x[4] = {1, 2, 3, 4}, y[4];
      t3d_request_t *q = nullptr;
      const auto t0 = Clock::now();
      T3D_EXPECT_OK(comm, t3d_allreduce(comm, x, y, 4, T3D_FLOAT32, T3D_SUM, nullptr, &q));
      if (q) {
        const t3d_result_t r = t3d_wait(q, 10000);
        const int64_t took = MsSince(t0);
        const std::string text = t3d_request_error(q);
        EXPECT_EQ(r, T3D_ERR_TIMEOUT) << t3d_result_string(r) << ": " << text;
        EXPECT_LT(took, 2000) << "timeout of 1000 ms took " << took << " ms to report";
        EXPECT_GE(took, 900) << "reported before the timeout";
        EXPECT_NE(text.find("allreduce"), std::string::npos) << text;
        EXPECT_TRUE(MentionsRank(text, 1)) << "does not name the missing rank 1: " << text;
        t3d_request_free(q);
        EXPECT_NE(t3d_comm_status(comm), T3D_OK) << "a timed-out collective leaves the communicator broken";
      }
    }
    HostBarrier();
  }, o);
}

// A per-call timeout (opts.timeout_ms) overrides the communicator's.
TEST(Comm, PerCallTimeout) {
  RunOptions o;
  o.comm_timeout_ms = 60000;
  o.abort_on_failure = false;
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    if (rank == 1) {
      t3d_opts_t opts{};
      opts.timeout_ms = 500;
      opts.premul_scalar = 1.0;
      const auto t0 = Clock::now();
      std::string err;
      t3d_result_t r = RunResult([&](t3d_request_t **q) { return t3d_barrier(comm, &opts, q); }, &err);
      const int64_t took = MsSince(t0);
      EXPECT_EQ(r, T3D_ERR_TIMEOUT) << err;
      EXPECT_LT(took, 1000) << "timeout of 500 ms took " << took << " ms";
      EXPECT_NE(err.find("barrier"), std::string::npos) << err;
      EXPECT_TRUE(MentionsRank(err, 0)) << err;
    }
    HostBarrier();
  }, o);
}

// A wait that gives up returns T3D_ERR_TIMEOUT but leaves the operation running; it then completes normally.
TEST(Comm, ShortWaitLeavesOperationRunning) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    int32_t v = rank + 1, s = 0;
    t3d_request_t *q = nullptr;
    if (rank == 0) {
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, &v, &s, 1, T3D_INT32, T3D_SUM, nullptr, &q));
      EXPECT_EQ(t3d_wait(q, 50), T3D_ERR_TIMEOUT);
      EXPECT_EQ(t3d_test(q), T3D_IN_PROGRESS);
      EXPECT_EQ(t3d_comm_status(comm), T3D_OK);
      if (!HostBarrier()) return;
    } else {
      if (!HostBarrier()) return;
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, &v, &s, 1, T3D_INT32, T3D_SUM, nullptr, &q));
    }
    std::string err;
    EXPECT_EQ(Finish(q, &err), T3D_OK) << err;
    EXPECT_EQ(s, 3);
  });
}

// ---------- abort ----------

// Another thread aborts while a request is pending: it completes with T3D_ERR_ABORTED quickly, and later calls
// fail the same way.
TEST(Comm, AbortFromAnotherThread) {
  RunOptions o;
  o.abort_on_failure = false;
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    if (rank == 0) {
      float x[4] = {0}, y[4] = {0};
      t3d_request_t *coll = nullptr, *recv = nullptr;
      T3D_EXPECT_OK(comm, t3d_allreduce(comm, x, y, 4, T3D_FLOAT32, T3D_SUM, nullptr, &coll));
      T3D_EXPECT_OK(comm, t3d_recv(comm, y, 4, T3D_FLOAT32, 1, 77, nullptr, &recv));
      std::atomic<bool> aborted{false};
      Clock::time_point t_abort;
      std::thread killer([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        t_abort = Clock::now();
        aborted.store(true);
        EXPECT_EQ(t3d_comm_abort(comm), T3D_OK);
      });
      t3d_result_t r = coll ? t3d_wait(coll, 10000) : T3D_ERR_INTERNAL;
      const int64_t after_abort = aborted.load() ? MsSince(t_abort) : -1;
      EXPECT_EQ(r, T3D_ERR_ABORTED) << t3d_result_string(r);
      EXPECT_TRUE(aborted.load()) << "the request ended before the abort";
      EXPECT_LT(after_abort, 1000) << "abort took " << after_abort << " ms to complete the request";
      if (recv) {
        EXPECT_EQ(t3d_wait(recv, 2000), T3D_ERR_ABORTED);
      }
      killer.join();
      if (coll) t3d_request_free(coll);
      if (recv) t3d_request_free(recv);
      EXPECT_EQ(t3d_comm_status(comm), T3D_ERR_ABORTED);
      // Later requests fail at once too (at the call or at completion).
      std::string err;
      r = RunResult([&](t3d_request_t **q) { return t3d_barrier(comm, nullptr, q); }, &err);
      EXPECT_EQ(r, T3D_ERR_ABORTED) << t3d_result_string(r);
      // Aborting twice is harmless.
      EXPECT_EQ(t3d_comm_abort(comm), T3D_OK);
    }
    HostBarrier();
  }, o);
}

// A callback set on a pending request runs with T3D_ERR_ABORTED when the communicator is aborted.
TEST(Comm, AbortRunsCallbacks) {
  RunOptions o;
  o.abort_on_failure = false;
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    if (rank == 1) {
      int32_t buf = 0;
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, &buf, 1, T3D_INT32, 0, 5, nullptr, &q));
      static std::atomic<int> calls;
      static std::atomic<int> result;
      calls = 0;
      result = 1;
      T3D_EXPECT_OK(comm, t3d_request_set_callback(q, [](void *, t3d_result_t res) {
        result.store(res);
        calls.fetch_add(1);
      }, nullptr));
      EXPECT_EQ(t3d_comm_abort(comm), T3D_OK);
      EXPECT_EQ(t3d_wait(q, 5000), T3D_ERR_ABORTED);
      const auto t0 = Clock::now();
      while (calls.load() == 0 && MsSince(t0) < 5000) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      EXPECT_EQ(calls.load(), 1);
      EXPECT_EQ(result.load(), T3D_ERR_ABORTED);
      t3d_request_free(q);
    }
    HostBarrier();
  }, o);
}

}  // namespace
