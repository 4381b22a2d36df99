/* select.c: the one place where the engine chooses who runs an operation. The providers are tried in order and the
 * first whose fits() accepts the request runs it:
 *   shm   host memory, every rank of the communicator on this host (the segment exists): collectives, and
 *         point-to-point when every rank can read the others' memory; gather and scatter only without UCX
 *   cudev CUDA memory of ranks that share a device (NCCL refuses them), decided at the first CUDA call (takes):
 *         staged through host memory, the collective or transfer run by the host provider
 *   nccl  CUDA memory: everything, on the caller's stream
 *   hier  host memory across hosts with several ranks on each (comm->hier, core/hier.c): allreduce in two levels,
 *         shared memory inside each host and UCX between hosts
 *   ucx   host memory: everything else (ranks on other hosts, T3D_TRANSPORT=ucx, gather and scatter)
 * T3D_PROVIDERS (a comma list of these names) changes the order or leaves providers out, for tests and
 * comparisons: "ucx" runs a same-host communicator's collectives and point-to-point through the UCX algorithms. */
#include "engine.h"

#include <pthread.h>
#include <string.h>

static const t3d_provider_t *const all[] = {&t3d__provider_shm, &t3d__provider_cudev, &t3d__provider_nccl,
                                            &t3d__provider_hier, &t3d__provider_ucx};
#define NALL ((int)(sizeof all / sizeof all[0]))

static const t3d_provider_t *chosen[NALL + 1];
static pthread_once_t chosen_once = PTHREAD_ONCE_INIT;

static void choose(void) {
  const char *want = t3d__param_str(T3D_PARAM_PROVIDERS);
  int n = 0;
  if (want == NULL) {
    for (int i = 0; i < NALL; i++) chosen[n++] = all[i];
    return;
  }
  const char *s = want;
  while (*s != '\0' && n < NALL) {
    size_t len = strcspn(s, ",");
    int found = 0;
    for (int i = 0; i < NALL; i++) {
      if (strlen(all[i]->name) != len || strncmp(all[i]->name, s, len) != 0) continue;
      found = 1;
      int dup = 0;
      for (int j = 0; j < n; j++) dup |= chosen[j] == all[i];
      if (!dup) chosen[n++] = all[i];
    }
    if (!found) {
      T3D_WARN("T3D_PROVIDERS=%s: ignoring '%.*s' (the providers are shm, cudev, nccl, hier, ucx)", want, (int)len,
               s);
    }
    s += len + (s[len] == ',');
  }
}

const t3d_provider_t *const *t3d__providers(void) {
  pthread_once(&chosen_once, choose);
  return chosen;
}

/* The answers depend on the communicator (what it set up at init), the kind and the memory only, so they are
 * worked out once: a call then costs one load instead of a walk through the table. */
void t3d__providers_choose(t3d_comm_t *comm) {
  for (int k = 0; k < T3D_OP_GROUP; k++) {
    for (int m = 0; m < 2; m++) {
      t3d_request_t probe;
      memset(&probe, 0, sizeof probe);
      probe.kind = (t3d_op_kind_t)k;
      probe.memtype = m == 0 ? T3D_MEM_HOST : T3D_MEM_CUDA;
      comm->choice[k][m] = comm->next_choice[k][m] = NULL;
      for (const t3d_provider_t *const *p = t3d__providers(); *p != NULL && comm->next_choice[k][m] == NULL; p++) {
        if (!(*p)->fits(comm, &probe)) continue;
        if (comm->choice[k][m] == NULL) comm->choice[k][m] = *p;
        else comm->next_choice[k][m] = *p;
        if (comm->choice[k][m]->takes == NULL) break; /* it takes all it fits: no next one is needed */
      }
    }
  }
}
