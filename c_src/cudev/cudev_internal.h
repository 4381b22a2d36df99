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

#endif /* T3D_CUDEV_INTERNAL_H */
