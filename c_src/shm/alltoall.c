/* alltoall.c: alltoallv over a communicator's shared-memory segment: step k carries piece k of every block through
 * the sender's half, double-buffered, and each receiver copies its pieces out; past step 0, blocks in the
 * single-copy range are read straight from their owners (direct.c), and equal blocks (t3d_alltoall) in that range
 * take one single-copy step; equal blocks small enough travel in their sender's info line. Also in parts (step 0,
 * or the single-copy step, or the line), for the inline path. */
#include "shm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  t3d_shm_t *s;
  t3d_exec_t *ex;
  const t3d_shm_step_t *st;
  char *rb;
  const size_t *rcounts, *rdispls;
  size_t es, lo, piece, gmax;
  int nt;  /* copies out of the halves into the user's buffer: non-temporal */
  int far; /* writes into this rank's half: non-temporal (t3d__shm_far) */
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
                t3d__shm_half(c->s, p, c->st->h) + (size_t)c->s->rank * c->piece,
                t3d__shm_min_sz(c->piece, blk - c->lo), c->nt);
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

/* Step begun: writes this rank's piece [lo, lo + piece) of every block into its half (far: with non-temporal
 * stores) and posts phase 1. */
static t3d_result_t a2a_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *sb,
                                size_t sbias, const size_t *scounts, const size_t *sdispls, size_t es, size_t lo,
                                size_t local_max, int far) {
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
    t3d__shm_copy(half + (size_t)q * piece, sb + (sdispls[q] * es - sbias) + lo, t3d__shm_min_sz(piece, blk - lo), far);
  }
  t3d__shm_post_arrived(s, st);
  return T3D_OK;
}

/* Copies every peer's piece for this rank as soon as it is there, then posts phase 2. */
static t3d_result_t a2a_collect(a2a_ctx_t *c) {
  t3d_shm_arrival_t a = t3d__shm_arrival(c->st);
  T3D_CHECK(t3d__shm_wait_each(c->s, c->ex, c->st->base + 1, &a, a2a_from, c));
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
                 s->nt && total / 2 * (size_t)s->size >= s->nt_min, 0, T3D_OK};
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
    if (blk > lo) res = t3d__shm_read_peer(s, c->ex, p, s->rpid[p], c->rb + c->rdispls[p] * c->es + lo,
                                           s->raddr[p] + lo, blk - lo);
  }
  return t3d__shm_direct_end(s, c->ex, ++s->phase, res);
}

/* Steps from `from` on (step 0 is published and collected by the caller when from > 0), then this rank's own
 * block. */
static t3d_result_t a2a_steps(a2a_ctx_t *c, size_t from, const char *sb, size_t sbias, const size_t *scounts,
                              const size_t *sdispls) {
  t3d_shm_t *s = c->s;
  int me = s->rank;
  size_t es = c->es, local_max = a2a_local_max(s->size, me, scounts, es);
  for (size_t lo = from; lo == 0 || lo < c->gmax; lo += c->piece) {
    if (lo > 0 && t3d__shm_use_a2a_direct(s, c->gmax)) {
      T3D_CHECK(a2a_direct_rest(c, lo));
      break;
    }
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK(a2a_publish(s, c->ex, &st, sb, sbias, scounts, sdispls, es, lo, local_max, c->far));
    c->st = &st;
    c->lo = lo;
    T3D_CHECK(a2a_collect(c));
  }
  char *own_dst = c->rb + c->rdispls[me] * es;
  const char *own_src = sb + (sdispls[me] * es - sbias);
  /* The own block with the same stores as the copies out of the halves: glibc's memmove uses non-temporal ones
   * only past a share of the L3. Measured (2 ranks, t3d_bench_c -o alltoall, six alternating rounds, medians):
   * 32 and 64 MiB 0.78 of the time (64 MiB 12.8 -> 10.0 ms), 16 MiB 0.90, 8 and 128 MiB even. */
  size_t own = scounts[me] * es;
  if (own > 0 && own_dst != own_src) {
    if (c->nt && !t3d__overlap(own_dst, own, own_src, own)) t3d__shm_copy(own_dst, own_src, own, 1);
    else memmove(own_dst, own_src, own);
  }
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
  c->res = t3d__shm_read_peer(c->s, c->ex, p, (int)in->pid, c->rb + (size_t)p * c->blk, at, c->blk);
}

/* Whether an alltoall takes that path: equal blocks in the single-copy range, with peers to read from. */
static int a2a_equal_direct(const t3d_shm_t *s, int equal, size_t blk) {
  return equal && s->size > 1 && t3d__shm_use_a2a_direct(s, blk);
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
  T3D_CHECK(t3d__shm_wait_each(s, ex, st->base + 1, NULL, a2a_equal_from, &c));
  size_t own = (size_t)s->rank * blk;
  if (c.res == T3D_OK && rb + own != block0 + own) memmove(rb + own, block0 + own, blk);
  return t3d__shm_direct_end(s, ex, st->base + 2, c.res);
}

/* Equal blocks (t3d_alltoall) whose blocks for the others fit together in T3D_SHM_INLINE_DATA bytes travel in the
 * sender's info line, which receivers wait on anyway: one line crosses per peer instead of three (the info line,
 * the table and the piece). Up to A2A_PACKED_MAX bytes they lie packed at the start of the sender's half, after
 * the info line that says their size: no table (every rank was told the block size), one line fewer per peer.
 * Every rank chooses alike. Measured, C level, alternating builds (docs/benchmarks/alltoall-packed-c.txt): 2 ranks
 * near 128 B-16 KiB 1.1-1.3x faster (256 B 0.52 -> 0.40 us), 8 ranks on 2 cores 128 B-4 KiB 1.03-1.3x. */
#define A2A_PACKED_MAX 16384u

static int a2a_in_line(const t3d_shm_t *s, int equal, size_t blk) {
  return equal && s->size > 1 && (size_t)(s->size - 1) * blk <= T3D_SHM_INLINE_DATA;
}

/* Past the info line, not where single copy or a placement probe (which the steps' path takes) is asked for. */
static int a2a_packed(const t3d_shm_t *s, int equal, size_t blk) {
  if (a2a_in_line(s, equal, blk)) return 1;
  size_t others = (size_t)(s->size - 1) * blk;
  return equal && s->size > 1 && others <= A2A_PACKED_MAX && others <= s->half && !t3d__shm_use_a2a_direct(s, blk) &&
         !t3d__shm_probes(s, blk * (size_t)s->size);
}

/* Where rank p's blocks for the others are: its info line, or the start of its half. */
static char *a2a_packed_area(const t3d_shm_t *s, int p, int h, size_t blk) {
  return a2a_in_line(s, 1, blk) ? t3d__shm_inline_data(s, p, h) : t3d__shm_half(s, p, h);
}

/* Where rank p's block for q (q != p) is in that area: the blocks for the others, in rank order. */
static size_t a2a_line_at(int p, int q, size_t blk) { return (size_t)(q - (q > p)) * blk; }

static t3d_result_t a2a_packed_publish(t3d_shm_t *s, t3d_exec_t *ex, t3d_shm_step_t *st, const char *block0,
                                       size_t blk) {
  t3d__shm_step_begin(s, 2, st);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  if (a2a_in_line(s, 1, blk)) t3d__shm_put_inline(s, st, T3D_OP_ALLTOALLV, blk, NULL, 0);
  else t3d__shm_put_info(s, st, T3D_OP_ALLTOALLV, blk, blk);
  char *area = a2a_packed_area(s, s->rank, st->h, blk);
  for (int q = 0; q < s->size; q++) {
    if (q != s->rank) memcpy(area + a2a_line_at(s->rank, q, blk), block0 + (size_t)q * blk, blk);
  }
  t3d__shm_post_arrived(s, st);
  return T3D_OK;
}

static void a2a_packed_from(void *arg, int p) {
  a2a_equal_t *c = arg;
  if (c->res == T3D_OK) c->res = t3d__shm_check_info(c->s, c->ex, c->st, p, T3D_OP_ALLTOALLV, c->blk);
  if (c->res != T3D_OK) return;
  memcpy(c->rb + (size_t)p * c->blk, a2a_packed_area(c->s, p, c->st->h, c->blk) + a2a_line_at(p, c->s->rank, c->blk),
         c->blk);
}

static t3d_result_t a2a_packed_collect(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const char *block0,
                                       char *rb, size_t blk) {
  a2a_equal_t c = {s, ex, st, rb, blk, T3D_OK};
  t3d_shm_arrival_t a = t3d__shm_arrival(st);
  T3D_CHECK(t3d__shm_wait_each(s, ex, st->base + 1, &a, a2a_packed_from, &c));
  T3D_CHECK(c.res);
  size_t own = (size_t)s->rank * blk;
  if (rb + own != block0 + own) memmove(rb + own, block0 + own, blk);
  t3d__shm_post(s, st->base + 2);
  return T3D_OK;
}

t3d_result_t t3d__shm_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es, int equal) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  T3D_CHECK(a2a_check_self(ex, scounts, rcounts, es));
  size_t all = scounts[0] * es * (size_t)s->size;
  if (equal && t3d__shm_mapped_size(s, all)) {
    int done = 0;
    T3D_CHECK(t3d__shm_mapped_alltoall(s, ex, (const char *)sendbuf + sdispls[0] * es,
                                       (char *)recvbuf + rdispls[0] * es, scounts[0] * es, &done));
    if (done) return T3D_OK;
  }
  /* Incoming blocks may overwrite outgoing ones that later steps still read: then send from a copy. */
  const char *sb;
  size_t sbias;
  void *copy;
  T3D_CHECK(t3d__alltoall_source(s->size, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, es, &sb, &sbias,
                                 &copy));
  t3d_result_t res;
  size_t blk = scounts[0] * es;
  const char *block0 = sb + (sdispls[0] * es - sbias);
  t3d_shm_step_t st;
  if (a2a_packed(s, equal, blk)) {
    res = a2a_packed_publish(s, ex, &st, block0, blk);
    if (res == T3D_OK) res = a2a_packed_collect(s, ex, &st, block0, (char *)recvbuf + rdispls[0] * es, blk);
  } else if (a2a_equal_direct(s, equal, blk)) {
    res = a2a_equal_publish(s, ex, &st, block0, blk);
    if (res == T3D_OK) res = a2a_equal_collect(s, ex, &st, block0, (char *)recvbuf + rdispls[0] * es, blk);
  } else {
    a2a_ctx_t c = a2a_ctx(s, ex, recvbuf, scounts, rcounts, rdispls, es);
    /* Only equal blocks: every rank knows the size, so all decide alike whether to probe. */
    res = t3d__shm_far(s, ex, equal && t3d__shm_probes(s, all), all, &c.far);
    if (res == T3D_OK) res = a2a_steps(&c, 0, sb, sbias, scounts, sdispls);
  }
  free(copy);
  return res;
}

/* In parts: step 0 (or the single-copy step of equal blocks) published by start, collected (and any further steps
 * run) by finish. The caller made sure that the receive blocks do not overlap the send blocks, so no copy of the
 * input is needed. */
int t3d__shm_a2a_fits(t3d_shm_t *s, size_t max_send_block_bytes, int equal) {
  if (equal && t3d__shm_mapped_size(s, max_send_block_bytes * (size_t)s->size)) return 0;
  if (equal && t3d__shm_probes(s, max_send_block_bytes * (size_t)s->size)) return 0;
  if (max_send_block_bytes > a2a_piece(s) && !a2a_equal_direct(s, equal, max_send_block_bytes)) return 0;
  return t3d__shm_next_half_free(s);
}

t3d_result_t t3d__shm_a2a_start(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                size_t es, int equal, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  t3d_shm_step_t st;
  t3d_result_t res;
  if (a2a_packed(s, equal, scounts[0] * es)) {
    res = a2a_packed_publish(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, scounts[0] * es);
    rs->by_line = 1;
  } else if (a2a_equal_direct(s, equal, scounts[0] * es)) {
    res = a2a_equal_publish(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, scounts[0] * es);
  } else {
    t3d__shm_step_begin(s, 2, &st);
    res = a2a_publish(s, ex, &st, sendbuf, 0, scounts, sdispls, es, 0, a2a_local_max(s->size, s->rank, scounts, es),
                      0);
    rs->by_line = 1;
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
  if (a2a_packed(s, equal, scounts[0] * es)) {
    return a2a_packed_collect(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, (char *)recvbuf + rdispls[0] * es,
                            scounts[0] * es);
  }
  if (a2a_equal_direct(s, equal, scounts[0] * es)) {
    return a2a_equal_collect(s, ex, &st, (const char *)sendbuf + sdispls[0] * es, (char *)recvbuf + rdispls[0] * es,
                             scounts[0] * es);
  }
  a2a_ctx_t c = a2a_ctx(s, ex, recvbuf, scounts, rcounts, rdispls, es);
  c.st = &st;
  T3D_CHECK(a2a_collect(&c));
  return a2a_steps(&c, c.piece, sendbuf, 0, scounts, sdispls);
}
