/* mapped.c: collectives whose buffers are t3d memory (t3d_mem_alloc, mem.c) on every rank. Each rank maps the
 * others' buffers and reads and writes them in place: every byte is copied once, with non-temporal stores, where
 * the segment copies it twice and process_vm_readv copies it once but at a fraction of the speed (the kernel's copy;
 * docs/architecture.md, "Registered memory").
 *
 * Which path an operation takes must be the same on every rank, and only its own buffers are known to a rank. So
 * from T3D_SHM_MAPPED_BYTES on (rank 0's value at init; 0 where the ranks could not read each other's memory) every
 * allreduce, reduce_scatter, allgather, alltoall and broadcast of equal blocks starts with an offer: one step in
 * which each rank writes into its info line where its input and output are (allocation key and offset, or key 0:
 * not t3d memory, or a layout this file does not take) and posts; once all have, every rank reads the same lines
 * and takes the mapped path only if every rank offered. Otherwise the segment's algorithm follows (the offer cost
 * one exchange of flags). A step has three phases: 1 offered, 3 done with the peers' buffers (2 is not used); a
 * rank returns only once every rank has posted 3, since until then they may use its buffers. */
#include "shm.h"

#include <stdio.h>
#include <string.h>

/* Offers that nobody takes are made rarer, up to one in this many (every rank counts alike: all see the same
 * offers). */
#define OFFER_GAP_MAX 64u

int t3d__shm_mapped_size(const t3d_shm_t *s, size_t bytes) {
  return s->mapped_min != 0 && bytes >= s->mapped_min && s->size > 1;
}

/* The offer: writes where in (in_bytes) and out (out_bytes) are, posts phase 1, waits for every rank and checks
 * that they run the same operation. *all = 1: every rank offered, and s->m_in[p] / s->m_out[p] point at rank p's
 * buffers here; else *all = 0 and the step's phases are posted (the caller goes on through the segment). */
static t3d_result_t offer(t3d_shm_t *s, t3d_exec_t *ex, t3d_shm_step_t *st, int kind, uint64_t sig,
                          const void *in, size_t in_bytes, void *out, size_t out_bytes, int mine_ok, int *all) {
  if (s->offer_skip > 0) {
    s->offer_skip--;
    *all = 0;
    return T3D_OK;
  }
  uint64_t ikey = 0, ioff = 0, okey = 0, ooff = 0;
  if (mine_ok && (!t3d__mem_find(in, in_bytes, &ikey, &ioff) || !t3d__mem_find(out, out_bytes, &okey, &ooff))) {
    ikey = okey = 0;
  }
  t3d__shm_step_begin(s, 3, st);
  T3D_CHECK(t3d__shm_step_acquire(s, ex, st));
  t3d__shm_put_info(s, st, kind, sig, ikey);
  t3d_shm_info_t *line = t3d__shm_info(s, s->rank, st->h);
  line->addr = ioff;
  line->spare[0] = okey;
  line->spare[1] = ooff;
  t3d__shm_post(s, st->base + 1);
  T3D_CHECK(t3d__shm_wait(s, ex, -1, st->base + 1));
  T3D_CHECK(t3d__shm_check_all_info(s, ex, st, kind, sig));
  int offered = 0;
  for (int p = 0; p < s->size; p++) {
    const t3d_shm_info_t *l = t3d__shm_info(s, p, st->h);
    offered += l->aux != 0 && l->spare[0] != 0;
  }
  *all = offered == s->size;
  if (!*all) {
    /* Nobody offered: a job that does not use t3d memory pays for one offer in OFFER_GAP_MAX at most. */
    s->offer_gap = offered > 0 ? 0 : s->offer_gap == 0 ? 1 : t3d__shm_min_sz(2u * s->offer_gap, OFFER_GAP_MAX);
    s->offer_skip = s->offer_gap;
    t3d__shm_post(s, st->base + 3);
    return T3D_OK;
  }
  s->offer_gap = 0;
  s->m_in[s->rank] = (char *)(uintptr_t)in;
  s->m_out[s->rank] = out;
  t3d_result_t res = T3D_OK;
  for (int p = 0; p < s->size && res == T3D_OK; p++) {
    if (p == s->rank) continue;
    const t3d_shm_info_t *l = t3d__shm_info(s, p, st->h);
    char why[300] = "";
    const char *which = "input";
    s->m_in[p] = t3d__mem_peer((int)l->pid, l->aux, l->addr, in_bytes, why, sizeof why);
    if (s->m_in[p] != NULL) {
      which = "output";
      s->m_out[p] = t3d__mem_peer((int)l->pid, l->spare[0], l->spare[1], out_bytes, why, sizeof why);
    }
    if (s->m_in[p] == NULL || s->m_out[p] == NULL) {
      snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d): mapping rank %d's %s "
               "(t3d memory) failed: %s; T3D_SHM_MAPPED_BYTES=0 copies through shared memory instead", ex->opname,
               (unsigned long long)ex->seq, ex->comm->name, ex->rank, ex->size, p, which, why);
      res = T3D_ERR_SYSTEM;
    }
  }
  return res;
}

/* Rank q's slice of count elements, whole lines of es-byte elements, the last one shorter. */
static void slice_of(size_t count, size_t es, int n, int q, size_t *lo, size_t *hi) {
  size_t unit = es != 0 && 64 % es == 0 ? 64 / es : 1;
  size_t sl = (count + (size_t)n * unit - 1) / ((size_t)n * unit) * unit;
  *lo = t3d__shm_min_sz((size_t)q * sl, count);
  *hi = t3d__shm_min_sz(*lo + sl, count);
}

/* The end of the mapped work: phase 3 posted, and every rank past it (nobody uses this rank's buffers any more). */
static t3d_result_t finish(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, t3d_result_t res) {
  return t3d__shm_direct_end(s, ex, st->base + 3, res);
}

/* Allreduce: rank q reduces slice q of every rank's input and writes it into every rank's output (the sources read
 * once, each output byte written once: the least traffic there is). In place is fine: slice q of every buffer is
 * read and written by rank q alone. Measured, 2 ranks, 64 MiB: writing both outputs from one pass is about 1.6x
 * faster than writing the own output and then copying the others' slices from theirs.
 * Where every rank works in place, the outputs are the lines the pass has just read, and plain stores write them
 * (non-temporal ones would first push each line out of the cache): measured through torch, in-place 64 MiB, three
 * alternating pairs, 2 ranks 9.4-9.9 -> 6.0-6.7 ms, 8 ranks on 2 cores 40-47 -> 22-27 ms. */
t3d_result_t t3d__shm_mapped_allreduce(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                       size_t count, t3d_dtype_t dt, t3d_redop_t op, int *done) {
  size_t es = t3d_dtype_size(dt), bytes = count * es;
  t3d_shm_step_t st;
  T3D_CHECK(offer(s, ex, &st, T3D_OP_ALLREDUCE, bytes, sendbuf, bytes, recvbuf, bytes, s->size <= T3D_SHM_FANOUT_MAX,
                  done));
  if (!*done) return T3D_OK;
  size_t lo, hi;
  slice_of(count, es, s->size, s->rank, &lo, &hi);
  int in_place = 1;
  for (int p = 0; p < s->size; p++) {
    in_place &= s->m_out[p] == s->m_in[p];
    s->srcs[p] = s->m_in[p] + lo * es;
    s->m_out[p] += lo * es;
  }
  t3d__shm_reduce_fanout((void *const *)s->m_out, s->size, s->srcs, s->size, hi - lo, dt, op,
                         s->nt && bytes >= s->nt_min && !in_place);
  return finish(s, ex, &st, T3D_OK);
}

/* Reduce_scatter of equal blocks: rank q reduces block q of every rank's input into its output. An output that is
 * the own block of the input is fine (element for element); another overlap takes the segment. */
t3d_result_t t3d__shm_mapped_reduce_scatter(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                            size_t count, t3d_dtype_t dt, t3d_redop_t op, int *done) {
  size_t es = t3d_dtype_size(dt), blk = count * es, total = blk * (size_t)s->size;
  const char *own = (const char *)sendbuf + (size_t)s->rank * blk;
  int ok = !t3d__overlap(sendbuf, total, recvbuf, blk) || (const char *)recvbuf == own;
  t3d_shm_step_t st;
  T3D_CHECK(offer(s, ex, &st, T3D_OP_REDUCE_SCATTERV, total, sendbuf, total, recvbuf, blk, ok, done));
  if (!*done) return T3D_OK;
  int nt = s->nt && total >= s->nt_min;
  for (int p = 0; p < s->size; p++) s->srcs[p] = s->m_in[p] + (size_t)s->rank * blk;
  t3d__shm_reduce_n(nt ? NULL : recvbuf, nt ? recvbuf : NULL, s->srcs, s->size, count, dt, op, nt);
  return finish(s, ex, &st, T3D_OK);
}

/* Alltoall: block p of the output from block `me` of rank p's input. */
typedef struct {
  t3d_shm_t *s;
  size_t blk;
  int nt;
} blocks_t;

static void copy_peer_block(void *arg, int p) {
  blocks_t *c = arg;
  t3d__shm_copy(c->s->m_out[c->s->rank] + (size_t)p * c->blk, c->s->m_in[p] + (size_t)c->s->rank * c->blk, c->blk,
                c->nt);
}

/* Writes len bytes at src into every rank's buffer but `skip`'s at offset off, a piece at a time, so that each piece
 * is read from memory once. */
#define FANOUT_PIECE (128 * 1024)
static void copy_fanout(t3d_shm_t *s, const char *src, size_t off, size_t len, int skip, int nt) {
  for (size_t at = 0; at < len; at += FANOUT_PIECE) {
    size_t m = t3d__shm_min_sz(FANOUT_PIECE, len - at);
    for (int q = 0; q < s->size; q++) {
      if (q != skip) t3d__shm_copy(s->m_out[q] + off + at, src + at, m, nt);
    }
  }
}

/* Allgather of equal blocks (blk bytes each): every rank writes its block into every rank's output (read once,
 * each output byte written once). Its own output's block may already be in place; any other overlap of the input
 * with the output takes the segment. */
t3d_result_t t3d__shm_mapped_allgather(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                       size_t blk, int *done) {
  size_t total = blk * (size_t)s->size;
  char *own = (char *)recvbuf + (size_t)s->rank * blk;
  const void *in = sendbuf == NULL ? own : sendbuf;
  int ok = in == own || !t3d__overlap(in, blk, recvbuf, total);
  t3d_shm_step_t st;
  T3D_CHECK(offer(s, ex, &st, T3D_OP_ALLGATHERV, total, in, blk, recvbuf, total, ok, done));
  if (!*done) return T3D_OK;
  copy_fanout(s, in, (size_t)s->rank * blk, blk, in == own ? s->rank : -1, s->nt && total >= s->nt_min);
  return finish(s, ex, &st, T3D_OK);
}

/* Alltoall of equal blocks: block p of the output from block `me` of rank p's input; in place (or any overlap)
 * takes the segment, since peers read the very blocks this rank would overwrite. */
t3d_result_t t3d__shm_mapped_alltoall(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t blk,
                                      int *done) {
  size_t total = blk * (size_t)s->size;
  int ok = !t3d__overlap(sendbuf, total, recvbuf, total);
  t3d_shm_step_t st;
  T3D_CHECK(offer(s, ex, &st, T3D_OP_ALLTOALLV, total, sendbuf, total, recvbuf, total, ok, done));
  if (!*done) return T3D_OK;
  blocks_t c = {s, blk, s->nt && total >= s->nt_min};
  copy_peer_block(&c, s->rank);
  return finish(s, ex, &st, t3d__shm_wait_each(s, ex, st.base + 1, NULL, copy_peer_block, &c));
}

/* Broadcast: every rank, the root included, copies its slice of the root's buffer into every other rank's buffer
 * (each byte read once, written once per receiver, by all ranks at once). */
t3d_result_t t3d__shm_mapped_broadcast(t3d_shm_t *s, t3d_exec_t *ex, void *buf, size_t bytes, int root,
                                       int *done) {
  t3d_shm_step_t st;
  T3D_CHECK(offer(s, ex, &st, T3D_OP_BROADCAST, bytes, buf, bytes, buf, bytes, 1, done));
  if (!*done) return T3D_OK;
  size_t lo, hi;
  slice_of(bytes, 1, s->size, s->rank, &lo, &hi);
  copy_fanout(s, s->m_in[root] + lo, lo, hi - lo, root, s->nt && bytes >= s->nt_min);
  return finish(s, ex, &st, T3D_OK);
}
