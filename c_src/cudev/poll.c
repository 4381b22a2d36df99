/* poll.c: how the same-device code waits for the device: a query (cudaStreamQuery, cudaEventQuery) polled with the
 * usual spin, yield, nap, ended by the communicator's abort and the deadline (cudev.c's staging, ipc.c's host waits). */
#include "cudev_internal.h"

#include <stdio.h>

t3d_result_t t3d__cudev_poll(t3d_comm_t *comm, const t3d_cudart_api_t *api,
                             t3d_cuda_error_t (*query)(void *), void *handle, const char *call, const char *what,
                             uint64_t deadline_ns, char *err, size_t errlen) {
  t3d_backoff_t b = {0};
  for (;;) {
    t3d_cuda_error_t e = query(handle);
    if (e == T3D_CUDA_SUCCESS) return T3D_OK;
    if (e != T3D_CUDA_NOT_READY) {
      snprintf(err, errlen, "%s failed: %s", call, api->GetErrorString(e) != NULL ? api->GetErrorString(e) : "unknown CUDA error");
      return T3D_ERR_TRANSPORT; /* breaks the group: peers must not wait for this rank */
    }
    if (atomic_load(&comm->aborted)) {
      snprintf(err, errlen, "aborted while waiting for %s", what);
      return T3D_ERR_ABORTED;
    }
    if (t3d__now_ns() > deadline_ns) {
      snprintf(err, errlen, "timed out waiting for %s", what);
      return T3D_ERR_TIMEOUT;
    }
    t3d__backoff_wait(&b);
  }
}

