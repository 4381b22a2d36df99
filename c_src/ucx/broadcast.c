/* broadcast.c: binomial tree rooted at root, on ranks relative to it. Large messages go down the tree in chunks,
 * a round of ROUND_CHUNKS at a time, so that a rank forwards round k while round k+1 arrives, and each link has a
 * round's chunks in flight rather than one (one at a time, the 2-rank 64 MiB broadcast over TCP waited on each
 * 256 KiB chunk's rendezvous). */
#include "ucx.h"

/* Below this a message goes whole; above it in chunks of this size (more when that would need too many steps). */
#define PIPELINE_CHUNK ((size_t)256 * 1024)
#define PIPELINE_MIN ((size_t)1024 * 1024)
#define MAX_CHUNKS ((size_t)1 << 19)
#define ROUND_CHUNKS 8

/* Chunk j's length: the last one takes what is left. */
static size_t chunk_len(size_t j, size_t nchunks, size_t chunk, size_t bytes) {
  return j + 1 < nchunks ? chunk : bytes - j * chunk;
}

t3d_result_t t3d__algo_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root) {
  int n = ex->size, r = ex->rank;
  if (n == 1 || bytes == 0) return T3D_OK;
  int vr = (r - root + n) % n;
  /* The parent clears the lowest set bit of vr; the children add the lower powers of two. */
  int parent = -1, mask = 1;
  while (mask < n) {
    if (vr & mask) {
      parent = (vr - mask + root) % n;
      break;
    }
    mask <<= 1;
  }
  int children[16], nchildren = 0;
  for (int m = mask >> 1; m > 0; m >>= 1)
    if (vr + m < n) children[nchildren++] = (vr + m + root) % n;

  size_t chunk = bytes;
  if (bytes > PIPELINE_MIN) {
    chunk = PIPELINE_CHUNK;
    if ((bytes + chunk - 1) / chunk > MAX_CHUNKS) chunk = (bytes + MAX_CHUNKS - 1) / MAX_CHUNKS;
  }
  size_t nchunks = (bytes + chunk - 1) / chunk;
  size_t nrounds = (nchunks + ROUND_CHUNKS - 1) / ROUND_CHUNKS;
  char *b = (char *)buf;
  t3d_xfer_t xs[ROUND_CHUNKS * 17]; /* a round's receives and its sends to at most 16 children (n < 2^16) */
  /* Round k receives chunks [k R, (k + 1) R) and forwards those of round k - 1; the chunk index is the step. */
  for (size_t k = 0; k <= nrounds; k++) {
    t3d_batch_t bt;
    t3d__batch_init(&bt, ex, xs, (int)(sizeof xs / sizeof xs[0]));
    size_t lo = k * ROUND_CHUNKS, hi = lo + ROUND_CHUNKS < nchunks ? lo + ROUND_CHUNKS : nchunks;
    for (size_t j = lo; parent >= 0 && j < hi; j++) {
      t3d__batch_recv(&bt, parent, (uint32_t)j, b + j * chunk, chunk_len(j, nchunks, chunk, bytes));
    }
    for (size_t j = lo - ROUND_CHUNKS; k > 0 && j < lo && j < nchunks; j++) {
      size_t len = chunk_len(j, nchunks, chunk, bytes);
      for (int c = 0; c < nchildren; c++) t3d__batch_send(&bt, children[c], (uint32_t)j, b + j * chunk, len);
    }
    T3D_CHECK(t3d__batch_wait(&bt));
  }
  return T3D_OK;
}
