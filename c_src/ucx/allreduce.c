/* allreduce.c: allreduce. Small vectors: every rank sends its whole vector to every other and each reduces all of
 * them in rank order (one round). Large: ring reduce-scatter then ring allgather over size blocks. Both give
 * bitwise identical results on every rank: a fixed reduction order everywhere, or one owner per element. */
#include "ucx.h"

#include <stdlib.h>

static t3d_result_t allreduce_direct(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count,
                                     t3d_dtype_t dt, t3d_redop_t op) {
  int n = ex->size, r = ex->rank;
  size_t bytes = count * t3d_dtype_size(dt);
  t3d_result_t res = T3D_OK;
  char *slots = malloc((size_t)n * bytes);
  t3d_xfer_t *xs = malloc(2 * (size_t)n * sizeof *xs);
  if (slots == NULL || xs == NULL) {
    res = T3D_ERR_NO_MEMORY;
    goto out_free;
  }
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, 2 * n);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_recv(&b, p, 0, slots + (size_t)p * bytes, bytes);
  for (int p = 0; p < n; p++)
    if (p != r) t3d__batch_send(&b, p, 0, sendbuf, bytes);
  T3D_CHECK_GOTO(t3d__batch_wait(&b), res, out_free);
  /* In place, recvbuf is about to be overwritten by rank 0's vector: keep our own in its slot. */
  const char *own = (const char *)sendbuf;
  if (sendbuf == recvbuf) {
    memcpy(slots + (size_t)r * bytes, sendbuf, bytes);
    own = slots + (size_t)r * bytes;
  }
  const char *first = r == 0 ? own : slots;
  if (first != (const char *)recvbuf) memcpy(recvbuf, first, bytes);
  for (int p = 1; p < n; p++) t3d__reduce(recvbuf, p == r ? own : slots + (size_t)p * bytes, count, dt, op);
out_free:
  free(xs);
  free(slots);
  return res;
}

static t3d_result_t allreduce_ring(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count,
                                   t3d_dtype_t dt, t3d_redop_t op) {
  int n = ex->size, r = ex->rank;
  size_t es = t3d_dtype_size(dt);
  t3d_result_t res = T3D_OK;
  size_t *arr = malloc(4 * (size_t)n * sizeof *arr);
  if (arr == NULL) return T3D_ERR_NO_MEMORY;
  size_t *counts = arr, *offs = arr + n, *bytes = arr + 2 * n, *displs = arr + 3 * n;
  t3d__algo_split(count, n, counts, offs);
  for (int c = 0; c < n; c++) {
    bytes[c] = counts[c] * es;
    displs[c] = offs[c] * es;
  }
  char *rb = (char *)recvbuf;
  /* Reduce-scatter leaves block r reduced in place in recvbuf; in place it writes there only after its last read
   * of the input. */
  T3D_CHECK_GOTO(t3d__ring_reduce_scatter(ex, sendbuf, rb + displs[r], counts, offs, dt, op, 0), res, out_free);
  T3D_CHECK_GOTO(t3d__ring_allgather(ex, recvbuf, bytes, displs, (uint32_t)(n - 1)), res, out_free);
out_free:
  free(arr);
  return res;
}

t3d_result_t t3d__algo_allreduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                 t3d_redop_t op) {
  size_t bytes = count * t3d_dtype_size(dt);
  if (bytes == 0) return T3D_OK;
  if (ex->size == 1) {
    if (sendbuf != recvbuf) memmove(recvbuf, sendbuf, bytes);
    return T3D_OK;
  }
  /* The direct scheme costs size * bytes of scratch and size^2 messages: keep it to small groups. */
  if (bytes <= t3d__algo_small_bytes() && ex->size <= 64) return allreduce_direct(ex, sendbuf, recvbuf, count, dt, op);
  return allreduce_ring(ex, sendbuf, recvbuf, count, dt, op);
}
