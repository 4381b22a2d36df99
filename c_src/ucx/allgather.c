/* allgather.c: allgatherv over per-rank byte counts and displacements. Small totals: every rank sends its block to
 * every other at once. Larger: a ring. */
#include "ucx.h"

#include <stdlib.h>

static t3d_result_t allgather_direct(t3d_exec_t *ex, char *rb, const size_t *bytes, const size_t *displs) {
  int n = ex->size, r = ex->rank;
  t3d_xfer_t *xs = malloc(2 * (size_t)n * sizeof *xs);
  if (xs == NULL) return T3D_ERR_NO_MEMORY;
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, 2 * n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, 0, rb + displs[p], bytes[p]);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_send(&b, p, 0, rb + displs[r], bytes[r]);
  t3d_result_t res = t3d__batch_wait(&b);
  free(xs);
  return res;
}

t3d_result_t t3d__algo_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                  const size_t *displs_bytes) {
  int n = ex->size, r = ex->rank;
  char *rb = (char *)recvbuf;
  /* In place (sendbuf NULL, equal to recvbuf as with MPI_IN_PLACE, or already pointing at our block): the block is
   * where it belongs. */
  char *own = rb + displs_bytes[r];
  if (sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own && bytes[r] > 0)
    memmove(own, sendbuf, bytes[r]);
  size_t total = 0;
  for (int c = 0; c < n; c++) total += bytes[c];
  if (n == 1 || total == 0) return T3D_OK;
  if (total <= t3d__algo_small_bytes() && n <= 64) return allgather_direct(ex, rb, bytes, displs_bytes);
  return t3d__ring_allgather(ex, recvbuf, bytes, displs_bytes, 0);
}
