/* comm.c: a communicator's life: init (the transport, the shared-memory segment when every rank is on this host,
 * NCCL's state, the progress thread), destroy, abort, status, and split into subgroups. */
#include "engine.h"
#include "base/watch.h"
#include "cudev/cudev_internal.h"
#include "nccl/nccl_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void t3d_config_init(t3d_config_t *cfg) {
  if (cfg == NULL) return;
  cfg->timeout_ms = 0;
  cfg->name = NULL;
  cfg->key_prefix = NULL;
  cfg->transport = NULL;
  cfg->inline_bytes = T3D_INLINE_DEFAULT;
}

/* A build without UCX (T3D_HAVE_UCX 0: ucx/transport_none.c) serves a communicator only when the shared-memory
 * segment carries all of it; anything else fails init on every rank with this error. */
static t3d_result_t no_ucx(t3d_comm_t *comm, t3d_result_t res, const char *why) {
  return t3d__set_error(comm, res,
                        "t3d_comm_init: this build of t3d has no UCX (built with T3D_WITH_UCX=OFF or without UCX "
                        "found), which rank %d of group '%s' needs: %s", comm->rank, comm->name, why);
}

/* T3D_TRANSPORT: "auto" (shared memory for collectives when every rank is on this host, UCX for the rest), "ucx"
 * (UCX only), "shm" (like auto, but an error when some rank is on another host). */
static t3d_result_t pick_transport(t3d_comm_t *comm, const char *want) {
  if (strcmp(want, "ucx") == 0 && !T3D_HAVE_UCX)
    return no_ucx(comm, T3D_ERR_UNSUPPORTED, "its transport is 'ucx' (T3D_TRANSPORT or config)");
  if (strcmp(want, "auto") == 0 || strcmp(want, "ucx") == 0 || strcmp(want, "shm") == 0) {
    comm->tp = &t3d__transport_ucx;
    return T3D_OK;
  }
  return t3d__set_error(comm, T3D_ERR_UNSUPPORTED,
                        "t3d_comm_init: transport '%s' (T3D_TRANSPORT or config) is not available on rank %d; this "
                        "build has: %s", want, comm->rank, T3D_HAVE_UCX ? "auto, ucx, shm" : "auto, shm");
}

/* Publishes this rank's host identity (store key host/<rank>) and numbers every rank's host, hosts in the order of
 * their lowest rank: host[p] for each rank p, *nhosts of them. */
static t3d_result_t number_hosts(t3d_comm_t *comm, int *host, int *nhosts) {
  char mine[400], key[32];
  t3d__host_identity(mine, sizeof mine);
  snprintf(key, sizeof key, "host/%d", comm->rank);
  T3D_CHECK(t3d__store_set(comm, key, mine, strlen(mine) + 1));
  char **ids = calloc((size_t)comm->size, sizeof *ids);
  if (ids == NULL) return T3D_ERR_NO_MEMORY;
  t3d_result_t res = T3D_OK;
  *nhosts = 0;
  for (int p = 0; p < comm->size && res == T3D_OK; p++) {
    size_t len = 0;
    snprintf(key, sizeof key, "host/%d", p);
    res = p == comm->rank ? ((ids[p] = strdup(mine)) ? T3D_OK : T3D_ERR_NO_MEMORY)
                          : t3d__store_get(comm, key, (void **)&ids[p], &len);
    if (res != T3D_OK) break;
    host[p] = -1;
    for (int q = 0; q < p && host[p] < 0; q++) {
      if (strcmp(ids[q], ids[p]) == 0) host[p] = host[q];
    }
    if (host[p] < 0) host[p] = (*nhosts)++;
  }
  for (int p = 0; p < comm->size; p++) free(ids[p]);
  free(ids);
  return res;
}

/* Without UCX even a group of one takes the segment: its sends to itself need the segment's point-to-point. Fills
 * host[] and *nhosts (number_hosts) where it looked; *nhosts stays 0 where it did not. */
static t3d_result_t setup_shm(t3d_comm_t *comm, const char *want, int *host, int *nhosts) {
  if (strcmp(want, "ucx") == 0 || (comm->size == 1 && T3D_HAVE_UCX)) return T3D_OK;
  T3D_CHECK(number_hosts(comm, host, nhosts));
  int other = -1;
  for (int p = 0; p < comm->size && other < 0; p++) {
    if (host[p] != host[comm->rank]) other = p;
  }
  if (other < 0) {
    t3d__backoff_note_ranks(comm->size); /* first: the segment's waiters follow it */
    t3d_result_t res = t3d__shm_init(comm, &comm->shm);
    if (res == T3D_OK) res = t3d__shm_p2p_attach(comm, comm->shm, &comm->shm_p2p);
    if (res == T3D_OK && comm->shm_p2p != NULL) comm->p2p_driver = &t3d__provider_shm;
    if (!T3D_HAVE_UCX && res == T3D_OK && comm->shm_p2p == NULL) {
      res = no_ucx(comm, T3D_ERR_UNSUPPORTED,
                   t3d__param_int(T3D_PARAM_SHM_P2P) == 0
                       ? "point-to-point off the shared-memory segment (T3D_SHM_P2P=0)"
                       : "point-to-point off the shared-memory segment (T3D_SHM_P2P=0 on some rank, or a rank may "
                         "not read another's memory with process_vm_readv: seccomp, Yama ptrace_scope or users)");
    } else if (!T3D_HAVE_UCX && res != T3D_OK && res != T3D_ERR_TIMEOUT) { /* a timeout: a peer did not come */
      char why[sizeof comm->last_error];
      snprintf(why, sizeof why, "the shared-memory segment cannot be used: %.960s", t3d__thread_error());
      res = no_ucx(comm, res, why);
    }
    if (res != T3D_OK) {
      t3d__shm_fini(comm->shm);
      comm->shm = NULL;
    }
    return res;
  }
  if (!T3D_HAVE_UCX) {
    char why[96];
    snprintf(why, sizeof why, "rank %d is on another host than rank %d", other, comm->rank);
    return no_ucx(comm, T3D_ERR_UNSUPPORTED, why);
  }
  if (strcmp(want, "shm") == 0) {
    return t3d__set_error(comm, T3D_ERR_UNSUPPORTED,
                          "t3d_comm_init: T3D_TRANSPORT=shm but rank %d of group '%s' is on another host than rank %d",
                          other, comm->name, comm->rank);
  }
  return T3D_OK;
}

/* Across hosts with as many ranks on each (core/hier.c): the child communicator of this host's ranks. */
static t3d_result_t setup_hier(t3d_comm_t *comm, const int *host, int nhosts) {
  int local_rank = 0, local_size = 0;
  t3d_result_t res = T3D_OK;
  t3d_hier_t *h = t3d__hier_layout(comm, host, nhosts, &local_rank, &local_size, &res);
  if (h == NULL) return res;
  t3d_config_t c;
  t3d_config_init(&c);
  char name[64], prefix[300];
  snprintf(name, sizeof name, "%.50s/host", comm->name);
  snprintf(prefix, sizeof prefix, "%s/hier/host%d", comm->prefix, t3d__hier_host(h));
  c.name = name;
  c.key_prefix = prefix;
  c.timeout_ms = comm->timeout_ms;
  c.transport = "auto";
  t3d_comm_t *local = NULL;
  res = t3d_comm_init(&local, local_rank, local_size, &comm->store, &c);
  if (res != T3D_OK || local->shm == NULL) {
    if (res == T3D_OK) res = T3D_ERR_INTERNAL;
    t3d__set_error(comm, res, "t3d_comm_init: rank %d of group '%s' could not join the group of its host "
                   "(two-level collectives across hosts): %s", comm->rank, comm->name, t3d_thread_last_error());
    if (local != NULL) t3d_comm_destroy(local);
    t3d__hier_free(h);
    return res;
  }
  t3d__hier_attach(h, local);
  comm->hier = h;
  T3D_INFO("comm '%s' rank %d: two-level collectives, %d hosts x %d ranks (local rank %d)", comm->name, comm->rank,
           comm->size / local_size, local_size, local_rank);
  return T3D_OK;
}

static void free_hier(t3d_comm_t *comm) {
  if (comm->hier == NULL) return;
  t3d_comm_destroy(t3d__hier_local(comm->hier));
  t3d__hier_free(comm->hier);
  comm->hier = NULL;
}

static void comm_free(t3d_comm_t *comm) {
  free(comm->ring_scratch);
  pthread_mutex_destroy(&comm->mu);
  pthread_cond_destroy(&comm->cv);
  pthread_mutex_destroy(&comm->err_mu);
  free(comm);
}

t3d_result_t t3d_comm_init(t3d_comm_t **out, int rank, int size, const t3d_store_t *store, const t3d_config_t *cfg) {
  if (out == NULL) return T3D_ERR_INVALID_ARG;
  *out = NULL;
  if (size < 1 || size > 65535 || rank < 0 || rank >= size || store == NULL || store->set == NULL ||
      store->get == NULL) {
    T3D_WARN("t3d_comm_init: invalid argument: rank %d, size %d, store %p", rank, size, (const void *)store);
    return T3D_ERR_INVALID_ARG;
  }
  t3d_comm_t *comm = calloc(1, sizeof *comm);
  if (comm == NULL) return T3D_ERR_NO_MEMORY;
  pthread_mutex_init(&comm->mu, NULL);
  pthread_cond_init(&comm->cv, NULL);
  pthread_mutex_init(&comm->err_mu, NULL);
  comm->rank = rank;
  comm->size = size;
  comm->store = *store;
  t3d_config_t dflt;
  t3d_config_init(&dflt);
  if (cfg == NULL) cfg = &dflt;
  comm->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : t3d__param_int(T3D_PARAM_TIMEOUT_MS);
  snprintf(comm->name, sizeof comm->name, "%s", cfg->name ? cfg->name : "comm");
  snprintf(comm->prefix, sizeof comm->prefix, "%s", cfg->key_prefix ? cfg->key_prefix : "t3d");
  comm->inline_max = cfg->inline_bytes >= -1 ? cfg->inline_bytes : t3d__param_int(T3D_PARAM_INLINE_BYTES);
  if (comm->inline_max < -1) comm->inline_max = -1;
  int64_t wait_ns = t3d__param_int(T3D_PARAM_INLINE_WAIT_NS);
  comm->inline_wait_ns = wait_ns > 0 ? (uint64_t)wait_ns : 0;

  const char *want = cfg->transport ? cfg->transport : t3d__param_str(T3D_PARAM_TRANSPORT);
  snprintf(comm->transport, sizeof comm->transport, "%s", want);
  t3d_result_t res = pick_transport(comm, want);
  int nhosts = 0, *host = malloc(sizeof(int) * (size_t)size); /* each rank's host: setup_shm, then setup_hier */
  if (res == T3D_OK && host == NULL) res = T3D_ERR_NO_MEMORY;
  if (res == T3D_OK) res = comm->tp->init(comm, &comm->tp_state);
  if (res == T3D_OK) {
    res = setup_shm(comm, want, host, &nhosts);
    if (res != T3D_OK) comm->tp->fini(comm->tp_state);
  }
  /* Groups without the segment's own liveness (shm/sync.c) are watched over sockets. */
  if (res == T3D_OK && comm->shm == NULL && T3D_HAVE_UCX) {
    res = t3d__watch_join(comm);
    if (res != T3D_OK) comm->tp->fini(comm->tp_state);
  }
  /* Across hosts, over the default transport: a group of this host's ranks for the two-level collectives. */
  if (res == T3D_OK && comm->shm == NULL && nhosts > 1 && strcmp(want, "auto") == 0) {
    res = setup_hier(comm, host, nhosts);
    if (res != T3D_OK) {
      t3d__watch_leave(comm);
      comm->tp->fini(comm->tp_state);
    }
  }
  free(host);
  if (res == T3D_OK) {
    res = t3d__nccl_new(&comm->nccl);
    if (res == T3D_OK) {
      res = t3d__cudev_new(comm, &comm->cudev);
      if (res != T3D_OK) t3d__nccl_free(comm->nccl, 0);
    }
    if (res != T3D_OK) {
      free_hier(comm);
      t3d__watch_leave(comm);
      t3d__shm_p2p_free(comm->shm_p2p);
      t3d__shm_fini(comm->shm);
      comm->tp->fini(comm->tp_state);
    }
  }
  if (res == T3D_OK) t3d__providers_choose(comm);
  if (res == T3D_OK && pthread_create(&comm->thread, NULL, t3d__progress_main, comm) != 0) {
    res = t3d__set_error(comm, T3D_ERR_SYSTEM, "t3d_comm_init: cannot start the progress thread on rank %d", rank);
    free_hier(comm);
    t3d__watch_leave(comm);
    t3d__nccl_free(comm->nccl, 0);
    t3d__cudev_free(comm->cudev);
    t3d__shm_p2p_free(comm->shm_p2p);
    t3d__shm_fini(comm->shm);
    comm->tp->fini(comm->tp_state);
  }
  if (res != T3D_OK) {
    /* The caller has no communicator to ask, so the reason goes to the log as well. */
    T3D_WARN("%s", comm->last_error);
    comm_free(comm);
    return res;
  }
  comm->thread_started = 1;
  comm->owner = pthread_self();
  comm->owner_path = t3d__membarrier_ready();
  T3D_INFO("comm '%s' rank %d/%d up over %s%s", comm->name, rank, size, comm->tp->name,
           comm->shm ? " + shared memory" : "");
  *out = comm;
  return T3D_OK;
}

t3d_result_t t3d_comm_destroy(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  t3d__watch_leave(comm); /* first: its thread may be writing to comm */
  if (comm->thread_started) {
    pthread_mutex_lock(&comm->mu);
    comm->stop = 1;
    pthread_cond_signal(&comm->cv);
    pthread_mutex_unlock(&comm->mu);
    pthread_join(comm->thread, NULL);
  }
  t3d__nccl_free(comm->nccl, comm->timeout_ms);
  t3d__cudev_free(comm->cudev);
  free_hier(comm);
  t3d__shm_p2p_free(comm->shm_p2p);
  t3d__shm_fini(comm->shm);
  comm->tp->fini(comm->tp_state);
  comm_free(comm);
  return T3D_OK;
}

t3d_result_t t3d_comm_abort(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  int expected = 0;
  if (atomic_compare_exchange_strong(&comm->fatal, &expected, (int)T3D_ERR_ABORTED)) {
    snprintf(comm->fatal_msg, sizeof comm->fatal_msg, "t3d: group '%s' was aborted on rank %d", comm->name,
             comm->rank);
  }
  atomic_store(&comm->aborted, 1);
  if (comm->hier != NULL) t3d_comm_abort(t3d__hier_local(comm->hier));
  t3d__nccl_abort(comm->nccl);
  pthread_mutex_lock(&comm->mu);
  pthread_cond_signal(&comm->cv);
  pthread_mutex_unlock(&comm->mu);
  return T3D_OK;
}

int t3d_comm_rank(const t3d_comm_t *comm) { return comm ? comm->rank : -1; }
int t3d_comm_size(const t3d_comm_t *comm) { return comm ? comm->size : -1; }
t3d_result_t t3d_comm_status(t3d_comm_t *comm) {
  if (comm == NULL) return T3D_ERR_INVALID_ARG;
  t3d__nccl_poll_errors(comm);
  return (t3d_result_t)atomic_load(&comm->fatal);
}
const char *t3d_comm_transport(const t3d_comm_t *comm) {
  if (comm == NULL || comm->tp == NULL) return "";
  return comm->shm != NULL ? (T3D_HAVE_UCX ? "shm+ucx" : "shm") : comm->tp->name;
}

typedef struct {
  int key, rank;
} split_member_t;

static int member_cmp(const void *a, const void *b) {
  const split_member_t *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->rank < y->rank ? -1 : (x->rank > y->rank);
}

t3d_result_t t3d_comm_split(t3d_comm_t *parent, int color, int key, const t3d_config_t *cfg, t3d_comm_t **newcomm) {
  if (parent == NULL || newcomm == NULL) return T3D_ERR_INVALID_ARG;
  *newcomm = NULL;
  if (color < 0 && color != T3D_SPLIT_NOCOLOR) {
    return t3d__set_error(parent, T3D_ERR_INVALID_ARG,
                          "t3d_comm_split: invalid argument 'color' (%d) on rank %d of group '%s': must be >= 0 or "
                          "T3D_SPLIT_NOCOLOR", color, parent->rank, parent->name);
  }
  int n = parent->size;
  int mine[2] = {color, key};
  int *all = malloc(sizeof(int) * 2 * (size_t)n);
  split_member_t *members = malloc(sizeof *members * (size_t)n);
  if (all == NULL || members == NULL) {
    free(all);
    free(members);
    return T3D_ERR_NO_MEMORY;
  }
  t3d_request_t *r = NULL;
  t3d_result_t res = t3d_allgather(parent, mine, all, 2, T3D_INT32, NULL, &r);
  if (res == T3D_OK) {
    res = t3d_wait(r, -1);
    t3d_request_free(r);
  }
  pthread_mutex_lock(&parent->mu);
  int split_id = parent->split_count++;
  pthread_mutex_unlock(&parent->mu);
  int count = 0, newrank = -1;
  if (res == T3D_OK && color != T3D_SPLIT_NOCOLOR) {
    for (int p = 0; p < n; p++) {
      if (all[2 * p] == color) members[count++] = (split_member_t){all[2 * p + 1], p};
    }
    qsort(members, (size_t)count, sizeof *members, member_cmp);
    for (int i = 0; i < count; i++) {
      if (members[i].rank == parent->rank) newrank = i;
    }
    t3d_config_t c;
    t3d_config_init(&c);
    if (cfg != NULL) c = *cfg;
    if (c.timeout_ms <= 0) c.timeout_ms = parent->timeout_ms;
    if (c.name == NULL) c.name = "split";
    char prefix[300];
    snprintf(prefix, sizeof prefix, "%s/split%d/color%d", parent->prefix, split_id, color);
    c.key_prefix = prefix;
    if (c.transport == NULL) c.transport = parent->transport;
    if (c.inline_bytes < -1) c.inline_bytes = parent->inline_max;
    res = t3d_comm_init(newcomm, newrank, count, &parent->store, &c);
    if (res != T3D_OK) {
      t3d__set_error(parent, res, "t3d_comm_split: rank %d of group '%s' could not create its part (color %d): %s",
                     parent->rank, parent->name, color, t3d_thread_last_error());
    }
  } else if (res != T3D_OK) {
    t3d__set_error(parent, res, "t3d_comm_split: exchanging colors on group '%s' failed: %s", parent->name,
                   t3d_thread_last_error());
  }
  free(all);
  free(members);
  return res;
}
