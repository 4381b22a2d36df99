/* coll.c: the public collective and point-to-point entry points: argument checks with messages that name the
 * argument and the rank, and the request set-up; then the engine takes over (core/submit.c). Nothing here chooses
 * or runs an algorithm. */
#include "core/engine.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------- argument checks ---------- */

static t3d_result_t bad_arg(t3d_comm_t *comm, const char *fn, const char *arg, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static t3d_result_t bad_arg(t3d_comm_t *comm, const char *fn, const char *arg, const char *fmt, ...) {
  char detail[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return t3d__set_error(comm, T3D_ERR_INVALID_ARG, "%s: invalid argument '%s' on rank %d of group '%s': %s", fn,
                        arg, comm->rank, comm->name, detail);
}
#define BAD_ARG(comm, fn, arg, ...) bad_arg((comm), (fn), (arg), __VA_ARGS__)

static t3d_result_t check_base(t3d_comm_t *comm, const char *fn, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  if (req == NULL) return BAD_ARG(comm, fn, "req", "NULL");
  *req = NULL;
  return T3D_OK;
}

static t3d_result_t check_dtype(t3d_comm_t *comm, const char *fn, t3d_dtype_t dt) {
  if ((int)dt < 0 || dt >= T3D_DTYPE_COUNT) return BAD_ARG(comm, fn, "dtype", "%d is not a t3d_dtype_t", (int)dt);
  return T3D_OK;
}

static t3d_result_t check_op(t3d_comm_t *comm, const char *fn, t3d_redop_t op, t3d_dtype_t dt) {
  T3D_CHECK(check_dtype(comm, fn, dt));
  t3d_result_t res = t3d_redop_supported(op, dt);
  if (res == T3D_ERR_INVALID_ARG) return BAD_ARG(comm, fn, "op", "%d is not a t3d_redop_t", (int)op);
  if (res != T3D_OK) {
    return t3d__set_error(comm, res, "%s: reduction %s is not supported for dtype %s (rank %d of group '%s')", fn,
                          t3d_redop_name(op), t3d_dtype_name(dt), comm->rank, comm->name);
  }
  return T3D_OK;
}

static t3d_result_t check_buf(t3d_comm_t *comm, const char *fn, const char *arg, const void *buf, size_t count,
                              t3d_dtype_t dt) {
  if (count > 0 && buf == NULL) return BAD_ARG(comm, fn, arg, "NULL with %zu elements", count);
  size_t es = t3d_dtype_size(dt) ? t3d_dtype_size(dt) : 1, bytes;
  if (__builtin_mul_overflow(count, 16 * es, &bytes)) { /* no division: this runs twice per call */
    return BAD_ARG(comm, fn, arg, "%zu elements is too large", count);
  }
  return T3D_OK;
}

static t3d_result_t check_rank(t3d_comm_t *comm, const char *fn, const char *arg, int r) {
  if (r < 0 || r >= comm->size) return BAD_ARG(comm, fn, arg, "%d is not a rank of a group of %d", r, comm->size);
  return T3D_OK;
}

/* Groups of up to this many ranks pass count and displacement arrays in the calling frame instead of the heap: a
 * small call then allocates nothing (t3d__request_keep copies them when the request outlives the call). */
#define FRAME_RANKS 16

/* Copies up to four per-rank arrays into one block owned by the request: `frame` (4 * FRAME_RANKS, in the
 * caller's frame) when the group is that small, else the heap. */
static t3d_result_t copy_arrays(t3d_request_t *r, size_t *frame, const size_t *a, const size_t *b, const size_t *c,
                                const size_t *d) {
  size_t n = (size_t)r->comm->size;
  r->arrays_borrowed = n <= FRAME_RANKS;
  r->arrays = r->arrays_borrowed ? frame : malloc(4 * n * sizeof(size_t));
  if (r->arrays == NULL) return T3D_ERR_NO_MEMORY;
  size_t *slot[4] = {r->arrays, r->arrays + n, r->arrays + 2 * n, r->arrays + 3 * n};
  const size_t *src[4] = {a, b, c, d};
  for (int i = 0; i < 4; i++) {
    if (src[i] != NULL) memcpy(slot[i], src[i], n * sizeof(size_t));
    else memset(slot[i], 0, n * sizeof(size_t));
  }
  r->scounts = slot[0];
  r->sdispls = slot[1];
  r->rcounts = slot[2];
  r->rdispls = slot[3];
  return T3D_OK;
}

/* Creates the request of a checked call, records what it does, and hands it to the engine. */
static t3d_result_t issue(t3d_comm_t *comm, t3d_op_kind_t kind, const t3d_opts_t *opts, const void *sendbuf,
                          void *recvbuf, size_t count, t3d_dtype_t dtype, t3d_redop_t op, int root,
                          t3d_request_t **req) {
  t3d_request_t r;
  t3d__request_prepare(comm, kind, opts, &r);
  r.sendbuf = sendbuf;
  r.recvbuf = recvbuf;
  r.count = count;
  r.dtype = dtype;
  r.op = op;
  r.root = root;
  return t3d__submit_prepared(comm, &r, req);
}

/* ---------- entry points ---------- */

t3d_result_t t3d_allreduce(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                           t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_allreduce";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_op(comm, fn, op, dtype));
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, count, dtype));
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, count, dtype));
  return issue(comm, T3D_OP_ALLREDUCE, opts, sendbuf, recvbuf, count, dtype, op, 0, req);
}

t3d_result_t t3d_broadcast(t3d_comm_t *comm, void *buf, size_t count, t3d_dtype_t dtype, int root,
                           const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_broadcast";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  T3D_CHECK(check_buf(comm, fn, "buf", buf, count, dtype));
  T3D_CHECK(check_rank(comm, fn, "root", root));
  return issue(comm, T3D_OP_BROADCAST, opts, NULL, buf, count, dtype, T3D_SUM, root, req);
}

t3d_result_t t3d_reduce(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                        t3d_redop_t op, int root, const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_reduce";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_op(comm, fn, op, dtype));
  T3D_CHECK(check_rank(comm, fn, "root", root));
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, count, dtype));
  if (comm->rank == root) T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, count, dtype));
  return issue(comm, T3D_OP_REDUCE, opts, sendbuf, recvbuf, count, dtype, op, root, req);
}

t3d_result_t t3d_allgatherv(t3d_comm_t *comm, const void *sendbuf, size_t sendcount, void *recvbuf,
                            const size_t *recvcounts, const size_t *displs, t3d_dtype_t dtype,
                            const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_allgatherv";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  if (recvcounts == NULL) return BAD_ARG(comm, fn, "recvcounts", "NULL");
  if (displs == NULL) return BAD_ARG(comm, fn, "displs", "NULL");
  if (sendcount != recvcounts[comm->rank]) {
    return BAD_ARG(comm, fn, "sendcount", "%zu differs from recvcounts[%d] = %zu", sendcount, comm->rank,
                   recvcounts[comm->rank]);
  }
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, sendcount, dtype));
  size_t total = 0;
  for (int p = 0; p < comm->size; p++) {
    if (displs[p] + recvcounts[p] > total) total = displs[p] + recvcounts[p];
  }
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, total, dtype));
  t3d_request_t rq, *r = &rq;
  t3d__request_prepare(comm, T3D_OP_ALLGATHERV, opts, r);
  r->sendbuf = sendbuf;
  r->recvbuf = recvbuf;
  r->count = sendcount;
  r->dtype = dtype;
  size_t frame[4 * FRAME_RANKS];
  t3d_result_t res = copy_arrays(r, frame, NULL, NULL, recvcounts, displs);
  if (res != T3D_OK) return res;
  return t3d__submit_prepared(comm, r, req);
}

/* Equal-count forms build their count and displacement arrays (in `frame`, 2 * FRAME_RANKS in the caller's frame,
 * when the group is that small; else on the heap: free_counts) and share the v-form's path. Callers zero `frame`:
 * the compiler cannot see that this fills it. */
static t3d_result_t equal_counts(t3d_comm_t *comm, size_t count, size_t *frame, size_t **counts, size_t **displs) {
  size_t n = (size_t)comm->size;
  *counts = n <= FRAME_RANKS ? frame : malloc(2 * n * sizeof(size_t));
  if (*counts == NULL) return T3D_ERR_NO_MEMORY;
  *displs = *counts + n;
  for (size_t p = 0; p < n; p++) {
    (*counts)[p] = count;
    (*displs)[p] = p * count;
  }
  return T3D_OK;
}

static void free_counts(size_t *counts, const size_t *frame) {
  if (counts != frame) free(counts);
}

t3d_result_t t3d_allgather(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                           const t3d_opts_t *opts, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  size_t frame[2 * FRAME_RANKS], *counts, *displs;
  t3d__zero(frame, sizeof frame); /* not `= {0}`: t3d__zero's reason */
  T3D_CHECK(equal_counts(comm, count, frame, &counts, &displs));
  t3d_result_t res = t3d_allgatherv(comm, sendbuf, count, recvbuf, counts, displs, dtype, opts, req);
  free_counts(counts, frame);
  return res;
}

t3d_result_t t3d_gather(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                        int root, const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_gather";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  T3D_CHECK(check_rank(comm, fn, "root", root));
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, count, dtype));
  if (comm->rank == root) T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, count * (size_t)comm->size, dtype));
  return issue(comm, T3D_OP_GATHER, opts, sendbuf, recvbuf, count, dtype, T3D_SUM, root, req);
}

t3d_result_t t3d_scatter(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                         int root, const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_scatter";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  T3D_CHECK(check_rank(comm, fn, "root", root));
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, count, dtype));
  if (comm->rank == root) T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, count * (size_t)comm->size, dtype));
  return issue(comm, T3D_OP_SCATTER, opts, sendbuf, recvbuf, count, dtype, T3D_SUM, root, req);
}

t3d_result_t t3d_reduce_scatterv(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, const size_t *recvcounts,
                                 t3d_dtype_t dtype, t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req) {
  const char *fn = "t3d_reduce_scatterv";
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_op(comm, fn, op, dtype));
  if (recvcounts == NULL) return BAD_ARG(comm, fn, "recvcounts", "NULL");
  size_t total = 0;
  for (int p = 0; p < comm->size; p++) total += recvcounts[p];
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, total, dtype));
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, recvcounts[comm->rank], dtype));
  t3d_request_t rq, *r = &rq;
  t3d__request_prepare(comm, T3D_OP_REDUCE_SCATTERV, opts, r);
  r->sendbuf = sendbuf;
  r->recvbuf = recvbuf;
  r->count = total;
  r->dtype = dtype;
  r->op = op;
  size_t frame[4 * FRAME_RANKS];
  t3d_result_t res = copy_arrays(r, frame, NULL, NULL, recvcounts, NULL);
  if (res != T3D_OK) return res;
  return t3d__submit_prepared(comm, r, req);
}

t3d_result_t t3d_reduce_scatter(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t recvcount,
                                t3d_dtype_t dtype, t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  size_t frame[2 * FRAME_RANKS], *counts, *displs;
  t3d__zero(frame, sizeof frame); /* not `= {0}`: t3d__zero's reason */
  T3D_CHECK(equal_counts(comm, recvcount, frame, &counts, &displs));
  t3d_result_t res = t3d_reduce_scatterv(comm, sendbuf, recvbuf, counts, dtype, op, opts, req);
  free_counts(counts, frame);
  return res;
}

/* equal: from t3d_alltoall (blocks of one size, at consecutive places). */
static t3d_result_t alltoallv(t3d_comm_t *comm, const char *fn, const void *sendbuf, const size_t *sendcounts,
                              const size_t *sdispls, void *recvbuf, const size_t *recvcounts, const size_t *rdispls,
                              t3d_dtype_t dtype, const t3d_opts_t *opts, t3d_request_t **req, int equal) {
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  const char *names[4] = {"sendcounts", "sdispls", "recvcounts", "rdispls"};
  const size_t *arrs[4] = {sendcounts, sdispls, recvcounts, rdispls};
  for (int i = 0; i < 4; i++) {
    if (arrs[i] == NULL) return BAD_ARG(comm, fn, names[i], "NULL");
  }
  size_t send_extent = 0, recv_extent = 0;
  for (int p = 0; p < comm->size; p++) {
    if (sendcounts[p] && sdispls[p] + sendcounts[p] > send_extent) send_extent = sdispls[p] + sendcounts[p];
    if (recvcounts[p] && rdispls[p] + recvcounts[p] > recv_extent) recv_extent = rdispls[p] + recvcounts[p];
  }
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, send_extent, dtype));
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, recv_extent, dtype));
  t3d_request_t rq, *r = &rq;
  t3d__request_prepare(comm, T3D_OP_ALLTOALLV, opts, r);
  r->sendbuf = sendbuf;
  r->recvbuf = recvbuf;
  r->dtype = dtype;
  r->equal_blocks = equal;
  size_t frame[4 * FRAME_RANKS];
  t3d_result_t res = copy_arrays(r, frame, sendcounts, sdispls, recvcounts, rdispls);
  if (res != T3D_OK) return res;
  return t3d__submit_prepared(comm, r, req);
}

t3d_result_t t3d_alltoallv(t3d_comm_t *comm, const void *sendbuf, const size_t *sendcounts, const size_t *sdispls,
                           void *recvbuf, const size_t *recvcounts, const size_t *rdispls, t3d_dtype_t dtype,
                           const t3d_opts_t *opts, t3d_request_t **req) {
  return alltoallv(comm, "t3d_alltoallv", sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls, dtype, opts,
                   req, 0);
}

t3d_result_t t3d_alltoall(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                          const t3d_opts_t *opts, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  size_t frame[2 * FRAME_RANKS], *counts, *displs;
  t3d__zero(frame, sizeof frame); /* not `= {0}`: t3d__zero's reason */
  T3D_CHECK(equal_counts(comm, count, frame, &counts, &displs));
  t3d_result_t res = alltoallv(comm, "t3d_alltoall", sendbuf, counts, displs, recvbuf, counts, displs, dtype, opts,
                               req, 1);
  free_counts(counts, frame);
  return res;
}

t3d_result_t t3d_barrier(t3d_comm_t *comm, const t3d_opts_t *opts, t3d_request_t **req) {
  T3D_CHECK(check_base(comm, "t3d_barrier", req));
  return issue(comm, T3D_OP_BARRIER, opts, NULL, NULL, 0, T3D_UINT8, T3D_SUM, 0, req);
}

/* A prepared send or receive's fields (sbuf for a send, rbuf for a receive). */
static void fill_p2p(t3d_request_t *r, const void *sbuf, void *rbuf, size_t count, t3d_dtype_t dtype, int peer,
                     int64_t tag) {
  r->sendbuf = sbuf;
  r->recvbuf = rbuf;
  r->count = count;
  r->dtype = dtype;
  r->root = peer;
  r->tag = tag;
}

static t3d_result_t p2p(t3d_comm_t *comm, const char *fn, t3d_op_kind_t kind, const void *sbuf, void *rbuf,
                        size_t count, t3d_dtype_t dtype, int peer, int64_t tag, const t3d_opts_t *opts,
                        t3d_request_t **req) {
  T3D_CHECK(check_base(comm, fn, req));
  T3D_CHECK(check_dtype(comm, fn, dtype));
  T3D_CHECK(check_buf(comm, fn, "buf", kind == T3D_OP_SEND ? sbuf : rbuf, count, dtype));
  if (!(kind == T3D_OP_RECV && peer == T3D_ANY_SOURCE)) T3D_CHECK(check_rank(comm, fn, "peer", peer));
  if (tag < 0 || tag > T3D_MAX_TAG) return BAD_ARG(comm, fn, "tag", "%lld is outside [0, 2^30)", (long long)tag);
  t3d_request_t *r;
  T3D_CHECK(t3d__request_new(comm, kind, opts, &r));
  fill_p2p(r, sbuf, rbuf, count, dtype, peer, tag);
  return t3d__submit(comm, r, req);
}

t3d_result_t t3d_send(t3d_comm_t *comm, const void *buf, size_t count, t3d_dtype_t dtype, int peer, int64_t tag,
                      const t3d_opts_t *opts, t3d_request_t **req) {
  return p2p(comm, "t3d_send", T3D_OP_SEND, buf, NULL, count, dtype, peer, tag, opts, req);
}

t3d_result_t t3d_recv(t3d_comm_t *comm, void *buf, size_t count, t3d_dtype_t dtype, int peer, int64_t tag,
                      const t3d_opts_t *opts, t3d_request_t **req) {
  return p2p(comm, "t3d_recv", T3D_OP_RECV, NULL, buf, count, dtype, peer, tag, opts, req);
}

t3d_result_t t3d_sendrecv(t3d_comm_t *comm, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                          size_t recvcount, int src, t3d_dtype_t dtype, int64_t tag, const t3d_opts_t *opts,
                          size_t *received) {
  const char *fn = "t3d_sendrecv";
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  if (received != NULL) *received = 0;
  T3D_CHECK(check_dtype(comm, fn, dtype));
  T3D_CHECK(check_buf(comm, fn, "sendbuf", sendbuf, sendcount, dtype));
  T3D_CHECK(check_buf(comm, fn, "recvbuf", recvbuf, recvcount, dtype));
  T3D_CHECK(check_rank(comm, fn, "dst", dst));
  if (src != T3D_ANY_SOURCE) T3D_CHECK(check_rank(comm, fn, "src", src));
  if (tag < 0 || tag > T3D_MAX_TAG) return BAD_ARG(comm, fn, "tag", "%lld is outside [0, 2^30)", (long long)tag);
  if (comm->group_depth > 0) return BAD_ARG(comm, fn, "comm", "has an open group (t3d_sendrecv blocks)");
  /* Both live in this frame; t3d__submit_pair copies them to the heap only where it must. */
  t3d_request_t s, r;
  t3d__request_prepare(comm, T3D_OP_SEND, opts, &s);
  fill_p2p(&s, sendbuf, NULL, sendcount, dtype, dst, tag);
  t3d__request_prepare(comm, T3D_OP_RECV, opts, &r);
  fill_p2p(&r, NULL, recvbuf, recvcount, dtype, src, tag);
  return t3d__submit_pair(comm, &s, &r, received);
}
