/* allgather.c: allgatherv over a communicator's shared-memory segment: every rank's block streams through its half
 * a step at a time, double-buffered, and the others copy it out; or, for large blocks between processes that may
 * read each other's memory, the others read it straight from the owner's buffer (single copy, direct.c). Also in
 * one step in parts, for the inline path. */
#include "shm.h"

#include <string.h>

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
  int inl;        /* the blocks travel in the info lines (gather_inline) */
  t3d_result_t res;
} gather_ctx_t;

static void gather_from(void *arg, int p) {
  gather_ctx_t *c = arg;
  size_t blk = c->counts[p] * c->es;
  if (c->lo == 0 && c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_ALLGATHERV, c->total);
  if (c->res != T3D_OK || c->lo >= blk) return;
  if (c->inl) {
    memcpy(c->rb + c->displs[p] * c->es, t3d__shm_inline_data(c->s, p, c->st->h), blk);
    return;
  }
  if (c->direct) {
    const t3d_shm_info_t *in = t3d__shm_info(c->s, p, c->st->h);
    c->res = t3d__shm_read_peer(c->s, c->ex, p, (int)in->pid, c->rb + c->displs[p] * c->es, in->addr, blk);
    return;
  }
  t3d__shm_copy(c->rb + c->displs[p] * c->es + c->lo, t3d__shm_half(c->s, p, c->st->h),
                t3d__shm_min_sz(c->s->half, blk - c->lo), c->nt);
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

/* Blocks of at most T3D_SHM_INLINE_DATA bytes each travel in their owner's info line, as a small one-shot
 * allreduce's vectors do (allreduce.c): a reader finds that the step is posted, what it is and the block in one
 * line. Every rank knows every block's size, so all decide alike. */
static int gather_inline(size_t maxb) { return maxb <= T3D_SHM_INLINE_DATA; }

/* Bytes of the output the blocks span. */
static size_t gather_extent(int n, const size_t *counts, const size_t *displs, size_t es) {
  size_t extent = 0;
  for (int p = 0; p < n; p++) {
    if ((displs[p] + counts[p]) * es > extent) extent = (displs[p] + counts[p]) * es;
  }
  return extent;
}

/* An input of `mine` bytes that shares no byte with the output (the blocks' extent): it can be read where it is
 * while the output is written. */
static int gather_apart(int n, const void *sendbuf, void *recvbuf, size_t mine, const size_t *counts,
                        const size_t *displs, size_t es) {
  if (sendbuf == NULL || sendbuf == recvbuf) return 0;
  return !t3d__overlap(sendbuf, mine, recvbuf, gather_extent(n, counts, displs, es));
}

/* In place (sendbuf NULL, equal to recvbuf, or already our block): the block is where it belongs. */
static char *gather_own(t3d_shm_t *s, const void *sendbuf, void *recvbuf, size_t mine, size_t displ) {
  char *own = (char *)recvbuf + displ;
  if (sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own && mine > 0) memmove(own, sendbuf, mine);
  return own;
}

/* Step begun: writes this rank's piece [lo, lo + half) of its block into its half (inl: its whole block into its
 * info line; far: with non-temporal stores, t3d__shm_far) and posts phase 1. */
static t3d_result_t gather_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *own,
                                   size_t mine, size_t lo, size_t total, int inl, int far) {
  if (inl) {
    T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
    t3d__shm_put_inline(s, st, T3D_OP_ALLGATHERV, total, own, mine);
    /* Without the fence, as the one-shot allreduce: gather_collect's post of phase 2 checks for sleepers. */
    t3d__shm_post_lazy(s, st->base + 1);
    t3d__shm_show_arrived(s, st);
    return T3D_OK;
  }
  if (lo == 0 || lo < mine) {
    T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
    if (lo == 0) t3d__shm_put_info(s, st, T3D_OP_ALLGATHERV, total, 0);
    if (lo < mine) t3d__shm_copy(t3d__shm_half(s, s->rank, st->h), own + lo, t3d__shm_min_sz(s->half, mine - lo), far);
  }
  t3d__shm_post_arrived(s, st);
  return T3D_OK;
}

/* Copies every peer's piece as soon as it is there, then posts phase 2. */
static t3d_result_t gather_collect(gather_ctx_t *c) {
  t3d_shm_arrival_t a = t3d__shm_arrival(c->st);
  T3D_CHECK(t3d__shm_wait_each(c->s, c->ex, c->st->base + 1, &a, gather_from, c));
  T3D_CHECK(c->res);
  t3d__shm_post(c->s, c->st->base + 2);
  return T3D_OK;
}

static gather_ctx_t gather_ctx(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *recvbuf,
                               const size_t *counts, const size_t *displs, size_t es, size_t lo, size_t total,
                               int inl) {
  gather_ctx_t c = {s, ex, st, recvbuf, counts, displs, es, lo, total, s->nt && total >= s->nt_min, 0, inl, T3D_OK};
  return c;
}

/* Single copy: one step in which every rank reads every other block from its owner, in two parts (the inline start
 * runs the first on the caller's thread). Publish: say where this rank's block is and post; the peers read the
 * input where it is while this rank copies it into place, unless it overlaps the output: then it is moved first
 * and read from there. */
static t3d_result_t gather_direct_publish(t3d_shm_t *s, t3d_exec_t *ex, t3d_shm_step_t *st, const void *sendbuf,
                                          void *recvbuf, const size_t *counts, const size_t *displs, size_t es,
                                          size_t total) {
  size_t mine = counts[s->rank] * es;
  int apart = gather_apart(s->size, sendbuf, recvbuf, mine, counts, displs, es);
  const char *src = apart ? sendbuf : gather_own(s, sendbuf, recvbuf, mine, displs[s->rank] * es);
  t3d__shm_step_begin(s, 2, st);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  t3d__shm_put_info(s, st, T3D_OP_ALLGATHERV, total, 0);
  t3d__shm_put_addr(s, st, src);
  t3d__shm_post(s, st->base + 1);
  /* The own block, copied while the peers read it: from T3D_SHM_NT_BYTES with non-temporal stores. Measured (2
   * ranks, t3d_bench_c -o allgather, eight alternating rounds, medians): 8 MiB (4 MiB blocks) 1.64 -> 1.35 ms; with
   * 2 MiB blocks they were slower (0.33 -> 0.38 ms), hence the block's size, not the total. */
  if (apart && mine > 0)
    t3d__shm_copy((char *)recvbuf + displs[s->rank] * es, sendbuf, mine, s->nt && mine >= s->nt_min);
  return T3D_OK;
}

/* Collect: read every other block as soon as its owner has posted, then wait until every rank has read this
 * rank's block (t3d__shm_direct_end). */
static t3d_result_t gather_direct_collect(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, void *recvbuf,
                                          const size_t *counts, const size_t *displs, size_t es, size_t total) {
  gather_ctx_t c = gather_ctx(s, ex, st, recvbuf, counts, displs, es, 0, total, 0);
  c.direct = 1;
  T3D_CHECK(t3d__shm_wait_each(s, ex, st->base + 1, NULL, gather_from, &c));
  return t3d__shm_direct_end(s, ex, st->base + 2, c.res);
}

t3d_result_t t3d__shm_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                 const size_t *displs_bytes) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t maxb, total = gather_total(s->size, bytes, 1, &maxb);
  if (total == 0) return T3D_OK;
  size_t mine = bytes[s->rank];
  if (t3d__shm_mapped_size(s, total) && t3d__equal_blocks(s->size, bytes, displs_bytes)) {
    int done = 0;
    T3D_CHECK(t3d__shm_mapped_allgather(s, ex, sendbuf, (char *)recvbuf + displs_bytes[0], bytes[0], &done));
    if (done) return T3D_OK;
  }
  if (t3d__shm_use_direct(s, maxb)) {
    t3d_shm_step_t st;
    T3D_CHECK(gather_direct_publish(s, ex, &st, sendbuf, recvbuf, bytes, displs_bytes, 1, total));
    return gather_direct_collect(s, ex, &st, recvbuf, bytes, displs_bytes, 1, total);
  }
  /* An input apart from the output goes into place a step at a time, right after the step's piece went into the
   * half, while it is still in the caches: read from memory once instead of twice (moved first, then published). */
  char *place = (char *)recvbuf + displs_bytes[s->rank];
  int apart = mine > 0 && gather_apart(s->size, sendbuf, recvbuf, mine, bytes, displs_bytes, 1);
  const char *own = apart ? sendbuf : gather_own(s, sendbuf, recvbuf, mine, displs_bytes[s->rank]);
  int far;
  T3D_CHECK(t3d__shm_far(s, ex, t3d__shm_probes(s, total), total, &far));
  for (size_t lo = 0; lo < maxb; lo += s->half) {
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK(gather_publish(s, ex, &st, own, mine, lo, total, gather_inline(maxb), far));
    gather_ctx_t c = gather_ctx(s, ex, &st, recvbuf, bytes, displs_bytes, 1, lo, total, gather_inline(maxb));
    if (apart && lo < mine) t3d__shm_copy(place + lo, own + lo, t3d__shm_min_sz(s->half, mine - lo), c.nt);
    T3D_CHECK(gather_collect(&c));
  }
  return T3D_OK;
}

/* An allgatherv whose blocks each fit one half or are read from their owners, in parts (one step of the loop
 * above, or the single-copy step). */
int t3d__shm_gather_fits(t3d_shm_t *s, size_t total_bytes, size_t max_block_bytes) {
  return total_bytes > 0 && !t3d__shm_mapped_size(s, total_bytes) && !t3d__shm_probes(s, total_bytes) &&
         (max_block_bytes <= s->half || t3d__shm_use_direct(s, max_block_bytes)) &&
         t3d__shm_next_half_free(s);
}

t3d_result_t t3d__shm_gather_start(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                   const size_t *displs, size_t es, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  size_t maxb, total = gather_total(s->size, counts, es, &maxb);
  t3d_shm_step_t st;
  t3d_result_t res;
  if (t3d__shm_use_direct(s, maxb)) {
    res = gather_direct_publish(s, ex, &st, sendbuf, recvbuf, counts, displs, es, total);
  } else {
    size_t mine = counts[s->rank] * es;
    const char *own = gather_own(s, sendbuf, recvbuf, mine, displs[s->rank] * es);
    t3d__shm_step_begin(s, 2, &st);
    res = gather_publish(s, ex, &st, own, mine, 0, total, gather_inline(maxb), 0);
    rs->by_line = 1;
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
  if (t3d__shm_use_direct(s, maxb)) return gather_direct_collect(s, ex, &st, recvbuf, counts, displs, es, total);
  gather_ctx_t c = gather_ctx(s, ex, &st, recvbuf, counts, displs, es, 0, total, gather_inline(maxb));
  return gather_collect(&c);
}
