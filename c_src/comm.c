/* comm.c: the communicator engine: init/split/destroy/abort, the progress thread that runs operations in issue
 * order, requests and their completion, groups, and the point-to-point primitives collectives are built from. */
#include "comm.h"
#include "nccl/nccl_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---------- errors ---------- */

/* Every error text is also kept per thread: a failed t3d_comm_init has no communicator to ask. */
static _Thread_local char thread_last_error[1024];

const char *t3d_thread_last_error(void) { return thread_last_error; }

t3d_result_t t3d__set_error(t3d_comm_t *comm, t3d_result_t res, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  T3D_INFO("%s", msg);
  snprintf(thread_last_error, sizeof thread_last_error, "%s", msg);
  if (comm != NULL) {
    pthread_mutex_lock(&comm->err_mu);
    snprintf(comm->last_error, sizeof comm->last_error, "%s", msg);
    pthread_mutex_unlock(&comm->err_mu);
  }
  return res;
}

const char *t3d_comm_last_error(t3d_comm_t *comm) {
  /* A per-thread copy: the progress thread may overwrite the communicator's buffer at any time. */
  static _Thread_local char copy[1024];
  if (comm == NULL) return "t3d: communicator is NULL";
  pthread_mutex_lock(&comm->err_mu);
  memcpy(copy, comm->last_error, sizeof copy);
  pthread_mutex_unlock(&comm->err_mu);
  return copy;
}

/* ---------- store ---------- */

t3d_result_t t3d__store_set(t3d_comm_t *comm, const char *key, const void *value, size_t len) {
  char full[512];
  snprintf(full, sizeof full, "%s/%s", comm->prefix, key);
  T3D_TRACE("store set '%s' (%zu bytes) rank %d", full, len, comm->rank);
  t3d_result_t res = comm->store.set(comm->store.ctx, full, value, len);
  if (res != T3D_OK) {
    return t3d__set_error(comm, res, "t3d: store set of '%s' failed on rank %d of group '%s': %s", full,
                          comm->rank, comm->name, t3d_result_string(res));
  }
  return T3D_OK;
}

t3d_result_t t3d__store_get(t3d_comm_t *comm, const char *key, void **value, size_t *len) {
  char full[512];
  snprintf(full, sizeof full, "%s/%s", comm->prefix, key);
  T3D_TRACE("store get '%s' rank %d", full, comm->rank);
  t3d_result_t res = comm->store.get(comm->store.ctx, full, value, len, comm->timeout_ms);
  if (res != T3D_OK) {
    return t3d__set_error(comm, res, "t3d: store get of '%s' failed on rank %d of group '%s' after %lld ms: %s",
                          full, comm->rank, comm->name, (long long)comm->timeout_ms, t3d_result_string(res));
  }
  return T3D_OK;
}

/* ---------- waiting: spin briefly, then yield, then block (ranks often outnumber cores) ---------- */

/* Time since the last sign of progress decides: pause-spin for a few microseconds (T3D_SPIN_NS, 5 us: a streaming
 * peer answers within that), then yield (T3D_YIELD_NS, 2 ms: lets the peer run when ranks outnumber cores), then
 * block: on the waiter's own wake-up signal where it has one (shared-memory flags: a futex), otherwise in short naps.
 * When this host runs as many ranks as it has cores or more, the peer we wait for is often queued behind us on our
 * own core (measured: two ranks on two cores share one about half the time, as the scheduler places a woken task
 * next to its waker): the spin phase is skipped, except by a shared-memory waiter that sees its peer running on
 * another CPU (t3d__backoff_poll_running, shm.h's t3d__shm_cpu). With more ranks than cores every polling thread also takes turns
 * from the ranks that have work: the yield phase is cut to T3D_YIELD_NS_OVERSUBSCRIBED (200 us) and the idle
 * progress thread stops watching its queue (t3d__backoff_note_ranks, t3d__oversubscribed). With exactly as many, a rank still has
 * about a core to itself, and blocking would cost a wake-up per step of a pipelined operation (measured, 2 ranks:
 * small broadcast 22 -> 45 us, 64 MiB allreduce 86% -> 73% of its bound). */
static _Atomic int64_t spin_ns = -1;  /* -1: not decided yet */
static _Atomic int64_t yield_ns = -1; /* -1: not decided yet */
static _Atomic int64_t running_spin_ns = -1; /* t3d__backoff_poll_running: T3D_SPIN_NS even when the cores are full */
static atomic_int oversubscribed;

static int64_t budget(_Atomic int64_t *slot, const char *env, int64_t dflt) {
  int64_t v = atomic_load_explicit(slot, memory_order_relaxed);
  if (v < 0) {
    v = t3d__env_int(env, dflt);
    if (v < 0) v = 0;
    int64_t expected = -1;
    atomic_compare_exchange_strong(slot, &expected, v);
    v = atomic_load_explicit(slot, memory_order_relaxed);
  }
  return v;
}

void t3d__backoff_note_ranks(int local_ranks) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) < cpus) cpus = CPU_COUNT(&set);
  if (cpus <= 0 || local_ranks < cpus) return;
  /* Values the user set stay. */
  if (t3d__env_str("T3D_SPIN_NS", NULL) == NULL) atomic_store_explicit(&spin_ns, 0, memory_order_relaxed);
  if (local_ranks == cpus) return;
  atomic_store(&oversubscribed, 1);
  if (t3d__env_str("T3D_YIELD_NS", NULL) == NULL) {
    atomic_store_explicit(&yield_ns, t3d__env_int("T3D_YIELD_NS_OVERSUBSCRIBED", 200000), memory_order_relaxed);
  }
}

int t3d__oversubscribed(void) { return atomic_load(&oversubscribed); }

void t3d__backoff_reset(t3d_backoff_t *b) { b->since = 0; }

/* One poll: pause-spin while idle < spin (setting *spun), then yield, then 1. */
static int backoff_step(uint64_t *since, uint64_t spin, int *spun) {
  uint64_t now = t3d__now_ns();
  if (*since == 0) *since = now;
  uint64_t idle = now - *since;
  if (idle < spin) {
    for (int i = 0; i < 8; i++) __builtin_ia32_pause();
    if (spun != NULL) *spun = 1;
    return 0;
  }
  if (idle < spin + (uint64_t)budget(&yield_ns, "T3D_YIELD_NS", 2000000)) {
    sched_yield();
    return 0;
  }
  return 1;
}

int t3d__backoff_poll(t3d_backoff_t *b) {
  b->spun = 0;
  return backoff_step(&b->since, (uint64_t)budget(&spin_ns, "T3D_SPIN_NS", 5000), &b->spun);
}

int t3d_backoff_poll(uint64_t *since) {
  return backoff_step(since, (uint64_t)budget(&spin_ns, "T3D_SPIN_NS", 5000), NULL);
}

int t3d__backoff_poll_running(t3d_backoff_t *b) {
  b->spun = 0;
  uint64_t now = t3d__now_ns();
  if (b->since == 0) b->since = now;
  if (now - b->since < (uint64_t)budget(&running_spin_ns, "T3D_SPIN_NS", 5000)) {
    for (int i = 0; i < 8; i++) __builtin_ia32_pause();
    b->spun = 1;
    return 0;
  }
  return t3d__backoff_poll(b);
}

int t3d__cores_filled(void) { return atomic_load_explicit(&spin_ns, memory_order_relaxed) == 0; }

void t3d__backoff_wait(t3d_backoff_t *b) {
  if (t3d__backoff_poll(b)) {
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

/* ---------- requests ---------- */

void t3d__request_prepare(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t *r) {
  memset(r, 0, sizeof *r);
  r->comm = comm;
  r->kind = kind;
  atomic_init(&r->done, 0);
  atomic_init(&r->refs, 2);
  r->timeout_ms = (opts != NULL && opts->timeout_ms > 0) ? opts->timeout_ms : comm->timeout_ms;
  r->scalar = opts != NULL ? opts->premul_scalar : 1.0;
  r->flags = opts != NULL ? opts->flags : 0u;
  /* A barrier has no buffers: it always runs on the host. */
  if (opts != NULL && opts->memtype == T3D_MEM_CUDA && kind != T3D_OP_BARRIER) {
    r->memtype = T3D_MEM_CUDA;
    r->device = opts->device;
    r->stream = opts->stream;
  }
  r->source = -1;
}

/* A heap copy of a prepared request, with its mutex and condition variable; NULL when out of memory. */
static t3d_request_t *request_keep(const t3d_request_t *prepared) {
  t3d_request_t *r = malloc(sizeof *r);
  if (r == NULL) return NULL;
  memcpy(r, prepared, sizeof *r);
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  return r;
}

t3d_result_t t3d__request_new(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t **out) {
  t3d_request_t tmp;
  t3d__request_prepare(comm, kind, opts, &tmp);
  *out = request_keep(&tmp);
  if (*out == NULL) return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d: out of memory for a request");
  return T3D_OK;
}

/* What every collective that finished on the caller's thread without error hands out (t3d__submit_prepared): done,
 * T3D_OK, never freed. One for all, so that such a call allocates nothing. */
static t3d_request_t done_ok = {.done = 1, .refs = 1, .result = T3D_OK, .mu = PTHREAD_MUTEX_INITIALIZER,
                                .cv = PTHREAD_COND_INITIALIZER, .source = -1};

static void request_destroy(t3d_request_t *r) {
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r->errmsg);
  free(r->arrays);
  free(r);
}

void t3d__request_release(t3d_request_t *r) {
  if (atomic_fetch_sub(&r->refs, 1) == 1) request_destroy(r);
}

void t3d_request_free(t3d_request_t *req) {
  if (req != NULL && req != &done_ok) t3d__request_release(req);
}

static void complete(t3d_request_t *r, t3d_result_t res, const char *msg) {
  r->result = res;
  if (res < 0 && msg != NULL && msg[0] != '\0') r->errmsg = strdup(msg);
  pthread_mutex_lock(&r->mu);
  atomic_store_explicit(&r->done, 1, memory_order_release);
  t3d_callback_t cb = r->cb;
  void *arg = r->cb_arg;
  r->cb = NULL;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  if (cb != NULL) cb(arg, res);
  t3d_request_t *parent = r->parent;
  if (parent != NULL) {
    if (res < 0 && parent->first_child_error == T3D_OK) {
      parent->first_child_error = res;
      if (r->errmsg != NULL) parent->errmsg = strdup(r->errmsg);
    }
    if (atomic_fetch_sub(&parent->pending_children, 1) == 1) {
      char *pmsg = parent->errmsg;
      parent->errmsg = NULL;
      complete(parent, parent->first_child_error, pmsg);
      free(pmsg);
    }
  }
  t3d__request_release(r); /* the engine's reference */
}

void t3d__request_complete(t3d_request_t *req, t3d_result_t res, const char *msg) { complete(req, res, msg); }

/* complete() for a request that finished on the caller's thread before the call handed it out: nobody can wait on
 * it, have set a callback, or hold it as a child yet, so the mutex, the broadcast and the atomic read-modify-writes
 * go (each locked instruction would also wait for the stores just made to leave this core). */
static void complete_fresh(t3d_request_t *r, t3d_result_t res, const char *msg) {
  r->result = res;
  if (res < 0 && msg != NULL && msg[0] != '\0') r->errmsg = strdup(msg);
  atomic_store_explicit(&r->done, 1, memory_order_relaxed);
  atomic_store_explicit(&r->refs, 1, memory_order_relaxed); /* the engine's reference, dropped */
}

/* Point-to-point over shared memory progresses only when someone runs a pass: a waiter does. */
static int drive(t3d_request_t *req) {
  if (!req->on_shm || atomic_load_explicit(&req->done, memory_order_acquire)) return 0;
  return t3d__shm_p2p_progress(req->comm->shm_p2p);
}

t3d_result_t t3d_test(t3d_request_t *req) {
  if (req == NULL) return T3D_ERR_INVALID_ARG;
  drive(req);
  if (!atomic_load_explicit(&req->done, memory_order_acquire)) return T3D_IN_PROGRESS;
  return req->result;
}

int t3d_request_poll(t3d_request_t *req, uint64_t *since) {
  if (req == NULL || since == NULL) return 1;
  if (!req->on_shm) return t3d_backoff_poll(since);
  if (atomic_load_explicit(&req->done, memory_order_acquire)) return 1;
  if (drive(req) > 0) {
    *since = 0;
    return 0;
  }
  /* Nobody else runs the passes this request needs: past the spin and yield phases, sleep on this rank's doorbell,
   * which peers ring when they publish something for it. */
  if (t3d_backoff_poll(since)) t3d__shm_p2p_sleep(req->comm->shm_p2p, req, 1000000);
  return 0;
}

t3d_result_t t3d_wait(t3d_request_t *req, int64_t timeout_ms) {
  if (req == NULL) return T3D_ERR_INVALID_ARG;
  if (atomic_load_explicit(&req->done, memory_order_acquire)) return req->result; /* e.g. finished inline */
  /* Spin a little, then yield (the progress threads may need this core), then sleep on the condition variable.
   * Point-to-point over shared memory keeps polling (t3d_request_poll) until done or timeout_ms. */
  uint64_t since = 0;
  uint64_t until = timeout_ms >= 0 ? t3d__now_ns() + (uint64_t)timeout_ms * 1000000ull : UINT64_MAX;
  while (!atomic_load_explicit(&req->done, memory_order_acquire)) {
    if (t3d_request_poll(req, &since) || t3d__now_ns() > until) break;
  }
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  if (timeout_ms >= 0) {
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
      dl.tv_sec++;
      dl.tv_nsec -= 1000000000L;
    }
  }
  pthread_mutex_lock(&req->mu);
  int rc = 0;
  while (!atomic_load_explicit(&req->done, memory_order_acquire) && rc != ETIMEDOUT) {
    rc = timeout_ms >= 0 ? pthread_cond_timedwait(&req->cv, &req->mu, &dl) : pthread_cond_wait(&req->cv, &req->mu);
  }
  pthread_mutex_unlock(&req->mu);
  if (!atomic_load_explicit(&req->done, memory_order_acquire)) return T3D_ERR_TIMEOUT;
  return req->result;
}

const char *t3d_request_error(t3d_request_t *req) {
  if (req == NULL || !atomic_load_explicit(&req->done, memory_order_acquire) || req->errmsg == NULL) return "";
  return req->errmsg;
}

int t3d_request_source(t3d_request_t *req) { return req != NULL ? req->source : -1; }
size_t t3d_request_count(t3d_request_t *req) { return req != NULL ? req->recv_count : 0; }

t3d_result_t t3d_request_set_callback(t3d_request_t *req, t3d_callback_t fn, void *arg) {
  if (req == NULL || fn == NULL) return T3D_ERR_INVALID_ARG;
  pthread_mutex_lock(&req->mu);
  int done = atomic_load_explicit(&req->done, memory_order_acquire);
  if (!done) {
    req->cb = fn;
    req->cb_arg = arg;
  }
  pthread_mutex_unlock(&req->mu);
  if (done) fn(arg, req->result);
  return T3D_OK;
}

/* ---------- submission ---------- */

static void enqueue(t3d_comm_t *comm, t3d_request_t *r) {
  pthread_mutex_lock(&comm->mu);
  r->next = NULL;
  if (comm->q_tail != NULL) comm->q_tail->next = r;
  else comm->q_head = r;
  comm->q_tail = r;
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
}

static int is_collective(t3d_op_kind_t k) { return k != T3D_OP_SEND && k != T3D_OP_RECV && k != T3D_OP_GROUP; }

static t3d_result_t start_inline(t3d_comm_t *comm, t3d_request_t *r, int kept, int whole, t3d_request_t **out);

/* Ends the engine's busy state. Requests queued meanwhile waited for it: wake the progress thread. */
static void release_engine(t3d_comm_t *comm) {
  pthread_mutex_lock(&comm->mu);
  comm->busy = 0;
  if (comm->q_head != NULL) pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
}

t3d_result_t t3d__submit(t3d_comm_t *comm, t3d_request_t *r, t3d_request_t **out) {
  int coll = is_collective(r->kind);
  *out = r;
  pthread_mutex_lock(&comm->mu);
  /* Sequence numbers are given at issue time: every rank issues collectives in the same order, so they agree. */
  if (coll) r->seq = ++comm->coll_seq;
  if (comm->group_depth > 0) {
    pthread_mutex_unlock(&comm->mu);
    r->next_child = NULL;
    if (comm->group_tail != NULL) comm->group_tail->next_child = r;
    else comm->group_head = r;
    comm->group_tail = r;
    return T3D_OK;
  }
  if (!coll && comm->shm_p2p != NULL && r->memtype == T3D_MEM_HOST) {
    /* Same-host point-to-point is posted here, on the caller's thread, in issue order. */
    pthread_mutex_unlock(&comm->mu);
    t3d__shm_p2p_post(comm->shm_p2p, &r, 1);
    return T3D_OK;
  }
  if (r->memtype == T3D_MEM_CUDA) {
    /* NCCL enqueues on the caller's stream at once; an error is the call's, and no request is handed out. */
    pthread_mutex_unlock(&comm->mu);
    t3d_result_t res = t3d__nccl_run(comm, &r, 1, 0);
    if (res < 0) {
      *out = NULL;
      t3d__request_release(r);
      return res;
    }
    return T3D_OK;
  }
  /* A small collective on an idle engine starts on the caller's thread: two thread hand-offs cost more than the
   * operation. */
  if (coll && comm->q_head == NULL && !comm->busy && t3d__inline_eligible(comm, r)) {
    comm->busy = 1;
    pthread_mutex_unlock(&comm->mu);
    return start_inline(comm, r, 1, 0, out);
  }
  pthread_mutex_unlock(&comm->mu);
  enqueue(comm, r);
  return T3D_OK;
}

t3d_result_t t3d__submit_prepared(t3d_comm_t *comm, t3d_request_t *tmp, t3d_request_t **out) {
  if (comm->shm != NULL && is_collective(tmp->kind) && tmp->memtype == T3D_MEM_HOST) {
    pthread_mutex_lock(&comm->mu);
    int idle = comm->group_depth == 0 && comm->q_head == NULL && !comm->busy;
    int eligible = idle && t3d__inline_eligible(comm, tmp);
    /* A blocking call runs the whole of a collective too large to start inline here as well. */
    int whole = idle && !eligible && (tmp->flags & T3D_FLAG_BLOCKING) && atomic_load(&comm->fatal) == 0;
    if (eligible || whole) {
      tmp->seq = ++comm->coll_seq;
      comm->busy = 1;
      pthread_mutex_unlock(&comm->mu);
      /* This thread owns the segment's state now: ask for the lines the call will write while it sets up. */
      size_t bytes = tmp->count * t3d_dtype_size(tmp->dtype);
      if (tmp->kind == T3D_OP_ALLREDUCE) t3d__shm_oneshot_warm(comm->shm, bytes);
      if (tmp->kind == T3D_OP_BROADCAST && tmp->root == comm->rank) t3d__shm_bcast_warm(comm->shm, bytes);
      return start_inline(comm, tmp, 0, whole, out);
    }
    pthread_mutex_unlock(&comm->mu);
  }
  t3d_request_t *r = request_keep(tmp);
  if (r == NULL) {
    free(tmp->arrays);
    return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d: out of memory for a request");
  }
  return t3d__submit(comm, r, out);
}

t3d_result_t t3d_group_start(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  comm->group_depth++;
  return T3D_OK;
}

t3d_result_t t3d_group_end(t3d_comm_t *comm, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  if (comm->group_depth == 0) {
    return t3d__set_error(comm, T3D_ERR_INVALID_ARG, "t3d_group_end: no open group on rank %d of group '%s'",
                          comm->rank, comm->name);
  }
  if (--comm->group_depth > 0) {
    if (req != NULL) *req = NULL;
    return T3D_OK;
  }
  t3d_request_t *g = NULL;
  T3D_CHECK(t3d__request_new(comm, T3D_OP_GROUP, NULL, &g));
  /* Host children go to the engine as the group; CUDA ones are issued here as one NCCL group. */
  int n = 0, ncuda = 0;
  for (t3d_request_t *c = comm->group_head; c != NULL; c = c->next_child) {
    n++;
    ncuda += c->memtype == T3D_MEM_CUDA;
  }
  t3d_request_t **cuda = ncuda > 0 ? malloc(sizeof *cuda * (size_t)ncuda) : NULL;
  /* Same-host point-to-point children are posted here, on the caller's thread, before the others are issued. */
  int nshm = 0;
  if (comm->shm_p2p != NULL) {
    for (t3d_request_t *c = comm->group_head; c != NULL; c = c->next_child)
      nshm += c->memtype == T3D_MEM_HOST && !is_collective(c->kind);
  }
  t3d_request_t **shm = nshm > 0 ? malloc(sizeof *shm * (size_t)nshm) : NULL;
  if ((ncuda > 0 && cuda == NULL) || (nshm > 0 && shm == NULL)) {
    free(cuda);
    free(shm);
    t3d__request_release(g);
    t3d__request_release(g);
    return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_group_end: out of memory on rank %d", comm->rank);
  }
  t3d_request_t *c = comm->group_head, *next, **host_tail = &g->children;
  comm->group_head = comm->group_tail = NULL;
  ncuda = 0;
  nshm = 0;
  for (; c != NULL; c = next) {
    next = c->next_child;
    c->next_child = NULL;
    c->parent = g;
    if (c->memtype == T3D_MEM_CUDA) {
      cuda[ncuda++] = c;
    } else if (shm != NULL && !is_collective(c->kind)) {
      shm[nshm++] = c;
    } else {
      *host_tail = c;
      host_tail = &c->next_child;
    }
  }
  /* One extra count held by the engine until every child has been issued, so the group cannot complete early. */
  atomic_init(&g->pending_children, n + 1);
  if (nshm > 0) t3d__shm_p2p_post(comm->shm_p2p, shm, nshm);
  free(shm);
  if (ncuda > 0) t3d__nccl_run(comm, cuda, ncuda, 1);
  free(cuda);
  if (g->children != NULL) {
    enqueue(comm, g);
  } else if (atomic_fetch_sub(&g->pending_children, 1) == 1) {
    /* Nothing for the engine: NCCL has enqueued every operation, so the group is complete now. */
    char *msg = g->errmsg;
    g->errmsg = NULL;
    complete(g, g->first_child_error, msg);
    free(msg);
  }
  if (req != NULL) *req = g;
  else t3d__request_release(g);
  return T3D_OK;
}

/* ---------- point-to-point primitives for algorithms ---------- */

static void poll_p2p(t3d_comm_t *comm);

t3d_result_t t3d__isend(t3d_exec_t *ex, int peer, uint32_t step, const void *buf, size_t bytes, t3d_xfer_t *x) {
  t3d_comm_t *c = ex->comm;
  return c->tp->isend(c->tp_state, peer, t3d__coll_tag(ex->seq, step, ex->rank), buf, bytes, x);
}

t3d_result_t t3d__irecv(t3d_exec_t *ex, int peer, uint32_t step, void *buf, size_t bytes, t3d_xfer_t *x) {
  t3d_comm_t *c = ex->comm;
  x->truncate = 0;
  return c->tp->irecv(c->tp_state, peer, t3d__coll_tag(ex->seq, step, peer), ~0ull, buf, bytes, x);
}

static const char *fail_verb(t3d_result_t res) {
  switch (res) {
    case T3D_ERR_TIMEOUT: return "timed out";
    case T3D_ERR_PEER_LOST: return "lost its connection";
    case T3D_ERR_ABORTED: return "was aborted";
    default: return "failed";
  }
}

t3d_result_t t3d__exec_check(t3d_exec_t *ex, const char *waiting_for) {
  t3d_comm_t *c = ex->comm;
  t3d_result_t res = T3D_OK;
  if (atomic_load(&c->aborted)) res = T3D_ERR_ABORTED;
  else if (t3d__now_ns() > ex->deadline_ns) res = T3D_ERR_TIMEOUT;
  if (res != T3D_OK) {
    snprintf(ex->error, sizeof ex->error,
             "t3d: %s #%llu on group '%s' (rank %d of %d) %s (timeout %lld ms); still waiting for %s", ex->opname,
             (unsigned long long)ex->seq, c->name, ex->rank, ex->size, fail_verb(res), (long long)ex->timeout_ms,
             waiting_for);
  }
  return res;
}

t3d_shm_t *t3d__exec_shm(t3d_exec_t *ex) { return ex->comm->shm; }

t3d_result_t t3d__waitall(t3d_exec_t *ex, t3d_xfer_t *xs, int n) {
  t3d_comm_t *c = ex->comm;
  t3d_result_t res = T3D_OK;
  t3d_backoff_t b = {0};
  for (;;) {
    int pending = 0, lost = -1;
    for (int i = 0; i < n; i++) {
      if (atomic_load_explicit(&xs[i].done, memory_order_acquire)) continue;
      pending++;
      if (c->tp->peer_lost(c->tp_state, xs[i].peer)) lost = xs[i].peer;
    }
    if (pending == 0) break;
    if (atomic_load(&c->aborted)) res = T3D_ERR_ABORTED;
    else if (lost >= 0) res = T3D_ERR_PEER_LOST;
    else if (t3d__now_ns() > ex->deadline_ns) res = T3D_ERR_TIMEOUT;
    if (res != T3D_OK) break;
    int progressed = c->tp->progress(c->tp_state);
    poll_p2p(c);
    if (progressed) t3d__backoff_reset(&b);
    else t3d__backoff_wait(&b);
  }
  if (res != T3D_OK) {
    /* Name the ranks we were still waiting for: that is what a user debugging a hang needs first. */
    char ranks[256] = "";
    size_t len = 0;
    for (int i = 0; i < n; i++) {
      if (atomic_load_explicit(&xs[i].done, memory_order_acquire)) continue;
      int seen = 0;
      for (int j = 0; j < i; j++) seen |= xs[j].peer == xs[i].peer && !atomic_load(&xs[j].done);
      if (!seen && len + 16 < sizeof ranks) {
        len += (size_t)snprintf(ranks + len, sizeof ranks - len, "%s%d", len ? ", " : "", xs[i].peer);
      }
    }
    for (int i = 0; i < n; i++) c->tp->cancel(c->tp_state, &xs[i]);
    snprintf(ex->error, sizeof ex->error,
             "t3d: %s #%llu on group '%s' (rank %d of %d) %s (timeout %lld ms); still waiting for rank(s) %s", ex->opname,
             (unsigned long long)ex->seq, c->name, ex->rank, ex->size, fail_verb(res), (long long)ex->timeout_ms,
             ranks);
  } else {
    for (int i = 0; i < n; i++) {
      if (xs[i].status != T3D_OK) {
        res = xs[i].status;
        /* A dying peer shows up as whatever the transport saw first; say what happened. */
        if (res == T3D_ERR_TRANSPORT && c->tp->peer_lost(c->tp_state, xs[i].peer)) res = T3D_ERR_PEER_LOST;
        snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): transfer with rank %d: %s",
                 ex->opname, (unsigned long long)ex->seq, c->name, ex->rank, ex->size, xs[i].peer,
                 t3d_result_string(res));
        break;
      }
      if (xs[i].is_recv && xs[i].bytes != xs[i].posted) {
        res = T3D_ERR_MISMATCH;
        snprintf(ex->error, sizeof ex->error,
                 "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d sent %zu bytes where %zu were expected "
                 "(ranks disagree on the size of the operation)",
                 ex->opname, (unsigned long long)ex->seq, c->name, ex->rank, ex->size, xs[i].peer, xs[i].bytes,
                 xs[i].posted);
        break;
      }
    }
  }
  for (int i = 0; i < n; i++) c->tp->release(c->tp_state, &xs[i]);
  return res;
}

t3d_result_t t3d__sendrecv(t3d_exec_t *ex, uint32_t step, int dst, const void *sbuf, size_t sbytes, int src,
                           void *rbuf, size_t rbytes) {
  t3d_xfer_t xs[2];
  int n = 0;
  if (src >= 0) T3D_CHECK(t3d__irecv(ex, src, step, rbuf, rbytes, &xs[n++]));
  if (dst >= 0) T3D_CHECK(t3d__isend(ex, dst, step, sbuf, sbytes, &xs[n++]));
  return t3d__waitall(ex, xs, n);
}

/* ---------- the progress thread ---------- */

void t3d__fail_comm(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&comm->fatal, &expected, (int)res)) {
    snprintf(comm->fatal_msg, sizeof comm->fatal_msg, "%s", msg);
  }
  t3d__set_error(comm, res, "%s", msg);
}

static void post_p2p(t3d_comm_t *comm, t3d_request_t *r) {
  size_t bytes = r->count * t3d_dtype_size(r->dtype);
  r->deadline_ns = t3d__now_ns() + (uint64_t)r->timeout_ms * 1000000ull;
  t3d_result_t res;
  if (r->kind == T3D_OP_SEND) {
    res = comm->tp->isend(comm->tp_state, r->root, t3d__p2p_tag(r->tag, comm->rank), r->sendbuf, bytes, &r->xfer);
  } else {
    uint64_t mask = r->root == T3D_ANY_SOURCE ? ~T3D_TAG_SRC_MASK : ~0ull;
    int src = r->root == T3D_ANY_SOURCE ? 0 : r->root;
    r->xfer.truncate = (r->flags & T3D_FLAG_RECV_TRUNCATE) != 0;
    res = comm->tp->irecv(comm->tp_state, r->root, t3d__p2p_tag(r->tag, src), mask, r->recvbuf, bytes, &r->xfer);
  }
  if (res != T3D_OK) {
    char msg[256];
    snprintf(msg, sizeof msg, "t3d: %s on group '%s' (rank %d) could not be posted: %s",
             r->kind == T3D_OP_SEND ? "send" : "recv", comm->name, comm->rank, t3d_result_string(res));
    complete(r, res, msg);
    return;
  }
  r->next = comm->active_p2p;
  comm->active_p2p = r;
}

/* Completes the point-to-point requests whose transfers finished, failed, timed out or were aborted. */
static void poll_p2p(t3d_comm_t *comm) {
  t3d_request_t **link = &comm->active_p2p;
  uint64_t now = 0;
  while (*link != NULL) {
    t3d_request_t *r = *link;
    t3d_xfer_t *x = &r->xfer;
    const char *what = r->kind == T3D_OP_SEND ? "send to" : "recv from";
    char msg[512];
    t3d_result_t res = T3D_IN_PROGRESS;
    msg[0] = '\0';
    if (atomic_load_explicit(&x->done, memory_order_acquire)) {
      res = x->status;
      if (res == T3D_OK && r->kind == T3D_OP_RECV) {
        r->source = x->source;
        r->recv_count = x->bytes / t3d_dtype_size(r->dtype);
      } else if (res == T3D_ERR_MISMATCH) {
        snprintf(msg, sizeof msg, "t3d: recv on group '%s' (rank %d, tag %lld): the message is larger than the "
                 "%zu-element receive buffer", comm->name, comm->rank, (long long)r->tag, r->count);
      } else if (res < 0) {
        snprintf(msg, sizeof msg, "t3d: %s rank %d on group '%s' (rank %d, tag %lld) failed: %s", what, r->root,
                 comm->name, comm->rank, (long long)r->tag, t3d_result_string(res));
      }
    } else {
      if (now == 0) now = t3d__now_ns();
      if (atomic_load(&comm->aborted)) res = T3D_ERR_ABORTED;
      else if (comm->tp->peer_lost(comm->tp_state, r->root)) res = T3D_ERR_PEER_LOST;
      else if (now > r->deadline_ns) res = T3D_ERR_TIMEOUT;
      if (res != T3D_IN_PROGRESS) {
        comm->tp->cancel(comm->tp_state, x);
        snprintf(msg, sizeof msg, "t3d: %s rank %d on group '%s' (rank %d, tag %lld) %s (timeout %lld ms)", what,
                 r->root, comm->name, comm->rank, (long long)r->tag, fail_verb(res), (long long)r->timeout_ms);
      }
    }
    if (res == T3D_IN_PROGRESS) {
      link = &r->next;
      continue;
    }
    *link = r->next;
    comm->tp->release(comm->tp_state, x);
    complete(r, res, msg);
  }
}

const char *t3d__op_name(t3d_op_kind_t k) {
  static const char *names[] = {"allreduce", "broadcast",     "reduce",   "allgather", "gather", "scatter",
                                "reduce_scatter", "alltoall", "barrier", "send",      "recv",   "group"};
  return names[k];
}

static void init_exec(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex) {
  ex->error[0] = '\0'; /* not the whole 512 bytes: this runs for every collective */
  ex->comm = comm;
  ex->rank = comm->rank;
  ex->size = comm->size;
  ex->opname = t3d__op_name(r->kind);
  ex->seq = r->seq;
  ex->timeout_ms = r->timeout_ms;
  ex->start_ns = t3d__now_ns();
  ex->deadline_ns = r->resume ? r->deadline_ns : ex->start_ns + (uint64_t)r->timeout_ms * 1000000ull;
}

/* Records the outcome of a collective and completes it. release: end the engine's busy state first, so that whoever
 * sees r done finds the engine idle. */
/* Writes a failed collective's error (ex->error, filled in if empty) to the communicator; errors that leave peers
 * out of step break it. */
static void record_failure(t3d_comm_t *comm, t3d_exec_t *ex, t3d_result_t res) {
  if (ex->error[0] == '\0') {
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) failed: %s", ex->opname,
             (unsigned long long)ex->seq, comm->name, comm->rank, comm->size, t3d_result_string(res));
  }
  /* A collective that failed half-way leaves peers out of step: nothing later on this communicator can be
   * trusted, so it fails fast (as NCCL does) instead of mismatching messages. */
  if (res == T3D_ERR_TIMEOUT || res == T3D_ERR_PEER_LOST || res == T3D_ERR_ABORTED || res == T3D_ERR_MISMATCH ||
      res == T3D_ERR_TRANSPORT) {
    t3d__fail_comm(comm, res, ex->error);
  } else {
    t3d__set_error(comm, res, "%s", ex->error);
  }
}

/* Records the outcome of a collective and completes it. release: end the engine's busy state first, so that whoever
 * sees r done finds the engine idle. fresh: r finished on the caller's thread and was not handed out yet. */
static void end_collective(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex, t3d_result_t res, int release,
                           int fresh) {
  if (res < 0) record_failure(comm, ex, res);
  if (release) release_engine(comm);
  if (fresh) complete_fresh(r, res, ex->error);
  else complete(r, res, ex->error);
}

static void run_collective(t3d_comm_t *comm, t3d_request_t *r, int release) {
  int fatal = atomic_load(&comm->fatal);
  if (fatal != 0) {
    char msg[700];
    snprintf(msg, sizeof msg, "t3d: %s #%llu on group '%s' (rank %d) not run: the communicator is broken by an "
             "earlier error: %s", t3d__op_name(r->kind), (unsigned long long)r->seq, comm->name, comm->rank,
             comm->fatal_msg);
    if (release) release_engine(comm);
    complete(r, (t3d_result_t)fatal, msg);
    return;
  }
  t3d_exec_t ex;
  init_exec(comm, r, &ex);
  end_collective(comm, r, &ex, t3d__execute(&ex, r), release, 0);
}

/* A prepared request that start_inline could not keep (no memory): the call finishes here, waiting for late peers,
 * and reports through its return value. */
static t3d_result_t finish_unkept(t3d_comm_t *comm, t3d_exec_t *ex, t3d_request_t *r, t3d_result_t res,
                                  t3d_request_t **out) {
  if (res == T3D_IN_PROGRESS) res = t3d__execute(ex, r); /* r->resume is set: finishes the started operation */
  if (res < 0) record_failure(comm, ex, res);
  release_engine(comm);
  free(r->arrays);
  if (res < 0) return res;
  *out = &done_ok;
  return T3D_OK;
}

/* On the caller's thread, with the engine marked busy. r is on the heap (kept) or prepared on the caller's stack;
 * the latter, finished without error, hands out done_ok, and is kept only when it failed or goes on. When peers are
 * late the request goes to the head of the queue (ahead of anything other threads queued meanwhile: it was issued
 * first) and the progress thread finishes it, so the call never waits for long; unless the call is blocking
 * (T3D_FLAG_BLOCKING): then this thread finishes it. whole: a blocking call's collective that has no inline start,
 * run from the beginning. */
static t3d_result_t start_inline(t3d_comm_t *comm, t3d_request_t *r, int kept, int whole, t3d_request_t **out) {
  t3d_exec_t ex;
  init_exec(comm, r, &ex);
  r->deadline_ns = ex.deadline_ns;
  t3d_result_t res = whole ? t3d__execute(&ex, r) : t3d__execute_start(&ex, r);
  if (res == T3D_IN_PROGRESS && (r->flags & T3D_FLAG_BLOCKING)) res = t3d__execute(&ex, r); /* r->resume is set */
  if (!kept) {
    if (res == T3D_OK) {
      release_engine(comm);
      free(r->arrays);
      *out = &done_ok;
      return T3D_OK;
    }
    t3d_request_t *k = request_keep(r);
    if (k == NULL) return finish_unkept(comm, &ex, r, res, out);
    r = k;
  }
  *out = r;
  if (res != T3D_IN_PROGRESS) {
    end_collective(comm, r, &ex, res, 1, 1);
    return T3D_OK;
  }
  pthread_mutex_lock(&comm->mu);
  r->next = comm->q_head;
  comm->q_head = r;
  if (comm->q_tail == NULL) comm->q_tail = r;
  comm->busy = 0;
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
  return T3D_OK;
}

static void run_request(t3d_comm_t *comm, t3d_request_t *r) {
  if (r->kind == T3D_OP_SEND || r->kind == T3D_OP_RECV) {
    if (atomic_load(&comm->aborted)) {
      complete(r, T3D_ERR_ABORTED, "t3d: point-to-point operation aborted");
      return;
    }
    post_p2p(comm, r); /* UCX: same-host point-to-point never reaches the queue */
  } else if (r->kind == T3D_OP_GROUP) {
    /* Point-to-point first: any pairing of sends and receives inside the group then matches without deadlock. */
    t3d_request_t *c, *next;
    for (c = r->children; c != NULL; c = next) {
      next = c->next_child;
      if (c->kind == T3D_OP_SEND || c->kind == T3D_OP_RECV) run_request(comm, c);
    }
    for (c = r->children; c != NULL; c = next) {
      next = c->next_child;
      if (c->kind != T3D_OP_SEND && c->kind != T3D_OP_RECV) run_request(comm, c);
    }
    if (atomic_fetch_sub(&r->pending_children, 1) == 1) {
      char *msg = r->errmsg;
      r->errmsg = NULL;
      complete(r, r->first_child_error, msg);
      free(msg);
    }
  } else {
    run_collective(comm, r, 0);
  }
}

static void *progress_main(void *arg) {
  t3d_comm_t *comm = arg;
  t3d_backoff_t b = {0};
  unsigned idle_ms = 1;
  for (;;) {
    /* Going idle: watch the queue for ~200 us first (yielding); a condition-variable wake-up costs tens of
     * microseconds, more than a small collective. Not when ranks outnumber cores: the watcher would take turns
     * from the ranks that have work. */
    if (comm->active_p2p == NULL && !t3d__oversubscribed()) {
      uint64_t until = t3d__now_ns() + 200000;
      int spins = 0;
      while (__atomic_load_n(&comm->q_head, __ATOMIC_ACQUIRE) == NULL && !__atomic_load_n(&comm->stop, __ATOMIC_ACQUIRE) &&
             t3d__now_ns() < until) {
        if (++spins < 64) __builtin_ia32_pause();
        else sched_yield();
      }
    }
    pthread_mutex_lock(&comm->mu);
    /* Fully idle (or a caller runs a collective inline): block, but wake now and then to let the transport push
     * out buffered bytes. */
    while ((comm->q_head == NULL || comm->busy) && comm->active_p2p == NULL && !comm->stop) {
      struct timespec dl;
      clock_gettime(CLOCK_REALTIME, &dl);
      dl.tv_nsec += (long)idle_ms * 1000000L;
      if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
      }
      int rc = pthread_cond_timedwait(&comm->cv, &comm->mu, &dl);
      /* Also on an abort's signal: pending shared-memory point-to-point then fails at once. */
      if (rc == ETIMEDOUT || atomic_load(&comm->aborted)) {
        pthread_mutex_unlock(&comm->mu);
        comm->tp->progress(comm->tp_state);
        /* Same-host point-to-point is driven by its waiters; this catches deadlines, aborts and sends queued behind
         * a full ring when nobody waits. */
        int active = t3d__shm_p2p_active(comm->shm_p2p);
        if (active) t3d__shm_p2p_progress(comm->shm_p2p);
        pthread_mutex_lock(&comm->mu);
        unsigned cap = active ? 4 : 64;
        idle_ms = idle_ms < cap ? idle_ms * 2 : cap;
      }
    }
    t3d_request_t *r = comm->busy ? NULL : comm->q_head;
    if (r != NULL) {
      comm->q_head = r->next;
      if (comm->q_head == NULL) comm->q_tail = NULL;
      comm->busy = 1;
    }
    int stop = comm->stop && comm->q_head == NULL && !comm->busy && comm->active_p2p == NULL &&
               !t3d__shm_p2p_active(comm->shm_p2p);
    pthread_mutex_unlock(&comm->mu);
    if (stop) break;
    idle_ms = 1;
    if (r != NULL) {
      if (is_collective(r->kind)) {
        run_collective(comm, r, 1);
      } else {
        run_request(comm, r);
        release_engine(comm);
      }
      t3d__backoff_reset(&b);
    }
    if (comm->active_p2p != NULL) {
      int progressed = comm->tp->progress(comm->tp_state);
      t3d_request_t *before = comm->active_p2p;
      poll_p2p(comm);
      if (progressed || before != comm->active_p2p) t3d__backoff_reset(&b);
      else if (comm->q_head == NULL) t3d__backoff_wait(&b);
    }
    /* Stopping with same-host point-to-point still pending: it completes, or fails at its deadline. */
    if (comm->stop && t3d__shm_p2p_active(comm->shm_p2p)) {
      if (t3d__shm_p2p_progress(comm->shm_p2p) > 0) t3d__backoff_reset(&b);
      else t3d__backoff_wait(&b);
    }
  }
  return NULL;
}

/* ---------- communicator lifetime ---------- */

void t3d_config_init(t3d_config_t *cfg) {
  if (cfg == NULL) return;
  cfg->timeout_ms = 0;
  cfg->name = NULL;
  cfg->key_prefix = NULL;
  cfg->transport = NULL;
  cfg->inline_bytes = T3D_INLINE_DEFAULT;
}

/* A build without UCX (T3D_HAVE_UCX 0: transport/ucx_none.c) serves a communicator only when the shared-memory
 * segment carries all of it; anything else fails init on every rank with this error. */
static t3d_result_t no_ucx(t3d_comm_t *comm, t3d_result_t res, const char *why) {
  return t3d__set_error(comm, res,
                        "t3d_comm_init: this build of t3d has no UCX (built with T3D_WITH_UCX=OFF or without UCX "
                        "found), which rank %d of group '%s' needs: %s", comm->rank, comm->name, why);
}

/* T3D_TRANSPORT: "auto" (shared memory for collectives when every rank is on this host, UCX for the rest), "ucx"
 * (UCX only), "shm" (like auto, but an error when some rank is on another host). */
static t3d_result_t pick_transport(t3d_comm_t *comm, const char *want) {
  if (strcmp(want, "ucx") == 0 && !T3D_HAVE_UCX)
    return no_ucx(comm, T3D_ERR_UNSUPPORTED, "its transport is 'ucx' (T3D_TRANSPORT or config)");
  if (strcmp(want, "auto") == 0 || strcmp(want, "ucx") == 0 || strcmp(want, "shm") == 0) {
    comm->tp = &t3d__transport_ucx;
    return T3D_OK;
  }
  return t3d__set_error(comm, T3D_ERR_UNSUPPORTED,
                        "t3d_comm_init: transport '%s' (T3D_TRANSPORT or config) is not available on rank %d; this "
                        "build has: %s", want, comm->rank, T3D_HAVE_UCX ? "auto, ucx, shm" : "auto, shm");
}

/* Same host = same host name and same boot: containers that share a name but not memory differ in boot id only
 * rarely, and a wrong guess fails at segment open with a clear error rather than silently. */
static void host_identity(char *buf, size_t len) {
  char host[256] = "?", boot[64] = "";
  gethostname(host, sizeof host - 1);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f != NULL) {
    if (fgets(boot, sizeof boot, f) == NULL) boot[0] = '\0';
    fclose(f);
  }
  boot[strcspn(boot, "\n")] = '\0';
  snprintf(buf, len, "%s/%s", host, boot);
}

/* Without UCX even a group of one takes the segment: its sends to itself need the segment's point-to-point. */
static t3d_result_t setup_shm(t3d_comm_t *comm, const char *want) {
  if (strcmp(want, "ucx") == 0 || (comm->size == 1 && T3D_HAVE_UCX)) return T3D_OK;
  char mine[400], key[32];
  host_identity(mine, sizeof mine);
  snprintf(key, sizeof key, "host/%d", comm->rank);
  T3D_CHECK(t3d__store_set(comm, key, mine, strlen(mine) + 1));
  int same = 1, other = -1;
  for (int p = 0; p < comm->size && same; p++) {
    if (p == comm->rank) continue;
    void *v = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "host/%d", p);
    T3D_CHECK(t3d__store_get(comm, key, &v, &len));
    if (len != strlen(mine) + 1 || memcmp(v, mine, len) != 0) {
      same = 0;
      other = p;
    }
    free(v);
  }
  if (same) {
    t3d__backoff_note_ranks(comm->size); /* first: the segment's waiters follow it */
    t3d_result_t res = t3d__shm_init(comm, &comm->shm);
    if (res == T3D_OK) res = t3d__shm_p2p_attach(comm, comm->shm, &comm->shm_p2p);
    if (!T3D_HAVE_UCX && res == T3D_OK && comm->shm_p2p == NULL) {
      res = no_ucx(comm, T3D_ERR_UNSUPPORTED,
                   t3d__env_int("T3D_SHM_P2P", 1) == 0
                       ? "point-to-point off the shared-memory segment (T3D_SHM_P2P=0)"
                       : "point-to-point off the shared-memory segment (T3D_SHM_P2P=0 on some rank, or a rank may "
                         "not read another's memory with process_vm_readv: seccomp, Yama ptrace_scope or users)");
    } else if (!T3D_HAVE_UCX && res != T3D_OK && res != T3D_ERR_TIMEOUT) { /* a timeout: a peer did not come */
      char why[sizeof comm->last_error];
      snprintf(why, sizeof why, "the shared-memory segment cannot be used: %.960s", thread_last_error);
      res = no_ucx(comm, res, why);
    }
    if (res != T3D_OK) {
      t3d__shm_fini(comm->shm);
      comm->shm = NULL;
    }
    return res;
  }
  if (!T3D_HAVE_UCX) {
    char why[96];
    snprintf(why, sizeof why, "rank %d is on another host than rank %d", other, comm->rank);
    return no_ucx(comm, T3D_ERR_UNSUPPORTED, why);
  }
  if (strcmp(want, "shm") == 0) {
    return t3d__set_error(comm, T3D_ERR_UNSUPPORTED,
                          "t3d_comm_init: T3D_TRANSPORT=shm but rank %d of group '%s' is on another host than rank %d",
                          other, comm->name, comm->rank);
  }
  return T3D_OK;
}

static void comm_free(t3d_comm_t *comm) {
  pthread_mutex_destroy(&comm->mu);
  pthread_cond_destroy(&comm->cv);
  pthread_mutex_destroy(&comm->err_mu);
  free(comm);
}

t3d_result_t t3d_comm_init(t3d_comm_t **out, int rank, int size, const t3d_store_t *store, const t3d_config_t *cfg) {
  if (out == NULL) return T3D_ERR_INVALID_ARG;
  *out = NULL;
  if (size < 1 || size > 65535 || rank < 0 || rank >= size || store == NULL || store->set == NULL ||
      store->get == NULL) {
    T3D_WARN("t3d_comm_init: invalid argument: rank %d, size %d, store %p", rank, size, (const void *)store);
    return T3D_ERR_INVALID_ARG;
  }
  t3d_comm_t *comm = calloc(1, sizeof *comm);
  if (comm == NULL) return T3D_ERR_NO_MEMORY;
  pthread_mutex_init(&comm->mu, NULL);
  pthread_cond_init(&comm->cv, NULL);
  pthread_mutex_init(&comm->err_mu, NULL);
  comm->rank = rank;
  comm->size = size;
  comm->store = *store;
  t3d_config_t dflt;
  t3d_config_init(&dflt);
  if (cfg == NULL) cfg = &dflt;
  comm->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : t3d__env_int("T3D_TIMEOUT_MS", 600000);
  snprintf(comm->name, sizeof comm->name, "%s", cfg->name ? cfg->name : "comm");
  snprintf(comm->prefix, sizeof comm->prefix, "%s", cfg->key_prefix ? cfg->key_prefix : "t3d");
  comm->inline_max = cfg->inline_bytes >= -1 ? cfg->inline_bytes : t3d__env_int("T3D_INLINE_BYTES", 64 * 1024);
  if (comm->inline_max < -1) comm->inline_max = -1;
  int64_t wait_ns = t3d__env_int("T3D_INLINE_WAIT_NS", 20000);
  comm->inline_wait_ns = wait_ns > 0 ? (uint64_t)wait_ns : 0;

  const char *want = cfg->transport ? cfg->transport : t3d__env_str("T3D_TRANSPORT", "auto");
  snprintf(comm->transport, sizeof comm->transport, "%s", want);
  t3d_result_t res = pick_transport(comm, want);
  if (res == T3D_OK) res = comm->tp->init(comm, &comm->tp_state);
  if (res == T3D_OK) {
    res = setup_shm(comm, want);
    if (res != T3D_OK) comm->tp->fini(comm->tp_state);
  }
  if (res == T3D_OK) {
    res = t3d__nccl_new(&comm->nccl);
    if (res != T3D_OK) {
      t3d__shm_p2p_free(comm->shm_p2p);
      t3d__shm_fini(comm->shm);
      comm->tp->fini(comm->tp_state);
    }
  }
  if (res == T3D_OK && pthread_create(&comm->thread, NULL, progress_main, comm) != 0) {
    res = t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: cannot start the progress thread on rank %d", rank);
    t3d__nccl_free(comm->nccl, 0);
    t3d__shm_p2p_free(comm->shm_p2p);
    t3d__shm_fini(comm->shm);
    comm->tp->fini(comm->tp_state);
  }
  if (res != T3D_OK) {
    /* The caller has no communicator to ask, so the reason goes to the log as well. */
    T3D_WARN("%s", comm->last_error);
    comm_free(comm);
    return res;
  }
  comm->thread_started = 1;
  T3D_INFO("comm '%s' rank %d/%d up over %s%s", comm->name, rank, size, comm->tp->name,
           comm->shm ? " + shared memory" : "");
  *out = comm;
  return T3D_OK;
}

t3d_result_t t3d_comm_destroy(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  if (comm->thread_started) {
    pthread_mutex_lock(&comm->mu);
    comm->stop = 1;
    pthread_cond_signal(&comm->cv);
    pthread_mutex_unlock(&comm->mu);
    pthread_join(comm->thread, NULL);
  }
  t3d__nccl_free(comm->nccl, comm->timeout_ms);
  t3d__shm_p2p_free(comm->shm_p2p);
  t3d__shm_fini(comm->shm);
  comm->tp->fini(comm->tp_state);
  comm_free(comm);
  return T3D_OK;
}

t3d_result_t t3d_comm_abort(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  int expected = 0;
  if (atomic_compare_exchange_strong(&comm->fatal, &expected, (int)T3D_ERR_ABORTED)) {
    snprintf(comm->fatal_msg, sizeof comm->fatal_msg, "t3d: group '%s' was aborted on rank %d", comm->name,
             comm->rank);
  }
  atomic_store(&comm->aborted, 1);
  t3d__nccl_abort(comm->nccl);
  pthread_mutex_lock(&comm->mu);
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
  return T3D_OK;
}

int t3d_comm_rank(const t3d_comm_t *comm) { return comm ? comm->rank : -1; }
int t3d_comm_size(const t3d_comm_t *comm) { return comm ? comm->size : -1; }
t3d_result_t t3d_comm_status(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  t3d__nccl_poll_errors(comm);
  return (t3d_result_t)atomic_load(&comm->fatal);
}
const char *t3d_comm_transport(const t3d_comm_t *comm) {
  if (comm == NULL || comm->tp == NULL) return "";
  return comm->shm != NULL ? (T3D_HAVE_UCX ? "shm+ucx" : "shm") : comm->tp->name;
}

typedef struct {
  int key, rank;
} split_member_t;

static int member_cmp(const void *a, const void *b) {
  const split_member_t *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->rank < y->rank ? -1 : (x->rank > y->rank);
}

t3d_result_t t3d_comm_split(t3d_comm_t *parent, int color, int key, const t3d_config_t *cfg, t3d_comm_t **newcomm) {
  if (parent == NULL || newcomm == NULL) return T3D_ERR_INVALID_ARG;
  *newcomm = NULL;
  if (color < 0 && color != T3D_SPLIT_NOCOLOR) {
    return t3d__set_error(parent, T3D_ERR_INVALID_ARG,
                          "t3d_comm_split: invalid argument 'color' (%d) on rank %d of group '%s': must be >= 0 or "
                          "T3D_SPLIT_NOCOLOR", color, parent->rank, parent->name);
  }
  int n = parent->size;
  int mine[2] = {color, key};
  int *all = malloc(sizeof(int) * 2 * (size_t)n);
  split_member_t *members = malloc(sizeof *members * (size_t)n);
  if (all == NULL || members == NULL) {
    free(all);
    free(members);
    return T3D_ERR_NO_MEMORY;
  }
  t3d_request_t *r = NULL;
  t3d_result_t res = t3d_allgather(parent, mine, all, 2, T3D_INT32, NULL, &r);
  if (res == T3D_OK) {
    res = t3d_wait(r, -1);
    t3d_request_free(r);
  }
  pthread_mutex_lock(&parent->mu);
  int split_id = parent->split_count++;
  pthread_mutex_unlock(&parent->mu);
  int count = 0, newrank = -1;
  if (res == T3D_OK && color != T3D_SPLIT_NOCOLOR) {
    for (int p = 0; p < n; p++) {
      if (all[2 * p] == color) members[count++] = (split_member_t){all[2 * p + 1], p};
    }
    qsort(members, (size_t)count, sizeof *members, member_cmp);
    for (int i = 0; i < count; i++) {
      if (members[i].rank == parent->rank) newrank = i;
    }
    t3d_config_t c;
    t3d_config_init(&c);
    if (cfg != NULL) c = *cfg;
    if (c.timeout_ms <= 0) c.timeout_ms = parent->timeout_ms;
    if (c.name == NULL) c.name = "split";
    char prefix[300];
    snprintf(prefix, sizeof prefix, "%s/split%d/color%d", parent->prefix, split_id, color);
    c.key_prefix = prefix;
    if (c.transport == NULL) c.transport = parent->transport;
    if (c.inline_bytes < -1) c.inline_bytes = parent->inline_max;
    res = t3d_comm_init(newcomm, newrank, count, &parent->store, &c);
    if (res != T3D_OK) {
      t3d__set_error(parent, res, "t3d_comm_split: rank %d of group '%s' could not create its part (color %d): %s",
                     parent->rank, parent->name, color, t3d_thread_last_error());
    }
  } else if (res != T3D_OK) {
    t3d__set_error(parent, res, "t3d_comm_split: exchanging colors on group '%s' failed: %s", parent->name,
                   t3d_thread_last_error());
  }
  free(all);
  free(members);
  return res;
}
