/* ucx.h: the UCX provider: the transport (transport.c, or transport_none.c in a build without UCX), the
 * point-to-point transfers collectives are built from (xfer.c), user sends and receives over UCX (p2p.c), and the
 * collective algorithms (one file each) with what they share: batches of transfers that skip empty messages, the
 * small-message threshold, and the ring reduce-scatter / allgather building blocks (ring.c). */
#ifndef T3D_UCX_H
#define T3D_UCX_H

#include "comm.h"

/* ---------- transfers inside a collective (xfer.c) ----------
 * step tells apart messages of the same operation between the same pair; both sides must use the same step. */
t3d_result_t t3d__isend(t3d_exec_t *ex, int peer, uint32_t step, const void *buf, size_t bytes, t3d_xfer_t *x);
t3d_result_t t3d__irecv(t3d_exec_t *ex, int peer, uint32_t step, void *buf, size_t bytes, t3d_xfer_t *x);
/* Drives progress until every xfer is done, the deadline passes (T3D_ERR_TIMEOUT), or the communicator is aborted
 * (T3D_ERR_ABORTED); on error the remaining transfers are cancelled. Releases all of them. A received length other
 * than the posted one is T3D_ERR_MISMATCH. User point-to-point in flight keeps completing meanwhile. */
t3d_result_t t3d__waitall(t3d_exec_t *ex, t3d_xfer_t *xs, int n);
/* Send to dst and receive from src at once (either may be -1 for none). */
t3d_result_t t3d__sendrecv(t3d_exec_t *ex, uint32_t step, int dst, const void *sbuf, size_t sbytes, int src,
                           void *rbuf, size_t rbytes);

/* ---------- user sends and receives over UCX (p2p.c), on the progress thread ---------- */
/* Posts a send or receive (completing it at once if posting fails) and keeps it on comm->active_p2p. */
void t3d__ucx_p2p_post(t3d_comm_t *comm, t3d_request_t *r);
/* Completes the posted ones whose transfers finished, failed, timed out or were aborted; returns how many. */
int t3d__ucx_p2p_poll(t3d_comm_t *comm);

/* ---------- the collective algorithms (one file each). All run with blocking semantics. ----------
 * Reducing ones see only T3D_SUM, PROD, MIN, MAX, BAND, BOR, BXOR on non-half dtypes: the front end (coll.c)
 * converts half types to float32, applies PREMUL_SUM's scalar before and AVG's division after. */
t3d_result_t t3d__algo_allreduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                                 t3d_redop_t op);
t3d_result_t t3d__algo_reduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dt,
                              t3d_redop_t op, int root);
t3d_result_t t3d__algo_reduce_scatterv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                       t3d_dtype_t dt, t3d_redop_t op);
t3d_result_t t3d__algo_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root);
t3d_result_t t3d__algo_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                  const size_t *displs_bytes);
t3d_result_t t3d__algo_gather(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root);
t3d_result_t t3d__algo_scatter(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t bytes, int root);
t3d_result_t t3d__algo_alltoallv(t3d_exec_t *ex, const void *sendbuf, const size_t *sbytes, const size_t *sdispls,
                                 void *recvbuf, const size_t *rbytes, const size_t *rdispls);
t3d_result_t t3d__algo_barrier(t3d_exec_t *ex);


#include <stdint.h>
#include <string.h>

/* Messages of one operation posted together and waited for together. Empty messages are never posted: every
 * algorithm knows the sizes on both sides, so skipping them on both keeps sends and receives matched. After a
 * posting error nothing more is posted, and wait still drains what went out (their buffers may not be released
 * before that) and returns the posting error. */
typedef struct t3d_batch {
  t3d_exec_t *ex;
  t3d_xfer_t *xs;
  int n, cap;
  t3d_result_t res;
} t3d_batch_t;

void t3d__batch_init(t3d_batch_t *b, t3d_exec_t *ex, t3d_xfer_t *xs, int cap);
void t3d__batch_send(t3d_batch_t *b, int peer, uint32_t step, const void *buf, size_t bytes);
void t3d__batch_recv(t3d_batch_t *b, int peer, uint32_t step, void *buf, size_t bytes);
t3d_result_t t3d__batch_wait(t3d_batch_t *b);

/* Send to dst and receive from src (either -1 for none), skipping empty sides. */
t3d_result_t t3d__algo_xchg(t3d_exec_t *ex, uint32_t step, int dst, const void *sbuf, size_t sbytes, int src,
                            void *rbuf, size_t rbytes);

/* Bytes per rank at or below which latency-bound (one round, all peers at once) algorithms are chosen.
 * T3D_ALGO_SMALL_BYTES, default 65536, read once. */
size_t t3d__algo_small_bytes(void);

/* Ring reduce-scatter: block c is counts[c] elements at element offset offs[c] of sendbuf. The caller ends with
 * the reduction of its own block in out (counts[rank] elements), each block reduced by one rank in ring order.
 * out may alias sendbuf: it is written only after sendbuf is last read. Uses steps step0 .. step0 + size - 2. */
t3d_result_t t3d__ring_reduce_scatter(t3d_exec_t *ex, const void *sendbuf, void *out, const size_t *counts,
                                      const size_t *offs, t3d_dtype_t dt, t3d_redop_t op, uint32_t step0);
/* Ring allgather in place: block c is bytes[c] long at byte offset displs[c] of buf, the caller's own block already
 * there. Uses steps step0 .. step0 + size - 2. */
t3d_result_t t3d__ring_allgather(t3d_exec_t *ex, void *buf, const size_t *bytes, const size_t *displs,
                                 uint32_t step0);

#endif /* T3D_UCX_H */
