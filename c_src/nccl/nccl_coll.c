/* nccl_coll.c: collectives and point-to-point on CUDA buffers through NCCL, on the caller's thread. A request
 * completes once NCCL has enqueued it on the caller's stream. NCCL communicators are nonblocking, so that creating
 * one (which waits for every rank) and each call can be bounded by the operation's timeout and by abort. */
#include "nccl_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  int peer;
  t3d_nccl_comm_t comm;
} nccl_pair_t;

struct t3d_nccl {
  pthread_mutex_t mu; /* held while calling NCCL: the caller's thread, abort, destroy, the error poll */
  int device;         /* the CUDA device of the first call; -1 before it */
  t3d_nccl_comm_t world;
  nccl_pair_t *pairs; /* two-rank communicators of point-to-point outside groups */
  int npairs;
  t3d_result_t broken; /* set by abort or an asynchronous error: NCCL calls on these communicators stop */
};

/* What one run needs for its calls and its messages. */
typedef struct {
  t3d_comm_t *comm;
  t3d_nccl_t *st;
  const t3d_nccl_api_t *api;
  t3d_request_t *req; /* the one the message names */
  uint64_t deadline_ns;
} run_t;

t3d_result_t t3d__nccl_new(t3d_nccl_t **out) {
  t3d_nccl_t *st = calloc(1, sizeof *st);
  if (st == NULL) return T3D_ERR_NO_MEMORY;
  pthread_mutex_init(&st->mu, NULL);
  st->device = -1;
  *out = st;
  return T3D_OK;
}

/* The NCCL communicators of st (the whole group's, then the pairs'), for teardown and error polls. */
static int comm_count(const t3d_nccl_t *st) { return (st->world != NULL) + st->npairs; }
static t3d_nccl_comm_t comm_at(const t3d_nccl_t *st, int i) {
  if (st->world != NULL && i-- == 0) return st->world;
  return st->pairs[i].comm;
}

/* Ends one communicator as NCCL asks: finalize (flushes its work; the state reads IN_PROGRESS until every rank is
 * quiescent), then destroy, which then frees without blocking. One that does not settle in time is aborted. */
static void end_comm(const t3d_nccl_api_t *api, t3d_nccl_comm_t nc, int abort, uint64_t deadline_ns) {
  t3d_nccl_result_t r = abort ? T3D_NCCL_INTERNAL_ERROR : api->CommFinalize(nc);
  t3d_backoff_t b = {0};
  while (r == T3D_NCCL_IN_PROGRESS && t3d__now_ns() < deadline_ns) {
    t3d__backoff_wait(&b);
    if (api->CommGetAsyncError(nc, &r) != T3D_NCCL_SUCCESS) r = T3D_NCCL_INTERNAL_ERROR;
  }
  if (r == T3D_NCCL_SUCCESS) api->CommDestroy(nc);
  else api->CommAbort(nc);
}

/* Ends every NCCL communicator (abort: without waiting for their work) and forgets them. Holds st->mu. */
static void end_comms(t3d_nccl_t *st, int abort, int64_t timeout_ms) {
  const t3d_nccl_api_t *api = t3d__nccl_api(NULL);
  uint64_t deadline = t3d__now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
  if (api != NULL) {
    for (int i = 0; i < comm_count(st); i++) end_comm(api, comm_at(st, i), abort, deadline);
  }
  st->world = NULL;
  free(st->pairs);
  st->pairs = NULL;
  st->npairs = 0;
}

void t3d__nccl_abort(t3d_nccl_t *st) {
  if (st == NULL) return;
  pthread_mutex_lock(&st->mu);
  st->broken = T3D_ERR_ABORTED;
  end_comms(st, 1, 0);
  pthread_mutex_unlock(&st->mu);
}

void t3d__nccl_free(t3d_nccl_t *st, int64_t timeout_ms) {
  if (st == NULL) return;
  pthread_mutex_lock(&st->mu);
  /* Finalizing a communicator whose peers are gone or whose work failed can wait forever: abort those. */
  end_comms(st, st->broken != T3D_OK, timeout_ms);
  pthread_mutex_unlock(&st->mu);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

static t3d_result_t fail(run_t *rn, t3d_result_t res, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static t3d_result_t fail(run_t *rn, t3d_result_t res, const char *fmt, ...) {
  char detail[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  t3d_comm_t *comm = rn->comm;
  return t3d__set_error(comm, res, "t3d: %s #%llu on rank %d of group '%s' (CUDA device %d): %s",
                        t3d__op_name(rn->req->kind), (unsigned long long)rn->req->seq, comm->rank, comm->name,
                        rn->req->device, detail);
}

static t3d_result_t from_nccl(t3d_nccl_result_t r) {
  switch (r) {
    case T3D_NCCL_SUCCESS: return T3D_OK;
    case T3D_NCCL_INVALID_ARGUMENT:
    case T3D_NCCL_INVALID_USAGE: return T3D_ERR_INVALID_ARG;
    case T3D_NCCL_REMOTE_ERROR: return T3D_ERR_PEER_LOST;
    case T3D_NCCL_SYSTEM_ERROR: return T3D_ERR_SYSTEM;
    default: return T3D_ERR_TRANSPORT;
  }
}

/* The outcome of an NCCL call on a nonblocking communicator: IN_PROGRESS means poll until it settles, within the
 * operation's deadline and unless the communicator is aborted. */
static t3d_result_t settle(run_t *rn, t3d_nccl_comm_t nc, t3d_nccl_result_t r, const char *call) {
  t3d_backoff_t b = {0};
  while (r == T3D_NCCL_IN_PROGRESS) {
    if (atomic_load(&rn->comm->aborted)) return fail(rn, T3D_ERR_ABORTED, "%s: the group was aborted", call);
    if (t3d__now_ns() > rn->deadline_ns) {
      return fail(rn, T3D_ERR_TIMEOUT, "%s did not finish within %lld ms (are all ranks making this call?)", call,
                  (long long)rn->req->timeout_ms);
    }
    t3d__backoff_wait(&b);
    if (rn->api->CommGetAsyncError(nc, &r) != T3D_NCCL_SUCCESS) r = T3D_NCCL_INTERNAL_ERROR;
  }
  if (r == T3D_NCCL_SUCCESS) return T3D_OK;
  const char *last = rn->api->GetLastError(nc);
  return fail(rn, from_nccl(r), "%s failed: %s%s%s", call, rn->api->GetErrorString(r), last && last[0] ? ": " : "",
              last ? last : "");
}

/* Waits for rank 0's unique id in the store, in short slices: the caller holds st->mu, which t3d_comm_abort needs,
 * so the wait must notice an abort, and it ends at the operation's deadline. */
static t3d_result_t get_id(run_t *rn, const char *key, void **v, size_t *len) {
  t3d_comm_t *comm = rn->comm;
  char full[512];
  snprintf(full, sizeof full, "%s/%s", comm->prefix, key);
  for (;;) {
    uint64_t now = t3d__now_ns();
    int64_t left_ms = now < rn->deadline_ns ? (int64_t)((rn->deadline_ns - now) / 1000000ull) : 0;
    t3d_result_t r = comm->store.get(comm->store.ctx, full, v, len, left_ms < 100 ? left_ms : 100);
    if (r != T3D_ERR_TIMEOUT) {
      if (r == T3D_OK) return T3D_OK;
      return fail(rn, r, "reading NCCL's unique id from the store key '%s' failed: %s", full, t3d_result_string(r));
    }
    if (atomic_load(&comm->aborted)) return fail(rn, T3D_ERR_ABORTED, "the group was aborted while waiting for rank "
                                                 "0's NCCL unique id");
    if (left_ms <= 0) {
      return fail(rn, T3D_ERR_TIMEOUT, "rank 0 did not publish NCCL's unique id under store key '%s' within %lld "
                  "ms (did every rank make this call?)", full, (long long)rn->req->timeout_ms);
    }
  }
}

/* Creates an NCCL communicator of nranks: rank 0 makes the unique id and puts it in the store under key. */
static t3d_result_t make_comm(run_t *rn, const char *key, int nranks, int rank, t3d_nccl_comm_t *out) {
  const t3d_nccl_api_t *api = rn->api;
  t3d_nccl_unique_id_t id;
  if (rank == 0) {
    t3d_nccl_result_t r = api->GetUniqueId(&id);
    if (r != T3D_NCCL_SUCCESS) return fail(rn, from_nccl(r), "ncclGetUniqueId failed: %s", api->GetErrorString(r));
    T3D_CHECK(t3d__store_set(rn->comm, key, &id, sizeof id));
  } else {
    void *v = NULL;
    size_t len = 0;
    T3D_CHECK(get_id(rn, key, &v, &len));
    if (len != sizeof id) {
      free(v);
      return fail(rn, T3D_ERR_MISMATCH, "store key '%s' holds %zu bytes, not an NCCL unique id", key, len);
    }
    memcpy(&id, v, sizeof id);
    free(v);
  }
  t3d_nccl_config_t cfg = {sizeof cfg, T3D_NCCL_CONFIG_MAGIC, T3D_NCCL_CONFIG_VERSION, 0, T3D_NCCL_CONFIG_UNDEF_INT,
                           T3D_NCCL_CONFIG_UNDEF_INT, T3D_NCCL_CONFIG_UNDEF_INT, NULL};
  t3d_nccl_comm_t nc = NULL;
  t3d_nccl_result_t started = api->CommInitRankConfig(&nc, nranks, id, rank, &cfg);
  t3d_result_t res = settle(rn, nc, started, "ncclCommInitRankConfig");
  if (res != T3D_OK) {
    if (nc != NULL) api->CommAbort(nc);
    return res;
  }
  T3D_INFO("group '%s' rank %d: NCCL communicator '%s' (%d ranks) on CUDA device %d", rn->comm->name,
           rn->comm->rank, key, nranks, rn->st->device);
  *out = nc;
  return T3D_OK;
}

static t3d_result_t world_comm(run_t *rn, t3d_nccl_comm_t *out) {
  if (rn->st->world == NULL) {
    T3D_CHECK(make_comm(rn, "nccl/world", rn->comm->size, rn->comm->rank, &rn->st->world));
  }
  *out = rn->st->world;
  return T3D_OK;
}

static t3d_result_t pair_comm(run_t *rn, int peer, t3d_nccl_comm_t *out) {
  t3d_nccl_t *st = rn->st;
  for (int i = 0; i < st->npairs; i++) {
    if (st->pairs[i].peer == peer) {
      *out = st->pairs[i].comm;
      return T3D_OK;
    }
  }
  int me = rn->comm->rank, lo = me < peer ? me : peer, hi = me < peer ? peer : me;
  char key[64];
  snprintf(key, sizeof key, "nccl/pair/%d-%d", lo, hi);
  nccl_pair_t *grown = realloc(st->pairs, sizeof *grown * (size_t)(st->npairs + 1));
  if (grown == NULL) return T3D_ERR_NO_MEMORY;
  st->pairs = grown;
  t3d_nccl_comm_t nc = NULL;
  T3D_CHECK(make_comm(rn, key, 2, me == lo ? 0 : 1, &nc));
  st->pairs[st->npairs++] = (nccl_pair_t){peer, nc};
  *out = nc;
  return T3D_OK;
}

/* ---------- mapping t3d's types and reductions onto NCCL's ---------- */

typedef struct {
  t3d_nccl_dtype_t dt;
  size_t mult;          /* NCCL elements per t3d element (2 for complex) */
  t3d_nccl_redop_t op;
  int premul;           /* op must be made with the scalar */
  unsigned char scalar[8];
} reduction_t;

static int is_int(t3d_dtype_t dt) {
  return dt == T3D_INT8 || dt == T3D_UINT8 || dt == T3D_INT32 || dt == T3D_INT64;
}

/* The scalar of PREMUL_SUM in the NCCL type, as NCCL reads it from host memory. */
static t3d_result_t premul_scalar(run_t *rn, t3d_dtype_t dt, double s, unsigned char *out) {
  float f = (float)s;
  int64_t i = (int64_t)s;
  if (is_int(dt) && (double)i != s) {
    return fail(rn, T3D_ERR_UNSUPPORTED, "PREMUL_SUM with the non-integral factor %g on dtype %s: NCCL multiplies "
                "integers by an integer", s, t3d_dtype_name(dt));
  }
  switch (dt) {
    case T3D_FLOAT16:
    case T3D_BFLOAT16: t3d__float_to_half(out, &f, 1, dt); break;
    case T3D_FLOAT32:
    case T3D_COMPLEX64: memcpy(out, &f, sizeof f); break;
    case T3D_FLOAT64:
    case T3D_COMPLEX128: memcpy(out, &s, sizeof s); break;
    case T3D_INT8: *(int8_t *)out = (int8_t)i; break;
    case T3D_UINT8: *out = (unsigned char)i; break;
    case T3D_INT32: { int32_t v = (int32_t)i; memcpy(out, &v, sizeof v); } break;
    default: memcpy(out, &i, sizeof i); break;
  }
  return T3D_OK;
}

static t3d_result_t reduction(run_t *rn, const t3d_request_t *r, reduction_t *red) {
  static const t3d_nccl_dtype_t types[T3D_DTYPE_COUNT] = {
      [T3D_INT8] = T3D_NCCL_INT8,       [T3D_UINT8] = T3D_NCCL_UINT8,       [T3D_INT32] = T3D_NCCL_INT32,
      [T3D_INT64] = T3D_NCCL_INT64,     [T3D_FLOAT16] = T3D_NCCL_FLOAT16,   [T3D_BFLOAT16] = T3D_NCCL_BFLOAT16,
      [T3D_FLOAT32] = T3D_NCCL_FLOAT32, [T3D_FLOAT64] = T3D_NCCL_FLOAT64,   [T3D_BOOL] = T3D_NCCL_UINT8,
      [T3D_COMPLEX64] = T3D_NCCL_FLOAT32, [T3D_COMPLEX128] = T3D_NCCL_FLOAT64};
  memset(red, 0, sizeof *red);
  red->dt = types[r->dtype];
  red->mult = (r->dtype == T3D_COMPLEX64 || r->dtype == T3D_COMPLEX128) ? 2 : 1;
  t3d_redop_t op = r->op;
  if (r->dtype == T3D_BOOL) {
    /* bool is one byte of 0 or 1: "any" and "all" keep it so, a byte sum would not. */
    if (op == T3D_SUM || op == T3D_MAX || op == T3D_BOR) op = T3D_MAX;
    else if (op == T3D_PROD || op == T3D_MIN || op == T3D_BAND) op = T3D_MIN;
  }
  switch (op) {
    case T3D_SUM: red->op = T3D_NCCL_SUM; break;
    case T3D_PROD: red->op = T3D_NCCL_PROD; break;
    case T3D_MIN: red->op = T3D_NCCL_MIN; break;
    case T3D_MAX: red->op = T3D_NCCL_MAX; break;
    case T3D_AVG: red->op = T3D_NCCL_AVG; break;
    case T3D_PREMUL_SUM:
      red->premul = 1;
      return premul_scalar(rn, r->dtype, r->scalar, red->scalar);
    default:
      return fail(rn, T3D_ERR_UNSUPPORTED, "reduction %s on dtype %s: NCCL has no bitwise reductions",
                  t3d_redop_name(r->op), t3d_dtype_name(r->dtype));
  }
  return T3D_OK;
}

/* ---------- one request as NCCL calls ---------- */

/* Reduction operators made for this run, destroyed once NCCL has been given every call that uses them. */
typedef struct {
  t3d_nccl_redop_t ops[16];
  t3d_nccl_comm_t comms[16];
  int n;
} made_ops_t;

static t3d_result_t redop_for(run_t *rn, t3d_nccl_comm_t nc, reduction_t *red, made_ops_t *made) {
  if (!red->premul) return T3D_OK;
  if (made->n == (int)(sizeof made->ops / sizeof made->ops[0])) {
    return fail(rn, T3D_ERR_UNSUPPORTED, "more than %d PREMUL_SUM operations in one group", made->n);
  }
  t3d_nccl_result_t r =
      rn->api->RedOpCreatePreMulSum(&red->op, red->scalar, red->dt, T3D_NCCL_SCALAR_HOST_IMMEDIATE, nc);
  T3D_CHECK(settle(rn, nc, r, "ncclRedOpCreatePreMulSum"));
  made->ops[made->n] = red->op;
  made->comms[made->n++] = nc;
  return T3D_OK;
}

/* Elements from the start of a buffer to the end of its last non-empty block. */
static size_t extent(const size_t *counts, const size_t *displs, int n) {
  size_t e = 0;
  for (int p = 0; p < n; p++) {
    if (counts[p] > 0 && displs[p] + counts[p] > e) e = displs[p] + counts[p];
  }
  return e;
}

static int equal_blocks(const size_t *counts, const size_t *displs, int n) {
  for (int p = 0; p < n; p++) {
    if (counts[p] != counts[0] || (displs != NULL && displs[p] != (size_t)p * counts[0])) return 0;
  }
  return 1;
}

/* Issues the calls of one request; several calls of one request go in an NCCL group of their own (groups nest). */
static t3d_result_t enqueue(run_t *rn, t3d_nccl_comm_t nc, t3d_request_t *r, made_ops_t *made) {
  const t3d_nccl_api_t *api = rn->api;
  rn->req = r;
  void *s = r->stream;
  int me = rn->comm->rank, n = rn->comm->size;
  size_t es = t3d_dtype_size(r->dtype);
  const char *sb = r->sendbuf;
  char *rb = r->recvbuf;
  reduction_t red;
  t3d_nccl_result_t x = T3D_NCCL_SUCCESS;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
      T3D_CHECK(reduction(rn, r, &red));
      T3D_CHECK(redop_for(rn, nc, &red, made));
      return settle(rn, nc, api->AllReduce(sb, rb, r->count * red.mult, red.dt, red.op, nc, s), "ncclAllReduce");
    case T3D_OP_REDUCE:
      T3D_CHECK(reduction(rn, r, &red));
      T3D_CHECK(redop_for(rn, nc, &red, made));
      return settle(rn, nc, api->Reduce(sb, me == r->root ? rb : NULL, r->count * red.mult, red.dt, red.op, r->root,
                                        nc, s), "ncclReduce");
    case T3D_OP_BROADCAST:
      return settle(rn, nc, api->Broadcast(rb, rb, r->count * es, T3D_NCCL_INT8, r->root, nc, s), "ncclBroadcast");
    case T3D_OP_ALLGATHERV:
      if (equal_blocks(r->rcounts, r->rdispls, n)) {
        return settle(rn, nc, api->AllGather(sb, rb, r->count * es, T3D_NCCL_INT8, nc, s), "ncclAllGather");
      }
      /* Uneven blocks: each rank broadcasts its own. */
      api->GroupStart();
      for (int p = 0; p < n && x == T3D_NCCL_SUCCESS; p++) {
        if (r->rcounts[p] == 0) continue;
        char *dst = rb + r->rdispls[p] * es;
        x = api->Broadcast(p == me ? (const void *)sb : dst, dst, r->rcounts[p] * es, T3D_NCCL_INT8, p, nc, s);
      }
      break;
    case T3D_OP_REDUCE_SCATTERV: {
      T3D_CHECK(reduction(rn, r, &red));
      T3D_CHECK(redop_for(rn, nc, &red, made));
      if (equal_blocks(r->rcounts, NULL, n)) {
        return settle(rn, nc, api->ReduceScatter(sb, rb, r->rcounts[0] * red.mult, red.dt, red.op, nc, s),
                      "ncclReduceScatter");
      }
      /* Uneven blocks: block p is reduced to rank p. */
      api->GroupStart();
      const char *block = sb;
      for (int p = 0; p < n && x == T3D_NCCL_SUCCESS; p++) {
        size_t c = r->rcounts[p];
        if (c > 0) x = api->Reduce(block, p == me ? rb : NULL, c * red.mult, red.dt, red.op, p, nc, s);
        block += c * es;
      }
      break;
    }
    case T3D_OP_GATHER:
    case T3D_OP_SCATTER: {
      size_t bytes = r->count * es;
      int gather = r->kind == T3D_OP_GATHER;
      api->GroupStart();
      if (me == r->root) {
        for (int p = 0; p < n && x == T3D_NCCL_SUCCESS && bytes > 0; p++) {
          x = gather ? api->Recv(rb + (size_t)p * bytes, bytes, T3D_NCCL_INT8, p, nc, s)
                     : api->Send(sb + (size_t)p * bytes, bytes, T3D_NCCL_INT8, p, nc, s);
        }
      }
      if (x == T3D_NCCL_SUCCESS && bytes > 0) {
        x = gather ? api->Send(sb, bytes, T3D_NCCL_INT8, r->root, nc, s)
                   : api->Recv(rb, bytes, T3D_NCCL_INT8, r->root, nc, s);
      }
      break;
    }
    case T3D_OP_ALLTOALLV:
      if (t3d__overlap(sb, extent(r->scounts, r->sdispls, n) * es, rb, extent(r->rcounts, r->rdispls, n) * es)) {
        return fail(rn, T3D_ERR_UNSUPPORTED, "an alltoall whose receive blocks overlap its send blocks, on CUDA "
                    "buffers (NCCL reads and writes them at once)");
      }
      api->GroupStart();
      for (int p = 0; p < n && x == T3D_NCCL_SUCCESS; p++) {
        if (r->scounts[p] > 0) x = api->Send(sb + r->sdispls[p] * es, r->scounts[p] * es, T3D_NCCL_INT8, p, nc, s);
        if (x == T3D_NCCL_SUCCESS && r->rcounts[p] > 0) {
          x = api->Recv(rb + r->rdispls[p] * es, r->rcounts[p] * es, T3D_NCCL_INT8, p, nc, s);
        }
      }
      break;
    case T3D_OP_SEND:
    case T3D_OP_RECV: {
      /* In a pair's communicator the lower group rank is rank 0. */
      int dst = nc == rn->st->world ? r->root : (r->root < me ? 0 : 1);
      if (r->kind == T3D_OP_SEND) {
        return settle(rn, nc, api->Send(sb, r->count * es, T3D_NCCL_INT8, dst, nc, s), "ncclSend");
      }
      r->source = r->root;
      r->recv_count = r->count;
      return settle(rn, nc, api->Recv(rb, r->count * es, T3D_NCCL_INT8, dst, nc, s), "ncclRecv");
    }
    default:
      return fail(rn, T3D_ERR_INTERNAL, "operation kind %d has no NCCL form", (int)r->kind);
  }
  /* The grouped forms above: close their group whether or not a call failed. */
  t3d_nccl_result_t end = api->GroupEnd();
  if (x != T3D_NCCL_SUCCESS) return settle(rn, nc, x, "a call of the NCCL group");
  return settle(rn, nc, end, "ncclGroupEnd");
}

/* ---------- runs ---------- */

static t3d_result_t run_locked(run_t *rn, t3d_request_t **reqs, int n, int grouped) {
  t3d_comm_t *comm = rn->comm;
  t3d_nccl_t *st = rn->st;
  if (atomic_load(&comm->aborted) || st->broken != T3D_OK) {
    return fail(rn, st->broken != T3D_OK ? st->broken : T3D_ERR_ABORTED,
                "the group's NCCL communicators are %s", st->broken == T3D_ERR_ABORTED || st->broken == T3D_OK
                    ? "aborted" : "broken by an earlier error");
  }
  for (int i = 0; i < n; i++) {
    t3d_request_t *r = reqs[i];
    rn->req = r;
    if (st->device >= 0 && r->device != st->device) {
      return fail(rn, T3D_ERR_INVALID_ARG, "invalid argument 'opts->device': the buffers are on CUDA device %d, but "
                  "this group's NCCL communicators use CUDA device %d (one device per group and process)",
                  r->device, st->device);
    }
    if (r->kind == T3D_OP_RECV && r->root == T3D_ANY_SOURCE) {
      return fail(rn, T3D_ERR_UNSUPPORTED, "a receive from any source (NCCL receives from a named peer only)");
    }
    if ((r->kind == T3D_OP_SEND || r->kind == T3D_OP_RECV) && r->root == comm->rank && !grouped) {
      return fail(rn, T3D_ERR_UNSUPPORTED, "a %s to itself outside a group (NCCL would wait for the other half)",
                  r->kind == T3D_OP_SEND ? "send" : "receive");
    }
    /* What NCCL cannot reduce is refused before any NCCL communicator is made for it. */
    reduction_t red;
    if (r->kind == T3D_OP_ALLREDUCE || r->kind == T3D_OP_REDUCE || r->kind == T3D_OP_REDUCE_SCATTERV)
      T3D_CHECK(reduction(rn, r, &red));
  }
  rn->req = reqs[0];
  if (st->device < 0) st->device = reqs[0]->device;
  t3d_nccl_comm_t nc;
  int p2p = reqs[0]->kind == T3D_OP_SEND || reqs[0]->kind == T3D_OP_RECV;
  if (!grouped && p2p) T3D_CHECK(pair_comm(rn, reqs[0]->root, &nc));
  else T3D_CHECK(world_comm(rn, &nc));

  made_ops_t made = {.n = 0};
  t3d_result_t res = T3D_OK;
  if (grouped) rn->api->GroupStart();
  for (int i = 0; i < n && res == T3D_OK; i++) res = enqueue(rn, nc, reqs[i], &made);
  if (grouped) {
    rn->req = reqs[0];
    t3d_nccl_result_t end = rn->api->GroupEnd();
    if (res == T3D_OK) res = settle(rn, nc, end, "ncclGroupEnd");
  }
  for (int i = 0; i < made.n; i++) rn->api->RedOpDestroy(made.ops[i], made.comms[i]);
  return res;
}

t3d_result_t t3d__nccl_run(t3d_comm_t *comm, t3d_request_t **reqs, int n, int grouped) {
  t3d_nccl_t *st = comm->nccl;
  const char *why = NULL;
  run_t rn = {comm, st, t3d__nccl_api(&why), reqs[0], 0};
  t3d_result_t res;
  if (rn.api == NULL) {
    res = fail(&rn, T3D_ERR_UNSUPPORTED, "CUDA buffers go through NCCL, and %s", why);
  } else {
    int64_t timeout_ms = reqs[0]->timeout_ms;
    rn.deadline_ns = t3d__now_ns() + (uint64_t)timeout_ms * 1000000ull;
    pthread_mutex_lock(&st->mu);
    res = run_locked(&rn, reqs, n, grouped);
    pthread_mutex_unlock(&st->mu);
  }
  char msg[1024] = "";
  if (res < 0) snprintf(msg, sizeof msg, "%s", t3d_comm_last_error(comm));
  /* As on the host path: after a timeout or a lost peer the ranks are out of step, so the group fails fast. */
  if (res == T3D_ERR_TIMEOUT || res == T3D_ERR_PEER_LOST || res == T3D_ERR_TRANSPORT || res == T3D_ERR_SYSTEM) {
    pthread_mutex_lock(&st->mu);
    if (st->broken == T3D_OK) st->broken = res;
    pthread_mutex_unlock(&st->mu);
    t3d__fail_comm(comm, res, msg);
  }
  for (int i = 0; i < n; i++) t3d__request_complete(reqs[i], res, msg);
  return res;
}

void t3d__nccl_poll_errors(t3d_comm_t *comm) {
  t3d_nccl_t *st = comm->nccl;
  const t3d_nccl_api_t *api = t3d__nccl_api(NULL);
  /* Only when a run is not under way: this is a health check, never a reason to wait. */
  if (st == NULL || api == NULL || pthread_mutex_trylock(&st->mu) != 0) return;
  for (int i = 0; i < comm_count(st) && st->broken == T3D_OK; i++) {
    t3d_nccl_comm_t nc = comm_at(st, i);
    t3d_nccl_result_t e = T3D_NCCL_SUCCESS;
    if (api->CommGetAsyncError(nc, &e) != T3D_NCCL_SUCCESS || e == T3D_NCCL_SUCCESS || e == T3D_NCCL_IN_PROGRESS)
      continue;
    st->broken = from_nccl(e) == T3D_ERR_PEER_LOST ? T3D_ERR_PEER_LOST : T3D_ERR_TRANSPORT;
    const char *last = api->GetLastError(nc);
    char msg[700];
    snprintf(msg, sizeof msg, "t3d: group '%s' rank %d: NCCL reported an asynchronous error on CUDA device %d: %s%s%s",
             comm->name, comm->rank, st->device, api->GetErrorString(e), last && last[0] ? ": " : "",
             last ? last : "");
    t3d__fail_comm(comm, st->broken, msg);
  }
  pthread_mutex_unlock(&st->mu);
}
