/* comm.h: the communicator and request structures, and the base's functions on them (base/: errors, the store,
 * requests). Shared by the engine (core/), the public API (coll.c) and the providers (shm/, ucx/, nccl/);
 * collective algorithms mostly see a t3d_exec_t. */
#ifndef T3D_COMM_H
#define T3D_COMM_H

#include "t3d_internal.h"

#include <pthread.h>

struct t3d_provider;

typedef enum {
  T3D_OP_ALLREDUCE,
  T3D_OP_BROADCAST,
  T3D_OP_REDUCE,
  T3D_OP_ALLGATHERV,
  T3D_OP_GATHER,
  T3D_OP_SCATTER,
  T3D_OP_REDUCE_SCATTERV,
  T3D_OP_ALLTOALLV,
  T3D_OP_BARRIER,
  T3D_OP_SEND,
  T3D_OP_RECV,
  T3D_OP_GROUP
} t3d_op_kind_t;

struct t3d_request {
  t3d_comm_t *comm;
  t3d_op_kind_t kind;
  atomic_int done;
  atomic_int refs; /* the user's handle and the engine's */
  int shared;      /* one request handed out by many calls (core/submit.c's done request): never freed */
  const struct t3d_provider *prov; /* what runs it (core/select.c); NULL for a group */
  t3d_result_t result;
  char *errmsg;
  atomic_int hooks; /* threads asleep on cv, plus one once a callback is set: only then does completion take mu */
  t3d_callback_t cb;
  void *cb_arg;
  /* what the operation does */
  uint64_t seq;
  int64_t timeout_ms;
  uint64_t deadline_ns; /* shm point-to-point: stamped by the first pass that reads the clock after its post (0
                         * until then); inline collectives: set when started */
  int resume;           /* an inline collective that the progress thread finishes (rs) */
  t3d_shm_resume_t rs;
  const void *sendbuf;
  void *recvbuf;
  size_t count;
  t3d_dtype_t dtype;
  t3d_redop_t op;
  double scalar;
  unsigned flags;
  t3d_memtype_t memtype; /* T3D_MEM_CUDA: on stream, through NCCL (c_src/nccl/) or staged (c_src/cudev/) */
  int device;
  void *stream;
  int root; /* also the peer of send/recv */
  int64_t tag;
  size_t *arrays; /* copied counts/displacements, one allocation, or the caller's stack (arrays_borrowed) */
  int arrays_borrowed; /* arrays lives in the issuing call's frame: t3d__request_keep copies it to the heap */
  size_t *scounts, *sdispls, *rcounts, *rdispls;
  int equal_blocks; /* alltoallv from t3d_alltoall: every rank knows every block's size (shm: single copy at once) */
  /* point-to-point over shared memory (shm/p2p.c): on_shm, also on a group with such children (waiters then
   * drive progress), and a rendezvous send's record */
  int on_shm;
  uint32_t shm_rec;
  uint64_t shm_gen;
  /* point-to-point results */
  t3d_xfer_t xfer;
  int source;
  size_t recv_count;
  /* groups */
  struct t3d_request *parent;
  struct t3d_request *children; /* linked through next_child */
  struct t3d_request *next_child;
  atomic_int pending_children;
  t3d_result_t first_child_error;
  /* queue or active-list link */
  struct t3d_request *next;
  /* Last, and left alone by t3d__request_prepare: a request that a thread's cache hands out again keeps them set up
   * (base/request.c). */
  pthread_mutex_t mu; /* guards cb and the sleep on cv */
  pthread_cond_t cv;
};

typedef struct t3d_nccl t3d_nccl_t;
typedef struct t3d_hier t3d_hier_t;
typedef struct t3d_cudev t3d_cudev_t;

struct t3d_comm {
  int rank, size;
  char name[64];
  char prefix[256];
  t3d_store_t store;
  int64_t timeout_ms;
  const t3d_transport_t *tp;
  void *tp_state;
  t3d_shm_t *shm; /* same-host collectives, or NULL */
  t3d_shm_p2p_t *shm_p2p; /* same-host point-to-point, or NULL (then UCX) */
  t3d_nccl_t *nccl; /* CUDA buffers (c_src/nccl/) */
  t3d_cudev_t *cudev; /* CUDA buffers of ranks that share a device: staged through host memory (c_src/cudev/) */
  t3d_hier_t *hier; /* across hosts with several ranks on each: the two-level collectives (core/hier.c), or NULL */
  /* The provider whose posted point-to-point completes only when someone runs its passes (shm): t3d_test and
   * t3d_wait drive it for requests marked on_shm (base/request.c). NULL when there is none. */
  const struct t3d_provider *p2p_driver;
  /* Who runs each kind of operation on each kind of memory (core/select.c fills it at init; NULL: nobody). */
  const struct t3d_provider *choice[T3D_OP_GROUP][2];
  const struct t3d_provider *next_choice[T3D_OP_GROUP][2]; /* the next that fits, when the first declines (takes) */
  char transport[16]; /* what was asked for: auto, ucx or shm (splits inherit it) */

  pthread_t thread;
  int thread_started;
  pthread_mutex_t mu; /* queue, stop, coll_seq, split_count */
  pthread_cond_t cv;
  t3d_request_t *q_head, *q_tail;
  int busy; /* a request is being run (by the progress thread, or inline by a caller) */
  int stop;
  uint64_t coll_seq;
  int split_count;
  /* The owner's path (core/submit.c): the thread that made the communicator starts collectives without mu while
   * only it issues, the queue is empty and the progress thread has finished all it took. */
  pthread_t owner;
  int owner_path;              /* set at init where membarrier(2) is there: the path may be taken */
  atomic_int shared;           /* another thread issued: the path is off for good */
  atomic_int in_owner_path;    /* the owner is between its check and the end of what it started */
  _Atomic uint64_t enqueued;   /* requests put in the queue (under mu) */
  _Atomic uint64_t finished;   /* of those, the ones the progress thread has run and released (written by it alone) */

  atomic_int aborted;
  atomic_int fatal; /* t3d_result_t that broke the communicator, 0 if none */
  char fatal_msg[1024];
  /* The watch (base/watch.h), for groups not on one host's segment: its thread sets these once, when a peer is
   * lost or tells of a failure (watch_told, watch_since_ns and watch_msg before watch_res, with release order). */
  struct t3d_watch_reg *watch;
  atomic_int watch_res;
  int watch_told;
  uint64_t watch_since_ns;
  char watch_msg[800];

  int64_t inline_max;      /* allreduce up to this many bytes may start on the caller's thread (-1: never) */
  uint64_t inline_wait_ns; /* how long the caller waits for its peers before handing over (T3D_INLINE_WAIT_NS) */

  int group_depth; /* caller thread only */
  t3d_request_t *group_head, *group_tail;

  t3d_request_t *active_p2p; /* UCX point-to-point in flight (ucx/p2p.c); progress thread only */
  /* The UCX ring reduce-scatter's receive buffers (ucx/ring.c), kept from one operation to the next; only the
   * operation running uses them (one at a time: `busy`). Freed with the communicator. */
  void *ring_scratch;
  size_t ring_scratch_bytes;

  pthread_mutex_t err_mu;
  char last_error[1024];
};

/* ---------- errors and the store (base/error.c) ---------- */
/* Records the text of an error as the communicator's last error (and the thread's) and returns res. */
t3d_result_t t3d__set_error(t3d_comm_t *comm, t3d_result_t res, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Breaks the communicator: later operations fail at once with res and msg. */
void t3d__fail_comm(t3d_comm_t *comm, t3d_result_t res, const char *msg);
/* The text of the last error on this thread (t3d_thread_last_error). */
const char *t3d__thread_error(void);
/* Store helpers with the communicator's key prefix. */
t3d_result_t t3d__store_set(t3d_comm_t *comm, const char *key, const void *value, size_t len);
t3d_result_t t3d__store_get(t3d_comm_t *comm, const char *key, void **value, size_t *len);

/* ---------- requests (base/request.c) ---------- */
/* Fills *req (on the caller's stack) as t3d__request_new would, without its mutex and condition variable: for
 * t3d__submit_prepared (core/submit.c), which keeps it on the heap (t3d__request_keep) only when it must. */
void t3d__request_prepare(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t *req);
/* A heap copy of a prepared request, with its mutex and condition variable (and of its arrays, where they were
 * borrowed); NULL when out of memory. */
t3d_request_t *t3d__request_keep(const t3d_request_t *prepared);
/* Frees a request's arrays unless they are borrowed from the issuing call's frame. */
void t3d__request_drop_arrays(t3d_request_t *r);
t3d_result_t t3d__request_new(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t **req);
void t3d__request_release(t3d_request_t *req);
/* Completes a request (its callback, its group) and drops the engine's reference. */
void t3d__request_complete(t3d_request_t *req, t3d_result_t res, const char *msg);
/* The same for a request that finished on the caller's thread before the call handed it out: nobody can wait on
 * it, have set a callback or hold it as a child yet, so no mutex, broadcast or atomic read-modify-write. */
void t3d__request_complete_fresh(t3d_request_t *req, t3d_result_t res, const char *msg);
/* "allreduce", "send", ... */
const char *t3d__op_name(t3d_op_kind_t kind);
static inline int t3d__is_collective(t3d_op_kind_t k) {
  return k != T3D_OP_SEND && k != T3D_OP_RECV && k != T3D_OP_GROUP;
}

#endif /* T3D_COMM_H */
