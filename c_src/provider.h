/* provider.h: the interface every provider implements. A provider runs operations for some kind of memory and
 * reach: shm/ (every rank on this host: collectives through one shared segment, point-to-point through its rings),
 * ucx/ (the collective algorithms over UCX point-to-point, any host), nccl/ (CUDA buffers) and cudev/ (CUDA buffers
 * of ranks that share a device, staged through host memory). The engine
 * (core/select.c) walks its table of providers in order and takes the first whose fits() accepts a request; what
 * a provider may call is the base (c_src/base/, the reduction kernels), never the engine. */
#ifndef T3D_PROVIDER_H
#define T3D_PROVIDER_H

#include "comm.h"

/* Collectives in blocking style, on the thread that runs the request (the progress thread, or a caller whose call
 * is blocking). The front end (core/run.c) has already turned the request into plain buffers: reducing ones see
 * only SUM, PROD, MIN, MAX, BAND, BOR, BXOR on full-width real types (half types through float32, complex as pairs,
 * PREMUL_SUM's scalar applied before and AVG's division after). */
typedef struct t3d_coll_ops {
  t3d_result_t (*allreduce)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                            t3d_redop_t op);
  t3d_result_t (*reduce)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                         t3d_redop_t op, int root);
  t3d_result_t (*reduce_scatterv)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                  t3d_dtype_t dt, t3d_redop_t op);
  t3d_result_t (*broadcast)(t3d_exec_t *ex, void *buf, size_t bytes, int root);
  /* Block p: bytes[p] at byte offset displs[p] of recvbuf. */
  t3d_result_t (*allgatherv)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                             const size_t *displs);
  t3d_result_t (*gather)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root);
  t3d_result_t (*scatter)(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root);
  /* Counts and displacements in elements of es bytes; equal: from t3d_alltoall (blocks of one size at consecutive
   * places, which every rank knows). */
  t3d_result_t (*alltoallv)(t3d_exec_t *ex, const void *sendbuf, const size_t *scounts, const size_t *sdispls,
                            void *recvbuf, const size_t *rcounts, const size_t *rdispls, size_t es, int equal);
  t3d_result_t (*barrier)(t3d_exec_t *ex);
} t3d_coll_ops_t;

typedef struct t3d_provider {
  const char *name; /* "shm", "cudev", "nccl", "hier", "ucx": also what T3D_PROVIDERS names */
  /* Whether it can run req (a collective or a send / receive) on comm. It may look at req's kind and memtype
   * only: the engine asks once per communicator, kind and memory (core/select.c) and keeps the answers. */
  int (*fits)(const t3d_comm_t *comm, const t3d_request_t *req);
  /* For a provider whose answer depends on what the ranks find at their first such call (cudev: whether ranks share
   * a CUDA device), asked at every call it fits, on the caller's thread: 0 hands req to the next provider that
   * fits. It may talk to the peers through the store. NULL: it takes whatever fits. */
  int (*takes)(t3d_comm_t *comm, const t3d_request_t *req);
  /* Where its operations run. With `post`, they are issued at once on the caller's thread (NCCL enqueues on the
   * caller's stream; same-host point-to-point is posted into the segment) and complete later, through `progress`
   * or the device; `post_on_caller` says whether that happens on the caller's thread (1) or on the progress thread,
   * which takes the request from its queue first (0: UCX, whose worker only the progress thread drives). Without
   * `post` the request is queued and the progress thread runs it through `coll`. n requests; grouped: they were
   * issued inside t3d_group_start / t3d_group_end. A result below zero fails all of them. */
  t3d_result_t (*post)(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped);
  int post_on_caller;
  const t3d_coll_ops_t *coll; /* NULL: no host collectives (nccl) */
  /* Runs a whole collective instead of coll (cudev), on the thread that runs requests; it may hand `host` a
   * request on host memory of the same kind, which the engine runs through the provider it chose for host
   * memory, front end included. */
  t3d_result_t (*run)(t3d_exec_t *ex, t3d_request_t *req, t3d_result_t (*host)(t3d_exec_t *ex, t3d_request_t *req));
  /* A collective that starts on the caller's thread (core/submit.c): start_fits says whether req may (the engine
   * is idle and owns comm's state), start publishes this rank's part and returns T3D_OK when the operation
   * finished within a short wait, or T3D_IN_PROGRESS with req->resume set when finish must complete it later (on
   * the progress thread, or on the caller's if the call is blocking). NULL: never. */
  int (*start_fits)(const t3d_comm_t *comm, const t3d_request_t *req);
  t3d_result_t (*start)(t3d_exec_t *ex, t3d_request_t *req);
  t3d_result_t (*finish)(t3d_exec_t *ex, t3d_request_t *req);
  /* A hint before start: the caller will write `bytes` into its part soon (prefetch for ownership). */
  void (*warm)(t3d_comm_t *comm, const t3d_request_t *req);
  /* Posted point-to-point: drives it (returns nonzero when something completed or moved), says whether some is
   * still pending, and sleeps a waiter on req until a peer may have made progress (at most max_ns). */
  int (*progress)(t3d_comm_t *comm);
  int (*active)(t3d_comm_t *comm);
  void (*sleep)(t3d_comm_t *comm, const t3d_request_t *req, uint64_t max_ns);
  /* Whether a waiter on posted point-to-point should spin rather than yield now: a peer is running on another CPU,
   * so it is not queued behind the waiter (shm: the CPU words of as many ranks as cores). NULL: never. */
  int (*peer_running)(t3d_comm_t *comm);
  /* This rank's operation broke the communicator (res, msg): tell the other ranks, so that their waits end with
   * this error instead of their timeouts (shm: a word in the segment every wait checks). NULL: they cannot be told. */
  void (*broken)(t3d_comm_t *comm, t3d_result_t res, const char *msg);
} t3d_provider_t;

extern const t3d_provider_t t3d__provider_shm;  /* shm/provider.c */
extern const t3d_provider_t t3d__provider_ucx;  /* ucx/provider.c */
extern const t3d_provider_t t3d__provider_hier; /* core/hier.c: shm inside hosts + ucx between them */
extern const t3d_provider_t t3d__provider_nccl; /* nccl/nccl_coll.c */
extern const t3d_provider_t t3d__provider_cudev; /* cudev/cudev.c: CUDA buffers of ranks sharing a device */

#endif /* T3D_PROVIDER_H */
