// test_params.cc: the registry of environment variables (c_src/base/params.c): names match their ids, integers
// parse with strtoll base 0 (as the environment was always read), the environment is read once (and again on t3d__param_reload), strings
// outlive the environment's, and the public listing (t3d_param_count / get / find) says the same as the getters.
// This binary changes the environment of its own process only.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/params.h"
#include "t3d.h"

namespace {

// Sets (or, for nullptr, unsets) a variable and reads the environment again.
void SetAndReload(const char *name, const char *value) {
  if (value != nullptr) setenv(name, value, 1);
  else unsetenv(name);
  t3d__param_reload();
}

// First, while the registry has not been read yet: threads that race to the first use all see one reading.
TEST(Params, ConcurrentFirstUseSeesOneReading) {
  setenv("T3D_SHM_BYTES", "12345", 1);
  std::vector<std::thread> threads;
  std::vector<int64_t> seen(8, 0);
  for (size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&seen, i] { seen[i] = t3d__param_int(T3D_PARAM_SHM_BYTES); });
  }
  for (auto &t : threads) t.join();
  for (int64_t v : seen) EXPECT_EQ(v, 12345);
  SetAndReload("T3D_SHM_BYTES", nullptr);
}

TEST(Params, NamesMatchIdsAndTheListingOrder) {
  ASSERT_EQ(t3d_param_count(), static_cast<int>(T3D_PARAM_ID_COUNT));
// The macro's parameters are upper case: p.name, p.type, ... must not be replaced.
#define T3D_PARAM(ID, NAME, TYPE, INT_DEFAULT, STR_DEFAULT, SHOWN_DEFAULT, READER, MEANING) \
  {                                                                                      \
    EXPECT_STREQ(NAME, "T3D_" #ID);                                                      \
    t3d_param_t p;                                                                       \
    ASSERT_EQ(t3d_param_get(T3D_PARAM_##ID, &p), T3D_OK);                                \
    EXPECT_STREQ(p.name, NAME);                                                          \
    EXPECT_EQ(p.type, T3D_PARAM_TYPE_##TYPE) << NAME;                                    \
    EXPECT_STREQ(p.reader, READER);                                                      \
    EXPECT_STREQ(p.meaning, MEANING);                                                    \
    EXPECT_STREQ(p.default_shown, SHOWN_DEFAULT);                                        \
    if (p.type == T3D_PARAM_TYPE_STR) {                                                  \
      EXPECT_EQ(INT_DEFAULT, 0) << NAME;                                                 \
    } else {                                                                             \
      const char *sd = STR_DEFAULT;                                                      \
      EXPECT_EQ(sd, nullptr) << NAME;                                                    \
      EXPECT_EQ(std::to_string(INT_DEFAULT), p.default_text) << NAME;                    \
    }                                                                                    \
  }
#include "base/params.def"
#undef T3D_PARAM
}

// Every text the parse has an opinion on: base prefixes, signs, white space, suffixes, overflow, empty. kDefault:
// the text is not a whole integer (or empty), so the default holds. This is how the environment was always read
// (strtoll with base 0, nothing left over; no range check).
constexpr int64_t kDefault = INT64_MIN + 1;
TEST(Params, IntegersParseAsStrtollBase0) {
  const struct {
    const char *text;
    int64_t want;
  } texts[] = {{"0", 0}, {"42", 42}, {"-1", -1}, {"-2", -2}, {"0x10", 16}, {"0X1f", 31}, {"010", 8},
               {"08", kDefault}, {"12k", kDefault}, {"4M", kDefault}, {" 5", 5}, {"5 ", kDefault}, {"+7", 7},
               {"abc", kDefault}, {"", kDefault}, {"-", kDefault}, {"0x", kDefault}, {"1e3", kDefault},
               {"1.5", kDefault}, {"\t9", 9}, {"99999999999999999999", INT64_MAX},
               {"-99999999999999999999", INT64_MIN}, {"9223372036854775807", INT64_MAX}};
  const struct {
    t3d_param_id_t id;
    const char *name;
    int64_t dflt;
  } vars[] = {{T3D_PARAM_SHM_BYTES, "T3D_SHM_BYTES", 2097152},
              {T3D_PARAM_SHM_P2P_EAGER_BYTES, "T3D_SHM_P2P_EAGER_BYTES", -1},
              {T3D_PARAM_SHM_P2P, "T3D_SHM_P2P", 1}};
  for (const auto &v : vars) {
    for (const auto &t : texts) {
      SCOPED_TRACE(std::string(v.name) + "='" + t.text + "'");
      SetAndReload(v.name, t.text);
      EXPECT_EQ(t3d__param_int(v.id), t.want == kDefault ? v.dflt : t.want);
      EXPECT_EQ(t3d__param_is_set(v.id) != 0, t.text[0] != '\0');
      t3d_param_t p;
      ASSERT_EQ(t3d_param_get(v.id, &p), T3D_OK);
      EXPECT_EQ(p.value, t3d__param_int(v.id));
      EXPECT_EQ(std::to_string(p.value), p.value_text);
      EXPECT_EQ(p.is_set != 0, t.text[0] != '\0');
      if (p.is_set) EXPECT_STREQ(p.env_text, t.text);
      else EXPECT_EQ(p.env_text, nullptr);
    }
    SetAndReload(v.name, nullptr);
    EXPECT_EQ(t3d__param_int(v.id), v.dflt);
    EXPECT_FALSE(t3d__param_is_set(v.id));
  }
}

TEST(Params, InvalidIntegerKeepsTheDefaultButCountsAsSet) {
  SetAndReload("T3D_SPIN_NS", "5us");
  t3d_param_t p;
  ASSERT_EQ(t3d_param_find("T3D_SPIN_NS", &p), T3D_OK);
  EXPECT_EQ(p.value, 5000);
  EXPECT_TRUE(p.is_set);
  EXPECT_FALSE(p.is_valid);
  EXPECT_STREQ(p.env_text, "5us");
  EXPECT_TRUE(t3d__param_is_set(T3D_PARAM_SPIN_NS));  // comm.c: "the user chose a spin", as before
  SetAndReload("T3D_SPIN_NS", "250");
  ASSERT_EQ(t3d_param_find("T3D_SPIN_NS", &p), T3D_OK);
  EXPECT_TRUE(p.is_valid);
  EXPECT_EQ(p.value, 250);
  SetAndReload("T3D_SPIN_NS", nullptr);
}

TEST(Params, StringsAsEnvStrGivesThem) {
  SetAndReload("T3D_TRANSPORT", nullptr);
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_TRANSPORT), "auto");
  SetAndReload("T3D_TRANSPORT", "");
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_TRANSPORT), "auto");
  EXPECT_FALSE(t3d__param_is_set(T3D_PARAM_TRANSPORT));
  SetAndReload("T3D_TRANSPORT", "ucx");
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_TRANSPORT), "ucx");
  EXPECT_TRUE(t3d__param_is_set(T3D_PARAM_TRANSPORT));
  SetAndReload("T3D_TRANSPORT", nullptr);
  // No default: NULL, the way it was always read; the listing shows "".
  SetAndReload("T3D_DEBUG_FILE", nullptr);
  EXPECT_EQ(t3d__param_str(T3D_PARAM_DEBUG_FILE), nullptr);
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_DEBUG), "");
  t3d_param_t p;
  ASSERT_EQ(t3d_param_get(T3D_PARAM_DEBUG_FILE, &p), T3D_OK);
  EXPECT_STREQ(p.value_text, "");
  EXPECT_STREQ(p.default_text, "");
  EXPECT_EQ(p.value, 0);
  // An integer as text: its effective value in decimal.
  SetAndReload("T3D_SHM_NT_BYTES", "0x100");
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_SHM_NT_BYTES), "256");
  SetAndReload("T3D_SHM_NT_BYTES", nullptr);
  // Wrong ids and wrong types.
  EXPECT_EQ(t3d__param_int(T3D_PARAM_TRANSPORT), 0);
  EXPECT_EQ(t3d__param_int(T3D_PARAM_ID_COUNT), 0);
  EXPECT_EQ(t3d__param_str(T3D_PARAM_ID_COUNT), nullptr);
  EXPECT_EQ(t3d__param_is_set(T3D_PARAM_ID_COUNT), 0);
}

TEST(Params, ReadOnceUntilReloadAndStringsOutliveTheEnvironment) {
  SetAndReload("T3D_NCCL_LIBRARY", "/opt/first/libnccl.so.2");
  const char *first = t3d__param_str(T3D_PARAM_NCCL_LIBRARY);
  setenv("T3D_NCCL_LIBRARY", "/opt/second/libnccl.so.2", 1);
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_NCCL_LIBRARY), "/opt/first/libnccl.so.2");  // no reload: the cached value
  t3d__param_reload();
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_NCCL_LIBRARY), "/opt/second/libnccl.so.2");
  unsetenv("T3D_NCCL_LIBRARY");
  EXPECT_STREQ(first, "/opt/first/libnccl.so.2");  // a copy, valid for the life of the process
  t3d__param_reload();
  EXPECT_STREQ(t3d__param_str(T3D_PARAM_NCCL_LIBRARY), "libnccl.so.2");
}

TEST(Params, ReadersRacingAReloadSeeOneValueOrTheOther) {
  SetAndReload("T3D_TIMEOUT_MS", "1000");
  std::atomic<bool> stop{false};
  std::atomic<int> odd{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        int64_t v = t3d__param_int(T3D_PARAM_TIMEOUT_MS);
        const char *s = t3d__param_str(T3D_PARAM_TIMEOUT_MS);
        if ((v != 1000 && v != 2000) || (std::strcmp(s, "1000") != 0 && std::strcmp(s, "2000") != 0)) ++odd;
      }
    });
  }
  for (int i = 0; i < 200; ++i) SetAndReload("T3D_TIMEOUT_MS", i % 2 ? "1000" : "2000");
  stop = true;
  for (auto &t : readers) t.join();
  EXPECT_EQ(odd.load(), 0);
  SetAndReload("T3D_TIMEOUT_MS", nullptr);
}

TEST(Params, PublicListingRejectsWhatItDoesNotHave) {
  t3d_param_t p;
  EXPECT_EQ(t3d_param_get(-1, &p), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_param_get(t3d_param_count(), &p), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_param_get(0, nullptr), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_param_find("T3D_NO_SUCH_VARIABLE", &p), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_param_find(nullptr, &p), T3D_ERR_INVALID_ARG);
  EXPECT_EQ(t3d_param_find("T3D_SHM_BYTES", nullptr), T3D_ERR_INVALID_ARG);
  ASSERT_EQ(t3d_param_find("T3D_CUDA_BLOCKING_WAIT", &p), T3D_OK);
  EXPECT_EQ(p.type, T3D_PARAM_TYPE_BOOL);
  EXPECT_STREQ(p.reader, "shim");
  EXPECT_EQ(p.value, 0);
}

}  // namespace
