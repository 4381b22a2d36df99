/* t3d_internal.h: what the parts of c_src share: the check macros, logging, the transport table, the execution
 * context that collective algorithms run in, and the reduction kernels. Not installed. */
#ifndef T3D_INTERNAL_H
#define T3D_INTERNAL_H

#include "t3d.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* ---------- logging and checks ---------- */
typedef enum { T3D_LOG_NONE = 0, T3D_LOG_WARN = 1, T3D_LOG_INFO = 2, T3D_LOG_TRACE = 3 } t3d_log_level_t;
int t3d__log_level(void); /* T3D_DEBUG, read once */
void t3d__log(int level, const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
#define T3D_WARN(...) \
  do { if (t3d__log_level() >= T3D_LOG_WARN) t3d__log(T3D_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__); } while (0)
#define T3D_INFO(...) \
  do { if (t3d__log_level() >= T3D_LOG_INFO) t3d__log(T3D_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__); } while (0)
#define T3D_TRACE(...) \
  do { if (t3d__log_level() >= T3D_LOG_TRACE) t3d__log(T3D_LOG_TRACE, __FILE__, __LINE__, __VA_ARGS__); } while (0)

/* Propagate an error, logging "-> code" at each hop so that a failure reads like a backtrace. */
#define T3D_CHECK(call)                                                              \
  do {                                                                               \
    t3d_result_t t3d_res_ = (call);                                                  \
    if (t3d_res_ < 0) {                                                              \
      T3D_INFO("%s -> %s", #call, t3d_result_string(t3d_res_));                     \
      return t3d_res_;                                                               \
    }                                                                                \
  } while (0)
#define T3D_CHECK_GOTO(call, res, label)                                             \
  do {                                                                               \
    (res) = (call);                                                                  \
    if ((res) < 0) {                                                                 \
      T3D_INFO("%s -> %s", #call, t3d_result_string(res));                          \
      goto label;                                                                    \
    }                                                                                \
  } while (0)

/* ---------- the environment: every variable is declared in base/params.def and read through the registry ---------- */
#include "base/params.h"

/* ---------- types ---------- */
/* float16 and bfloat16: reduced through float32 (c_src/base/reduce.c). */
static inline int t3d__is_half(t3d_dtype_t dt) { return dt == T3D_FLOAT16 || dt == T3D_BFLOAT16; }

/* ---------- buffers ---------- */
/* Nonzero when [a, a + na) and [b, b + nb) share a byte; compared as integers, as the objects may be unrelated. */
static inline int t3d__overlap(const void *a, size_t na, const void *b, size_t nb) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return na > 0 && nb > 0 && x < y + nb && y < x + na;
}

/* A scratch buffer kept from call to call: grows *buf to at least bytes (its old contents are not kept), never
 * shrinks; 0 when out of memory (then *buf is left as it was). */
int t3d__grow_scratch(void **buf, size_t *cap, size_t bytes);
/* Byte range [lo, hi) covered by the non-empty blocks (counts and displacements in elements of es bytes); [0, 0)
 * when every block is empty. */
void t3d__block_extent(int n, const size_t *counts, const size_t *displs, size_t es, size_t *lo, size_t *hi);
/* Nonzero when the receive blocks of an alltoallv share a byte with its send blocks (counts and displacements in
 * elements of es bytes). */
int t3d__alltoall_overlaps(int n, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                           const void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es);
/* Where an alltoallv sends from: when the receive blocks overlap the send blocks (in place, say), incoming data
 * would overwrite outgoing data before it leaves, so *copy gets the byte range the send blocks cover and block p
 * is read at *src + sdispls[p] * es - *bias; otherwise *src = sendbuf, *bias = 0, *copy = NULL. Free *copy after. */
t3d_result_t t3d__alltoall_source(int n, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                                  const void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es,
                                  const char **src, size_t *bias, void **copy);

/* Zeroes n bytes with the C library's memset. For a struct of a few hundred bytes the compiler inlines `rep stos`
 * instead, whose start-up cost was a tenth of a small allreduce's time (measured: t3d__request_prepare 11-14% of
 * the profile of 8 B allreduce and send/recv calls); out of line, n is unknown here and memset's vector stores run. */
void t3d__zero(void *p, size_t n);

/* ---------- time and place ---------- */
uint64_t t3d__now_ns(void);
/* The two sides of an asymmetric fence (membarrier(2), private expedited): t3d__membarrier, on a rarely taken
 * path, runs a full memory barrier on every thread of this process that is running (0; -1 where it could not), so
 * that the frequent side needs only a compiler barrier (core/submit.c, "The owner's path").
 * t3d__membarrier_ready registers this process (once per process) and says whether the kernel offers it. */
int t3d__membarrier_ready(void);
int t3d__membarrier(void);
/* "hostname/boot id": ranks with equal identities share a host (base/common.c). */
void t3d__host_identity(char *buf, size_t len);

/* ---------- transports ---------- */
/* One message in flight. The transport sets status (T3D_OK or an error), bytes (received length) and
 * source (sender rank) before it stores done = 1 with release order. */
typedef struct t3d_xfer {
  atomic_int done;
  t3d_result_t status;
  size_t posted; /* length posted (receives: capacity) */
  size_t bytes;  /* length received */
  int is_recv;
  int truncate; /* receives: accept a longer message, keep its head (set before irecv) */
  int source;
  int peer;     /* the peer it was posted for (-1: any source) */
  void *handle; /* transport-owned */
  void *probe;        /* transport-owned */
} t3d_xfer_t;

/* Message tags: 2 bits kind | 26 bits (collectives: 4 bits operation, 22 bits sequence; point-to-point: the user
 * tag) | 20 bits step | 16 bits source rank. */
#define T3D_TAG_KIND_COLL 0ull
#define T3D_TAG_KIND_P2P 1ull
#define T3D_TAG_SRC_BITS 16
#define T3D_TAG_STEP_BITS 20
#define T3D_TAG_SRC_MASK 0xffffull
#define T3D_TAG_STEP_MASK (0xfffffull << T3D_TAG_SRC_BITS)
#define T3D_TAG_OP_SHIFT 58
#define T3D_TAG_OP_MASK (0xfull << T3D_TAG_OP_SHIFT)
/* The operation a collective's tag carries (its t3d_op_kind_t, 4 bits). */
static inline int t3d__coll_tag_op(uint64_t tag) { return (int)((tag & T3D_TAG_OP_MASK) >> T3D_TAG_OP_SHIFT); }
uint64_t t3d__coll_tag(int op, uint64_t seq, uint32_t step, int src);
uint64_t t3d__p2p_tag(int64_t user_tag, int src);

/* Even split of count elements into n blocks, the first count % n one element longer (the UCX algorithms, and the
 * blocks of the two levels across hosts). */
static inline void t3d__algo_split(size_t count, int n, size_t *counts, size_t *offs) {
  size_t q = count / (size_t)n, rem = count % (size_t)n, off = 0;
  for (int c = 0; c < n; c++) {
    counts[c] = q + ((size_t)c < rem ? 1 : 0);
    offs[c] = off;
    off += counts[c];
  }
}

typedef struct t3d_transport {
  const char *name;
  /* Creates the endpoints to every peer, exchanging addresses through the store. Runs on the caller's thread. */
  t3d_result_t (*init)(t3d_comm_t *comm, void **state);
  /* Non-blocking; completion shows in x->done. May complete at once. */
  t3d_result_t (*isend)(void *state, int peer, uint64_t tag, const void *buf, size_t bytes, t3d_xfer_t *x);
  /* peer -1 with tag_mask clearing the source bits receives from any rank. */
  t3d_result_t (*irecv)(void *state, int peer, uint64_t tag, uint64_t tag_mask, void *buf, size_t bytes,
                        t3d_xfer_t *x);
  /* Drives completions; returns nonzero when something happened. Only the progress thread calls it. */
  int (*progress)(void *state);
  /* Gives up a pending transfer (abort or timeout); x->done is set before it returns. */
  void (*cancel)(void *state, t3d_xfer_t *x);
  /* Whether a message that no receive has taken yet matches tag under mask; its tag goes to *found. Leaves it
   * where it is. */
  int (*peek)(void *state, uint64_t tag, uint64_t mask, uint64_t *found);
  /* Nonzero when the transport knows the peer is gone (its pending transfers will never complete). */
  int (*peer_lost)(void *state, int peer);
  /* Releases a completed transfer's transport resources. */
  void (*release)(void *state, t3d_xfer_t *x);
  void (*fini)(void *state);
} t3d_transport_t;

extern const t3d_transport_t t3d__transport_ucx;

/* ---------- execution context of one operation, on the progress thread ---------- */
typedef struct t3d_exec {
  t3d_comm_t *comm;
  int rank, size;
  /* Where rank and size number a subset of the communicator (core/hier.c: a lane across hosts): peers[i] is the
   * communicator's rank of the subset's rank i. NULL: the whole communicator, rank for rank. */
  const int *peers;
  const char *opname; /* "allreduce", ... */
  int kind;           /* its t3d_op_kind_t */
  uint64_t seq;       /* collective sequence number on this communicator */
  uint32_t fp;        /* what ranks must also agree on (t3d__exec_fingerprint): dtype, reduce op, root */
  uint64_t deadline_ns; /* 0 until something first needs it: read it through t3d__exec_deadline */
  int64_t timeout_ms;
  char error[1024];    /* text of the first failure, for the request and the communicator */
} t3d_exec_t;

/* The operation's deadline: its timeout from the first time anything asks (a wait that has to back off, a
 * timeout check), not from its start. A small collective whose peers are there when it waits never reads the
 * clock, which costs 23 ns a read on this project's machines, a tenth of such a call. The queued path asks at
 * once (core/run.c), and so does a blocking call's whole collective; an inline start asks at the latest when it
 * hands the request on (core/submit.c). */
static inline uint64_t t3d__exec_deadline(t3d_exec_t *ex) {
  if (ex->deadline_ns == 0) ex->deadline_ns = t3d__now_ns() + (uint64_t)ex->timeout_ms * 1000000ull;
  return ex->deadline_ns;
}


/* A collective's fingerprint (t3d_exec_t.fp, core/run.c), 28 bits: dtype + 1 (bits 0-4; 0 for a barrier), reduce
 * op + 1 (bits 5-8; reductions only), root + 1 (bits 9-25; rooted collectives only). t3d__fingerprint_text writes
 * e.g. "float32, sum, root 0". */
#define T3D_FP_BITS 28
void t3d__fingerprint_text(uint32_t fp, char *buf, size_t len);

/* Waiting on something other than transfers (shared-memory flags): backoff between polls, and a check that fails
 * the operation on abort or deadline, writing ex->error with `waiting_for` (e.g. "rank(s) 2, 3"). */
typedef struct t3d_backoff {
  uint64_t since; /* 0: progress just happened */
  int spun;       /* the last poll was in the spin phase: a caller may poll its word again at once */
  int quick;      /* spin phase: one pause per poll instead of T3D_SPIN_PAUSES (waits on a word a peer on another
                   * core writes within a microsecond: the shared-memory collectives) */
} t3d_backoff_t;
/* Pauses per poll of the spin phase, unless quick: each poll also reads the clock, and a waiter notices its word
 * only between polls. */
#define T3D_SPIN_PAUSES 8
void t3d__backoff_reset(t3d_backoff_t *b);
/* Tells the backoff how many ranks of one communicator share this host (as many as cores or more: no spinning;
 * more: also a short yield phase, and t3d__oversubscribed() says so). */
void t3d__backoff_note_ranks(int local_ranks);
int t3d__oversubscribed(void);
/* t3d_backoff_poll (t3d.h): spins or yields once and returns 0 while in those phases; returns 1 at once when past
 * them: the caller should block on its own wake-up signal (with a bounded timeout, so that it still checks for
 * abort and deadline). */
int t3d__backoff_poll(t3d_backoff_t *b);
/* t3d__backoff_poll for a waiter that knows its peer is running on another CPU right now: the peer is not queued
 * behind it, so it pause-spins for T3D_SPIN_NS (5 us) even where the spin phase is skipped, then goes on as
 * t3d__backoff_poll. */
int t3d__backoff_poll_running(t3d_backoff_t *b);
/* The poll of a point-to-point waiter on shared memory (t3d_request_poll, with a time since the last progress
 * instead of a t3d_backoff_t): quick, as its pass between polls already reads the rings; running: as
 * t3d__backoff_poll_running. */
int t3d__backoff_poll_p2p(uint64_t *since, int running);
/* Nonzero when the spin phase is skipped: this host runs as many ranks as cores, or more. */
int t3d__cores_filled(void);
/* t3d__backoff_poll for waiters without a wake-up signal: past the yield phase, naps of ~20 us. */
void t3d__backoff_wait(t3d_backoff_t *b);
/* Fails the operation on abort or deadline (writing ex->error with `waiting_for`, e.g. "rank(s) 2, 3"); T3D_OK
 * otherwise (base/error.c). */
t3d_result_t t3d__exec_check(t3d_exec_t *ex, const char *waiting_for);
/* "timed out", "lost its connection", "was aborted", "failed": how an error message says what happened. */
const char *t3d__fail_verb(t3d_result_t res);

/* ---------- the shared-memory provider's life (c_src/shm/) ----------
 * Set up at init when every rank of the communicator is on this host (and T3D_TRANSPORT is not "ucx"); its
 * collectives are reached through its provider table (shm/provider.c), declared in shm/shm.h. */
typedef struct t3d_shm t3d_shm_t;
/* Point-to-point over the segment (shm/p2p.c), when every rank can use it: sends and receives are posted on the
 * caller's thread and progressed by whoever waits. */
typedef struct t3d_shm_p2p t3d_shm_p2p_t;
/* Collective over the communicator, on the caller's thread; uses the store (t3d__store_set/get in comm.h). */
t3d_result_t t3d__shm_init(t3d_comm_t *comm, t3d_shm_t **shm);
void t3d__shm_fini(t3d_shm_t *shm);
/* Makes shm's point-to-point state, or sets *out = NULL when the communicator cannot use it. */
t3d_result_t t3d__shm_p2p_attach(t3d_comm_t *comm, t3d_shm_t *shm, t3d_shm_p2p_t **out);
void t3d__shm_p2p_free(t3d_shm_p2p_t *p);
/* Where a collective started on the caller's thread stands, for its finish (kept in the request). */
typedef struct t3d_shm_resume {
  int h;
  uint64_t base;
  int by_line; /* peers show phase 1 in their info line's seq (t3d__shm_post_arrived), not only in their flag */
} t3d_shm_resume_t;

/* ---------- reduction kernels (c_src/base/reduce.c) ---------- */
/* dst[i] = dst[i] op src[i] for n elements. op is one of SUM, PROD, MIN, MAX, BAND, BOR, BXOR; dt is not half. */
void t3d__reduce(void *dst, const void *src, size_t n, t3d_dtype_t dt, t3d_redop_t op);
/* buf[i] *= s (floating and complex types; integers multiply and truncate). */
void t3d__scale(void *buf, size_t n, t3d_dtype_t dt, double s);
/* buf[i] /= d (integers truncate). */
void t3d__divide(void *buf, size_t n, t3d_dtype_t dt, int64_t d);
/* Half <-> float32 (round to nearest even). */
void t3d__half_to_float(float *dst, const void *src, size_t n, t3d_dtype_t half_dt);
void t3d__float_to_half(void *dst, const float *src, size_t n, t3d_dtype_t half_dt);

#endif /* T3D_INTERNAL_H */
