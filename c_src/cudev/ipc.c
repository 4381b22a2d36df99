/* ipc.c: collectives of ranks that share one CUDA device, run by the device (T3D_CUDA_PATH=ipc). Each rank owns a
 * device buffer (cudaMalloc) and two interprocess events; the others map the buffer and open the events through
 * their IPC handles. A collective, on the caller's stream S:
 *
 *   A. host: every rank's meta (its buffer's handle and generation, the bytes it needs, whether it can run this
 *      collective on the device) goes to every rank (an allgather through the host provider). Growing a buffer
 *      happens before A; the old one stays allocated (and mapped) until the communicator is freed, because work
 *      still queued may read it. When any rank cannot take the device path, all of them stage this collective.
 *   B. S waits for every peer's `done` event: its reads of this rank's buffer (the previous collective) are over.
 *   C. S copies this rank's input into its buffer and records `copied`.
 *   D. host: a barrier; after it every rank has recorded `copied` for this collective.
 *   E. S waits for the peers' `copied` events, then reads their buffers: device-to-device copies (broadcast,
 *      allgather, alltoall) or the registered reduction kernel (allreduce, reduce_scatter), every source in rank
 *      order, so that all ranks compute the same bytes.
 *   F. S records `done`. The request completes now: the rest happens in stream order, as with NCCL.
 *
 * Where IPC does not work (events or buffers that cannot be made, published or mapped: a runtime or a container
 * that refuses them), the rank that met the failure says so in its next meta (at A, or in a second exchange after
 * A when something new was mapped) and every rank turns the device path off for the communicator: with
 * T3D_CUDA_PATH=auto its collectives are staged from then on (rank 0 logs why, once); with T3D_CUDA_PATH=ipc the
 * collective fails on every rank with the failing rank's words.
 *
 * With T3D_CUDA_IPC_WAIT=host the waits of B and E are this thread's polls of the events instead of the stream's, so
 * that no stream waits on another process's (on an H200 that was no faster: what a call costs there without MPS is
 * the GPU's switches between the ranks' contexts).
 *
 * Why the events cannot be re-recorded too early: a peer records `copied` again only after its next A, which needs
 * this rank's next A, which comes after this rank's E; it records `done` again only after its next D, which needs
 * this rank's next C, which comes after this rank's next B. */
#include "cudev_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IPC_MAX_RANKS = 64, IPC_MIN_BYTES = 1 << 20 };

static pthread_mutex_t kernels_mu = PTHREAD_MUTEX_INITIALIZER;
static t3d_cuda_kernels_t kernels;
static int have_kernels;
static atomic_int warned_no_kernels;

void t3d_cuda_set_kernels(const t3d_cuda_kernels_t *k) {
  pthread_mutex_lock(&kernels_mu);
  have_kernels = k != NULL && k->reduce != NULL && k->reduce_supported != NULL;
  if (have_kernels) kernels = *k;
  pthread_mutex_unlock(&kernels_mu);
}

static int get_kernels(t3d_cuda_kernels_t *out) {
  pthread_mutex_lock(&kernels_mu);
  int ok = have_kernels;
  if (ok) *out = kernels;
  pthread_mutex_unlock(&kernels_mu);
  return ok;
}

/* What each rank tells the others at step A. */
typedef struct {
  int64_t gen;    /* of its buffer: a new one gets a new handle */
  int64_t need;   /* bytes it copies into its buffer in this collective */
  int64_t ok;     /* it can run this collective on the device */
  int64_t broken; /* IPC failed on it (why says how): the device path goes off for the communicator */
  t3d_cuda_ipc_handle_t buf, copied, done;
  char why[192];
} meta_t;

typedef struct {
  void *ptr;
  int mapped; /* a peer's, opened through IPC (closed), or this rank's own (freed) */
} held_t;

struct t3d_cudev_ipc {
  int n, rank;
  int host_waits; /* T3D_CUDA_IPC_WAIT=host (read once, at setup) */
  int off;        /* the ranks agreed that IPC fails on some of them: every collective is staged */
  int opened;     /* the peers' events are open */
  /* this rank's */
  void *buf;
  size_t cap;
  int64_t gen;
  void *ev_copied, *ev_done;
  meta_t mine;
  /* the peers' (index: rank; this rank's own entries point at its own buffer) */
  void **peer_buf;
  int64_t *peer_gen; /* every rank's buffer generation as last mapped here (this rank's own too, so that every
                      * rank sees the same thing new after A) */
  void **peer_copied, **peer_done;
  meta_t *metas;
  size_t *counts, *displs; /* of the meta allgather */
  const void **srcs;
  held_t *held; /* buffers replaced by bigger ones, released with the communicator */
  int nheld, capheld;
};

static int hold(t3d_cudev_ipc_t *s, void *ptr, int mapped) {
  if (ptr == NULL) return 1;
  if (s->nheld == s->capheld) {
    int cap = s->capheld ? 2 * s->capheld : 8;
    held_t *h = realloc(s->held, (size_t)cap * sizeof *h);
    if (h == NULL) return 0;
    s->held = h;
    s->capheld = cap;
  }
  s->held[s->nheld++] = (held_t){ptr, mapped};
  return 1;
}

/* Whether event is done, asking for up to a second (an error, e.g. a runtime shutting down, ends the wait). */
static void settle(const t3d_cudart_api_t *api, void *event) {
  if (event == NULL) return;
  uint64_t until = t3d__now_ns() + 1000000000ull;
  t3d_backoff_t b = {0};
  while (api->EventQuery(event) == T3D_CUDA_NOT_READY && t3d__now_ns() < until) t3d__backoff_wait(&b);
}

void t3d__cudev_ipc_free(t3d_cudev_ipc_t *s) {
  if (s == NULL) return;
  const t3d_cudart_api_t *api = t3d__cudart_api(NULL);
  if (api != NULL) {
    /* Reads still queued: this rank's of the peers' buffers end with its `done`, the peers' of this rank's buffer
     * with theirs. Freed before those, a buffer could be read after it is gone. */
    settle(api, s->ev_done);
    for (int p = 0; p < s->n; p++) {
      if (p != s->rank && s->peer_done != NULL) settle(api, s->peer_done[p]);
    }
    for (int p = 0; p < s->n; p++) {
      if (p == s->rank) continue;
      if (s->peer_buf != NULL && s->peer_buf[p] != NULL) api->IpcCloseMemHandle(s->peer_buf[p]);
      /* Events opened through IPC are destroyed like any other. */
      if (s->peer_copied != NULL && s->peer_copied[p] != NULL) api->EventDestroy(s->peer_copied[p]);
      if (s->peer_done != NULL && s->peer_done[p] != NULL) api->EventDestroy(s->peer_done[p]);
    }
    for (int i = 0; i < s->nheld; i++) {
      if (s->held[i].mapped) api->IpcCloseMemHandle(s->held[i].ptr);
      else api->Free(s->held[i].ptr);
    }
    if (s->buf != NULL) api->Free(s->buf);
    if (s->ev_copied != NULL) api->EventDestroy(s->ev_copied);
    if (s->ev_done != NULL) api->EventDestroy(s->ev_done);
  }
  free(s->peer_buf);
  free(s->peer_gen);
  free(s->peer_copied);
  free(s->peer_done);
  free(s->metas);
  free(s->counts);
  free(s->displs);
  free(s->srcs);
  free(s->held);
  free(s);
}

static const char *cuda_text(const t3d_cudart_api_t *api, t3d_cuda_error_t e) {
  const char *s = api->GetErrorString(e);
  return s != NULL ? s : "unknown CUDA error";
}

/* Records that IPC failed on this rank (the first failure's words), for the next meta. */
static void broke(t3d_cudev_ipc_t *s, const t3d_cudart_api_t *api, const char *what, t3d_cuda_error_t e) {
  if (s->mine.broken) return;
  s->mine.broken = 1;
  snprintf(s->mine.why, sizeof s->mine.why, "%s failed: %s", what, e == T3D_CUDA_SUCCESS ? "out of host memory"
                                                                   : cuda_text(api, e));
}

#define CUDA_OR_FAIL(call, what)                                                                     \
  do {                                                                                               \
    t3d_cuda_error_t e_ = (call);                                                                    \
    if (e_ != T3D_CUDA_SUCCESS) {                                                                    \
      snprintf(err, errlen, "%s failed: %s (T3D_CUDA_PATH=staged avoids the device path)", what,     \
               cuda_text(api, e_));                                                                  \
      return T3D_ERR_TRANSPORT; /* breaks the group: the peers must not wait for this rank */        \
    }                                                                                                \
  } while (0)

/* The state and this rank's two events, at the communicator's first device-path collective (a CUDA failure is
 * recorded for step A: the state is made all the same). */
static t3d_result_t setup(t3d_cudev_ipc_t **out, const t3d_cudart_api_t *api, int rank, int n, char *err,
                          size_t errlen) {
  t3d_cudev_ipc_t *s = calloc(1, sizeof *s);
  if (s == NULL) goto oom;
  *out = s;
  s->n = n;
  s->rank = rank;
  s->host_waits = strcmp(t3d__param_str(T3D_PARAM_CUDA_IPC_WAIT), "host") == 0;
  s->peer_buf = calloc((size_t)n, sizeof *s->peer_buf);
  s->peer_gen = calloc((size_t)n, sizeof *s->peer_gen);
  s->peer_copied = calloc((size_t)n, sizeof *s->peer_copied);
  s->peer_done = calloc((size_t)n, sizeof *s->peer_done);
  s->metas = calloc((size_t)n, sizeof *s->metas);
  s->counts = calloc((size_t)n, sizeof *s->counts);
  s->displs = calloc((size_t)n, sizeof *s->displs);
  s->srcs = calloc((size_t)n, sizeof *s->srcs);
  if (!s->peer_buf || !s->peer_gen || !s->peer_copied || !s->peer_done || !s->metas ||
      !s->counts || !s->displs || !s->srcs) {
    goto oom;
  }
  for (int p = 0; p < n; p++) {
    s->counts[p] = sizeof(meta_t);
    s->displs[p] = (size_t)p * sizeof(meta_t);
  }
  const unsigned flags = T3D_CUDA_EVENT_DISABLE_TIMING | T3D_CUDA_EVENT_INTERPROCESS;
  t3d_cuda_error_t e;
  if ((e = api->EventCreateWithFlags(&s->ev_copied, flags)) != T3D_CUDA_SUCCESS ||
      (e = api->EventCreateWithFlags(&s->ev_done, flags)) != T3D_CUDA_SUCCESS) {
    broke(s, api, "cudaEventCreateWithFlags (interprocess)", e);
  } else if ((e = api->IpcGetEventHandle(&s->mine.copied, s->ev_copied)) != T3D_CUDA_SUCCESS ||
             (e = api->IpcGetEventHandle(&s->mine.done, s->ev_done)) != T3D_CUDA_SUCCESS) {
    broke(s, api, "cudaIpcGetEventHandle", e);
  }
  return T3D_OK;
oom:
  snprintf(err, errlen, "out of host memory");
  return T3D_ERR_NO_MEMORY;
}

/* This rank's buffer, at least `need` bytes (before step A; the old one is held). 0 when the device has no room:
 * this rank then says it cannot take the device path. */
static int grow(t3d_cudev_ipc_t *s, const t3d_cudart_api_t *api, size_t need) {
  if (need <= s->cap) return 1;
  size_t cap = s->cap > IPC_MIN_BYTES ? s->cap : IPC_MIN_BYTES;
  while (cap < need) cap *= 2;
  void *p = NULL;
  t3d_cuda_ipc_handle_t h;
  if (api->Malloc(&p, cap) != T3D_CUDA_SUCCESS || p == NULL) return 0; /* no room now: staged this time */
  t3d_cuda_error_t e = api->IpcGetMemHandle(&h, p);
  if (e != T3D_CUDA_SUCCESS || !hold(s, s->buf, 0)) {
    api->Free(p);
    broke(s, api, "cudaIpcGetMemHandle", e);
    return 0;
  }
  s->buf = p;
  s->cap = cap;
  s->gen++;
  s->mine.buf = h;
  s->mine.gen = s->gen;
  return 1;
}

/* After step A: maps what peers published that is new (a bigger buffer, their events the first time). A failure
 * is recorded (broke) for the exchange that follows. Whether anything is new is the same on every rank. */
static int anything_new(const t3d_cudev_ipc_t *s) {
  if (!s->opened) return 1;
  for (int p = 0; p < s->n; p++) {
    if (s->metas[p].gen != s->peer_gen[p]) return 1;
  }
  return 0;
}

static void open_peers(t3d_cudev_ipc_t *s, const t3d_cudart_api_t *api) {
  for (int p = 0; p < s->n; p++) {
    const meta_t *m = &s->metas[p];
    if (p == s->rank) {
      s->peer_buf[p] = s->buf;
      s->peer_gen[p] = m->gen;
      continue;
    }
    t3d_cuda_error_t e;
    if (s->peer_copied[p] == NULL) {
      if ((e = api->IpcOpenEventHandle(&s->peer_copied[p], m->copied)) != T3D_CUDA_SUCCESS ||
          (e = api->IpcOpenEventHandle(&s->peer_done[p], m->done)) != T3D_CUDA_SUCCESS) {
        broke(s, api, "cudaIpcOpenEventHandle", e);
        return;
      }
    }
    if (m->gen != s->peer_gen[p] && m->gen > 0) {
      void *ptr = NULL;
      if ((e = api->IpcOpenMemHandle(&ptr, m->buf, T3D_CUDA_IPC_LAZY_PEER_ACCESS)) != T3D_CUDA_SUCCESS) {
        broke(s, api, "cudaIpcOpenMemHandle", e);
        return;
      }
      if (!hold(s, s->peer_buf[p], 1)) {
        api->IpcCloseMemHandle(ptr);
        broke(s, api, "keeping a peer's old mapping", T3D_CUDA_SUCCESS);
        return;
      }
      s->peer_buf[p] = ptr;
      s->peer_gen[p] = m->gen;
    }
  }
  s->opened = 1;
}

/* The bytes a collective moves as every rank counts them alike (alltoallv: from its receive counts, equal on every
 * rank only with equal blocks, which A checks). */
static size_t moved_bytes(const t3d_request_t *r, int n) {
  size_t es = t3d_dtype_size(r->dtype), total = 0;
  if (r->kind == T3D_OP_ALLGATHERV || r->kind == T3D_OP_ALLTOALLV) {
    for (int p = 0; p < n; p++) total += r->rcounts[p];
    return total * es;
  }
  return r->count * es;
}

static size_t min_bytes(void) {
  int64_t v = t3d__param_int(T3D_PARAM_CUDA_IPC_MIN_BYTES);
  return v < 0 ? 0 : (size_t)v;
}

int t3d__cudev_ipc_takes(const t3d_request_t *r, int n) {
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
    case T3D_OP_REDUCE_SCATTERV:
    case T3D_OP_BROADCAST:
    case T3D_OP_ALLGATHERV: return moved_bytes(r, n) >= min_bytes(); /* the same on every rank */
    case T3D_OP_ALLTOALLV: return 1; /* decided at A, where the ranks agree on equal blocks first */
    default: return 0;
  }
}

/* Bytes this rank copies into its buffer, and from where. */
static size_t input_of(const t3d_request_t *r, int rank, int n, const void **src) {
  size_t es = t3d_dtype_size(r->dtype);
  *src = r->sendbuf;
  switch (r->kind) {
    case T3D_OP_BROADCAST:
      *src = r->recvbuf;
      return rank == r->root ? r->count * es : 0;
    case T3D_OP_ALLTOALLV: {
      size_t lo, hi;
      t3d__block_extent(n, r->scounts, r->sdispls, es, &lo, &hi);
      return hi;
    }
    default: return r->count * es; /* allreduce, reduce_scatterv (the whole input), allgatherv (its block) */
  }
}

/* Step E on stream: the reads of the peers' buffers. */
static t3d_result_t read_peers(t3d_cudev_ipc_t *s, const t3d_cudart_api_t *api, const t3d_cuda_kernels_t *k,
                               const t3d_request_t *r, int size, char *err, size_t errlen) {
  const size_t es = t3d_dtype_size(r->dtype);
  const int me = s->rank;
  unsigned char *out = r->recvbuf;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
    case T3D_OP_REDUCE_SCATTERV: {
      size_t off = 0, count = r->count;
      if (r->kind == T3D_OP_REDUCE_SCATTERV) {
        for (int p = 0; p < me; p++) off += r->rcounts[p];
        count = r->rcounts[me];
      }
      if (count == 0) return T3D_OK;
      for (int p = 0; p < size; p++) s->srcs[p] = (const unsigned char *)s->peer_buf[p] + off * es;
      t3d_cuda_error_t e = k->reduce(out, s->srcs, size, count, r->dtype, r->op, r->scalar, r->stream);
      if (e != T3D_CUDA_SUCCESS) {
        snprintf(err, errlen, "the device reduction of %zu %s failed: %s", count, t3d_dtype_name(r->dtype),
                 cuda_text(api, e));
        return T3D_ERR_TRANSPORT;
      }
      return T3D_OK;
    }
    case T3D_OP_BROADCAST:
      if (me == r->root || r->count == 0) return T3D_OK;
      CUDA_OR_FAIL(api->MemcpyAsync(out, s->peer_buf[r->root], r->count * es, T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE,
                                    r->stream), "cudaMemcpyAsync (device to device)");
      return T3D_OK;
    case T3D_OP_ALLGATHERV:
      for (int p = 0; p < size; p++) {
        if (r->rcounts[p] == 0) continue;
        CUDA_OR_FAIL(api->MemcpyAsync(out + r->rdispls[p] * es, s->peer_buf[p], r->rcounts[p] * es,
                                      T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE, r->stream),
                     "cudaMemcpyAsync (device to device)");
      }
      return T3D_OK;
    case T3D_OP_ALLTOALLV:
      /* Equal blocks (checked at A): peer p's block for this rank lies where this rank's block for p would. */
      for (int p = 0; p < size; p++) {
        if (r->rcounts[p] == 0) continue;
        CUDA_OR_FAIL(api->MemcpyAsync(out + r->rdispls[p] * es,
                                      (const unsigned char *)s->peer_buf[p] + r->sdispls[me] * es,
                                      r->rcounts[p] * es, T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE, r->stream),
                     "cudaMemcpyAsync (device to device)");
      }
      return T3D_OK;
    default:
      snprintf(err, errlen, "internal error: %s on the device path", t3d__op_name((t3d_op_kind_t)r->kind));
      return T3D_ERR_INTERNAL;
  }
}

/* Makes the work that follows on stream wait for the peers' events (only_writers: of the peers that wrote their
 * buffer in this collective): on the device (cudaStreamWaitEvent), or, with T3D_CUDA_IPC_WAIT=host, here, by
 * polling them, so that no stream of this process waits on another process's. */
static t3d_result_t wait_peers(t3d_exec_t *ex, t3d_cudev_ipc_t *s, const t3d_cudart_api_t *api, void **events,
                               int only_writers, void *stream, char *err, size_t errlen) {
  for (int p = 0; p < s->n; p++) {
    if (p == s->rank || (only_writers && s->metas[p].need == 0)) continue;
    if (!s->host_waits) {
      CUDA_OR_FAIL(api->StreamWaitEvent(stream, events[p], 0), "cudaStreamWaitEvent");
      continue;
    }
    char what[48];
    snprintf(what, sizeof what, "rank %d's device work", p);
    t3d_result_t res = t3d__cudev_poll(ex->comm, api, api->EventQuery, events[p], "cudaEventQuery", what,
                                       t3d__exec_deadline(ex), err, errlen);
    if (res != T3D_OK) return res;
  }
  return T3D_OK;
}

/* A host request of kind on this communicator, through `host` (the engine's host provider). */
static t3d_result_t host_op(t3d_exec_t *ex, const t3d_request_t *r, t3d_op_kind_t kind, t3d_cudev_ipc_t *s,
                            t3d_result_t (*host)(t3d_exec_t *, t3d_request_t *)) {
  t3d_request_t h;
  memset(&h, 0, sizeof h);
  h.comm = ex->comm;
  h.kind = kind;
  h.seq = r->seq;
  h.timeout_ms = r->timeout_ms;
  h.deadline_ns = r->deadline_ns;
  h.root = -1;
  h.source = -1;
  if (kind == T3D_OP_ALLGATHERV) {
    h.sendbuf = &s->mine;
    h.recvbuf = s->metas;
    h.count = sizeof(meta_t);
    h.dtype = T3D_UINT8;
    h.rcounts = s->counts;
    h.rdispls = s->displs;
  }
  return host(ex, &h);
}

/* After an exchange of metas: when some rank says IPC failed on it, the device path goes off for the communicator
 * (the same decision on every rank). With strict (T3D_CUDA_PATH=ipc) that fails the collective with the failing
 * rank's words; otherwise it is staged, and so is every later one. */
static t3d_result_t check_broken(t3d_cudev_ipc_t *s, const t3d_exec_t *ex, int strict, int *staged, char *err,
                                 size_t errlen) {
  for (int p = 0; p < s->n; p++) {
    const meta_t *m = &s->metas[p];
    if (!m->broken) continue;
    s->off = 1;
    if (strict) {
      snprintf(err, errlen, "CUDA IPC failed on rank %d: %.*s (T3D_CUDA_PATH=staged avoids the device path)", p,
               (int)sizeof m->why, m->why);
      return T3D_ERR_TRANSPORT;
    }
    if (s->rank == 0) {
      T3D_WARN("t3d: group '%s': CUDA IPC failed on rank %d (%.*s), so the collectives of its ranks that share a "
               "GPU are staged through host memory from now on", ex->comm->name, p, (int)sizeof m->why, m->why);
    }
    *staged = 1;
    return T3D_OK;
  }
  return T3D_OK;
}

t3d_result_t t3d__cudev_ipc_run(t3d_exec_t *ex, t3d_request_t *r, t3d_cudev_ipc_t **state,
                                const t3d_cudart_api_t *api, t3d_result_t (*host)(t3d_exec_t *, t3d_request_t *),
                                int strict, int *staged, char *err, size_t errlen) {
  const int n = ex->size, me = ex->rank;
  *staged = 0;
  if (n > IPC_MAX_RANKS || (*state != NULL && (*state)->off)) {
    *staged = 1; /* every rank sees the same size, and turned the path off at the same call */
    return T3D_OK;
  }
  t3d_result_t res;
  if (*state == NULL && (res = setup(state, api, me, n, err, errlen)) != T3D_OK) return res;
  t3d_cudev_ipc_t *s = *state;

  /* What this rank can do, before A. */
  t3d_cuda_kernels_t k = {0};
  int reduces = r->kind == T3D_OP_ALLREDUCE || r->kind == T3D_OP_REDUCE_SCATTERV;
  int have = get_kernels(&k);
  if (reduces && !have && !atomic_exchange(&warned_no_kernels, 1)) {
    T3D_WARN("t3d: no device reduction is registered (t3d._C_cuda registers it when it loads), so reducing "
             "collectives of ranks that share a GPU are staged through host memory");
  }
  int ok = !s->mine.broken && (!reduces || (have && k.reduce_supported(r->dtype, r->op)));
  if (r->kind == T3D_OP_ALLTOALLV) ok = ok && r->equal_blocks && moved_bytes(r, n) >= min_bytes();
  const void *src = NULL;
  size_t need = input_of(r, me, n, &src);
  if (ok && need > 0) ok = grow(s, api, need);
  s->mine.need = (int64_t)need;
  s->mine.ok = ok;

  /* A */
  if ((res = host_op(ex, r, T3D_OP_ALLGATHERV, s, host)) != T3D_OK) return res;
  if ((res = check_broken(s, ex, strict, staged, err, errlen)) != T3D_OK || *staged) return res;
  for (int p = 0; p < n; p++) {
    if (!s->metas[p].ok) {
      *staged = 1;
      return T3D_OK;
    }
  }
  if (anything_new(s)) {
    /* Mapping may fail on some ranks only: they say so in a second exchange before anyone relies on it. */
    open_peers(s, api);
    if ((res = host_op(ex, r, T3D_OP_ALLGATHERV, s, host)) != T3D_OK) return res;
    if ((res = check_broken(s, ex, strict, staged, err, errlen)) != T3D_OK || *staged) return res;
  }
  /* B, C */
  if (need > 0) {
    if ((res = wait_peers(ex, s, api, s->peer_done, 0, r->stream, err, errlen)) != T3D_OK) return res;
    CUDA_OR_FAIL(api->MemcpyAsync(s->buf, src, need, T3D_CUDA_MEMCPY_DEVICE_TO_DEVICE, r->stream),
                 "cudaMemcpyAsync (device to device)");
  }
  CUDA_OR_FAIL(api->EventRecord(s->ev_copied, r->stream), "cudaEventRecord");
  /* D */
  if ((res = host_op(ex, r, T3D_OP_BARRIER, s, host)) != T3D_OK) return res;
  /* E, F */
  if ((res = wait_peers(ex, s, api, s->peer_copied, 1, r->stream, err, errlen)) != T3D_OK) return res;
  if ((res = read_peers(s, api, &k, r, n, err, errlen)) != T3D_OK) return res;
  CUDA_OR_FAIL(api->EventRecord(s->ev_done, r->stream), "cudaEventRecord");
  return T3D_OK;
}
