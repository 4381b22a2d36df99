/* base/watch.h: liveness and failure reports between the processes of groups that do not share one host's segment
 * (groups across hosts, and any group run over UCX). One watch per process: a thread, a listening TCP socket, and
 * one connection to every process it shares such a group with, carrying heartbeats, failure reports and a goodbye.
 *
 * A peer is lost when its connection closes without a goodbye (its process died: found at once) or when nothing
 * came from it for T3D_PEER_TIMEOUT_MS (host down, network partition). Every group that has it then breaks, and a
 * wait on such a group fails: at once when it was told by a peer, after T3D__WATCH_GRACE_MS when it found a loss
 * itself (bytes the lost process sent before it went may still be on their way). The first rank whose collective
 * fails tells every other rank of the group (t3d__watch_tell), as the segment's header does on one host. */
#ifndef T3D_BASE_WATCH_H
#define T3D_BASE_WATCH_H

#include "comm.h"

/* A loss found by this rank fails waits only this long after it was found. */
#define T3D__WATCH_GRACE_MS 200

/* Adds comm to the watch (collective over comm: it goes through the store). A peer whose watch cannot be reached
 * is logged and left unwatched; the call fails only on store errors. */
t3d_result_t t3d__watch_join(t3d_comm_t *comm);
/* Takes comm out of the watch; says goodbye to the processes it no longer shares a group with. */
void t3d__watch_leave(t3d_comm_t *comm);
/* Tells every other rank of comm that its collective failed with res and msg (once per communicator). */
void t3d__watch_tell(t3d_comm_t *comm, t3d_result_t res, const char *msg);

/* What a wait on comm should fail with: T3D_OK, or the error code with the reason in comm->watch_msg
 * ("lost rank 2 (...): ..." or "failed: rank 1 broke the group: ..."). One atomic load while all is well. */
static inline t3d_result_t t3d__watch_check(t3d_comm_t *comm) {
  int res = atomic_load_explicit(&comm->watch_res, memory_order_acquire);
  if (res == 0) return T3D_OK;
  if (comm->watch_told || t3d__now_ns() >= comm->watch_since_ns + T3D__WATCH_GRACE_MS * 1000000ull) {
    return (t3d_result_t)res;
  }
  return T3D_OK;
}

#endif /* T3D_BASE_WATCH_H */
