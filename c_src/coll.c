/* coll.c: the public collective and point-to-point entry points (argument checks with messages that name the
 * argument and the rank, request set-up) and the front end that runs a request on the progress thread: complex as
 * real pairs, half types through float32, PREMUL_SUM's scalar before and AVG's division after the algorithm. */
#include "comm.h"

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

/* Copies up to four per-rank arrays into one allocation owned by the request. */
static t3d_result_t copy_arrays(t3d_request_t *r, const size_t *a, const size_t *b, const size_t *c,
                                const size_t *d) {
  size_t n = (size_t)r->comm->size;
  r->arrays = malloc(4 * n * sizeof(size_t));
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
  t3d_result_t res = copy_arrays(r, NULL, NULL, recvcounts, displs);
  if (res != T3D_OK) return res;
  return t3d__submit_prepared(comm, r, req);
}

/* Equal-count forms build their count and displacement arrays and share the v-form's path. */
static t3d_result_t equal_counts(t3d_comm_t *comm, size_t count, size_t **counts, size_t **displs) {
  size_t n = (size_t)comm->size;
  *counts = malloc(2 * n * sizeof(size_t));
  if (*counts == NULL) return T3D_ERR_NO_MEMORY;
  *displs = *counts + n;
  for (size_t p = 0; p < n; p++) {
    (*counts)[p] = count;
    (*displs)[p] = p * count;
  }
  return T3D_OK;
}

t3d_result_t t3d_allgather(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count, t3d_dtype_t dtype,
                           const t3d_opts_t *opts, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  size_t *counts, *displs;
  T3D_CHECK(equal_counts(comm, count, &counts, &displs));
  t3d_result_t res = t3d_allgatherv(comm, sendbuf, count, recvbuf, counts, displs, dtype, opts, req);
  free(counts);
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
  t3d_result_t res = copy_arrays(r, NULL, NULL, recvcounts, NULL);
  if (res != T3D_OK) return res;
  return t3d__submit_prepared(comm, r, req);
}

t3d_result_t t3d_reduce_scatter(t3d_comm_t *comm, const void *sendbuf, void *recvbuf, size_t recvcount,
                                t3d_dtype_t dtype, t3d_redop_t op, const t3d_opts_t *opts, t3d_request_t **req) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  size_t *counts, *displs;
  T3D_CHECK(equal_counts(comm, recvcount, &counts, &displs));
  t3d_result_t res = t3d_reduce_scatterv(comm, sendbuf, recvbuf, counts, dtype, op, opts, req);
  free(counts);
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
  t3d_result_t res = copy_arrays(r, sendcounts, sdispls, recvcounts, rdispls);
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
  size_t *counts, *displs;
  T3D_CHECK(equal_counts(comm, count, &counts, &displs));
  t3d_result_t res = alltoallv(comm, "t3d_alltoall", sendbuf, counts, displs, recvbuf, counts, displs, dtype, opts,
                               req, 1);
  free(counts);
  return res;
}

t3d_result_t t3d_barrier(t3d_comm_t *comm, const t3d_opts_t *opts, t3d_request_t **req) {
  T3D_CHECK(check_base(comm, "t3d_barrier", req));
  return issue(comm, T3D_OP_BARRIER, opts, NULL, NULL, 0, T3D_UINT8, T3D_SUM, 0, req);
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
  r->sendbuf = sbuf;
  r->recvbuf = rbuf;
  r->count = count;
  r->dtype = dtype;
  r->root = peer;
  r->tag = tag;
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

/* ---------- execution on the progress thread ---------- */

static int is_half(t3d_dtype_t dt) { return dt == T3D_FLOAT16 || dt == T3D_BFLOAT16; }

/* Runs allreduce, reduce or reduce_scatterv. The algorithms see plain SUM..BXOR on full-width types. */
static t3d_result_t run_reducing(t3d_exec_t *ex, t3d_request_t *r) {
  t3d_dtype_t dt = r->dtype;
  size_t mult = 1;
  if (dt == T3D_COMPLEX64 || dt == T3D_COMPLEX128) {
    dt = dt == T3D_COMPLEX64 ? T3D_FLOAT32 : T3D_FLOAT64;
    mult = 2;
  }
  t3d_redop_t op = (r->op == T3D_AVG || r->op == T3D_PREMUL_SUM) ? T3D_SUM : r->op;
  int me = ex->rank;
  size_t n_in = r->count * mult, n_out;
  size_t *counts = NULL;
  if (r->kind == T3D_OP_REDUCE_SCATTERV) {
    n_out = r->rcounts[me] * mult;
    counts = r->rcounts;
    if (mult != 1) {
      counts = malloc(sizeof(size_t) * (size_t)ex->size);
      if (counts == NULL) return T3D_ERR_NO_MEMORY;
      for (int p = 0; p < ex->size; p++) counts[p] = r->rcounts[p] * mult;
    }
  } else {
    n_out = (r->kind == T3D_OP_REDUCE && me != r->root) ? 0 : n_in;
  }
  t3d_dtype_t wdt = is_half(dt) ? T3D_FLOAT32 : dt;
  size_t wsize = t3d_dtype_size(wdt);
  const void *in = r->sendbuf;
  void *out = r->recvbuf;
  void *tmp_in = NULL, *tmp_out = NULL;
  t3d_result_t res = T3D_OK;
  if (is_half(dt) || r->op == T3D_PREMUL_SUM) {
    tmp_in = malloc(n_in * wsize + 1);
    if (tmp_in == NULL) {
      res = T3D_ERR_NO_MEMORY;
      goto out;
    }
    if (is_half(dt)) t3d__half_to_float(tmp_in, r->sendbuf, n_in, dt);
    else memcpy(tmp_in, r->sendbuf, n_in * wsize);
    if (r->op == T3D_PREMUL_SUM) t3d__scale(tmp_in, n_in, wdt, r->scalar);
    in = tmp_in;
  }
  if (is_half(dt)) {
    if (r->kind == T3D_OP_ALLREDUCE) {
      out = tmp_in; /* in place on the float32 copy */
    } else {
      tmp_out = malloc(n_out * wsize + 1);
      if (tmp_out == NULL) {
        res = T3D_ERR_NO_MEMORY;
        goto out;
      }
      out = tmp_out;
    }
  }
  int shm = t3d__exec_shm(ex) != NULL;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
      res = shm ? t3d__shm_allreduce(ex, in, out, n_in, wdt, op) : t3d__algo_allreduce(ex, in, out, n_in, wdt, op);
      break;
    case T3D_OP_REDUCE:
      res = shm ? t3d__shm_reduce(ex, in, out, n_in, wdt, op, r->root)
                : t3d__algo_reduce(ex, in, out, n_in, wdt, op, r->root);
      break;
    default:
      res = shm ? t3d__shm_reduce_scatterv(ex, in, out, counts, wdt, op)
                : t3d__algo_reduce_scatterv(ex, in, out, counts, wdt, op);
      break;
  }
  if (res != T3D_OK) goto out;
  if (r->op == T3D_AVG && n_out > 0) t3d__divide(out, n_out, wdt, ex->size);
  if (is_half(dt) && n_out > 0) t3d__float_to_half(r->recvbuf, out, n_out, dt);
out:
  free(tmp_in);
  free(tmp_out);
  if (counts != r->rcounts) free(counts);
  return res;
}

/* Byte counts and displacements from element ones (a is NULL-safe: all zero). */
static size_t *to_bytes(const size_t *a, const size_t *b, int n, size_t esize) {
  size_t *out = malloc(2 * (size_t)n * sizeof(size_t));
  if (out == NULL) return NULL;
  for (int p = 0; p < n; p++) {
    out[p] = a[p] * esize;
    out[n + p] = b[p] * esize;
  }
  return out;
}

/* ---------- inline start on the caller's thread ---------- */

/* The element type and count the one-shot folds: complex as pairs of reals. */
static t3d_dtype_t fold_type(const t3d_request_t *r, size_t *n) {
  *n = r->count;
  if (r->dtype != T3D_COMPLEX64 && r->dtype != T3D_COMPLEX128) return r->dtype;
  *n *= 2;
  return r->dtype == T3D_COMPLEX64 ? T3D_FLOAT32 : T3D_FLOAT64;
}

/* Total and largest block of r's receive counts, in bytes. */
static size_t rcounts_bytes(const t3d_request_t *r, int n, size_t *maxb) {
  size_t es = t3d_dtype_size(r->dtype), total = 0;
  *maxb = 0;
  for (int p = 0; p < n; p++) {
    total += r->rcounts[p] * es;
    if (r->rcounts[p] * es > *maxb) *maxb = r->rcounts[p] * es;
  }
  return total;
}

/* On a communicator with shared memory: a small allreduce that needs no staging buffer (no half type, no
 * PREMUL_SUM, input and output the same or apart) and fits the one-shot; a barrier; a small broadcast or allgatherv
 * whose blocks fit one half; a small reduce_scatterv of a real, non-half type (not PREMUL_SUM) done in one step,
 * output apart from the input; a small alltoallv whose blocks to others fit one piece, receive blocks apart from
 * its send blocks. (The half these write must be free now.) */
int t3d__inline_eligible(t3d_comm_t *comm, const t3d_request_t *r) {
  if (comm->shm == NULL || comm->inline_max < 0 || atomic_load(&comm->fatal) != 0) return 0;
  size_t es = t3d_dtype_size(r->dtype), bytes = r->count * es, total, maxb;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
      if (bytes == 0 || bytes > (uint64_t)comm->inline_max || is_half(r->dtype) || r->op == T3D_PREMUL_SUM) return 0;
      if (r->sendbuf != r->recvbuf && t3d__overlap(r->sendbuf, bytes, r->recvbuf, bytes)) return 0;
      return t3d__shm_oneshot_fits(comm->shm, bytes);
    case T3D_OP_BARRIER: return 1;
    case T3D_OP_BROADCAST:
      return bytes <= (uint64_t)comm->inline_max && t3d__shm_bcast_fits(comm->shm, bytes, r->root);
    case T3D_OP_REDUCE_SCATTERV:
      if (is_half(r->dtype) || r->op == T3D_PREMUL_SUM || r->dtype == T3D_COMPLEX64 || r->dtype == T3D_COMPLEX128)
        return 0;
      total = rcounts_bytes(r, comm->size, &maxb);
      if (total > (uint64_t)comm->inline_max) return 0;
      if (t3d__overlap(r->sendbuf, total, r->recvbuf, r->rcounts[comm->rank] * es)) return 0;
      return t3d__shm_rs_fits(comm->shm, total, maxb, es);
    case T3D_OP_ALLGATHERV:
      total = rcounts_bytes(r, comm->size, &maxb);
      return total <= (uint64_t)comm->inline_max && t3d__shm_gather_fits(comm->shm, total, maxb);
    case T3D_OP_ALLTOALLV:
      total = 0;
      maxb = 0;
      for (int q = 0; q < comm->size; q++) {
        total += r->scounts[q] * es;
        if (q != comm->rank && r->scounts[q] * es > maxb) maxb = r->scounts[q] * es;
      }
      if (total == 0 || total > (uint64_t)comm->inline_max || r->scounts[comm->rank] != r->rcounts[comm->rank])
        return 0;
      if (t3d__alltoall_overlaps(comm->size, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls,
                                 es))
        return 0;
      return t3d__shm_a2a_fits(comm->shm, maxb, r->equal_blocks);
    default: return 0;
  }
}

static t3d_result_t finish_inline(t3d_exec_t *ex, t3d_request_t *r) {
  size_t es = t3d_dtype_size(r->dtype);
  t3d_redop_t op = r->op == T3D_AVG ? T3D_SUM : r->op;
  size_t n = 0; /* elements AVG divides */
  t3d_dtype_t dt = r->dtype;
  switch (r->kind) {
    case T3D_OP_BARRIER: return t3d__shm_barrier_finish(ex, &r->rs);
    case T3D_OP_BROADCAST: return t3d__shm_bcast_finish(ex, &r->rs, r->recvbuf, r->count * es, r->root);
    case T3D_OP_ALLGATHERV: return t3d__shm_gather_finish(ex, &r->rs, r->recvbuf, r->rcounts, r->rdispls, es);
    case T3D_OP_ALLTOALLV:
      return t3d__shm_a2a_finish(ex, &r->rs, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls,
                                 es, r->equal_blocks);
    case T3D_OP_REDUCE_SCATTERV:
      n = r->rcounts[ex->rank];
      T3D_CHECK(t3d__shm_rs_finish(ex, &r->rs, r->sendbuf, r->recvbuf, r->rcounts, dt, op));
      break;
    default:
      dt = fold_type(r, &n);
      T3D_CHECK(t3d__shm_oneshot_finish(ex, &r->rs, r->sendbuf, r->recvbuf, n, dt, op));
      break;
  }
  if (r->op == T3D_AVG) t3d__divide(r->recvbuf, n, dt, ex->size);
  return T3D_OK;
}

t3d_result_t t3d__execute_start(t3d_exec_t *ex, t3d_request_t *r) {
  size_t es = t3d_dtype_size(r->dtype);
  int who = -1;
  r->rs = (t3d_shm_resume_t){0};
  switch (r->kind) {
    case T3D_OP_BARRIER: t3d__shm_barrier_start(ex, &r->rs); break;
    case T3D_OP_BROADCAST:
      T3D_CHECK(t3d__shm_bcast_start(ex, r->recvbuf, r->count * es, r->root, &r->rs));
      if (ex->rank == r->root) return T3D_OK;
      who = r->root;
      break;
    case T3D_OP_ALLGATHERV:
      T3D_CHECK(t3d__shm_gather_start(ex, r->sendbuf, r->recvbuf, r->rcounts, r->rdispls, es, &r->rs));
      break;
    case T3D_OP_ALLTOALLV:
      T3D_CHECK(t3d__shm_a2a_start(ex, r->sendbuf, r->scounts, r->sdispls, es, r->equal_blocks, &r->rs));
      break;
    case T3D_OP_REDUCE_SCATTERV:
      T3D_CHECK(t3d__shm_rs_start(ex, r->sendbuf, r->rcounts, r->dtype, &r->rs));
      if (r->rcounts[ex->rank] == 0) return finish_inline(ex, r); /* nothing to fold: waits for nobody */
      break;
    default: T3D_CHECK(t3d__shm_oneshot_start(ex, r->sendbuf, r->count * es, &r->rs)); break;
  }
  /* Peers that issue at about the same time arrive within microseconds; later ones are the progress thread's
   * business, so that the call stays non-blocking. */
  t3d_result_t res = t3d__shm_start_wait(ex, &r->rs, who, ex->start_ns + ex->comm->inline_wait_ns);
  if (res == T3D_IN_PROGRESS) r->resume = 1;
  if (res != T3D_OK) return res;
  return finish_inline(ex, r);
}

/* Gather and scatter run over the transport (algo/gather.c, algo/scatter.c). A build without UCX runs them through
 * the segment: an alltoallv whose only non-empty blocks go to or come from the root. In place as there. */
static t3d_result_t shm_rooted(t3d_exec_t *ex, int gather, const void *sendbuf, void *recvbuf, size_t bytes,
                               int root) {
  static char none;
  int n = ex->size, me = ex->rank;
  if (bytes == 0) return T3D_OK;
  size_t *sc = calloc(4 * (size_t)n, sizeof *sc);
  if (sc == NULL) return T3D_ERR_NO_MEMORY;
  size_t *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n;
  char *own = me == root ? (char *)(gather ? recvbuf : (void *)sendbuf) + (size_t)me * bytes : NULL;
  for (int p = 0; p < n && me == root; p++) {
    if (p == root) continue;
    (gather ? rc : sc)[p] = bytes;
    (gather ? rd : sd)[p] = (size_t)p * bytes;
  }
  if (me != root) (gather ? sc : rc)[root] = bytes;
  if (gather && me == root && sendbuf != NULL && sendbuf != recvbuf && (const char *)sendbuf != own)
    memmove(own, sendbuf, bytes);
  t3d_result_t res = t3d__shm_alltoallv(ex, sendbuf && (!gather || me != root) ? sendbuf : &none, sc, sd,
                                        recvbuf && (gather || me != root) ? recvbuf : &none, rc, rd, 1, 0);
  if (!gather && me == root && res == T3D_OK && recvbuf != NULL && recvbuf != sendbuf && (char *)recvbuf != own)
    memmove(recvbuf, own, bytes);
  free(sc);
  return res;
}

t3d_result_t t3d__execute(t3d_exec_t *ex, t3d_request_t *r) {
  if (r->resume) return finish_inline(ex, r);
  size_t esize = r->kind == T3D_OP_BARRIER ? 1 : t3d_dtype_size(r->dtype);
  int shm = t3d__exec_shm(ex) != NULL;
  t3d_result_t res;
  size_t *b1 = NULL, *b2 = NULL;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
    case T3D_OP_REDUCE:
    case T3D_OP_REDUCE_SCATTERV: return run_reducing(ex, r);
    case T3D_OP_BROADCAST:
      return shm ? t3d__shm_broadcast(ex, r->recvbuf, r->count * esize, r->root)
                 : t3d__algo_broadcast(ex, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_GATHER:
      if (shm && !T3D_HAVE_UCX) return shm_rooted(ex, 1, r->sendbuf, r->recvbuf, r->count * esize, r->root);
      return t3d__algo_gather(ex, r->sendbuf, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_SCATTER:
      if (shm && !T3D_HAVE_UCX) return shm_rooted(ex, 0, r->sendbuf, r->recvbuf, r->count * esize, r->root);
      return t3d__algo_scatter(ex, r->sendbuf, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_BARRIER: return shm ? t3d__shm_barrier(ex) : t3d__algo_barrier(ex);
    case T3D_OP_ALLGATHERV:
      b1 = to_bytes(r->rcounts, r->rdispls, ex->size, esize);
      if (b1 == NULL) return T3D_ERR_NO_MEMORY;
      res = shm ? t3d__shm_allgatherv(ex, r->sendbuf, r->recvbuf, b1, b1 + ex->size)
                : t3d__algo_allgatherv(ex, r->sendbuf, r->recvbuf, b1, b1 + ex->size);
      free(b1);
      return res;
    case T3D_OP_ALLTOALLV:
      if (shm) {
        return t3d__shm_alltoallv(ex, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls,
                                  esize, r->equal_blocks);
      }
      b1 = to_bytes(r->scounts, r->sdispls, ex->size, esize);
      b2 = to_bytes(r->rcounts, r->rdispls, ex->size, esize);
      res = T3D_ERR_NO_MEMORY;
      if (b1 != NULL && b2 != NULL) {
        res = t3d__algo_alltoallv(ex, r->sendbuf, b1, b1 + ex->size, r->recvbuf, b2, b2 + ex->size);
      }
      free(b1);
      free(b2);
      return res;
    default: return T3D_ERR_INTERNAL;
  }
}
