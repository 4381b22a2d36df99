/* cudev.c: CUDA buffers of ranks that share one device. NCCL refuses a communicator with two ranks on one device, so
 * such a group stages through host memory: the device copies each input into a host buffer on the caller's stream,
 * the host provider (shared memory) runs the collective or the transfer, and the device copies the result back on
 * the same stream. The request completes once the copy back has finished, so the stream's later work sees the
 * result (the shim records its end event after completion). Collectives of T3D_CUDA_IPC_MIN_BYTES or more take the
 * device path instead (ipc.c: the device reads the peers' buffers through CUDA IPC), unless T3D_CUDA_PATH=staged;
 * where IPC fails, T3D_CUDA_PATH=auto stages them too and T3D_CUDA_PATH=ipc fails them.
 *
 * Which path a group takes (T3D_CUDA_PATH=auto) is found at its first CUDA call: each rank publishes its device's
 * identity (host and PCI bus id) in the store, and a collective is staged when two of the group's ranks share a
 * device; a send or receive outside a group looks at its pair only (as NCCL makes pair communicators for those),
 * one inside a group at the whole group (NCCL would run it on the group's communicator). */
#include "cudev_internal.h"
#include "provider.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { PATH_AUTO, PATH_NCCL, PATH_STAGED, PATH_IPC };
enum { ROUTE_UNKNOWN, ROUTE_NCCL, ROUTE_STAGED };

struct t3d_cudev {
  pthread_mutex_t mu; /* ids, route, error */
  int path;           /* T3D_CUDA_PATH */
  char **ids;         /* per rank: "host|bus id", NULL until read */
  int nids;
  int route;          /* of collectives and grouped point-to-point */
  char error[512];    /* why the ranks' devices are unknown, or "" */
  int warned;         /* that was logged */
  /* The staging buffer of collectives (only the thread that runs requests uses it): pinned when cudaMallocHost
   * gives it, so that the copies run asynchronously on the copy engines. */
  unsigned char *buf;
  size_t cap;
  int pinned;
  t3d_cudev_ipc_t *ipc; /* the device path's buffers and events (T3D_CUDA_PATH=ipc), or NULL */
};

t3d_result_t t3d__cudev_new(t3d_comm_t *comm, t3d_cudev_t **out) {
  const char *want = t3d__param_str(T3D_PARAM_CUDA_PATH);
  int path = strcmp(want, "auto") == 0     ? PATH_AUTO
             : strcmp(want, "nccl") == 0   ? PATH_NCCL
             : strcmp(want, "staged") == 0 ? PATH_STAGED
             : strcmp(want, "ipc") == 0    ? PATH_IPC
                                           : -1;
  if (path < 0) {
    return t3d__set_error(comm, T3D_ERR_INVALID_ARG,
                          "t3d_comm_init: T3D_CUDA_PATH='%s' on rank %d: expected auto, ipc, nccl or staged", want,
                          comm->rank);
  }
  const char *wait = t3d__param_str(T3D_PARAM_CUDA_IPC_WAIT);
  if (strcmp(wait, "device") != 0 && strcmp(wait, "host") != 0) {
    return t3d__set_error(comm, T3D_ERR_INVALID_ARG,
                          "t3d_comm_init: T3D_CUDA_IPC_WAIT='%s' on rank %d: expected device or host", wait,
                          comm->rank);
  }
  t3d_cudev_t *st = calloc(1, sizeof *st);
  if (st == NULL) return T3D_ERR_NO_MEMORY;
  pthread_mutex_init(&st->mu, NULL);
  st->path = path;
  *out = st;
  return T3D_OK;
}

void t3d__cudev_free(t3d_cudev_t *st) {
  if (st == NULL) return;
  t3d__cudev_ipc_free(st->ipc);
  if (st->buf != NULL) {
    const t3d_cudart_api_t *api = t3d__cudart_api(NULL);
    if (st->pinned && api != NULL) api->FreeHost(st->buf);
    else free(st->buf);
  }
  for (int p = 0; p < st->nids; p++) free(st->ids[p]);
  free(st->ids);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

/* ---------- which path ---------- */

static void set_error(t3d_cudev_t *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(t3d_cudev_t *st, const char *fmt, ...) {
  if (st->error[0] != '\0') return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(st->error, sizeof st->error, fmt, ap);
  va_end(ap);
}

/* Publishes this rank's device identity once and reads rank p's (under st->mu); NULL with st->error set when the
 * runtime or the store fails. */
static const char *identity(t3d_comm_t *comm, t3d_cudev_t *st, int device, int p) {
  if (st->ids == NULL) {
    st->ids = calloc((size_t)comm->size, sizeof *st->ids);
    if (st->ids == NULL) {
      set_error(st, "rank %d: out of memory", comm->rank);
      return NULL;
    }
    st->nids = comm->size;
    const char *why = NULL;
    const t3d_cudart_api_t *api = t3d__cudart_api(&why);
    if (api == NULL) {
      set_error(st, "rank %d: %s", comm->rank, why);
      return NULL;
    }
    char bus[64] = "", mine[512];
    t3d_cuda_error_t e = api->DeviceGetPCIBusId(bus, (int)sizeof bus, device);
    if (e != T3D_CUDA_SUCCESS) {
      set_error(st, "rank %d: cudaDeviceGetPCIBusId(%d) failed: %s", comm->rank, device, api->GetErrorString(e));
      return NULL;
    }
    t3d__host_identity(mine, sizeof mine - sizeof bus - 1);
    size_t used = strlen(mine);
    snprintf(mine + used, sizeof mine - used, "|%s", bus);
    char key[32];
    snprintf(key, sizeof key, "cudev/%d", comm->rank);
    st->ids[comm->rank] = strdup(mine);
    if (st->ids[comm->rank] == NULL || t3d__store_set(comm, key, mine, strlen(mine) + 1) != T3D_OK) {
      set_error(st, "rank %d: cannot publish its CUDA device in the store", comm->rank);
      return NULL;
    }
  }
  if (st->ids[p] == NULL) {
    char key[32];
    snprintf(key, sizeof key, "cudev/%d", p);
    void *v = NULL;
    size_t len = 0;
    if (t3d__store_get(comm, key, &v, &len) != T3D_OK || len == 0) {
      free(v);
      set_error(st, "rank %d: rank %d did not publish its CUDA device in the store", comm->rank, p);
      return NULL;
    }
    ((char *)v)[len - 1] = '\0';
    st->ids[p] = v;
  }
  return st->ids[p];
}

/* Whether ranks a and b use one device; -1 when that cannot be found out (st->error says why). */
static int same_device(t3d_comm_t *comm, t3d_cudev_t *st, int device, int a, int b) {
  const char *x = identity(comm, st, device, a), *y = x != NULL ? identity(comm, st, device, b) : NULL;
  if (x == NULL || y == NULL) return -1;
  return strcmp(x, y) == 0;
}

/* Under st->mu: the route of collectives (and grouped point-to-point): staged when any two ranks share a device. */
static int group_route(t3d_comm_t *comm, t3d_cudev_t *st, int device) {
  if (st->route != ROUTE_UNKNOWN) return st->route;
  int shared = 0;
  for (int p = 0; p < comm->size && !shared; p++) {
    for (int q = p + 1; q < comm->size && !shared; q++) {
      int s = same_device(comm, st, device, p, q);
      if (s < 0) return ROUTE_UNKNOWN;
      shared = s;
    }
  }
  st->route = shared ? ROUTE_STAGED : ROUTE_NCCL;
  T3D_INFO("group '%s' rank %d: CUDA tensors go %s", comm->name, comm->rank,
           shared ? "through t3d's same-device paths (ranks share a device; under MPS a call costs several times less)"
                  : "through NCCL (a device per rank)");
  return st->route;
}

/* The provider's `takes`, on the caller's thread at issue. When the ranks' devices cannot be found out (no CUDA
 * runtime, a store that fails), NCCL gets this call and every later one (it then says what it thinks of them), and
 * the reason is logged once. */
static int cudev_takes(t3d_comm_t *comm, const t3d_request_t *req) {
  t3d_cudev_t *st = comm->cudev;
  if (st == NULL || st->path == PATH_NCCL) return 0;
  if (st->path == PATH_STAGED) return 1;
  if (comm->size == 1) return 0;
  pthread_mutex_lock(&st->mu);
  if (st->error[0] != '\0') {
    pthread_mutex_unlock(&st->mu);
    return 0;
  }
  int staged;
  int pair = !t3d__is_collective(req->kind) && comm->group_depth == 0 && req->root >= 0;
  if (pair) {
    staged = same_device(comm, st, req->device, comm->rank, req->root) == 1;
  } else {
    staged = group_route(comm, st, req->device) == ROUTE_STAGED;
  }
  if (st->error[0] != '\0' && !st->warned) {
    st->warned = 1;
    T3D_WARN("t3d: group '%s': cannot tell which ranks share a CUDA device, so NCCL runs its CUDA tensors: %s",
             comm->name, st->error);
  }
  pthread_mutex_unlock(&st->mu);
  return staged;
}

/* ---------- the device side ---------- */

static const char *cuda_text(const t3d_cudart_api_t *api, t3d_cuda_error_t e) {
  const char *s = api->GetErrorString(e);
  return s != NULL ? s : "unknown CUDA error";
}

/* Until everything queued on the stream has finished. */
static t3d_result_t wait_stream(t3d_comm_t *comm, const t3d_cudart_api_t *api, void *stream, uint64_t deadline_ns,
                                char *err, size_t errlen) {
  return t3d__cudev_poll(comm, api, api->StreamQuery, stream, "cudaStreamQuery",
                         "the device to copy its staging buffers", deadline_ns, err, errlen);
}

static t3d_result_t copy(const t3d_cudart_api_t *api, void *dst, const void *src, size_t bytes, int to_device,
                         void *stream, char *err, size_t errlen) {
  if (bytes == 0) return T3D_OK;
  t3d_cuda_error_t e = api->MemcpyAsync(dst, src, bytes, to_device ? T3D_CUDA_MEMCPY_HOST_TO_DEVICE
                                                                   : T3D_CUDA_MEMCPY_DEVICE_TO_HOST, stream);
  if (e == T3D_CUDA_SUCCESS) return T3D_OK;
  snprintf(err, errlen, "cudaMemcpyAsync of %zu bytes %s failed: %s", bytes, to_device ? "to the device" : "from the "
           "device", cuda_text(api, e));
  return T3D_ERR_TRANSPORT; /* breaks the group: peers must not wait for this rank */
}

/* The runtime, with the request's device made current on this thread. */
static const t3d_cudart_api_t *device_api(int device, char *err, size_t errlen) {
  const char *why = NULL;
  const t3d_cudart_api_t *api = t3d__cudart_api(&why);
  if (api == NULL) {
    snprintf(err, errlen, "ranks that share a CUDA device stage through host memory, and %s", why);
    return NULL;
  }
  int cur = -1;
  t3d_cuda_error_t e = api->GetDevice(&cur);
  if (e == T3D_CUDA_SUCCESS && cur != device) e = api->SetDevice(device);
  if (e != T3D_CUDA_SUCCESS) {
    snprintf(err, errlen, "cannot make CUDA device %d current: %s", device, cuda_text(api, e));
    return NULL;
  }
  return api;
}

/* ---------- collectives ---------- */

/* Where a collective's bytes are: `in` bytes read from `src` on the device into the host input; `out` bytes of host
 * output (all of which the host call may write), of which `back` bytes from its start return to the device, or,
 * with `blocks`, only the receive blocks (rcounts, rdispls), so that gaps between them keep their bytes. */
typedef struct {
  const void *src;
  size_t in, out, back;
  int blocks;
  int in_to_out; /* a broadcast: the root's buffer is read into the output (the host call's only buffer) */
} layout_t;

/* The bytes [0, end) that blocks cover. */
static size_t extent(int n, const size_t *counts, const size_t *displs, size_t es) {
  size_t lo, hi;
  t3d__block_extent(n, counts, displs, es, &lo, &hi);
  return hi;
}

static layout_t layout_of(const t3d_request_t *r, int rank, int size) {
  size_t es = t3d_dtype_size(r->dtype), n = r->count * es;
  int root = rank == r->root;
  layout_t l = {r->sendbuf, 0, 0, 0, 0, 0};
  switch (r->kind) {
    case T3D_OP_ALLREDUCE: l.in = l.out = l.back = n; break;
    case T3D_OP_REDUCE:
      l.in = n;
      l.out = (root || r->recvbuf != NULL) ? n : 0;
      l.back = root ? n : 0;
      break;
    case T3D_OP_REDUCE_SCATTERV: l.in = n; l.out = l.back = r->rcounts[rank] * es; break;
    case T3D_OP_BROADCAST:
      l.src = r->recvbuf;
      l.in = root ? n : 0;
      l.out = n;
      l.back = root ? 0 : n;
      l.in_to_out = 1;
      break;
    case T3D_OP_ALLGATHERV:
      l.in = n;
      l.out = extent(size, r->rcounts, r->rdispls, es);
      l.blocks = 1;
      break;
    case T3D_OP_GATHER:
      l.in = n;
      l.out = (root || r->recvbuf != NULL) ? n * (size_t)size : 0;
      l.back = root ? n * (size_t)size : 0;
      break;
    case T3D_OP_SCATTER: l.in = root ? n * (size_t)size : 0; l.out = l.back = n; break;
    case T3D_OP_ALLTOALLV:
      l.in = extent(size, r->scounts, r->sdispls, es);
      l.out = extent(size, r->rcounts, r->rdispls, es);
      l.blocks = 1;
      break;
    default: break;
  }
  return l;
}

/* Copies the result back (layout_t says which bytes); adjacent blocks go in one copy. */
static t3d_result_t copy_back(const t3d_cudart_api_t *api, const t3d_request_t *r, const layout_t *l, int size,
                              const unsigned char *host, char *err, size_t errlen) {
  unsigned char *dev = r->recvbuf;
  if (!l->blocks) return copy(api, dev, host, l->back, 1, r->stream, err, errlen);
  size_t es = t3d_dtype_size(r->dtype);
  size_t from = 0, len = 0; /* the run of adjacent blocks not yet copied, in bytes */
  for (int p = 0; p <= size; p++) {
    size_t off = p < size ? r->rdispls[p] * es : 0, bytes = p < size ? r->rcounts[p] * es : 0;
    if (p < size && bytes == 0) continue;
    if (p < size && len > 0 && off == from + len) {
      len += bytes;
      continue;
    }
    t3d_result_t res = copy(api, dev + from, host + from, len, 1, r->stream, err, errlen);
    if (res != T3D_OK) return res;
    from = off;
    len = bytes;
  }
  return T3D_OK;
}

/* The staging buffer, at least `bytes` long; pinned when the runtime gives pinned memory. */
static unsigned char *staging(t3d_cudev_t *st, const t3d_cudart_api_t *api, size_t bytes) {
  if (bytes <= st->cap && st->buf != NULL) return st->buf;
  size_t cap = st->cap > 0 ? st->cap : 65536;
  while (cap < bytes) cap *= 2;
  if (st->buf != NULL) {
    if (st->pinned) api->FreeHost(st->buf);
    else free(st->buf);
    st->buf = NULL;
    st->cap = 0;
  }
  void *p = NULL;
  st->pinned = api->MallocHost(&p, cap) == T3D_CUDA_SUCCESS && p != NULL;
  if (!st->pinned) p = malloc(cap); /* pageable: the copies then block the caller of cudaMemcpyAsync */
  if (p == NULL) return NULL;
  st->buf = p;
  st->cap = cap;
  return st->buf;
}

static t3d_result_t cudev_run(t3d_exec_t *ex, t3d_request_t *r, t3d_result_t (*host)(t3d_exec_t *, t3d_request_t *)) {
  t3d_comm_t *comm = ex->comm;
  t3d_cudev_t *st = comm->cudev;
  char why[700] = "";
  t3d_result_t res = T3D_OK;
  const char *route = "staged";
  const t3d_cudart_api_t *api = device_api(r->device, why, sizeof why);
  if (api == NULL) {
    res = T3D_ERR_UNSUPPORTED;
    goto out;
  }
  if (st->path != PATH_STAGED && t3d__cudev_ipc_takes(r, ex->size)) {
    int staged = 0;
    res = t3d__cudev_ipc_run(ex, r, &st->ipc, api, host, st->path == PATH_IPC, &staged, why, sizeof why);
    if (res != T3D_OK && why[0] == '\0') return res; /* the host provider wrote ex->error */
    route = "device path";
    if (res != T3D_OK || !staged) goto out;
    route = "staged";
  }
  layout_t l = layout_of(r, ex->rank, ex->size);
  size_t out_at = (l.in + 63) & ~(size_t)63; /* the host input at the buffer's start, the output after it */
  unsigned char *buf = staging(st, api, out_at + l.out + 64);
  if (buf == NULL) {
    res = T3D_ERR_NO_MEMORY;
    snprintf(why, sizeof why, "no host memory for %zu staging bytes", out_at + l.out);
    goto out;
  }
  /* In stream order after everything the caller queued before it: the input as the device has it then. */
  res = copy(api, l.in_to_out ? buf + out_at : buf, l.src, l.in, 0, r->stream, why, sizeof why);
  if (res == T3D_OK && l.in > 0) res = wait_stream(comm, api, r->stream, t3d__exec_deadline(ex), why, sizeof why);
  if (res != T3D_OK) goto out;

  t3d_request_t h;
  memset(&h, 0, sizeof h);
  h.comm = comm;
  h.kind = r->kind;
  h.seq = r->seq;
  h.timeout_ms = r->timeout_ms;
  h.deadline_ns = r->deadline_ns;
  h.sendbuf = r->sendbuf != NULL ? buf : NULL;
  h.recvbuf = (r->recvbuf != NULL || l.out > 0) ? buf + out_at : NULL;
  h.count = r->count;
  h.dtype = r->dtype;
  h.op = r->op;
  h.scalar = r->scalar;
  h.flags = r->flags;
  h.root = r->root;
  h.scounts = r->scounts;
  h.sdispls = r->sdispls;
  h.rcounts = r->rcounts;
  h.rdispls = r->rdispls;
  h.equal_blocks = r->equal_blocks;
  h.source = -1;
  res = host(ex, &h);
  if (res != T3D_OK) return res; /* the host provider wrote ex->error */

  res = copy_back(api, r, &l, ex->size, buf + out_at, why, sizeof why);
  /* Done only when the copy back has finished: the staging buffer is reused next, and the request's completion
   * tells the shim that the stream holds the result. */
  if (res == T3D_OK) res = wait_stream(comm, api, r->stream, t3d__exec_deadline(ex), why, sizeof why);
out:
  if (res != T3D_OK) {
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d, CUDA device %d, %s): %s",
             ex->opname, (unsigned long long)ex->seq, comm->name, ex->rank, ex->size, r->device,
             route, why);
  }
  return res;
}

/* ---------- point-to-point ---------- */

/* A send that the host provider still carries after its CUDA request completed: its staging memory, freed when it
 * completes; a failure then breaks the communicator, so that later calls fail instead of mismatching. */
typedef struct {
  t3d_comm_t *comm;
  t3d_request_t *host;
  void *mem;
} send_tail_t;

static void send_done(void *arg, t3d_result_t res) {
  send_tail_t *t = arg;
  if (res != T3D_OK) t3d__fail_comm(t->comm, res, t3d_request_error(t->host));
  free(t->mem);
  free(t);
}

/* Sends and receives on the caller's thread, each as a request on host memory that the host provider (shared
 * memory) carries: a send's bytes are copied from the device first, and the CUDA send completes once its host send
 * is posted (its staging memory lives until the host send completes); a receive waits for its host receive, then
 * its bytes go to the device, and it completes when they are there. In a group the host requests are posted
 * together, so that any pairing of sends and receives matches. */
static t3d_result_t cudev_post(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped) {
  char why[700] = "", msg[1024] = "";
  t3d_result_t res = T3D_OK;
  t3d_request_t **h = calloc((size_t)n, sizeof *h);
  void **mem = calloc((size_t)n, sizeof *mem);
  const t3d_provider_t *hp = comm->choice[T3D_OP_SEND][0];
  const t3d_cudart_api_t *api = device_api(reqs[0]->device, why, sizeof why);
  if (h == NULL || mem == NULL) {
    res = T3D_ERR_NO_MEMORY;
    snprintf(why, sizeof why, "out of memory");
  } else if (api == NULL) {
    res = T3D_ERR_UNSUPPORTED;
  } else if (hp == NULL || hp->post == NULL || !hp->post_on_caller || hp != comm->choice[T3D_OP_RECV][0]) {
    res = T3D_ERR_UNSUPPORTED;
    snprintf(why, sizeof why, "point-to-point between ranks that share a CUDA device is staged through same-host "
             "shared memory, which this group does not have (T3D_SHM_P2P=0, or ranks may not read each other's "
             "memory with process_vm_readv)");
  }
  uint64_t deadline = t3d__now_ns() + (uint64_t)reqs[0]->timeout_ms * 1000000ull;
  int made = 0;
  for (int i = 0; i < n && res == T3D_OK; i++) {
    const t3d_request_t *r = reqs[i];
    size_t bytes = r->count * t3d_dtype_size(r->dtype);
    mem[i] = malloc(bytes + 1);
    if (mem[i] == NULL || t3d__request_new(comm, r->kind, NULL, &h[i]) != T3D_OK) {
      res = T3D_ERR_NO_MEMORY;
      snprintf(why, sizeof why, "no host memory for %zu staging bytes", bytes);
      break;
    }
    made++;
    h[i]->prov = hp;
    h[i]->timeout_ms = r->timeout_ms;
    h[i]->count = r->count;
    h[i]->dtype = r->dtype;
    h[i]->root = r->root;
    h[i]->tag = r->tag;
    if (r->kind == T3D_OP_SEND) {
      h[i]->sendbuf = mem[i];
      res = copy(api, mem[i], r->sendbuf, bytes, 0, r->stream, why, sizeof why);
    } else {
      h[i]->recvbuf = mem[i];
    }
  }
  for (int i = 0; i < n && res == T3D_OK; i++) {
    if (reqs[i]->kind == T3D_OP_SEND) res = wait_stream(comm, api, reqs[i]->stream, deadline, why, sizeof why);
  }
  if (res == T3D_OK) {
    hp->post(comm, h, n, grouped);
    for (int i = 0; i < n; i++) {
      if (reqs[i]->kind == T3D_OP_SEND) continue;
      t3d_result_t w = t3d_wait(h[i], -1); /* the host receive fails at its own deadline */
      if (w != T3D_OK && res == T3D_OK) {
        res = w;
        snprintf(msg, sizeof msg, "%s", t3d_request_error(h[i]));
      }
    }
    for (int i = 0; i < n && res == T3D_OK; i++) {
      t3d_request_t *r = reqs[i];
      if (r->kind != T3D_OP_RECV) continue;
      r->source = h[i]->source;
      r->recv_count = h[i]->recv_count;
      res = copy(api, r->recvbuf, mem[i], r->recv_count * t3d_dtype_size(r->dtype), 1, r->stream, why, sizeof why);
    }
    for (int i = 0; i < n && res == T3D_OK; i++) {
      if (reqs[i]->kind == T3D_OP_RECV) res = wait_stream(comm, api, reqs[i]->stream, deadline, why, sizeof why);
    }
    for (int i = 0; i < n; i++) { /* posted: each host send keeps its memory until it completes */
      send_tail_t *t = reqs[i]->kind == T3D_OP_SEND ? malloc(sizeof *t) : NULL;
      if (t != NULL) {
        *t = (send_tail_t){comm, h[i], mem[i]};
        mem[i] = NULL;
        t3d_request_set_callback(h[i], send_done, t);
      } else if (reqs[i]->kind == T3D_OP_SEND) {
        t3d_wait(h[i], -1); /* no memory for the record: wait for the send instead */
      }
    }
  } else {
    for (int i = 0; i < made; i++) t3d__request_release(h[i]); /* never posted: the engine's reference too */
  }
  for (int i = 0; i < made; i++) t3d_request_free(h[i]);
  for (int i = 0; i < n && mem != NULL; i++) free(mem[i]);
  free(h);
  free(mem);
  if (res != T3D_OK && msg[0] == '\0') {
    snprintf(msg, sizeof msg, "t3d: %s on rank %d of group '%s' (CUDA device %d, staged): %s",
             t3d__op_name(reqs[0]->kind), comm->rank, comm->name, reqs[0]->device, why);
  }
  /* As on the host path: after a failed device copy or a lost peer the ranks are out of step. */
  if (res == T3D_ERR_TRANSPORT || res == T3D_ERR_TIMEOUT || res == T3D_ERR_PEER_LOST) t3d__fail_comm(comm, res, msg);
  if (res != T3D_OK) t3d__set_error(comm, res, "%s", msg);
  for (int i = 0; i < n; i++) t3d__request_complete(reqs[i], res, res != T3D_OK ? msg : NULL);
  return res;
}

static int cudev_fits(const t3d_comm_t *comm, const t3d_request_t *req) {
  (void)comm;
  return req->memtype == T3D_MEM_CUDA;
}

const t3d_provider_t t3d__provider_cudev = {
    .name = "cudev",
    .fits = cudev_fits,
    .takes = cudev_takes,
    .run = cudev_run,
    .post = cudev_post,
    .post_on_caller = 1,
};
