/* shm/stage.c: the staging areas of point-to-point over the segment, one per ordered pair of ranks (p2p.c sends
 * and matches the messages; docs/architecture.md, "Point-to-point on one host").
 *
 * A long message whose receiver chooses the area travels through it in chunks, two copies pipelined. The receiver
 * opens the transfer (its length, its chunk size and a claim word that both sides take chunks from with a CAS),
 * then takes the sender's record (POSTED -> READING). The sender, in its passes, copies the chunks it claims into
 * the area's free slots; the receiver copies them out, and reads the chunks it claims itself straight from the
 * sender's memory (process_vm_readv) when nothing is staged: the sender is busy elsewhere or not scheduled. So the
 * receiver alone can always finish, as with one process_vm_readv, and the sender never waits for a slot. */
#include "p2p_state.h"

#include <errno.h>
#include <sched.h>
#include <string.h>

/* How long a receiver waits for a staged chunk before it reads one itself. */
#define STAGE_WAIT_NS 20000u

/* The head of an ordered pair's staging area (then T3D_STAGE_SLOTS chunks, from the next page). The sender alone
 * writes `ready` and `idx`, the receiver alone `freed`, `len` and `chunk`; both take chunks of the open transfer
 * from `claim`. */
typedef struct stage_ctl {
  _Atomic uint64_t ready; /* chunks staged so far, over the pair's life (sender's release store, after the copy) */
  uint32_t idx[T3D_STAGE_SLOTS]; /* the chunk of the transfer that slot i holds */
  char pad0[64 - 8 - 4 * T3D_STAGE_SLOTS];
  _Atomic uint64_t freed; /* chunks copied out (receiver) */
  char pad1[56];
  _Atomic uint64_t claim; /* transfer id << 32 | the next chunk nobody has taken */
  _Atomic uint64_t len;   /* the open transfer's bytes (written before claim) */
  _Atomic uint64_t chunk; /* and its chunk: an eighth of it, from 16 KiB up to a slot */
  char pad2[40];
} stage_ctl_t;
_Static_assert(sizeof(stage_ctl_t) == 192, "three lines");

static size_t stage_stride(size_t stage) { return 4096 + stage; }

static stage_ctl_t *stage(const t3d_shm_p2p_t *p, int src, int dst) {
  size_t pair = (size_t)dst * (size_t)(p->size - 1) + (size_t)(src < dst ? src : src - 1);
  return (stage_ctl_t *)(void *)(p->stages + pair * stage_stride(p->stage_chunk * T3D_STAGE_SLOTS));
}

static char *stage_slot(const t3d_shm_p2p_t *p, stage_ctl_t *sc, uint64_t i) {
  return (char *)sc + 4096 + (size_t)(i % T3D_STAGE_SLOTS) * p->stage_chunk;
}

/* A rendezvous message's transfer id (its record and generation); the receiver opens a transfer with it. */
static uint32_t xfer_id(uint32_t rec, uint64_t gen) { return rec << 24 | (uint32_t)(gen & 0xffffffu); }

/* Copies chunks of rendezvous send r into its pair's staging area while its receiver has the transfer open and a
 * slot is free; never waits. The record must say READING: the receiver opens the transfer before it takes the
 * record, and a send that is still POSTED may yet be given up, which would leave staged chunks nobody reads. */
static void stage_send(t3d_shm_p2p_t *p, t3d_request_t *r) {
  if (atomic_load_explicit(record(p, p->rank, r->shm_rec), memory_order_acquire) !=
      REC_WORD(r->shm_gen, REC_READING))
    return;
  stage_ctl_t *sc = stage(p, p->rank, r->root);
  uint32_t id = xfer_id(r->shm_rec, r->shm_gen);
  uint64_t c = atomic_load_explicit(&sc->claim, memory_order_acquire);
  if ((uint32_t)(c >> 32) != id) return; /* the receiver reads this one another way */
  size_t len = (size_t)atomic_load_explicit(&sc->len, memory_order_relaxed);
  size_t chunk = (size_t)atomic_load_explicit(&sc->chunk, memory_order_relaxed);
  uint64_t nch = (len + chunk - 1) / chunk;
  uint64_t ready = atomic_load_explicit(&sc->ready, memory_order_relaxed);
  while ((uint32_t)c < nch) {
    /* Acquire: the receiver has copied out the slot this chunk overwrites. */
    if (ready - atomic_load_explicit(&sc->freed, memory_order_acquire) >= T3D_STAGE_SLOTS) return;
    if (!atomic_compare_exchange_weak_explicit(&sc->claim, &c, c + 1, memory_order_acquire, memory_order_acquire)) {
      if ((uint32_t)(c >> 32) != id) return;
      continue;
    }
    size_t off = (size_t)(uint32_t)c * chunk, m = len - off < chunk ? len - off : chunk;
    /* Where cores may sit on different last-level caches, the chunk goes to memory: read from the writer's L3 in
     * the other complex it took 4-6x as long in half of the runs (64 MiB one way: 22-34 ms against 4-6). */
    t3d__shm_copy(stage_slot(p, sc, ready), (const char *)r->sendbuf + off, m, p->shm->handoff_nt);
    sc->idx[ready % T3D_STAGE_SLOTS] = (uint32_t)c;
    atomic_store_explicit(&sc->ready, ++ready, memory_order_release);
    c++;
  }
}

void t3d__shm_stage_sends(t3d_shm_p2p_t *p) {
  for (t3d_request_t *r = p->rdv; r != NULL; r = r->next)
    if (r->root != p->rank) stage_send(p, r);
}

/* Opens the transfer of rendezvous message h (n bytes) through src's staging area, before the record is taken. */
void t3d__shm_stage_open(t3d_shm_p2p_t *p, int src, const slot_hdr_t *h, size_t n) {
  stage_ctl_t *sc = stage(p, src, p->rank);
  size_t chunk = (n / T3D_STAGE_SLOTS + 4095) / 4096 * 4096;
  if (chunk < 16384) chunk = 16384;
  if (chunk > p->stage_chunk) chunk = p->stage_chunk;
  atomic_store_explicit(&sc->len, n, memory_order_relaxed);
  atomic_store_explicit(&sc->chunk, chunk, memory_order_relaxed);
  atomic_store_explicit(&sc->claim, (uint64_t)xfer_id(h->rec, h->gen) << 32, memory_order_release);
}

/* Receives the open transfer of message h (n bytes) from src into dst: copies out what the sender stages, reads
 * the chunks it claims itself from the sender's memory when nothing is staged (at once, once the sender has let
 * a first wait of STAGE_WAIT_NS pass without staging anything), and stages this rank's own open sends meanwhile
 * (both directions of a ring shift move at once). Returns 0 or an errno; after an error it still takes every
 * chunk, so that the pair's area is left clean for the next transfer. */
int t3d__shm_stage_read(t3d_shm_p2p_t *p, int src, const slot_hdr_t *h, char *dst, size_t n) {
  stage_ctl_t *sc = stage(p, src, p->rank);
  size_t chunk = (size_t)atomic_load_explicit(&sc->chunk, memory_order_relaxed);
  uint64_t nch = (n + chunk - 1) / chunk, done = 0, staged = 0, read_self = 0;
  uint64_t freed = atomic_load_explicit(&sc->freed, memory_order_relaxed);
  uint64_t idle_since = 0, checked = t3d__now_ns();
  int nt = p->shm->nt && n >= p->shm->nt_min, err = 0;
  ring_bell(p, src); /* a sender asleep in its wait: stage */
  while (done < nch) {
    if (p->rdv != NULL) t3d__shm_stage_sends(p);
    if (atomic_load_explicit(&sc->ready, memory_order_acquire) != freed) {
      uint32_t k = sc->idx[freed % T3D_STAGE_SLOTS];
      size_t off = (size_t)k * chunk;
      if (err == 0) t3d__shm_copy(dst + off, stage_slot(p, sc, freed), n - off < chunk ? n - off : chunk, nt);
      atomic_store_explicit(&sc->freed, ++freed, memory_order_release);
      ring_bell(p, src); /* a sender asleep with its slots full */
      done++;
      staged++;
      idle_since = 0;
      continue;
    }
    uint64_t now = t3d__now_ns();
    uint64_t c = atomic_load_explicit(&sc->claim, memory_order_relaxed);
    if ((uint32_t)c < nch) {
      /* Nothing staged: wait a little while the sender stages, else read a chunk from its memory. */
      if (staged > 0 || read_self == 0) {
        if (idle_since == 0) idle_since = now;
        if (now - idle_since < STAGE_WAIT_NS) {
          __builtin_ia32_pause();
          continue;
        }
      }
      if (!atomic_compare_exchange_strong_explicit(&sc->claim, &c, c + 1, memory_order_relaxed,
                                                   memory_order_relaxed))
        continue;
      size_t off = (size_t)(uint32_t)c * chunk, m = n - off < chunk ? n - off : chunk;
      if (err == 0) err = t3d__shm_cma_read(p->pid, h->pid, dst + off, h->addr + off, m);
      done++;
      read_self++;
      idle_since = 0;
      continue;
    }
    /* Every chunk is taken: the sender is copying its last ones (or its process died with one). Checked as often
     * as collective waits check their peers (T3D_SHM_LIVENESS_MS), every 10 ms where those checks are off: this
     * wait has no deadline. */
    if (now - checked > (p->shm->liveness_ns != 0 ? p->shm->liveness_ns : 10000000u)) {
      checked = now;
      if (peer_gone(p, src) != 0) return ESRCH;
    }
    if (idle_since == 0) idle_since = now;
    if (now - idle_since < STAGE_WAIT_NS) __builtin_ia32_pause();
    else sched_yield(); /* it may be waiting for this core */
  }
  return err;
}

size_t t3d__shm_stage_bytes(int n, size_t stage) {
  return stage == 0 || n < 2 ? 0 : (size_t)n * (size_t)(n - 1) * stage_stride(stage);
}

size_t t3d__shm_stage_size(int n) {
  /* 2 MiB per ordered pair (measured: 8 chunks of 256 KiB take 0.63-0.73 of the time of process_vm_readv for a 16-256
   * MiB ring shift at 2 ranks), fewer bytes where the group's areas would pass 16 MiB; chunks of at least 64 KiB.
   * None by default with more ranks on the host than cores: the sender and its receiver then seldom run at once,
   * and no gain was measured (4 ranks on 2 cores 0.9-1.2x, 8 ranks 0.8-1.5x). */
  const size_t unit = (size_t)T3D_STAGE_SLOTS << 16, most = (size_t)16 << 20;
  if (n < 2) return 0;
  int64_t want = t3d__param_int(T3D_PARAM_SHM_P2P_STAGE_BYTES);
  size_t st;
  if (want >= 0) {
    st = (size_t)want > most ? most : (size_t)want;
  } else if (t3d__oversubscribed()) {
    st = 0;
  } else {
    st = most / ((size_t)n * (size_t)(n - 1));
    if (st > ((size_t)2 << 20)) st = (size_t)2 << 20;
  }
  return st / unit * unit;
}
