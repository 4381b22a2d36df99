/* reduce_scatter.c: reduce_scatterv over a communicator's shared-memory segment. Step k carries piece k (P
 * elements) of every block: rank p writes its piece for owner q at q * P of its half, and q folds the pieces of all
 * ranks in rank order into its output; also in one step in parts, for the inline path. */
#include "shm.h"

#include <stdlib.h>
#include <string.h>

/* Where a reduce_scatterv's blocks are and how the own block is read, set up by rs_layout. */
typedef struct {
  const size_t *counts;
  size_t es, total, maxc, P;
  int own_direct; /* the own block is folded straight from sendbuf (not copied into the half) */
  int nt_out;     /* the fold writes the output with non-temporal stores */
} rs_layout_t;

/* Elements of each block one step carries: a line-aligned share of the half per owner. */
static size_t rs_piece(const t3d_shm_t *s, size_t es) { return s->half / (size_t)s->size / 64 * 64 / es; }

static void rs_layout(t3d_shm_t *s, const size_t *counts, t3d_dtype_t dt, int own_direct, int nt_out,
                      rs_layout_t *l) {
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
  l->nt_out = nt_out;
}

/* An input of at most T3D_SHM_INLINE_DATA bytes travels whole in its rank's info line, as a small one-shot
 * allreduce's vector does (allreduce.c): a reader finds that the step is posted, what it is and its piece in one
 * line. Every rank knows the total, so all decide alike. */
static int rs_inline(const rs_layout_t *l) { return l->total * l->es <= T3D_SHM_INLINE_DATA; }

/* Up to this many bytes of input a step posts phase 1 without the fence, as the small one-shot allreduce does:
 * rs_fold's post of phase 2 checks for sleepers, and its fold is short, so a peer that blocked meanwhile is woken
 * late by little. Measured (2 ranks, t3d_bench_c -o reduce_scatter, eight alternating runs, medians): 64 B-4 KiB
 * 0.89-0.99 of the time with the fence. */
#define RS_LAZY_MAX (16u * 1024u)

/* Step begun: writes piece [lo, lo + P) of every block into this rank's half (far: with non-temporal stores,
 * t3d__shm_far), or the whole input into its info line (rs_inline), and posts phase 1. */
static t3d_result_t rs_publish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const rs_layout_t *l,
                               const char *sb, size_t lo, int far) {
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  if (rs_inline(l)) {
    t3d__shm_put_inline(s, st, T3D_OP_REDUCE_SCATTERV, l->total * l->es, sb, l->total * l->es);
  } else {
    if (lo == 0) t3d__shm_put_info(s, st, T3D_OP_REDUCE_SCATTERV, l->total * l->es, 0);
    char *half = t3d__shm_half(s, s->rank, st->h);
    for (int q = 0; q < s->size; q++) {
      if ((q == s->rank && l->own_direct) || lo >= l->counts[q]) continue;
      t3d__shm_copy(half + (size_t)q * l->P * l->es, sb + (s->offs[q] + lo) * l->es,
                    t3d__shm_min_sz(l->P, l->counts[q] - lo) * l->es, far);
    }
  }
  if (l->total * l->es <= RS_LAZY_MAX) {
    t3d__shm_post_lazy(s, st->base + 1);
    t3d__shm_show_arrived(s, st);
  } else {
    t3d__shm_post_arrived(s, st);
  }
  return T3D_OK;
}

/* Folds piece lo of this rank's block from every rank's half (when it has one) into rb + lo, then posts phase 2. */
static t3d_result_t rs_fold(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, const rs_layout_t *l,
                            const char *sb, char *rb, size_t lo, t3d_dtype_t dt, t3d_redop_t op) {
  int me = s->rank;
  if (lo < l->counts[me]) {
    t3d_shm_arrival_t a = t3d__shm_arrival(st);
    T3D_CHECK(t3d__shm_wait_line(s, ex, -1, st->base + 1, 0, &a));
    if (lo == 0) T3D_CHECK(t3d__shm_check_all_info(s, ex, st, T3D_OP_REDUCE_SCATTERV, l->total * l->es));
    for (int p = 0; p < s->size; p++) {
      if (p == me && l->own_direct) s->srcs[p] = sb + (s->offs[me] + lo) * l->es;
      else if (rs_inline(l)) s->srcs[p] = t3d__shm_inline_data(s, p, st->h) + s->offs[me] * l->es;
      else s->srcs[p] = t3d__shm_half(s, p, st->h) + (size_t)me * l->P * l->es;
    }
    char *out = rb + lo * l->es; /* reduce_n's first destination takes plain stores, its second non-temporal ones */
    t3d__shm_reduce_n(l->nt_out ? NULL : out, l->nt_out ? out : NULL, s->srcs, s->size,
                      t3d__shm_min_sz(l->P, l->counts[me] - lo), dt, op, l->nt_out);
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
  if (t3d__shm_mapped_size(s, total * es) && t3d__equal_blocks(s->size, counts, NULL)) {
    int done = 0;
    T3D_CHECK(t3d__shm_mapped_reduce_scatter(s, ex, sendbuf, recvbuf, counts[0], dt, op, &done));
    if (done) return T3D_OK;
  }
  const char *sb = sendbuf;
  char *rb = recvbuf, *scratch = NULL;
  size_t mine = counts[me] * es, below = 0;
  for (int q = 0; q < me; q++) below += counts[q];
  /* Step k writes output [kP, (k+1)P) after reading every piece k: safe when the output is the input's start or
   * the own block (what is overwritten was read at step k or before). Other overlaps go through scratch. */
  int ov = t3d__overlap(sb, total * es, rb, mine);
  /* An output of at least T3D_SHM_NT_BYTES apart from the input takes non-temporal stores, as allreduce's and
   * allgather's do: a plain store first reads each output line from memory. Measured (2 ranks, t3d_bench_c -o
   * reduce_scatter, eight alternating rounds, medians): 8-128 MiB 0.74 of the time (64 MiB 11.2 -> 8.2 ms); a
   * 4 MiB total (2 MiB output) was no faster. With more ranks than cores (8 on 2) no gain showed, so it is off
   * there unless T3D_SHM_NT_BYTES is set. */
  int nt_out = !ov && s->nt && mine >= s->nt_min &&
               (!t3d__oversubscribed() || t3d__param_is_set(T3D_PARAM_SHM_NT_BYTES));
  rs_layout_t l;
  rs_layout(s, counts, dt, !ov || rb == sb + below * es, nt_out, &l);
  if (ov && rb != sb && rb != sb + below * es) {
    scratch = malloc(mine);
    if (scratch == NULL) return T3D_ERR_NO_MEMORY;
    rb = scratch;
  }
  t3d_result_t res = T3D_OK;
  int far;
  T3D_CHECK_GOTO(t3d__shm_far(s, ex, t3d__shm_probes(s, total * es), total * es, &far), res, out);
  for (size_t lo = 0; lo < l.maxc; lo += l.P) {
    t3d_shm_step_t st;
    t3d__shm_step_begin(s, 2, &st);
    T3D_CHECK_GOTO(rs_publish(s, ex, &st, &l, sb, lo, far), res, out);
    T3D_CHECK_GOTO(rs_fold(s, ex, &st, &l, sb, rb, lo, dt, op), res, out);
  }
  if (scratch != NULL) memcpy(recvbuf, scratch, mine);
out:
  free(scratch);
  return res;
}

/* A reduce_scatterv in one step, in parts, when the output does not overlap the input (no scratch). */
int t3d__shm_rs_fits(t3d_shm_t *s, size_t total_bytes, size_t max_block_bytes, size_t es) {
  return total_bytes > 0 && !t3d__shm_mapped_size(s, total_bytes) && !t3d__shm_probes(s, total_bytes) &&
         max_block_bytes <= rs_piece(s, es) * es && t3d__shm_next_half_free(s);
}

t3d_result_t t3d__shm_rs_start(t3d_exec_t *ex, const void *sendbuf, const size_t *counts, t3d_dtype_t dt,
                               t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs_layout_t l;
  rs_layout(s, counts, dt, 1, 0, &l);
  t3d_shm_step_t st;
  t3d__shm_step_begin(s, 2, &st);
  rs->h = st.h;
  rs->base = st.base;
  rs->by_line = 1;
  return rs_publish(s, ex, &st, &l, sendbuf, 0, 0);
}

t3d_result_t t3d__shm_rs_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf, void *recvbuf,
                                const size_t *counts, t3d_dtype_t dt, t3d_redop_t op) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs_layout_t l;
  rs_layout(s, counts, dt, 1, 0, &l);
  t3d_shm_step_t st = {rs->h, rs->base, 0, 1};
  return rs_fold(s, ex, &st, &l, sendbuf, recvbuf, 0, dt, op);
}
