// test_shm_p2p.cc: point-to-point between ranks of one host (c_src/shm/p2p.c): more messages than a ring holds
// before any receive exists, order between messages that travel in a slot and ones read from the sender's buffer,
// any-source receives over both, a rendezvous send nobody receives (timeout, then the late receive is told), a
// receive that times out, an abort that ends a blocked receive, and long messages through the staging areas
// (c_src/shm/stage.c). Ranks are threads here; test_fork covers processes (process_vm_readv).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

// Message `tag` from `from`: a recognisable float pattern of n elements.
std::vector<float> Message(int from, int tag, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(from * 100000 + tag * 100 + static_cast<int>(i % 89));
  return v;
}

// Slots carry up to 4 KiB at 2-8 ranks (T3D_SHM_P2P_EAGER_BYTES), up to 32 B of it in the slot's header line; these
// sizes take each of the three ways.
const size_t kSmall = 5;     // 20 B: in the slot's header line
const size_t kMid = 200;     // 800 B: in the slot, after its header
const size_t kLarge = 6000;  // 24000 B: read from the sender's buffer

size_t SizeOf(int tag) {
  if (tag % 2 == 1) return kLarge + static_cast<size_t>(tag);
  return tag % 4 == 0 ? kSmall : kMid + static_cast<size_t>(tag);
}

void SkipUnlessShm(t3d_comm_t *comm) {
  if (std::string(t3d_comm_transport(comm)).find("shm") == std::string::npos) GTEST_SKIP() << "no shared memory";
}

// 40 messages (5x the slots of a ring), half of them rendezvous, the others in slots (short and long), all sent
// before the receiver posts anything; it then receives them in reverse tag order. The sender's calls never block;
// its sends complete as room appears.
TEST(ShmP2P, MoreMessagesThanSlotsBeforeAnyReceive) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    const int kMsgs = 40;
    if (rank == 0) {
      std::vector<std::vector<float>> out;
      std::vector<t3d_request_t *> reqs;
      for (int t = 0; t < kMsgs; ++t) out.push_back(Message(0, t, SizeOf(t)));
      for (int t = 0; t < kMsgs; ++t) {
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_send(comm, out[t].data(), out[t].size(), T3D_FLOAT32, 1, t, nullptr, &q));
        reqs.push_back(q);
      }
      if (!HostBarrier()) return;
      for (int t = 0; t < kMsgs; ++t) {
        std::string err;
        EXPECT_EQ(Finish(reqs[t], &err), T3D_OK) << Tag(rank, "send " + std::to_string(t)) << ": " << err;
      }
    } else {
      if (!HostBarrier()) return;
      for (int t = kMsgs - 1; t >= 0; --t) {
        std::vector<float> in(SizeOf(t) + 3, -1.0f);
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 0, t, nullptr, &q));
        ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << Tag(rank, "recv tag " + std::to_string(t)) << ": "
                                                        << t3d_request_error(q);
        EXPECT_EQ(t3d_request_count(q), SizeOf(t)) << Tag(rank, "count of tag " + std::to_string(t));
        EXPECT_EQ(t3d_request_source(q), 0);
        t3d_request_free(q);
        std::vector<float> want = Message(0, t, SizeOf(t));
        EXPECT_EQ(0, memcmp(in.data(), want.data(), want.size() * sizeof(float))) << Tag(rank, "tag " + std::to_string(t));
        EXPECT_EQ(in[SizeOf(t)], -1.0f) << Tag(rank, "wrote past the message of tag " + std::to_string(t));
      }
    }
  });
}

// Same tag, alternating slot and rendezvous messages, received as they were sent: order holds across both.
TEST(ShmP2P, SameTagKeepsOrderAcrossSizes) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    const int kMsgs = 12;
    const int tag = 7;
    if (rank == 0) {
      std::vector<std::vector<float>> out;
      std::vector<t3d_request_t *> reqs;
      for (int i = 0; i < kMsgs; ++i) out.push_back(Message(0, i, SizeOf(i)));
      for (int i = 0; i < kMsgs; ++i) {
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_send(comm, out[i].data(), out[i].size(), T3D_FLOAT32, 1, tag, nullptr, &q));
        reqs.push_back(q);
      }
      for (t3d_request_t *q : reqs) EXPECT_EQ(Finish(q), T3D_OK);
    } else {
      for (int i = 0; i < kMsgs; ++i) {
        std::vector<float> in(kLarge + kMsgs, -1.0f);
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 0, tag, nullptr, &q));
        ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q);
        ASSERT_EQ(t3d_request_count(q), SizeOf(i)) << Tag(rank, "message " + std::to_string(i) + " out of order");
        t3d_request_free(q);
        std::vector<float> want = Message(0, i, SizeOf(i));
        EXPECT_EQ(0, memcmp(in.data(), want.data(), want.size() * sizeof(float))) << Tag(rank, "message " + std::to_string(i));
      }
    }
  });
}

// Every other rank sends a slot message and a rendezvous one (same tag); rank 0 takes all with any-source
// receives. Each (source, size) arrives once, and from each source the small one first.
TEST(ShmP2P, AnySourceOverBothProtocols) {
  const int n = 4;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    const int tag = 3;
    if (rank != 0) {
      std::vector<float> a = Message(rank, 0, kSmall), b = Message(rank, 1, kLarge);
      t3d_request_t *qa = nullptr, *qb = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, a.data(), a.size(), T3D_FLOAT32, 0, tag, nullptr, &qa));
      T3D_ASSERT_OK(comm, t3d_send(comm, b.data(), b.size(), T3D_FLOAT32, 0, tag, nullptr, &qb));
      EXPECT_EQ(Finish(qa), T3D_OK);
      EXPECT_EQ(Finish(qb), T3D_OK);
      return;
    }
    std::map<int, std::vector<size_t>> seen;
    for (int i = 0; i < 2 * (n - 1); ++i) {
      std::vector<float> in(kLarge, -1.0f);
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, T3D_ANY_SOURCE, tag, nullptr, &q));
      ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q);
      const int src = t3d_request_source(q);
      const size_t cnt = t3d_request_count(q);
      t3d_request_free(q);
      ASSERT_TRUE(src >= 1 && src < n) << "source " << src;
      std::vector<float> want = Message(src, cnt == kSmall ? 0 : 1, cnt);
      EXPECT_EQ(0, memcmp(in.data(), want.data(), cnt * sizeof(float))) << "from rank " << src << ", " << cnt;
      seen[src].push_back(cnt);
    }
    for (int p = 1; p < n; ++p) EXPECT_EQ(seen[p], (std::vector<size_t>{kSmall, kLarge})) << "from rank " << p;
  });
}

// A rendezvous send nobody receives times out and names its peer; a receive posted after that is told the sender
// gave the message up, and the pair still works afterwards.
TEST(ShmP2P, UnreceivedRendezvousSendTimesOut) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    std::vector<float> big = Message(0, 1, kLarge);
    std::vector<float> in(kLarge, -1.0f);
    t3d_opts_t opts{};
    opts.timeout_ms = 300;
    if (rank == 0) {
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, big.data(), big.size(), T3D_FLOAT32, 1, 1, &opts, &q));
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_ERR_TIMEOUT);
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
      EXPECT_LT(ms.count(), 5000) << "the timeout came late";
      EXPECT_GE(ms.count(), 290) << "the timeout came early";
      const std::string err = t3d_request_error(q);
      EXPECT_NE(err.find("send to rank 1"), std::string::npos) << err;
      EXPECT_NE(err.find("timed out"), std::string::npos) << err;
      t3d_request_free(q);
    }
    if (!HostBarrier()) return;
    if (rank == 1) {
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 0, 1, nullptr, &q));
      EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_ERR_ABORTED);
      const std::string err = t3d_request_error(q);
      EXPECT_NE(err.find("gave the message up"), std::string::npos) << err;
      t3d_request_free(q);
    }
    // A fresh exchange on the same pair.
    t3d_request_t *q = nullptr;
    if (rank == 0) T3D_ASSERT_OK(comm, t3d_send(comm, big.data(), big.size(), T3D_FLOAT32, 1, 2, nullptr, &q));
    else T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 0, 2, nullptr, &q));
    ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << Tag(rank, t3d_request_error(q));
    t3d_request_free(q);
    if (rank == 1) {
      EXPECT_EQ(0, memcmp(in.data(), big.data(), big.size() * sizeof(float)));
    }
  });
}

// A receive whose sender never sends times out with the peer and tag in its text, neither early nor late (its
// deadline is stamped by the first pass after the post that reads the clock).
TEST(ShmP2P, ReceiveTimeoutNamesPeer) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    if (rank == 1) return;
    std::vector<float> in(kSmall);
    t3d_opts_t opts{};
    opts.timeout_ms = 200;
    t3d_request_t *q = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 1, 9, &opts, &q));
    EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_ERR_TIMEOUT);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    EXPECT_GE(ms.count(), 200) << "the timeout came early";
    EXPECT_LT(ms.count(), 5000) << "the timeout came late";
    const std::string err = t3d_request_error(q);
    EXPECT_NE(err.find("recv from rank 1"), std::string::npos) << err;
    EXPECT_NE(err.find("tag 9"), std::string::npos) << err;
    t3d_request_free(q);
  });
}

// t3d_comm_abort from another thread ends a receive that a caller is blocked on.
TEST(ShmP2P, AbortEndsBlockedReceive) {
  RunOptions opts;
  opts.abort_on_failure = false;
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    if (rank == 1) return;
    std::vector<float> in(kLarge);
    t3d_request_t *q = nullptr;
    T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 1, 4, nullptr, &q));
    std::thread aborter([comm] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      t3d_comm_abort(comm);
    });
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_ERR_ABORTED) << t3d_request_error(q);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    EXPECT_LT(ms.count(), 3000) << "the abort took effect late";
    aborter.join();
    t3d_request_free(q);
  }, opts);
}

// Long messages through the pairs' staging areas (from T3D_SHM_P2P_STAGE_MIN_BYTES, 4 MiB): a ring shift of 3
// ranks over sizes that end in a partial chunk, in both directions in turn, then one-way messages whose receive is
// posted late (the message waits in the unexpected queue), whose sender leaves its send alone for a while (the
// receiver must read the chunks itself), and one received truncated (only its head is read; the next message on
// the pair must still arrive whole). Each element names its sender, message and index.
float StagedValue(int from, int msg, size_t i) {
  return static_cast<float>(from * 1000003 + msg * 7919 + static_cast<int>(i % 1000081));
}

::testing::AssertionResult StagedArrived(const std::vector<float> &in, int from, int msg, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (in[i] != StagedValue(from, msg, i))
      return ::testing::AssertionFailure() << "message " << msg << " from rank " << from << ", element " << i
                                           << " of " << n << ": got " << in[i] << ", expected "
                                           << StagedValue(from, msg, i);
  for (size_t i = n; i < in.size(); ++i)
    if (in[i] != -1.0f) return ::testing::AssertionFailure() << "message " << msg << " wrote element " << i;
  return ::testing::AssertionSuccess();
}

std::vector<float> StagedMessage(int from, int msg, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = StagedValue(from, msg, i);
  return v;
}

TEST(ShmP2P, StagedRingShiftAndOneWay) {
  const int n = 3;
  SetEnv("T3D_SHM_P2P_STAGE_BYTES", "2097152");  // with more ranks than cores there are none by default
  SetEnv("T3D_SHM_P2P_STAGE_MIN_BYTES", "4194304");  // its 4 MiB messages staged too (on AMD's CPUs 8 MiB unset)
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    const size_t sizes[] = {(size_t{1} << 20) + 7, (size_t{1} << 22) + 13, size_t{3} << 20, (size_t{1} << 20) + 1};
    int msg = 0;
    for (size_t cnt : sizes) {
      for (int dir = 1; dir <= 2; ++dir, ++msg) {  // to the next rank, then to the previous one
        const int to = (rank + dir) % n, from = (rank + n * 2 - dir) % n;
        std::vector<float> out = StagedMessage(rank, msg, cnt), in(cnt + 5, -1.0f);
        t3d_request_t *rq = nullptr, *sq = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, from, msg, nullptr, &rq));
        T3D_ASSERT_OK(comm, t3d_send(comm, out.data(), cnt, T3D_FLOAT32, to, msg, nullptr, &sq));
        std::string err;
        ASSERT_EQ(Finish(sq, &err), T3D_OK) << Tag(rank, "send " + std::to_string(msg)) << ": " << err;
        ASSERT_EQ(t3d_wait(rq, TestTimeoutMs()), T3D_OK) << Tag(rank, t3d_request_error(rq));
        EXPECT_EQ(t3d_request_count(rq), cnt);
        t3d_request_free(rq);
        EXPECT_TRUE(StagedArrived(in, from, msg, cnt)) << Tag(rank, "ring shift");
      }
    }
    // One way, rank 0 to rank 1 (rank 2 idles): a late receive, an idle sender, a truncated receive, then a whole
    // message again.
    const size_t cnt = (size_t{1} << 21) + 3;
    if (rank == 0) {
      std::vector<std::vector<float>> outs;
      for (int m = 0; m < 4; ++m) outs.push_back(StagedMessage(0, 100 + m, cnt));
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, outs[0].data(), cnt, T3D_FLOAT32, 1, 100, nullptr, &q));
      if (!HostBarrier()) return;  // rank 1 posts its receive only after this
      EXPECT_EQ(Finish(q), T3D_OK) << Tag(rank, "late receive");
      T3D_ASSERT_OK(comm, t3d_send(comm, outs[1].data(), cnt, T3D_FLOAT32, 1, 101, nullptr, &q));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // no waits, no passes of this thread
      EXPECT_EQ(Finish(q), T3D_OK) << Tag(rank, "idle sender");
      for (int m = 2; m < 4; ++m) {
        T3D_ASSERT_OK(comm, t3d_send(comm, outs[m].data(), cnt, T3D_FLOAT32, 1, 100 + m, nullptr, &q));
        EXPECT_EQ(Finish(q), T3D_OK) << Tag(rank, "message " + std::to_string(100 + m));
      }
    } else if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the message arrives before any receive
      if (!HostBarrier()) return;
      for (int m = 0; m < 4; ++m) {
        std::vector<float> in(cnt + 5, -1.0f);
        t3d_opts_t o{};
        size_t cap = in.size();
        if (m == 2) {
          o.flags = T3D_FLAG_RECV_TRUNCATE;
          cap = cnt / 3;
        }
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), cap, T3D_FLOAT32, 0, 100 + m, &o, &q));
        ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << Tag(rank, t3d_request_error(q));
        EXPECT_EQ(t3d_request_count(q), cnt) << Tag(rank, "message " + std::to_string(100 + m));
        t3d_request_free(q);
        EXPECT_TRUE(StagedArrived(in, 0, 100 + m, m == 2 ? cap : cnt)) << Tag(rank, "one way");
      }
    } else {
      if (!HostBarrier()) return;
    }
  });
  UnsetEnv("T3D_SHM_P2P_STAGE_BYTES");
  UnsetEnv("T3D_SHM_P2P_STAGE_MIN_BYTES");
}

}  // namespace

namespace {

t3d_request_t *g_pending = nullptr;

// Destroying a communicator with a receive still pending returns once that receive reaches its deadline, and the
// receive reports the timeout (it must not hang destroy, nor vanish).
TEST(ShmP2P, DestroyWithPendingReceiveEndsAtItsDeadline) {
  static std::vector<float> in(kSmall);
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    SkipUnlessShm(comm);
    if (rank == 1) return;
    t3d_opts_t opts{};
    opts.timeout_ms = 300;
    T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), in.size(), T3D_FLOAT32, 1, 11, &opts, &g_pending));
  });
  if (g_pending == nullptr) return;  // skipped
  EXPECT_EQ(t3d_test(g_pending), T3D_ERR_TIMEOUT);
  EXPECT_NE(std::string(t3d_request_error(g_pending)).find("recv from rank 1"), std::string::npos)
      << t3d_request_error(g_pending);
  t3d_request_free(g_pending);
}

}  // namespace
