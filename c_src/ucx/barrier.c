/* barrier.c: dissemination barrier: in round k each rank signals rank + 2^k and waits for rank - 2^k, so after
 * ceil(log2 size) rounds every rank has heard, directly or not, from every other. */
#include "ucx.h"

t3d_result_t t3d__algo_barrier(t3d_exec_t *ex) {
  int n = ex->size, r = ex->rank;
  uint32_t step = 0;
  for (int d = 1; d < n; d <<= 1, step++) {
    unsigned char out = 1, in = 0;
    T3D_CHECK(t3d__algo_xchg(ex, step, (r + d) % n, &out, 1, (r + n - d) % n, &in, 1));
  }
  return T3D_OK;
}
