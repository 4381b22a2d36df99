/* transport.c: UCP tagged messages. One UCP context and worker per communicator, endpoints to every peer,
 * worker addresses exchanged through the store. Only the progress thread touches the worker after init. */
#include "comm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <ucp/api/ucp.h>

/* A receive that may be shorter than its message: matched by probing, so that the message's length is known and a
 * longer one lands in a bounce buffer whose head is then copied out. Kept in posting order. */
typedef struct probe_recv {
  t3d_xfer_t *x;
  uint64_t tag, mask;
  void *buf;
  size_t cap;
  void *bounce;
  size_t length;
  uint64_t sender_tag;
  int matched, completed;
  struct probe_recv *next;
} probe_recv_t;

typedef struct ucx_state {
  t3d_comm_t *comm;
  probe_recv_t *probes; /* oldest first */
  ucp_context_h context;
  ucp_worker_h worker;
  ucp_ep_h *eps;
  struct ucx_peer_err {
    struct ucx_state *st;
    int peer;
  } *err_args;
  atomic_int *peer_lost;
} ucx_state_t;

/* UCX calls go through this so that failures log the call and translate the status. */
#define UCX_CHECK_GOTO(call, res, label)                                                        \
  do {                                                                                          \
    ucs_status_t ucx_st_ = (call);                                                              \
    if (ucx_st_ != UCS_OK) {                                                                    \
      (res) = t3d__set_error(st->comm, T3D_ERR_TRANSPORT, "t3d: UCX call %s failed: %s (rank %d, group '%s')", \
                             #call, ucs_status_string(ucx_st_), st->comm->rank, st->comm->name);     \
      goto label;                                                                               \
    }                                                                                           \
  } while (0)

static t3d_result_t status_to_result(ucs_status_t s) {
  switch (s) {
    case UCS_OK: return T3D_OK;
    case UCS_ERR_CANCELED: return T3D_ERR_ABORTED;
    case UCS_ERR_MESSAGE_TRUNCATED: return T3D_ERR_MISMATCH;
    case UCS_ERR_NO_MEMORY: return T3D_ERR_NO_MEMORY;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE: return T3D_ERR_PEER_LOST;
    default: return T3D_ERR_TRANSPORT;
  }
}

static void peer_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
  struct ucx_peer_err *pe = arg;
  atomic_store(&pe->st->peer_lost[pe->peer], 1);
  T3D_WARN("rank %d lost its connection to rank %d in group '%s': %s", pe->st->comm->rank, pe->peer,
           pe->st->comm->name, ucs_status_string(status));
}

static void finish(t3d_xfer_t *x, ucs_status_t status, size_t bytes, int source) {
  x->status = status_to_result(status);
  x->bytes = bytes;
  x->source = source;
  atomic_store_explicit(&x->done, 1, memory_order_release);
}

static void send_cb(void *request, ucs_status_t status, void *user_data) {
  t3d_xfer_t *x = user_data;
  finish(x, status, 0, -1);
}

static void recv_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data) {
  t3d_xfer_t *x = user_data;
  if (status == UCS_OK) finish(x, status, info->length, (int)(info->sender_tag & T3D_TAG_SRC_MASK));
  else finish(x, status, 0, -1);
}

static int match_probes(ucx_state_t *st);

static t3d_result_t ucx_init(t3d_comm_t *comm, void **state) {
  t3d_result_t res = T3D_OK;
  ucx_state_t *st = calloc(1, sizeof *st);
  if (st == NULL) return T3D_ERR_NO_MEMORY;
  st->comm = comm;
  ucp_config_t *config = NULL;
  ucp_address_t *addr = NULL;
  size_t addr_len = 0;

  UCX_CHECK_GOTO(ucp_config_read(NULL, NULL, &config), res, fail);
  /* UCX 1.13's System V transport fails to attach peers' segments once a process holds several workers
   * ("shmat ... Invalid argument" when a group is split twice); POSIX shared memory and CMA carry the same traffic.
   * A user's own UCX_TLS still wins. */
  if (getenv("UCX_TLS") == NULL) ucp_config_modify(config, "TLS", "^sysv");
  ucp_params_t params;
  memset(&params, 0, sizeof params);
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucs_status_t s = ucp_init(&params, config, &st->context);
  ucp_config_release(config);
  UCX_CHECK_GOTO(s /* ucp_init */, res, fail);

  ucp_worker_params_t wparams;
  memset(&wparams, 0, sizeof wparams);
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(st->context, &wparams, &st->worker);
  if (s == UCS_ERR_NO_RESOURCE || s == UCS_ERR_NO_MEMORY) {
    /* Most often UCX's shared-memory transports finding /dev/shm full; UCX says so only in its own log. */
    struct statvfs v;
    unsigned long long free_kb = statvfs("/dev/shm", &v) == 0 ? (unsigned long long)v.f_bavail * v.f_frsize / 1024 : 0;
    res = t3d__set_error(comm, T3D_ERR_TRANSPORT, "t3d: UCX call ucp_worker_create failed: %s (rank %d, group '%s'); "
                         "UCX's shared-memory transports need room in /dev/shm (%llu KiB free here): free some "
                         "(df -h /dev/shm), or keep UCX off it with UCX_TLS=^posix,sysv,cma (or UCX_TLS=tcp)",
                         ucs_status_string(s), comm->rank, comm->name, free_kb);
    goto fail;
  }
  UCX_CHECK_GOTO(s /* ucp_worker_create */, res, fail);
  UCX_CHECK_GOTO(ucp_worker_get_address(st->worker, &addr, &addr_len), res, fail);

  char key[64];
  snprintf(key, sizeof key, "ucx/%d", comm->rank);
  T3D_CHECK_GOTO(t3d__store_set(comm, key, addr, addr_len), res, fail);

  st->eps = calloc((size_t)comm->size, sizeof *st->eps);
  st->err_args = calloc((size_t)comm->size, sizeof *st->err_args);
  st->peer_lost = calloc((size_t)comm->size, sizeof *st->peer_lost);
  if (st->eps == NULL || st->err_args == NULL || st->peer_lost == NULL) {
    res = T3D_ERR_NO_MEMORY;
    goto fail;
  }
  int peer_mode = strcmp(t3d__param_str(T3D_PARAM_UCX_ERR_MODE), "peer") == 0;
  for (int p = 0; p < comm->size; p++) {
    void *remote = NULL;
    size_t len = 0;
    if (p == comm->rank) {
      remote = addr;
    } else {
      snprintf(key, sizeof key, "ucx/%d", p);
      T3D_CHECK_GOTO(t3d__store_get(comm, key, &remote, &len), res, fail);
    }
    st->err_args[p].st = st;
    st->err_args[p].peer = p;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof ep);
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = remote;
    /* Peer mode makes a dead peer fail our requests at once, but UCX 1.13 then refuses its shared-memory
     * transports and falls back to TCP (~20x slower here). By default dead peers are found by timeouts. */
    ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = peer_error_cb;
    ep.err_handler.arg = &st->err_args[p];
    s = ucp_ep_create(st->worker, &ep, &st->eps[p]);
    if (p != comm->rank) free(remote);
    UCX_CHECK_GOTO(s /* ucp_ep_create to the peer */, res, fail);
  }
  ucp_worker_release_address(st->worker, addr);
  *state = st;
  return T3D_OK;

fail:
  if (addr != NULL) ucp_worker_release_address(st->worker, addr);
  t3d__transport_ucx.fini(st);
  return res;
}

static t3d_result_t ucx_isend(void *state, int peer, uint64_t tag, const void *buf, size_t bytes, t3d_xfer_t *x) {
  ucx_state_t *st = state;
  static const char dummy;
  atomic_store(&x->done, 0);
  x->peer = peer;
  x->handle = NULL;
  x->probe = NULL;
  x->posted = bytes;
  x->is_recv = 0;
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = send_cb;
  p.user_data = x;
  ucs_status_ptr_t r = ucp_tag_send_nbx(st->eps[peer], bytes ? buf : &dummy, bytes, tag, &p);
  if (r == NULL) {
    finish(x, UCS_OK, 0, -1);
  } else if (UCS_PTR_IS_ERR(r)) {
    finish(x, UCS_PTR_STATUS(r), 0, -1);
  } else {
    x->handle = r;
  }
  return T3D_OK;
}

static t3d_result_t ucx_irecv(void *state, int peer, uint64_t tag, uint64_t tag_mask, void *buf, size_t bytes,
                              t3d_xfer_t *x) {
  ucx_state_t *st = state;
  static char dummy;
  atomic_store(&x->done, 0);
  x->peer = peer;
  x->handle = NULL;
  x->probe = NULL;
  x->posted = bytes;
  x->is_recv = 1;
  if (x->truncate) {
    probe_recv_t *pr = calloc(1, sizeof *pr);
    if (pr == NULL) return T3D_ERR_NO_MEMORY;
    pr->x = x;
    pr->tag = tag;
    pr->mask = tag_mask;
    pr->buf = buf;
    pr->cap = bytes;
    probe_recv_t **l = &st->probes;
    while (*l != NULL) l = &(*l)->next;
    *l = pr;
    x->probe = pr;
    match_probes(st);
    return T3D_OK;
  }
  ucp_request_param_t p;
  memset(&p, 0, sizeof p);
  /* Always through the callback: UCX 1.13 does not report the length of an immediately matched message. */
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = recv_cb;
  p.user_data = x;
  ucs_status_ptr_t r = ucp_tag_recv_nbx(st->worker, bytes ? buf : &dummy, bytes, tag, tag_mask, &p);
  if (UCS_PTR_IS_ERR(r)) {
    finish(x, UCS_PTR_STATUS(r), 0, -1);
  } else {
    x->handle = r;
  }
  return T3D_OK;
}

static void probe_unlink(ucx_state_t *st, probe_recv_t *pr) {
  for (probe_recv_t **l = &st->probes; *l != NULL; l = &(*l)->next) {
    if (*l == pr) {
      *l = pr->next;
      return;
    }
  }
}

/* May run inside ucp_tag_msg_recv_nbx itself: it only records the outcome; the sweep in match_probes frees. */
static void probe_recv_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data) {
  probe_recv_t *pr = user_data;
  if (status == UCS_OK && pr->bounce != NULL) memcpy(pr->buf, pr->bounce, pr->cap);
  free(pr->bounce);
  pr->bounce = NULL;
  pr->completed = 1;
  if (status == UCS_OK) finish(pr->x, status, pr->length, (int)(pr->sender_tag & T3D_TAG_SRC_MASK));
  else finish(pr->x, status, 0, -1);
}

/* Matches waiting probe receives in posting order. Messages arrive only inside ucp_worker_progress (single-threaded
 * worker), so one pass cannot let a later receive overtake an earlier one with the same tag. */
static int match_probes(ucx_state_t *st) {
  int n = 0;
  for (probe_recv_t *pr = st->probes; pr != NULL; pr = pr->next) {
    if (pr->matched) continue;
    ucp_tag_recv_info_t info;
    ucp_tag_message_h msg = ucp_tag_probe_nb(st->worker, pr->tag, pr->mask, 1, &info);
    if (msg == NULL) continue;
    pr->matched = 1;
    pr->length = info.length;
    pr->sender_tag = info.sender_tag;
    void *target = pr->buf;
    if (info.length > pr->cap) target = pr->bounce = malloc(info.length);
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = probe_recv_cb;
    p.user_data = pr;
    static char dummy;
    ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(st->worker, target ? target : &dummy, info.length, msg, &p);
    if (UCS_PTR_IS_ERR(r)) probe_recv_cb(NULL, UCS_PTR_STATUS(r), NULL, pr);
    else pr->x->handle = r;
    n++;
  }
  for (probe_recv_t **l = &st->probes; *l != NULL;) {
    probe_recv_t *pr = *l;
    if (!pr->completed) {
      l = &pr->next;
      continue;
    }
    pr->x->probe = NULL;
    *l = pr->next;
    free(pr);
  }
  return n;
}

static int ucx_progress(void *state) {
  ucx_state_t *st = state;
  int n = (int)ucp_worker_progress(st->worker);
  if (st->probes != NULL) n += match_probes(st);
  return n;
}

static int ucx_peek(void *state, uint64_t tag, uint64_t mask, uint64_t *found) {
  ucx_state_t *st = state;
  ucp_tag_recv_info_t info;
  if (ucp_tag_probe_nb(st->worker, tag, mask, 0, &info) == NULL) return 0;
  *found = info.sender_tag;
  return 1;
}

static int ucx_peer_lost(void *state, int peer) {
  ucx_state_t *st = state;
  return peer >= 0 && atomic_load(&st->peer_lost[peer]);
}

static void ucx_cancel(void *state, t3d_xfer_t *x) {
  ucx_state_t *st = state;
  if (atomic_load_explicit(&x->done, memory_order_acquire)) return;
  if (x->handle == NULL && x->probe != NULL) { /* a probe receive not matched yet */
    probe_recv_t *pr = x->probe;
    probe_unlink(st, pr);
    free(pr);
    x->probe = NULL;
    finish(x, UCS_ERR_CANCELED, 0, -1);
    return;
  }
  if (x->handle == NULL) return;
  ucp_request_cancel(st->worker, x->handle);
  /* A send that is mid-flight may not honour the cancel; progress a bounded while, then leave it marked done.
   * The request stays owned by UCX and is reclaimed when the worker is destroyed. */
  uint64_t until = t3d__now_ns() + 200ull * 1000 * 1000;
  while (!atomic_load_explicit(&x->done, memory_order_acquire) && t3d__now_ns() < until) {
    ucp_worker_progress(st->worker);
  }
  if (!atomic_load_explicit(&x->done, memory_order_acquire)) {
    x->handle = NULL; /* abandoned: never touch it again */
    finish(x, UCS_ERR_CANCELED, 0, -1);
  }
}

static void ucx_release(void *state, t3d_xfer_t *x) {
  if (x->handle != NULL) {
    ucp_request_free(x->handle);
    x->handle = NULL;
  }
}

static void ucx_fini(void *state) {
  ucx_state_t *st = state;
  if (st == NULL) return;
  if (st->eps != NULL) {
    for (int p = 0; p < st->comm->size; p++) {
      if (st->eps[p] == NULL) continue;
      /* Flush first so that our last messages reach live peers; force only when the peer is gone or the flush
       * does not finish in bounded time. */
      ucp_request_param_t cp;
      memset(&cp, 0, sizeof cp);
      cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      cp.flags = ucx_peer_lost(st, p) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(st->eps[p], &cp);
      if (UCS_PTR_IS_PTR(r)) {
        uint64_t until = t3d__now_ns() + 1000ull * 1000 * 1000;
        while (ucp_request_check_status(r) == UCS_INPROGRESS && t3d__now_ns() < until) {
          ucp_worker_progress(st->worker);
        }
        if (ucp_request_check_status(r) == UCS_INPROGRESS) {
          ucp_request_cancel(st->worker, r);
        } else {
          ucp_request_free(r);
        }
      }
    }
  }
  while (st->probes != NULL) {
    probe_recv_t *pr = st->probes;
    st->probes = pr->next;
    free(pr->bounce);
    free(pr);
  }
  if (st->worker != NULL) ucp_worker_destroy(st->worker);
  if (st->context != NULL) ucp_cleanup(st->context);
  free(st->eps);
  free(st->err_args);
  free(st->peer_lost);
  free(st);
}

const t3d_transport_t t3d__transport_ucx = {
    .name = "ucx",
    .init = ucx_init,
    .isend = ucx_isend,
    .irecv = ucx_irecv,
    .progress = ucx_progress,
    .cancel = ucx_cancel,
    .peek = ucx_peek,
    .peer_lost = ucx_peer_lost,
    .release = ucx_release,
    .fini = ucx_fini,
};

const char *t3d_ucx_version_string(void) { return ucp_get_version_string(); }
