/* provider.c: the shared-memory provider's entry in the engine's table (every rank of the communicator on this
 * host): the collectives of this folder, the parts of the small ones that start on the caller's thread, and
 * point-to-point through the segment's rings, posted on the caller's thread and driven by whoever waits. */
#include "provider.h"
#include "shm.h"

#include <stdlib.h>
#include <string.h>

/* Collectives and point-to-point of host memory when the segment exists; gather and scatter only in a build
 * without UCX (with it, the UCX algorithms serve them: they move each block once, to or from the root). */
static int shm_fits(const t3d_comm_t *comm, const t3d_request_t *r) {
  if (comm->shm == NULL || r->memtype != T3D_MEM_HOST) return 0;
  if (!t3d__is_collective(r->kind)) return comm->shm_p2p != NULL;
  return (r->kind != T3D_OP_GATHER && r->kind != T3D_OP_SCATTER) || !T3D_HAVE_UCX;
}

/* ---------- the start on the caller's thread ---------- */

/* The element type and count the one-shot folds: complex as pairs of reals. */
static t3d_dtype_t fold_type(const t3d_request_t *r, size_t *n) {
  *n = r->count;
  if (r->dtype != T3D_COMPLEX64 && r->dtype != T3D_COMPLEX128) return r->dtype;
  *n *= 2;
  return r->dtype == T3D_COMPLEX64 ? T3D_FLOAT32 : T3D_FLOAT64;
}

/* Total and largest block of r's receive counts, in bytes. */
static size_t rcounts_bytes(const t3d_request_t *r, int n, size_t *maxb) {
  size_t es = t3d_dtype_size(r->dtype), total = 0;
  *maxb = 0;
  for (int p = 0; p < n; p++) {
    total += r->rcounts[p] * es;
    if (r->rcounts[p] * es > *maxb) *maxb = r->rcounts[p] * es;
  }
  return total;
}

/* On a communicator with shared memory: a small allreduce that needs no staging buffer (no half type, no
 * PREMUL_SUM, input and output the same or apart) and fits the one-shot; a barrier; a small broadcast or allgatherv
 * whose blocks fit one half; a small reduce_scatterv of a real, non-half type (not PREMUL_SUM) done in one step,
 * output apart from the input; a small alltoallv whose blocks to others fit one piece, receive blocks apart from
 * its send blocks. (The half these write must be free now.) */
static int shm_start_fits(const t3d_comm_t *comm, const t3d_request_t *r) {
  size_t es = t3d_dtype_size(r->dtype), bytes = r->count * es, total, maxb;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
      if (bytes == 0 || bytes > (uint64_t)comm->inline_max || t3d__is_half(r->dtype) || r->op == T3D_PREMUL_SUM) return 0;
      if (r->sendbuf != r->recvbuf && t3d__overlap(r->sendbuf, bytes, r->recvbuf, bytes)) return 0;
      return t3d__shm_oneshot_fits(comm->shm, bytes);
    case T3D_OP_BARRIER: return 1;
    case T3D_OP_BROADCAST:
      return bytes <= (uint64_t)comm->inline_max && t3d__shm_bcast_fits(comm->shm, bytes, r->root);
    case T3D_OP_REDUCE_SCATTERV:
      if (t3d__is_half(r->dtype) || r->op == T3D_PREMUL_SUM || r->dtype == T3D_COMPLEX64 || r->dtype == T3D_COMPLEX128)
        return 0;
      total = rcounts_bytes(r, comm->size, &maxb);
      if (total > (uint64_t)comm->inline_max) return 0;
      if (t3d__overlap(r->sendbuf, total, r->recvbuf, r->rcounts[comm->rank] * es)) return 0;
      return t3d__shm_rs_fits(comm->shm, total, maxb, es);
    case T3D_OP_ALLGATHERV:
      total = rcounts_bytes(r, comm->size, &maxb);
      return total <= (uint64_t)comm->inline_max && t3d__shm_gather_fits(comm->shm, total, maxb);
    case T3D_OP_ALLTOALLV:
      total = 0;
      maxb = 0;
      for (int q = 0; q < comm->size; q++) {
        total += r->scounts[q] * es;
        if (q != comm->rank && r->scounts[q] * es > maxb) maxb = r->scounts[q] * es;
      }
      if (total == 0 || total > (uint64_t)comm->inline_max || r->scounts[comm->rank] != r->rcounts[comm->rank])
        return 0;
      if (t3d__alltoall_overlaps(comm->size, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls,
                                 es))
        return 0;
      return t3d__shm_a2a_fits(comm->shm, maxb, r->equal_blocks);
    default: return 0;
  }
}

static t3d_result_t shm_finish(t3d_exec_t *ex, t3d_request_t *r) {
  size_t es = t3d_dtype_size(r->dtype);
  t3d_redop_t op = r->op == T3D_AVG ? T3D_SUM : r->op;
  size_t n = 0; /* elements AVG divides */
  t3d_dtype_t dt = r->dtype;
  switch (r->kind) {
    case T3D_OP_BARRIER: return t3d__shm_barrier_finish(ex, &r->rs);
    case T3D_OP_BROADCAST: return t3d__shm_bcast_finish(ex, &r->rs, r->recvbuf, r->count * es, r->root);
    case T3D_OP_ALLGATHERV: return t3d__shm_gather_finish(ex, &r->rs, r->recvbuf, r->rcounts, r->rdispls, es);
    case T3D_OP_ALLTOALLV:
      return t3d__shm_a2a_finish(ex, &r->rs, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls,
                                 es, r->equal_blocks);
    case T3D_OP_REDUCE_SCATTERV:
      n = r->rcounts[ex->rank];
      T3D_CHECK(t3d__shm_rs_finish(ex, &r->rs, r->sendbuf, r->recvbuf, r->rcounts, dt, op));
      break;
    default:
      dt = fold_type(r, &n);
      T3D_CHECK(t3d__shm_oneshot_finish(ex, &r->rs, r->sendbuf, r->recvbuf, n, dt, op));
      break;
  }
  if (r->op == T3D_AVG) t3d__divide(r->recvbuf, n, dt, ex->size);
  return T3D_OK;
}

static t3d_result_t shm_start(t3d_exec_t *ex, t3d_request_t *r) {
  size_t es = t3d_dtype_size(r->dtype);
  int who = -1;
  r->rs = (t3d_shm_resume_t){0};
  switch (r->kind) {
    case T3D_OP_BARRIER: t3d__shm_barrier_start(ex, &r->rs); break;
    case T3D_OP_BROADCAST:
      T3D_CHECK(t3d__shm_bcast_start(ex, r->recvbuf, r->count * es, r->root, &r->rs));
      if (ex->rank != r->root) who = r->root;
      else if (!t3d__shm_use_bcast_direct(ex->comm->shm, r->count * es)) return T3D_OK; /* else: waits for its readers */
      break;
    case T3D_OP_ALLGATHERV:
      T3D_CHECK(t3d__shm_gather_start(ex, r->sendbuf, r->recvbuf, r->rcounts, r->rdispls, es, &r->rs));
      break;
    case T3D_OP_ALLTOALLV:
      T3D_CHECK(t3d__shm_a2a_start(ex, r->sendbuf, r->scounts, r->sdispls, es, r->equal_blocks, &r->rs));
      break;
    case T3D_OP_REDUCE_SCATTERV:
      T3D_CHECK(t3d__shm_rs_start(ex, r->sendbuf, r->rcounts, r->dtype, &r->rs));
      if (r->rcounts[ex->rank] == 0) return shm_finish(ex, r); /* nothing to fold: waits for nobody */
      break;
    default: T3D_CHECK(t3d__shm_oneshot_start(ex, r->sendbuf, r->count * es, &r->rs)); break;
  }
  /* Peers that issue at about the same time arrive within microseconds; later ones are the progress thread's
   * business, so that the call stays non-blocking. */
  t3d_result_t res = t3d__shm_start_wait(ex, &r->rs, who, ex->comm->inline_wait_ns);
  if (res == T3D_IN_PROGRESS) r->resume = 1;
  if (res != T3D_OK) return res;
  return shm_finish(ex, r);
}

/* ---------- gather and scatter in a build without UCX ---------- */

/* Gather and scatter run over the transport (ucx/gather.c, ucx/scatter.c). A build without UCX runs them through
 * the segment: an alltoallv whose only non-empty blocks go to or come from the root. In place as there. */
static t3d_result_t shm_rooted(t3d_exec_t *ex, int gather, const void *sendbuf, void *recvbuf, size_t bytes,
                               int root) {
  static char none;
  int n = ex->size, me = ex->rank;
  if (bytes == 0) return T3D_OK;
  size_t *sc = calloc(4 * (size_t)n, sizeof *sc);
  if (sc == NULL) return T3D_ERR_NO_MEMORY;
  size_t *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n;
  char *own = me == root ? (char *)(gather ? recvbuf : (void *)sendbuf) + (size_t)me * bytes : NULL;
  for (int p = 0; p < n && me == root; p++) {
    if (p == root) continue;
    (gather ? rc : sc)[p] = bytes;
    (gather ? rd : sd)[p] = (size_t)p * bytes;
  }
  if (me != root) (gather ? sc : rc)[root] = bytes;
  if (gather && me == root && sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own)
    memmove(own, sendbuf, bytes);
  t3d_result_t res = t3d__shm_alltoallv(ex, sendbuf && (!gather || me != root) ? sendbuf : &none, sc, sd,
                                        recvbuf && (gather || me != root) ? recvbuf : &none, rc, rd, 1, 0);
  if (!gather && me == root && res == T3D_OK && recvbuf != NULL && recvbuf != sendbuf && (char *)recvbuf != own)
    memmove(recvbuf, own, bytes);
  free(sc);
  return res;
}


static t3d_result_t shm_gather(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root) {
  return shm_rooted(ex, 1, sendbuf, recvbuf, bytes, root);
}

static t3d_result_t shm_scatter(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root) {
  return shm_rooted(ex, 0, sendbuf, recvbuf, bytes, root);
}

/* ---------- the table ---------- */

/* This thread owns the segment's state now: ask for the lines the call will write while it sets up. */
static void shm_warm(t3d_comm_t *comm, const t3d_request_t *r) {
  size_t bytes = r->count * t3d_dtype_size(r->dtype);
  if (r->kind == T3D_OP_ALLREDUCE) t3d__shm_oneshot_warm(comm->shm, bytes);
  if (r->kind == T3D_OP_BROADCAST && r->root == comm->rank) t3d__shm_bcast_warm(comm->shm, bytes);
}

static t3d_result_t shm_post(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped) {
  (void)grouped;
  t3d__shm_p2p_post(comm->shm_p2p, reqs, n);
  return T3D_OK;
}

static int shm_progress(t3d_comm_t *comm) { return t3d__shm_p2p_progress(comm->shm_p2p); }
static int shm_active(t3d_comm_t *comm) { return t3d__shm_p2p_active(comm->shm_p2p); }
static void shm_sleep(t3d_comm_t *comm, const t3d_request_t *req, uint64_t max_ns) {
  t3d__shm_p2p_sleep(comm->shm_p2p, req, max_ns);
}

static int shm_peer_running(t3d_comm_t *comm) { return comm->shm != NULL && t3d__shm_peer_running(comm->shm); }

static void shm_broken(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  if (comm->shm != NULL) t3d__shm_report_failure(comm->shm, res, msg);
}

static const t3d_coll_ops_t shm_coll = {
    .allreduce = t3d__shm_allreduce,
    .reduce = t3d__shm_reduce,
    .reduce_scatterv = t3d__shm_reduce_scatterv,
    .broadcast = t3d__shm_broadcast,
    .allgatherv = t3d__shm_allgatherv,
    .gather = shm_gather,
    .scatter = shm_scatter,
    .alltoallv = t3d__shm_alltoallv,
    .barrier = t3d__shm_barrier,
};

const t3d_provider_t t3d__provider_shm = {
    .name = "shm",
    .fits = shm_fits,
    .post = shm_post,
    .post_on_caller = 1,
    .coll = &shm_coll,
    .start_fits = shm_start_fits,
    .start = shm_start,
    .finish = shm_finish,
    .warm = shm_warm,
    .progress = shm_progress,
    .active = shm_active,
    .sleep = shm_sleep,
    .peer_running = shm_peer_running,
    .broken = shm_broken,
};
