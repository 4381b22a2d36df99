/* barrier.c: barrier over a communicator's shared-memory segment: one phase, which every rank posts and then waits
 * for every other rank to have posted; also in parts (start posts, finish waits), for the inline path. */
#include "shm.h"

t3d_result_t t3d__shm_barrier(t3d_exec_t *ex) {
  t3d_shm_resume_t rs;
  t3d__shm_barrier_start(ex, &rs);
  return t3d__shm_barrier_finish(ex, &rs);
}

void t3d__shm_barrier_start(t3d_exec_t *ex, t3d_shm_resume_t *rs) {
  t3d_shm_t *s = t3d__exec_shm(ex);
  rs->h = 0;
  rs->base = s->phase++; /* one phase: base + 1 */
  t3d__shm_post(s, rs->base + 1);
}

t3d_result_t t3d__shm_barrier_finish(t3d_exec_t *ex, const t3d_shm_resume_t *rs) {
  return t3d__shm_wait(t3d__exec_shm(ex), ex, -1, rs->base + 1);
}
