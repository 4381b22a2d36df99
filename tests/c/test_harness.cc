// test_harness.cc: the harness itself: both stores, the half conversions, and the reference that the collective
// tests trust.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

using namespace t3dtest;

namespace {

std::string GetString(const t3d_store_t *s, const char *key, int64_t timeout_ms, t3d_result_t *res) {
  void *value = nullptr;
  size_t len = 0;
  *res = s->get(s->ctx, key, &value, &len, timeout_ms);
  if (*res != T3D_OK) return "";
  std::string out(static_cast<const char *>(value), len);
  free(value);
  return out;
}

void ExerciseStore(const t3d_store_t *s) {
  t3d_result_t r;
  EXPECT_EQ(s->set(s->ctx, "a/b:c", "hello", 5), T3D_OK);
  EXPECT_EQ(GetString(s, "a/b:c", 0, &r), "hello");
  EXPECT_EQ(r, T3D_OK);
  EXPECT_EQ(s->set(s->ctx, "a/b:c", "bye", 3), T3D_OK);  // overwrite
  EXPECT_EQ(GetString(s, "a/b:c", 0, &r), "bye");
  EXPECT_EQ(s->set(s->ctx, "empty", "", 0), T3D_OK);
  EXPECT_EQ(GetString(s, "empty", 0, &r), "");
  EXPECT_EQ(r, T3D_OK);
  // A missing key times out after about the timeout.
  const auto t0 = std::chrono::steady_clock::now();
  GetString(s, "missing", 100, &r);
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r, T3D_ERR_TIMEOUT);
  EXPECT_GE(took, 90);
  EXPECT_LT(took, 2000);
  // A get blocks until another thread sets the key.
  std::thread setter([s] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    s->set(s->ctx, "late", "value", 5);
  });
  EXPECT_EQ(GetString(s, "late", 5000, &r), "value");
  EXPECT_EQ(r, T3D_OK);
  setter.join();
}

TEST(Harness, MemStore) {
  MemStore store;
  ExerciseStore(store.store());
}

TEST(Harness, FileStore) {
  FileStore store("/tmp/" + UniqueName("t3d-harness"));
  ExerciseStore(store.store());
  store.Remove();
  EXPECT_NE(access(store.dir().c_str(), F_OK), 0) << "Remove left " << store.dir();
}

TEST(Harness, HalfConversions) {
  // Every finite binary16 and bfloat16 value survives the round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t u = static_cast<uint16_t>(h);
    if ((u & 0x7c00) != 0x7c00) {
      EXPECT_EQ(FloatToHalf(HalfToFloat(u)), u) << std::hex << h;
    }
    if ((u & 0x7f80) != 0x7f80) {
      EXPECT_EQ(FloatToBf16(Bf16ToFloat(u)), u) << std::hex << h;
    }
  }
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even (down)
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie to even (up)
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  for (int v = -256; v <= 256; ++v) {
    EXPECT_EQ(Bf16ToFloat(FloatToBf16(static_cast<float>(v))), static_cast<float>(v));
    EXPECT_EQ(HalfToFloat(FloatToHalf(static_cast<float>(v))), static_cast<float>(v));
  }
}

// The inputs differ between ranks (else a reduction that ignores peers would pass) and the reference matches a
// direct computation for a few hand-checked cases.
TEST(Harness, InputsDependOnRankAndReferenceIsExact) {
  for (size_t d = 0; d < kNumDtypes; ++d) {
    for (size_t o = 0; o < kNumOps; ++o) {
      const t3d_dtype_t dt = kAllDtypes[d];
      const t3d_redop_t op = kAllOps[o];
      if (t3d_redop_supported(op, dt) != T3D_OK) continue;
      const size_t n = 64, es = t3d_dtype_size(dt);
      std::vector<unsigned char> a(n * es), b(n * es);
      FillInput(dt, op, 0, a.data(), n);
      FillInput(dt, op, 1, b.data(), n);
      EXPECT_NE(memcmp(a.data(), b.data(), n * es), 0) << CaseName(dt, op, n) << ": ranks 0 and 1 have equal inputs";
    }
  }
  // SUM of int32 over 3 ranks equals the sum of the inputs; AVG truncates towards zero.
  std::vector<int32_t> in(3 * 16), sum(16), avg(16);
  for (int r = 0; r < 3; ++r) FillInput(T3D_INT32, T3D_SUM, r, in.data() + 16 * r, 16);
  ReferenceReduce(T3D_INT32, T3D_SUM, 3, sum.data(), 16);
  ReferenceReduce(T3D_INT32, T3D_AVG, 3, avg.data(), 16);
  bool saw_negative_inexact = false;
  for (int i = 0; i < 16; ++i) {
    const int32_t s = in[i] + in[16 + i] + in[32 + i];
    EXPECT_EQ(sum[i], s) << i;
    EXPECT_EQ(avg[i], s / 3) << i;
    saw_negative_inexact |= s < 0 && s % 3 != 0;
  }
  EXPECT_TRUE(saw_negative_inexact) << "the AVG inputs never test truncation of a negative sum";
}

TEST(Harness, CompareReportsFirstDifference) {
  float a[3] = {1, 2, 3}, b[3] = {1, 2.5f, 3};
  EXPECT_EQ(CompareBuffers(T3D_FLOAT32, a, a, 3, 0.0), "");
  const std::string msg = CompareBuffers(T3D_FLOAT32, a, b, 3, 0.0);
  EXPECT_NE(msg.find("element 1"), std::string::npos) << msg;
  EXPECT_EQ(CompareBuffers(T3D_FLOAT32, a, b, 3, 0.3), "");
}

TEST(Harness, RunRanksHostBarrierAndSlots) {
  std::atomic<int> count{0};
  RunRanks(4, [&](int rank, t3d_comm_t *comm) {
    EXPECT_EQ(t3d_comm_rank(comm), rank);
    count.fetch_add(1);
    ASSERT_TRUE(HostBarrier());
    EXPECT_EQ(count.load(), 4);
    HostSlots()[rank] = {static_cast<unsigned char>(rank)};
    ASSERT_TRUE(HostBarrier());
    for (int r = 0; r < 4; ++r) EXPECT_EQ(HostSlots()[r].at(0), r);
  });
}

}  // namespace
