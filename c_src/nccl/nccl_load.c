/* nccl_load.c: finds NCCL when the first CUDA buffer arrives, so that libt3d needs neither CUDA nor NCCL to load.
 * T3D_NCCL_LIBRARY names the file; the default libnccl.so.2 is, in a torch process, the copy torch already loaded. */
#include "nccl_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static t3d_nccl_api_t api;
static int api_ok;
static char load_error[512];
static char version_text[32];

/* Resolves one symbol into a function-pointer slot; returns 0 and records the name when it is missing. */
static int resolve(void *lib, const char *name, void *slot) {
  void *fn = dlsym(lib, name);
  if (fn == NULL) {
    snprintf(load_error, sizeof load_error, "the NCCL library has no symbol %s (NCCL 2.14 or newer is needed)", name);
    return 0;
  }
  /* POSIX guarantees that a data pointer from dlsym converts to a function pointer; memcpy says so to C11. */
  memcpy(slot, &fn, sizeof fn);
  return 1;
}

static void load(void) {
  const char *path = t3d__param_str(T3D_PARAM_NCCL_LIBRARY);
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *why = dlerror();
    snprintf(load_error, sizeof load_error, "cannot load NCCL from '%s' (T3D_NCCL_LIBRARY): %s", path,
             why ? why : "unknown error");
    return;
  }
  int ok = resolve(lib, "ncclGetVersion", &api.GetVersion) && resolve(lib, "ncclGetUniqueId", &api.GetUniqueId) &&
           resolve(lib, "ncclCommInitRankConfig", &api.CommInitRankConfig) &&
           resolve(lib, "ncclCommFinalize", &api.CommFinalize) && resolve(lib, "ncclCommDestroy", &api.CommDestroy) && resolve(lib, "ncclCommAbort", &api.CommAbort) &&
           resolve(lib, "ncclCommGetAsyncError", &api.CommGetAsyncError) &&
           resolve(lib, "ncclGetErrorString", &api.GetErrorString) &&
           resolve(lib, "ncclGetLastError", &api.GetLastError) &&
           resolve(lib, "ncclRedOpCreatePreMulSum", &api.RedOpCreatePreMulSum) &&
           resolve(lib, "ncclRedOpDestroy", &api.RedOpDestroy) && resolve(lib, "ncclAllReduce", &api.AllReduce) &&
           resolve(lib, "ncclBroadcast", &api.Broadcast) && resolve(lib, "ncclReduce", &api.Reduce) &&
           resolve(lib, "ncclAllGather", &api.AllGather) && resolve(lib, "ncclReduceScatter", &api.ReduceScatter) &&
           resolve(lib, "ncclSend", &api.Send) && resolve(lib, "ncclRecv", &api.Recv) &&
           resolve(lib, "ncclGroupStart", &api.GroupStart) && resolve(lib, "ncclGroupEnd", &api.GroupEnd);
  int v = 0;
  if (ok && api.GetVersion(&v) != T3D_NCCL_SUCCESS) {
    snprintf(load_error, sizeof load_error, "ncclGetVersion failed in '%s'", path);
    ok = 0;
  }
  /* Versions from 2.9 on are major*10000 + minor*100 + patch. */
  if (ok && v < 21403) {
    snprintf(load_error, sizeof load_error, "'%s' is NCCL %d; t3d needs 2.14.3 or newer", path, v);
    ok = 0;
  }
  if (!ok) {
    dlclose(lib);
    return;
  }
  snprintf(version_text, sizeof version_text, "%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
  T3D_INFO("NCCL %s from '%s'", version_text, path);
  api_ok = 1; /* the library stays loaded for the life of the process */
}

const t3d_nccl_api_t *t3d__nccl_api(const char **error) {
  pthread_once(&load_once, load);
  if (!api_ok) {
    if (error != NULL) *error = load_error;
    return NULL;
  }
  return &api;
}

const char *t3d_nccl_version_string(void) { return t3d__nccl_api(NULL) != NULL ? version_text : ""; }

const char *t3d_nccl_load_error(void) {
  pthread_once(&load_once, load);
  return api_ok ? "" : load_error;
}
