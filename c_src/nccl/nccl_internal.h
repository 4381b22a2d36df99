/* nccl_internal.h: what the engine (core/) calls to run requests on CUDA buffers through NCCL. */
#ifndef T3D_NCCL_INTERNAL_H
#define T3D_NCCL_INTERNAL_H

#include "../comm.h"
#include "nccl_abi.h"

/* The loaded library, or NULL with *error (static text) saying why not (nccl_load.c). */
const t3d_nccl_api_t *t3d__nccl_api(const char **error);

/* A communicator's NCCL side: made with the communicator (it loads nothing), its NCCL communicators created at the
 * first call that needs them. */
t3d_result_t t3d__nccl_new(t3d_nccl_t **out);
/* Finalizes and destroys the NCCL communicators (aborts them when broken, or when finalizing takes longer than
 * timeout_ms) and frees the state. NULL is fine. */
void t3d__nccl_free(t3d_nccl_t *st, int64_t timeout_ms);
/* Any thread: aborts every NCCL communicator; later calls fail with T3D_ERR_ABORTED. */
void t3d__nccl_abort(t3d_nccl_t *st);
/* Enqueues CUDA requests on the caller's thread and completes each of them. grouped: one NCCL group on the whole
 * communicator's NCCL communicator; otherwise n == 1, and a send or receive uses its pair's communicator. Returns
 * the first error (the requests carry it too). */
t3d_result_t t3d__nccl_run(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped);
/* Asks NCCL for asynchronous errors (a failed kernel, a lost peer) and breaks the communicator on one. */
void t3d__nccl_poll_errors(t3d_comm_t *comm);

#endif /* T3D_NCCL_INTERNAL_H */
