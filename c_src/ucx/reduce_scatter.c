/* reduce_scatter.c: reduce_scatterv. Small totals: each rank sends every block straight to its owner, who reduces
 * them in rank order (one round). Larger: a ring over the blocks, sized by the count array. */
#include "ucx.h"

#include <stdlib.h>

static t3d_result_t reduce_scatter_direct(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                          const size_t *offs, t3d_dtype_t dt, t3d_redop_t op) {
  int n = ex->size, r = ex->rank;
  size_t es = t3d_dtype_size(dt), mine = counts[r] * es;
  const char *sb = (const char *)sendbuf;
  t3d_result_t res = T3D_OK;
  char *slots = malloc((size_t)n * mine + 1);
  t3d_xfer_t *xs = malloc(2 * (size_t)n * sizeof *xs);
  if (slots == NULL || xs == NULL) {
    res = T3D_ERR_NO_MEMORY;
    goto out_free;
  }
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, 2 * n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, 0, slots + (size_t)p * mine, mine);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_send(&b, p, 0, sb + offs[p] * es, counts[p] * es);
  T3D_CHECK_GOTO(t3d__batch_wait(&b), res, out_free);
  if (mine > 0) {
    /* recvbuf may alias the input: fold in scratch, write once at the end. */
    memcpy(slots + (size_t)r * mine, sb + offs[r] * es, mine);
    for (int p = 1; p < n; p++) t3d__reduce(slots, slots + (size_t)p * mine, counts[r], dt, op);
    memmove(recvbuf, slots, mine);
  }
out_free:
  free(xs);
  free(slots);
  return res;
}

t3d_result_t t3d__algo_reduce_scatterv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                       t3d_dtype_t dt, t3d_redop_t op) {
  int n = ex->size;
  size_t es = t3d_dtype_size(dt);
  size_t *offs = malloc((size_t)n * sizeof *offs);
  if (offs == NULL) return T3D_ERR_NO_MEMORY;
  size_t total = 0;
  for (int c = 0; c < n; c++) {
    offs[c] = total;
    total += counts[c];
  }
  t3d_result_t res = T3D_OK;
  if (total == 0) goto out_free;
  if (n > 1 && total * es <= t3d__algo_small_bytes() && n <= 64)
    res = reduce_scatter_direct(ex, sendbuf, recvbuf, counts, offs, dt, op);
  else
    res = t3d__ring_reduce_scatter(ex, sendbuf, recvbuf, counts, offs, dt, op, 0);
out_free:
  free(offs);
  return res;
}
