// test_p2p.cc: point-to-point: tag matching, any-source receives, received counts, truncation errors, group
// coalescing (ring exchange), many requests in flight, and completion callbacks.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

using Buf = std::vector<unsigned char>;

Buf Bytes(t3d_dtype_t dt, size_t n) { return Buf(std::max<size_t>(1, n * t3d_dtype_size(dt)), 0xA5); }

std::string Tag(int rank, const std::string &what) { return "rank " + std::to_string(rank) + ": " + what; }

std::string Diff(const Buf &got, const Buf &expect, size_t nbytes) {
  for (size_t b = 0; b < nbytes; ++b)
    if (got[b] != expect[b])
      return "byte " + std::to_string(b) + " got " + std::to_string(got[b]) + " expected " + std::to_string(expect[b]);
  return "";
}

// Payload of a message from `from` with tag `tag`, n elements.
Buf Payload(t3d_dtype_t dt, int from, int64_t tag, size_t n) {
  Buf b = Bytes(dt, n);
  FillPattern(dt, from, b.data(), n, static_cast<size_t>(tag) * 1000, static_cast<int>(tag % 97));
  return b;
}

// Two messages with different tags are matched by tag, not by arrival order.
TEST(P2P, TagsMatchOutOfOrder) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_FLOAT32;
    const size_t n5 = 5, n7 = 1000;
    if (rank == 0) {
      Buf a = Payload(dt, 0, 5, n5), b = Payload(dt, 0, 7, n7);
      t3d_request_t *ra = nullptr, *rb = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, a.data(), n5, dt, 1, 5, nullptr, &ra));
      T3D_ASSERT_OK(comm, t3d_send(comm, b.data(), n7, dt, 1, 7, nullptr, &rb));
      std::string err;
      EXPECT_EQ(Finish(ra, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(rb, &err), T3D_OK) << err;
    } else {
      Buf a = Bytes(dt, n5), b = Bytes(dt, n7);
      t3d_request_t *ra = nullptr, *rb = nullptr;
      // Post tag 7 first.
      T3D_ASSERT_OK(comm, t3d_recv(comm, b.data(), n7, dt, 0, 7, nullptr, &rb));
      T3D_ASSERT_OK(comm, t3d_recv(comm, a.data(), n5, dt, 0, 5, nullptr, &ra));
      EXPECT_EQ(t3d_wait(rb, TestTimeoutMs()), T3D_OK) << t3d_request_error(rb);
      EXPECT_EQ(t3d_wait(ra, TestTimeoutMs()), T3D_OK) << t3d_request_error(ra);
      EXPECT_EQ(t3d_request_source(ra), 0);
      EXPECT_EQ(t3d_request_source(rb), 0);
      EXPECT_EQ(t3d_request_count(ra), n5);
      EXPECT_EQ(t3d_request_count(rb), n7);
      t3d_request_free(ra);
      t3d_request_free(rb);
      EXPECT_EQ("", Diff(a, Payload(dt, 0, 5, n5), n5 * 4));
      EXPECT_EQ("", Diff(b, Payload(dt, 0, 7, n7), n7 * 4));
    }
  });
}

// Same tag, same pair: messages arrive in the order they were sent.
TEST(P2P, SameTagKeepsOrder) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const int k = 20;
    std::vector<Buf> bufs(k);
    std::vector<t3d_request_t *> reqs(k, nullptr);
    for (int i = 0; i < k; ++i) {
      if (rank == 0) {
        bufs[i] = Payload(T3D_INT32, 0, i, 64);
        T3D_ASSERT_OK(comm, t3d_send(comm, bufs[i].data(), 64, T3D_INT32, 1, 42, nullptr, &reqs[i]));
      } else {
        bufs[i] = Bytes(T3D_INT32, 64);
        T3D_ASSERT_OK(comm, t3d_recv(comm, bufs[i].data(), 64, T3D_INT32, 0, 42, nullptr, &reqs[i]));
      }
    }
    for (int i = 0; i < k; ++i) {
      std::string err;
      EXPECT_EQ(Finish(reqs[i], &err), T3D_OK) << Tag(rank, "message " + std::to_string(i)) << ": " << err;
      if (rank == 1) {
        EXPECT_EQ("", Diff(bufs[i], Payload(T3D_INT32, 0, i, 64), 256)) << "message " << i;
      }
    }
  });
}

TEST(P2P, AnySource) {
  const int n = 4;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_INT64;
    const int64_t tag = 3;
    const size_t cap = 10 * (n + 1);
    if (rank != 0) {
      const size_t count = 10 * static_cast<size_t>(rank + 1);
      Buf b = Payload(dt, rank, tag, count);
      ASSERT_TRUE(RunOk(comm, "send to 0", [&](t3d_request_t **r) {
        return t3d_send(comm, b.data(), count, dt, 0, tag, nullptr, r);
      }));
      return;
    }
    std::vector<Buf> bufs(n - 1, Bytes(dt, cap));
    std::vector<t3d_request_t *> reqs(n - 1, nullptr);
    for (int i = 0; i < n - 1; ++i)
      T3D_ASSERT_OK(comm, t3d_recv(comm, bufs[i].data(), cap, dt, T3D_ANY_SOURCE, tag, nullptr, &reqs[i]));
    std::set<int> sources;
    for (int i = 0; i < n - 1; ++i) {
      ASSERT_EQ(t3d_wait(reqs[i], TestTimeoutMs()), T3D_OK) << t3d_request_error(reqs[i]);
      const int src = t3d_request_source(reqs[i]);
      const size_t count = t3d_request_count(reqs[i]);
      t3d_request_free(reqs[i]);
      ASSERT_GE(src, 1);
      ASSERT_LT(src, n);
      sources.insert(src);
      EXPECT_EQ(count, 10 * static_cast<size_t>(src + 1)) << "from " << src;
      EXPECT_EQ("", Diff(bufs[i], Payload(dt, src, tag, count), count * 8)) << "from " << src;
    }
    EXPECT_EQ(sources.size(), static_cast<size_t>(n - 1)) << "every sender must be seen once";
  });
}

// A receive larger than the message: t3d_request_count tells how many arrived; the rest is untouched.
TEST(P2P, ReceiveCountOfShortMessage) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_FLOAT64;
    for (size_t sent : {static_cast<size_t>(0), static_cast<size_t>(1), static_cast<size_t>(13),
                        static_cast<size_t>(70000)}) {
      const size_t cap = sent + 17;
      const int64_t tag = static_cast<int64_t>(sent % 1000);
      if (rank == 0) {
        Buf b = Payload(dt, 0, tag, sent);
        ASSERT_TRUE(RunOk(comm, "send " + std::to_string(sent), [&](t3d_request_t **r) {
          return t3d_send(comm, b.data(), sent, dt, 1, tag, nullptr, r);
        }));
      } else {
        Buf b = Bytes(dt, cap);
        t3d_request_t *req = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, b.data(), cap, dt, 0, tag, nullptr, &req));
        ASSERT_EQ(t3d_wait(req, TestTimeoutMs()), T3D_OK) << t3d_request_error(req);
        EXPECT_EQ(t3d_request_count(req), sent);
        EXPECT_EQ(t3d_request_source(req), 0);
        t3d_request_free(req);
        EXPECT_EQ("", Diff(b, Payload(dt, 0, tag, sent), sent * 8)) << "sent " << sent;
        for (size_t i = sent * 8; i < cap * 8; ++i) {
          ASSERT_EQ(b[i], 0xA5) << "byte " << i << " past the message was written (sent " << sent << ")";
        }
      }
    }
  });
}

// A message longer than the posted receive fails the receive with T3D_ERR_MISMATCH, without hanging either side.
TEST(P2P, MessageLargerThanReceiveIsError) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    for (size_t sent : {static_cast<size_t>(100), static_cast<size_t>(300000)}) {
      const size_t cap = 10;
      if (rank == 0) {
        Buf b = Payload(T3D_UINT8, 0, 1, sent);
        std::string err;
        t3d_result_t r = RunResult(
            [&](t3d_request_t **q) { return t3d_send(comm, b.data(), sent, T3D_UINT8, 1, 1, nullptr, q); }, &err);
        // The sender may or may not learn of the truncation; it must only finish.
        EXPECT_TRUE(r == T3D_OK || r == T3D_ERR_MISMATCH) << t3d_result_string(r) << ": " << err;
      } else {
        Buf b = Bytes(T3D_UINT8, cap + 8);
        std::string err;
        t3d_result_t r = RunResult(
            [&](t3d_request_t **q) { return t3d_recv(comm, b.data(), cap, T3D_UINT8, 0, 1, nullptr, q); }, &err);
        EXPECT_EQ(r, T3D_ERR_MISMATCH) << "sent " << sent << " into " << cap << ": " << err;
        for (size_t i = cap; i < cap + 8; ++i) {
          ASSERT_EQ(b[i], 0xA5) << "byte " << i << " past the receive buffer was written";
        }
      }
      if (!HostBarrier()) return;
    }
  });
}

// After a truncated receive, the pair can still exchange messages.
TEST(P2P, UsableAfterTruncation) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    Buf big = Payload(T3D_UINT8, 0, 2, 64), small = Bytes(T3D_UINT8, 8);
    std::string err;
    if (rank == 0) {
      RunResult([&](t3d_request_t **q) { return t3d_send(comm, big.data(), 64, T3D_UINT8, 1, 2, nullptr, q); });
    } else {
      EXPECT_EQ(RunResult([&](t3d_request_t **q) { return t3d_recv(comm, small.data(), 8, T3D_UINT8, 0, 2, nullptr, q); },
                          &err),
                T3D_ERR_MISMATCH);
    }
    Buf msg = Payload(T3D_INT32, 0, 9, 100), got = Bytes(T3D_INT32, 100);
    if (rank == 0) {
      EXPECT_TRUE(RunOk(comm, "send after truncation", [&](t3d_request_t **q) {
        return t3d_send(comm, msg.data(), 100, T3D_INT32, 1, 9, nullptr, q);
      }));
    } else {
      EXPECT_TRUE(RunOk(comm, "recv after truncation", [&](t3d_request_t **q) {
        return t3d_recv(comm, got.data(), 100, T3D_INT32, 0, 9, nullptr, q);
      }));
      EXPECT_EQ("", Diff(got, msg, 400));
    }
    EXPECT_TRUE(RunOk(comm, "barrier after truncation", [&](t3d_request_t **q) {
      return t3d_barrier(comm, nullptr, q);
    }));
  });
}

// With T3D_FLAG_RECV_TRUNCATE a longer message fills the buffer with its head, reports the sender's count, writes
// nothing past the buffer, and keeps later messages of the same tag in order (eager and rendezvous sizes).
TEST(P2P, TruncateFlagKeepsHead) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    for (size_t sent : {static_cast<size_t>(8), static_cast<size_t>(300000)}) {
      const size_t cap = sent / 2;
      Buf first = Payload(T3D_UINT8, 0, 3, sent), second = Payload(T3D_UINT8, 0, 4, cap);
      if (rank == 0) {
        EXPECT_TRUE(RunOk(comm, "send long", [&](t3d_request_t **q) {
          return t3d_send(comm, first.data(), sent, T3D_UINT8, 1, 5, nullptr, q);
        }));
        EXPECT_TRUE(RunOk(comm, "send exact", [&](t3d_request_t **q) {
          return t3d_send(comm, second.data(), cap, T3D_UINT8, 1, 5, nullptr, q);
        }));
      } else {
        t3d_opts_t o{};
        o.flags = T3D_FLAG_RECV_TRUNCATE;
        Buf a = Bytes(T3D_UINT8, cap + 8), b = Bytes(T3D_UINT8, cap);
        t3d_request_t *qa = nullptr, *qb = nullptr;
        ASSERT_EQ(t3d_recv(comm, a.data(), cap, T3D_UINT8, 0, 5, &o, &qa), T3D_OK);
        ASSERT_EQ(t3d_recv(comm, b.data(), cap, T3D_UINT8, 0, 5, &o, &qb), T3D_OK);
        EXPECT_EQ(t3d_wait(qa, 60000), T3D_OK) << t3d_request_error(qa);
        EXPECT_EQ(t3d_wait(qb, 60000), T3D_OK) << t3d_request_error(qb);
        EXPECT_EQ(t3d_request_count(qa), sent);
        EXPECT_EQ(t3d_request_count(qb), cap);
        EXPECT_EQ("", Diff(a, first, cap)) << "sent " << sent;
        EXPECT_EQ("", Diff(b, second, cap)) << "sent " << sent;
        for (size_t i = cap; i < cap + 8; ++i) ASSERT_EQ(a[i], 0xA5) << "byte " << i << " past the buffer written";
        t3d_request_free(qa);
        t3d_request_free(qb);
      }
      if (!HostBarrier()) return;
    }
  });
}

// Every rank sends right and receives from the left inside one group: sends first would deadlock with blocking
// semantics; the group must not. Large messages force the rendezvous path.
TEST(P2P, RingExchangeInGroup) {
  for (int n : {2, 3, 4, 8}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    RunRanks(n, [n](int rank, t3d_comm_t *comm) {
      const t3d_dtype_t dt = T3D_FLOAT32;
      const int right = (rank + 1) % n, left = (rank + n - 1) % n;
      for (size_t count : {static_cast<size_t>(1), static_cast<size_t>(1000), static_cast<size_t>(300000)}) {
        for (int round = 0; round < 3; ++round) {
          const int64_t tag = round;
          Buf out = Payload(dt, rank, tag, count), in = Bytes(dt, count);
          t3d_request_t *sreq = nullptr, *rreq = nullptr, *greq = nullptr;
          T3D_ASSERT_OK(comm, t3d_group_start(comm));
          if (round % 2 == 0) {
            T3D_ASSERT_OK(comm, t3d_send(comm, out.data(), count, dt, right, tag, nullptr, &sreq));
            T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), count, dt, left, tag, nullptr, &rreq));
          } else {  // receive first, and nest a group
            T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), count, dt, left, tag, nullptr, &rreq));
            T3D_ASSERT_OK(comm, t3d_group_start(comm));
            T3D_ASSERT_OK(comm, t3d_send(comm, out.data(), count, dt, right, tag, nullptr, &sreq));
            T3D_ASSERT_OK(comm, t3d_group_end(comm, nullptr));
          }
          T3D_ASSERT_OK(comm, t3d_group_end(comm, round == 1 ? nullptr : &greq));
          std::string err;
          if (greq) {
            EXPECT_EQ(Finish(greq, &err), T3D_OK) << Tag(rank, "group request") << ": " << err;
            // The group request completing means both members have.
            EXPECT_EQ(t3d_test(sreq), T3D_OK);
            EXPECT_EQ(t3d_test(rreq), T3D_OK);
          }
          EXPECT_EQ(Finish(sreq, &err), T3D_OK) << Tag(rank, "send") << ": " << err;
          ASSERT_EQ(t3d_wait(rreq, TestTimeoutMs()), T3D_OK) << Tag(rank, "recv") << ": " << t3d_request_error(rreq);
          EXPECT_EQ(t3d_request_source(rreq), left);
          EXPECT_EQ(t3d_request_count(rreq), count);
          t3d_request_free(rreq);
          EXPECT_EQ("", Diff(in, Payload(dt, left, tag, count), count * 4))
              << Tag(rank, "count " + std::to_string(count) + " round " + std::to_string(round));
        }
      }
    });
  }
}

// t3d_sendrecv (the blocking exchange) shifts a ring of 2, 3 and 8 ranks at eager, slot and rendezvous sizes, and
// says how many elements arrived.
TEST(P2P, SendrecvRingShift) {
  for (int n : {2, 3, 8}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    RunRanks(n, [n](int rank, t3d_comm_t *comm) {
      const t3d_dtype_t dt = T3D_FLOAT32;
      const int right = (rank + 1) % n, left = (rank + n - 1) % n;
      for (size_t count : {static_cast<size_t>(0), static_cast<size_t>(2), static_cast<size_t>(1000),
                           static_cast<size_t>(300000)}) {
        for (int64_t tag = 0; tag < 3; ++tag) {
          Buf out = Payload(dt, rank, tag, count), in = Bytes(dt, count);
          size_t got = 12345;
          T3D_ASSERT_OK(comm, t3d_sendrecv(comm, out.data(), count, right, in.data(), count, left, dt, tag, nullptr,
                                           &got));
          EXPECT_EQ(got, count) << Tag(rank, "received");
          EXPECT_EQ("", Diff(in, Payload(dt, left, tag, count), count * 4))
              << Tag(rank, "count " + std::to_string(count) + " tag " + std::to_string(tag));
        }
      }
    });
  }
}

// t3d_sendrecv from any source into a larger buffer: the count that arrived; a longer message is an error that
// names the call, unless T3D_FLAG_RECV_TRUNCATE.
TEST(P2P, SendrecvAnySourceAndCounts) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_INT32;
    const int other = 1 - rank;
    const size_t mine = rank == 0 ? 3 : 7, cap = 10;
    Buf out = Payload(dt, rank, 4, mine), in = Bytes(dt, cap);
    size_t got = 0;
    T3D_ASSERT_OK(comm, t3d_sendrecv(comm, out.data(), mine, other, in.data(), cap, T3D_ANY_SOURCE, dt, 4, nullptr,
                                     &got));
    EXPECT_EQ(got, rank == 0 ? 7u : 3u);
    EXPECT_EQ("", Diff(in, Payload(dt, other, 4, got), got * 4)) << Tag(rank, "any source");
    // Too long for the receive on both ranks (7 and 3 elements into room for 2).
    Buf small = Bytes(dt, 2);
    EXPECT_EQ(t3d_sendrecv(comm, out.data(), mine, other, small.data(), 2, other, dt, 5, nullptr, &got),
              T3D_ERR_MISMATCH);
    const std::string err = t3d_comm_last_error(comm);
    EXPECT_NE(err.find("t3d_sendrecv"), std::string::npos) << err;
    EXPECT_NE(err.find("larger than"), std::string::npos) << err;
    EXPECT_EQ(got, 0u);
    t3d_opts_t opts{};
    opts.flags = T3D_FLAG_RECV_TRUNCATE;
    T3D_ASSERT_OK(comm, t3d_sendrecv(comm, out.data(), mine, other, small.data(), 2, other, dt, 6, &opts, &got));
    EXPECT_EQ(got, rank == 0 ? 7u : 3u);
    EXPECT_EQ("", Diff(small, Payload(dt, other, 4, 2), 8)) << Tag(rank, "truncated");
  });
}

// While another thread of the rank waits on its own receive (and so runs the passes that may complete this thread's
// exchanges), t3d_sendrecv keeps returning the right data: it returns only once whoever completed its requests has
// let go of them.
TEST(P2P, SendrecvWhileAnotherThreadPolls) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_INT32;
    const int other = 1 - rank;
    Buf side = Bytes(dt, 4);
    t3d_request_t *q = nullptr;
    std::thread waiter;
    if (rank == 0) {
      T3D_ASSERT_OK(comm, t3d_recv(comm, side.data(), 4, dt, 1, 99, nullptr, &q));
      waiter = std::thread([q] { EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q); });
    }
    for (int64_t i = 0; i < 2000; ++i) {
      const int64_t tag = i % 7;
      Buf out = Payload(dt, rank, tag, 3), in = Bytes(dt, 3);
      size_t got = 0;
      T3D_ASSERT_OK(comm, t3d_sendrecv(comm, out.data(), 3, other, in.data(), 3, other, dt, tag, nullptr, &got));
      ASSERT_EQ(got, 3u);
      ASSERT_EQ("", Diff(in, Payload(dt, other, tag, 3), 12)) << Tag(rank, "exchange " + std::to_string(i));
    }
    if (rank == 1) {
      Buf msg = Payload(dt, 1, 99, 4);
      t3d_request_t *s = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, msg.data(), 4, dt, 0, 99, nullptr, &s));
      std::string e;
      EXPECT_EQ(Finish(s, &e), T3D_OK) << e;
    } else {
      waiter.join();
      t3d_request_free(q);
      EXPECT_EQ("", Diff(side, Payload(dt, 1, 99, 4), 16));
    }
  });
}

// Bad arguments get an error that names the argument and the rank; inside a group the blocking call is refused; a
// receive whose peer never sends times out (the send half still delivered) and the error names the call.
TEST(P2P, SendrecvErrors) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    const t3d_dtype_t dt = T3D_FLOAT32;
    Buf out = Payload(dt, rank, 1, 4), in = Bytes(dt, 4);
    EXPECT_EQ(t3d_sendrecv(comm, out.data(), 4, 2, in.data(), 4, 0, dt, 1, nullptr, nullptr), T3D_ERR_INVALID_ARG);
    std::string err = t3d_comm_last_error(comm);
    EXPECT_NE(err.find("dst"), std::string::npos) << err;
    EXPECT_NE(err.find("rank " + std::to_string(rank)), std::string::npos) << err;
    EXPECT_EQ(t3d_sendrecv(comm, out.data(), 4, 0, nullptr, 4, 0, dt, 1, nullptr, nullptr), T3D_ERR_INVALID_ARG);
    EXPECT_NE(std::string(t3d_comm_last_error(comm)).find("recvbuf"), std::string::npos);
    T3D_ASSERT_OK(comm, t3d_group_start(comm));
    EXPECT_EQ(t3d_sendrecv(comm, out.data(), 4, 0, in.data(), 4, 0, dt, 1, nullptr, nullptr), T3D_ERR_INVALID_ARG);
    EXPECT_NE(std::string(t3d_comm_last_error(comm)).find("group"), std::string::npos);
    T3D_ASSERT_OK(comm, t3d_group_end(comm, nullptr));
    if (rank == 0) {
      t3d_opts_t opts{};
      opts.timeout_ms = 300;
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_EQ(t3d_sendrecv(comm, out.data(), 4, 1, in.data(), 4, 1, dt, 9, &opts, nullptr), T3D_ERR_TIMEOUT);
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
      EXPECT_GE(ms.count(), 290) << "the timeout came early";
      err = t3d_comm_last_error(comm);
      EXPECT_NE(err.find("t3d_sendrecv"), std::string::npos) << err;
      EXPECT_NE(err.find("rank 0"), std::string::npos) << err;
    } else {
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), 4, dt, 0, 9, nullptr, &q));
      std::string e;
      EXPECT_EQ(Finish(q, &e), T3D_OK) << e;
      EXPECT_EQ("", Diff(in, Payload(dt, 0, 1, 4), 16));
    }
  });
}

// A group holding both point-to-point and a collective.
TEST(P2P, GroupWithCollective) {
  const int n = 3;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    Buf out = Payload(T3D_INT32, rank, 4, 50), in = Bytes(T3D_INT32, 50);
    int32_t one = 1, sum = 0;
    t3d_request_t *s = nullptr, *r = nullptr, *a = nullptr, *g = nullptr;
    T3D_ASSERT_OK(comm, t3d_group_start(comm));
    T3D_ASSERT_OK(comm, t3d_allreduce(comm, &one, &sum, 1, T3D_INT32, T3D_SUM, nullptr, &a));
    T3D_ASSERT_OK(comm, t3d_send(comm, out.data(), 50, T3D_INT32, (rank + 1) % n, 4, nullptr, &s));
    T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), 50, T3D_INT32, (rank + n - 1) % n, 4, nullptr, &r));
    T3D_ASSERT_OK(comm, t3d_group_end(comm, &g));
    std::string err;
    EXPECT_EQ(Finish(g, &err), T3D_OK) << err;
    EXPECT_EQ(Finish(a, &err), T3D_OK) << err;
    EXPECT_EQ(Finish(s, &err), T3D_OK) << err;
    EXPECT_EQ(Finish(r, &err), T3D_OK) << err;
    EXPECT_EQ(sum, n);
    EXPECT_EQ("", Diff(in, Payload(T3D_INT32, (rank + n - 1) % n, 4, 50), 200));
  });
}

// Hundreds of requests in flight per rank, receives posted in the opposite tag order from the sends.
TEST(P2P, ManyOutstandingRequests) {
  const int n = 4;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    const int per_peer = 64;
    const size_t count = 33;
    std::vector<Buf> sbufs, rbufs;
    std::vector<t3d_request_t *> reqs;
    std::vector<std::pair<int, int>> rinfo;  // (peer, tag) of each receive, by index into rbufs
    sbufs.reserve(static_cast<size_t>(per_peer * n));
    rbufs.reserve(static_cast<size_t>(per_peer * n));
    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      for (int t = per_peer - 1; t >= 0; --t) {
        rbufs.push_back(Bytes(T3D_INT32, count));
        rinfo.emplace_back(p, t);
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_recv(comm, rbufs.back().data(), count, T3D_INT32, p, t, nullptr, &q));
        reqs.push_back(q);
      }
    }
    for (int p = 0; p < n; ++p) {
      if (p == rank) continue;
      for (int t = 0; t < per_peer; ++t) {
        sbufs.push_back(Payload(T3D_INT32, rank * 100 + p, t, count));
        t3d_request_t *q = nullptr;
        T3D_ASSERT_OK(comm, t3d_send(comm, sbufs.back().data(), count, T3D_INT32, p, t, nullptr, &q));
        reqs.push_back(q);
      }
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      std::string err;
      EXPECT_EQ(Finish(reqs[i], &err), T3D_OK) << Tag(rank, "request " + std::to_string(i)) << ": " << err;
    }
    for (size_t i = 0; i < rbufs.size(); ++i) {
      const int p = rinfo[i].first, t = rinfo[i].second;
      EXPECT_EQ("", Diff(rbufs[i], Payload(T3D_INT32, p * 100 + rank, t, count), count * 4))
          << Tag(rank, "from " + std::to_string(p) + " tag " + std::to_string(t));
    }
  });
}

struct CallbackLog {
  std::atomic<int> calls{0};
  std::atomic<int> last{1};
};

void Record(void *arg, t3d_result_t result) {
  CallbackLog *log = static_cast<CallbackLog *>(arg);
  log->last.store(result);
  log->calls.fetch_add(1);
}

bool WaitForCalls(const CallbackLog &log, int want) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(TestTimeoutMs());
  while (log.calls.load() < want && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return log.calls.load() >= want;
}

// Callbacks: once on a pending request, once (at once) on a completed one, with the error of a failed one.
TEST(P2P, CallbackCalledExactlyOnce) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    Buf b = Payload(T3D_FLOAT32, 0, 11, 256);
    if (rank == 0) {
      if (!HostBarrier()) return;  // rank 1 has set its callback on a pending receive
      ASSERT_TRUE(RunOk(comm, "send", [&](t3d_request_t **q) {
        return t3d_send(comm, b.data(), 256, T3D_FLOAT32, 1, 11, nullptr, q);
      }));
      // A send whose callback is set after it completed.
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_send(comm, b.data(), 256, T3D_FLOAT32, 1, 12, nullptr, &q));
      ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q);
      CallbackLog late;
      T3D_EXPECT_OK(comm, t3d_request_set_callback(q, Record, &late));
      EXPECT_TRUE(WaitForCalls(late, 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      EXPECT_EQ(late.calls.load(), 1);
      EXPECT_EQ(late.last.load(), T3D_OK);
      t3d_request_free(q);
      // A receive that will be truncated on rank 1.
      Buf big = Payload(T3D_FLOAT32, 0, 13, 64);
      RunResult([&](t3d_request_t **r) { return t3d_send(comm, big.data(), 64, T3D_FLOAT32, 1, 13, nullptr, r); });
      HostBarrier();
      return;
    }
    Buf in = Bytes(T3D_FLOAT32, 256);
    CallbackLog log;
    t3d_request_t *q = nullptr;
    T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), 256, T3D_FLOAT32, 0, 11, nullptr, &q));
    T3D_EXPECT_OK(comm, t3d_request_set_callback(q, Record, &log));
    EXPECT_EQ(log.calls.load(), 0) << "callback ran before the message was sent";
    if (!HostBarrier()) return;
    EXPECT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q);
    EXPECT_TRUE(WaitForCalls(log, 1));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(log.calls.load(), 1);
    EXPECT_EQ(log.last.load(), T3D_OK);
    t3d_request_free(q);
    EXPECT_EQ("", Diff(in, b, 1024));
    // Receive for the tag-12 send.
    Buf in12 = Bytes(T3D_FLOAT32, 256);
    EXPECT_TRUE(RunOk(comm, "recv 12", [&](t3d_request_t **r) {
      return t3d_recv(comm, in12.data(), 256, T3D_FLOAT32, 0, 12, nullptr, r);
    }));
    // The truncated one: the callback sees the error; free the request right away (callback still runs once).
    Buf small = Bytes(T3D_FLOAT32, 8);
    CallbackLog bad;
    t3d_request_t *qb = nullptr;
    T3D_ASSERT_OK(comm, t3d_recv(comm, small.data(), 8, T3D_FLOAT32, 0, 13, nullptr, &qb));
    T3D_EXPECT_OK(comm, t3d_request_set_callback(qb, Record, &bad));
    t3d_request_free(qb);
    EXPECT_TRUE(WaitForCalls(bad, 1));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(bad.calls.load(), 1);
    EXPECT_EQ(bad.last.load(), T3D_ERR_MISMATCH);
    HostBarrier();
  });
}

// Callbacks set while another thread completes the requests: each is called exactly once, whichever side wins.
// Completion takes a request's mutex only when it sees a sleeper or a callback's setter (base/request.c, hooks); a
// lost race would leave a callback never called. Rank 1 posts every receive, a second thread of it keeps running
// passes (each t3d_test runs one), and rank 0 (a thread of the same process here) sends message i only once rank 1
// is about to set callback i, so that the completion and the setting meet. (That window is a few instructions
// wide: the test catches a completion that never looks for callbacks at once, an ordering slip only by chance.)
TEST(P2P, CallbackSetWhileAnotherThreadCompletes) {
  const int kMsgs = 2000;
  static std::atomic<int> next_callback;
  next_callback.store(-1);
  RunRanks(2, [kMsgs](int rank, t3d_comm_t *comm) {
    if (rank == 0) {
      if (!HostBarrier()) return;  // rank 1 has posted every receive
      std::vector<int32_t> vals(kMsgs);
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(TestTimeoutMs() / 2);
      for (int i = 0; i < kMsgs; ++i) {
        while (next_callback.load() < i && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        vals[i] = i;
        ASSERT_TRUE(RunOk(comm, "send", [&](t3d_request_t **q) {
          return t3d_send(comm, &vals[i], 1, T3D_INT32, 1, i, nullptr, q);
        }));
      }
      HostBarrier();
      return;
    }
    std::vector<int32_t> in(kMsgs, -1);
    std::vector<t3d_request_t *> reqs(kMsgs, nullptr);
    for (int i = 0; i < kMsgs; ++i) T3D_ASSERT_OK(comm, t3d_recv(comm, &in[i], 1, T3D_INT32, 0, i, nullptr, &reqs[i]));
    std::atomic<bool> stop{false};
    std::thread driver([&] {
      while (!stop.load()) t3d_test(reqs[kMsgs - 1]);
    });
    std::vector<CallbackLog> logs(kMsgs);
    if (!HostBarrier()) {
      stop.store(true);
      driver.join();
      return;
    }
    for (int i = 0; i < kMsgs; ++i) {
      next_callback.store(i);
      // A delay that sweeps the moment of setting across the message's arrival and completion (0-2 us).
      for (volatile int k = 0, spins = (i * 13) % 64 * 8; k < spins; k = k + 1) {
      }
      T3D_EXPECT_OK(comm, t3d_request_set_callback(reqs[i], Record, &logs[i]));
    }
    EXPECT_EQ(t3d_wait(reqs[kMsgs - 1], TestTimeoutMs() / 2), T3D_OK) << t3d_request_error(reqs[kMsgs - 1]);
    stop.store(true);
    driver.join();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a callback runs right after its completion
    int never = 0, twice = 0, wrong = 0;
    for (int i = 0; i < kMsgs; ++i) {
      never += logs[i].calls.load() == 0;
      twice += logs[i].calls.load() > 1;
      wrong += logs[i].last.load() != T3D_OK || in[i] != i;
      t3d_request_free(reqs[i]);
    }
    EXPECT_EQ(never, 0) << "callbacks never called (set while the request completed)";
    EXPECT_EQ(twice, 0) << "callbacks called more than once";
    EXPECT_EQ(wrong, 0) << "receives with an error or the wrong value";
    HostBarrier();
  });
}

// Zero-length messages still match and complete.
TEST(P2P, ZeroLengthMessage) {
  RunRanks(2, [](int rank, t3d_comm_t *comm) {
    unsigned char byte = 0x5a;
    if (rank == 0) {
      EXPECT_TRUE(RunOk(comm, "send 0", [&](t3d_request_t **q) {
        return t3d_send(comm, &byte, 0, T3D_UINT8, 1, T3D_MAX_TAG, nullptr, q);
      }));
    } else {
      t3d_request_t *q = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, &byte, 4, T3D_UINT8, T3D_ANY_SOURCE, T3D_MAX_TAG, nullptr, &q));
      ASSERT_EQ(t3d_wait(q, TestTimeoutMs()), T3D_OK) << t3d_request_error(q);
      EXPECT_EQ(t3d_request_count(q), 0u);
      EXPECT_EQ(t3d_request_source(q), 0);
      t3d_request_free(q);
      EXPECT_EQ(byte, 0x5a);
    }
  });
}

// Point-to-point traffic interleaved with collectives on the same communicator does not cross-match.
TEST(P2P, InterleavedWithCollectives) {
  const int n = 4;
  RunRanks(n, [n](int rank, t3d_comm_t *comm) {
    for (int it = 0; it < 10; ++it) {
      Buf out = Payload(T3D_INT32, rank, it, 16), in = Bytes(T3D_INT32, 16);
      int32_t v = rank, s = -1;
      t3d_request_t *rr = nullptr, *ar = nullptr, *sr = nullptr;
      T3D_ASSERT_OK(comm, t3d_recv(comm, in.data(), 16, T3D_INT32, (rank + n - 1) % n, it, nullptr, &rr));
      T3D_ASSERT_OK(comm, t3d_allreduce(comm, &v, &s, 1, T3D_INT32, T3D_SUM, nullptr, &ar));
      T3D_ASSERT_OK(comm, t3d_send(comm, out.data(), 16, T3D_INT32, (rank + 1) % n, it, nullptr, &sr));
      std::string err;
      EXPECT_EQ(Finish(ar, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(sr, &err), T3D_OK) << err;
      EXPECT_EQ(Finish(rr, &err), T3D_OK) << err;
      EXPECT_EQ(s, n * (n - 1) / 2);
      EXPECT_EQ("", Diff(in, Payload(T3D_INT32, (rank + n - 1) % n, it, 16), 64)) << "iteration " << it;
    }
  });
}

}  // namespace
