// harness_shm.h: what tests read of a communicator's shared-memory state (harness_shm.c, in C: that state uses C11
// atomics, which C++17 cannot include).
#ifndef T3D_HARNESS_SHM_H
#define T3D_HARNESS_SHM_H

#include <stdint.h>

#include "t3d.h"

#ifdef __cplusplus
extern "C" {
#endif

// The placement probes comm has run (c_src/shm/sync.c, t3d__shm_far) and what the last timed one found (1: far).
// Returns 0 when comm has no shared-memory segment.
int t3dtest_shm_placement(const t3d_comm_t *comm, uint64_t *probes, int *far);

#ifdef __cplusplus
}
#endif

#endif
