/* shm.h: what the files of c_src/shm share: the layout of a communicator's shared-memory segment (segment.c makes,
 * maps and unmaps it), the per-rank state, the flag protocol (sync.c: steps, phases, waits), single copy (direct.c:
 * reading a peer's memory), point-to-point (p2p.c) and the copy / reduce loops (copy.c). The collectives, one file
 * each (allreduce.c for allreduce and reduce, broadcast.c, allgather.c, reduce_scatter.c, alltoall.c, barrier.c),
 * are built from these and declared below; the engine reaches them only through provider.c's table. */
#ifndef T3D_SHM_H
#define T3D_SHM_H

#include "comm.h"

#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Segment layout (every part 4 KiB aligned):
 *   header   one page: magic, rank count, bytes per half (rank 0 decides; the others adopt it)
 *   control  per rank T3D_SHM_CTRL_STRIDE bytes: its progress flag alone in the first 64 bytes and, in the next 64
 *            (the adjacent-line prefetcher fetches lines in pairs), the count of ranks asleep on that flag and the
 *            CPU the rank last ran t3d code on; then one 64-byte op-info line per half and per small slot, then a
 *            pair of lines whose first holds the collective the rank runs now (t3d__shm_opline: read by peers only
 *            to explain a mismatch)
 *   data     per rank two halves of `half` bytes; step t of the communicator uses half t & 1 of every rank
 *   small    per rank T3D_SHM_SMALL_SLOTS slots of T3D_SHM_SMALL_BYTES: small broadcasts use them in turn instead of
 *            the halves, so that a root may run that many broadcasts ahead of its slowest reader
 *   p2p      point-to-point (p2p.c): per rank T3D_SHM_P2P_RECORDS rendezvous records, then one ring of slots per
 *            ordered pair (sender, receiver), then (when p2p_stage is not 0) one staging area per ordered pair of
 *            two ranks
 * A rank writes only its own flag, info lines and halves (and, in p2p, what p2p.c says). */
#define T3D_SHM_MAGIC 0x3730304d48534433ull /* "3DSHM007" */
#define T3D_SHM_SMALL_SLOTS 16
#define T3D_SHM_SMALL_BYTES 16384
/* A multiple of 128 bytes, so that no rank's flag line shares a prefetched pair of lines with another rank's. */
#define T3D_SHM_CTRL_STRIDE (128 + 64 * (2 + T3D_SHM_SMALL_SLOTS) + 128)
_Static_assert(T3D_SHM_CTRL_STRIDE % 128 == 0, "control areas are whole pairs of lines");
#define T3D_SHM_SLEEPERS_OFFSET 64
#define T3D_SHM_CPU_OFFSET 96
#define T3D_SHM_PID_OFFSET 100
#define T3D_SHM_INFO_OFFSET 128
#define T3D_SHM_PAGE 4096

typedef struct t3d_shm_header {
  uint64_t magic;
  uint64_t nranks;
  uint64_t half;
  uint64_t total;
  uint64_t p2p_eager; /* point-to-point: bytes a slot carries (p2p.c) */
  uint64_t p2p_slots; /* slots per ring */
  uint64_t p2p_stage; /* bytes of each ordered pair's staging area (0: none) */
  /* The first rank whose operation broke the communicator tells the others here (t3d__shm_report_failure): it
   * claims `failed` (its rank + 1), writes its result code and error text, then sets `failed_ready`. Waits read
   * `failed` now and then (t3d__shm_wait_line, t3d__shm_wait_each) and fail with that rank's error. */
  _Atomic uint64_t failed;
  int64_t failed_code;
  _Atomic uint64_t failed_ready;
  char failed_msg[1024];
} t3d_shm_header_t;
_Static_assert(sizeof(t3d_shm_header_t) <= T3D_SHM_PAGE, "the header is one page");

/* Written by a rank into the info line of the half it uses, before it publishes the first step of an operation;
 * readers compare it with their own view of the operation to catch ranks that disagree. */
typedef struct t3d_shm_info {
  uint64_t kind; /* the operation: its sequence number << 8 | its T3D_OP_* (t3d__shm_info_kind) */
  uint64_t sig;  /* size signature: what all ranks must agree on */
  uint64_t aux;  /* alltoallv: the largest block this rank sends */
  uint64_t addr; /* single-copy allgatherv: where this rank's block is, in its process */
  int64_t pid;   /* this rank's process, for reading at addr */
  uint64_t spare[2];
  /* Set to phase base + 1 of the step, after the rank posted that phase, by a one-shot allreduce / reduce: a
   * reader that sees it knows the phase is posted without reading the flag's line (t3d__shm_wait_line), and has
   * kind, size and (up to T3D_SHM_INLINE_DATA bytes) the vector in this line. Steps that do not set it leave an
   * earlier step's phase here, which no later wait asks for. */
  _Atomic uint64_t seq;
} t3d_shm_info_t;
_Static_assert(sizeof(t3d_shm_info_t) == 64, "an info line is one cache line");
/* A one-shot allreduce / reduce of at most this many bytes writes its vector into the info line in place of aux,
 * addr, pid and spare (allreduce.c). */
#define T3D_SHM_INLINE_DATA (offsetof(t3d_shm_info_t, seq) - offsetof(t3d_shm_info_t, aux))

struct t3d_shm {
  char *base;
  size_t map_bytes;
  int rank, size;
  char *ctrl, *data, *small;
  size_t half; /* bytes of one half */
  /* Protocol state, identical on every rank because every rank runs the same operations in the same order. */
  uint64_t phase;      /* the last phase value handed out */
  uint64_t step;       /* steps begun (selects the half) */
  uint64_t free_at[2]; /* phase every rank must have reached before half h may be written again */
  uint64_t small_steps;                     /* small steps begun (selects the slot) */
  uint64_t free_small[T3D_SHM_SMALL_SLOTS]; /* the same for each small slot */
  uint64_t seen_all;   /* a phase every rank is known to have reached */
  /* Tuning, read once at init. */
  size_t oneshot_max; /* allreduce / reduce up to this many bytes: one-shot */
  size_t chunk;       /* allreduce / reduce above it: bytes per reduce-scatter + allgather step */
  size_t nt_min;      /* operations of at least this many bytes write user buffers with non-temporal stores
                       * (measured here: they win from 4 MiB, lose at 2 MiB, where the output still fits the caches) */
  int nt;             /* the CPU has a non-temporal store path */
  int handoff_nt;     /* and data that another core reads next (the broadcast root's half) may take it: where cores
                       * may sit on different last-level caches (t3d__shm_llc_may_split) */
  int cpu_aware;      /* as many ranks as cores: publish the CPU, spin while the awaited peer runs elsewhere */
  char *p2p_region;   /* point-to-point rings and records (p2p.c) */
  size_t p2p_eager;
  unsigned p2p_slots;
  size_t p2p_stage;
  int p2p_ok;         /* every rank can use the region (cross-memory attach works, T3D_SHM_P2P is not 0) */
  size_t direct_min;  /* allgatherv blocks of direct_min to direct_max bytes are read straight from the owner's
                       * buffer (direct.c, "single copy"); 0: never (rank 0's choice for all) */
  size_t direct_max;
  size_t a2a_direct_min; /* the same for alltoallv blocks, whose range differs when oversubscribed */
  size_t a2a_direct_max;
  size_t bcast_direct_min; /* broadcasts of bcast_direct_min to bcast_direct_max bytes: the readers read the root's
                            * buffer (broadcast.c, single copy); 0: never (rank 0's choice for all) */
  size_t bcast_direct_max;
  size_t mapped_min;  /* collectives of at least this many bytes first offer their buffers as t3d memory (mapped.c);
                       * 0: never (rank 0's choice for all) */
  char **m_in, **m_out; /* scratch: a mapped collective's buffers of every rank, mapped here */
  size_t place_min;   /* allgather / alltoall of at least this many bytes time the ranks' placement first
                       * (t3d__shm_far); 0: never (rank 0's choice for all) */
  uint64_t far_ns;    /* a probe round longer than this: the ranks sit far apart */
  int far_now;        /* what the last timed probe found */
  uint64_t may_probe; /* operations that could have probed: one in PROBE_EVERY does (sync.c) */
  uint64_t probes;    /* probes run (tests count them) */
  uint32_t offer_gap;   /* offers nobody took in a row make the next ones rarer (mapped.c): skip this many, */
  uint32_t offer_skip;  /* of which this many are left */
  int pid;            /* this process */
  t3d_shm_p2p_t *p2p; /* the communicator's point-to-point over the region, once made (comm.c) */
  int *pending;       /* scratch: ranks still awaited */
  const void **srcs;  /* scratch: one source per rank */
  size_t *offs;       /* scratch: one offset per rank */
  uint64_t *raddr;    /* scratch: alltoallv, where each peer's block for this rank is, in its process */
  int *rpid;          /* scratch: each peer's process */
  char name[64];
  int wake_pending; /* a t3d__shm_post_lazy has not checked for sleepers yet (t3d__shm_settle) */
  uint64_t op_seq;      /* the collective this rank runs now (t3d__exec_shm), for its info lines */
  uint32_t op_fp;       /* and its fingerprint (t3d_exec_t.fp) */
  uint64_t liveness_ns; /* how often a wait checks that the ranks it waits for still have a process (0: never) */
  uint64_t alive_checked; /* when it last did */
};

/* What an info line's kind word holds for this rank's current collective: its sequence number (low 28 bits) << 36
 * | its fingerprint (dtype, reduce op, root: T3D_FP_BITS) << 8 | its T3D_OP_*. One compare checks all of them. */
static inline uint64_t t3d__shm_info_kind(const t3d_shm_t *s, int kind) {
  return (s->op_seq & 0xfffffffull) << 36 | (uint64_t)s->op_fp << 8 | (uint64_t)kind;
}
static inline uint64_t t3d__shm_kind_seq(uint64_t w) { return w >> 36; }
static inline uint32_t t3d__shm_kind_fp(uint64_t w) { return (uint32_t)(w >> 8) & ((1u << T3D_FP_BITS) - 1); }
static inline int t3d__shm_kind_op(uint64_t w) { return (int)(w & 0xff); }

/* ---------- the provider's operations (provider.c puts them in its table) ----------
 * The collectives have the t3d_coll_ops_t signatures and contracts (c_src/provider.h). */
/* Posts n sends and receives (host memory, in issue order) and runs a pass; completes what finished. */
void t3d__shm_p2p_post(t3d_shm_p2p_t *p, t3d_request_t **reqs, int n);
/* Runs a pass unless another thread is running one; returns how many requests completed. */
int t3d__shm_p2p_progress(t3d_shm_p2p_t *p);
/* Nonzero while some posted request has not completed. */
int t3d__shm_p2p_active(t3d_shm_p2p_t *p);
/* For a waiter on req with nothing left to poll: sleeps until a peer publishes something for this rank (or frees
 * room it waits for), at most max_ns. */
void t3d__shm_p2p_sleep(t3d_shm_p2p_t *p, const t3d_request_t *req, uint64_t max_ns);
t3d_result_t t3d__shm_allreduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                t3d_redop_t op);
t3d_result_t t3d__shm_reduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                             t3d_redop_t op, int root);
t3d_result_t t3d__shm_reduce_scatterv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                      t3d_dtype_t dt, t3d_redop_t op);
t3d_result_t t3d__shm_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root);
t3d_result_t t3d__shm_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                 const size_t *displs_bytes);
/* Counts and displacements in elements of es bytes; equal: blocks of one size at consecutive places (t3d_alltoall),
 * as every rank was told. */
t3d_result_t t3d__shm_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es, int equal);
t3d_result_t t3d__shm_barrier(t3d_exec_t *ex);
/* Collectives a caller starts on its own thread, in parts: start publishes what this rank contributes and never
 * waits; start_wait waits until rank `who` (-1: every other rank) has published (T3D_OK), for about `limit_ns`
 * (then T3D_IN_PROGRESS) or until an error (abort, deadline); finish waits for the rest and completes. Between start
 * and finish no other operation may run on the communicator. They take the same steps as the queued versions, so
 * ranks may take either path.
 *   allreduce: oneshot_*, when oneshot_fits says the size qualifies and the half is free; who = -1.
 *   broadcast: bcast_*, when bcast_fits (one half; the root needs it free; single copy: any size in its range, every
 *              rank needs the next half free); through the segment the root is done after start, the others wait
 *              for who = root; single copy: the root waits for who = -1 (its readers' phase 1) too.
 *   barrier:   barrier_*; who = -1.
 *   allgatherv: gather_*, when gather_fits (every block fits one half or is in the single-copy range; the next
 *              half must be free); who = -1; counts and displacements in elements of es bytes. Single copy's
 *              finish also waits until every peer has read this rank's block.
 *   reduce_scatterv: rs_*, when rs_fits (one step; the half must be free) and the output does not overlap the
 *              input; who = -1 (a rank whose own block is empty waits for nobody: finish right after start).
 *   alltoallv: a2a_*, when a2a_fits (this rank's blocks to others fit one piece of a half, or are equal blocks
 *              (equal: from t3d_alltoall) in the single-copy range; the next half must be free) and the receive
 *              blocks do not overlap the send blocks; who = -1. Finish runs any further steps that peers with
 *              larger blocks need, or, for single copy, waits until every peer has read this rank's blocks. */
t3d_result_t t3d__shm_start_wait(t3d_exec_t *ex, const t3d_shm_resume_t *rs, int who, uint64_t limit_ns);
int t3d__shm_oneshot_fits(t3d_shm_t *shm, size_t bytes);
/* Asks for ownership of the lines a one-shot allreduce of `bytes` will write next, so that the transfer from the
 * peer that read them last overlaps the call's set-up (a hint: it changes nothing). */
void t3d__shm_oneshot_warm(t3d_shm_t *shm, size_t bytes);
/* The same for the root of a broadcast of `bytes`. */
void t3d__shm_bcast_warm(t3d_shm_t *shm, size_t bytes);
t3d_result_t t3d__shm_oneshot_start(t3d_exec_t *ex, const void *sendbuf, size_t bytes, t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_oneshot_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf, void *recvbuf,
                                     size_t count, t3d_dtype_t dt, t3d_redop_t op);
int t3d__shm_bcast_fits(t3d_shm_t *shm, size_t bytes, int root);
t3d_result_t t3d__shm_bcast_start(t3d_exec_t *ex, const void *buf, size_t bytes, int root, t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_bcast_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, void *buf, size_t bytes, int root);
int t3d__shm_gather_fits(t3d_shm_t *shm, size_t total_bytes, size_t max_block_bytes);
t3d_result_t t3d__shm_gather_start(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                   const size_t *displs, size_t es, t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_gather_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, void *recvbuf, const size_t *counts,
                                    const size_t *displs, size_t es);
int t3d__shm_rs_fits(t3d_shm_t *shm, size_t total_bytes, size_t max_block_bytes, size_t es);
t3d_result_t t3d__shm_rs_start(t3d_exec_t *ex, const void *sendbuf, const size_t *counts, t3d_dtype_t dt,
                               t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_rs_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf, void *recvbuf,
                                const size_t *counts, t3d_dtype_t dt, t3d_redop_t op);
int t3d__shm_a2a_fits(t3d_shm_t *shm, size_t max_send_block_bytes, int equal);
t3d_result_t t3d__shm_a2a_start(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                size_t es, int equal, t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_a2a_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs, const void *sendbuf,
                                 const size_t *scounts, const size_t *sdispls, void *recvbuf, const size_t *rcounts,
                                 const size_t *rdispls, size_t es, int equal);
void t3d__shm_barrier_start(t3d_exec_t *ex, t3d_shm_resume_t *rs);
t3d_result_t t3d__shm_barrier_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs);

static inline _Atomic uint64_t *t3d__shm_flag(const t3d_shm_t *s, int p) {
  return (_Atomic uint64_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE);
}
/* Ranks blocked in t3d__shm_sleep on rank p's flag: a post wakes them only when there are some. */
static inline _Atomic uint32_t *t3d__shm_sleepers(const t3d_shm_t *s, int p) {
  return (_Atomic uint32_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE + T3D_SHM_SLEEPERS_OFFSET);
}
/* Rank p's CPU + 1 as it last saw it while running (posting, or starting to wait); 0 while it sleeps on a futex or
 * before it first ran. A waiter whose peer shows another CPU than its own knows the peer is not queued behind it
 * and spins briefly instead of yielding (t3d__shm_backoff). Stale when the peer was preempted since: the cost is
 * one short spin. */
static inline _Atomic uint32_t *t3d__shm_cpu(const t3d_shm_t *s, int p) {
  return (_Atomic uint32_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE + T3D_SHM_CPU_OFFSET);
}
/* Rank p's process id, written once at init: a wait that finds it gone fails at once (sync.c). */
static inline _Atomic int32_t *t3d__shm_pid(const t3d_shm_t *s, int p) {
  return (_Atomic int32_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE + T3D_SHM_PID_OFFSET);
}
/* Publishes v (a CPU + 1, or 0 before sleeping on a futex) as this rank's CPU word, writing only a change. */
static inline void t3d__shm_set_cpu(t3d_shm_t *s, uint32_t v) {
  if (!s->cpu_aware) return;
  _Atomic uint32_t *c = t3d__shm_cpu(s, s->rank);
  if (atomic_load_explicit(c, memory_order_relaxed) != v) atomic_store_explicit(c, v, memory_order_relaxed);
}
static inline void t3d__shm_note_cpu(t3d_shm_t *s) {
  if (s->cpu_aware) t3d__shm_set_cpu(s, (uint32_t)sched_getcpu() + 1u);
}
/* Rank p's current collective: its kind word (t3d__shm_info_kind; t3d__exec_shm writes it, t3d__shm_check_info
 * quotes it). */
static inline _Atomic uint64_t *t3d__shm_opline(const t3d_shm_t *s, int p) {
  return (_Atomic uint64_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE + T3D_SHM_INFO_OFFSET +
                                      64 * (2 + T3D_SHM_SMALL_SLOTS));
}
static inline t3d_shm_info_t *t3d__shm_info(const t3d_shm_t *s, int p, int h) {
  return (t3d_shm_info_t *)(void *)(s->ctrl + (size_t)p * T3D_SHM_CTRL_STRIDE + T3D_SHM_INFO_OFFSET + 64 * h);
}
static inline char *t3d__shm_inline_data(const t3d_shm_t *s, int p, int h) {
  return (char *)t3d__shm_info(s, p, h) + offsetof(t3d_shm_info_t, aux);
}
/* h 0 and 1: the halves; 2 + j: small slot j (t3d__shm_step_begin_small). */
static inline char *t3d__shm_half(const t3d_shm_t *s, int p, int h) {
  if (h < 2) return s->data + ((size_t)p * 2 + (size_t)h) * s->half;
  return s->small + ((size_t)p * T3D_SHM_SMALL_SLOTS + (size_t)(h - 2)) * T3D_SHM_SMALL_BYTES;
}

/* ---------- helpers of the collectives ---------- */
static inline size_t t3d__shm_min_sz(size_t a, size_t b) { return a < b ? a : b; }
/* PREFETCHW: fetch the line for writing (the CPU flag "3dnowprefetch"; a NOP hint where absent). */
static inline void t3d__shm_prefetch_write(const void *p) {
#if defined(__x86_64__)
  __asm__ volatile("prefetchw (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 1);
#endif
}

/* ---------- protocol (sync.c) ----------
 * Each rank has one monotonically increasing flag. An operation is a sequence of steps; a step hands out a few
 * consecutive phase values (base + 1 .. base + k) and a rank stores base + j in its flag (release) once it has done
 * everything phase j of the step asks of it. Readers wait (acquire) until a peer's flag reaches the phase they need.
 * Before writing half h a rank waits until every rank has finished the previous step that used h: double
 * buffering, so that step t + 1 proceeds while slow ranks still read step t, and no barrier between operations. */
typedef struct t3d_shm_step {
  int h;         /* the half this step uses */
  uint64_t base; /* phases base + 1 .. base + nphases */
  uint64_t need; /* every rank past this phase before the half may be written */
  int first;     /* the operation's first step */
} t3d_shm_step_t;

void t3d__shm_step_begin(t3d_shm_t *s, int nphases, t3d_shm_step_t *st);
/* A step of at most T3D_SHM_SMALL_BYTES per rank in the next small slot; it leaves the halves' turn alone. */
void t3d__shm_step_begin_small(t3d_shm_t *s, int nphases, t3d_shm_step_t *st);
/* Whether every other rank has reached phase `need` by now (no waiting). */
int t3d__shm_all_past(t3d_shm_t *s, uint64_t need);
/* Whether the half the next step uses is free now (every rank past its previous use): the inline starts never wait
 * for it. */
static inline int t3d__shm_next_half_free(t3d_shm_t *s) { return t3d__shm_all_past(s, s->free_at[s->step & 1]); }
/* Waits until half st->h may be written (every rank past its previous use). */
t3d_result_t t3d__shm_step_acquire(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st);
void t3d__shm_wake(t3d_shm_t *s);
/* Publishes phase `value` and wakes the ranks asleep on this rank's flag. Sequentially consistent store and load,
 * paired with t3d__shm_sleep's: either the sleeper sees the new value or the poster sees the sleeper. */
static inline void t3d__shm_post(t3d_shm_t *s, uint64_t value) {
  t3d__shm_note_cpu(s);
  atomic_store_explicit(t3d__shm_flag(s, s->rank), value, memory_order_seq_cst);
  if (atomic_load_explicit(t3d__shm_sleepers(s, s->rank), memory_order_seq_cst) != 0) t3d__shm_wake(s);
  s->wake_pending = 0;
}
/* t3d__shm_post without the fence: the store leaves while the caller goes on, instead of stalling it (a cross-core
 * line transfer, a fair share of a sub-microsecond collective). The check for sleepers that the fence orders is
 * left to t3d__shm_settle, which t3d__shm_sleep runs before this rank blocks and a later t3d__shm_post covers
 * (flags only grow): a caller posts so before it returns from the operation. Each step's start settles too. */
static inline void t3d__shm_post_lazy(t3d_shm_t *s, uint64_t value) {
  t3d__shm_note_cpu(s);
  atomic_store_explicit(t3d__shm_flag(s, s->rank), value, memory_order_release);
  s->wake_pending = 1;
}
static inline void t3d__shm_settle(t3d_shm_t *s) {
  if (!s->wake_pending) return;
  s->wake_pending = 0;
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(t3d__shm_sleepers(s, s->rank), memory_order_seq_cst) != 0) t3d__shm_wake(s);
}
/* Blocks (futex) until rank p posts a value other than the one its flag holds now, unless that value is already
 * at least `target`, for at most max_ns. Returns early on any post; callers re-check. */
void t3d__shm_sleep(t3d_shm_t *s, int p, uint64_t target, uint64_t max_ns);
/* Waiting between polls of peer p's flag for `target`: t3d__backoff_poll's spin and yield phases, then sleeps of
 * up to 1 ms (so that callers still check abort and deadline), never past `until` (0: no limit). */
void t3d__shm_backoff(t3d_shm_t *s, t3d_backoff_t *b, int p, uint64_t target, uint64_t until);
/* With as many ranks as cores (cpu_aware): notes this rank's CPU and says whether some other rank shows another
 * one (it runs there now, unless preempted since: then the cost is one short spin). 0 otherwise. */
int t3d__shm_peer_running(t3d_shm_t *s);
/* Waits until rank `who` (-1: every other rank) has reached phase `target`; with `limit_ns` (0: none) gives up with
 * T3D_IN_PROGRESS after about that long. The first few polls do not read the clock (sync.c, QUICK_POLLS), so the
 * limit counts from the first that does. */
t3d_result_t t3d__shm_wait_until(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t limit_ns);
static inline t3d_result_t t3d__shm_wait(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target) {
  return t3d__shm_wait_until(s, ex, who, target, 0);
}
/* How a rank may show that it reached a phase besides its flag (t3d__shm_wait_line): its info line of half / slot
 * h holds `word` in seq. */
typedef struct t3d_shm_arrival {
  int h;
  uint64_t word;
} t3d_shm_arrival_t;
/* t3d__shm_wait_until, where a rank also counts as there once it shows so as `a` says (NULL: flags only). */
t3d_result_t t3d__shm_wait_line(t3d_shm_t *s, t3d_exec_t *ex, int who, uint64_t target, uint64_t limit_ns,
                                const t3d_shm_arrival_t *a);
/* Calls fn for every other rank as soon as it reaches `target` (ranks after this one first), or shows so as `a`
 * says (NULL: flags only). */
typedef void (*t3d_shm_peer_fn)(void *arg, int peer);
t3d_result_t t3d__shm_wait_each(t3d_shm_t *s, t3d_exec_t *ex, uint64_t target, const t3d_shm_arrival_t *a,
                               t3d_shm_peer_fn fn, void *arg);
/* Sets seq of st's info line to phase 1 of st, after the caller posted that phase (or a later one) to its flag: a
 * reader that waits on that line (t3d__shm_arrival) learns in one line that the phase is posted and what the
 * operation is, instead of reading the flag's line first (one cross-core transfer fewer per peer). The flag comes
 * first, so that a rank seen there is also at the phase by its flag. t3d__shm_post_arrived: both. */
static inline void t3d__shm_show_arrived(t3d_shm_t *s, const t3d_shm_step_t *st) {
  atomic_store_explicit(&t3d__shm_info(s, s->rank, st->h)->seq, st->base + 1, memory_order_release);
}
static inline void t3d__shm_post_arrived(t3d_shm_t *s, const t3d_shm_step_t *st) {
  t3d__shm_post(s, st->base + 1);
  t3d__shm_show_arrived(s, st);
}
/* What a reader of step st waits for in a peer's info line (t3d__shm_show_arrived). */
static inline t3d_shm_arrival_t t3d__shm_arrival(const t3d_shm_step_t *st) {
  t3d_shm_arrival_t a = {st->h, st->base + 1};
  return a;
}
/* Writes this rank's info line for the half of st (first step of an operation only). */
void t3d__shm_put_info(t3d_shm_t *s, const t3d_shm_step_t *st, int kind, uint64_t sig, uint64_t aux);
/* Writes this rank's info line for st with len <= T3D_SHM_INLINE_DATA bytes of data in it, in place of aux, addr
 * and pid (t3d__shm_inline_data): a step small enough to travel in one line per rank. */
static inline void t3d__shm_put_inline(t3d_shm_t *s, const t3d_shm_step_t *st, int kind, uint64_t sig,
                                       const void *data, size_t len) {
  t3d_shm_info_t *in = t3d__shm_info(s, s->rank, st->h);
  in->kind = t3d__shm_info_kind(s, kind);
  in->sig = sig;
  if (len > 0) memcpy(t3d__shm_inline_data(s, s->rank, st->h), data, len);
}
/* After waiting for peer's first phase: T3D_ERR_MISMATCH (with ex->error) unless it runs the same operation. */
t3d_result_t t3d__shm_check_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int peer, int kind,
                                 uint64_t sig);
/* t3d__shm_check_info for every other rank. */
/* The communicator's segment for the collective of ex, which it records as this rank's current one (its sequence
 * number goes into the info lines; peers quote it when they find a mismatch). Every shm collective starts here. */
static inline t3d_shm_t *t3d__exec_shm(t3d_exec_t *ex) {
  t3d_shm_t *s = ex->comm->shm;
  if (s->op_seq != ex->seq) {
    s->op_seq = ex->seq;
    s->op_fp = ex->fp;
    atomic_store_explicit(t3d__shm_opline(s, s->rank), t3d__shm_info_kind(s, ex->kind), memory_order_relaxed);
  }
  return s;
}
/* Tells the other ranks that this rank's operation broke the communicator (res, msg): the first such report wins,
 * and every wait of the others then fails with it (sync.c). */
void t3d__shm_report_failure(t3d_shm_t *s, t3d_result_t res, const char *msg);
/* Whether process pid is gone: no such process, or a zombie (direct.c; the liveness checks of waits and p2p.c). */
int t3d__shm_process_gone(int32_t pid);
t3d_result_t t3d__shm_check_all_info(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int kind,
                                     uint64_t sig);
/* For the one rank that writes in step st (a broadcast's root), after it showed the step's phase in its own line
 * (t3d__shm_show_arrived) and a sequentially consistent fence: T3D_ERR_MISMATCH, with what each called, if a peer
 * shows that phase in its line of st->h too, i.e. also writes in this step (names itself the root, or runs
 * another collective that publishes there). Of two such ranks the later one finds the other (the fences order
 * each one's store before its loads); in the usual case the peers' lines are not written meanwhile, so the loads
 * cost no transfer between cores. */
t3d_result_t t3d__shm_check_sole_writer(t3d_shm_t *s, t3d_exec_t *ex, const t3d_shm_step_t *st, int kind,
                                        uint64_t sig);

/* Sets the address in this rank's info line for the half of st (after t3d__shm_put_info). */
static inline void t3d__shm_put_addr(t3d_shm_t *s, const t3d_shm_step_t *st, const void *addr) {
  t3d__shm_info(s, s->rank, st->h)->addr = (uint64_t)(uintptr_t)addr;
}

/* ---------- placement ----------
 * Whether the ranks of a 2-rank group sit on different core complexes of the host ("far"): then a line one rank
 * wrote with plain stores reaches the other from the writer's cache across the host's fabric, which in one kind of
 * far placement is several times slower than from memory, and the large operations write their halves with
 * non-temporal stores instead. The placement changes while a job runs (a virtual machine's CPUs move between host
 * cores), so it is timed again and again: at every operation of `bytes` >= T3D_SHM_PROBE_EACH_BYTES, and else at
 * the first of the operations that may probe and at every 16th after it, a few rounds in which both ranks post a
 * phase and wait for the other's (a step of its own; a microsecond or two against milliseconds). Each rank decides
 * for its own writes alone, so the ranks need not agree on the answer, only on when to probe: `probe` and `bytes`
 * must be the same on every rank (they follow from the operation and its size). Returns T3D_OK with *far set (0
 * where the operation may not probe; else the last timed answer), or the wait's error. */
t3d_result_t t3d__shm_far(t3d_shm_t *s, t3d_exec_t *ex, int probe, size_t bytes, int *far);
/* From this size every operation that may probe does, its probe a few microseconds against milliseconds
 * (docs/architecture.md, "Placement probes"). */
#define T3D_SHM_PROBE_EACH_BYTES (8u * 1024u * 1024u)
/* Whether an allreduce, reduce_scatter, allgather or alltoall of `bytes` may probe (then it never starts in parts: a
 * probe waits); broadcast.c asks from its own threshold. */
static inline int t3d__shm_probes_from(const t3d_shm_t *s, size_t bytes, size_t min) {
  return s->place_min != 0 && bytes >= min;
}
static inline int t3d__shm_probes(const t3d_shm_t *s, size_t bytes) {
  return t3d__shm_probes_from(s, bytes, s->place_min);
}

/* ---------- single copy (direct.c) ----------
 * Copies len bytes at addr in process pid into dst: memcpy when pid is self_pid (ranks that are threads of one
 * process), else process_vm_readv (cross-memory attach). 0 or an errno. */
int t3d__shm_cma_read(int self_pid, int pid, void *dst, uint64_t addr, size_t len);
/* The word a rank reads in another rank's process at init to learn whether it may (its address travels with the
 * segment's name, segment.c), and what the reader may then do with that process's memory: T3D_SHM_PROBE_CMA, read
 * it; T3D_SHM_PROBE_P2P, also run point-to-point over shared memory. */
extern const uint64_t t3d__shm_cma_probe_word;
#define T3D_SHM_PROBE_CMA 1
#define T3D_SHM_PROBE_P2P 2
int t3d__shm_probe_bits(int pid, unsigned long long addr);
/* Unset T3D_SHM_DIRECT_MAX_BYTES on CPUs whose cores may sit on different L3s (AMD's): the largest allgather and
 * alltoall block read straight from its owner (docs/architecture.md, "Single copy"). */
#define T3D_SHM_DIRECT_MAX_SPLIT (2 * 1024 * 1024)
/* ... and the smallest allgather and alltoall blocks so read there. */
#define T3D_SHM_AG_DIRECT_MIN_SPLIT (1536 * 1024)
#define T3D_SHM_A2A_DIRECT_MIN_SPLIT (1024 * 1024)
/* Unset T3D_SHM_P2P_STAGE_MIN_BYTES on such CPUs: the shortest point-to-point message staged. */
#define T3D_SHM_P2P_STAGE_MIN_SPLIT (8 * 1024 * 1024)
/* With more ranks than cores, alltoall blocks from this size, while all n * n blocks together stay within
 * T3D_SHM_A2A_DIRECT_TOTAL (allgather: never). */
#define T3D_SHM_A2A_DIRECT_MIN_OVERSUBSCRIBED (32 * 1024)
#define T3D_SHM_A2A_DIRECT_TOTAL (32 * 1024 * 1024)
/* Unset T3D_SHM_BCAST_DIRECT_BYTES / _MAX_BYTES on CPUs whose cores may sit on different L3s (AMD's): the single-copy
 * broadcast's range there (docs/architecture.md, "Single copy"). */
#define T3D_SHM_BCAST_DIRECT_MIN_SPLIT (64 * 1024)
#define T3D_SHM_BCAST_DIRECT_MAX_SPLIT (2 * 1024 * 1024)
/* Rank 0's choice of the single-copy ranges for the group of n ranks (cma: every rank can read the others'
 * memory), into s->direct_min .. s->a2a_direct_max. */
void t3d__shm_direct_ranges(t3d_shm_t *s, int n, int cma);
/* Whether an allgatherv (alltoallv) block of `block` bytes is read straight from its owner. */
int t3d__shm_use_direct(const t3d_shm_t *s, size_t block);
int t3d__shm_use_a2a_direct(const t3d_shm_t *s, size_t block);
/* Whether a broadcast of `bytes` is read from the root's buffer (broadcast.c). */
int t3d__shm_use_bcast_direct(const t3d_shm_t *s, size_t bytes);
/* Copies len bytes at addr in rank p's process (pid) into dst; on failure ex->error says what went wrong. */
t3d_result_t t3d__shm_read_peer(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, void *dst, uint64_t addr,
                                size_t len);
/* Copies len bytes at src into addr in rank p's process (process_vm_writev: cross-memory attach allows it wherever
 * it allows reading); on failure ex->error says what went wrong. */
t3d_result_t t3d__shm_write_peer(t3d_shm_t *s, t3d_exec_t *ex, int p, int pid, uint64_t addr, const void *src,
                                 size_t len);
/* The end of a single-copy step on this rank, whose reads ended with res: posts `done` (also after a failed read:
 * the owners then need not wait for their deadline), then waits until every rank has posted it, so that nobody
 * reads this rank's buffer any more when the call returns, even a failed one. The first error wins. Here rather
 * than in direct.c, which would then call sync.c, whose waits call p2p.c, which reads through direct.c. */
static inline t3d_result_t t3d__shm_direct_end(t3d_shm_t *s, t3d_exec_t *ex, uint64_t done, t3d_result_t res) {
  t3d__shm_post(s, done);
  if (res == T3D_OK) return t3d__shm_wait(s, ex, -1, done);
  char first[sizeof ex->error];
  memcpy(first, ex->error, sizeof first);
  (void)t3d__shm_wait(s, ex, -1, done);
  memcpy(ex->error, first, sizeof first);
  return res;
}

/* ---------- t3d memory (mem.c) and the collectives on it (mapped.c) ---------- */
/* Whether [ptr, ptr + bytes) lies in one t3d_mem_alloc allocation of this process: its key and the offset of ptr
 * from the allocation's start. */
int t3d__mem_find(const void *ptr, size_t bytes, uint64_t *key, uint64_t *off);
/* Where bytes at offset off of process pid's allocation `key` are mapped in this process (mapped on first use and
 * kept); NULL with the reason in err. */
char *t3d__mem_peer(int pid, uint64_t key, uint64_t off, size_t bytes, char *err, size_t errlen);
/* Whether n blocks all have counts[0] elements and (displs not NULL) lie one after the other from displs[0]. */
static inline int t3d__equal_blocks(int n, const size_t *counts, const size_t *displs) {
  for (int p = 1; p < n; p++) {
    if (counts[p] != counts[0] || (displs != NULL && displs[p] != displs[0] + (size_t)p * counts[0])) return 0;
  }
  return 1;
}
/* Whether a collective of `bytes` (the size every rank computes alike) starts with the mapped offer; the inline
 * starts decline those. */
int t3d__shm_mapped_size(const t3d_shm_t *s, size_t bytes);
/* Run the offer and, when every rank's buffers are t3d memory, the whole collective (*done = 1); else *done = 0 and
 * the caller goes on through the segment. Equal blocks only (blk bytes; count elements). */
t3d_result_t t3d__shm_mapped_allreduce(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                       size_t count, t3d_dtype_t dt, t3d_redop_t op, int *done);
t3d_result_t t3d__shm_mapped_reduce_scatter(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                            size_t count, t3d_dtype_t dt, t3d_redop_t op, int *done);
t3d_result_t t3d__shm_mapped_allgather(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf,
                                       size_t blk, int *done);
t3d_result_t t3d__shm_mapped_alltoall(t3d_shm_t *s, t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t blk,
                                      int *done);
t3d_result_t t3d__shm_mapped_broadcast(t3d_shm_t *s, t3d_exec_t *ex, void *buf, size_t bytes, int root,
                                       int *done);

/* ---------- point-to-point (p2p.c) ---------- */
#define T3D_SHM_P2P_RECORDS 256u
/* Bytes of the point-to-point region for n ranks, and rank 0's choice of its sizes. */
size_t t3d__shm_p2p_bytes(int n, size_t eager, unsigned slots, size_t stage);
void t3d__shm_p2p_sizes(int n, size_t *eager, unsigned *slots, size_t *stage);

/* ---------- copy and reduce loops (copy.c) ---------- */
/* Nonzero when a non-temporal store path exists on this CPU (AVX-512F or AVX). */
int t3d__shm_nt_available(void);
/* Nonzero unless the CPU is known to share one last-level cache among a socket's cores (Intel's): where cores may
 * sit on different ones, a 2-rank group times its placement and may write what the peer reads next non-temporally. */
int t3d__shm_llc_may_split(void);
/* memcpy, with non-temporal stores when nt (then ends with a store fence, so a flag published after it orders). */
void t3d__shm_copy(void *dst, const void *src, size_t n, int nt);
/* dst[i] = src[0][i] op src[1][i] op ... op src[nsrc-1][i], in that order, for n elements; also into dst2 when not
 * NULL (non-temporal when nt2); dst may be NULL when dst2 is not. A destination may coincide with a source element for element (in place), never
 * overlap it otherwise. op is one of SUM..BXOR on a non-half dtype. */
void t3d__shm_reduce_n(void *dst, void *dst2, const void *const *src, int nsrc, size_t n, t3d_dtype_t dt,
                       t3d_redop_t op, int nt2);

/* dst[q][i] = src[0][i] op ... op src[nsrc-1][i] for every q < ndst: the sources read once, a tile at a time, and
 * the tile written to every destination (non-temporal when nt). A destination may coincide with a source element
 * for element. At most T3D_SHM_FANOUT_MAX sources. */
#define T3D_SHM_FANOUT_MAX 256
void t3d__shm_reduce_fanout(void *const *dst, int ndst, const void *const *src, int nsrc, size_t n, t3d_dtype_t dt,
                            t3d_redop_t op, int nt);

#endif /* T3D_SHM_H */
