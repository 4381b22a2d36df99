/* fake_cudart.c: a stand-in for the CUDA runtime (the functions t3d's staged path resolves, under their real names)
 * on host memory, for tests without a GPU. "Device memory" is host memory. A copy is queued on its stream and runs
 * only when someone asks the stream whether it is done (cudaStreamQuery: the first query after a copy runs the
 * stream's queue and answers "not ready", the next "done"), so a caller that reads a staging buffer or completes
 * before the stream has drained sees stale bytes, as it would on a device. Devices 0-7; device d's PCI bus id is
 * 0000:(0x10 + d):00.0. fake_cudart_* hooks let the tests count and fail calls. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SUCCESS = 0, INVALID_VALUE = 1, MEMORY_ALLOCATION = 2, INVALID_DEVICE = 101, NOT_READY = 600 };
enum { H2D = 1, D2H = 2 };

typedef struct copy {
  void *dst;
  const void *src;
  size_t bytes;
  struct copy *next;
} copy_t;

typedef struct {
  void *stream;
  long copies; /* ever queued */
  copy_t *head, *tail;
  int drained_once; /* answered "not ready" since the last copy */
} stream_t;

#define MAX_STREAMS 64
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static stream_t streams[MAX_STREAMS];
static int nstreams;
static atomic_long bytes_h2d, bytes_d2h, pinned_live, queries, set_device_calls;
static _Thread_local int current_device;
static _Thread_local void *tls_last_stream;
/* An injected failure: the next call of fail_fn on fail_stream returns fail_err. */
static char fail_fn[64];
static void *fail_stream;
static int fail_err;

static int injected(const char *fn, void *stream) {
  pthread_mutex_lock(&mu);
  int hit = fail_fn[0] != '\0' && strcmp(fail_fn, fn) == 0 && fail_stream == stream;
  int err = fail_err;
  if (hit) fail_fn[0] = '\0';
  pthread_mutex_unlock(&mu);
  return hit ? err : SUCCESS;
}

static stream_t *stream_of(void *stream) { /* under mu */
  for (int i = 0; i < nstreams; i++) {
    if (streams[i].stream == stream) return &streams[i];
  }
  if (nstreams == MAX_STREAMS) return NULL;
  streams[nstreams].stream = stream;
  return &streams[nstreams++];
}

int cudaRuntimeGetVersion(int *v) {
  *v = 13000;
  return SUCCESS;
}

int cudaGetDevice(int *d) {
  *d = current_device;
  return SUCCESS;
}

int cudaSetDevice(int d) {
  if (d < 0 || d > 7) return INVALID_DEVICE;
  atomic_fetch_add(&set_device_calls, 1);
  current_device = d;
  return SUCCESS;
}

int cudaDeviceGetPCIBusId(char *bus, int len, int d) {
  if (d < 0 || d > 7) return INVALID_DEVICE;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x10 + d);
  return SUCCESS;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, void *stream) {
  int e = injected("cudaMemcpyAsync", stream);
  if (e != SUCCESS) return e;
  if (kind != H2D && kind != D2H) return INVALID_VALUE;
  tls_last_stream = stream;
  copy_t *c = malloc(sizeof *c);
  if (c == NULL) return MEMORY_ALLOCATION;
  *c = (copy_t){dst, src, bytes, NULL};
  atomic_fetch_add(kind == H2D ? &bytes_h2d : &bytes_d2h, (long)bytes);
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  if (s == NULL) {
    pthread_mutex_unlock(&mu);
    free(c);
    return INVALID_VALUE;
  }
  if (s->tail != NULL) s->tail->next = c;
  else s->head = c;
  s->tail = c;
  s->copies++;
  s->drained_once = 0;
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

int cudaStreamQuery(void *stream) {
  int e = injected("cudaStreamQuery", stream);
  if (e != SUCCESS) return e;
  atomic_fetch_add(&queries, 1);
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  int res = SUCCESS;
  if (s != NULL && (s->head != NULL || !s->drained_once)) {
    for (copy_t *c = s->head, *next; c != NULL; c = next) {
      next = c->next;
      memcpy(c->dst, c->src, c->bytes);
      free(c);
    }
    s->head = s->tail = NULL;
    res = s->drained_once ? SUCCESS : NOT_READY;
    s->drained_once = 1;
  }
  pthread_mutex_unlock(&mu);
  return res;
}

int cudaMallocHost(void **p, size_t bytes) {
  *p = malloc(bytes);
  if (*p == NULL) return MEMORY_ALLOCATION;
  atomic_fetch_add(&pinned_live, 1);
  return SUCCESS;
}

int cudaFreeHost(void *p) {
  if (p != NULL) atomic_fetch_sub(&pinned_live, 1);
  free(p);
  return SUCCESS;
}

const char *cudaGetErrorString(int e) {
  switch (e) {
    case SUCCESS: return "no error";
    case INVALID_VALUE: return "invalid argument";
    case MEMORY_ALLOCATION: return "out of memory";
    case INVALID_DEVICE: return "invalid device ordinal";
    case NOT_READY: return "device not ready";
    default: return "unknown error";
  }
}

/* ---------- hooks for the tests ---------- */

long fake_cudart_bytes_h2d(void) { return atomic_load(&bytes_h2d); }
long fake_cudart_bytes_d2h(void) { return atomic_load(&bytes_d2h); }
long fake_cudart_pinned_live(void) { return atomic_load(&pinned_live); }
long fake_cudart_queries(void) { return atomic_load(&queries); }
void *fake_cudart_thread_last_stream(void) { return tls_last_stream; }

/* Copies still queued on the stream (0 once every request that used it has completed), and copies ever queued. */
long fake_cudart_pending_on(void *stream) {
  long n = 0;
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  for (copy_t *c = s != NULL ? s->head : NULL; c != NULL; c = c->next) n++;
  pthread_mutex_unlock(&mu);
  return n;
}

long fake_cudart_copies_on(void *stream) {
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  long n = s != NULL ? s->copies : 0;
  pthread_mutex_unlock(&mu);
  return n;
}

/* The next call of fn ("cudaMemcpyAsync" or "cudaStreamQuery") on stream fails with err. */
void fake_cudart_fail_next(const char *fn, void *stream, int err) {
  pthread_mutex_lock(&mu);
  snprintf(fail_fn, sizeof fail_fn, "%s", fn);
  fail_stream = stream;
  fail_err = err;
  pthread_mutex_unlock(&mu);
}
