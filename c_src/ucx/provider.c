/* provider.c: the UCX provider's entry in the engine's table: the collective algorithms of this folder (any host;
 * on one host only where the shared-memory provider does not serve, or when T3D_PROVIDERS leaves it out) and user
 * point-to-point, which the progress thread posts and completes. */
#include "provider.h"
#include "ucx.h"

#include <stdlib.h>

static int ucx_fits(const t3d_comm_t *comm, const t3d_request_t *req) {
  (void)comm;
  return req->memtype == T3D_MEM_HOST;
}

/* On the progress thread (post_on_caller 0), in issue order. */
static t3d_result_t ucx_post(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped) {
  (void)grouped;
  for (int i = 0; i < n; i++) t3d__ucx_p2p_post(comm, reqs[i]);
  return T3D_OK;
}

/* The transport's own progress (it may have bytes to push out even with nothing posted), then completions. */
static int ucx_progress(t3d_comm_t *comm) {
  int moved = comm->tp->progress(comm->tp_state);
  if (comm->active_p2p != NULL) moved |= t3d__ucx_p2p_poll(comm) > 0;
  return moved;
}

static int ucx_active(t3d_comm_t *comm) { return comm->active_p2p != NULL; }

/* The algorithms take byte counts and displacements; the front end passes elements of es bytes. */
static size_t *to_bytes(const size_t *a, const size_t *b, int n, size_t es) {
  size_t *out = malloc(2 * (size_t)n * sizeof(size_t));
  if (out == NULL) return NULL;
  for (int p = 0; p < n; p++) {
    out[p] = a[p] * es;
    out[n + p] = b[p] * es;
  }
  return out;
}

static t3d_result_t ucx_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                  void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es, int equal) {
  (void)equal;
  size_t *s = to_bytes(scounts, sdispls, ex->size, es), *r = to_bytes(rcounts, rdispls, ex->size, es);
  t3d_result_t res = T3D_ERR_NO_MEMORY;
  if (s != NULL && r != NULL) res = t3d__algo_alltoallv(ex, sendbuf, s, s + ex->size, recvbuf, r, r + ex->size);
  free(s);
  free(r);
  return res;
}

static const t3d_coll_ops_t ucx_coll = {
    .allreduce = t3d__algo_allreduce,
    .reduce = t3d__algo_reduce,
    .reduce_scatterv = t3d__algo_reduce_scatterv,
    .broadcast = t3d__algo_broadcast,
    .allgatherv = t3d__algo_allgatherv,
    .gather = t3d__algo_gather,
    .scatter = t3d__algo_scatter,
    .alltoallv = ucx_alltoallv,
    .barrier = t3d__algo_barrier,
};

const t3d_provider_t t3d__provider_ucx = {
    .name = "ucx",
    .fits = ucx_fits,
    .post = ucx_post,
    .post_on_caller = 0,
    .coll = &ucx_coll,
    .progress = ucx_progress,
    .active = ucx_active,
};
