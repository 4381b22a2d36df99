/* scatter.c: linear scatter: the root posts a send to every rank at once, the others receive. */
#include "ucx.h"

#include <stdlib.h>

t3d_result_t t3d__algo_scatter(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root) {
  int n = ex->size, r = ex->rank;
  if (bytes == 0) return T3D_OK;
  if (r != root) return t3d__algo_xchg(ex, 0, -1, NULL, 0, root, recvbuf, bytes);
  const char *sb = (const char *)sendbuf, *own = sb + (size_t)r * bytes;
  t3d_result_t res = T3D_OK;
  if (n > 1) {
    t3d_xfer_t *xs = malloc((size_t)n * sizeof *xs);
    if (xs == NULL) return T3D_ERR_NO_MEMORY;
    t3d_batch_t b;
    t3d__batch_init(&b, ex, xs, n);
    for (int p = 0; p < n; p++)
      if (p != r) t3d__batch_send(&b, p, 0, sb + (size_t)p * bytes, bytes);
    res = t3d__batch_wait(&b);
    free(xs);
  }
  /* Copied after the sends complete: recvbuf may overlap another rank's block of sendbuf. In place (recvbuf NULL,
   * equal to sendbuf as with MPI_IN_PLACE, or already our block) nothing moves. */
  if (res == T3D_OK && recvbuf != NULL && recvbuf != sendbuf && (const char *)recvbuf != own)
    memmove(recvbuf, own, bytes);
  return res;
}
