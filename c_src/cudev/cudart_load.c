/* cudart_load.c: finds the CUDA runtime when the staged path first needs it, so that libt3d needs no CUDA to load.
 * T3D_CUDART_LIBRARY lists the names to try; in a torch process the first one torch was built with is the copy it
 * already loaded (dlopen matches a loaded library by its soname). */
#include "cudev_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static t3d_cudart_api_t api;
static int api_ok;
static char load_error[768];

static int resolve(void *lib, const char *path, const char *name, void *slot) {
  void *fn = dlsym(lib, name);
  if (fn == NULL) {
    snprintf(load_error, sizeof load_error, "the CUDA runtime '%s' has no symbol %s", path, name);
    return 0;
  }
  memcpy(slot, &fn, sizeof fn); /* POSIX: a data pointer from dlsym converts to a function pointer */
  return 1;
}

static int try_one(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return 0;
  int ok = resolve(lib, path, "cudaRuntimeGetVersion", &api.RuntimeGetVersion) &&
           resolve(lib, path, "cudaGetDevice", &api.GetDevice) && resolve(lib, path, "cudaSetDevice", &api.SetDevice) &&
           resolve(lib, path, "cudaDeviceGetPCIBusId", &api.DeviceGetPCIBusId) &&
           resolve(lib, path, "cudaMemcpyAsync", &api.MemcpyAsync) &&
           resolve(lib, path, "cudaStreamQuery", &api.StreamQuery) &&
           resolve(lib, path, "cudaMallocHost", &api.MallocHost) && resolve(lib, path, "cudaFreeHost", &api.FreeHost) &&
           resolve(lib, path, "cudaGetErrorString", &api.GetErrorString) &&
           resolve(lib, path, "cudaMalloc", &api.Malloc) && resolve(lib, path, "cudaFree", &api.Free) &&
           resolve(lib, path, "cudaIpcGetMemHandle", &api.IpcGetMemHandle) &&
           resolve(lib, path, "cudaIpcOpenMemHandle", &api.IpcOpenMemHandle) &&
           resolve(lib, path, "cudaIpcCloseMemHandle", &api.IpcCloseMemHandle) &&
           resolve(lib, path, "cudaEventCreateWithFlags", &api.EventCreateWithFlags) &&
           resolve(lib, path, "cudaEventDestroy", &api.EventDestroy) &&
           resolve(lib, path, "cudaEventRecord", &api.EventRecord) &&
           resolve(lib, path, "cudaIpcGetEventHandle", &api.IpcGetEventHandle) &&
           resolve(lib, path, "cudaIpcOpenEventHandle", &api.IpcOpenEventHandle) &&
           resolve(lib, path, "cudaStreamWaitEvent", &api.StreamWaitEvent) &&
           resolve(lib, path, "cudaEventQuery", &api.EventQuery);
  if (!ok) {
    dlclose(lib);
    return -1;
  }
  int v = 0;
  api.RuntimeGetVersion(&v);
  T3D_INFO("CUDA runtime %d.%d from '%s'", v / 1000, (v % 1000) / 10, path);
  return 1; /* stays loaded for the life of the process */
}

static void load(void) {
  const char *list = t3d__param_str(T3D_PARAM_CUDART_LIBRARY);
  char tried[512] = "";
  for (const char *s = list; s != NULL && *s != '\0';) {
    size_t len = strcspn(s, ",");
    char path[256];
    snprintf(path, sizeof path, "%.*s", (int)(len < sizeof path ? len : sizeof path - 1), s);
    s += len + (s[len] == ',');
    if (path[0] == '\0') continue;
    int got = try_one(path);
    if (got == 1) {
      api_ok = 1;
      return;
    }
    if (got < 0) return; /* load_error says which symbol */
    size_t used = strlen(tried);
    snprintf(tried + used, sizeof tried - used, "%s'%s'", used ? ", " : "", path);
  }
  const char *why = dlerror();
  snprintf(load_error, sizeof load_error, "cannot load the CUDA runtime from %s (T3D_CUDART_LIBRARY)%s%s",
           tried[0] ? tried : "an empty list", why ? ": " : "", why ? why : "");
}

const t3d_cudart_api_t *t3d__cudart_api(const char **error) {
  pthread_once(&load_once, load);
  if (!api_ok) {
    if (error != NULL) *error = load_error;
    return NULL;
  }
  return &api;
}
