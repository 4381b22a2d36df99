/* transport_none.c: the stand-in for transport.c in a build without UCX (T3D_WITH_UCX=OFF, or AUTO without
 * UCX found). Nothing reaches it: t3d_comm_init makes every rank, even a group of one, use the shared-memory segment
 * for collectives and point-to-point, and refuses with a clear error every configuration that would need UCX (ranks
 * on other hosts, T3D_TRANSPORT=ucx, point-to-point off the segment). Its transfers fail if called all the same. */
#include "comm.h"

static t3d_result_t none_init(t3d_comm_t *comm, void **state) {
  *state = NULL;
  return T3D_OK;
}

static t3d_result_t none_xfer(t3d_xfer_t *x, int peer, size_t bytes, int is_recv) {
  x->peer = peer;
  x->handle = NULL;
  x->probe = NULL;
  x->posted = bytes;
  x->is_recv = is_recv;
  x->status = T3D_ERR_UNSUPPORTED;
  x->bytes = 0;
  x->source = -1;
  atomic_store_explicit(&x->done, 1, memory_order_release);
  T3D_WARN("a transfer reached the UCX transport, which this build of t3d does not have");
  return T3D_ERR_UNSUPPORTED;
}

static t3d_result_t none_isend(void *state, int peer, uint64_t tag, const void *buf, size_t bytes, t3d_xfer_t *x) {
  return none_xfer(x, peer, bytes, 0);
}

static t3d_result_t none_irecv(void *state, int peer, uint64_t tag, uint64_t tag_mask, void *buf, size_t bytes,
                               t3d_xfer_t *x) {
  return none_xfer(x, peer, bytes, 1);
}

static int none_progress(void *state) { return 0; }
static void none_cancel(void *state, t3d_xfer_t *x) {}
static int none_peek(void *state, uint64_t tag, uint64_t mask, uint64_t *found) {
  (void)state, (void)tag, (void)mask, (void)found;
  return 0;
}
static int none_peer_lost(void *state, int peer) { return 0; }
static void none_release(void *state, t3d_xfer_t *x) {}
static void none_fini(void *state) {}

const t3d_transport_t t3d__transport_ucx = {
    .name = "none",
    .init = none_init,
    .isend = none_isend,
    .irecv = none_irecv,
    .progress = none_progress,
    .cancel = none_cancel,
    .peek = none_peek,
    .peer_lost = none_peer_lost,
    .release = none_release,
    .fini = none_fini,
};

const char *t3d_ucx_version_string(void) { return ""; }
