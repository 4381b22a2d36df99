/* progress.c: the progress thread of a communicator: it takes requests from the queue in issue order and runs them
 * (collectives through their provider, point-to-point posted through its provider), keeps the point-to-point it
 * posted moving, and, while idle, wakes now and then so that deadlines, aborts and buffered bytes are handled when
 * nobody waits. */
#include "engine.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

/* Point-to-point comes in two kinds. What the progress thread posts itself (UCX: only this thread drives its worker)
 * it polls without pause while any is in flight. What callers posted on their own threads (same-host) their
 * waiters drive; the progress thread only runs a pass on its periodic wake-ups, so that deadlines and aborts fire
 * when nobody waits. */
/* Whether some provider of that kind (callers: it posts on the callers' threads) has point-to-point pending. */
static int posted_active(t3d_comm_t *comm, int callers) {
  for (const t3d_provider_t *const *p = t3d__providers(); *p != NULL; p++) {
    if ((*p)->active != NULL && (*p)->post_on_caller == callers && (*p)->active(comm)) return 1;
  }
  return 0;
}

/* Drives the pending point-to-point of the providers of that kind; returns how much moved. */
static int posted_progress(t3d_comm_t *comm, int callers) {
  int moved = 0;
  for (const t3d_provider_t *const *p = t3d__providers(); *p != NULL; p++) {
    if ((*p)->progress != NULL && (*p)->post_on_caller == callers && (callers == 0 || (*p)->active(comm)))
      moved += (*p)->progress(comm);
  }
  return moved;
}

static void run_request(t3d_comm_t *comm, t3d_request_t *r) {
  if (r->kind == T3D_OP_SEND || r->kind == T3D_OP_RECV) {
    if (atomic_load(&comm->aborted)) {
      t3d__request_complete(r, T3D_ERR_ABORTED, "t3d: point-to-point operation aborted");
      return;
    }
    r->prov->post(comm, &r, 1, 0); /* UCX: what callers post themselves never reaches the queue */
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
      t3d__request_complete(r, r->first_child_error, msg);
      free(msg);
    }
  } else {
    t3d__run_collective(comm, r, 0);
  }
}

void *t3d__progress_main(void *arg) {
  t3d_comm_t *comm = arg;
  /* Named for top, perf and gdb (scripts/profile-step.sh counts this thread as the backend's). */
  pthread_setname_np(pthread_self(), "t3d_progress");
  t3d_backoff_t b = {0};
  unsigned idle_ms = 1;
  for (;;) {
    /* Going idle: watch the queue for ~200 us first (yielding); a condition-variable wake-up costs tens of
     * microseconds, more than a small collective. Not when ranks outnumber cores: the watcher would take turns
     * from the ranks that have work. */
    if (!posted_active(comm, 0) && !t3d__oversubscribed()) {
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
    while ((comm->q_head == NULL || comm->busy) && !posted_active(comm, 0) && !comm->stop) {
      struct timespec dl;
      clock_gettime(CLOCK_REALTIME, &dl);
      dl.tv_nsec += (long)idle_ms * 1000000L;
      if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
      }
      int rc = pthread_cond_timedwait(&comm->cv, &comm->mu, &dl);
      /* Also on an abort's signal: pending same-host point-to-point then fails at once. */
      if (rc == ETIMEDOUT || atomic_load(&comm->aborted)) {
        pthread_mutex_unlock(&comm->mu);
        posted_progress(comm, 0);
        /* Same-host point-to-point is driven by its waiters; this catches deadlines, aborts and sends queued behind
         * a full ring when nobody waits. */
        int active = posted_active(comm, 1);
        if (active) posted_progress(comm, 1);
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
    int stop = comm->stop && comm->q_head == NULL && !comm->busy && !posted_active(comm, 0) && !posted_active(comm, 1);
    pthread_mutex_unlock(&comm->mu);
    if (stop) break;
    idle_ms = 1;
    if (r != NULL) {
      if (t3d__is_collective(r->kind)) {
        t3d__run_collective(comm, r, 1);
      } else {
        run_request(comm, r);
        t3d__release_engine(comm);
      }
      /* Done with the engine: the owner's path may start again (core/submit.c). */
      t3d__count_one(&comm->finished, memory_order_release);
      t3d__backoff_reset(&b);
    }
    if (posted_active(comm, 0)) {
      if (posted_progress(comm, 0)) t3d__backoff_reset(&b);
      else if (comm->q_head == NULL) t3d__backoff_wait(&b);
    }
    /* Stopping with same-host point-to-point still pending: it completes, or fails at its deadline. */
    if (comm->stop && posted_active(comm, 1)) {
      if (posted_progress(comm, 1) > 0) t3d__backoff_reset(&b);
      else t3d__backoff_wait(&b);
    }
  }
  return NULL;
}
