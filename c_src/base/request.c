/* request.c: requests: their set-up, completion (callbacks, groups), reference counts, and what a user does with
 * one (test, wait, poll, read its result). */
#include "comm.h"
#include "provider.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Everything but the mutex and the condition variable, which come last. */
#define REQUEST_FIELDS offsetof(t3d_request_t, mu)

void t3d__request_prepare(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t *r) {
  t3d__zero(r, REQUEST_FIELDS);
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

/* Each thread keeps up to CACHE_MAX of the requests it frees for the next ones it makes, their mutex and condition
 * variable still set up: a small ring shift makes three requests and frees them, and their malloc, free, set-up and
 * tear-down had been a fifth of its profile. A thread's cache is freed when it exits. */
enum { CACHE_MAX = 8 };
typedef struct {
  t3d_request_t *r[CACHE_MAX];
  int n, registered;
} request_cache_t;
/* Not initial-exec TLS, though that would save a __tls_get_addr call per use (a few percent of a small ring shift's
 * profile): loaded by Python after torch, libt3d then finds glibc's static TLS reserve used up and fails to load. */
static _Thread_local request_cache_t cache;
static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static int cache_ok; /* the key exists */

static void destroy_memory(t3d_request_t *r) {
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r);
}

static void cache_drop(void *arg) {
  request_cache_t *c = arg;
  while (c->n > 0) destroy_memory(c->r[--c->n]);
  c->registered = -1; /* a request this exiting thread frees later (another destructor) is freed at once */
}

static void cache_key_init(void) { cache_ok = pthread_key_create(&cache_key, cache_drop) == 0; }

/* A request's memory, mutex and condition variable set up; the fields are the caller's to fill. */
static t3d_request_t *request_memory(void) {
  if (cache.n > 0) return cache.r[--cache.n];
  t3d_request_t *r = malloc(sizeof *r);
  if (r == NULL) return NULL;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  return r;
}

static void request_destroy(t3d_request_t *r) {
  free(r->errmsg);
  free(r->arrays);
  if (!cache.registered) {
    /* The thread's first: its cache must be freed when it exits. */
    pthread_once(&cache_once, cache_key_init);
    cache.registered = cache_ok && pthread_setspecific(cache_key, &cache) == 0 ? 1 : -1;
  }
  if (cache.registered == 1 && cache.n < CACHE_MAX) cache.r[cache.n++] = r;
  else destroy_memory(r);
}

t3d_request_t *t3d__request_keep(const t3d_request_t *prepared) {
  t3d_request_t *r = request_memory();
  if (r == NULL) return NULL;
  memcpy(r, prepared, REQUEST_FIELDS);
  if (prepared->arrays_borrowed) {
    size_t n = 4 * (size_t)prepared->comm->size;
    r->arrays = malloc(n * sizeof(size_t));
    if (r->arrays == NULL) {
      destroy_memory(r);
      return NULL;
    }
    memcpy(r->arrays, prepared->arrays, n * sizeof(size_t));
    r->arrays_borrowed = 0;
    /* The four arrays keep their places relative to the block. */
    size_t **views[4] = {&r->scounts, &r->sdispls, &r->rcounts, &r->rdispls};
    for (int i = 0; i < 4; i++) *views[i] = r->arrays + (*views[i] - prepared->arrays);
  }
  return r;
}

void t3d__request_drop_arrays(t3d_request_t *r) {
  if (!r->arrays_borrowed) free(r->arrays);
  r->arrays = NULL;
}

t3d_result_t t3d__request_new(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t **out) {
  /* Prepared where it lives (not on the stack, then copied: point-to-point makes one per call). */
  t3d_request_t *r = request_memory();
  *out = r;
  if (r == NULL) return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d: out of memory for a request");
  t3d__request_prepare(comm, kind, opts, r);
  return T3D_OK;
}

void t3d__request_release(t3d_request_t *r) {
  /* The last reference (the other's release, seen through acquire, came before): nobody can take another, so no
   * locked instruction, which would also wait for this core's recent stores to leave it. */
  if (atomic_load_explicit(&r->refs, memory_order_acquire) == 1 || atomic_fetch_sub(&r->refs, 1) == 1) {
    request_destroy(r);
  }
}

void t3d_request_free(t3d_request_t *req) {
  if (req != NULL && !req->shared) t3d__request_release(req);
}

/* done, then hooks; a sleeper or a callback's setter raises hooks, then reads done (both sequentially consistent):
 * one of the two sides sees the other. Nobody sleeping and no callback (the common case: waiters poll first) costs
 * no mutex and no broadcast. */
void t3d__request_complete(t3d_request_t *r, t3d_result_t res, const char *msg) {
  r->result = res;
  if (res < 0 && msg != NULL && msg[0] != '\0') r->errmsg = strdup(msg);
  atomic_store(&r->done, 1);
  if (atomic_load(&r->hooks) != 0) {
    pthread_mutex_lock(&r->mu);
    t3d_callback_t cb = r->cb;
    void *arg = r->cb_arg;
    r->cb = NULL;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (cb != NULL) cb(arg, res);
  }
  t3d_request_t *parent = r->parent;
  if (parent != NULL) {
    if (res < 0 && parent->first_child_error == T3D_OK) {
      parent->first_child_error = res;
      if (r->errmsg != NULL) parent->errmsg = strdup(r->errmsg);
    }
    if (atomic_fetch_sub(&parent->pending_children, 1) == 1) {
      char *pmsg = parent->errmsg;
      parent->errmsg = NULL;
      t3d__request_complete(parent, parent->first_child_error, pmsg);
      free(pmsg);
    }
  }
  t3d__request_release(r); /* the engine's reference */
}

/* Without the mutex, the broadcast and the atomic read-modify-writes: each locked instruction would also wait for
 * the stores just made to leave this core. */
void t3d__request_complete_fresh(t3d_request_t *r, t3d_result_t res, const char *msg) {
  r->result = res;
  if (res < 0 && msg != NULL && msg[0] != '\0') r->errmsg = strdup(msg);
  atomic_store_explicit(&r->done, 1, memory_order_relaxed);
  atomic_store_explicit(&r->refs, 1, memory_order_relaxed); /* the engine's reference, dropped */
}

/* Point-to-point over shared memory progresses only when someone runs a pass: a waiter does. */
static int drive(t3d_request_t *req) {
  if (!req->on_shm || atomic_load_explicit(&req->done, memory_order_acquire)) return 0;
  return req->comm->p2p_driver->progress(req->comm);
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
   * which peers ring when they publish something for it. A peer that runs on another CPU answers within the spin
   * phase, which a yield would outlast (even where the cores are full and waits skip it). */
  const t3d_provider_t *d = req->comm->p2p_driver;
  int running = d->peer_running != NULL && d->peer_running(req->comm);
  if (t3d__backoff_poll_p2p(since, running)) d->sleep(req->comm, req, 1000000);
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
    if (t3d_request_poll(req, &since) || (timeout_ms >= 0 && t3d__now_ns() > until)) break;
  }
  /* Done while polling (the common case): the sleep's set-up below would only delay the caller. */
  if (atomic_load_explicit(&req->done, memory_order_acquire)) return req->result;
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
  atomic_fetch_add(&req->hooks, 1);
  int rc = 0;
  while (!atomic_load(&req->done) && rc != ETIMEDOUT) {
    rc = timeout_ms >= 0 ? pthread_cond_timedwait(&req->cv, &req->mu, &dl) : pthread_cond_wait(&req->cv, &req->mu);
  }
  atomic_fetch_sub(&req->hooks, 1);
  pthread_mutex_unlock(&req->mu);
  if (!atomic_load_explicit(&req->done, memory_order_acquire)) return T3D_ERR_TIMEOUT;
  return req->result;
}

const char *t3d_request_error(t3d_request_t *req) {
  if (req == NULL || !atomic_load_explicit(&req->done, memory_order_acquire) || req->errmsg == NULL) return "";
  return req->errmsg;
}

const char *t3d_request_provider(const t3d_request_t *req) {
  return req != NULL && req->prov != NULL ? req->prov->name : "";
}

int t3d_request_source(t3d_request_t *req) { return req != NULL ? req->source : -1; }
size_t t3d_request_count(t3d_request_t *req) { return req != NULL ? req->recv_count : 0; }

t3d_result_t t3d_request_set_callback(t3d_request_t *req, t3d_callback_t fn, void *arg) {
  if (req == NULL || fn == NULL) return T3D_ERR_INVALID_ARG;
  pthread_mutex_lock(&req->mu);
  atomic_fetch_add(&req->hooks, 1); /* stays raised: completion must look for the callback */
  int done = atomic_load(&req->done);
  if (!done) {
    req->cb = fn;
    req->cb_arg = arg;
  }
  pthread_mutex_unlock(&req->mu);
  if (done) fn(arg, req->result);
  return T3D_OK;
}

const char *t3d__op_name(t3d_op_kind_t k) {
  static const char *names[] = {"allreduce", "broadcast",     "reduce",   "allgather", "gather", "scatter",
                                "reduce_scatter", "alltoall", "barrier", "send",      "recv",   "group"};
  return names[k];
}
