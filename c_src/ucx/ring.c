/* ring.c: building blocks the collectives share: transfer batches, pairwise exchange, and ring reduce-scatter and
 * allgather over blocks of uneven sizes. */
#include "ucx.h"

#include <stdlib.h>

void t3d__batch_init(t3d_batch_t *b, t3d_exec_t *ex, t3d_xfer_t *xs, int cap) {
  b->ex = ex;
  b->xs = xs;
  b->n = 0;
  b->cap = cap;
  b->res = T3D_OK;
}

void t3d__batch_send(t3d_batch_t *b, int peer, uint32_t step, const void *buf, size_t bytes) {
  if (b->res < 0 || bytes == 0) return;
  if (b->n >= b->cap) {
    b->res = T3D_ERR_INTERNAL;
    return;
  }
  t3d_xfer_t *x = &b->xs[b->n];
  memset(x, 0, sizeof *x);
  b->res = t3d__isend(b->ex, peer, step, buf, bytes, x);
  if (b->res >= 0) b->n++;
}

void t3d__batch_recv(t3d_batch_t *b, int peer, uint32_t step, void *buf, size_t bytes) {
  if (b->res < 0 || bytes == 0) return;
  if (b->n >= b->cap) {
    b->res = T3D_ERR_INTERNAL;
    return;
  }
  t3d_xfer_t *x = &b->xs[b->n];
  memset(x, 0, sizeof *x);
  b->res = t3d__irecv(b->ex, peer, step, buf, bytes, x);
  if (b->res >= 0) b->n++;
}

t3d_result_t t3d__batch_wait(t3d_batch_t *b) {
  t3d_result_t res = T3D_OK;
  if (b->n > 0) res = t3d__waitall(b->ex, b->xs, b->n);
  b->n = 0;
  if (b->res < 0) {
    T3D_INFO("%s #%llu: posting failed -> %s", b->ex->opname, (unsigned long long)b->ex->seq,
             t3d_result_string(b->res));
    return b->res;
  }
  return res;
}

t3d_result_t t3d__algo_xchg(t3d_exec_t *ex, uint32_t step, int dst, const void *sbuf, size_t sbytes, int src,
                            void *rbuf, size_t rbytes) {
  t3d_xfer_t xs[2];
  t3d_batch_t b;
  t3d__batch_init(&b, ex, xs, 2);
  /* Receive first so that the incoming message can land in place rather than in the unexpected queue. */
  if (src >= 0) t3d__batch_recv(&b, src, step, rbuf, rbytes);
  if (dst >= 0) t3d__batch_send(&b, dst, step, sbuf, sbytes);
  return t3d__batch_wait(&b);
}

size_t t3d__algo_small_bytes(void) {
  int64_t v = t3d__param_int(T3D_PARAM_ALGO_SMALL_BYTES);
  return v < 0 ? 0 : (size_t)v;
}

/* The ring's receive buffers, at least `bytes`: the communicator's, kept from call to call up to RING_KEEP_MAX
 * (a buffer allocated per call has new pages, which the kernel's receive faults in one at a time: measured on 2
 * namespace hosts x 2 ranks, 64 MiB reduce_scatter through torch, three alternating pairs, 86-105 -> 49-69 ms), or
 * for a larger one its own allocation, which the caller frees. NULL when out of memory. */
#define RING_KEEP_MAX ((size_t)64 << 20)
static char *ring_scratch(t3d_comm_t *comm, size_t bytes) {
  if (bytes > RING_KEEP_MAX) return malloc(bytes);
  if (!t3d__grow_scratch(&comm->ring_scratch, &comm->ring_scratch_bytes, bytes)) return NULL;
  return comm->ring_scratch;
}

t3d_result_t t3d__ring_reduce_scatter(t3d_exec_t *ex, const void *sendbuf, void *out, const size_t *counts,
                                      const size_t *offs, t3d_dtype_t dt, t3d_redop_t op, uint32_t step0) {
  int n = ex->size, r = ex->rank;
  size_t es = t3d_dtype_size(dt);
  const char *sb = (const char *)sendbuf;
  if (n == 1) {
    if (counts[0] > 0 && out != sb + offs[0] * es) memmove(out, sb + offs[0] * es, counts[0] * es);
    return T3D_OK;
  }
  size_t maxc = 0;
  for (int c = 0; c < n; c++) maxc = counts[c] > maxc ? counts[c] : maxc;
  if (maxc == 0) return T3D_OK;
  /* Two buffers: one holds the partial result being forwarded while the next arrives in the other. */
  char *scratch = ring_scratch(ex->comm, 2 * maxc * es);
  if (scratch == NULL) return T3D_ERR_NO_MEMORY;
  char *bufs[2] = {scratch, scratch + maxc * es};
  int right = (r + 1) % n, left = (r + n - 1) % n;
  t3d_result_t res = T3D_OK;
  /* Output over the input's own block (in place) and an operation whose operands commute bitwise: the last step
   * folds the partial result into the output, which the input's own block already holds, instead of folding the
   * own block into the partial result and copying that out. The own block is read only at the last step. */
  int fold_out = counts[r] > 0 && out == sb + offs[r] * es &&
                 (op == T3D_SUM || op == T3D_BAND || op == T3D_BOR || op == T3D_BXOR);
  /* At step s this rank forwards block r-s-1 (the one it finished reducing at step s-1, or its own input at step
   * 0) and receives block r-s-2; after size-1 steps the block received last is block r, reduced over all ranks. */
  for (int s = 0; s < n - 1; s++) {
    int sc = (r + 2 * n - s - 1) % n, rc = (r + 2 * n - s - 2) % n;
    const void *sptr = s == 0 ? (const void *)(sb + offs[sc] * es) : (const void *)bufs[(s - 1) & 1];
    char *rptr = bufs[s & 1];
    T3D_CHECK_GOTO(t3d__algo_xchg(ex, step0 + (uint32_t)s, right, sptr, counts[sc] * es, left, rptr,
                                  counts[rc] * es),
                   res, out_free);
    if (s == n - 2 && fold_out) t3d__reduce(out, rptr, counts[rc], dt, op);
    else t3d__reduce(rptr, sb + offs[rc] * es, counts[rc], dt, op);
  }
  if (counts[r] > 0 && !fold_out) memcpy(out, bufs[(n - 2) & 1], counts[r] * es);
out_free:
  if (scratch != ex->comm->ring_scratch) free(scratch);
  return res;
}

t3d_result_t t3d__ring_allgather(t3d_exec_t *ex, void *buf, const size_t *bytes, const size_t *displs,
                                 uint32_t step0) {
  int n = ex->size, r = ex->rank;
  char *b = (char *)buf;
  int right = (r + 1) % n, left = (r + n - 1) % n;
  /* At step s this rank forwards block r-s (its own, then each one it just received) and receives block r-s-1. */
  for (int s = 0; s < n - 1; s++) {
    int sc = (r + n - s) % n, rc = (r + 2 * n - s - 1) % n;
    T3D_CHECK(t3d__algo_xchg(ex, step0 + (uint32_t)s, right, b + displs[sc], bytes[sc], left, b + displs[rc],
                             bytes[rc]));
  }
  return T3D_OK;
}
