/* alltoall.c: alltoallv: every receive and send posted at once (empty ones skipped on both sides), the own block
 * copied locally. */
#include "ucx.h"

#include <stdlib.h>

t3d_result_t t3d__algo_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *sbytes, const size_t *sdispls,
                                 void *recvbuf, const size_t *rbytes, const size_t *rdispls) {
  int n = ex->size, r = ex->rank;
  if (sbytes[r] != rbytes[r]) return T3D_ERR_MISMATCH;
  /* Block p leaves from sb + sdispls[p] - sbias: the bias is nonzero only when sending from a copy. */
  const char *sb;
  size_t sbias;
  char *rb = (char *)recvbuf;
  void *copy;
  T3D_CHECK(t3d__alltoall_source(n, sendbuf, sbytes, sdispls, recvbuf, rbytes, rdispls, 1, &sb, &sbias, &copy));
  t3d_result_t res = T3D_OK;
  if (n > 1) {
    t3d_xfer_t *xs = malloc(2 * (size_t)n * sizeof *xs);
    if (xs == NULL) {
      free(copy);
      return T3D_ERR_NO_MEMORY;
    }
    t3d_batch_t b;
    t3d__batch_init(&b, ex, xs, 2 * n);
    /* Peers in the order r+1, r+2, ... so that not every rank sends to rank 0 first. */
    for (int i = 1; i < n; i++) {
      int p = (r + n - i) % n;
      t3d__batch_recv(&b, p, 0, rb + rdispls[p], rbytes[p]);
    }
    for (int i = 1; i < n; i++) {
      int p = (r + i) % n;
      t3d__batch_send(&b, p, 0, sb + (sdispls[p] - sbias), sbytes[p]);
    }
    res = t3d__batch_wait(&b);
    free(xs);
  }
  if (res == T3D_OK && rbytes[r] > 0 && rb + rdispls[r] != sb + (sdispls[r] - sbias))
    memmove(rb + rdispls[r], sb + (sdispls[r] - sbias), rbytes[r]);
  free(copy);
  return res;
}
