/* engine.h: the engine's parts (core/), seen by each other and by the public API (coll.c). Providers never include
 * this header: they depend on the base, not on the engine. */
#ifndef T3D_ENGINE_H
#define T3D_ENGINE_H

#include "provider.h"

/* ---------- choosing a provider (select.c) ---------- */
/* The providers in the order they are tried (T3D_PROVIDERS, default "shm,cudev,nccl,hier,ucx"), NULL-terminated. */
const t3d_provider_t *const *t3d__providers(void);
/* Works out, once the communicator is set up, which provider runs each kind of operation on each kind of memory:
 * the first of that list that fits, or NULL (then nothing can run it). */
void t3d__providers_choose(t3d_comm_t *comm);
/* That answer for req: the first that fits, or the next one when the first has `takes` and declines req. */
static inline const t3d_provider_t *t3d__provider_for(t3d_comm_t *comm, const t3d_request_t *req) {
  int m = req->memtype == T3D_MEM_CUDA;
  const t3d_provider_t *p = comm->choice[req->kind][m];
  if (p != NULL && p->takes != NULL && !p->takes(comm, req)) p = comm->next_choice[req->kind][m];
  return p;
}
/* Whether an operation of req's kind is issued through its provider's post (point-to-point, and everything of a
 * provider without host collectives, i.e. NCCL) rather than run as a collective. */
static inline int t3d__is_posted(const t3d_request_t *req) {
  return !t3d__is_collective(req->kind) || (req->prov->coll == NULL && req->prov->run == NULL);
}

/* ---------- running a collective (run.c) ---------- */
void t3d__exec_init(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex);
/* The front end: complex as real pairs, half types through float32, PREMUL_SUM's scalar before and AVG's division
 * after, then the provider's collective. Finishes a started one (req->resume) through the provider's finish. */
t3d_result_t t3d__execute(t3d_exec_t *ex, t3d_request_t *req);
/* Writes a failed collective's error to the communicator; errors that leave peers out of step break it. */
void t3d__record_failure(t3d_comm_t *comm, t3d_exec_t *ex, t3d_result_t res);
/* How the thread that runs a collective holds the engine: not at all (a phase of another), by its busy state
 * (under mu), or through the owner's path (core/submit.c, without mu). t3d__release ends either hold. */
enum { T3D_HOLD_NONE = 0, T3D_HOLD_ENGINE = 1, T3D_HOLD_OWNER = 2 };
void t3d__release(t3d_comm_t *comm, int hold);
/* Adds one to a count that one writer at a time changes (enqueued: under mu; finished: the progress thread), without
 * a locked instruction; the owner's path reads both (core/submit.c). */
static inline void t3d__count_one(_Atomic uint64_t *c, memory_order order) {
  atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1, order);
}
/* Records the outcome of a collective and completes it. release (a T3D_HOLD_*): ended first, so that whoever sees
 * r done finds the engine idle. fresh: r finished on the caller's thread and was not handed out yet. */
void t3d__end_collective(t3d_comm_t *comm, t3d_request_t *r, t3d_exec_t *ex, t3d_result_t res, int release,
                         int fresh);
/* Runs a queued collective (or fails it at once on a broken communicator). */
void t3d__run_collective(t3d_comm_t *comm, t3d_request_t *r, int release);
/* Ends the engine's busy state; wakes the progress thread for requests queued meanwhile. */
void t3d__release_engine(t3d_comm_t *comm);

/* ---------- issuing (submit.c) ---------- */
/* Queues req (or holds it in the open group, or posts it through its provider) and hands the user's reference
 * back through out. */
t3d_result_t t3d__submit(t3d_comm_t *comm, t3d_request_t *req, t3d_request_t **out);
/* t3d__submit for a prepared request (base/request.c), which it owns from here (also req->arrays): a small
 * collective that finishes on the caller's thread without error hands out a shared done request and allocates
 * nothing; otherwise req is copied to the heap and goes on as with t3d__submit. */
t3d_result_t t3d__submit_prepared(t3d_comm_t *comm, t3d_request_t *req, t3d_request_t **out);
/* t3d_sendrecv's send s and receive r, prepared in the caller's frame: posted and polled to the end right there
 * when the shared-memory provider takes both, else copied to the heap and run as a group, waited on. Returns the
 * first error (written to the communicator), and the receive's count through received (may be NULL). */
t3d_result_t t3d__submit_pair(t3d_comm_t *comm, t3d_request_t *s, t3d_request_t *r, size_t *received);
/* Appends req to the progress thread's queue. */
void t3d__enqueue(t3d_comm_t *comm, t3d_request_t *req);

/* ---------- two levels across hosts (hier.c) ---------- */
/* On a communicator without a segment whose hosts hold two or more ranks each, as many on every host (host[p]: rank
 * p's host, of nhosts, as comm.c numbered them): the layout (lanes) and this rank's place in its host (local_rank of
 * local_size); NULL otherwise, or with T3D_HIER=0, or on error (*res). comm.c then makes the child communicator of
 * this host's ranks and attaches it. */
t3d_hier_t *t3d__hier_layout(const t3d_comm_t *comm, const int *host, int nhosts, int *local_rank, int *local_size,
                             t3d_result_t *res);
int t3d__hier_host(const t3d_hier_t *h); /* this rank's host, numbered by their lowest ranks */
void t3d__hier_attach(t3d_hier_t *h, t3d_comm_t *local);
t3d_comm_t *t3d__hier_local(const t3d_hier_t *h);
/* Frees the layout (not the child: comm.c destroys it). */
void t3d__hier_free(t3d_hier_t *h);

/* ---------- the progress thread (progress.c) ---------- */
void *t3d__progress_main(void *comm);

#endif /* T3D_ENGINE_H */
