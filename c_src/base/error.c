/* error.c: error texts (the communicator's last error, the thread's, the message that breaks a communicator), the
 * check that fails a waiting operation on abort or deadline, and the store helpers with the communicator's key
 * prefix. */
#include "comm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every error text is also kept per thread: a failed t3d_comm_init has no communicator to ask. */
static _Thread_local char thread_last_error[1024];

const char *t3d_thread_last_error(void) { return thread_last_error; }
const char *t3d__thread_error(void) { return thread_last_error; }

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
    /* Set-up keys end in the rank that publishes them ("ucx/2"): a timeout then means that rank never got here. */
    const char *tail = strrchr(key, '/');
    char who[160] = "";
    if (res == T3D_ERR_TIMEOUT && tail != NULL && tail[1] >= '0' && tail[1] <= '9' &&
        strspn(tail + 1, "0123456789") == strlen(tail + 1)) {
      snprintf(who, sizeof who, " (rank %s never published it: it has not reached the creation of this group, or "
               "has died)", tail + 1);
    }
    return t3d__set_error(comm, res, "t3d: store get of '%s' failed on rank %d of group '%s' after %lld ms: %s%s",
                          full, comm->rank, comm->name, (long long)comm->timeout_ms, t3d_result_string(res), who);
  }
  return T3D_OK;
}

/* ---------- waiting operations ---------- */

const char *t3d__fail_verb(t3d_result_t res) {
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
  else if (t3d__now_ns() > t3d__exec_deadline(ex)) res = T3D_ERR_TIMEOUT;
  if (res != T3D_OK) {
    snprintf(ex->error, sizeof ex->error,
             "t3d: %s #%llu on group '%s' (rank %d of %d) %s (timeout %lld ms); still waiting for %s", ex->opname,
             (unsigned long long)ex->seq, c->name, ex->rank, ex->size, t3d__fail_verb(res), (long long)ex->timeout_ms,
             waiting_for);
  }
  return res;
}


/* ---------- a broken communicator ---------- */

void t3d__fail_comm(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&comm->fatal, &expected, (int)res)) {
    snprintf(comm->fatal_msg, sizeof comm->fatal_msg, "%s", msg);
  }
  t3d__set_error(comm, res, "%s", msg);
}
