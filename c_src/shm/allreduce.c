/* allreduce.c: allreduce and reduce over a communicator's shared-memory segment. Small vectors one-shot (every rank
 * copies its vector into its half, then the reducing ranks reduce all halves in rank order), also in parts for the
 * inline path (fits, warm, start, finish); large ones reduce-scatter + allgather in chunks (each rank reduces one
 * slice of the chunk straight from the halves and its own input). */
#include "shm.h"

#include <stdlib.h>
#include <string.h>

/* Elements per 64-byte line: slices start on cache lines, so that two ranks never write the same line. */
static size_t line_elems(size_t es) { return es != 0 && 64 % es == 0 ? 64 / es : 1; }

/* Every rank's whole vector goes into its half; the reducing ranks fold all halves in rank order, so every rank
 * computes the same bits. root < 0: allreduce. Two parts, so that an inline allreduce can publish on the caller's
 * thread and leave the fold to the progress thread when peers are late (t3d__shm_oneshot_*).
 * A reader waits on the peer's info line, not its flag: after its post the writer sets the line's seq
 * to the step's phase, so a reader that sees it has kind and size in the same line and may count the phase as
 * posted. Vectors of at most T3D_SHM_INLINE_DATA bytes travel in that line too: one line per peer. The flag is
 * still read now and then (t3d__shm_wait_line), for a peer that posts without setting seq: one that runs another
 * operation, whose mismatch check_info then reports. */
enum { ONESHOT_INLINE, ONESHOT_HALF };

static int oneshot_mode(size_t bytes) { return bytes <= T3D_SHM_INLINE_DATA ? ONESHOT_INLINE : ONESHOT_HALF; }

static t3d_result_t oneshot_publish(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, size_t bytes, int root,
                                    int kind, t3d_shm_step_t *st) {
  t3d__shm_step_begin(s, 2, st);
  /* The root of a reduce reads its own input in place; everybody else publishes it. */
  if (root != s->rank) {
    T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
    if (oneshot_mode(bytes) == ONESHOT_INLINE) {
      t3d__shm_put_inline(s, st, kind, bytes, sendbuf, bytes);
    } else {
      t3d__shm_put_info(s, st, kind, bytes, 0);
      memcpy(t3d__shm_half(s, s->rank, st->h), sendbuf, bytes);
    }
  }
  if (root >= 0 && root != s->rank) {
    /* A non-root of a reduce has nothing to read: it is done with the step, and returns. */
    t3d__shm_show_arrived(s, st);
    t3d__shm_post(s, st->base + 2);
    return T3D_OK;
  }
  /* Without the fence: this rank waits for its peers next, while the stores leave its core; the fold's post (or
   * t3d__shm_sleep, if it blocks first) checks for sleepers. */
  t3d__shm_post_lazy(s, st->base + 1);
  if (root != s->rank) t3d__shm_show_arrived(s, st);
  return T3D_OK;
}

static t3d_result_t oneshot_fold(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const void *sendbuf,
                                 void *recvbuf, size_t count, t3d_dtype_t dt, t3d_redop_t op, int kind) {
  int n = s->size, me = s->rank;
  size_t bytes = count * t3d_dtype_size(dt);
  t3d_shm_arrival_t a = t3d__shm_arrival(st);
  T3D_CHECK(t3d__shm_wait_line(s, ex, -1, st->base + 1, 0, &a));
  for (int p = 0; p < n; p++) {
    if (p == me) {
      s->srcs[p] = sendbuf;
      continue;
    }
    T3D_CHECK(t3d__shm_check_info(s, ex, st, p, kind, bytes));
    if (oneshot_mode(bytes) == ONESHOT_INLINE) {
      s->srcs[p] = t3d__shm_inline_data(s, p, st->h);
      continue;
    }
    s->srcs[p] = t3d__shm_half(s, p, st->h);
    /* Ask for all of a peer's lines at once: the fold's loads would otherwise meet the misses a few at a time. */
    for (size_t off = 0; off < bytes && off < 4096; off += 64) __builtin_prefetch((const char *)s->srcs[p] + off);
  }
  t3d__shm_reduce_n(recvbuf, NULL, s->srcs, n, count, dt, op, 0);
  t3d__shm_post(s, st->base + 2);
  return T3D_OK;
}

static t3d_result_t reduce_oneshot(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count,
                                   t3d_dtype_t dt, t3d_redop_t op, int root, int kind) {
  t3d_shm_step_t st;
  T3D_CHECK(oneshot_publish(s, ex, sendbuf, count * t3d_dtype_size(dt), root, kind, &st));
  if (root >= 0 && root != s->rank) return T3D_OK;
  return oneshot_fold(s, ex, &st, sendbuf, recvbuf, count, dt, op, kind);
}

int t3d__shm_oneshot_fits(t3d_shm_t *s, size_t bytes) {
  return bytes <= s->oneshot_max && !t3d__shm_mapped_size(s, bytes) && t3d__shm_next_half_free(s);
}

void t3d__shm_oneshot_warm(t3d_shm_t *s, size_t bytes) {
  if (bytes > s->oneshot_max) return;
  int h = (int)(s->step & 1);
  t3d__shm_prefetch_write(t3d__shm_info(s, s->rank, h));
  const char *half = t3d__shm_half(s, s->rank, h);
  for (size_t off = 0; oneshot_mode(bytes) == ONESHOT_HALF && off < bytes && off < 4 * 64; off += 64)
    t3d__shm_prefetch_write(half + off);
}

t3d_result_t t3d__shm_oneshot_start(t3d_exec_t *ex, const void *sendbuf, size_t bytes, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  T3D_CHECK(oneshot_publish(s, ex, sendbuf, bytes, -1, T3D_OP_ALLREDUCE, &st));
  rs->h = st.h;
  rs->base = st.base;
  rs->by_line = 1;
  return T3D_OK;
}

t3d_result_t t3d__shm_oneshot_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf, void *recvbuf,
                                     size_t count, t3d_dtype_t dt, t3d_redop_t op) {
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  return oneshot_fold(t3d__exec_shm(ex), ex, &st, sendbuf, recvbuf, count, dt, op, T3D_OP_ALLREDUCE);
}

typedef struct {
  t3d_shm_t *s;
  int h, nt;
  char *out;       /* user output at the chunk's start */
  size_t es, m, sl; /* chunk elements, slice elements */
} slice_copy_t;

static void slice_bounds(size_t m, size_t sl, int q, size_t *lo, size_t *hi) {
  *lo = t3d__shm_min_sz((size_t)q * sl, m);
  *hi = t3d__shm_min_sz(*lo + sl, m);
}

static void copy_slice_out(void *arg, int p) {
  slice_copy_t *c = arg;
  size_t lo, hi;
  slice_bounds(c->m, c->sl, p, &lo, &hi);
  t3d__shm_copy(c->out + lo * c->es, t3d__shm_half(c->s, p, c->h) + lo * c->es, (hi - lo) * c->es, c->nt);
}

/* Chunk by chunk: each rank publishes the slices others own (its own stays in its buffer), reduces its slice from
 * all halves into its half and its output, then copies the others' reduced slices out. Every element is reduced
 * by one rank only, so all ranks hold the same bits. root < 0: allreduce; else only root copies out. */
static t3d_result_t reduce_chunked(t3d_shm_t *s, t3d_exec_t *ex, const char *sb, char *rb, size_t count,
                                   t3d_dtype_t dt, t3d_redop_t op, int root, int kind) {
  int n = s->size, me = s->rank;
  size_t es = t3d_dtype_size(dt), unit = line_elems(es) * (size_t)n;
  size_t per = s->chunk / es / unit * unit;
  if (per == 0) per = unit;
  int collect = root < 0 || root == me;
  /* In place the output's lines are the input's, which this rank has just read (its slice) or copied into its half
   * (the others' slices, a chunk before): plain stores find them in the cache, where non-temporal ones would first
   * push them out. Measured through torch, in-place 64 MiB at 2 ranks, four alternating pairs: medians 9.2 -> 7.7
   * ms; 8 ranks on 2 cores within the noise. */
  int nt = s->nt && count * es >= s->nt_min && sb != rb;
  int far; /* what this rank writes into its half for the others goes with non-temporal stores */
  T3D_CHECK(t3d__shm_far(s, ex, t3d__shm_probes(s, count * es), count * es, &far));
  for (size_t off = 0; off < count; off += per) {
    size_t m = t3d__shm_min_sz(per, count - off);
    size_t sl = (m + unit - 1) / unit * line_elems(es);
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 3, &st);
    T3D_CHECK(t3d__shm_step_acquire(s, ex, &st));
    if (off == 0) t3d__shm_put_info(s, &st, kind, count * es, 0);
    char *mine = t3d__shm_half(s, me, st.h);
    for (int q = 0; q < n; q++) {
      if (q == me) continue;
      size_t lo, hi;
      slice_bounds(m, sl, q, &lo, &hi);
      t3d__shm_copy(mine + lo * es, sb + (off + lo) * es, (hi - lo) * es, far);
    }
    t3d__shm_post(s, st.base + 1);
    T3D_CHECK(t3d__shm_wait(s, ex, -1, st.base + 1));
    if (off == 0) T3D_CHECK(t3d__shm_check_all_info(s, ex, &st, kind, count * es));
    size_t lo, hi;
    slice_bounds(m, sl, me, &lo, &hi);
    for (int p = 0; p < n; p++) s->srcs[p] = p == me ? sb + (off + lo) * es : t3d__shm_half(s, p, st.h) + lo * es;
    char *out = collect ? rb + (off + lo) * es : NULL;
    if (far) /* the others read the half: it takes reduce_n's non-temporal stores, the output plain ones */
      t3d__shm_reduce_n(out, mine + lo * es, s->srcs, n, hi - lo, dt, op, 1);
    else
      t3d__shm_reduce_n(mine + lo * es, out, s->srcs, n, hi - lo, dt, op, nt);
    if (!collect) {
      t3d__shm_post(s, st.base + 3);
      continue;
    }
    t3d__shm_post(s, st.base + 2);
    slice_copy_t c = {s, st.h, nt, rb + off * es, es, m, sl};
    T3D_CHECK(t3d__shm_wait_each(s, ex, st.base + 2, NULL, copy_slice_out, &c));
    t3d__shm_post(s, st.base + 3);
  }
  return T3D_OK;
}

static t3d_result_t reduce_common(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                  t3d_redop_t op, int root, int kind) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t bytes = count * t3d_dtype_size(dt);
  if (bytes == 0) return T3D_OK;
  int collect = root < 0 || root == s->rank;
  /* Exactly in place is fine (each element is read before it is written); any other overlap reads from a copy. */
  void *copy = NULL;
  if (collect && sendbuf != recvbuf && t3d__overlap(sendbuf, bytes, recvbuf, bytes)) {
    copy = malloc(bytes);
    if (copy == NULL) return T3D_ERR_NO_MEMORY;
    memcpy(copy, sendbuf, bytes);
    sendbuf = copy;
  }
  t3d_result_t res;
  int done = 0;
  if (root < 0 && t3d__shm_mapped_size(s, bytes)) {
    res = t3d__shm_mapped_allreduce(s, ex, sendbuf, recvbuf, count, dt, op, &done);
    if (res != T3D_OK || done) {
      free(copy);
      return res;
    }
  }
  if (bytes <= s->oneshot_max) res = reduce_oneshot(s, ex, sendbuf, recvbuf, count, dt, op, root, kind);
  else res = reduce_chunked(s, ex, sendbuf, recvbuf, count, dt, op, root, kind);
  free(copy);
  return res;
}

t3d_result_t t3d__shm_allreduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                t3d_redop_t op) {
  return reduce_common(ex, sendbuf, recvbuf, count, dt, op, -1, T3D_OP_ALLREDUCE);
}

t3d_result_t t3d__shm_reduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                             t3d_redop_t op, int root) {
  return reduce_common(ex, sendbuf, recvbuf, count, dt, op, root, T3D_OP_REDUCE);
}

