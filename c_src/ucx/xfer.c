/* xfer.c: the point-to-point transfers the collective algorithms are built from: tagged sends and receives of one
 * operation over the transport, and the wait for a set of them, which fails on abort, deadline or a lost peer with
 * a message naming the ranks still awaited. */
#include "ucx.h"
#include "base/watch.h"

#include <stdio.h>



/* peer is a rank of the exec (of its subset, ex->peers); transfers, tags and messages use the communicator's. */
t3d_result_t t3d__isend(t3d_exec_t *ex, int peer, uint32_t step, const void *buf, size_t bytes, t3d_xfer_t *x) {
  t3d_comm_t *c = ex->comm;
  if (ex->peers != NULL) peer = ex->peers[peer];
  return c->tp->isend(c->tp_state, peer, t3d__coll_tag(ex->kind, ex->seq, step, c->rank), buf, bytes, x);
}

t3d_result_t t3d__irecv(t3d_exec_t *ex, int peer, uint32_t step, void *buf, size_t bytes, t3d_xfer_t *x) {
  t3d_comm_t *c = ex->comm;
  if (ex->peers != NULL) peer = ex->peers[peer];
  x->truncate = 0;
  return c->tp->irecv(c->tp_state, peer, t3d__coll_tag(ex->kind, ex->seq, step, peer), ~0ull, buf, bytes, x);
}

/* Ranks that run different collectives under one sequence number never take each other's messages (the tags
 * carry the operation), so they would wait until their timeout. A wait that has lasted T3D__DESYNC_LOOK_MS looks,
 * every T3D__DESYNC_LOOK_MS, whether a rank it awaits has sent this collective's number under another operation:
 * then the ranks disagree, and this rank says so (and tells the others, base/watch.h). */
#define T3D__DESYNC_LOOK_MS 200
static t3d_result_t look_for_desync(t3d_exec_t *ex, const t3d_xfer_t *xs, int n) {
  t3d_comm_t *c = ex->comm;
  for (int i = 0; i < n; i++) {
    if (!xs[i].is_recv || xs[i].peer < 0 || atomic_load_explicit(&xs[i].done, memory_order_acquire)) continue;
    uint64_t tag = t3d__coll_tag(0, ex->seq, 0, xs[i].peer), found = 0;
    uint64_t mask = ~(T3D_TAG_OP_MASK | T3D_TAG_STEP_MASK); /* any operation, any step */
    if (!c->tp->peek(c->tp_state, tag, mask, &found) || t3d__coll_tag_op(found) == (ex->kind & 0xf)) continue;
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d runs %s #%llu where "
             "this rank runs %s (ranks disagree on the operation)", ex->opname, (unsigned long long)ex->seq, c->name,
             c->rank, c->size, xs[i].peer, t3d__op_name((t3d_op_kind_t)t3d__coll_tag_op(found)),
             (unsigned long long)ex->seq, ex->opname);
    return T3D_ERR_MISMATCH;
  }
  return T3D_OK;
}

/* A peer whose UCX connection broke may have failed and exited after telling why (base/watch.h): that report comes
 * over another socket, so a watched group gives it the watch's grace before it reports the loss as such. */
static int lost_for_good(const t3d_comm_t *c, uint64_t *since) {
  if (c->watch == NULL) return 1;
  uint64_t now = t3d__now_ns();
  if (*since == 0) *since = now;
  return now >= *since + T3D__WATCH_GRACE_MS * 1000000ull;
}

t3d_result_t t3d__waitall(t3d_exec_t *ex, t3d_xfer_t *xs, int n) {
  t3d_comm_t *c = ex->comm;
  t3d_result_t res = T3D_OK;
  t3d_backoff_t b = {0};
  int watched = 0, lost_rank = -1;
  uint64_t look_at = 0, lost_since = 0;
  int desync = 0;
  for (;;) {
    int pending = 0, lost = -1;
    for (int i = 0; i < n; i++) {
      if (atomic_load_explicit(&xs[i].done, memory_order_acquire)) continue;
      pending++;
      if (c->tp->peer_lost(c->tp_state, xs[i].peer)) lost = xs[i].peer;
    }
    if (pending == 0) break;
    if (atomic_load(&c->aborted)) res = T3D_ERR_ABORTED;
    else if ((res = t3d__watch_check(c)) != T3D_OK) watched = 1; /* a peer lost or a failure told */
    else if (lost >= 0 && lost_for_good(c, &lost_since)) res = T3D_ERR_PEER_LOST, lost_rank = lost;
    else {
      uint64_t now = t3d__now_ns();
      if (now > t3d__exec_deadline(ex)) res = T3D_ERR_TIMEOUT;
      else if (look_at == 0) look_at = now + T3D__DESYNC_LOOK_MS * 1000000ull;
      else if (now >= look_at) {
        look_at = now + T3D__DESYNC_LOOK_MS * 1000000ull;
        if ((res = look_for_desync(ex, xs, n)) != T3D_OK) desync = 1; /* ex->error says what */
      }
    }
    if (res != T3D_OK) break;
    int progressed = c->tp->progress(c->tp_state);
    t3d__ucx_p2p_poll(c);
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
    if (desync) {
      /* look_for_desync wrote it */
    } else if (res == T3D_ERR_PEER_LOST && !watched) { /* UCX saw it first (the connection reset): the watch says more */
      snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) lost rank %d: its UCX "
               "connection failed (the process died or its host is unreachable); still waiting for rank(s) %s",
               ex->opname, (unsigned long long)ex->seq, c->name, c->rank, c->size, lost_rank, ranks);
    } else if (watched) {
      snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) %.600s; still waiting "
               "for rank(s) %.200s", ex->opname, (unsigned long long)ex->seq, c->name, c->rank, c->size,
               c->watch_msg, ranks);
    } else {
      snprintf(ex->error, sizeof ex->error,
               "t3d: %s #%llu on group '%s' (rank %d of %d) %s (timeout %lld ms); still waiting for rank(s) %s",
               ex->opname, (unsigned long long)ex->seq, c->name, c->rank, c->size, t3d__fail_verb(res),
               (long long)ex->timeout_ms, ranks);
    }
  } else {
    for (int i = 0; i < n; i++) {
      if (xs[i].status != T3D_OK) {
        res = xs[i].status;
        /* A dying peer shows up as whatever the transport saw first; say what happened. */
        if (res == T3D_ERR_TRANSPORT && c->tp->peer_lost(c->tp_state, xs[i].peer)) res = T3D_ERR_PEER_LOST;
        snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): transfer with rank %d: %s",
                 ex->opname, (unsigned long long)ex->seq, c->name, c->rank, c->size, xs[i].peer,
                 t3d_result_string(res));
        break;
      }
      if (xs[i].is_recv && xs[i].bytes != xs[i].posted) {
        res = T3D_ERR_MISMATCH;
        snprintf(ex->error, sizeof ex->error,
                 "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d sent %zu bytes where %zu were expected "
                 "(ranks disagree on the size of the operation)",
                 ex->opname, (unsigned long long)ex->seq, c->name, c->rank, c->size, xs[i].peer, xs[i].bytes,
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

