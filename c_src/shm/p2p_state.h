/* shm/p2p_state.h: the state of point-to-point over a communicator's segment, shared by p2p.c (rings, records,
 * matching, completion) and stage.c (the ordered pairs' staging areas for long messages). Private to those two. */
#ifndef T3D_SHM_P2P_STATE_H
#define T3D_SHM_P2P_STATE_H

#include "shm.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { MSG_EAGER = 1, MSG_RENDEZVOUS = 2 };
/* A record's word: generation << 2 | state. The sender moves IDLE -> POSTED before it publishes the header and
 * back to IDLE (with CAS) to cancel; the receiver moves POSTED -> READING (CAS) -> DONE. */
enum { REC_IDLE = 0, REC_POSTED = 1, REC_READING = 2, REC_DONE = 3 };
#define REC_WORD(gen, st) (((gen) << 2) | (uint64_t)(st))
/* A slot's first line. The receiver learns that a message arrived from `seq` alone, in the same line as the header
 * and a short message's payload: one line crosses between the cores per small message (docs/architecture.md,
 * "Point-to-point on one host", has the measurements). */
typedef struct slot_hdr {
  _Atomic uint64_t seq; /* i + 1 once the slot holds the ring's message i (the sender's release store, last) */
  uint64_t len;         /* the message's length */
  int32_t tag;          /* tags are below 2^30 (T3D_MAX_TAG) */
  uint32_t kind;
  int32_t pid;  /* rendezvous: the sender's process */
  uint32_t rec; /* rendezvous: the sender's record */
  union {
    struct {
      uint64_t addr; /* rendezvous: the sender's buffer, in the sender's address space */
      uint64_t gen;  /* rendezvous: the record's generation */
      uint64_t mkey; /* rendezvous from t3d memory (mem.c): the allocation's key and the buffer's offset; else 0 */
      uint64_t moff;
    };
    unsigned char inline_data[32]; /* an eager message of at most SLOT_INLINE bytes; longer ones follow the line */
  };
} slot_hdr_t;
_Static_assert(sizeof(slot_hdr_t) == 64, "a slot header is one cache line");
#define SLOT_INLINE sizeof(((slot_hdr_t *)0)->inline_data)

/* Each rank's doorbell: a waiter with nothing left to do sleeps on `bell` (futex); a rank that publishes a message
 * to it, finishes reading its rendezvous message or frees room in its ring rings the bell when `sleepers` says
 * someone sleeps. */
typedef struct bell {
  _Atomic uint32_t bell;
  _Atomic uint32_t sleepers;
  char pad[56];
} bell_t;

/* A message that arrived before a receive for it. */
typedef struct unexp {
  int src;
  slot_hdr_t h;
  void *data; /* eager: a private copy of the payload */
  struct unexp *next;
} unexp_t;

struct t3d_shm_p2p {
  t3d_comm_t *comm;
  t3d_shm_t *shm;         /* the peers' process ids and how often to check them */
  uint64_t alive_checked; /* when the requests' peers were last checked */
  unsigned unclocked;     /* passes since the last one that read the clock */
  int rank, size, pid;
  char *region; /* records, then rings */
  size_t eager, slot_bytes, ring_bytes;
  unsigned slots;
  char *stages;      /* the pairs' staging areas (NULL: none) */
  size_t stage_chunk; /* bytes of one chunk: an eighth of an area */
  size_t stage_min;  /* receives of messages this long go through the area */
  pthread_mutex_t mu;
  atomic_int active; /* requests posted and not completed */
  /* Sender side. */
  t3d_request_t **sendq_head, **sendq_tail; /* per peer: sends not yet in the ring, oldest first */
  int queued;                               /* sends in those queues */
  uint64_t *head;                           /* per peer: messages this rank published to it */
  uint64_t *tail_seen;                      /* per peer: its ring's tail when this rank last read it */
  t3d_request_t *rdv;                       /* rendezvous sends awaiting the reader */
  uint64_t *rec_gen;                        /* per record: its generation */
  uint32_t *free_recs;
  int nfree;
  /* Receiver side. */
  t3d_request_t *recvs, *recvs_tail; /* posted receives, oldest first */
  int *want;                         /* posted receives per source */
  int want_any;                      /* posted any-source receives */
  uint64_t *tail;                    /* per peer: messages of it consumed */
  unexp_t *unexp, *unexp_tail;
};

/* Region layout: n bells, n x T3D_SHM_P2P_RECORDS records, n x n rings (receiver-major). */
static inline size_t records_at(int n) { return (size_t)n * sizeof(bell_t); }
static inline size_t rings_at(int n) {
  return (records_at(n) + (size_t)n * T3D_SHM_P2P_RECORDS * sizeof(uint64_t) + 63) / 64 * 64;
}

static inline bell_t *bell(const t3d_shm_p2p_t *p, int owner) {
  return (bell_t *)(void *)(p->region + (size_t)owner * sizeof(bell_t));
}

static inline _Atomic uint64_t *record(const t3d_shm_p2p_t *p, int owner, uint32_t i) {
  return (_Atomic uint64_t *)(void *)(p->region + records_at(p->size) +
                                      ((size_t)owner * T3D_SHM_P2P_RECORDS + i) * sizeof(uint64_t));
}

/* After publishing something rank q may wait for: wake it if it sleeps. The fence pairs with the one in
 * t3d__shm_p2p_sleep: either the sleeper's check sees what was published, or this load sees the sleeper. */
static inline void ring_bell(const t3d_shm_p2p_t *p, int q) {
  bell_t *b = bell(p, q);
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&b->sleepers, memory_order_relaxed) == 0) return;
  atomic_fetch_add_explicit(&b->bell, 1, memory_order_relaxed);
  syscall(SYS_futex, (void *)&b->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Peer q's process id when its process has exited, else 0. */
static inline int32_t peer_gone(const t3d_shm_p2p_t *p, int q) {
  if (q < 0 || q >= p->size || q == p->rank) return 0;
  int32_t pid = atomic_load_explicit(t3d__shm_pid(p->shm, q), memory_order_acquire);
  return pid > 0 && pid != (int32_t)p->pid && t3d__shm_process_gone(pid) ? pid : 0;
}

/* ---------- staging areas (stage.c) ---------- */
enum { T3D_STAGE_SLOTS = 8 }; /* chunks in a pair's area */

/* Bytes of the staging areas of n ranks, each of `stage` bytes (0: none). */
size_t t3d__shm_stage_bytes(int n, size_t stage);
/* The area size a group of n ranks gets (T3D_SHM_P2P_STAGE_BYTES; rank 0 decides). */
size_t t3d__shm_stage_size(int n);
/* Stages chunks of this rank's rendezvous sends whose receivers have opened a transfer (never waits). */
void t3d__shm_stage_sends(t3d_shm_p2p_t *p);
/* Opens the transfer of rendezvous message h (n bytes) from src, before the receiver takes its record. */
void t3d__shm_stage_open(t3d_shm_p2p_t *p, int src, const slot_hdr_t *h, size_t n);
/* Receives the open transfer into dst; 0 or an errno. */
int t3d__shm_stage_read(t3d_shm_p2p_t *p, int src, const slot_hdr_t *h, char *dst, size_t n);

#endif
