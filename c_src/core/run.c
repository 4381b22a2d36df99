/* run.c: how the engine runs a collective: the front end that turns a request into what providers take (complex as
 * real pairs, half types through float32, PREMUL_SUM's scalar before and AVG's division after), the call into the
 * chosen provider, and the recording of the outcome (errors that break the communicator, completion). */
#include "engine.h"
#include "base/watch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Runs allreduce, reduce or reduce_scatterv. The algorithms see plain SUM..BXOR on full-width types. */
static t3d_result_t run_reducing(t3d_exec_t *ex, t3d_request_t *r, const t3d_coll_ops_t *c) {
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
  t3d_dtype_t wdt = t3d__is_half(dt) ? T3D_FLOAT32 : dt;
  size_t wsize = t3d_dtype_size(wdt);
  const void *in = r->sendbuf;
  void *out = r->recvbuf;
  void *tmp_in = NULL, *tmp_out = NULL;
  t3d_result_t res = T3D_OK;
  if (t3d__is_half(dt) || r->op == T3D_PREMUL_SUM) {
    tmp_in = malloc(n_in * wsize + 1);
    if (tmp_in == NULL) {
      res = T3D_ERR_NO_MEMORY;
      goto out;
    }
    if (t3d__is_half(dt)) t3d__half_to_float(tmp_in, r->sendbuf, n_in, dt);
    else memcpy(tmp_in, r->sendbuf, n_in * wsize);
    if (r->op == T3D_PREMUL_SUM) t3d__scale(tmp_in, n_in, wdt, r->scalar);
    in = tmp_in;
  }
  if (t3d__is_half(dt)) {
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
  switch (r->kind) {
    case T3D_OP_ALLREDUCE: res = c->allreduce(ex, in, out, n_in, wdt, op); break;
    case T3D_OP_REDUCE: res = c->reduce(ex, in, out, n_in, wdt, op, r->root); break;
    default: res = c->reduce_scatterv(ex, in, out, counts, wdt, op); break;
  }
  if (res != T3D_OK) goto out;
  if (r->op == T3D_AVG && n_out > 0) t3d__divide(out, n_out, wdt, ex->size);
  if (t3d__is_half(dt) && n_out > 0) t3d__float_to_half(r->recvbuf, out, n_out, dt);
out:
  free(tmp_in);
  free(tmp_out);
  if (counts != r->rcounts) free(counts);
  return res;
}

/* What a provider with `run` (cudev) hands over: a request on host memory, run through the host provider. */
static t3d_result_t execute_on_host(t3d_exec_t *ex, t3d_request_t *r) {
  r->memtype = T3D_MEM_HOST;
  r->prov = ex->comm->choice[r->kind][0];
  if (r->prov == NULL || r->prov->coll == NULL) {
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d): no provider can run it on host "
             "memory (T3D_PROVIDERS leaves out the ones that could)", ex->opname, (unsigned long long)ex->seq,
             ex->comm->name, ex->rank);
    return T3D_ERR_UNSUPPORTED;
  }
  return t3d__execute(ex, r);
}

t3d_result_t t3d__execute(t3d_exec_t *ex, t3d_request_t *r) {
  if (r->resume) return r->prov->finish(ex, r);
  if (r->prov->run != NULL) return r->prov->run(ex, r, execute_on_host);
  const t3d_coll_ops_t *c = r->prov->coll;
  size_t esize = r->kind == T3D_OP_BARRIER ? 1 : t3d_dtype_size(r->dtype);
  size_t *b;
  t3d_result_t res;
  switch (r->kind) {
    case T3D_OP_ALLREDUCE:
    case T3D_OP_REDUCE:
    case T3D_OP_REDUCE_SCATTERV: return run_reducing(ex, r, c);
    case T3D_OP_BROADCAST: return c->broadcast(ex, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_GATHER: return c->gather(ex, r->sendbuf, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_SCATTER: return c->scatter(ex, r->sendbuf, r->recvbuf, r->count * esize, r->root);
    case T3D_OP_BARRIER: return c->barrier(ex);
    case T3D_OP_ALLGATHERV:
      /* Byte counts and displacements from element ones. */
      b = malloc(2 * (size_t)ex->size * sizeof(size_t));
      if (b == NULL) return T3D_ERR_NO_MEMORY;
      for (int p = 0; p < ex->size; p++) {
        b[p] = r->rcounts[p] * esize;
        b[ex->size + p] = r->rdispls[p] * esize;
      }
      res = c->allgatherv(ex, r->sendbuf, r->recvbuf, b, b + ex->size);
      free(b);
      return res;
    case T3D_OP_ALLTOALLV:
      return c->alltoallv(ex, r->sendbuf, r->scounts, r->sdispls, r->recvbuf, r->rcounts, r->rdispls, esize,
                          r->equal_blocks);
    default: return T3D_ERR_INTERNAL;
  }
}

/* ---------- outcome ---------- */

void t3d__release_engine(t3d_comm_t *comm) {
  pthread_mutex_lock(&comm->mu);
  comm->busy = 0;
  if (comm->q_head != NULL) pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
}

/* What ranks must agree on besides the operation and its size (t3d_internal.h, T3D_FP_BITS). */
static uint32_t fingerprint(t3d_op_kind_t kind, t3d_dtype_t dtype, t3d_redop_t op, int root) {
  if (kind == T3D_OP_BARRIER) return 0;
  uint32_t fp = ((uint32_t)dtype + 1u) & 0x1fu;
  if (kind == T3D_OP_ALLREDUCE || kind == T3D_OP_REDUCE || kind == T3D_OP_REDUCE_SCATTERV) {
    fp |= (((uint32_t)op + 1u) & 0xfu) << 5;
  }
  if (kind == T3D_OP_BROADCAST || kind == T3D_OP_REDUCE || kind == T3D_OP_GATHER ||
      kind == T3D_OP_SCATTER) {
    fp |= (((uint32_t)root + 1u) & 0x1ffffu) << 9;
  }
  return fp;
}

void t3d__exec_init(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex) {
  ex->error[0] = '\0'; /* not the whole 512 bytes: this runs for every collective */
  ex->comm = comm;
  ex->rank = comm->rank;
  ex->size = comm->size;
  ex->peers = NULL;
  ex->opname = t3d__op_name(r->kind);
  ex->kind = (int)r->kind;
  ex->seq = r->seq;
  ex->fp = fingerprint(r->kind, r->dtype, r->op, r->root);
  ex->timeout_ms = r->timeout_ms;
  ex->deadline_ns = r->resume ? r->deadline_ns : 0; /* t3d__exec_deadline reads the clock when first asked */
}

/* Every provider that keeps state its peers wait on (a segment) learns that the communicator broke. */
static void tell_providers(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  for (const t3d_provider_t *const *p = t3d__providers(); *p != NULL; p++) {
    if ((*p)->broken != NULL) (*p)->broken(comm, res, msg);
  }
}

/* ex->error is filled in if empty. */
void t3d__record_failure(t3d_comm_t *comm, t3d_exec_t *ex, t3d_result_t res) {
  if (ex->error[0] == '\0') {
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) failed: %s", ex->opname,
             (unsigned long long)ex->seq, comm->name, comm->rank, comm->size, t3d_result_string(res));
  }
  /* A collective that failed half-way leaves peers out of step: nothing later on this communicator can be
   * trusted, so it fails fast (as NCCL does) instead of mismatching messages. */
  if (res == T3D_ERR_TIMEOUT || res == T3D_ERR_PEER_LOST || res == T3D_ERR_ABORTED || res == T3D_ERR_MISMATCH ||
      res == T3D_ERR_TRANSPORT) {
    t3d__fail_comm(comm, res, ex->error);
    tell_providers(comm, res, ex->error);
    t3d__watch_tell(comm, res, ex->error); /* groups not on one host's segment (base/watch.h) */
  } else {
    t3d__set_error(comm, res, "%s", ex->error);
  }
}

void t3d__release(t3d_comm_t *comm, int hold) {
  if (hold == T3D_HOLD_OWNER) atomic_store_explicit(&comm->in_owner_path, 0, memory_order_release);
  else if (hold == T3D_HOLD_ENGINE) t3d__release_engine(comm);
}

void t3d__end_collective(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex, t3d_result_t res, int release,
                         int fresh) {
  if (res < 0) t3d__record_failure(comm, ex, res);
  t3d__release(comm, release);
  if (fresh) t3d__request_complete_fresh(r, res, ex->error);
  else t3d__request_complete(r, res, ex->error);
}

void t3d__run_collective(t3d_comm_t *comm, t3d_request_t *r, int release) {
  int fatal = atomic_load(&comm->fatal);
  if (fatal != 0) {
    char msg[1300];
    snprintf(msg, sizeof msg, "t3d: %s #%llu on group '%s' (rank %d) not run: the communicator is broken by an "
             "earlier error: %s", t3d__op_name(r->kind), (unsigned long long)r->seq, comm->name, comm->rank,
             comm->fatal_msg);
    /* Broken from outside (another host told this one): peers on this host may be waiting for this rank in a
     * segment; they hear it from there (the first report in a segment wins, so telling again costs nothing). */
    tell_providers(comm, (t3d_result_t)fatal, msg);
    if (release) t3d__release_engine(comm);
    t3d__request_complete(r, (t3d_result_t)fatal, msg);
    return;
  }
  t3d_exec_t ex;
  t3d__exec_init(comm, r, &ex);
  t3d__exec_deadline(&ex); /* from its start on this thread */
  t3d__end_collective(comm, r, &ex, t3d__execute(&ex, r), release, 0);
}

