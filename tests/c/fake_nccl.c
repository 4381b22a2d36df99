/* fake_nccl.c: a stand-in for libnccl.so.2 that the C tests load through T3D_NCCL_LIBRARY. It exports the NCCL
 * functions t3d resolves, working on host memory with the ranks of a communicator as threads of one process, and
 * fake_nccl_* hooks through which the tests count communicators, see streams and inject errors. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "include/t3d_half.h" /* the halves convert as libt3d's do */
#include "nccl/nccl_abi.h"

#define FAKE_VERSION 22705 /* reported as NCCL 2.27.5 */
#define ID_MAGIC "t3d-fake-nccl-id"
#define OP_PREMUL T3D_NCCL_NUM_OPS /* the class of every ncclRedOpCreatePreMulSum operator */

/* ---------- call counters and hooks' state ---------- */

enum {
  FN_GET_VERSION, FN_GET_UNIQUE_ID, FN_COMM_INIT, FN_COMM_FINALIZE, FN_COMM_DESTROY, FN_COMM_ABORT, FN_GET_ASYNC_ERROR,
  FN_GET_ERROR_STRING, FN_GET_LAST_ERROR, FN_PREMUL_CREATE, FN_REDOP_DESTROY, FN_ALLREDUCE, FN_BROADCAST, FN_REDUCE,
  FN_ALLGATHER, FN_REDUCE_SCATTER, FN_SEND, FN_RECV, FN_GROUP_START, FN_GROUP_END, FN_COUNT
};
static const char *const fn_names[FN_COUNT] = {
    "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommFinalize", "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError", "ncclGetErrorString", "ncclGetLastError", "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
    "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd"};

static atomic_long fn_calls[FN_COUNT];
static atomic_int comms_created, comms_live, comms_aborted, last_nranks, last_blocking = -1;
static atomic_int premul_live, zero_p2p, injected_async;
static atomic_ullong id_counter;
static _Atomic(void *) last_stream;
static _Thread_local void *tls_last_stream;
/* Per thread: the operation calls since fake_nccl_thread_expect_stream and those with another stream. */
static _Thread_local void *tls_expect_stream;
static _Thread_local int tls_op_calls, tls_stream_misses;
/* Per thread: the last operation call's arguments as NCCL saw them. */
static _Thread_local int tls_last_fn = -1, tls_last_dtype = -1, tls_last_op = -1;
static _Thread_local size_t tls_last_count;

/* One failure to inject on this thread: the next call of fail_fn returns fail_res without doing anything. */
static _Thread_local int fail_fn = -1;
static _Thread_local int fail_res;

static _Thread_local char last_error[512];

static void set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
}

/* Counts the call and says whether an injected failure replaces it (then *res holds the result to return). */
static int enter(int fn, t3d_nccl_result_t *res) {
  atomic_fetch_add(&fn_calls[fn], 1);
  if (fail_fn != fn) return 0;
  fail_fn = -1;
  *res = fail_res;
  set_error("fake NCCL: %s failed by request of the test (fake_nccl_fail_next)", fn_names[fn]);
  return 1;
}

static void note_call(int fn, void *stream, t3d_nccl_dtype_t dt, int redop, size_t count) {
  atomic_store(&last_stream, stream);
  tls_last_stream = stream;
  tls_op_calls++;
  if (stream != tls_expect_stream) tls_stream_misses++;
  tls_last_fn = fn;
  tls_last_dtype = dt;
  tls_last_op = redop < 0 ? -1 : redop < T3D_NCCL_NUM_OPS ? redop : OP_PREMUL;
  tls_last_count = count;
}

/* ---------- communicators ---------- */

typedef struct {
  int in_use;
  t3d_nccl_dtype_t dtype;
  int residence;
  const void *ptr;         /* ncclScalarDevice: read when the operation runs */
  unsigned char value[8];  /* ncclScalarHostImmediate: read at creation */
} premul_t;

/* One message of a send, posted in the clique until the matching receive has copied it. The receiver reads the
 * sender's buffer directly, so the sender waits for `consumed`. */
typedef struct msg {
  struct msg *next;
  int src, dst;
  const void *buf;
  size_t bytes;
  int claimed, consumed, mismatch;
  size_t recv_bytes;
} msg_t;

/* What one rank brings to a collective; every rank reads every post. */
typedef struct {
  int fn;
  const void *send;
  size_t count;
  t3d_nccl_dtype_t dtype;
  int opclass; /* a builtin op, or OP_PREMUL */
  int root;
  unsigned char scalar[8];
} post_t;

struct t3d_nccl_comm_opaque;

/* The ranks that share one unique id. */
typedef struct clique {
  struct clique *next;
  t3d_nccl_unique_id_t id;
  int nranks, joined, refs; /* refs: member comms not yet freed */
  int aborted;              /* a member called ncclCommAbort */
  int *member;              /* per rank: joined */
  int *gone;                /* per rank: destroyed or aborted */
  int bar_arrived;
  int *bar_in; /* per rank: waiting at the current barrier */
  unsigned long bar_gen;
  post_t *posts;
  msg_t *mbox;
} clique_t;

struct t3d_nccl_comm_opaque {
  clique_t *cl;
  int rank, nranks, blocking;
  int busy; /* calls in progress (they may be blocked in a wait) */
  int dead; /* destroyed or aborted while busy: the last call out frees it */
  int finalized;      /* ncclCommFinalize was called: no more operations */
  int finalize_polls; /* ncclCommGetAsyncError answers IN_PROGRESS this many more times after a nonblocking finalize */
  t3d_nccl_result_t async_error;
  premul_t *ops;
  int nops;
};
typedef struct t3d_nccl_comm_opaque comm_t;

/* One mutex guards every clique and communicator; waits use one condition variable. The fake runs a handful of
 * ranks, so simplicity wins over contention here. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static clique_t *g_cliques;
/* Counters of ids that already formed a complete communicator: NCCL needs a fresh id per communicator. */
static unsigned long long *g_retired;
static size_t g_nretired, g_capretired;

/* Every wait for peers gives up after FAKE_NCCL_WAIT_MS (default 30 s) with an error naming who did not come. Real
 * NCCL would not block the host there at all (the GPU would wait); the fake executes on the calling thread, so a
 * rank that never joins would otherwise hang its peers, and with them every thread that needs their locks. */
static long g_wait_ms;
static pthread_once_t g_wait_once = PTHREAD_ONCE_INIT;

static void read_wait_ms(void) {
  const char *s = getenv("FAKE_NCCL_WAIT_MS");
  const long v = s ? strtol(s, NULL, 10) : 0;
  g_wait_ms = v > 0 ? v : 30000;
}

static struct timespec wait_deadline(void) {
  pthread_once(&g_wait_once, read_wait_ms);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts); /* the clock of a default condition variable */
  ts.tv_sec += g_wait_ms / 1000;
  ts.tv_nsec += (g_wait_ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

/* With g_mu held: one wait for a change; 0 once the deadline has passed. */
static int wait_locked(const struct timespec *deadline) {
  return pthread_cond_timedwait(&g_cv, &g_mu, deadline) != ETIMEDOUT;
}

static int any_gone(const clique_t *cl) {
  for (int r = 0; r < cl->nranks; ++r)
    if (cl->gone[r]) return 1;
  return 0;
}

static int comm_ready(const comm_t *c) { return c->cl->joined == c->nranks; }

/* With g_mu held. */
static void free_comm_locked(comm_t *c) {
  clique_t *cl = c->cl;
  free(c->ops);
  free(c);
  if (--cl->refs > 0) return;
  for (clique_t **p = &g_cliques; *p; p = &(*p)->next) {
    if (*p == cl) {
      *p = cl->next;
      break;
    }
  }
  while (cl->mbox) {
    msg_t *m = cl->mbox;
    cl->mbox = m->next;
    free(m);
  }
  free(cl->member);
  free(cl->gone);
  free(cl->bar_in);
  free(cl->posts);
  free(cl);
}

static void release_locked(comm_t *c) {
  if (--c->busy == 0 && c->dead) free_comm_locked(c);
}

static int id_counter_of(const t3d_nccl_unique_id_t *id, unsigned long long *counter) {
  if (memcmp(id->internal, ID_MAGIC, sizeof ID_MAGIC) != 0) return 0;
  memcpy(counter, id->internal + sizeof ID_MAGIC + sizeof(int32_t), sizeof *counter);
  return 1;
}

static int retired_locked(const t3d_nccl_unique_id_t *id) {
  unsigned long long k;
  if (!id_counter_of(id, &k)) return 0;
  for (size_t i = 0; i < g_nretired; ++i)
    if (g_retired[i] == k) return 1;
  return 0;
}

static void retire_locked(const t3d_nccl_unique_id_t *id) {
  unsigned long long k;
  if (!id_counter_of(id, &k)) return;
  if (g_nretired == g_capretired) {
    size_t cap = g_capretired ? 2 * g_capretired : 64;
    unsigned long long *p = realloc(g_retired, cap * sizeof *p);
    if (!p) return;
    g_retired = p;
    g_capretired = cap;
  }
  g_retired[g_nretired++] = k;
}

/* ---------- reductions ---------- */

static size_t dtype_size(t3d_nccl_dtype_t dt) {
  switch (dt) {
    case T3D_NCCL_INT8: case T3D_NCCL_UINT8: return 1;
    case T3D_NCCL_FLOAT16: case T3D_NCCL_BFLOAT16: return 2;
    case T3D_NCCL_INT32: case T3D_NCCL_UINT32: case T3D_NCCL_FLOAT32: return 4;
    case T3D_NCCL_INT64: case T3D_NCCL_UINT64: case T3D_NCCL_FLOAT64: return 8;
    default: return 0;
  }
}

typedef struct {
  int op; /* opclass */
  int nranks;
  const unsigned char **in;    /* per rank: element 0 of the block to reduce */
  const unsigned char **scalar; /* per rank: its PreMulSum factor, in the dtype */
} rargs_t;

/* Integers: wrap-around arithmetic in the unsigned type of the same width (no signed overflow); AVG sums in 64 bits
 * and divides with truncation. */
#define DEFINE_INT_REDUCE(NAME, T, U, W)                                                  \
  static void NAME(unsigned char *out, size_t count, const rargs_t *a) {                  \
    for (size_t i = 0; i < count; ++i) {                                                  \
      T acc = 0;                                                                          \
      uint64_t wide = 0;                                                                  \
      for (int r = 0; r < a->nranks; ++r) {                                               \
        T x;                                                                              \
        memcpy(&x, a->in[r] + i * sizeof(T), sizeof(T));                                  \
        switch (a->op) {                                                                  \
          case T3D_NCCL_SUM: acc = r ? (T)((U)acc + (U)x) : x; break;                     \
          case T3D_NCCL_PROD: acc = r ? (T)((U)acc * (U)x) : x; break;                    \
          case T3D_NCCL_MAX: acc = (r == 0 || x > acc) ? x : acc; break;                  \
          case T3D_NCCL_MIN: acc = (r == 0 || x < acc) ? x : acc; break;                  \
          case T3D_NCCL_AVG: wide += (uint64_t)(W)x; break;                               \
          default: {                                                                      \
            T s;                                                                          \
            memcpy(&s, a->scalar[r], sizeof(T));                                          \
            const T y = (T)((U)x * (U)s);                                                 \
            acc = r ? (T)((U)acc + (U)y) : y;                                             \
          }                                                                               \
        }                                                                                 \
      }                                                                                   \
      if (a->op == T3D_NCCL_AVG) acc = (T)((W)wide / (W)a->nranks);                       \
      memcpy(out + i * sizeof(T), &acc, sizeof(T));                                       \
    }                                                                                     \
  }

DEFINE_INT_REDUCE(reduce_i8, int8_t, uint8_t, int64_t)
DEFINE_INT_REDUCE(reduce_u8, uint8_t, uint8_t, uint64_t)
DEFINE_INT_REDUCE(reduce_i32, int32_t, uint32_t, int64_t)
DEFINE_INT_REDUCE(reduce_u32, uint32_t, uint32_t, uint64_t)
DEFINE_INT_REDUCE(reduce_i64, int64_t, uint64_t, int64_t)
DEFINE_INT_REDUCE(reduce_u64, uint64_t, uint64_t, uint64_t)

static float ld_f16(const unsigned char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return t3d__f16_to_f32(h);
}
static void st_f16(unsigned char *p, float v) {
  const uint16_t h = t3d__f32_to_f16(v);
  memcpy(p, &h, 2);
}
static float ld_bf16(const unsigned char *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return t3d__bf16_to_f32(h);
}
static void st_bf16(unsigned char *p, float v) {
  const uint16_t h = t3d__f32_to_bf16(v);
  memcpy(p, &h, 2);
}
static float ld_f32(const unsigned char *p) {
  float v;
  memcpy(&v, p, 4);
  return v;
}
static void st_f32(unsigned char *p, float v) { memcpy(p, &v, 4); }
static double ld_f64(const unsigned char *p) {
  double v;
  memcpy(&v, p, 8);
  return v;
}
static void st_f64(unsigned char *p, double v) { memcpy(p, &v, 8); }

/* Floating types accumulate in ACC (float for the halves and float32) and round once when stored. */
#define DEFINE_FLOAT_REDUCE(NAME, SIZE, ACC, LOAD, STORE)                              \
  static void NAME(unsigned char *out, size_t count, const rargs_t *a) {               \
    for (size_t i = 0; i < count; ++i) {                                               \
      ACC acc = 0;                                                                     \
      for (int r = 0; r < a->nranks; ++r) {                                            \
        const ACC x = LOAD(a->in[r] + i * (SIZE));                                     \
        switch (a->op) {                                                               \
          case T3D_NCCL_SUM: case T3D_NCCL_AVG: acc = r ? acc + x : x; break;          \
          case T3D_NCCL_PROD: acc = r ? acc * x : x; break;                            \
          case T3D_NCCL_MAX: acc = (r == 0 || x > acc) ? x : acc; break;               \
          case T3D_NCCL_MIN: acc = (r == 0 || x < acc) ? x : acc; break;               \
          default: {                                                                   \
            const ACC y = x * LOAD(a->scalar[r]);                                      \
            acc = r ? acc + y : y;                                                     \
          }                                                                            \
        }                                                                              \
      }                                                                                \
      if (a->op == T3D_NCCL_AVG) acc = acc / (ACC)a->nranks;                           \
      STORE(out + i * (SIZE), acc);                                                    \
    }                                                                                  \
  }

DEFINE_FLOAT_REDUCE(reduce_f16, 2, float, ld_f16, st_f16)
DEFINE_FLOAT_REDUCE(reduce_bf16, 2, float, ld_bf16, st_bf16)
DEFINE_FLOAT_REDUCE(reduce_f32, 4, float, ld_f32, st_f32)
DEFINE_FLOAT_REDUCE(reduce_f64, 8, double, ld_f64, st_f64)

static void reduce_block(t3d_nccl_dtype_t dt, unsigned char *out, size_t count, const rargs_t *a) {
  switch (dt) {
    case T3D_NCCL_INT8: reduce_i8(out, count, a); break;
    case T3D_NCCL_UINT8: reduce_u8(out, count, a); break;
    case T3D_NCCL_INT32: reduce_i32(out, count, a); break;
    case T3D_NCCL_UINT32: reduce_u32(out, count, a); break;
    case T3D_NCCL_INT64: reduce_i64(out, count, a); break;
    case T3D_NCCL_UINT64: reduce_u64(out, count, a); break;
    case T3D_NCCL_FLOAT16: reduce_f16(out, count, a); break;
    case T3D_NCCL_BFLOAT16: reduce_bf16(out, count, a); break;
    case T3D_NCCL_FLOAT32: reduce_f32(out, count, a); break;
    case T3D_NCCL_FLOAT64: reduce_f64(out, count, a); break;
    default: break;
  }
}

/* ---------- operations, run at once or recorded in a group ---------- */

typedef struct {
  int fn;
  comm_t *comm;
  const void *send;
  void *recv;
  size_t count;
  t3d_nccl_dtype_t dtype;
  int opclass;
  int root; /* or the peer of a send / receive */
  unsigned char scalar[8];
  const void *scalar_ptr; /* a device-resident PreMulSum scalar, read when the operation runs */
} op_t;

static _Thread_local int group_depth;
static _Thread_local op_t *group_ops;
static _Thread_local size_t group_nops, group_cap;

/* With g_mu held: waits for every rank of the clique. 0, with the error set, when a member left or aborted or the
 * wait timed out. */
static int barrier_locked(clique_t *cl, int rank, const char *what) {
  const unsigned long gen = cl->bar_gen;
  cl->bar_in[rank] = 1;
  if (++cl->bar_arrived == cl->nranks) {
    cl->bar_arrived = 0;
    memset(cl->bar_in, 0, (size_t)cl->nranks * sizeof *cl->bar_in);
    cl->bar_gen++;
    pthread_cond_broadcast(&g_cv);
    return 1;
  }
  const struct timespec deadline = wait_deadline();
  int timed_out = 0;
  while (cl->bar_gen == gen && !cl->aborted && !any_gone(cl) && !timed_out) timed_out = !wait_locked(&deadline);
  if (cl->bar_gen != gen) return 1;
  cl->bar_arrived--; /* this rank leaves the failed barrier */
  cl->bar_in[rank] = 0;
  if (cl->aborted || any_gone(cl)) {
    set_error("fake NCCL: %s on rank %d: a peer aborted or destroyed its communicator", what, rank);
    return 0;
  }
  char missing[160] = "";
  size_t len = 0;
  for (int r = 0; r < cl->nranks && len + 16 < sizeof missing; ++r)
    if (r != rank && !cl->bar_in[r]) len += (size_t)snprintf(missing + len, sizeof missing - len, " %d", r);
  set_error("fake NCCL: %s on rank %d waited %ld ms (FAKE_NCCL_WAIT_MS) for rank(s)%s", what, rank, g_wait_ms,
            missing);
  return 0;
}

static const char *op_name(int opclass) {
  static const char *const names[] = {"sum", "prod", "max", "min", "avg", "premulsum"};
  return (opclass >= 0 && opclass <= OP_PREMUL) ? names[opclass] : "?";
}

/* Checks that every rank's post agrees with rank 0's; every rank reaches the same verdict. */
static t3d_nccl_result_t check_posts(const clique_t *cl) {
  const post_t *p0 = &cl->posts[0];
  for (int r = 1; r < cl->nranks; ++r) {
    const post_t *p = &cl->posts[r];
    if (p->fn != p0->fn) {
      set_error("fake NCCL: rank %d called %s while rank 0 called %s", r, fn_names[p->fn], fn_names[p0->fn]);
      return T3D_NCCL_INVALID_USAGE;
    }
    if (p->count != p0->count || p->dtype != p0->dtype) {
      set_error("fake NCCL: %s: rank %d passed count %zu dtype %d, rank 0 count %zu dtype %d", fn_names[p->fn], r,
                p->count, p->dtype, p0->count, p0->dtype);
      return T3D_NCCL_INVALID_USAGE;
    }
    if (p->opclass != p0->opclass) {
      set_error("fake NCCL: %s: rank %d reduces with %s, rank 0 with %s", fn_names[p->fn], r, op_name(p->opclass),
                op_name(p0->opclass));
      return T3D_NCCL_INVALID_USAGE;
    }
    if (p->root != p0->root) {
      set_error("fake NCCL: %s: rank %d passed root %d, rank 0 root %d", fn_names[p->fn], r, p->root, p0->root);
      return T3D_NCCL_INVALID_USAGE;
    }
  }
  return T3D_NCCL_SUCCESS;
}

/* A collective: post, meet, compute this rank's output privately from everyone's inputs, meet (no input is read
 * any more), then write the output; that order makes sendbuf == recvbuf safe. */
static t3d_nccl_result_t run_collective(const op_t *op) {
  comm_t *c = op->comm;
  clique_t *cl = c->cl;
  const int n = c->nranks, me = c->rank;
  const size_t es = dtype_size(op->dtype);
  post_t mine;
  memset(&mine, 0, sizeof mine);
  mine.fn = op->fn;
  mine.send = op->send;
  mine.count = op->count;
  mine.dtype = op->dtype;
  mine.opclass = op->opclass;
  mine.root = op->root;
  if (op->scalar_ptr) {
    memcpy(mine.scalar, op->scalar_ptr, es);
  } else {
    memcpy(mine.scalar, op->scalar, sizeof mine.scalar);
  }

  pthread_mutex_lock(&g_mu);
  cl->posts[me] = mine;
  if (!barrier_locked(cl, me, fn_names[op->fn])) {
    pthread_mutex_unlock(&g_mu);
    return T3D_NCCL_REMOTE_ERROR;
  }
  t3d_nccl_result_t res = check_posts(cl);
  pthread_mutex_unlock(&g_mu);

  unsigned char *tmp = NULL;
  size_t out_bytes = 0;
  if (res == T3D_NCCL_SUCCESS) {
    const unsigned char **in = calloc((size_t)n, sizeof *in);
    const unsigned char **sc = calloc((size_t)n, sizeof *sc);
    const size_t block = op->count * es;
    switch (op->fn) {
      case FN_ALLREDUCE: out_bytes = block; break;
      case FN_REDUCE: out_bytes = me == op->root ? block : 0; break;
      case FN_BROADCAST: out_bytes = block; break;
      case FN_ALLGATHER: out_bytes = block * (size_t)n; break;
      case FN_REDUCE_SCATTER: out_bytes = block; break;
      default: break;
    }
    tmp = out_bytes ? malloc(out_bytes) : NULL;
    if (!in || !sc || (out_bytes && !tmp)) {
      set_error("fake NCCL: out of memory");
      res = T3D_NCCL_SYSTEM_ERROR;
      out_bytes = 0;
    } else if (out_bytes) {
      rargs_t ra = {op->opclass, n, in, sc};
      for (int r = 0; r < n; ++r) {
        const post_t *p = &cl->posts[r];
        in[r] = (const unsigned char *)p->send + (op->fn == FN_REDUCE_SCATTER ? (size_t)me * block : 0);
        sc[r] = p->scalar;
      }
      switch (op->fn) {
        case FN_ALLREDUCE: case FN_REDUCE: case FN_REDUCE_SCATTER: reduce_block(op->dtype, tmp, op->count, &ra); break;
        case FN_BROADCAST: memcpy(tmp, cl->posts[op->root].send, block); break;
        case FN_ALLGATHER:
          for (int r = 0; r < n; ++r) memcpy(tmp + (size_t)r * block, cl->posts[r].send, block);
          break;
        default: break;
      }
    }
    free(in);
    free(sc);
  }

  pthread_mutex_lock(&g_mu);
  const int met = barrier_locked(cl, me, fn_names[op->fn]);
  pthread_mutex_unlock(&g_mu);
  if (!met) {
    free(tmp);
    return T3D_NCCL_REMOTE_ERROR;
  }
  if (res == T3D_NCCL_SUCCESS && out_bytes) memcpy(op->recv, tmp, out_bytes);
  free(tmp);
  return res;
}

/* Sends, then receives, then waits for the sends to be taken: any pairing inside one group completes. */
static t3d_nccl_result_t run_p2p(const op_t *ops, size_t nops) {
  t3d_nccl_result_t res = T3D_NCCL_SUCCESS;
  msg_t **posted = calloc(nops ? nops : 1, sizeof *posted);
  if (!posted) {
    set_error("fake NCCL: out of memory");
    return T3D_NCCL_SYSTEM_ERROR;
  }
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < nops; ++i) {
    if (ops[i].fn != FN_SEND) continue;
    msg_t *m = calloc(1, sizeof *m);
    if (!m) {
      set_error("fake NCCL: out of memory");
      res = T3D_NCCL_SYSTEM_ERROR;
      break;
    }
    clique_t *cl = ops[i].comm->cl;
    m->src = ops[i].comm->rank;
    m->dst = ops[i].root;
    m->buf = ops[i].send;
    m->bytes = ops[i].count * dtype_size(ops[i].dtype);
    msg_t **tail = &cl->mbox;
    while (*tail) tail = &(*tail)->next;
    *tail = m;
    posted[i] = m;
  }
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);

  /* Every receive is served even after an error, so that no peer waits for a message this rank never takes. */
  for (size_t i = 0; i < nops; ++i) {
    if (ops[i].fn != FN_RECV) continue;
    comm_t *c = ops[i].comm;
    clique_t *cl = c->cl;
    const int peer = ops[i].root;
    const size_t want = ops[i].count * dtype_size(ops[i].dtype);
    msg_t *m = NULL;
    const struct timespec deadline = wait_deadline();
    int timed_out = 0;
    pthread_mutex_lock(&g_mu);
    for (;;) {
      for (m = cl->mbox; m; m = m->next)
        if (m->src == peer && m->dst == c->rank && !m->claimed) break;
      if (m || cl->aborted || cl->gone[peer] || timed_out) break;
      timed_out = !wait_locked(&deadline);
    }
    if (m) m->claimed = 1;
    pthread_mutex_unlock(&g_mu);
    if (!m) {
      if (res == T3D_NCCL_SUCCESS) {
        if (timed_out) {
          set_error("fake NCCL: ncclRecv on rank %d waited %ld ms (FAKE_NCCL_WAIT_MS) for a message from rank %d",
                    c->rank, g_wait_ms, peer);
        } else {
          set_error("fake NCCL: ncclRecv on rank %d from rank %d: the peer aborted or destroyed its communicator",
                    c->rank, peer);
        }
        res = T3D_NCCL_REMOTE_ERROR;
      }
      continue;
    }
    const int mismatch = m->bytes != want;
    if (mismatch) {
      if (res == T3D_NCCL_SUCCESS) {
        set_error("fake NCCL: ncclRecv on rank %d expects %zu bytes from rank %d, which sent %zu", c->rank, want,
                  peer, m->bytes);
        res = T3D_NCCL_INVALID_USAGE;
      }
    } else if (want) {
      memcpy(ops[i].recv, m->buf, want);
    }
    pthread_mutex_lock(&g_mu);
    m->mismatch = mismatch;
    m->recv_bytes = want;
    m->consumed = 1;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
  }

  const struct timespec deadline = wait_deadline();
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < nops; ++i) {
    msg_t *m = posted[i];
    if (!m) continue;
    clique_t *cl = ops[i].comm->cl;
    /* A claimed message is being copied: wait for it even when the clique failed or the time is up, so that the
     * copy is safe. */
    int timed_out = 0;
    while (!m->consumed && (m->claimed || (!cl->aborted && !cl->gone[m->dst] && !timed_out)))
      timed_out = !wait_locked(&deadline);
    if (res == T3D_NCCL_SUCCESS) {
      if (!m->consumed && timed_out) {
        set_error("fake NCCL: ncclSend on rank %d waited %ld ms (FAKE_NCCL_WAIT_MS) for rank %d to receive", m->src,
                  g_wait_ms, m->dst);
        res = T3D_NCCL_REMOTE_ERROR;
      } else if (!m->consumed) {
        set_error("fake NCCL: ncclSend on rank %d to rank %d: the peer aborted or destroyed its communicator", m->src,
                  m->dst);
        res = T3D_NCCL_REMOTE_ERROR;
      } else if (m->mismatch) {
        set_error("fake NCCL: ncclSend on rank %d sent %zu bytes to rank %d, which expected %zu", m->src, m->bytes,
                  m->dst, m->recv_bytes);
        res = T3D_NCCL_INVALID_USAGE;
      }
    }
    for (msg_t **p = &cl->mbox; *p; p = &(*p)->next) {
      if (*p == m) {
        *p = m->next;
        break;
      }
    }
    free(m);
  }
  pthread_mutex_unlock(&g_mu);
  free(posted);
  return res;
}

/* Runs recorded operations: point-to-point first, then the collectives in order. */
static t3d_nccl_result_t run_ops(const op_t *ops, size_t nops) {
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < nops; ++i) ops[i].comm->busy++;
  pthread_mutex_unlock(&g_mu);
  int any_p2p = 0;
  for (size_t i = 0; i < nops; ++i) any_p2p |= ops[i].fn == FN_SEND || ops[i].fn == FN_RECV;
  t3d_nccl_result_t res = any_p2p ? run_p2p(ops, nops) : T3D_NCCL_SUCCESS;
  /* The collectives run even after an error so that the peers, which reach the same verdicts, stay in step. */
  for (size_t i = 0; i < nops; ++i) {
    if (ops[i].fn == FN_SEND || ops[i].fn == FN_RECV) continue;
    const t3d_nccl_result_t r = run_collective(&ops[i]);
    if (res == T3D_NCCL_SUCCESS) res = r;
  }
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < nops; ++i) release_locked(ops[i].comm);
  pthread_mutex_unlock(&g_mu);
  return res;
}

/* Checks an operation when it is called; 0 when it is valid. */
static t3d_nccl_result_t check_op(op_t *op, const void *send_needed, const void *recv_needed) {
  comm_t *c = op->comm;
  const char *fn = fn_names[op->fn];
  if (c == NULL) {
    set_error("fake NCCL: %s: NULL communicator", fn);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  pthread_mutex_lock(&g_mu);
  const int ready = comm_ready(c), aborted = c->cl->aborted;
  pthread_mutex_unlock(&g_mu);
  if (!ready) {
    set_error("fake NCCL: %s on rank %d: the communicator is still initializing (poll ncclCommGetAsyncError)", fn,
              c->rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  if (aborted) {
    set_error("fake NCCL: %s on rank %d: a rank of this communicator aborted it", fn, c->rank);
    return T3D_NCCL_REMOTE_ERROR;
  }
  if (c->finalized) {
    set_error("fake NCCL: %s on rank %d: the communicator was finalized", fn, c->rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  if (dtype_size(op->dtype) == 0) {
    set_error("fake NCCL: %s: invalid data type %d", fn, op->dtype);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  if (op->root < 0 || op->root >= c->nranks) {
    set_error("fake NCCL: %s: %s %d is not a rank of a %d-rank communicator", fn,
              (op->fn == FN_SEND || op->fn == FN_RECV) ? "peer" : "root", op->root, c->nranks);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  if (op->count > 0 && (!send_needed || !recv_needed)) {
    set_error("fake NCCL: %s on rank %d: NULL buffer with count %zu", fn, c->rank, op->count);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  return T3D_NCCL_SUCCESS;
}

/* Resolves a reduction operator of the call into its class and this rank's PreMulSum factor. */
static t3d_nccl_result_t resolve_op(op_t *op, t3d_nccl_redop_t redop) {
  comm_t *c = op->comm;
  if (redop >= 0 && redop < T3D_NCCL_NUM_OPS) {
    op->opclass = redop;
    return T3D_NCCL_SUCCESS;
  }
  const int k = redop - T3D_NCCL_NUM_OPS;
  if (redop < 0 || k >= c->nops || !c->ops[k].in_use) {
    set_error("fake NCCL: %s: unknown reduction operator %d", fn_names[op->fn], redop);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  if (c->ops[k].dtype != op->dtype) {
    set_error("fake NCCL: %s: operator %d was made for data type %d, used with %d", fn_names[op->fn], redop,
              c->ops[k].dtype, op->dtype);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  op->opclass = OP_PREMUL;
  if (c->ops[k].residence == T3D_NCCL_SCALAR_HOST_IMMEDIATE) {
    memcpy(op->scalar, c->ops[k].value, sizeof op->scalar);
  } else {
    op->scalar_ptr = c->ops[k].ptr;
  }
  return T3D_NCCL_SUCCESS;
}

/* Runs the operation now (a group of one) or records it in the caller's group. */
static t3d_nccl_result_t submit(const op_t *op) {
  if (group_depth > 0) {
    if (group_nops == group_cap) {
      const size_t cap = group_cap ? 2 * group_cap : 16;
      op_t *p = realloc(group_ops, cap * sizeof *p);
      if (!p) {
        set_error("fake NCCL: out of memory");
        return T3D_NCCL_SYSTEM_ERROR;
      }
      group_ops = p;
      group_cap = cap;
    }
    group_ops[group_nops++] = *op;
    return T3D_NCCL_SUCCESS;
  }
  if ((op->fn == FN_SEND || op->fn == FN_RECV) && op->root == op->comm->rank) {
    set_error("fake NCCL: %s on rank %d to itself outside a group can never complete", fn_names[op->fn],
              op->comm->rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  const t3d_nccl_result_t res = run_ops(op, 1);
  if (res == T3D_NCCL_SUCCESS && !op->comm->blocking) return T3D_NCCL_IN_PROGRESS;
  return res;
}

/* ---------- the NCCL API ---------- */

t3d_nccl_result_t ncclGetVersion(int *version) {
  t3d_nccl_result_t res;
  if (enter(FN_GET_VERSION, &res)) return res;
  if (!version) return T3D_NCCL_INVALID_ARGUMENT;
  *version = FAKE_VERSION;
  return T3D_NCCL_SUCCESS;
}

t3d_nccl_result_t ncclGetUniqueId(t3d_nccl_unique_id_t *id) {
  t3d_nccl_result_t res;
  if (enter(FN_GET_UNIQUE_ID, &res)) return res;
  if (!id) return T3D_NCCL_INVALID_ARGUMENT;
  memset(id, 0, sizeof *id);
  const int32_t pid = (int32_t)getpid();
  const unsigned long long k = atomic_fetch_add(&id_counter, 1) + 1;
  memcpy(id->internal, ID_MAGIC, sizeof ID_MAGIC);
  memcpy(id->internal + sizeof ID_MAGIC, &pid, sizeof pid);
  memcpy(id->internal + sizeof ID_MAGIC + sizeof pid, &k, sizeof k);
  return T3D_NCCL_SUCCESS;
}

t3d_nccl_result_t ncclCommInitRankConfig(t3d_nccl_comm_t *out, int nranks, t3d_nccl_unique_id_t id, int rank,
                                         t3d_nccl_config_t *config) {
  t3d_nccl_result_t res;
  if (enter(FN_COMM_INIT, &res)) return res;
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) {
    set_error("fake NCCL: ncclCommInitRankConfig: bad arguments (rank %d of %d)", rank, nranks);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  *out = NULL;
  int blocking = 1;
  if (config) {
    if (config->magic != T3D_NCCL_CONFIG_MAGIC || config->size < sizeof(t3d_nccl_config_t) ||
        config->version < 21400) {
      set_error("fake NCCL: ncclCommInitRankConfig: the config was not set up like NCCL_CONFIG_INITIALIZER "
                "(size %zu, magic 0x%x, version %u)",
                config->size, config->magic, config->version);
      return T3D_NCCL_INVALID_ARGUMENT;
    }
    if (config->blocking != T3D_NCCL_CONFIG_UNDEF_INT) blocking = config->blocking != 0;
  }
  atomic_store(&last_blocking, blocking);
  if (memcmp(id.internal, ID_MAGIC, sizeof ID_MAGIC) != 0) {
    set_error("fake NCCL: ncclCommInitRankConfig: the unique id did not come from ncclGetUniqueId");
    return T3D_NCCL_INVALID_ARGUMENT;
  }

  comm_t *c = calloc(1, sizeof *c);
  if (!c) return T3D_NCCL_SYSTEM_ERROR;
  pthread_mutex_lock(&g_mu);
  if (retired_locked(&id)) {
    pthread_mutex_unlock(&g_mu);
    free(c);
    set_error("fake NCCL: ncclCommInitRankConfig (rank %d): this unique id already formed a communicator", rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  clique_t *cl = g_cliques;
  while (cl && memcmp(&cl->id, &id, sizeof id) != 0) cl = cl->next;
  if (!cl) {
    cl = calloc(1, sizeof *cl);
    if (cl) {
      cl->member = calloc((size_t)nranks, sizeof *cl->member);
      cl->gone = calloc((size_t)nranks, sizeof *cl->gone);
      cl->bar_in = calloc((size_t)nranks, sizeof *cl->bar_in);
      cl->posts = calloc((size_t)nranks, sizeof *cl->posts);
    }
    if (!cl || !cl->member || !cl->gone || !cl->bar_in || !cl->posts) {
      if (cl) {
        free(cl->member);
        free(cl->gone);
        free(cl->bar_in);
        free(cl->posts);
        free(cl);
      }
      pthread_mutex_unlock(&g_mu);
      free(c);
      return T3D_NCCL_SYSTEM_ERROR;
    }
    cl->id = id;
    cl->nranks = nranks;
    cl->next = g_cliques;
    g_cliques = cl;
  }
  if (cl->nranks != nranks) {
    const int had = cl->nranks;
    pthread_mutex_unlock(&g_mu);
    free(c);
    set_error("fake NCCL: ncclCommInitRankConfig: rank %d says %d ranks, an earlier rank said %d", rank, nranks, had);
    return T3D_NCCL_INVALID_USAGE;
  }
  if (cl->member[rank]) {
    pthread_mutex_unlock(&g_mu);
    free(c);
    set_error("fake NCCL: ncclCommInitRankConfig: rank %d joined this unique id twice", rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  cl->member[rank] = 1;
  c->cl = cl;
  c->rank = rank;
  c->nranks = nranks;
  c->blocking = blocking;
  cl->refs++;
  if (++cl->joined == nranks) {
    retire_locked(&id);
    pthread_cond_broadcast(&g_cv);
  }
  atomic_fetch_add(&comms_created, 1);
  atomic_fetch_add(&comms_live, 1);
  atomic_store(&last_nranks, nranks);
  if (blocking) {
    const struct timespec deadline = wait_deadline();
    int timed_out = 0;
    c->busy++;
    while (cl->joined < nranks && !cl->aborted && !timed_out) timed_out = !wait_locked(&deadline);
    c->busy--;
    if (cl->joined < nranks) { /* a blocking init that fails leaves no communicator behind */
      const int was_ended = c->dead;
      if (!was_ended) {
        c->dead = 1;
        cl->gone[rank] = 1;
      }
      free_comm_locked(c);
      pthread_mutex_unlock(&g_mu);
      if (!was_ended) atomic_fetch_sub(&comms_live, 1);
      set_error("fake NCCL: ncclCommInitRankConfig (rank %d): %s", rank,
                timed_out ? "not every rank joined within FAKE_NCCL_WAIT_MS" : "a rank aborted during initialization");
      return T3D_NCCL_REMOTE_ERROR;
    }
  }
  pthread_mutex_unlock(&g_mu);
  *out = c;
  /* Nonblocking: the caller polls ncclCommGetAsyncError until every rank has joined. */
  return blocking ? T3D_NCCL_SUCCESS : T3D_NCCL_IN_PROGRESS;
}

/* Every operation ran when it was called, so there is nothing to flush; a nonblocking communicator still reports
 * IN_PROGRESS once, so that the caller's poll loop runs. */
t3d_nccl_result_t ncclCommFinalize(t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  if (enter(FN_COMM_FINALIZE, &res)) return res;
  comm_t *c = comm;
  if (!c) return T3D_NCCL_INVALID_ARGUMENT;
  pthread_mutex_lock(&g_mu);
  const int again = c->finalized;
  c->finalized = 1;
  c->finalize_polls = c->blocking ? 0 : 1;
  pthread_mutex_unlock(&g_mu);
  if (again) {
    set_error("fake NCCL: ncclCommFinalize on rank %d: already finalized", c->rank);
    return T3D_NCCL_INVALID_USAGE;
  }
  return c->blocking ? T3D_NCCL_SUCCESS : T3D_NCCL_IN_PROGRESS;
}

static t3d_nccl_result_t end_comm(int fn, t3d_nccl_comm_t comm) {
  comm_t *c = comm;
  pthread_mutex_lock(&g_mu);
  if (c->dead) {
    pthread_mutex_unlock(&g_mu);
    set_error("fake NCCL: %s: the communicator was already destroyed or aborted", fn_names[fn]);
    return T3D_NCCL_INVALID_USAGE;
  }
  c->dead = 1;
  c->cl->gone[c->rank] = 1;
  if (fn == FN_COMM_ABORT) c->cl->aborted = 1;
  pthread_cond_broadcast(&g_cv);
  if (c->busy == 0) free_comm_locked(c);
  pthread_mutex_unlock(&g_mu);
  atomic_fetch_sub(&comms_live, 1);
  if (fn == FN_COMM_ABORT) atomic_fetch_add(&comms_aborted, 1);
  return T3D_NCCL_SUCCESS;
}

t3d_nccl_result_t ncclCommDestroy(t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  if (enter(FN_COMM_DESTROY, &res)) return res;
  if (!comm) return T3D_NCCL_INVALID_ARGUMENT;
  return end_comm(FN_COMM_DESTROY, comm);
}

t3d_nccl_result_t ncclCommAbort(t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  if (enter(FN_COMM_ABORT, &res)) return res;
  if (!comm) return T3D_NCCL_SUCCESS; /* NCCL accepts a NULL communicator here */
  return end_comm(FN_COMM_ABORT, comm);
}

t3d_nccl_result_t ncclCommGetAsyncError(t3d_nccl_comm_t comm, t3d_nccl_result_t *err) {
  t3d_nccl_result_t res;
  if (enter(FN_GET_ASYNC_ERROR, &res)) return res;
  if (!comm || !err) return T3D_NCCL_INVALID_ARGUMENT;
  comm_t *c = comm;
  const int injected = atomic_load(&injected_async);
  pthread_mutex_lock(&g_mu);
  if (c->cl->aborted) {
    *err = T3D_NCCL_REMOTE_ERROR;
    set_error("fake NCCL: a rank of this communicator aborted it");
  } else if (!comm_ready(c)) {
    *err = T3D_NCCL_IN_PROGRESS;
  } else if (c->finalize_polls > 0) {
    c->finalize_polls--;
    *err = T3D_NCCL_IN_PROGRESS;
  } else if (injected != 0) {
    *err = injected;
    set_error("fake NCCL: injected asynchronous error %d", injected);
  } else {
    *err = c->async_error;
  }
  pthread_mutex_unlock(&g_mu);
  return T3D_NCCL_SUCCESS;
}

const char *ncclGetErrorString(t3d_nccl_result_t code) {
  t3d_nccl_result_t res;
  (void)enter(FN_GET_ERROR_STRING, &res);
  switch (code) {
    case T3D_NCCL_SUCCESS: return "no error";
    case T3D_NCCL_UNHANDLED_CUDA_ERROR: return "unhandled cuda error (fake)";
    case T3D_NCCL_SYSTEM_ERROR: return "unhandled system error (fake)";
    case T3D_NCCL_INTERNAL_ERROR: return "internal error (fake)";
    case T3D_NCCL_INVALID_ARGUMENT: return "invalid argument (fake)";
    case T3D_NCCL_INVALID_USAGE: return "invalid usage (fake)";
    case T3D_NCCL_REMOTE_ERROR: return "remote process exited or there was a network error (fake)";
    case T3D_NCCL_IN_PROGRESS: return "NCCL operation in progress (fake)";
    default: return "unknown result code (fake)";
  }
}

const char *ncclGetLastError(t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  (void)comm;
  (void)enter(FN_GET_LAST_ERROR, &res);
  return last_error;
}

t3d_nccl_result_t ncclRedOpCreatePreMulSum(t3d_nccl_redop_t *op, void *scalar, t3d_nccl_dtype_t dt, int residence,
                                           t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  if (enter(FN_PREMUL_CREATE, &res)) return res;
  comm_t *c = comm;
  if (!op || !scalar || !c || dtype_size(dt) == 0 || (residence != 0 && residence != 1)) {
    set_error("fake NCCL: ncclRedOpCreatePreMulSum: bad arguments (dtype %d, residence %d)", dt, residence);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  pthread_mutex_lock(&g_mu);
  int k = 0;
  while (k < c->nops && c->ops[k].in_use) ++k;
  if (k == c->nops) {
    premul_t *p = realloc(c->ops, (size_t)(c->nops + 1) * sizeof *p);
    if (!p) {
      pthread_mutex_unlock(&g_mu);
      return T3D_NCCL_SYSTEM_ERROR;
    }
    c->ops = p;
    c->nops++;
  }
  premul_t *slot = &c->ops[k];
  memset(slot, 0, sizeof *slot);
  slot->in_use = 1;
  slot->dtype = dt;
  slot->residence = residence;
  slot->ptr = scalar;
  if (residence == T3D_NCCL_SCALAR_HOST_IMMEDIATE) memcpy(slot->value, scalar, dtype_size(dt));
  pthread_mutex_unlock(&g_mu);
  atomic_fetch_add(&premul_live, 1);
  *op = T3D_NCCL_NUM_OPS + k;
  return T3D_NCCL_SUCCESS;
}

t3d_nccl_result_t ncclRedOpDestroy(t3d_nccl_redop_t op, t3d_nccl_comm_t comm) {
  t3d_nccl_result_t res;
  if (enter(FN_REDOP_DESTROY, &res)) return res;
  comm_t *c = comm;
  const int k = op - T3D_NCCL_NUM_OPS;
  if (!c) return T3D_NCCL_INVALID_ARGUMENT;
  pthread_mutex_lock(&g_mu);
  const int known = op >= T3D_NCCL_NUM_OPS && k < c->nops && c->ops[k].in_use;
  if (known) c->ops[k].in_use = 0;
  pthread_mutex_unlock(&g_mu);
  if (!known) {
    set_error("fake NCCL: ncclRedOpDestroy: operator %d was not made by ncclRedOpCreatePreMulSum on this "
              "communicator", op);
    return T3D_NCCL_INVALID_ARGUMENT;
  }
  atomic_fetch_sub(&premul_live, 1);
  return T3D_NCCL_SUCCESS;
}

static op_t make_op(int fn, const void *send, void *recv, size_t count, t3d_nccl_dtype_t dt, int root,
                    t3d_nccl_comm_t comm) {
  op_t op;
  memset(&op, 0, sizeof op);
  op.fn = fn;
  op.comm = comm;
  op.send = send;
  op.recv = recv;
  op.count = count;
  op.dtype = dt;
  op.root = root;
  op.opclass = -1;
  return op;
}

t3d_nccl_result_t ncclAllReduce(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt,
                                t3d_nccl_redop_t redop, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_ALLREDUCE, &res)) return res;
  note_call(FN_ALLREDUCE, stream, dt, redop, count);
  op_t op = make_op(FN_ALLREDUCE, sendbuf, recvbuf, count, dt, 0, comm);
  if ((res = check_op(&op, sendbuf, recvbuf)) != T3D_NCCL_SUCCESS) return res;
  if ((res = resolve_op(&op, redop)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclBroadcast(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt, int root,
                                t3d_nccl_comm_t comm, t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_BROADCAST, &res)) return res;
  note_call(FN_BROADCAST, stream, dt, -1, count);
  op_t op = make_op(FN_BROADCAST, sendbuf, recvbuf, count, dt, root, comm);
  /* Only the root's sendbuf is read. */
  const int is_root = comm && root == ((comm_t *)comm)->rank;
  if ((res = check_op(&op, is_root ? sendbuf : recvbuf, recvbuf)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclReduce(const void *sendbuf, void *recvbuf, size_t count, t3d_nccl_dtype_t dt,
                             t3d_nccl_redop_t redop, int root, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_REDUCE, &res)) return res;
  note_call(FN_REDUCE, stream, dt, redop, count);
  op_t op = make_op(FN_REDUCE, sendbuf, recvbuf, count, dt, root, comm);
  /* Only the root's recvbuf is written. */
  const int is_root = comm && root == ((comm_t *)comm)->rank;
  if ((res = check_op(&op, sendbuf, is_root ? recvbuf : sendbuf)) != T3D_NCCL_SUCCESS) return res;
  if ((res = resolve_op(&op, redop)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclAllGather(const void *sendbuf, void *recvbuf, size_t sendcount, t3d_nccl_dtype_t dt,
                                t3d_nccl_comm_t comm, t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_ALLGATHER, &res)) return res;
  note_call(FN_ALLGATHER, stream, dt, -1, sendcount);
  op_t op = make_op(FN_ALLGATHER, sendbuf, recvbuf, sendcount, dt, 0, comm);
  if ((res = check_op(&op, sendbuf, recvbuf)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclReduceScatter(const void *sendbuf, void *recvbuf, size_t recvcount, t3d_nccl_dtype_t dt,
                                    t3d_nccl_redop_t redop, t3d_nccl_comm_t comm, t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_REDUCE_SCATTER, &res)) return res;
  note_call(FN_REDUCE_SCATTER, stream, dt, redop, recvcount);
  op_t op = make_op(FN_REDUCE_SCATTER, sendbuf, recvbuf, recvcount, dt, 0, comm);
  if ((res = check_op(&op, sendbuf, recvbuf)) != T3D_NCCL_SUCCESS) return res;
  if ((res = resolve_op(&op, redop)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclSend(const void *buf, size_t count, t3d_nccl_dtype_t dt, int peer, t3d_nccl_comm_t comm,
                           t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_SEND, &res)) return res;
  note_call(FN_SEND, stream, dt, -1, count);
  if (count == 0) atomic_fetch_add(&zero_p2p, 1);
  op_t op = make_op(FN_SEND, buf, NULL, count, dt, peer, comm);
  if ((res = check_op(&op, buf, buf)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclRecv(void *buf, size_t count, t3d_nccl_dtype_t dt, int peer, t3d_nccl_comm_t comm,
                           t3d_cuda_stream_t stream) {
  t3d_nccl_result_t res;
  if (enter(FN_RECV, &res)) return res;
  note_call(FN_RECV, stream, dt, -1, count);
  if (count == 0) atomic_fetch_add(&zero_p2p, 1);
  op_t op = make_op(FN_RECV, NULL, buf, count, dt, peer, comm);
  if ((res = check_op(&op, buf, buf)) != T3D_NCCL_SUCCESS) return res;
  return submit(&op);
}

t3d_nccl_result_t ncclGroupStart(void) {
  t3d_nccl_result_t res;
  if (enter(FN_GROUP_START, &res)) return res;
  group_depth++;
  return T3D_NCCL_SUCCESS;
}

t3d_nccl_result_t ncclGroupEnd(void) {
  t3d_nccl_result_t res;
  const int failed = enter(FN_GROUP_END, &res);
  if (group_depth == 0) {
    set_error("fake NCCL: ncclGroupEnd without ncclGroupStart");
    return T3D_NCCL_INVALID_USAGE;
  }
  if (failed) { /* an injected failure drops the whole group, as a failed launch would */
    free(group_ops);
    group_ops = NULL;
    group_depth = 0;
    group_nops = group_cap = 0;
    return res;
  }
  if (--group_depth > 0) return T3D_NCCL_SUCCESS;
  const size_t n = group_nops;
  op_t *ops = group_ops;
  group_ops = NULL;
  group_nops = group_cap = 0;
  int nonblocking = 0;
  for (size_t i = 0; i < n; ++i) nonblocking |= !ops[i].comm->blocking;
  res = n ? run_ops(ops, n) : T3D_NCCL_SUCCESS;
  free(ops);
  if (res == T3D_NCCL_SUCCESS && nonblocking) return T3D_NCCL_IN_PROGRESS;
  return res;
}

/* ---------- test hooks ---------- */

int fake_nccl_comms_created(void) { return atomic_load(&comms_created); }
int fake_nccl_comms_live(void) { return atomic_load(&comms_live); }
int fake_nccl_aborts(void) { return atomic_load(&comms_aborted); }
int fake_nccl_last_nranks(void) { return atomic_load(&last_nranks); }
/* The config's blocking flag of the last ncclCommInitRankConfig (1 when it left the default), -1 before any. */
int fake_nccl_last_blocking(void) { return atomic_load(&last_blocking); }
/* The stream of the last operation call, in the process and on the calling thread. */
void *fake_nccl_last_stream(void) { return atomic_load(&last_stream); }
void *fake_nccl_thread_last_stream(void) { return tls_last_stream; }
/* Starts counting this thread's operation calls and those whose stream is not `stream`. */
void fake_nccl_thread_expect_stream(void *stream) {
  tls_expect_stream = stream;
  tls_op_calls = tls_stream_misses = 0;
}
int fake_nccl_thread_op_calls(void) { return tls_op_calls; }
int fake_nccl_thread_stream_misses(void) { return tls_stream_misses; }
/* This thread's last operation call: its function name ("" before any), data type, operator (-1 for data movement,
 * 5 for any PreMulSum operator) and count. */
const char *fake_nccl_thread_last_fn(void) { return tls_last_fn < 0 ? "" : fn_names[tls_last_fn]; }
int fake_nccl_thread_last_dtype(void) { return tls_last_dtype; }
int fake_nccl_thread_last_op(void) { return tls_last_op; }
size_t fake_nccl_thread_last_count(void) { return tls_last_count; }
/* Every live communicator reports `result` from ncclCommGetAsyncError until this is called again with 0. */
void fake_nccl_inject_async_error(int result) { atomic_store(&injected_async, result); }
/* PreMulSum operators created and not yet destroyed. */
int fake_nccl_premul_live(void) { return atomic_load(&premul_live); }
/* ncclSend / ncclRecv calls with a count of 0. */
int fake_nccl_zero_count_p2p(void) { return atomic_load(&zero_p2p); }

/* Calls of an NCCL function by name ("ncclBroadcast"), from every thread; -1 for an unknown name. */
long fake_nccl_calls(const char *name) {
  for (int i = 0; i < FN_COUNT; ++i)
    if (name && strcmp(name, fn_names[i]) == 0) return atomic_load(&fn_calls[i]);
  return -1;
}

/* The next call of the named function on this thread returns `result` and does nothing; 0 when the name is known,
 * -1 (and no failure pending) otherwise. */
int fake_nccl_fail_next(const char *name, int result) {
  fail_fn = -1; /* an unknown name clears a pending failure */
  for (int i = 0; i < FN_COUNT; ++i) {
    if (name && strcmp(name, fn_names[i]) == 0) {
      fail_fn = i;
      fail_res = result;
      return 0;
    }
  }
  return -1;
}
