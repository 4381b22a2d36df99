/* shm_coll.c: the collectives over a communicator's shared-memory segment. Small allreduce / reduce one-shot (every
 * rank copies its vector into its half, then reduces all halves in rank order); large ones reduce-scatter +
 * allgather in chunks (each rank reduces one slice of the chunk straight from the halves and its own input). The
 * data movers (broadcast, allgatherv, alltoallv) stream through the halves a step at a time, double-buffered, or,
 * for large blocks between processes that may read each other's memory, read them straight from the owner's buffer
 * ("single copy" below). */
#include "shm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }


/* PREFETCHW: fetch the line for writing (the CPU flag "3dnowprefetch"; a NOP hint where absent). */
static void prefetch_write(const void *p) {
#if defined(__x86_64__)
  __asm__ volatile("prefetchw (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 1);
#endif
}

/* Elements per 64-byte line: slices start on cache lines, so that two ranks never write the same line. */
static size_t line_elems(size_t es) { return es != 0 && 64 % es == 0 ? 64 / es : 1; }

static t3d_result_t check_all_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int kind, uint64_t sig) {
  for (int p = 0; p < s->size; p++)
    if (p != s->rank) T3D_CHECK(t3d__shm_check_info(s, ex, st, p, kind, sig));
  return T3D_OK;
}

/* ---------- single copy ----------
 * Blocks of allgatherv (alltoallv) of direct_min to direct_max (a2a_direct_min to a2a_direct_max) bytes skip the
 * segment: their owner publishes where the block is (allgatherv: the addr and pid of its info line; alltoallv: a
 * table in its step-0 half), readers copy it straight from there (process_vm_readv: one copy instead of two, into
 * the half and out of it), and the owner returns only once every reader says it is done, because its buffer may
 * change after that. All ranks choose alike: rank 0 set the ranges for everyone at init (shm.c, direct_ranges:
 * none unless every rank can read the others' memory; with more ranks than cores, alltoall's only), and the sizes
 * compared with them are the same on every rank (allgatherv) or learned from every rank's step 0 (alltoallv).
 * docs/architecture.md, "Single copy", has the measurements behind the ranges. */

static int use_direct(const t3d_shm_t *s, size_t block) {
  return s->direct_min != 0 && block >= s->direct_min && block <= s->direct_max;
}

static int use_a2a_direct(const t3d_shm_t *s, size_t block) {
  return s->a2a_direct_min != 0 && block >= s->a2a_direct_min && block <= s->a2a_direct_max;
}

/* Copies len bytes at addr in rank p's process (pid) into dst. */
static t3d_result_t read_peer(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, void *dst, uint64_t addr, size_t len) {
  int err = len > 0 ? t3d__shm_cma_read(s->pid, pid, dst, addr, len) : 0;
  if (err == 0) return T3D_OK;
  if (err == ESRCH) { /* the owner's process is gone */
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d's process (pid %d) "
             "is gone", ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, p, pid);
    return T3D_ERR_PEER_LOST;
  }
  snprintf(ex->error, sizeof ex->error,
           "t3d: %s #%llu on group '%s' (rank %d of %d): reading %zu bytes from rank %d's memory (process_vm_readv) "
           "failed: %s; T3D_SHM_DIRECT_BYTES=0 copies through shared memory instead",
           ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, len, p, strerror(err));
  return T3D_ERR_SYSTEM;
}

/* The end of a single-copy step on this rank, whose reads ended with res: posts `done` (also after a failed read:
 * the owners then need not wait for their deadline), then waits until every rank has posted it, so that nobody
 * reads this rank's buffer any more when the call returns, even a failed one. The first error wins. */
static t3d_result_t direct_end(t3d_shm_t *s, t3d_exec_t *ex, uint64_t done, t3d_result_t res) {
  t3d__shm_post(s, done);
  if (res == T3D_OK) return t3d__shm_wait(s, ex, -1, done);
  char first[sizeof ex->error];
  memcpy(first, ex->error, sizeof first);
  (void)t3d__shm_wait(s, ex, -1, done);
  memcpy(ex->error, first, sizeof first);
  return res;
}

/* ---------- allreduce and reduce ---------- */

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
  t3d_shm_info_t *in = t3d__shm_info(s, s->rank, st->h);
  /* The root of a reduce reads its own input in place; everybody else publishes it. */
  if (root != s->rank) {
    T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
    if (oneshot_mode(bytes) == ONESHOT_INLINE) {
      in->kind = (uint64_t)kind;
      in->sig = bytes;
      memcpy(t3d__shm_inline_data(s, s->rank, st->h), sendbuf, bytes);
    } else {
      t3d__shm_put_info(s, st, kind, bytes, 0);
      memcpy(t3d__shm_half(s, s->rank, st->h), sendbuf, bytes);
    }
  }
  if (root >= 0 && root != s->rank) {
    /* A non-root of a reduce has nothing to read: it is done with the step, and returns. */
    atomic_store_explicit(&in->seq, st->base + 1, memory_order_release);
    t3d__shm_post(s, st->base + 2);
    return T3D_OK;
  }
  /* Without the fence: this rank waits for its peers next, while the stores leave its core; the fold's post (or
   * t3d__shm_sleep, if it blocks first) checks for sleepers. */
  t3d__shm_post_lazy(s, st->base + 1);
  if (root != s->rank) atomic_store_explicit(&in->seq, st->base + 1, memory_order_release);
  return T3D_OK;
}

static t3d_result_t oneshot_fold(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const void *sendbuf,
                                 void *recvbuf, size_t count, t3d_dtype_t dt, t3d_redop_t op, int kind) {
  int n = s->size, me = s->rank;
  size_t bytes = count * t3d_dtype_size(dt);
  t3d_shm_arrival_t a = {st->h, st->base + 1};
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

/* Whether the half the next step uses is free now (every rank past its previous use): the inline starts never wait
 * for it. */
static int next_half_free(t3d_shm_t *s) { return t3d__shm_all_past(s, s->free_at[s->step & 1]); }

/* The same for the next small slot. */
static int next_small_free(t3d_shm_t *s) {
  return t3d__shm_all_past(s, s->free_small[s->small_steps % T3D_SHM_SMALL_SLOTS]);
}

int t3d__shm_oneshot_fits(t3d_shm_t *s, size_t bytes) { return bytes <= s->oneshot_max && next_half_free(s); }

void t3d__shm_oneshot_warm(t3d_shm_t *s, size_t bytes) {
  if (bytes > s->oneshot_max) return;
  int h = (int)(s->step & 1);
  prefetch_write(t3d__shm_info(s, s->rank, h));
  const char *half = t3d__shm_half(s, s->rank, h);
  for (size_t off = 0; oneshot_mode(bytes) == ONESHOT_HALF && off < bytes && off < 4 * 64; off += 64)
    prefetch_write(half + off);
}

t3d_result_t t3d__shm_oneshot_start(t3d_exec_t *ex, const void *sendbuf, size_t bytes, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  T3D_CHECK(oneshot_publish(s, ex, sendbuf, bytes, -1, T3D_OP_ALLREDUCE, &st));
  rs->h = st.h;
  rs->base = st.base;
  rs->bytes = bytes;
  return T3D_OK;
}

t3d_result_t t3d__shm_start_wait(t3d_exec_t *ex, const t3d_shm_resume_t *rs, int who, uint64_t until) {
  /* Only a one-shot's start (rs->bytes set) looks beyond the flags: the other starts would pay a miss on a line
   * that never says more. */
  t3d_shm_t *s = t3d__exec_shm(ex);
  if (rs->bytes == 0) return t3d__shm_wait_line(s, ex, who, rs->base + 1, until, NULL);
  t3d_shm_arrival_t a = {rs->h, rs->base + 1};
  return t3d__shm_wait_line(s, ex, who, rs->base + 1, until, &a);
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
  *lo = min_sz((size_t)q * sl, m);
  *hi = min_sz(*lo + sl, m);
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
  int nt = s->nt && count * es >= s->nt_min;
  for (size_t off = 0; off < count; off += per) {
    size_t m = min_sz(per, count - off);
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
      memcpy(mine + lo * es, sb + (off + lo) * es, (hi - lo) * es);
    }
    t3d__shm_post(s, st.base + 1);
    T3D_CHECK(t3d__shm_wait(s, ex, -1, st.base + 1));
    if (off == 0) T3D_CHECK(check_all_info(s, ex, &st, kind, count * es));
    size_t lo, hi;
    slice_bounds(m, sl, me, &lo, &hi);
    for (int p = 0; p < n; p++) s->srcs[p] = p == me ? sb + (off + lo) * es : t3d__shm_half(s, p, st.h) + lo * es;
    t3d__shm_reduce_n(mine + lo * es, collect ? rb + (off + lo) * es : NULL, s->srcs, n, hi - lo, dt, op, nt);
    if (!collect) {
      t3d__shm_post(s, st.base + 3);
      continue;
    }
    t3d__shm_post(s, st.base + 2);
    slice_copy_t c = {s, st.h, nt, rb + off * es, es, m, sl};
    T3D_CHECK(t3d__shm_wait_each(s, ex, st.base + 2, copy_slice_out, &c));
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

/* ---------- reduce_scatterv ---------- */

/* Step k carries piece k (P elements) of every block: rank p writes its piece for owner q at q * P of its half, and
 * q folds the pieces of all ranks in rank order into its output. */
/* Where a reduce_scatterv's blocks are and how the own block is read, set up by rs_layout. */
typedef struct {
  const size_t *counts;
  size_t es, total, maxc, P;
  int own_direct; /* the own block is folded straight from sendbuf (not copied into the half) */
} rs_layout_t;

/* Elements of each block one step carries: a line-aligned share of the half per owner. */
static size_t rs_piece(const t3d_shm_t *s, size_t es) { return s->half / (size_t)s->size / 64 * 64 / es; }

static void rs_layout(t3d_shm_t *s, const size_t *counts, t3d_dtype_t dt, int own_direct, rs_layout_t *l) {
  l->counts = counts;
  l->es = t3d_dtype_size(dt);
  l->total = l->maxc = 0;
  for (int q = 0; q < s->size; q++) {
    s->offs[q] = l->total;
    l->total += counts[q];
    if (counts[q] > l->maxc) l->maxc = counts[q];
  }
  l->P = rs_piece(s, l->es);
  l->own_direct = own_direct;
}

/* Step begun: writes piece [lo, lo + P) of every block into this rank's half and posts phase 1. */
static t3d_result_t rs_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const rs_layout_t *l,
                               const char *sb, size_t lo) {
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  if (lo == 0) t3d__shm_put_info(s, st, T3D_OP_REDUCE_SCATTERV, l->total * l->es, 0);
  char *half = t3d__shm_half(s, s->rank, st->h);
  for (int q = 0; q < s->size; q++) {
    if ((q == s->rank && l->own_direct) || lo >= l->counts[q]) continue;
    memcpy(half + (size_t)q * l->P * l->es, sb + (s->offs[q] + lo) * l->es,
           min_sz(l->P, l->counts[q] - lo) * l->es);
  }
  t3d__shm_post(s, st->base + 1);
  return T3D_OK;
}

/* Folds piece lo of this rank's block from every rank's half (when it has one) into rb + lo, then posts phase 2. */
static t3d_result_t rs_fold(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const rs_layout_t *l,
                            const char *sb, char *rb, size_t lo, t3d_dtype_t dt, t3d_redop_t op) {
  int me = s->rank;
  if (lo < l->counts[me]) {
    T3D_CHECK(t3d__shm_wait(s, ex, -1, st->base + 1));
    if (lo == 0) T3D_CHECK(check_all_info(s, ex, st, T3D_OP_REDUCE_SCATTERV, l->total * l->es));
    for (int p = 0; p < s->size; p++) {
      s->srcs[p] = (p == me && l->own_direct) ? sb + (s->offs[me] + lo) * l->es
                                               : t3d__shm_half(s, p, st->h) + (size_t)me * l->P * l->es;
    }
    t3d__shm_reduce_n(rb + lo * l->es, NULL, s->srcs, s->size, min_sz(l->P, l->counts[me] - lo), dt, op, 0);
  }
  t3d__shm_post(s, st->base + 2);
  return T3D_OK;
}

t3d_result_t t3d__shm_reduce_scatterv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                      t3d_dtype_t dt, t3d_redop_t op) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  int me = s->rank;
  size_t es = t3d_dtype_size(dt), total = 0;
  for (int q = 0; q < s->size; q++) total += counts[q];
  if (total == 0) return T3D_OK;
  const char *sb = sendbuf;
  char *rb = recvbuf, *scratch = NULL;
  size_t mine = counts[me] * es, below = 0;
  for (int q = 0; q < me; q++) below += counts[q];
  /* Step k writes output [kP, (k+1)P) after reading every piece k: safe when the output is the input's start or
   * the own block (what is overwritten was read at step k or before). Other overlaps go through scratch. */
  int ov = t3d__overlap(sb, total * es, rb, mine);
  rs_layout_t l;
  rs_layout(s, counts, dt, !ov || rb == sb + below * es, &l);
  if (ov && rb != sb && rb != sb + below * es) {
    scratch = malloc(mine);
    if (scratch == NULL) return T3D_ERR_NO_MEMORY;
    rb = scratch;
  }
  t3d_result_t res = T3D_OK;
  for (size_t lo = 0; lo < l.maxc; lo += l.P) {
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK_GOTO(rs_publish(s, ex, &st, &l, sb, lo), res, out);
    T3D_CHECK_GOTO(rs_fold(s, ex, &st, &l, sb, rb, lo, dt, op), res, out);
  }
  if (scratch != NULL) memcpy(recvbuf, scratch, mine);
out:
  free(scratch);
  return res;
}

/* A reduce_scatterv in one step, in parts, when the output does not overlap the input (no scratch). */
int t3d__shm_rs_fits(t3d_shm_t *s, size_t total_bytes, size_t max_block_bytes, size_t es) {
  return total_bytes > 0 && max_block_bytes <= rs_piece(s, es) * es && next_half_free(s);
}

t3d_result_t t3d__shm_rs_start(t3d_exec_t *ex, const void *sendbuf, const size_t *counts, t3d_dtype_t dt,
                               t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs_layout_t l;
  rs_layout(s, counts, dt, 1, &l);
  t3d_shm_step_t st;
  t3d__shm_step_begin(s, 2, &st);
  rs->h = st.h;
  rs->base = st.base;
  return rs_publish(s, ex, &st, &l, sendbuf, 0);
}

t3d_result_t t3d__shm_rs_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf, void *recvbuf,
                                const size_t *counts, t3d_dtype_t dt, t3d_redop_t op) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs_layout_t l;
  rs_layout(s, counts, dt, 1, &l);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  return rs_fold(s, ex, &st, &l, sendbuf, recvbuf, 0, dt, op);
}

/* ---------- broadcast ---------- */

/* A small broadcast takes one step in the next small slot (a root may then run T3D_SHM_SMALL_SLOTS broadcasts
 * ahead of its slowest reader instead of two); a larger one steps through the halves. */
static void bcast_step_begin(t3d_shm_t *s, size_t bytes, t3d_shm_step_t *st) {
  if (bytes <= T3D_SHM_SMALL_BYTES) t3d__shm_step_begin_small(s, 2, st);
  else t3d__shm_step_begin(s, 2, st);
}

t3d_result_t t3d__shm_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  char *b = buf;
  int nt = s->nt && bytes >= s->nt_min;
  for (size_t lo = 0; lo < bytes; lo += s->half) {
    size_t len = min_sz(s->half, bytes - lo);
    t3d_shm_step_t st;
    bcast_step_begin(s, bytes, &st);
    if (s->rank == root) {
      T3D_CHECK(t3d__shm_step_acquire(s, ex, &st));
      if (lo == 0) t3d__shm_put_info(s, &st, T3D_OP_BROADCAST, bytes, 0);
      memcpy(t3d__shm_half(s, root, st.h), b + lo, len);
    } else {
      T3D_CHECK(t3d__shm_wait(s, ex, root, st.base + 1));
      if (lo == 0) T3D_CHECK(t3d__shm_check_info(s, ex, &st, root, T3D_OP_BROADCAST, bytes));
      t3d__shm_copy(b + lo, t3d__shm_half(s, root, st.h), len, nt);
    }
    t3d__shm_post(s, st.base + 2);
  }
  return T3D_OK;
}

/* A broadcast that fits one half, in parts: the root publishes and is done; the others wait for it, then copy out.
 * The same steps as t3d__shm_broadcast, so ranks that take either path agree. */
/* The root of a small broadcast: the lines of the next small slot (as t3d__shm_oneshot_warm). Measured, 2 ranks:
 * 128 B-512 B 0.42-0.46 -> 0.38-0.41 us, 2 KiB 0.74 -> 0.60 us. */
void t3d__shm_bcast_warm(t3d_shm_t *s, size_t bytes) {
  if (bytes == 0 || bytes > T3D_SHM_SMALL_BYTES) return;
  int h = 2 + (int)(s->small_steps % T3D_SHM_SMALL_SLOTS);
  prefetch_write(t3d__shm_info(s, s->rank, h));
  const char *slot = t3d__shm_half(s, s->rank, h);
  for (size_t off = 0; off < bytes && off < 4 * 64; off += 64) prefetch_write(slot + off);
}

int t3d__shm_bcast_fits(t3d_shm_t *s, size_t bytes, int root) {
  if (bytes == 0 || bytes > s->half) return 0;
  return root != s->rank || (bytes <= T3D_SHM_SMALL_BYTES ? next_small_free(s) : next_half_free(s));
}

t3d_result_t t3d__shm_bcast_start(t3d_exec_t *ex, const void *buf, size_t bytes, int root, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  bcast_step_begin(s, bytes, &st);
  rs->h = st.h;
  rs->base = st.base;
  if (s->rank != root) return T3D_OK;
  T3D_CHECK(t3d__shm_step_acquire(s, ex, &st)); /* free: t3d__shm_bcast_fits checked */
  t3d__shm_put_info(s, &st, T3D_OP_BROADCAST, bytes, 0);
  memcpy(t3d__shm_half(s, root, st.h), buf, bytes);
  t3d__shm_post(s, st.base + 2);
  return T3D_OK;
}

t3d_result_t t3d__shm_bcast_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, void *buf, size_t bytes, int root) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  T3D_CHECK(t3d__shm_wait(s, ex, root, st.base + 1));
  T3D_CHECK(t3d__shm_check_info(s, ex, &st, root, T3D_OP_BROADCAST, bytes));
  memcpy(buf, t3d__shm_half(s, root, st.h), bytes);
  t3d__shm_post(s, st.base + 2);
  return T3D_OK;
}

/* ---------- allgatherv ---------- */

/* Blocks are counts[p] * es bytes at displs[p] * es: the queued path passes bytes (es 1), the inline one the
 * request's element counts. */
typedef struct {
  t3d_shm_t *s;
  t3d_exec_t *ex;
  const t3d_shm_step_t *st;
  char *rb;
  const size_t *counts, *displs;
  size_t es, lo, total;
  int nt, direct; /* direct: read the block from the owner's buffer (single copy) */
  t3d_result_t res;
} gather_ctx_t;

static void gather_from(void *arg, int p) {
  gather_ctx_t *c = arg;
  size_t blk = c->counts[p] * c->es;
  if (c->lo == 0 && c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_ALLGATHERV, c->total);
  if (c->res != T3D_OK || c->lo >= blk) return;
  if (c->direct) {
    const t3d_shm_info_t *in = t3d__shm_info(c->s, p, c->st->h);
    c->res = read_peer(c->s, c->ex, p, (int)in->pid, c->rb + c->displs[p] * c->es, in->addr, blk);
    return;
  }
  t3d__shm_copy(c->rb + c->displs[p] * c->es + c->lo, t3d__shm_half(c->s, p, c->st->h),
                min_sz(c->s->half, blk - c->lo), c->nt);
}

static size_t gather_total(int n, const size_t *counts, size_t es, size_t *maxb) {
  size_t total = 0;
  *maxb = 0;
  for (int p = 0; p < n; p++) {
    total += counts[p] * es;
    if (counts[p] * es > *maxb) *maxb = counts[p] * es;
  }
  return total;
}

/* In place (sendbuf NULL, equal to recvbuf, or already our block): the block is where it belongs. */
static char *gather_own(t3d_shm_t *s, const void *sendbuf, void *recvbuf, size_t mine, size_t displ) {
  char *own = (char *)recvbuf + displ;
  if (sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own && mine > 0) memmove(own, sendbuf, mine);
  return own;
}

/* Step begun: writes this rank's piece [lo, lo + half) of its block into its half and posts phase 1. */
static t3d_result_t gather_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *own,
                                   size_t mine, size_t lo, size_t total) {
  if (lo == 0 || lo < mine) {
    T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
    if (lo == 0) t3d__shm_put_info(s, st, T3D_OP_ALLGATHERV, total, 0);
    if (lo < mine) memcpy(t3d__shm_half(s, s->rank, st->h), own + lo, min_sz(s->half, mine - lo));
  }
  t3d__shm_post(s, st->base + 1);
  return T3D_OK;
}

/* Copies every peer's piece as soon as it is there, then posts phase 2. */
static t3d_result_t gather_collect(gather_ctx_t *c) {
  T3D_CHECK(t3d__shm_wait_each(c->s, c->ex, c->st->base + 1, gather_from, c));
  T3D_CHECK(c->res);
  t3d__shm_post(c->s, c->st->base + 2);
  return T3D_OK;
}

static gather_ctx_t gather_ctx(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *recvbuf,
                               const size_t *counts, const size_t *displs, size_t es, size_t lo, size_t total) {
  gather_ctx_t c = {s, ex, st, recvbuf, counts, displs, es, lo, total, s->nt && total >= s->nt_min, 0, T3D_OK};
  return c;
}

/* Single copy: one step in which every rank reads every other block from its owner, in two parts (the inline start
 * runs the first on the caller's thread). Publish: say where this rank's block is and post; the peers read the
 * input where it is while this rank copies it into place, unless it overlaps the output: then it is moved first
 * and read from there. */
static t3d_result_t gather_direct_publish(t3d_shm_t *s, t3d_exec_t *ex, t3d_shm_step_t *st, const void *sendbuf,
                                          void *recvbuf, const size_t *counts, const size_t *displs, size_t es,
                                          size_t total) {
  size_t mine = counts[s->rank] * es, extent = 0;
  for (int p = 0; p < s->size; p++) {
    if ((displs[p] + counts[p]) * es > extent) extent = (displs[p] + counts[p]) * es;
  }
  int apart = sendbuf != NULL && sendbuf != recvbuf && !t3d__overlap(sendbuf, mine, recvbuf, extent);
  const char *src = apart ? sendbuf : gather_own(s, sendbuf, recvbuf, mine, displs[s->rank] * es);
  t3d__shm_step_begin(s, 2, st);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  t3d__shm_put_info(s, st, T3D_OP_ALLGATHERV, total, 0);
  t3d__shm_put_addr(s, st, src);
  t3d__shm_post(s, st->base + 1);
  if (apart && mine > 0) memcpy((char *)recvbuf + displs[s->rank] * es, sendbuf, mine);
  return T3D_OK;
}

/* Collect: read every other block as soon as its owner has posted, then wait until every rank has read this
 * rank's block (direct_end). */
static t3d_result_t gather_direct_collect(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *recvbuf,
                                          const size_t *counts, const size_t *displs, size_t es, size_t total) {
  gather_ctx_t c = gather_ctx(s, ex, st, recvbuf, counts, displs, es, 0, total);
  c.direct = 1;
  T3D_CHECK(t3d__shm_wait_each(s, ex, st->base + 1, gather_from, &c));
  return direct_end(s, ex, st->base + 2, c.res);
}

t3d_result_t t3d__shm_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                 const size_t *displs_bytes) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t maxb, total = gather_total(s->size, bytes, 1, &maxb);
  if (total == 0) return T3D_OK;
  size_t mine = bytes[s->rank];
  if (use_direct(s, maxb)) {
    t3d_shm_step_t st;
    T3D_CHECK(gather_direct_publish(s, ex, &st, sendbuf, recvbuf, bytes, displs_bytes, 1, total));
    return gather_direct_collect(s, ex, &st, recvbuf, bytes, displs_bytes, 1, total);
  }
  const char *own = gather_own(s, sendbuf, recvbuf, mine, displs_bytes[s->rank]);
  for (size_t lo = 0; lo < maxb; lo += s->half) {
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK(gather_publish(s, ex, &st, own, mine, lo, total));
    gather_ctx_t c = gather_ctx(s, ex, &st, recvbuf, bytes, displs_bytes, 1, lo, total);
    T3D_CHECK(gather_collect(&c));
  }
  return T3D_OK;
}

/* An allgatherv whose blocks each fit one half or are read from their owners, in parts (one step of the loop
 * above, or the single-copy step). */
int t3d__shm_gather_fits(t3d_shm_t *s, size_t total_bytes, size_t max_block_bytes) {
  return total_bytes > 0 && (max_block_bytes <= s->half || use_direct(s, max_block_bytes)) && next_half_free(s);
}

t3d_result_t t3d__shm_gather_start(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                   const size_t *displs, size_t es, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t maxb, total = gather_total(s->size, counts, es, &maxb);
  t3d_shm_step_t st;
  t3d_result_t res;
  if (use_direct(s, maxb)) {
    res = gather_direct_publish(s, ex, &st, sendbuf, recvbuf, counts, displs, es, total);
  } else {
    size_t mine = counts[s->rank] * es;
    const char *own = gather_own(s, sendbuf, recvbuf, mine, displs[s->rank] * es);
    t3d__shm_step_begin(s, 2, &st);
    res = gather_publish(s, ex, &st, own, mine, 0, total);
  }
  rs->h = st.h;
  rs->base = st.base;
  return res;
}

t3d_result_t t3d__shm_gather_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, void *recvbuf, const size_t *counts,
                                    const size_t *displs, size_t es) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t maxb, total = gather_total(s->size, counts, es, &maxb);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  if (use_direct(s, maxb)) return gather_direct_collect(s, ex, &st, recvbuf, counts, displs, es, total);
  gather_ctx_t c = gather_ctx(s, ex, &st, recvbuf, counts, displs, es, 0, total);
  return gather_collect(&c);
}

/* ---------- alltoallv ---------- */

typedef struct {
  t3d_shm_t *s;
  t3d_exec_t *ex;
  const t3d_shm_step_t *st;
  char *rb;
  const size_t *rcounts, *rdispls;
  size_t es, lo, piece, gmax;
  int nt;
  t3d_result_t res;
} a2a_ctx_t;

/* Step 0 of an alltoallv also carries, after the pieces of rank p's half, p's table: for each receiver q, where
 * p's block for q is in p's process and its length ({addr, bytes} as two words). */
static uint64_t *a2a_table(const t3d_shm_t *s, int p, int h, size_t piece) {
  return (uint64_t *)(void *)(t3d__shm_half(s, p, h) + (size_t)s->size * piece);
}

/* Step 0: what rank p's table says about p's block for this rank, which must have the length this rank expects. */
static t3d_result_t a2a_learn(a2a_ctx_t *c, int p, size_t blk) {
  t3d_shm_t *s = c->s;
  const uint64_t *ent = a2a_table(s, p, c->st->h, c->piece) + 2 * (size_t)s->rank;
  s->raddr[p] = ent[0];
  s->rpid[p] = (int)t3d__shm_info(s, p, c->st->h)->pid;
  if (ent[1] == blk) return T3D_OK;
  t3d_exec_t *ex = c->ex;
  snprintf(ex->error, sizeof ex->error,
           "t3d: %s #%llu on group '%s' (rank %d of %d): rank %d sends %llu bytes to this rank, which expects %zu "
           "(ranks disagree on the split sizes)", ex->opname, (unsigned long long)ex->seq, ex->comm->name, ex->rank,
           ex->size, p, (unsigned long long)ent[1], blk);
  return T3D_ERR_MISMATCH;
}

static void a2a_from(void *arg, int p) {
  a2a_ctx_t *c = arg;
  size_t blk = c->rcounts[p] * c->es;
  if (c->lo == 0) {
    if (c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_ALLTOALLV, 0);
    if (c->res == T3D_OK) c->res = a2a_learn(c, p, blk);
    const t3d_shm_info_t *in = t3d__shm_info(c->s, p, c->st->h);
    if (in->aux > c->gmax) c->gmax = in->aux;
  }
  if (c->res != T3D_OK || c->lo >= blk) return;
  t3d__shm_copy(c->rb + c->rdispls[p] * c->es + c->lo,
                t3d__shm_half(c->s, p, c->st->h) + (size_t)c->s->rank * c->piece, min_sz(c->piece, blk - c->lo),
                c->nt);
}

/* Step k carries piece k (one line-aligned share of the half, less the table) of every block: rank p writes its
 * piece for q at offset q * piece of its half, and q copies it out. The number of steps is set by the largest block
 * any rank sends, which every rank learns from the others' step-0 info; past step 0, blocks large enough for single
 * copy are read from their owners instead. */
static size_t a2a_piece(const t3d_shm_t *s) {
  return (s->half - (size_t)s->size * 2 * sizeof(uint64_t)) / (size_t)s->size / 64 * 64;
}

/* Largest block this rank sends to another rank, in bytes. */
static size_t a2a_local_max(int n, int me, const size_t *scounts, size_t es) {
  size_t m = 0;
  for (int q = 0; q < n; q++) {
    if (q != me && scounts[q] * es > m) m = scounts[q] * es;
  }
  return m;
}

/* Step begun: writes this rank's piece [lo, lo + piece) of every block into its half and posts phase 1. */
static t3d_result_t a2a_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *sb,
                                size_t sbias, const size_t *scounts, const size_t *sdispls, size_t es, size_t lo,
                                size_t local_max) {
  size_t piece = a2a_piece(s);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  char *half = t3d__shm_half(s, s->rank, st->h);
  if (lo == 0) {
    t3d__shm_put_info(s, st, T3D_OP_ALLTOALLV, 0, local_max);
    uint64_t *table = a2a_table(s, s->rank, st->h, piece);
    for (int q = 0; q < s->size; q++) {
      table[2 * q] = (uint64_t)(uintptr_t)(sb + (sdispls[q] * es - sbias));
      table[2 * q + 1] = scounts[q] * es;
    }
  }
  for (int q = 0; q < s->size; q++) {
    size_t blk = scounts[q] * es;
    if (q == s->rank || lo >= blk) continue;
    memcpy(half + (size_t)q * piece, sb + (sdispls[q] * es - sbias) + lo, min_sz(piece, blk - lo));
  }
  t3d__shm_post(s, st->base + 1);
  return T3D_OK;
}

/* Copies every peer's piece for this rank as soon as it is there, then posts phase 2. */
static t3d_result_t a2a_collect(a2a_ctx_t *c) {
  T3D_CHECK(t3d__shm_wait_each(c->s, c->ex, c->st->base + 1, a2a_from, c));
  T3D_CHECK(c->res);
  t3d__shm_post(c->s, c->st->base + 2);
  return T3D_OK;
}

static a2a_ctx_t a2a_ctx(t3d_shm_t *s, t3d_exec_t *ex, void *recvbuf, const size_t *scounts, const size_t *rcounts,
                         const size_t *rdispls, size_t es) {
  size_t total = 0;
  for (int q = 0; q < s->size; q++) total += (scounts[q] + rcounts[q]) * es;
  /* gmax starts at this rank's own largest block: the peers' step-0 infos only tell theirs. */
  size_t gmax = a2a_local_max(s->size, s->rank, scounts, es);
  a2a_ctx_t c = {s, ex, NULL, recvbuf, rcounts, rdispls, es, 0, a2a_piece(s), gmax,
                 s->nt && total / 2 * (size_t)s->size >= s->nt_min, T3D_OK};
  return c;
}

static t3d_result_t a2a_check_self(t3d_exec_t *ex, const size_t *scounts, const size_t *rcounts, size_t es) {
  int me = ex->rank;
  if (scounts[me] == rcounts[me]) return T3D_OK;
  snprintf(ex->error, sizeof ex->error,
           "t3d: %s #%llu on group '%s' (rank %d of %d): sends %zu bytes to itself but expects %zu", ex->opname,
           (unsigned long long)ex->seq, ex->comm->name, me, ex->size, scounts[me] * es, rcounts[me] * es);
  return T3D_ERR_MISMATCH;
}

/* Single copy of what step 0 left: every block's bytes from lo on, read from its owner at the address its table
 * gave. The end of reading is a phase of its own (no step: the halves are not used). */
static t3d_result_t a2a_direct_rest(a2a_ctx_t *c, size_t lo) {
  t3d_shm_t *s = c->s;
  t3d_result_t res = T3D_OK;
  for (int i = 1; i < s->size && res == T3D_OK; i++) {
    int p = (s->rank + i) % s->size;
    size_t blk = c->rcounts[p] * c->es;
    if (blk > lo) res = read_peer(s, c->ex, p, s->rpid[p], c->rb + c->rdispls[p] * c->es + lo, s->raddr[p] + lo,
                                  blk - lo);
  }
  return direct_end(s, c->ex, ++s->phase, res);
}

/* Steps from `from` on (step 0 is published and collected by the caller when from > 0), then this rank's own
 * block. */
static t3d_result_t a2a_steps(a2a_ctx_t *c, size_t from, const char *sb, size_t sbias, const size_t *scounts,
                              const size_t *sdispls) {
  t3d_shm_t *s = c->s;
  int me = s->rank;
  size_t es = c->es, local_max = a2a_local_max(s->size, me, scounts, es);
  for (size_t lo = from; lo == 0 || lo < c->gmax; lo += c->piece) {
    if (lo > 0 && use_a2a_direct(s, c->gmax)) {
      T3D_CHECK(a2a_direct_rest(c, lo));
      break;
    }
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK(a2a_publish(s, c->ex, &st, sb, sbias, scounts, sdispls, es, lo, local_max));
    c->st = &st;
    c->lo = lo;
    T3D_CHECK(a2a_collect(c));
  }
  char *own_dst = c->rb + c->rdispls[me] * es;
  const char *own_src = sb + (sdispls[me] * es - sbias);
  if (scounts[me] > 0 && own_dst != own_src) memmove(own_dst, own_src, scounts[me] * es);
  return T3D_OK;
}

/* Single copy of equal blocks (t3d_alltoall): every rank knows every block's size up front, so the whole exchange
 * is one step: publish where block 0 of the send buffer is, read this rank's block from every peer as soon as it
 * has published, say so, move the own block, and wait until every peer has read. */
typedef struct {
  t3d_shm_t *s;
  t3d_exec_t *ex;
  const t3d_shm_step_t *st;
  char *rb;
  size_t blk;
  t3d_result_t res;
} a2a_equal_t;

static void a2a_equal_from(void *arg, int p) {
  a2a_equal_t *c = arg;
  if (c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_ALLTOALLV, c->blk);
  if (c->res != T3D_OK) return;
  const t3d_shm_info_t *in = t3d__shm_info(c->s, p, c->st->h);
  uint64_t at = in->addr + (uint64_t)c->s->rank * c->blk;
  c->res = read_peer(c->s, c->ex, p, (int)in->pid, c->rb + (size_t)p * c->blk, at, c->blk);
}

/* Whether an alltoall takes that path: equal blocks in the single-copy range, with peers to read from. */
static int a2a_equal_direct(const t3d_shm_t *s, int equal, size_t blk) {
  return equal && s->size > 1 && use_a2a_direct(s, blk);
}

/* Its two parts (the inline start runs the first on the caller's thread): publish where block 0 is, then read. */
static t3d_result_t a2a_equal_publish(t3d_shm_t *s, t3d_exec_t *ex, t3d_shm_step_t *st, const char *block0,
                                      size_t blk) {
  t3d__shm_step_begin(s, 2, st);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  t3d__shm_put_info(s, st, T3D_OP_ALLTOALLV, blk, blk);
  t3d__shm_put_addr(s, st, block0);
  t3d__shm_post(s, st->base + 1);
  return T3D_OK;
}

static t3d_result_t a2a_equal_collect(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *block0,
                                      char *rb, size_t blk) {
  a2a_equal_t c = {s, ex, st, rb, blk, T3D_OK};
  T3D_CHECK(t3d__shm_wait_each(s, ex, st->base + 1, a2a_equal_from, &c));
  size_t own = (size_t)s->rank * blk;
  if (c.res == T3D_OK && rb + own != block0 + own) memmove(rb + own, block0 + own, blk);
  return direct_end(s, ex, st->base + 2, c.res);
}

t3d_result_t t3d__shm_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es, int equal) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  T3D_CHECK(a2a_check_self(ex, scounts, rcounts, es));
  /* Incoming blocks may overwrite outgoing ones that later steps still read: then send from a copy. */
  const char *sb;
  size_t sbias;
  void *copy;
  T3D_CHECK(t3d__alltoall_source(s->size, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, es, &sb, &sbias,
                                 &copy));
  t3d_result_t res;
  size_t blk = scounts[0] * es;
  if (a2a_equal_direct(s, equal, blk)) {
    const char *block0 = sb + (sdispls[0] * es - sbias);
    t3d_shm_step_t st;
    res = a2a_equal_publish(s, ex, &st, block0, blk);
    if (res == T3D_OK) res = a2a_equal_collect(s, ex, &st, block0, (char *)recvbuf + rdispls[0] * es, blk);
  } else {
    a2a_ctx_t c = a2a_ctx(s, ex, recvbuf, scounts, rcounts, rdispls, es);
    res = a2a_steps(&c, 0, sb, sbias, scounts, sdispls);
  }
  free(copy);
  return res;
}

/* In parts: step 0 (or the single-copy step of equal blocks) published by start, collected (and any further steps
 * run) by finish. The caller made sure that the receive blocks do not overlap the send blocks, so no copy of the
 * input is needed. */
int t3d__shm_a2a_fits(t3d_shm_t *s, size_t max_send_block_bytes, int equal) {
  if (max_send_block_bytes > a2a_piece(s) && !a2a_equal_direct(s, equal, max_send_block_bytes)) return 0;
  return next_half_free(s);
}

t3d_result_t t3d__shm_a2a_start(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                size_t es, int equal, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  t3d_result_t res;
  if (a2a_equal_direct(s, equal, scounts[0] * es)) {
    res = a2a_equal_publish(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, scounts[0] * es);
  } else {
    t3d__shm_step_begin(s, 2, &st);
    res = a2a_publish(s, ex, &st, sendbuf, 0, scounts, sdispls, es, 0, a2a_local_max(s->size, s->rank, scounts, es));
  }
  rs->h = st.h;
  rs->base = st.base;
  return res;
}

t3d_result_t t3d__shm_a2a_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf,
                                 const size_t *scounts, const size_t *sdispls, void *recvbuf, const size_t *rcounts,
                                 const size_t *rdispls, size_t es, int equal) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  if (a2a_equal_direct(s, equal, scounts[0] * es)) {
    return a2a_equal_collect(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, (char *)recvbuf + rdispls[0] * es,
                             scounts[0] * es);
  }
  a2a_ctx_t c = a2a_ctx(s, ex, recvbuf, scounts, rcounts, rdispls, es);
  c.st = &st;
  T3D_CHECK(a2a_collect(&c));
  return a2a_steps(&c, c.piece, sendbuf, 0, scounts, sdispls);
}

/* ---------- barrier ---------- */

t3d_result_t t3d__shm_barrier(t3d_exec_t *ex) {
  t3d_shm_resume_t rs;
  t3d__shm_barrier_start(ex, &rs);
  return t3d__shm_barrier_finish(ex, &rs);
}

void t3d__shm_barrier_start(t3d_exec_t *ex, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs->h = 0;
  rs->base = s->phase++; /* one phase: base + 1 */
  t3d__shm_post(s, rs->base + 1);
}

t3d_result_t t3d__shm_barrier_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs) {
  return t3d__shm_wait(t3d__exec_shm(ex), ex, -1, rs->base + 1);
}
