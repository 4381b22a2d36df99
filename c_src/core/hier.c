/* hier.c: collectives of a group that spans hosts with as many ranks on every host (two or more hosts, two or more
 * ranks on each), in two levels: shared memory inside each host, the UCX algorithms between hosts. At init each
 * rank joins a child communicator of the ranks on its host (made by comm.c; it gets a segment, so the shared-memory
 * provider serves it), and learns its lane: the ranks that hold its place (local index) on every host.
 * - allreduce: a reduce-scatter in the host (local rank i holds the host's sum of block i), an allreduce of block i
 *   along lane i (UCX, on this communicator's transport, the lane's ranks only), an allgather in the host. Each byte
 *   crosses the network once each way per lane, where a flat ring over all ranks sends 2(n-1)/n of the vector from
 *   every rank (hosts x ranks), also between ranks of one host.
 * - broadcast: along the root's lane (one message per other host), then in each host from the rank that got it.
 * - allgather: the host's blocks in the host, this rank's block along its lane, then the blocks that came along the
 *   lanes round the host, one other host's at a time.
 * - reduce_scatter (each host's ranks numbered consecutively): each host's part of the input reduce-scattered in
 *   the host, then those partial blocks reduce-scattered along the lane.
 * The levels run one after the other on this communicator's progress thread; the child's own progress thread never
 * runs anything. The child is this module's alone: its sequence numbers (kind words in its segment) count the
 * phases run here. */
#include "engine.h" /* the provider tables and t3d_hier_t's functions; this file calls no other part of core/ */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct t3d_hier {
  t3d_comm_t *local; /* the ranks of this host, in rank order */
  int hosts;         /* hosts, in the order of their lowest rank */
  int host;          /* this rank's host among them */
  int *lane;         /* lane[j]: the rank on host j with this rank's local index */
  int *host_of;      /* host_of[p], local_of[p]: where rank p is */
  int *local_of;
  int *members;      /* members[j * local->size + i]: the rank with local index i on host j */
  int consecutive;   /* every host's ranks are numbered one after the other */
  uint64_t local_seq;
  void *scratch; /* allreduce: this rank's block between the levels when the output overlaps the input other than
                  * in place; reduce_scatter: the lane's slots. Grows, never shrinks */
  size_t scratch_bytes;
};

t3d_hier_t *t3d__hier_layout(const t3d_comm_t *comm, const int *hid, int nhosts, int *local_rank, int *local_size,
                             t3d_result_t *out) {
  *out = T3D_OK;
  if (t3d__param_int(T3D_PARAM_HIER) == 0 || comm->size < 4 || nhosts < 2) return NULL;
  int n = comm->size;
  t3d_hier_t *h = NULL;
  int *per_host = calloc((size_t)nhosts, sizeof(int));
  if (per_host == NULL) {
    *out = T3D_ERR_NO_MEMORY;
    return NULL;
  }
  t3d_result_t res = T3D_OK;
  int mine = -1;
  for (int p = 0; p < n; p++) {
    if (p == comm->rank) mine = per_host[hid[p]];
    per_host[hid[p]]++;
  }
  int each = per_host[0];
  for (int j = 1; j < nhosts; j++) {
    if (per_host[j] != each) goto out; /* uneven hosts: the flat algorithms */
  }
  if (each < 2) goto out;
  h = calloc(1, sizeof *h);
  int *tables = malloc(sizeof(int) * (size_t)(3 * n + nhosts));
  if (h == NULL || tables == NULL) {
    free(h);
    free(tables);
    h = NULL;
    res = T3D_ERR_NO_MEMORY;
    goto out;
  }
  h->members = tables;
  h->host_of = tables + n;
  h->local_of = tables + 2 * n;
  h->lane = tables + 3 * n;
  memset(per_host, 0, sizeof(int) * (size_t)nhosts);
  for (int p = 0; p < n; p++) {
    int i = per_host[hid[p]]++;
    h->host_of[p] = hid[p];
    h->local_of[p] = i;
    h->members[hid[p] * each + i] = p;
    if (i == mine) h->lane[hid[p]] = p;
  }
  h->hosts = nhosts;
  h->host = hid[comm->rank];
  h->consecutive = 1;
  for (int j = 0; j < nhosts; j++) {
    for (int i = 1; i < each; i++) h->consecutive &= h->members[j * each + i] == h->members[j * each] + i;
  }
  *local_rank = mine;
  *local_size = each;
out:
  free(per_host);
  *out = res;
  return h;
}

int t3d__hier_host(const t3d_hier_t *h) { return h->host; }
void t3d__hier_attach(t3d_hier_t *h, t3d_comm_t *local) { h->local = local; }
t3d_comm_t *t3d__hier_local(const t3d_hier_t *h) { return h->local; }

void t3d__hier_free(t3d_hier_t *h) {
  if (h == NULL) return;
  free(h->scratch);
  free(h->members);
  free(h);
}

/* The vector size from which allreduce takes the two levels (T3D_HIER_BYTES). */
static size_t hier_min_bytes(void) {
  int64_t v = t3d__param_int(T3D_PARAM_HIER_BYTES);
  return v < 0 ? SIZE_MAX : (size_t)v;
}

/* A phase inside the host: an exec on the child for the next of its sequence numbers. */
static void local_exec(const t3d_exec_t *ex, t3d_hier_t *h, t3d_op_kind_t kind, t3d_exec_t *lex) {
  *lex = *ex;
  lex->comm = h->local;
  lex->rank = h->local->rank;
  lex->size = h->local->size;
  lex->kind = (int)kind;
  lex->seq = ++h->local_seq;
  lex->peers = NULL;
  lex->error[0] = '\0';
}

/* A failure in either level: the host's other ranks may be waiting in the child's segment for this one, so the
 * child is broken too (its waits check the segment's word), with this error; the engine breaks this communicator
 * and tells the other hosts (core/run.c). */
static t3d_result_t failed(t3d_exec_t *ex, t3d_hier_t *h, const t3d_exec_t *phase, t3d_result_t res) {
  t3d_comm_t *c = ex->comm;
  if (phase->comm == h->local) {
    /* The child's error numbers ranks its own way: say which ranks of this group they are. */
    char map[200];
    size_t len = 0;
    int nl = h->local->size;
    for (int i = 0; i < nl && len + 24 < sizeof map; i++) {
      len += (size_t)snprintf(map + len, sizeof map - len, "%s%d", i ? ", " : "", h->members[h->host * nl + i]);
    }
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) failed in its host's part, "
             "group '%s', whose ranks 0..%d are ranks %.100s here: %.500s", ex->opname, (unsigned long long)ex->seq,
             c->name, c->rank, c->size, h->local->name, nl - 1, map,
             phase->error[0] ? phase->error : t3d_result_string(res));
  } else if (phase->error[0] != '\0') {
    snprintf(ex->error, sizeof ex->error, "%s", phase->error);
  }
  if (ex->error[0] == '\0') {
    snprintf(ex->error, sizeof ex->error, "t3d: %s #%llu on group '%s' (rank %d of %d) failed: %s", ex->opname,
             (unsigned long long)ex->seq, c->name, c->rank, c->size, t3d_result_string(res));
  }
  t3d__fail_comm(h->local, res, ex->error);
  t3d__provider_shm.broken(h->local, res, ex->error);
  return res;
}

static int grow_scratch(t3d_hier_t *h, size_t bytes) { return t3d__grow_scratch(&h->scratch, &h->scratch_bytes, bytes); }

/* One piece of the vector through the three levels. */
static t3d_result_t hier_allreduce_piece(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count,
                                         t3d_dtype_t dt, t3d_redop_t op) {
  t3d_hier_t *h = ex->comm->hier;
  size_t es = t3d_dtype_size(dt);
  int nl = h->local->size, me = h->local->rank;
  size_t *arr = malloc(4 * (size_t)nl * sizeof *arr);
  if (arr == NULL) return T3D_ERR_NO_MEMORY;
  size_t *counts = arr, *offs = arr + nl, *bytes = arr + 2 * nl, *displs = arr + 3 * nl;
  t3d__algo_split(count, nl, counts, offs);
  for (int c = 0; c < nl; c++) {
    bytes[c] = counts[c] * es;
    displs[c] = offs[c] * es;
  }
  t3d_result_t res = T3D_OK;
  /* This rank's block goes through the levels in its place in recvbuf: the allgather then finds it there and
   * copies only the other ranks' blocks. The shared-memory reduce-scatter may write its output over the input's own
   * block (in place) or apart from the input; any other overlap goes through the scratch block. */
  char *own = (char *)recvbuf + displs[me];
  if (sendbuf != recvbuf && t3d__overlap(sendbuf, count * es, own, bytes[me])) {
    if (!grow_scratch(h, bytes[me] + 1)) {
      free(arr);
      return T3D_ERR_NO_MEMORY;
    }
    own = h->scratch;
  }
  const t3d_coll_ops_t *shm = t3d__provider_shm.coll, *ucx = t3d__provider_ucx.coll;
  t3d_exec_t lex;
  local_exec(ex, h, T3D_OP_REDUCE_SCATTERV, &lex);
  res = shm->reduce_scatterv(&lex, sendbuf, own, counts, dt, op);
  if (res != T3D_OK) {
    res = failed(ex, h, &lex, res);
    goto out;
  }
  /* Along the lane: this communicator's transport and sequence number; the tags carry each sender's rank, so
   * the lanes' messages never meet. */
  t3d_exec_t *xex = &lex; /* reused: the local phase is done with it */
  *xex = *ex;
  xex->rank = h->host;
  xex->size = h->hosts;
  xex->peers = h->lane;
  res = ucx->allreduce(xex, own, own, counts[me], dt, op);
  if (res != T3D_OK) {
    res = failed(ex, h, xex, res);
    goto out;
  }
  local_exec(ex, h, T3D_OP_ALLGATHERV, &lex);
  res = shm->allgatherv(&lex, own, recvbuf, bytes, displs);
  if (res != T3D_OK) res = failed(ex, h, &lex, res);
out:
  free(arr);
  return res;
}

/* Large vectors go in pieces of T3D_HIER_CHUNK_BYTES, each through all three levels, the same pieces on every
 * rank. The lanes' messages of consecutive pieces carry the same tags; UCX matches a sender's messages in the order
 * they were sent, and a piece's receives are all posted before the next piece's. */
static t3d_result_t hier_allreduce(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, size_t count,
                                   t3d_dtype_t dt, t3d_redop_t op) {
  t3d_hier_t *h = ex->comm->hier;
  size_t es = t3d_dtype_size(dt), nl = (size_t)h->local->size;
  if (count * es < hier_min_bytes() || count < nl) {
    return t3d__provider_ucx.coll->allreduce(ex, sendbuf, recvbuf, count, dt, op);
  }
  int64_t chunk = t3d__param_int(T3D_PARAM_HIER_CHUNK_BYTES);
  size_t piece = chunk > 0 ? (size_t)chunk / es : count;
  if (piece < nl) piece = nl;
  const char *in = sendbuf;
  char *out = recvbuf;
  for (size_t lo = 0, n; lo < count; lo += n) {
    n = count - lo;
    if (n > piece && n - piece >= nl) n = piece; /* a tail shorter than nl joins the last piece */
    T3D_CHECK(hier_allreduce_piece(ex, in + lo * es, out + lo * es, n, dt, op));
  }
  return T3D_OK;
}

static t3d_result_t hier_broadcast(t3d_exec_t *ex, void *buf, size_t bytes, int root) {
  t3d_hier_t *h = ex->comm->hier;
  t3d_result_t res = T3D_OK;
  int lr = h->local_of[root];
  if (h->local->rank == lr) { /* the root's lane: one message to each other host */
    t3d_exec_t xex = *ex;
    xex.rank = h->host;
    xex.size = h->hosts;
    xex.peers = h->lane;
    res = t3d__provider_ucx.coll->broadcast(&xex, buf, bytes, h->host_of[root]);
    if (res != T3D_OK) return failed(ex, h, &xex, res);
  }
  t3d_exec_t lex;
  local_exec(ex, h, T3D_OP_BROADCAST, &lex);
  res = t3d__provider_shm.coll->broadcast(&lex, buf, bytes, lr);
  if (res != T3D_OK) return failed(ex, h, &lex, res);
  return T3D_OK;
}

/* Block p: bytes[p] at byte offset displs[p] of recvbuf (p a rank of the communicator). */
static t3d_result_t hier_allgatherv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *bytes,
                                    const size_t *displs) {
  t3d_hier_t *h = ex->comm->hier;
  int nl = h->local->size, nh = h->hosts, me = h->local->rank;
  size_t *arr = malloc(2 * (size_t)(nl > nh ? nl : nh) * sizeof *arr);
  if (arr == NULL) return T3D_ERR_NO_MEMORY;
  size_t *b = arr, *d = arr + (nl > nh ? nl : nh);
  char *rb = recvbuf;
  t3d_result_t res = T3D_OK;
  t3d_exec_t lex;
  /* 1. this host's blocks, each to its place */
  for (int i = 0; i < nl; i++) {
    b[i] = bytes[h->members[h->host * nl + i]];
    d[i] = displs[h->members[h->host * nl + i]];
  }
  local_exec(ex, h, T3D_OP_ALLGATHERV, &lex);
  res = t3d__provider_shm.coll->allgatherv(&lex, sendbuf, recvbuf, b, d);
  if (res != T3D_OK) {
    res = failed(ex, h, &lex, res);
    goto out;
  }
  /* 2. along the lane: the blocks of the ranks at this rank's place on every host */
  for (int j = 0; j < nh; j++) {
    b[j] = bytes[h->lane[j]];
    d[j] = displs[h->lane[j]];
  }
  t3d_exec_t xex = *ex;
  xex.rank = h->host;
  xex.size = nh;
  xex.peers = h->lane;
  res = t3d__provider_ucx.coll->allgatherv(&xex, rb + d[h->host], recvbuf, b, d);
  if (res != T3D_OK) {
    res = failed(ex, h, &xex, res);
    goto out;
  }
  /* 3. round the host, one other host at a time: local rank i holds host j's block i since step 2 */
  for (int j = 0; j < nh && res == T3D_OK; j++) {
    if (j == h->host) continue;
    for (int i = 0; i < nl; i++) {
      b[i] = bytes[h->members[j * nl + i]];
      d[i] = displs[h->members[j * nl + i]];
    }
    local_exec(ex, h, T3D_OP_ALLGATHERV, &lex);
    res = t3d__provider_shm.coll->allgatherv(&lex, rb + d[me], recvbuf, b, d);
    if (res != T3D_OK) res = failed(ex, h, &lex, res);
  }
out:
  free(arr);
  return res;
}

/* counts[p] elements for rank p, the blocks one after the other in sendbuf in rank order. Consecutive hosts only
 * (each host's part of the input is then one piece); otherwise over UCX between all ranks. */
static t3d_result_t hier_reduce_scatterv(t3d_exec_t *ex, const void *sendbuf, void *recvbuf, const size_t *counts,
                                         t3d_dtype_t dt, t3d_redop_t op) {
  t3d_hier_t *h = ex->comm->hier;
  if (!h->consecutive) return t3d__provider_ucx.coll->reduce_scatterv(ex, sendbuf, recvbuf, counts, dt, op);
  int nl = h->local->size, nh = h->hosts, me = h->local->rank;
  size_t es = t3d_dtype_size(dt);
  size_t *lc = malloc((size_t)(nh + 1) * sizeof *lc);
  if (lc == NULL) return T3D_ERR_NO_MEMORY;
  size_t scratch = 0;
  for (int j = 0; j < nh; j++) {
    lc[j] = counts[h->members[j * nl + me]];
    scratch += lc[j] * es;
  }
  t3d_result_t res = T3D_OK;
  if (!grow_scratch(h, scratch + 1)) {
    free(lc);
    return T3D_ERR_NO_MEMORY;
  }
  /* 1. host j's part of the input (its ranks' blocks, one piece), reduce-scattered in this host: this rank gets the
   * host's sum of the block of host j's rank at its own place, into slot j */
  const char *in = sendbuf;
  char *slot = h->scratch;
  t3d_exec_t lex;
  for (int j = 0; j < nh && res == T3D_OK; j++) {
    size_t off = 0;
    for (int p = 0; p < h->members[j * nl]; p++) off += counts[p];
    local_exec(ex, h, T3D_OP_REDUCE_SCATTERV, &lex);
    res = t3d__provider_shm.coll->reduce_scatterv(&lex, in + off * es, slot, counts + h->members[j * nl], dt, op);
    if (res != T3D_OK) res = failed(ex, h, &lex, res);
    slot += lc[j] * es;
  }
  /* 2. along the lane: slot j belongs to host j's rank at this place */
  if (res == T3D_OK) {
    t3d_exec_t xex = *ex;
    xex.rank = h->host;
    xex.size = nh;
    xex.peers = h->lane;
    res = t3d__provider_ucx.coll->reduce_scatterv(&xex, h->scratch, recvbuf, lc, dt, op);
    if (res != T3D_OK) res = failed(ex, h, &xex, res);
  }
  free(lc);
  return res;
}

static int hier_fits(const t3d_comm_t *comm, const t3d_request_t *req) {
  return comm->hier != NULL && req->memtype == T3D_MEM_HOST &&
         (req->kind == T3D_OP_ALLREDUCE || req->kind == T3D_OP_BROADCAST || req->kind == T3D_OP_ALLGATHERV ||
          req->kind == T3D_OP_REDUCE_SCATTERV);
}

static const t3d_coll_ops_t hier_coll = {
    .allreduce = hier_allreduce,
    .broadcast = hier_broadcast,
    .allgatherv = hier_allgatherv,
    .reduce_scatterv = hier_reduce_scatterv,
};

/* The group broke (core/run.c), maybe told by another host while this rank was between collectives: the host's
 * other ranks may be waiting for this one in the child's segment, in a collective it will now never run, and must
 * read why there rather than find its process gone once it exits. */
static void hier_broken(t3d_comm_t *comm, t3d_result_t res, const char *msg) {
  if (comm->hier == NULL) return;
  t3d__fail_comm(comm->hier->local, res, msg);
  t3d__provider_shm.broken(comm->hier->local, res, msg);
}

const t3d_provider_t t3d__provider_hier = {
    .name = "hier",
    .fits = hier_fits,
    .coll = &hier_coll,
    .broken = hier_broken,
};
