/* nccl_provider.c: the NCCL provider's entry in the engine's table: every operation on CUDA buffers, enqueued on
 * the caller's stream at issue time (nccl_coll.c). */
#include "nccl_internal.h"
#include "provider.h"

static int nccl_fits(const t3d_comm_t *comm, const t3d_request_t *req) {
  (void)comm;
  return req->memtype == T3D_MEM_CUDA;
}

const t3d_provider_t t3d__provider_nccl = {
    .name = "nccl",
    .fits = nccl_fits,
    .post = t3d__nccl_run,
    .post_on_caller = 1,
};
