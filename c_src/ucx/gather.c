/* gather.c: linear gather: the root posts a receive from every rank at once, the others send. */
#include "ucx.h"

#include <stdlib.h>

t3d_result_t t3d__algo_gather(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root) {
  int n = ex->size, r = ex->rank;
  if (bytes == 0) return T3D_OK;
  if (r != root) return t3d__algo_xchg(ex, 0, root, sendbuf, bytes, -1, NULL, 0);
  char *rb = (char *)recvbuf, *own = rb + (size_t)r * bytes;
  /* In place: sendbuf NULL, equal to recvbuf (as MPI_IN_PLACE) or already our block. */
  if (sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own) memmove(own, sendbuf, bytes);
  if (n == 1) return T3D_OK;
  t3d_xfer_t *xs = malloc((size_t)n * sizeof *xs);
  if (xs == NULL) return T3D_ERR_NO_MEMORY;
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, 0, rb + (size_t)p * bytes, bytes);
  t3d_result_t res = t3d__batch_wait(&b);
  free(xs);
  return res;
}
