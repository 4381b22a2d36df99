/* shm.c: interim: no shared-memory path yet; every communicator uses the UCX algorithms. */
#include "comm.h"

t3d_result_t t3d__shm_init(t3d_comm_t *comm, t3d_shm_t **shm) {
  *shm = NULL;
  return T3D_OK;
}
void t3d__shm_fini(t3d_shm_t *shm) {}
#define UNAVAILABLE return T3D_ERR_INTERNAL
t3d_result_t t3d__shm_allreduce(t3d_exec_t *ex, const void *s, void *r, size_t c, t3d_dtype_t d, t3d_redop_t o) { UNAVAILABLE; }
t3d_result_t t3d__shm_reduce(t3d_exec_t *ex, const void *s, void *r, size_t c, t3d_dtype_t d, t3d_redop_t o, int root) { UNAVAILABLE; }
t3d_result_t t3d__shm_reduce_scatterv(t3d_exec_t *ex, const void *s, void *r, const size_t *c, t3d_dtype_t d, t3d_redop_t o) { UNAVAILABLE; }
t3d_result_t t3d__shm_broadcast(t3d_exec_t *ex, void *b, size_t n, int root) { UNAVAILABLE; }
t3d_result_t t3d__shm_allgatherv(t3d_exec_t *ex, const void *s, void *r, const size_t *b, const size_t *d) { UNAVAILABLE; }
t3d_result_t t3d__shm_alltoallv(t3d_exec_t *ex, const void *s, const size_t *a, const size_t *b, void *r, const size_t *c, const size_t *d) { UNAVAILABLE; }
t3d_result_t t3d__shm_barrier(t3d_exec_t *ex) { UNAVAILABLE; }
