// fake_nccl_api.h: the tests' handle on libt3d_fake_nccl.so, opened by path (T3D_FAKE_NCCL_PATH): its NCCL
// functions in t3d's own table type and its fake_nccl_* hooks. Header-only; each test binary that uses it opens the
// library once.
#ifndef T3D_TESTS_FAKE_NCCL_API_H
#define T3D_TESTS_FAKE_NCCL_API_H

#include <dlfcn.h>

#include <cstring>
#include <string>

#include "nccl/nccl_abi.h"

namespace t3dtest {

struct FakeNccl {
  t3d_nccl_api_t api{};
  int (*comms_created)() = nullptr;
  int (*comms_live)() = nullptr;
  int (*aborts)() = nullptr;
  int (*last_nranks)() = nullptr;
  int (*last_blocking)() = nullptr;
  void *(*last_stream)() = nullptr;
  void *(*thread_last_stream)() = nullptr;
  void (*inject_async_error)(int) = nullptr;
  int (*premul_live)() = nullptr;
  int (*zero_count_p2p)() = nullptr;
  long (*calls)(const char *) = nullptr;
  int (*fail_next)(const char *, int) = nullptr;
  void (*thread_expect_stream)(void *) = nullptr;
  int (*thread_op_calls)() = nullptr;
  int (*thread_stream_misses)() = nullptr;
  const char *(*thread_last_fn)() = nullptr;
  int (*thread_last_dtype)() = nullptr;
  int (*thread_last_op)() = nullptr;
  size_t (*thread_last_count)() = nullptr;
  std::string error;  // "" once every symbol resolved

  // dlopen()s the library (the same handle t3d gets when it loads the same path) and resolves everything.
  bool Open(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char *why = dlerror();
      error = std::string("dlopen(") + path + "): " + (why ? why : "?");
      return false;
    }
    bool ok = true;
    auto get = [&](const char *name, void *slot) {
      void *sym = dlsym(lib, name);
      if (!sym) {
        error += std::string(error.empty() ? "" : "; ") + "missing " + name;
        ok = false;
        return;
      }
      std::memcpy(slot, &sym, sizeof sym);
    };
    get("ncclGetVersion", &api.GetVersion);
    get("ncclGetUniqueId", &api.GetUniqueId);
    get("ncclCommInitRankConfig", &api.CommInitRankConfig);
    get("ncclCommFinalize", &api.CommFinalize);
    get("ncclCommDestroy", &api.CommDestroy);
    get("ncclCommAbort", &api.CommAbort);
    get("ncclCommGetAsyncError", &api.CommGetAsyncError);
    get("ncclGetErrorString", &api.GetErrorString);
    get("ncclGetLastError", &api.GetLastError);
    get("ncclRedOpCreatePreMulSum", &api.RedOpCreatePreMulSum);
    get("ncclRedOpDestroy", &api.RedOpDestroy);
    get("ncclAllReduce", &api.AllReduce);
    get("ncclBroadcast", &api.Broadcast);
    get("ncclReduce", &api.Reduce);
    get("ncclAllGather", &api.AllGather);
    get("ncclReduceScatter", &api.ReduceScatter);
    get("ncclSend", &api.Send);
    get("ncclRecv", &api.Recv);
    get("ncclGroupStart", &api.GroupStart);
    get("ncclGroupEnd", &api.GroupEnd);
    get("fake_nccl_comms_created", &comms_created);
    get("fake_nccl_comms_live", &comms_live);
    get("fake_nccl_aborts", &aborts);
    get("fake_nccl_last_nranks", &last_nranks);
    get("fake_nccl_last_blocking", &last_blocking);
    get("fake_nccl_last_stream", &last_stream);
    get("fake_nccl_thread_last_stream", &thread_last_stream);
    get("fake_nccl_inject_async_error", &inject_async_error);
    get("fake_nccl_premul_live", &premul_live);
    get("fake_nccl_zero_count_p2p", &zero_count_p2p);
    get("fake_nccl_calls", &calls);
    get("fake_nccl_fail_next", &fail_next);
    get("fake_nccl_thread_expect_stream", &thread_expect_stream);
    get("fake_nccl_thread_op_calls", &thread_op_calls);
    get("fake_nccl_thread_stream_misses", &thread_stream_misses);
    get("fake_nccl_thread_last_fn", &thread_last_fn);
    get("fake_nccl_thread_last_dtype", &thread_last_dtype);
    get("fake_nccl_thread_last_op", &thread_last_op);
    get("fake_nccl_thread_last_count", &thread_last_count);
    return ok;
  }
};

}  // namespace t3dtest

#endif  // T3D_TESTS_FAKE_NCCL_API_H
