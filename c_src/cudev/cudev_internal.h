/* cudev_internal.h: ranks that share one CUDA device (c_src/cudev/). NCCL refuses two ranks of a communicator on
 * one device; these groups' CUDA buffers are staged through host memory instead: the device copies a rank's input
 * into host memory in stream order, the host provider (shared memory) runs the collective or the transfer, and the
 * device copies the result back, in stream order too. */
#ifndef T3D_CUDEV_INTERNAL_H
#define T3D_CUDEV_INTERNAL_H

#include "../comm.h"
#include "cudart_abi.h"

/* The loaded CUDA runtime, or NULL with *error (static text) saying why not (cudart_load.c). */
const t3d_cudart_api_t *t3d__cudart_api(const char **error);

/* A communicator's same-device state: made with the communicator (it loads nothing); T3D_CUDA_PATH is read here,
 * and a value it does not know fails the communicator's init. */
t3d_result_t t3d__cudev_new(t3d_comm_t *comm, t3d_cudev_t **out);
void t3d__cudev_free(t3d_cudev_t *st);

/* Polls query(handle) (cudaStreamQuery, cudaEventQuery) until it is done: spin, yield, nap; the communicator's
 * abort and the deadline end the wait. On failure err says so: "<call> failed: ...", or "... waiting for <what>". */
t3d_result_t t3d__cudev_poll(t3d_comm_t *comm, const t3d_cudart_api_t *api,
                             t3d_cuda_error_t (*query)(void *), void *handle, const char *call, const char *what,
                             uint64_t deadline_ns, char *err, size_t errlen);

/* The device path (ipc.c; T3D_CUDA_PATH auto or ipc): a communicator's buffers and events, made at its first such
 * call. */
typedef struct t3d_cudev_ipc t3d_cudev_ipc_t;
/* Whether r goes to the device path (t3d__cudev_ipc_run), the same answer on every rank: allreduce,
 * reduce_scatterv, broadcast and allgatherv of at least T3D_CUDA_IPC_MIN_BYTES, and every alltoallv (its ranks
 * agree at the run's first step). */
int t3d__cudev_ipc_takes(const t3d_request_t *r, int n);
/* Runs r on the device through the peers' mapped buffers, in r's stream order; *staged = 1 (and T3D_OK) when the
 * ranks agreed that this one must be staged instead (some rank lacks the kernel, the memory or equal blocks; or
 * CUDA IPC failed on some rank, which without strict stages every later call too). On failure err says why, or is
 * left empty when the host provider wrote ex->error. */
t3d_result_t t3d__cudev_ipc_run(t3d_exec_t *ex, t3d_request_t *r, t3d_cudev_ipc_t **state,
                                const t3d_cudart_api_t *api, t3d_result_t (*host)(t3d_exec_t *, t3d_request_t *),
                                int strict, int *staged, char *err, size_t errlen);
void t3d__cudev_ipc_free(t3d_cudev_ipc_t *s);

#endif /* T3D_CUDEV_INTERNAL_H */
