/* p2p.c: user sends and receives over UCX. The progress thread posts them (UCX's worker is driven by that thread
 * alone) and completes them as their transfers finish, fail, time out or are aborted. Between ranks of one host
 * that share a segment, point-to-point goes through shm/p2p.c instead. */
#include "ucx.h"
#include "base/watch.h"

#include <stdio.h>

void t3d__ucx_p2p_post(t3d_comm_t *comm, t3d_request_t *r) {
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
    t3d__request_complete(r, res, msg);
    return;
  }
  r->next = comm->active_p2p;
  comm->active_p2p = r;
}

/* Completes the point-to-point requests whose transfers finished, failed, timed out or were aborted. */
int t3d__ucx_p2p_poll(t3d_comm_t *comm) {
  t3d_request_t **link = &comm->active_p2p;
  uint64_t now = 0;
  int completed = 0;
  while (*link != NULL) {
    t3d_request_t *r = *link;
    t3d_xfer_t *x = &r->xfer;
    const char *what = r->kind == T3D_OP_SEND ? "send to" : "recv from";
    char msg[1100];
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
      t3d_result_t watched = t3d__watch_check(comm);
      if (atomic_load(&comm->aborted)) res = T3D_ERR_ABORTED;
      else if (watched != T3D_OK) res = watched;
      else if (comm->tp->peer_lost(comm->tp_state, r->root)) res = T3D_ERR_PEER_LOST;
      else if (now > r->deadline_ns) res = T3D_ERR_TIMEOUT;
      if (res != T3D_IN_PROGRESS) {
        comm->tp->cancel(comm->tp_state, x);
        if (res == watched) {
          snprintf(msg, sizeof msg, "t3d: %s rank %d on group '%s' (rank %d, tag %lld) %.800s", what, r->root, comm->name,
                   comm->rank, (long long)r->tag, comm->watch_msg);
        } else {
          snprintf(msg, sizeof msg, "t3d: %s rank %d on group '%s' (rank %d, tag %lld) %s (timeout %lld ms)", what,
                   r->root, comm->name, comm->rank, (long long)r->tag, t3d__fail_verb(res), (long long)r->timeout_ms);
        }
      }
    }
    if (res == T3D_IN_PROGRESS) {
      link = &r->next;
      continue;
    }
    *link = r->next;
    comm->tp->release(comm->tp_state, x);
    t3d__request_complete(r, res, msg);
    completed++;
  }
  return completed;
}

