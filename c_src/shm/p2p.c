/* shm/p2p.c: point-to-point between the ranks of a communicator that shares a host, without the progress thread.
 *
 * Every ordered pair (sender, receiver) has a ring of fixed slots in the communicator's segment: the sender alone
 * writes slots (each with its message's sequence number, last), the receiver alone the ring's tail. A message of at
 * most `eager` bytes travels inside its slot; a longer one sends only a header naming the sender's buffer
 * (rendezvous), and the receiver copies it straight from the sender's memory with process_vm_readv (one copy;
 * cross-memory attach), then marks the sender's record for that message done. Receivers move messages that match
 * no posted receive to a private unexpected queue, so the sender's slots never wait for the receiver's program.
 *
 * Who runs it: whoever holds `mu`. A send or receive is posted on the caller's thread at issue time and a pass
 * runs at once (an eager send completes there); t3d_test, t3d_wait and t3d_request_poll run passes while a caller
 * waits; shared-memory collective waits and the progress thread (on its periodic wake-ups) run them too, so that
 * queued sends still enter a ring, and timeouts and aborts still fire, when nobody waits. Requests complete after
 * `mu` is dropped: a completion callback may issue new operations.
 *
 * Long messages, when the group has staging areas, travel through the pair's area instead, two copies pipelined
 * (stage.c); the receiver chooses that way when it takes the record, and can still finish alone.
 *
 * Ordering: all point-to-point between two ranks of such a communicator takes this path, in issue order per pair
 * (a send that finds its ring full, or no free record, waits in a per-peer queue and later sends queue behind it).
 * A message matches the oldest posted receive that accepts its source and tag; a receive first looks at the
 * unexpected queue, oldest first. */
#include "p2p_state.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* How often a pass reads the clock for deadlines and lost peers (pass). */
enum { PASSES_PER_CLOCK = 16 };
/* The receiver's side of a ring. The sender reads `tail` only when its own count says the ring may be full. */
typedef struct ring_ctl {
  _Atomic uint64_t tail; /* messages consumed (receiver) */
  char pad[56];
} ring_ctl_t;

/* Staging areas (stage.c) follow the rings, from a page. */
static size_t stages_at(int n, size_t ring_bytes) {
  return (rings_at(n) + (size_t)n * (size_t)n * ring_bytes + 4095) / 4096 * 4096;
}

static char *ring(const t3d_shm_p2p_t *p, int src, int dst) {
  return p->region + rings_at(p->size) + ((size_t)dst * (size_t)p->size + (size_t)src) * p->ring_bytes;
}

static slot_hdr_t *slot(const t3d_shm_p2p_t *p, char *r, uint64_t i) {
  return (slot_hdr_t *)(void *)(r + sizeof(ring_ctl_t) + (size_t)(i % p->slots) * p->slot_bytes);
}

size_t t3d__shm_p2p_bytes(int n, size_t eager, unsigned slots, size_t stage) {
  if (slots == 0) return 0;
  size_t ring_bytes = sizeof(ring_ctl_t) + (size_t)slots * (sizeof(slot_hdr_t) + eager);
  if (stage == 0 || n < 2) return rings_at(n) + (size_t)n * (size_t)n * ring_bytes;
  return stages_at(n, ring_bytes) + t3d__shm_stage_bytes(n, stage);
}

void t3d__shm_p2p_sizes(int n, size_t *eager, unsigned *slots, size_t *stage) {
  /* 8 slots per pair; the eager size shrinks with the number of pairs, so that the rings of a communicator stay
   * near 4 MiB (8 ranks: 4 KiB messages go eagerly; 64 ranks: 64 bytes). */
  *slots = 8;
  int64_t want = t3d__param_int(T3D_PARAM_SHM_P2P_EAGER_BYTES);
  size_t e;
  if (want >= 0) {
    e = (size_t)want;
  } else {
    e = ((size_t)4 << 20) / ((size_t)n * (size_t)n * *slots);
    if (e > 4096) e = 4096;
  }
  e = e / 64 * 64;
  if (e > (1u << 20)) e = 1u << 20;
  *eager = e;
  *stage = t3d__shm_stage_size(n);
}

static t3d_result_t p2p_new(t3d_comm_t *comm, t3d_shm_t *s, char *region, size_t eager, unsigned slots,
                           size_t stage_bytes, t3d_shm_p2p_t **out) {
  *out = NULL;
  t3d_shm_p2p_t *p = calloc(1, sizeof *p);
  if (p == NULL) return T3D_ERR_NO_MEMORY;
  int n = s->size;
  p->comm = comm;
  p->shm = s;
  p->rank = s->rank;
  p->size = n;
  p->pid = s->pid; /* the segment state already knows this process */
  p->region = region;
  p->eager = eager;
  p->slots = slots;
  p->slot_bytes = sizeof(slot_hdr_t) + eager;
  p->ring_bytes = sizeof(ring_ctl_t) + (size_t)slots * p->slot_bytes;
  if (stage_bytes > 0 && n > 1) {
    p->stages = region + stages_at(n, p->ring_bytes);
    p->stage_chunk = stage_bytes / T3D_STAGE_SLOTS;
    int64_t m = t3d__param_int(T3D_PARAM_SHM_P2P_STAGE_MIN_BYTES);
    /* AMD: the area's non-temporal stores send 4 MiB messages through memory, where ranks on one core complex
     * read them faster straight from the sender (docs/benchmarks/p2p-stage-min-amd-2ranks.txt) */
    if (!t3d__param_is_set(T3D_PARAM_SHM_P2P_STAGE_MIN_BYTES) && t3d__shm_llc_may_split())
      m = T3D_SHM_P2P_STAGE_MIN_SPLIT;
    p->stage_min = m <= 0 ? 1 : (size_t)m;
  }
  pthread_mutex_init(&p->mu, NULL);
  atomic_init(&p->active, 0);
  p->sendq_head = calloc((size_t)n, sizeof *p->sendq_head);
  p->sendq_tail = calloc((size_t)n, sizeof *p->sendq_tail);
  p->head = calloc((size_t)n, sizeof *p->head);
  p->tail_seen = calloc((size_t)n, sizeof *p->tail_seen);
  p->tail = calloc((size_t)n, sizeof *p->tail);
  p->want = calloc((size_t)n, sizeof *p->want);
  p->rec_gen = calloc(T3D_SHM_P2P_RECORDS, sizeof *p->rec_gen);
  p->free_recs = malloc(T3D_SHM_P2P_RECORDS * sizeof *p->free_recs);
  if (p->sendq_head == NULL || p->sendq_tail == NULL || p->head == NULL || p->tail_seen == NULL || p->tail == NULL ||
      p->want == NULL || p->rec_gen == NULL || p->free_recs == NULL) {
    t3d__shm_p2p_free(p);
    return T3D_ERR_NO_MEMORY;
  }
  for (uint32_t i = 0; i < T3D_SHM_P2P_RECORDS; i++) p->free_recs[p->nfree++] = T3D_SHM_P2P_RECORDS - 1 - i;
  *out = p;
  return T3D_OK;
}

void t3d__shm_p2p_free(t3d_shm_p2p_t *p) {
  if (p == NULL) return;
  while (p->unexp != NULL) {
    unexp_t *u = p->unexp;
    p->unexp = u->next;
    free(u->data);
    free(u);
  }
  pthread_mutex_destroy(&p->mu);
  free(p->sendq_head);
  free(p->sendq_tail);
  free(p->head);
  free(p->tail_seen);
  free(p->tail);
  free(p->want);
  free(p->rec_gen);
  free(p->free_recs);
  free(p);
}

int t3d__shm_p2p_active(t3d_shm_p2p_t *p) { return p != NULL && atomic_load_explicit(&p->active, memory_order_relaxed) > 0; }

/* ---------- completion ---------- */

/* Requests finished during a pass, completed once `mu` is dropped (linked through next). */
typedef struct done_list {
  t3d_request_t *head;
} done_list_t;

static void finish(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r, t3d_result_t res, const char *msg) {
  r->result = res;
  if (res < 0 && msg != NULL && r->errmsg == NULL) r->errmsg = strdup(msg);
  r->next = d->head;
  d->head = r;
  atomic_fetch_sub_explicit(&p->active, 1, memory_order_relaxed);
}

static void complete_all(done_list_t *d) {
  /* Oldest first is not promised; each request is completed exactly once. */
  while (d->head != NULL) {
    t3d_request_t *r = d->head;
    d->head = r->next;
    r->next = NULL;
    t3d__request_complete(r, r->result, NULL);
  }
}

static const char *fail_verb(t3d_result_t res) {
  return res == T3D_ERR_TIMEOUT ? "timed out" : res == T3D_ERR_ABORTED ? "was aborted" : "failed";
}

static void fail(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r, t3d_result_t res) {
  char msg[512], peer[32] = "any rank";
  t3d_comm_t *c = p->comm;
  if (r->root != T3D_ANY_SOURCE) snprintf(peer, sizeof peer, "rank %d", r->root);
  snprintf(msg, sizeof msg, "t3d: %s %s on group '%s' (rank %d, tag %lld) %s (timeout %lld ms)",
           r->kind == T3D_OP_SEND ? "send to" : "recv from", peer, c->name, c->rank, (long long)r->tag,
           fail_verb(res), (long long)r->timeout_ms);
  finish(p, d, r, res, msg);
}

/* Request r with peer q (its root, or an any-source receive's sender) failed: q's process pid has exited. */
static void fail_lost(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r, int q, int32_t pid) {
  char msg[512];
  t3d_comm_t *c = p->comm;
  snprintf(msg, sizeof msg, "t3d: %s rank %d on group '%s' (rank %d, tag %lld) lost rank %d: its process (pid %d) "
           "has exited", r->kind == T3D_OP_SEND ? "send to" : "recv from", q, c->name, c->rank,
           (long long)r->tag, q, (int)pid);
  finish(p, d, r, T3D_ERR_PEER_LOST, msg);
}

/* ---------- sender ---------- */

/* Puts send r into its peer's ring; 0 when the ring is full or no record is free (r must wait). */
static int try_write(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r) {
  int dst = r->root;
  char *rg = ring(p, p->rank, dst);
  ring_ctl_t *ctl = (ring_ctl_t *)(void *)rg;
  uint64_t h = p->head[dst];
  if (h - p->tail_seen[dst] >= p->slots) {
    /* Acquire: the receiver is done with the slots it has released. */
    p->tail_seen[dst] = atomic_load_explicit(&ctl->tail, memory_order_acquire);
    if (h - p->tail_seen[dst] >= p->slots) return 0;
  }
  size_t len = r->count * t3d_dtype_size(r->dtype);
  slot_hdr_t *sh = slot(p, rg, h);
  sh->tag = (int32_t)r->tag;
  sh->len = len;
  if (len <= p->eager) {
    sh->kind = MSG_EAGER;
    if (len > 0) memcpy(len <= SLOT_INLINE ? (void *)sh->inline_data : (void *)(sh + 1), r->sendbuf, len);
    atomic_store_explicit(&sh->seq, h + 1, memory_order_release);
    p->head[dst] = h + 1;
    ring_bell(p, dst);
    finish(p, d, r, T3D_OK, NULL);
    return 1;
  }
  if (p->nfree == 0) return 0;
  uint32_t rec = p->free_recs[--p->nfree];
  uint64_t gen = ++p->rec_gen[rec];
  atomic_store_explicit(record(p, p->rank, rec), REC_WORD(gen, REC_POSTED), memory_order_relaxed);
  sh->kind = MSG_RENDEZVOUS;
  sh->addr = (uint64_t)(uintptr_t)r->sendbuf;
  sh->gen = gen;
  sh->rec = rec;
  sh->pid = p->pid;
  sh->mkey = 0;
  if (p->shm->mapped_min == 0 || len < p->shm->mapped_min || !t3d__mem_find(r->sendbuf, len, &sh->mkey, &sh->moff))
    sh->mkey = 0;
  atomic_store_explicit(&sh->seq, h + 1, memory_order_release); /* orders the record's POSTED too */
  p->head[dst] = h + 1;
  ring_bell(p, dst);
  r->shm_rec = rec;
  r->shm_gen = gen;
  r->next = p->rdv;
  p->rdv = r;
  return 1;
}

static void drain_sendq(t3d_shm_p2p_t *p, done_list_t *d) {
  for (int q = 0; q < p->size && p->queued > 0; q++) {
    while (p->sendq_head[q] != NULL) {
      t3d_request_t *r = p->sendq_head[q];
      t3d_request_t *next = r->next;
      if (!try_write(p, d, r)) break;
      p->queued--;
      p->sendq_head[q] = next;
      if (next == NULL) p->sendq_tail[q] = NULL;
    }
  }
}

static void post_send(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r) {
  int dst = r->root;
  if (p->sendq_head[dst] == NULL && try_write(p, d, r)) return;
  r->next = NULL;
  if (p->sendq_tail[dst] != NULL) p->sendq_tail[dst]->next = r;
  else p->sendq_head[dst] = r;
  p->sendq_tail[dst] = r;
  p->queued++;
}

/* A request's deadline counts from the first pass that reads the clock after it was posted (microseconds after
 * its post: posting reads no clock); 0 until then. */
static int past_deadline(t3d_request_t *r, uint64_t now) {
  if (r->deadline_ns == 0) {
    r->deadline_ns = now + (uint64_t)r->timeout_ms * 1000000ull;
    return 0;
  }
  return now > r->deadline_ns;
}

/* Rendezvous sends whose reader is done; cancelling the ones past their deadline (or all, on abort; now 0: none). */
static void reap_rdv(t3d_shm_p2p_t *p, done_list_t *d, uint64_t now, int aborted) {
  for (t3d_request_t **l = &p->rdv; *l != NULL;) {
    t3d_request_t *r = *l;
    _Atomic uint64_t *w = record(p, p->rank, r->shm_rec);
    uint64_t v = atomic_load_explicit(w, memory_order_acquire);
    t3d_result_t res = T3D_IN_PROGRESS;
    if (v == REC_WORD(r->shm_gen, REC_DONE)) {
      res = T3D_OK;
    } else if (aborted || (now != 0 && past_deadline(r, now))) {
      /* Cancel unless the reader has begun; then it finishes soon and a later pass completes the send. */
      uint64_t expect = REC_WORD(r->shm_gen, REC_POSTED);
      if (atomic_compare_exchange_strong(w, &expect, REC_WORD(r->shm_gen, REC_IDLE))) {
        res = aborted ? T3D_ERR_ABORTED : T3D_ERR_TIMEOUT;
      }
    }
    if (res == T3D_IN_PROGRESS) {
      l = &r->next;
      continue;
    }
    *l = r->next;
    p->free_recs[p->nfree++] = r->shm_rec;
    if (res == T3D_OK) finish(p, d, r, T3D_OK, NULL);
    else fail(p, d, r, res);
  }
}

/* ---------- receiver ---------- */

static int accepts(const t3d_request_t *r, int src, int64_t tag) {
  return (r->root == T3D_ANY_SOURCE || r->root == src) && r->tag == tag;
}

/* Copies len bytes of the rendezvous message h from its sender into dst; 0 or an errno. A buffer in t3d memory is
 * mapped and copied with non-temporal stores (mapped.c's reason: the kernel's copy is several times slower); if the
 * mapping fails, the sender's buffer is still there to read the other way. */
static int read_remote(t3d_shm_p2p_t *p, const slot_hdr_t *h, void *dst, size_t len) {
  if (h->mkey != 0) {
    char why[200];
    const char *src = t3d__mem_peer((int)h->pid, h->mkey, h->moff, len, why, sizeof why);
    if (src != NULL) {
      t3d__shm_copy(dst, src, len, p->shm->nt && len >= p->shm->nt_min);
      return 0;
    }
    T3D_WARN("point-to-point: mapping the sender's t3d memory failed: %s; reading it with process_vm_readv", why);
  }
  return t3d__shm_cma_read(p->pid, h->pid, dst, h->addr, len);
}

/* Delivers the message (src, h; eager payload at data) into receive r. */
static void deliver(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r, int src, const slot_hdr_t *h,
                    const void *data) {
  t3d_comm_t *c = p->comm;
  size_t es = t3d_dtype_size(r->dtype);
  size_t cap = r->count * es;
  int too_long = h->len > cap && !(r->flags & T3D_FLAG_RECV_TRUNCATE);
  size_t n = h->len < cap ? (size_t)h->len : cap;
  char msg[512];
  if (h->kind == MSG_RENDEZVOUS) {
    _Atomic uint64_t *w = record(p, src, h->rec);
    uint64_t expect = REC_WORD(h->gen, REC_POSTED);
    int staged = !too_long && p->stages != NULL && h->mkey == 0 && src != p->rank && n >= p->stage_min;
    if (staged) t3d__shm_stage_open(p, src, h, n);
    if (!atomic_compare_exchange_strong(w, &expect, REC_WORD(h->gen, REC_READING))) {
      snprintf(msg, sizeof msg, "t3d: recv from rank %d on group '%s' (rank %d, tag %lld): the sender gave the "
               "message up (its send timed out or was aborted)", src, c->name, c->rank, (long long)r->tag);
      finish(p, d, r, T3D_ERR_ABORTED, msg);
      return;
    }
    int err = too_long ? 0 : staged ? t3d__shm_stage_read(p, src, h, r->recvbuf, n) : read_remote(p, h, r->recvbuf, n);
    atomic_store_explicit(w, REC_WORD(h->gen, REC_DONE), memory_order_release);
    ring_bell(p, src);
    if (err == ESRCH) { /* the sender's process is gone or exiting (its memory already torn down) */
      fail_lost(p, d, r, src, h->pid);
      return;
    }
    if (err != 0) {
      snprintf(msg, sizeof msg, "t3d: recv from rank %d on group '%s' (rank %d, tag %lld): reading %zu bytes from "
               "the sender's memory (process_vm_readv) failed: %s; set T3D_SHM_P2P=0 to send point-to-point "
               "through UCX", src, c->name, c->rank, (long long)r->tag, n, strerror(err));
      finish(p, d, r, T3D_ERR_SYSTEM, msg);
      return;
    }
  } else if (!too_long && n > 0) {
    memcpy(r->recvbuf, data, n);
  }
  if (too_long) {
    snprintf(msg, sizeof msg, "t3d: recv on group '%s' (rank %d, tag %lld): the message is larger than the "
             "%zu-element receive buffer", c->name, c->rank, (long long)r->tag, r->count);
    finish(p, d, r, T3D_ERR_MISMATCH, msg);
    return;
  }
  r->source = src;
  r->recv_count = (size_t)h->len / es;
  finish(p, d, r, T3D_OK, NULL);
}

static void unlink_recv(t3d_shm_p2p_t *p, t3d_request_t **link, t3d_request_t *prev) {
  t3d_request_t *r = *link;
  *link = r->next;
  if (p->recvs_tail == r) p->recvs_tail = prev;
  if (r->root == T3D_ANY_SOURCE) p->want_any--;
  else p->want[r->root]--;
}

static const void *payload(const slot_hdr_t *sh) {
  return sh->len <= SLOT_INLINE ? (const void *)sh->inline_data : (const void *)(sh + 1);
}

/* Consumes every message waiting in src's ring: into the oldest posted receive that accepts it, or the unexpected
 * queue. */
static int scan_ring(t3d_shm_p2p_t *p, done_list_t *d, int src) {
  char *rg = ring(p, src, p->rank);
  ring_ctl_t *ctl = (ring_ctl_t *)(void *)rg;
  uint64_t t = p->tail[src];
  int n = 0;
  for (;; t++, n++) {
    const slot_hdr_t *sh = slot(p, rg, t);
    if (atomic_load_explicit(&sh->seq, memory_order_acquire) != t + 1) break;
    t3d_request_t **link = &p->recvs, *prev = NULL;
    while (*link != NULL && !accepts(*link, src, sh->tag)) {
      prev = *link;
      link = &(*link)->next;
    }
    if (*link != NULL) {
      t3d_request_t *r = *link;
      unlink_recv(p, link, prev);
      deliver(p, d, r, src, sh, payload(sh));
    } else {
      unexp_t *u = calloc(1, sizeof *u);
      if (u != NULL && sh->kind == MSG_EAGER && sh->len > 0) {
        u->data = malloc((size_t)sh->len);
        if (u->data == NULL) {
          free(u);
          u = NULL;
        }
      }
      if (u == NULL) break; /* out of memory: leave it in the ring and try again later */
      u->src = src;
      memcpy(&u->h, sh, sizeof u->h); /* the slot stays as it is until the tail passes it */
      if (u->data != NULL) memcpy(u->data, payload(sh), (size_t)sh->len);
      if (p->unexp_tail != NULL) p->unexp_tail->next = u;
      else p->unexp = u;
      p->unexp_tail = u;
    }
    atomic_store_explicit(&ctl->tail, t + 1, memory_order_release);
  }
  p->tail[src] = t;
  if (n > 0) ring_bell(p, src); /* its queued sends may fit now */
  return n;
}

static void post_recv(t3d_shm_p2p_t *p, done_list_t *d, t3d_request_t *r) {
  unexp_t *prev = NULL;
  for (unexp_t *u = p->unexp; u != NULL; prev = u, u = u->next) {
    if (!accepts(r, u->src, u->h.tag)) continue;
    if (prev != NULL) prev->next = u->next;
    else p->unexp = u->next;
    if (p->unexp_tail == u) p->unexp_tail = prev;
    deliver(p, d, r, u->src, &u->h, u->data);
    free(u->data);
    free(u);
    return;
  }
  r->next = NULL;
  if (p->recvs_tail != NULL) p->recvs_tail->next = r;
  else p->recvs = r;
  p->recvs_tail = r;
  if (r->root == T3D_ANY_SOURCE) p->want_any++;
  else p->want[r->root]++;
}

/* ---------- passes ---------- */

/* Fails what waits on a rank whose process has exited (checked every liveness_ns, as collective waits check the
 * ranks they wait for): a receive from it, a send queued for it, a rendezvous send it was to read. Without this a
 * peer killed mid-exchange left the other side waiting for its whole timeout. An any-source receive waits on:
 * another rank may still send. */
static void fail_lost_peers(t3d_shm_p2p_t *p, done_list_t *d, uint64_t now) {
  if (p->shm->liveness_ns == 0 || now - p->alive_checked < p->shm->liveness_ns) return;
  p->alive_checked = now;
  int32_t pid;
  for (t3d_request_t **l = &p->recvs, *prev = NULL; *l != NULL;) {
    t3d_request_t *r = *l;
    if (r->root == T3D_ANY_SOURCE || (pid = peer_gone(p, r->root)) == 0) {
      prev = r;
      l = &r->next;
      continue;
    }
    unlink_recv(p, l, prev);
    fail_lost(p, d, r, r->root, pid);
  }
  for (int q = 0; q < p->size && p->queued > 0; q++) {
    if (p->sendq_head[q] == NULL || (pid = peer_gone(p, q)) == 0) continue;
    while (p->sendq_head[q] != NULL) {
      t3d_request_t *r = p->sendq_head[q];
      p->sendq_head[q] = r->next;
      p->queued--;
      fail_lost(p, d, r, r->root, pid);
    }
    p->sendq_tail[q] = NULL;
  }
  for (t3d_request_t **l = &p->rdv; *l != NULL;) {
    t3d_request_t *r = *l;
    _Atomic uint64_t *w = record(p, p->rank, r->shm_rec);
    if (atomic_load_explicit(w, memory_order_acquire) == REC_WORD(r->shm_gen, REC_DONE) ||
        (pid = peer_gone(p, r->root)) == 0) {
      l = &r->next; /* done ones: reap_rdv completes them */
      continue;
    }
    /* Its reader is gone (whether or not it had begun to read): nobody will mark the record done. */
    atomic_store_explicit(w, REC_WORD(r->shm_gen, REC_IDLE), memory_order_release);
    *l = r->next;
    p->free_recs[p->nfree++] = r->shm_rec;
    fail_lost(p, d, r, r->root, pid);
  }
}

/* Fails what passed its deadline (everything, on abort) and reaps finished rendezvous sends. */
static void expire(t3d_shm_p2p_t *p, done_list_t *d, uint64_t now, int aborted) {
  t3d_result_t res = aborted ? T3D_ERR_ABORTED : T3D_ERR_TIMEOUT;
  for (t3d_request_t **l = &p->recvs, *prev = NULL; *l != NULL;) {
    t3d_request_t *r = *l;
    if (!aborted && !past_deadline(r, now)) {
      prev = r;
      l = &r->next;
      continue;
    }
    unlink_recv(p, l, prev);
    fail(p, d, r, res);
  }
  for (int q = 0; q < p->size && p->queued > 0; q++) {
    t3d_request_t **l = &p->sendq_head[q], *prev = NULL;
    while (*l != NULL) {
      t3d_request_t *r = *l;
      if (!aborted && !past_deadline(r, now)) {
        prev = r;
        l = &r->next;
        continue;
      }
      *l = r->next;
      if (p->sendq_tail[q] == r) p->sendq_tail[q] = prev;
      p->queued--;
      fail(p, d, r, res);
    }
  }
  reap_rdv(p, d, now, aborted);
}

/* One pass with mu held: queued sends into rings, rings into receives, finished rendezvous, deadlines. now: the
 * time, when the caller has just read it, else 0. */
static int pass(t3d_shm_p2p_t *p, done_list_t *d, uint64_t now) {
  int before = atomic_load_explicit(&p->active, memory_order_relaxed);
  if (p->queued > 0) drain_sendq(p, d);
  if (p->stages != NULL && p->rdv != NULL) t3d__shm_stage_sends(p);
  if (p->want_any > 0) {
    for (int i = 0; i < p->size; i++) scan_ring(p, d, (p->rank + i) % p->size);
  } else if (p->recvs != NULL) {
    for (int i = 0; i < p->size; i++) {
      int q = (p->rank + i) % p->size;
      if (p->want[q] > 0) scan_ring(p, d, q);
    }
  }
  int aborted = atomic_load(&p->comm->aborted);
  int pending = p->rdv != NULL || p->recvs != NULL || p->queued > 0;
  /* Deadlines are milliseconds away and lost peers are looked for every liveness_ns: a pass reads the clock for
   * them only every PASSES_PER_CLOCK passes (a clock read costs about as much as the rest of an idle pass, and a
   * waiter runs a pass per poll), or when its caller has just read it. */
  if (aborted || (pending && (now != 0 || ++p->unclocked >= PASSES_PER_CLOCK))) {
    p->unclocked = 0;
    if (now == 0) now = t3d__now_ns();
    expire(p, d, now, aborted); /* also completes finished rendezvous sends */
    if (!aborted) fail_lost_peers(p, d, now);
  } else if (p->rdv != NULL) {
    reap_rdv(p, d, 0, 0); /* finished rendezvous sends complete at once */
  }
  return before - atomic_load_explicit(&p->active, memory_order_relaxed);
}

void t3d__shm_p2p_post(t3d_shm_p2p_t *p, t3d_request_t **reqs, int n) {
  done_list_t d = {NULL};
  int aborted = atomic_load(&p->comm->aborted);
  pthread_mutex_lock(&p->mu);
  for (int i = 0; i < n; i++) {
    t3d_request_t *r = reqs[i];
    r->on_shm = 1;
    if (r->parent != NULL) r->parent->on_shm = 1;
    atomic_fetch_add_explicit(&p->active, 1, memory_order_relaxed);
    if (aborted) fail(p, &d, r, T3D_ERR_ABORTED); /* an aborted communicator moves no more messages */
    else if (r->kind == T3D_OP_SEND) post_send(p, &d, r);
    else post_recv(p, &d, r);
  }
  pass(p, &d, 0);
  pthread_mutex_unlock(&p->mu);
  complete_all(&d);
}

/* A pass unless another thread is running one (then *ran = 0); returns how many requests it completed. now: as
 * pass's. */
static int try_pass(t3d_shm_p2p_t *p, int *ran, uint64_t now) {
  *ran = pthread_mutex_trylock(&p->mu) == 0;
  if (!*ran) return 0;
  done_list_t d = {NULL};
  int n = pass(p, &d, now);
  pthread_mutex_unlock(&p->mu);
  complete_all(&d);
  return n;
}

int t3d__shm_p2p_progress(t3d_shm_p2p_t *p) {
  if (p == NULL || atomic_load_explicit(&p->active, memory_order_relaxed) == 0) return 0;
  int ran;
  return try_pass(p, &ran, 0);
}

t3d_result_t t3d__shm_p2p_attach(t3d_comm_t *comm, t3d_shm_t *shm, t3d_shm_p2p_t **out) {
  *out = NULL;
  if (shm == NULL || !shm->p2p_ok || shm->p2p_slots == 0) return T3D_OK;
  t3d_result_t res = p2p_new(comm, shm, shm->p2p_region, shm->p2p_eager, shm->p2p_slots, shm->p2p_stage, out);
  if (res != T3D_OK) return t3d__set_error(comm, res, "t3d_comm_init: out of memory for point-to-point state");
  shm->p2p = *out;
  return T3D_OK;
}

void t3d__shm_p2p_sleep(t3d_shm_p2p_t *p, const t3d_request_t *req, uint64_t max_ns) {
  bell_t *b = bell(p, p->rank);
  uint32_t v = atomic_load_explicit(&b->bell, memory_order_relaxed);
  atomic_fetch_add_explicit(&b->sleepers, 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);
  /* A last pass after announcing the sleep: what peers published before it is seen here; anything later rings.
   * When another thread holds mu, it is mid-pass: do not sleep. */
  int ran;
  if (try_pass(p, &ran, t3d__now_ns()) == 0 && ran && !atomic_load_explicit(&req->done, memory_order_acquire)) {
    struct timespec ts = {(time_t)(max_ns / 1000000000u), (long)(max_ns % 1000000000u)};
    t3d__shm_set_cpu(p->shm, 0u); /* asleep: peers' waits must not spin for it (t3d__shm_peer_running) */
    syscall(SYS_futex, (void *)&b->bell, FUTEX_WAIT, v, &ts, NULL, 0);
    t3d__shm_note_cpu(p->shm);
  }
  atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_relaxed);
}
