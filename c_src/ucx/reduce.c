/* reduce.c: reduce to a root. Small vectors: every rank sends its vector to the root, which reduces them in rank
 * order. Large: ring reduce-scatter over size blocks, then every rank sends its reduced block to the root. */
#include "ucx.h"

#include <stdlib.h>

static t3d_result_t reduce_direct(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                  t3d_redop_t op, int root) {
  int n = ex->size, r = ex->rank;
  size_t bytes = count * t3d_dtype_size(dt);
  if (r != root) return t3d__algo_xchg(ex, 0, root, sendbuf, bytes, -1, NULL, 0);
  t3d_result_t res = T3D_OK;
  char *slots = malloc((size_t)n * bytes);
  t3d_xfer_t *xs = malloc((size_t)n * sizeof *xs);
  if (slots == NULL || xs == NULL) {
    res = T3D_ERR_NO_MEMORY;
    goto out_free;
  }
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, 0, slots + (size_t)p * bytes, bytes);
  T3D_CHECK_GOTO(t3d__batch_wait(&b), res, out_free);
  /* recvbuf may alias the input: keep ours in its slot before recvbuf takes rank 0's vector. */
  memcpy(slots + (size_t)r * bytes, sendbuf, bytes);
  memcpy(recvbuf, slots, bytes);
  for (int p = 1; p < n; p++) t3d__reduce(recvbuf, slots + (size_t)p * bytes, count, dt, op);
out_free:
  free(xs);
  free(slots);
  return res;
}

static t3d_result_t reduce_ring(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                t3d_redop_t op, int root) {
  int n = ex->size, r = ex->rank;
  size_t es = t3d_dtype_size(dt);
  t3d_result_t res = T3D_OK;
  char *mine = NULL;
  t3d_xfer_t *xs = NULL;
  size_t *arr = malloc(2 * (size_t)n * sizeof *arr);
  if (arr == NULL) return T3D_ERR_NO_MEMORY;
  size_t *counts = arr, *offs = arr + n;
  t3d__algo_split(count, n, counts, offs);
  char *rb = (char *)recvbuf;
  /* Only the root has a recvbuf (others may pass NULL): elsewhere the reduced block waits in scratch. */
  if (r == root) {
    mine = rb + offs[r] * es;
  } else {
    mine = malloc(counts[r] * es + 1);
    if (mine == NULL) {
      res = T3D_ERR_NO_MEMORY;
      goto out_free;
    }
  }
  T3D_CHECK_GOTO(t3d__ring_reduce_scatter(ex, sendbuf, mine, counts, offs, dt, op, 0), res, out_free);
  uint32_t step = (uint32_t)(n - 1);
  if (r != root) {
    T3D_CHECK_GOTO(t3d__algo_xchg(ex, step, root, mine, counts[r] * es, -1, NULL, 0), res, out_free);
    goto out_free;
  }
  /* The root reads its input for the last time inside the reduce-scatter, so in place the blocks may land now. */
  xs = malloc((size_t)n * sizeof *xs);
  if (xs == NULL) {
    res = T3D_ERR_NO_MEMORY;
    goto out_free;
  }
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, step, rb + offs[p] * es, counts[p] * es);
  res = t3d__batch_wait(&b);
out_free:
  if (r != root) free(mine);
  free(xs);
  free(arr);
  return res;
}

t3d_result_t t3d__algo_reduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                              t3d_redop_t op, int root) {
  size_t bytes = count * t3d_dtype_size(dt);
  if (bytes == 0) return T3D_OK;
  if (ex->size == 1) {
    if (sendbuf != recvbuf) memmove(recvbuf, sendbuf, bytes);
    return T3D_OK;
  }
  if (bytes <= t3d__algo_small_bytes() && ex->size <= 64)
    return reduce_direct(ex, sendbuf, recvbuf, count, dt, op, root);
  return reduce_ring(ex, sendbuf, recvbuf, count, dt, op, root);
}
