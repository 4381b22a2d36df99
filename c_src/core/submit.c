/* submit.c: how an operation enters the engine: its provider is chosen, then it is posted through the provider
 * (point-to-point, CUDA), started on the caller's thread (a small collective on an idle engine, or a blocking call's
 * whole collective), held in an open group, or queued for the progress thread. Groups are issued here too. */
#include "engine.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* What every collective that finished on the caller's thread without error hands out: done, T3D_OK, never freed.
 * One for all, so that such a call allocates nothing. */
static t3d_request_t done_ok = {.done = 1, .refs = 1, .shared = 1, .result = T3D_OK, .prov = &t3d__provider_shm,
                                .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .source = -1};

/* ---------- the owner's path ----------
 * Taking mu twice per call (to claim the engine and to release it) was a third of a 2-rank 8 B broadcast at the C
 * level: 0.21 us a call with it, 0.14 without (docs/benchmarks/owner-path-2ranks.txt). A claim by compare-and-swap
 * and a release by exchange cost as much as the mutex, since each locked instruction waits for the stores this core
 * has just made into the segment's lines to leave it. So the thread that made the communicator, while it is the only
 * one that issues on it, claims the engine with plain stores and loads: it marks itself in_owner_path, then finds no
 * other thread has issued (shared), no group open, and every request it queued finished by the progress thread
 * (enqueued == finished); only it puts requests in the queue while shared is 0, so then nobody runs anything on the
 * engine but it. A thread other than the owner that issues turns the path off for good, the first time through an
 * asymmetric fence: it sets shared, runs membarrier(2) (a full barrier on every running thread of the process), and
 * waits until the owner is out of its path; the owner's side needs only a compiler barrier, since either its mark
 * was seen by then or its check comes after the barrier and sees shared. From then on every call takes mu. */
static int is_owner(const t3d_comm_t *comm) {
  return comm->owner_path && pthread_equal(pthread_self(), comm->owner);
}

/* shared: 0 the owner's path may run, 1 being turned off (the fence not yet run), 2 off. */
static void other_issuer(t3d_comm_t *comm) {
  if (!comm->owner_path || is_owner(comm)) return;
  int expected = 0;
  if (atomic_compare_exchange_strong(&comm->shared, &expected, 1)) {
    if (t3d__membarrier() != 0) {
      /* No barrier (the process was not registered: a seccomp filter, say): the owner's mark, if it made one, has
       * left its core's store buffer long before a millisecond is up. */
      struct timespec ms = {0, 1000000};
      nanosleep(&ms, NULL);
    }
    atomic_store_explicit(&comm->shared, 2, memory_order_release);
  }
  while (atomic_load_explicit(&comm->shared, memory_order_acquire) != 2) sched_yield();
  while (atomic_load_explicit(&comm->in_owner_path, memory_order_acquire) != 0) sched_yield();
}

/* On the owner's thread: claims the engine without mu where it may (1; t3d__release with T3D_HOLD_OWNER ends it). */
static int owner_claims(t3d_comm_t *comm) {
  if (!is_owner(comm)) return 0;
  atomic_store_explicit(&comm->in_owner_path, 1, memory_order_relaxed);
  atomic_signal_fence(memory_order_seq_cst); /* the hardware barrier is other_issuer's membarrier */
  if (atomic_load_explicit(&comm->shared, memory_order_relaxed) == 0 && comm->group_depth == 0 &&
      atomic_load_explicit(&comm->enqueued, memory_order_relaxed) ==
          atomic_load_explicit(&comm->finished, memory_order_acquire)) {
    return 1;
  }
  atomic_store_explicit(&comm->in_owner_path, 0, memory_order_release);
  return 0;
}

/* ---------- the queue ---------- */

/* Its callers (t3d__submit, t3d_group_end with what t3d__submit held) have run other_issuer. */
void t3d__enqueue(t3d_comm_t *comm, t3d_request_t *r) {
  pthread_mutex_lock(&comm->mu);
  r->next = NULL;
  if (comm->q_tail != NULL) comm->q_tail->next = r;
  else comm->q_head = r;
  comm->q_tail = r;
  t3d__count_one(&comm->enqueued, memory_order_relaxed);
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
}

static t3d_result_t no_provider(t3d_comm_t *comm, const t3d_request_t *r) {
  return t3d__set_error(comm, T3D_ERR_UNSUPPORTED,
                        "t3d: no provider can run %s of %s memory on rank %d of group '%s' (T3D_PROVIDERS leaves "
                        "out the ones that could)", t3d__op_name(r->kind), r->memtype == T3D_MEM_CUDA ? "CUDA" : "host",
                        comm->rank, comm->name);
}

/* Whether an idle engine may start r on the caller's thread (the provider checks the sizes). */
static int may_start(t3d_comm_t *comm, const t3d_request_t *r) {
  return r->prov->start_fits != NULL && comm->inline_max >= 0 && atomic_load(&comm->fatal) == 0 &&
         r->prov->start_fits(comm, r);
}

/* A prepared request that start_inline could not keep (no memory): the call finishes here, waiting for late peers,
 * and reports through its return value. */
static t3d_result_t finish_unkept(t3d_comm_t *comm, t3d_exec_t *ex, t3d_request_t *r, t3d_result_t res,
                                  t3d_request_t **out, int hold) {
  if (res == T3D_IN_PROGRESS) res = t3d__execute(ex, r); /* r->resume is set: finishes the started operation */
  if (res < 0) t3d__record_failure(comm, ex, res);
  t3d__release(comm, hold);
  t3d__request_drop_arrays(r);
  if (res < 0) return res;
  *out = &done_ok;
  return T3D_OK;
}

/* On the caller's thread, with the engine held (hold: busy, or the owner's path). r is on the heap (kept) or prepared on the caller's stack;
 * the latter, finished without error, hands out done_ok, and is kept only when it failed or goes on. When peers are
 * late the request goes to the head of the queue (ahead of anything other threads queued meanwhile: it was issued
 * first) and the progress thread finishes it, so the call never waits for long; unless the call is blocking
 * (T3D_FLAG_BLOCKING): then this thread finishes it. whole: a blocking call's collective that has no inline start,
 * run from the beginning. */
static t3d_result_t start_inline(t3d_comm_t *comm, t3d_request_t *r, int kept, int whole, t3d_request_t **out,
                                 int hold) {
  t3d_exec_t ex;
  t3d__exec_init(comm, r, &ex);
  if (whole) t3d__exec_deadline(&ex); /* a large operation: its phases (core/hier.c) copy the deadline */
  t3d_result_t res = whole ? t3d__execute(&ex, r) : r->prov->start(&ex, r);
  if (res == T3D_IN_PROGRESS) r->deadline_ns = t3d__exec_deadline(&ex); /* the thread that goes on keeps it */
  if (res == T3D_IN_PROGRESS && (r->flags & T3D_FLAG_BLOCKING)) res = t3d__execute(&ex, r); /* r->resume is set */
  if (!kept) {
    if (res == T3D_OK) {
      t3d__release(comm, hold);
      t3d__request_drop_arrays(r);
      *out = &done_ok;
      return T3D_OK;
    }
    t3d_request_t *k = t3d__request_keep(r);
    if (k == NULL) return finish_unkept(comm, &ex, r, res, out, hold);
    r = k;
  }
  *out = r;
  if (res != T3D_IN_PROGRESS) {
    t3d__end_collective(comm, r, &ex, res, hold, 1);
    return T3D_OK;
  }
  pthread_mutex_lock(&comm->mu);
  r->next = comm->q_head;
  comm->q_head = r;
  if (comm->q_tail == NULL) comm->q_tail = r;
  t3d__count_one(&comm->enqueued, memory_order_relaxed);
  if (hold == T3D_HOLD_OWNER) t3d__release(comm, hold);
  else comm->busy = 0;
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
  return T3D_OK;
}

t3d_result_t t3d__submit(t3d_comm_t *comm, t3d_request_t *r, t3d_request_t **out) {
  int coll = t3d__is_collective(r->kind);
  *out = r;
  if (r->prov == NULL) r->prov = t3d__provider_for(comm, r);
  if (r->prov == NULL) {
    t3d_result_t res = no_provider(comm, r);
    *out = NULL;
    t3d__request_release(r); /* the engine's reference and the user's */
    t3d__request_release(r);
    return res;
  }
  /* The open group, like the group depth, belongs to the calling thread; the mutex guards the collectives' sequence
   * and the engine's queue, which what joins a group or is posted here does not touch. */
  int here = t3d__is_posted(r) && r->prov->post_on_caller;
  if (!here) other_issuer(comm);
  if (coll) {
    pthread_mutex_lock(&comm->mu);
    /* Sequence numbers are given at issue time: every rank issues collectives in the same order, so they agree. */
    r->seq = ++comm->coll_seq;
    if (comm->group_depth > 0 || here) pthread_mutex_unlock(&comm->mu);
  }
  if (comm->group_depth > 0) {
    r->next_child = NULL;
    if (comm->group_tail != NULL) comm->group_tail->next_child = r;
    else comm->group_head = r;
    comm->group_tail = r;
    return T3D_OK;
  }
  if (here) {
    /* Posted here, on the caller's thread, in issue order (same-host point-to-point; NCCL enqueues on the caller's
     * stream at once). An error is the call's, and no request is handed out. */
    t3d_result_t res = r->prov->post(comm, &r, 1, 0);
    if (res < 0) {
      *out = NULL;
      t3d__request_release(r);
      return res;
    }
    return T3D_OK;
  }
  if (!coll) pthread_mutex_lock(&comm->mu);
  /* A small collective on an idle engine starts on the caller's thread: two thread hand-offs cost more than the
   * operation. */
  if (coll && comm->q_head == NULL && !comm->busy && may_start(comm, r)) {
    comm->busy = 1;
    pthread_mutex_unlock(&comm->mu);
    return start_inline(comm, r, 1, 0, out, T3D_HOLD_ENGINE);
  }
  pthread_mutex_unlock(&comm->mu);
  t3d__enqueue(comm, r);
  return T3D_OK;
}

t3d_result_t t3d__submit_prepared(t3d_comm_t *comm, t3d_request_t *tmp, t3d_request_t **out) {
  tmp->prov = t3d__provider_for(comm, tmp);
  if (tmp->prov == NULL) {
    t3d__request_drop_arrays(tmp);
    return no_provider(comm, tmp);
  }
  int may_inline = tmp->prov->start != NULL && t3d__is_collective(tmp->kind);
  if (may_inline && owner_claims(comm)) {
    int eligible = may_start(comm, tmp);
    int whole = !eligible && (tmp->flags & T3D_FLAG_BLOCKING) && atomic_load(&comm->fatal) == 0;
    if (eligible || whole) {
      tmp->seq = ++comm->coll_seq;
      if (tmp->prov->warm != NULL) tmp->prov->warm(comm, tmp);
      return start_inline(comm, tmp, 0, whole, out, T3D_HOLD_OWNER);
    }
    t3d__release(comm, T3D_HOLD_OWNER);
  }
  if (may_inline) {
    other_issuer(comm);
    pthread_mutex_lock(&comm->mu);
    int idle = comm->group_depth == 0 && comm->q_head == NULL && !comm->busy;
    int eligible = idle && may_start(comm, tmp);
    /* A blocking call runs the whole of a collective too large to start inline here as well. */
    int whole = idle && !eligible && (tmp->flags & T3D_FLAG_BLOCKING) && atomic_load(&comm->fatal) == 0;
    if (eligible || whole) {
      tmp->seq = ++comm->coll_seq;
      comm->busy = 1;
      pthread_mutex_unlock(&comm->mu);
      if (tmp->prov->warm != NULL) tmp->prov->warm(comm, tmp);
      return start_inline(comm, tmp, 0, whole, out, T3D_HOLD_ENGINE);
    }
    pthread_mutex_unlock(&comm->mu);
  }
  t3d_request_t *r = t3d__request_keep(tmp);
  if (r == NULL) {
    t3d__request_drop_arrays(tmp);
    return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d: out of memory for a request");
  }
  return t3d__submit(comm, r, out);
}

/* ---------- groups ---------- */

t3d_result_t t3d_group_start(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  comm->group_depth++;
  return T3D_OK;
}

/* Children that their providers post on the caller's thread (same-host point-to-point, CUDA operations) are
 * posted here, one provider at a time in the table's order; the others go to the engine as the group, whose
 * progress thread issues point-to-point first. */
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
  int n = 0, nposted = 0;
  for (t3d_request_t *c = comm->group_head; c != NULL; c = c->next_child) {
    n++;
    nposted += t3d__is_posted(c) && c->prov->post_on_caller;
  }
  /* A small group's lists live in this frame (a ring shift's send and receive allocate nothing more here). */
  enum { FRAME_POSTED = 8 };
  t3d_request_t *frame[2 * FRAME_POSTED];
  int on_heap = nposted > FRAME_POSTED;
  t3d_request_t **posted = on_heap ? malloc(sizeof *posted * (size_t)nposted) : frame;
  t3d_request_t **batch = on_heap ? malloc(sizeof *batch * (size_t)nposted) : frame + FRAME_POSTED;
  if (posted == NULL || batch == NULL) {
    if (on_heap) {
      free(posted);
      free(batch);
    }
    t3d__request_release(g);
    t3d__request_release(g);
    return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_group_end: out of memory on rank %d", comm->rank);
  }
  t3d_request_t *c = comm->group_head, *next, **host_tail = &g->children;
  comm->group_head = comm->group_tail = NULL;
  nposted = 0;
  int one_provider = 1;
  for (; c != NULL; c = next) {
    next = c->next_child;
    c->next_child = NULL;
    c->parent = g;
    if (t3d__is_posted(c) && c->prov->post_on_caller) {
      one_provider &= nposted == 0 || c->prov == posted[0]->prov;
      posted[nposted++] = c;
    } else {
      *host_tail = c;
      host_tail = &c->next_child;
    }
  }
  /* One extra count held by the engine until every child has been issued, so the group cannot complete early. */
  atomic_init(&g->pending_children, n + 1);
  if (nposted > 0 && one_provider) {
    posted[0]->prov->post(comm, posted, nposted, 1); /* the usual group: all on one provider, in issue order */
  } else if (nposted > 0) {
    for (const t3d_provider_t *const *p = t3d__providers(); *p != NULL; p++) {
      int k = 0;
      for (int i = 0; i < nposted; i++) {
        if (posted[i]->prov == *p) batch[k++] = posted[i];
      }
      if (k > 0) (*p)->post(comm, batch, k, 1);
    }
  }
  if (on_heap) {
    free(posted);
    free(batch);
  }
  if (g->children != NULL) {
    t3d__enqueue(comm, g);
  } else if (atomic_fetch_sub(&g->pending_children, 1) == 1) {
    /* Nothing for the engine: every operation was posted, so the group is complete now. */
    char *msg = g->errmsg;
    g->errmsg = NULL;
    t3d__request_complete(g, g->first_child_error, msg);
    free(msg);
  }
  if (req != NULL) *req = g;
  else t3d__request_release(g);
  return T3D_OK;
}

/* ---------- a blocking exchange (t3d_sendrecv) ---------- */

/* The engine's reference is gone: whoever completed the request (this thread's pass or another thread's) is done
 * with it, so a request in the caller's frame may go out of scope. */
static int let_go(t3d_request_t *r) { return atomic_load_explicit(&r->refs, memory_order_acquire) == 1; }

/* The pair's outcome, both done: the first error, with its request's text on the communicator; the receive's count. */
static t3d_result_t pair_result(t3d_comm_t *comm, const t3d_request_t *s, const t3d_request_t *r, size_t *received) {
  const t3d_request_t *bad = s->result < 0 ? s : r->result < 0 ? r : NULL;
  if (received != NULL) *received = r->result == T3D_OK ? r->recv_count : 0;
  if (bad == NULL) return T3D_OK;
  return t3d__set_error(comm, bad->result, "t3d_sendrecv (rank %d of group '%s'): %s", comm->rank, comm->name,
                        bad->errmsg != NULL ? bad->errmsg : t3d_result_string(bad->result));
}

/* A kept request that was never submitted: both its references go. */
static void drop_kept(t3d_request_t *k) {
  if (k == NULL) return;
  t3d__request_release(k);
  t3d__request_release(k);
}

/* Anywhere else: the two on the heap as a group, waited on. */
static t3d_result_t pair_as_group(t3d_comm_t *comm, t3d_request_t *s, t3d_request_t *r, size_t *received) {
  t3d_request_t *hs = t3d__request_keep(s), *hr = t3d__request_keep(r);
  if (hs == NULL || hr == NULL) {
    drop_kept(hs);
    drop_kept(hr);
    return t3d__set_error(comm, T3D_ERR_NO_MEMORY, "t3d_sendrecv: out of memory on rank %d", comm->rank);
  }
  t3d_request_t *os = NULL, *orr = NULL, *g = NULL;
  t3d_group_start(comm);
  t3d_result_t res = t3d__submit(comm, hs, &os);
  if (res == T3D_OK) {
    res = t3d__submit(comm, hr, &orr);
  } else {
    drop_kept(hr);
  }
  t3d_result_t end = t3d_group_end(comm, &g);
  if (res == T3D_OK) res = end;
  if (res == T3D_OK) t3d_wait(g, -1); /* each of the two ends by its own timeout */
  if (res == T3D_OK) res = pair_result(comm, os, orr, received);
  t3d_request_free(g);
  t3d_request_free(os);
  t3d_request_free(orr);
  return res;
}

t3d_result_t t3d__submit_pair(t3d_comm_t *comm, t3d_request_t *s, t3d_request_t *r, size_t *received) {
  s->prov = t3d__provider_for(comm, s);
  r->prov = t3d__provider_for(comm, r);
  if (s->prov != &t3d__provider_shm || r->prov != &t3d__provider_shm) return pair_as_group(comm, s, r, received);
  /* Same host: posted here and polled until both are done and let go. Nobody else holds a handle to them, so
   * nobody sleeps on their condition variables (which these frame copies do not have) or sets a callback. */
  t3d_request_t *both[2] = {s, r};
  t3d_result_t res = s->prov->post(comm, both, 2, 1);
  if (res < 0) return res;
  uint64_t since = 0;
  while (!let_go(s) || !let_go(r)) {
    t3d_request_t *w = !atomic_load_explicit(&r->done, memory_order_acquire)   ? r
                       : !atomic_load_explicit(&s->done, memory_order_acquire) ? s
                                                                                 : NULL;
    if (w != NULL) t3d_request_poll(w, &since);
    else __builtin_ia32_pause(); /* its completer is between marking it done and letting it go */
  }
  res = pair_result(comm, s, r, received);
  free(s->errmsg);
  free(r->errmsg);
  return res;
}
