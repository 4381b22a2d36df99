/* comm.h: the communicator and request structures shared by comm.c (engine), coll.c (front end) and the
 * transports. Algorithms never see them: they get a t3d_exec_t. */
#ifndef T3D_COMM_H
#define T3D_COMM_H

#include "t3d_internal.h"

#include <pthread.h>

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
  t3d_result_t result;
  char *errmsg;
  pthread_mutex_t mu; /* guards cb, waiters, errmsg publication */
  pthread_cond_t cv;
  t3d_callback_t cb;
  void *cb_arg;
  /* what the operation does */
  uint64_t seq;
  int64_t timeout_ms;
  uint64_t deadline_ns; /* point-to-point: set when posted; inline collectives: set when started */
  int resume;           /* an inline collective that the progress thread finishes (rs) */
  t3d_shm_resume_t rs;
  const void *sendbuf;
  void *recvbuf;
  size_t count;
  t3d_dtype_t dtype;
  t3d_redop_t op;
  double scalar;
  unsigned flags;
  t3d_memtype_t memtype; /* T3D_MEM_CUDA: run through NCCL on stream (c_src/nccl/) */
  int device;
  void *stream;
  int root; /* also the peer of send/recv */
  int64_t tag;
  size_t *arrays; /* copied counts/displacements, one allocation */
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
};

typedef struct t3d_nccl t3d_nccl_t;

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

  atomic_int aborted;
  atomic_int fatal; /* t3d_result_t that broke the communicator, 0 if none */
  char fatal_msg[512];

  int64_t inline_max;      /* allreduce up to this many bytes may start on the caller's thread (-1: never) */
  uint64_t inline_wait_ns; /* how long the caller waits for its peers before handing over (T3D_INLINE_WAIT_NS) */

  int group_depth; /* caller thread only */
  t3d_request_t *group_head, *group_tail;

  t3d_request_t *active_p2p; /* progress thread only */

  pthread_mutex_t err_mu;
  char last_error[1024];
};

/* Records the text of an error as the communicator's last error and returns res. */
t3d_result_t t3d__set_error(t3d_comm_t *comm, t3d_result_t res, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Store helpers with the communicator's key prefix. */
t3d_result_t t3d__store_set(t3d_comm_t *comm, const char *key, const void *value, size_t len);
t3d_result_t t3d__store_get(t3d_comm_t *comm, const char *key, void **value, size_t *len);

/* Completes a request (its callback, its group) and drops the engine's reference. */
void t3d__request_complete(t3d_request_t *req, t3d_result_t res, const char *msg);
/* Breaks the communicator: later operations fail at once with res and msg. */
void t3d__fail_comm(t3d_comm_t *comm, t3d_result_t res, const char *msg);
/* "allreduce", "send", ... */
const char *t3d__op_name(t3d_op_kind_t kind);

/* Engine (comm.c), used by the front end (coll.c). */
t3d_result_t t3d__request_new(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t **req);
void t3d__request_release(t3d_request_t *req);
/* Fills *req (on the caller's stack) as t3d__request_new would, without its mutex and condition variable: for
 * t3d__submit_prepared. */
void t3d__request_prepare(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, t3d_request_t *req);
/* Queues req (or holds it in the open group) and hands the user's reference back through out. */
t3d_result_t t3d__submit(t3d_comm_t *comm, t3d_request_t *req, t3d_request_t **out);
/* t3d__submit for a prepared request, which it owns from here (also req->arrays): a small collective that finishes
 * on the caller's thread without error hands out a shared done request and allocates nothing; otherwise req is
 * copied to the heap and goes on as with t3d__submit. */
t3d_result_t t3d__submit_prepared(t3d_comm_t *comm, t3d_request_t *req, t3d_request_t **out);
/* Runs one collective on the progress thread (coll.c). */
/* Finishes an inline one when req->resume is set. */
t3d_result_t t3d__execute(t3d_exec_t *ex, t3d_request_t *req);
/* Inline collectives (coll.c): whether req may start on the caller's thread (the engine must be idle), and the
 * start, which returns the result when the operation finished within a short wait, or T3D_IN_PROGRESS with
 * req->resume set when the progress thread must finish it. */
int t3d__inline_eligible(t3d_comm_t *comm, const t3d_request_t *req);
t3d_result_t t3d__execute_start(t3d_exec_t *ex, t3d_request_t *req);

#endif /* T3D_COMM_H */
