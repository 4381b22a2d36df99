/* fake_cudart.c: a stand-in for the CUDA runtime (the functions t3d's staged path resolves, under their real names)
 * on host memory, for tests without a GPU. "Device memory" is host memory. A copy is queued on its stream and runs
 * only when someone asks the stream whether it is done (cudaStreamQuery: the first query after a copy runs the
 * stream's queue and answers "not ready", the next "done"), so a caller that reads a staging buffer or completes
 * before the stream has drained sees stale bytes, as it would on a device. Devices 0-7; device d's PCI bus id is
 * 0000:(0x10 + d):00.0. fake_cudart_* hooks let the tests count and fail calls.
 *
 * For the device path (c_src/cudev/ipc.c) it also has "device" buffers (cudaMalloc: host memory), IPC handles
 * (the pointer itself: the tests' ranks are threads of one process), events and cudaStreamWaitEvent: an event
 * marks a place in its stream's queue, and a wait queues a step that, when its stream runs, first runs the
 * recorded stream up to that place. So a stream that reads a peer's buffer without waiting for the peer's event
 * reads whatever is there when its own queue runs, as a device would. fake_cudart_enqueue queues a host function
 * (the tests' stand-in for a kernel). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SUCCESS = 0, INVALID_VALUE = 1, MEMORY_ALLOCATION = 2, INVALID_DEVICE = 101, NOT_READY = 600 };
enum { H2D = 1, D2H = 2, D2D = 3 };

/* A step of a stream's queue: a copy, a host function, or a wait for another stream to reach a place. */
typedef struct copy {
  void *dst;
  const void *src;
  size_t bytes;
  void (*fn)(void *); /* a host function (fake_cudart_enqueue) instead of a copy */
  void *arg;
  void *wait_stream; /* a wait: run that stream until it has run wait_pos steps */
  long wait_pos;
  struct copy *next;
} copy_t;

typedef struct {
  void *stream;
  long copies; /* ever queued */
  long queued, ran; /* steps of every kind ever queued, and run */
  int running;
  copy_t *head, *tail;
  int drained_once; /* answered "not ready" since the last copy */
} stream_t;

typedef struct {
  void *stream; /* NULL until recorded */
  long pos;
  int refs; /* the creator and every IPC open: freed when all have destroyed it */
} event_t;

#define MAX_STREAMS 64
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static stream_t streams[MAX_STREAMS];
static int nstreams;
static atomic_long bytes_h2d, bytes_d2h, bytes_d2d, device_live, ipc_opened, events_live, pinned_live, queries, set_device_calls;
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

static int enqueue(void *stream, copy_t *c);

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
  if (kind != H2D && kind != D2H && kind != D2D) return INVALID_VALUE;
  tls_last_stream = stream;
  copy_t *c = calloc(1, sizeof *c);
  if (c == NULL) return MEMORY_ALLOCATION;
  c->dst = dst;
  c->src = src;
  c->bytes = bytes;
  atomic_fetch_add(kind == H2D ? &bytes_h2d : kind == D2H ? &bytes_d2h : &bytes_d2d, (long)bytes);
  return enqueue(stream, c);
}

static void run_stream(stream_t *s);

static void run_step(copy_t *c) { /* under mu */
  if (c->wait_stream != NULL) {
    stream_t *w = stream_of(c->wait_stream);
    if (w == NULL || w->ran >= c->wait_pos) return;
    if (w->running) {
      fprintf(stderr, "fake_cudart: streams wait for each other in a cycle\n");
      abort();
    }
    while (w->ran < c->wait_pos && w->head != NULL) {
      copy_t *first = w->head;
      w->head = first->next;
      if (w->head == NULL) w->tail = NULL;
      w->running = 1;
      run_step(first);
      w->running = 0;
      w->ran++;
      free(first);
    }
  } else if (c->fn != NULL) {
    c->fn(c->arg);
  } else {
    memcpy(c->dst, c->src, c->bytes);
  }
}

/* Runs everything queued on s (under mu). */
static void run_stream(stream_t *s) {
  s->running = 1;
  while (s->head != NULL) {
    copy_t *c = s->head;
    s->head = c->next;
    if (s->head == NULL) s->tail = NULL;
    run_step(c);
    s->ran++;
    free(c);
  }
  s->running = 0;
}

static int enqueue(void *stream, copy_t *c) {
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
  s->queued++;
  if (c->fn == NULL && c->wait_stream == NULL) s->copies++;
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
    run_stream(s);
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

/* ---------- the device path: buffers, IPC handles, events ---------- */

typedef struct {
  char reserved[64];
} handle_t;

int cudaMalloc(void **p, size_t bytes) {
  if (injected("cudaMalloc", NULL) != SUCCESS) return MEMORY_ALLOCATION;
  *p = malloc(bytes);
  if (*p == NULL) return MEMORY_ALLOCATION;
  memset(*p, 0xEE, bytes);
  atomic_fetch_add(&device_live, 1);
  return SUCCESS;
}

int cudaFree(void *p) {
  if (p != NULL) atomic_fetch_sub(&device_live, 1);
  free(p);
  return SUCCESS;
}

static const char handle_magic[8] = "fakeipc";

static void to_handle(handle_t *h, void *p) {
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, handle_magic, sizeof handle_magic);
  memcpy(h->reserved + 8, &p, sizeof p);
}

static void *from_handle(const handle_t *h) {
  if (memcmp(h->reserved, handle_magic, sizeof handle_magic) != 0) return NULL;
  void *p;
  memcpy(&p, h->reserved + 8, sizeof p);
  return p;
}

int cudaIpcGetMemHandle(handle_t *h, void *p) {
  if (p == NULL || injected("cudaIpcGetMemHandle", NULL) != SUCCESS) return INVALID_VALUE;
  to_handle(h, p);
  return SUCCESS;
}

int cudaIpcOpenMemHandle(void **p, handle_t h, unsigned flags) {
  (void)flags;
  if (injected("cudaIpcOpenMemHandle", NULL) != SUCCESS) return INVALID_VALUE;
  *p = from_handle(&h);
  if (*p == NULL) return INVALID_VALUE;
  atomic_fetch_add(&ipc_opened, 1);
  return SUCCESS;
}

int cudaIpcCloseMemHandle(void *p) {
  if (p == NULL) return INVALID_VALUE;
  atomic_fetch_sub(&ipc_opened, 1);
  return SUCCESS;
}

int cudaEventCreateWithFlags(void **ev, unsigned flags) {
  (void)flags;
  if (injected("cudaEventCreateWithFlags", NULL) != SUCCESS) return INVALID_VALUE;
  event_t *e = calloc(1, sizeof *e);
  if (e == NULL) return MEMORY_ALLOCATION;
  e->refs = 1;
  atomic_fetch_add(&events_live, 1);
  *ev = e;
  return SUCCESS;
}

/* An event opened through IPC is the same object here: each open counts as one more live event, and each destroy as
 * one less (the real runtime destroys the importer's handle, not the exporter's event). */
int cudaEventDestroy(void *ev) {
  event_t *e = ev;
  if (e == NULL) return INVALID_VALUE;
  atomic_fetch_sub(&events_live, 1);
  pthread_mutex_lock(&mu);
  int last = --e->refs == 0;
  pthread_mutex_unlock(&mu);
  if (last) free(e);
  return SUCCESS;
}

int cudaEventRecord(void *ev, void *stream) {
  event_t *e = ev;
  if (e == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  e->stream = stream;
  e->pos = s != NULL ? s->queued : 0;
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

/* Done once its stream has run up to the place it marks: asking runs it there, as a device would have by then. */
int cudaEventQuery(void *ev) {
  event_t *e = ev;
  if (e == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  if (e->stream != NULL) {
    copy_t wait = {0};
    wait.wait_stream = e->stream;
    wait.wait_pos = e->pos;
    run_step(&wait);
  }
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

int cudaIpcGetEventHandle(handle_t *h, void *ev) {
  if (ev == NULL || injected("cudaIpcGetEventHandle", NULL) != SUCCESS) return INVALID_VALUE;
  to_handle(h, ev);
  return SUCCESS;
}

int cudaIpcOpenEventHandle(void **ev, handle_t h) {
  if (injected("cudaIpcOpenEventHandle", NULL) != SUCCESS) return INVALID_VALUE;
  *ev = from_handle(&h);
  if (*ev == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  ((event_t *)*ev)->refs++;
  pthread_mutex_unlock(&mu);
  atomic_fetch_add(&events_live, 1);
  return SUCCESS;
}

int cudaStreamWaitEvent(void *stream, void *ev, unsigned flags) {
  (void)flags;
  event_t *e = ev;
  if (e == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  void *on = e->stream;
  long pos = e->pos;
  pthread_mutex_unlock(&mu);
  if (on == NULL || on == stream) return SUCCESS; /* never recorded, or earlier on this stream: nothing to wait for */
  copy_t *c = calloc(1, sizeof *c);
  if (c == NULL) return MEMORY_ALLOCATION;
  c->wait_stream = on;
  c->wait_pos = pos;
  return enqueue(stream, c);
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
long fake_cudart_bytes_d2d(void) { return atomic_load(&bytes_d2d); }
/* Device buffers allocated and not freed, IPC mappings open, events alive (opened ones included). */
long fake_cudart_device_live(void) { return atomic_load(&device_live); }
long fake_cudart_ipc_open(void) { return atomic_load(&ipc_opened); }
long fake_cudart_events_live(void) { return atomic_load(&events_live); }

/* Queues fn(arg) on stream, run in its order like a kernel. 0: queued. */
int fake_cudart_enqueue(void *stream, void (*fn)(void *), void *arg) {
  copy_t *c = calloc(1, sizeof *c);
  if (c == NULL) return MEMORY_ALLOCATION;
  c->fn = fn;
  c->arg = arg;
  return enqueue(stream, c);
}

/* Runs everything queued on stream (and what it waits for). */
void fake_cudart_sync(void *stream) {
  pthread_mutex_lock(&mu);
  stream_t *s = stream_of(stream);
  if (s != NULL) run_stream(s);
  pthread_mutex_unlock(&mu);
}
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

/* The next call of fn on stream fails with err (cudaMemcpyAsync, cudaStreamQuery), or the next call of fn by any
 * thread (stream NULL: cudaMalloc and the IPC and event calls, which fail with cudaErrorInvalidValue). */
void fake_cudart_fail_next(const char *fn, void *stream, int err) {
  pthread_mutex_lock(&mu);
  snprintf(fail_fn, sizeof fail_fn, "%s", fn);
  fail_stream = stream;
  fail_err = err;
  pthread_mutex_unlock(&mu);
}
